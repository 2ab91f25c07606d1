"""The one-transaction pattern on the caller's connection.

    with idem_pg.atomic(conn, "order-42", "sku=A&qty=1") as tx:
        if not tx.claimed:
            return tx.outcome, tx.response       # REPLAYED / CONFLICT / IN_FLIGHT / EXPIRED
        conn.execute("UPDATE stock SET qty = qty - 1 WHERE sku = 'A'")
        tx.complete(201, b'{"order":42}')

The claim, the business writes and the stored response commit together
(``conn.transaction()``: a transaction, or a savepoint inside the caller's
one).  An exception in the block rolls all of it back and the key is free
again; a claim left without ``complete()`` is rolled back too and raises
ClaimNotCompleted.  A concurrent retry waits for this transaction, then
replays.  With ``wait_for``, a retry that finds a committed claim in
flight (a Guard's, outside any transaction of this kind) waits for its
answer too, up to wait_for.

With ``retries=N`` the block is a loop of attempts, each a new
transaction, run again after a serialization failure (40001) or a
deadlock (40P01):

    for attempt in idem_pg.atomic(conn, "order-42", "sku=A&qty=1", retries=3):
        with attempt as tx:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Optional, cast

import psycopg

from ._batch import Batch, as_items, finish_many_query
from ._common import (RESTORE, SET_BOUNDS, BeginRow, Outcome, Response, Result, Seconds,
                      Statements, as_response, bounds, check_wait, interval, ms, saved_bounds, seconds,
                      statements, wait_seconds)
from ._drivers import driver_errors, driver_of
from .errors import ClaimNotCompleted, not_found, retry_transaction, translate

_SET_BOUNDS, _RESTORE, _bounds, _ms = SET_BOUNDS, RESTORE, bounds, ms

# The backoff between two attempts of atomic(..., retries=N), in seconds:
# a random time from 0 to RETRY_BASE doubled for each retry, at most
# RETRY_CAP ("full jitter").
RETRY_BASE = 0.01
RETRY_CAP = 1.0


def _error(exc: BaseException, function: str, st: Statements) -> BaseException:
    return not_found(translate(exc), function, st.schema)


class Atomic:
    """The claim inside the caller's transaction."""

    def __init__(self, conn, st: Statements, key: str, fingerprint: str,
                 scope: str, retention: Seconds, timeout: Seconds = None):
        self.conn = conn
        self.timeout = seconds(timeout)
        self._sql = st
        self.key = key
        self.fingerprint = fingerprint
        self.scope = scope
        self.retention = retention
        self.row: Optional[BeginRow] = None
        self.completed = False
        self.expires_at = None

    @property
    def _row(self) -> BeginRow:
        # Set by the claim before the transaction is handed out.
        return cast(BeginRow, self.row)

    @property
    def outcome(self) -> Outcome:
        return self._row.outcome()

    @property
    def claimed(self) -> bool:
        return self._row.claimed

    @property
    def token(self) -> Optional[int]:
        return self._row.token

    @property
    def response(self) -> Optional[Response]:
        """The stored response when REPLAYED."""
        return self._row.response()

    @property
    def status(self) -> Optional[int]:
        """EXPIRED: the status the first response had (its body is gone)."""
        return self._row.status if self.outcome is Outcome.EXPIRED else None

    def _complete_args(self, status: int, body: Any, retention: Seconds):
        """idem_complete's statement and parameters."""
        if not self.claimed:
            raise ClaimNotCompleted("complete() without a claim (outcome %s)" % self.outcome)
        resp = Response(status, body)
        retention = self.retention if retention is None else retention
        if retention is None and self.scope == "":
            return self._sql.complete_defaults, [self.key, self.fingerprint, resp.status,
                                                 resp.body]
        return self._sql.complete, [self.key, self.fingerprint, resp.status, resp.body, None,
                                    interval(retention), self.scope]

    def complete(self, status: int, body: Any = b"", *, retention: Seconds = None):
        """Store the response in this transaction; returns expires_at.
        With the block's ``timeout``, the statement runs under it."""
        query, args = self._complete_args(status, body, retention)
        bounds = _bounds(None, self.timeout)
        try:
            with self.conn.cursor(binary=True) as cur:
                if bounds is not None:
                    cur.execute(_SET_BOUNDS, bounds)
                    prev = saved_bounds(cur.fetchone())
                cur.execute(query, args)
                self.expires_at = cur.fetchone()[0]
                if bounds is not None:
                    cur.execute(_RESTORE, prev)
        except psycopg.Error as exc:
            raise _error(exc, "idem_complete", self._sql) from exc
        self.completed = True
        return self.expires_at


class AsyncAtomic(Atomic):
    """The claim inside the caller's transaction, on a psycopg
    AsyncConnection or an asyncpg connection (idem_pg._drivers)."""

    async def complete(self, status: int, body: Any = b"", *,  # type: ignore[override]
                       retention: Seconds = None):
        query, args = self._complete_args(status, body, retention)
        bounds = _bounds(None, self.timeout)
        conn, drv = self.conn, driver_of(self.conn)
        try:
            if bounds is not None:
                prev = saved_bounds(await drv.fetchrow(conn, _SET_BOUNDS, bounds))
            self.expires_at = cast(tuple, await drv.fetchrow(conn, query, args))[0]
            if bounds is not None:
                await drv.fetchrow(conn, _RESTORE, prev)
        except driver_errors() as exc:
            raise _error(exc, "idem_complete", self._sql) from exc
        self.completed = True
        return self.expires_at


def _begin(st: Statements, key: str, fingerprint: str, lease: Seconds,
           retention: Seconds, scope: str, wait: bool, lock_timeout: Seconds,
           wait_for: Seconds, timeout: Seconds, remember: Seconds = None):
    """The claim statement, its parameters and the bounds to set for it
    (None: leave the session's).  A wait for the holder's answer ends at
    wait_for on the server, so lock_timeout and timeout (statement_timeout)
    are counted on top of it."""
    check_wait(wait, wait_for)
    w = wait_seconds(wait_for) or 0.0
    bounds = _bounds(None if lock_timeout is None else cast(float, seconds(lock_timeout)) + w,
                     None if timeout is None else cast(float, seconds(timeout)) + w)
    r = interval(remember)          # sent (as remember =>) only when set
    if lease is None and retention is None and scope == "" and wait is True and not w:
        if r is None:
            return st.begin_atomic_defaults, [key, fingerprint], bounds
        return st.with_remember(st.begin_atomic_defaults, r), [key, fingerprint, r], bounds
    params = [key, fingerprint, interval(lease), interval(retention), scope, wait]
    if w:
        params.append(interval(w))
    if r is not None:
        params.append(r)
    return st.with_remember(st.begin_wait_atomic if w else st.begin_atomic, r), params, bounds


class _Retries:
    """The attempts of one atomic(..., retries=N) loop: whether an error
    runs the block again, and after how long."""

    def __init__(self, retries: int, timeout: Seconds):
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError("retries must be an int, 0 or more, got %r" % (retries,))
        self.retries = retries
        self.budget = seconds(timeout)
        self.start = 0.0
        self.number = 0          # of the attempt running or last run
        self.delay: Optional[float] = None   # before the next attempt; None: no next one

    def begin(self) -> None:
        if self.number == 0:
            self.start = time.monotonic()
        self.number += 1
        self.delay = None

    def again(self, exc: BaseException, conn: Any, fresh: bool) -> bool:
        """True to swallow ``exc`` and run the block again: a 40001 or
        40P01 in a transaction this attempt opened (rolled back: the
        connection is idle again), retries left, and, with a timeout, the
        next attempt starting within it of the first."""
        drv = driver_of(conn)
        if (self.number > self.retries or not fresh or not retry_transaction(exc)
                or drv.closed(conn) or not drv.idle(conn)):
            return False
        delay = random.uniform(0.0, min(RETRY_CAP, RETRY_BASE * 2 ** (self.number - 1)))
        if self.budget is not None and time.monotonic() + delay - self.start > self.budget:
            return False
        self.delay = delay
        return True


class Attempt:
    """One transaction of ``for attempt in atomic(..., retries=N)``: enter
    it with ``with attempt as tx``.  ``number`` counts from 1."""

    def __init__(self, open_: Callable[[], Any], conn: Any, retries: _Retries):
        self._open = open_
        self._conn = conn
        self._retries = retries
        self._cm: Any = None
        self._fresh = False
        self.number = retries.number + 1

    def _enter(self) -> Any:
        if self._cm is not None:
            raise RuntimeError("an attempt of atomic() can be entered once")
        self._fresh = driver_of(self._conn).idle(self._conn)
        self._retries.begin()
        self._cm = self._open()
        return self._cm

    def _again(self, exc: BaseException) -> bool:
        return self._retries.again(exc, self._conn, self._fresh)

    def __enter__(self) -> Atomic:
        return self._enter().__enter__()

    def __exit__(self, typ, exc, tb) -> bool:
        try:
            if self._cm.__exit__(typ, exc, tb):
                return True
        except BaseException as err:  # the COMMIT's, or raised in place of exc
            if not self._again(err):
                raise
            return True
        return exc is not None and self._again(exc)


class AsyncAttempt(Attempt):
    """One transaction of ``async for attempt in atomic_async(..., retries=N)``:
    enter it with ``async with attempt as tx``."""

    async def __aenter__(self) -> AsyncAtomic:
        return await self._enter().__aenter__()

    async def __aexit__(self, typ, exc, tb) -> bool:
        try:
            if await self._cm.__aexit__(typ, exc, tb):
                return True
        except BaseException as err:
            if not self._again(err):
                raise
            return True
        return exc is not None and self._again(exc)


def _unentered(attempt: Attempt) -> None:
    if attempt._cm is None:
        raise RuntimeError("each attempt of atomic() must be entered: "
                           "for attempt in atomic(...): with attempt as tx: ...")


_LOOP_ONLY = ("atomic(..., retries=N) runs the block again only as a loop: "
              "for attempt in atomic(...): with attempt as tx: ...")


class AtomicBlock:
    """What atomic() returns: ``with`` it for one transaction, or loop over
    it for attempts (see atomic())."""

    def __init__(self, conn: Any, open_: Callable[[], Any], retries: int, timeout: Seconds):
        self._conn = conn
        self._open = open_
        self._retries = _Retries(retries, timeout)
        self._cm: Any = None

    def __enter__(self) -> Atomic:
        if self._retries.retries:
            raise TypeError(_LOOP_ONLY)
        self._cm = self._open()
        return self._cm.__enter__()

    def __exit__(self, typ, exc, tb) -> bool:
        return self._cm.__exit__(typ, exc, tb)

    def __iter__(self) -> Iterator[Attempt]:
        while True:
            attempt = Attempt(self._open, self._conn, self._retries)
            yield attempt
            _unentered(attempt)
            if self._retries.delay is None:
                return
            time.sleep(self._retries.delay)


class AsyncAtomicBlock(AtomicBlock):
    """What atomic_async() returns: ``async with`` it, or ``async for``."""

    async def __aenter__(self) -> AsyncAtomic:
        if self._retries.retries:
            raise TypeError(_LOOP_ONLY.replace("for attempt", "async for attempt")
                            .replace("with attempt", "async with attempt"))
        self._cm = self._open()
        return await self._cm.__aenter__()

    async def __aexit__(self, typ, exc, tb) -> bool:
        return await self._cm.__aexit__(typ, exc, tb)

    async def __aiter__(self) -> AsyncIterator[AsyncAttempt]:
        while True:
            attempt = AsyncAttempt(self._open, self._conn, self._retries)
            yield attempt
            _unentered(attempt)
            if self._retries.delay is None:
                return
            await asyncio.sleep(self._retries.delay)


def atomic(conn: psycopg.Connection, key: str, fingerprint: str, *,
           schema: str = "public", lease: Seconds = None, retention: Seconds = None,
           scope: str = "", wait: bool = True, lock_timeout: Seconds = None,
           wait_for: Seconds = None, timeout: Seconds = None,
           retries: int = 0, remember: Seconds = None) -> AtomicBlock:
    """Claim ``key`` in a transaction on ``conn`` (see the module doc).
    ``lock_timeout`` bounds the wait for another transaction holding the
    key (Timeout, 55P03), and is restored after the claim; with
    ``wait_for`` (seconds) the claim is given lock_timeout + wait_for.
    ``timeout`` is a statement_timeout for the claim (+ wait_for) and for
    complete(), also restored after each: the block's own statements run
    under the session's.  Without it, the session's statement_timeout
    still ends any wait (Timeout).

    ``retries``: run the transaction again, up to that many more times,
    when it fails with a serialization failure (40001) or a deadlock
    (40P01), as a loop of attempts::

        for attempt in atomic(conn, key, fingerprint, retries=3):
            with attempt as tx:
                ...                      # the block, as with `with atomic(...)`

    Each attempt is a new transaction: the claim runs again (the failed
    attempt's was rolled back with its writes; a retry may now replay what
    another caller stored).  The error may come from the block, the claim,
    complete() or the COMMIT (PostgreSQL rolls a transaction back when it
    answers COMMIT with either); any other error, or one without a
    SQLSTATE (a lost connection: the COMMIT's result is unknown), ends the
    loop at once, as does the last attempt's error.  Only a transaction
    that atomic() opens is retried: inside the caller's transaction (a
    savepoint) the error surfaces, since the whole transaction must run
    again.  Between attempts the loop sleeps a random time from 0 to 10
    ms, doubled for each retry, at most 1 s; with ``timeout``, no attempt
    starts later than ``timeout`` seconds after the first began.  The block
    must be safe to run again: its only effects must be its statements on
    ``conn``, which the rollback undoes.  ``with atomic(..., retries=N)``
    with N > 0 raises TypeError: a ``with`` block cannot run twice.

    ``remember`` (a server with tombstones): idem_begin's remember, sent
    only when set; a key it still remembers after its response's retention
    gives the outcome EXPIRED (``tx.claimed`` false, ``tx.response`` None,
    ``tx.status`` the first response's status)."""
    st = statements(schema)
    query, params, bounds = _begin(st, key, fingerprint, lease, retention, scope, wait,
                                   lock_timeout, wait_for, timeout, remember)
    return AtomicBlock(conn, lambda: _claim(conn, st, key, fingerprint, scope, retention,
                                            timeout, query, params, bounds),
                       retries, timeout)


@contextlib.contextmanager
def _claim(conn: psycopg.Connection, st: Statements, key: str, fingerprint: str, scope: str,
           retention: Seconds, timeout: Seconds, query: Any, params: Any,
           bounds: Any) -> Iterator[Atomic]:
    """One transaction of atomic()."""
    with conn.transaction():
        tx = Atomic(conn, st, key, fingerprint, scope, retention, timeout)
        try:
            # Results in binary: timestamps, bytea and integers do not
            # depend on the session's DateStyle, TimeZone or bytea_output.
            with conn.cursor(binary=True) as cur:
                prev = None
                if bounds is not None:
                    cur.execute(_SET_BOUNDS, bounds)
                    prev = saved_bounds(cur.fetchone())
                cur.execute(query, params)
                tx.row = BeginRow.of(cur.fetchone())
                tx.row.outcome()        # a state this client does not know: Unavailable
                if prev is not None:
                    cur.execute(_RESTORE, prev)
        except psycopg.Error as exc:
            raise _error(exc, "idem_begin", st) from exc
        yield tx
        if tx.claimed and not tx.completed:
            raise ClaimNotCompleted("the block claimed %r but did not call complete(): "
                                    "rolled back" % key)


def atomic_async(conn: Any, key: str, fingerprint: str, *,
                 schema: str = "public", lease: Seconds = None,
                 retention: Seconds = None, scope: str = "", wait: bool = True,
                 lock_timeout: Seconds = None, wait_for: Seconds = None,
                 timeout: Seconds = None, retries: int = 0,
                 remember: Seconds = None) -> AsyncAtomicBlock:
    """asyncio version of atomic(), on a psycopg ``AsyncConnection`` or an
    asyncpg ``Connection`` (a pool's included).  If the task is cancelled
    while the claim waits, the wait is cancelled on the server and ``conn``
    is closed (its transaction rolls back).
    ``retries`` as in atomic(), with ``async for attempt in
    atomic_async(...): async with attempt as tx: ...``."""
    st = statements(schema)
    query, params, bounds = _begin(st, key, fingerprint, lease, retention, scope, wait,
                                   lock_timeout, wait_for, timeout, remember)
    return AsyncAtomicBlock(conn, lambda: _claim_async(conn, st, key, fingerprint, scope,
                                                       retention, timeout, query, params,
                                                       bounds),
                            retries, timeout)


@contextlib.asynccontextmanager
async def _claim_async(conn: Any, st: Statements, key: str,
                       fingerprint: str, scope: str, retention: Seconds, timeout: Seconds,
                       query: Any, params: Any, bounds: Any) -> AsyncIterator[AsyncAtomic]:
    """One transaction of atomic_async()."""
    drv = driver_of(conn)
    async with drv.transaction(conn):
        tx = AsyncAtomic(conn, st, key, fingerprint, scope, retention, timeout)
        try:
            prev = None
            if bounds is not None:
                prev = saved_bounds(await drv.fetchrow(conn, _SET_BOUNDS, bounds))
            tx.row = BeginRow.of(await drv.fetchrow(conn, query, params))
            tx.row.outcome()        # a state this client does not know: Unavailable
            if prev is not None:
                await drv.fetchrow(conn, _RESTORE, prev)
        except asyncio.CancelledError:
            await asyncio.shield(drv.abort(conn))
            raise
        except driver_errors() as exc:
            raise _error(exc, "idem_begin", st) from exc
        yield tx
        if tx.claimed and not tx.completed:
            raise ClaimNotCompleted("the block claimed %r but did not call complete(): "
                                    "rolled back" % key)


# -- batches -------------------------------------------------------------------------


def _many(conn: Any, items: Any, schema: str, lease: Seconds, retention: Seconds,
          scope: str, wait: bool, lock_timeout: Seconds, wait_for: Seconds,
          timeout: Seconds, remember: Seconds, holder: Optional[str]):
    """The Batch of atomic_many and the bounds of its claim and its store."""
    check_wait(wait, wait_for)
    st = statements(schema)
    b = Batch(st, as_items(items), lease=lease, retention=retention, scope=scope,
              wait=wait, wait_for=wait_for, remember=remember, holder=holder)
    w = b.wait_for or 0.0
    claim_bounds = _bounds(None if lock_timeout is None else cast(float, seconds(lock_timeout)) + w,
                           None if timeout is None else cast(float, seconds(timeout)) + w)
    return st, b, claim_bounds, _bounds(None, seconds(timeout))


def _bounded(cur: Any, bounds: Any, query: str, params: Any) -> Any:
    """One statement under ``bounds`` (restored after it); its row."""
    prev = None
    if bounds is not None:
        cur.execute(_SET_BOUNDS, bounds)
        prev = saved_bounds(cur.fetchone())
    cur.execute(query, params)
    row = cur.fetchone()
    if prev is not None:
        cur.execute(_RESTORE, prev)
    return row


def atomic_many(conn: psycopg.Connection, items: Any, handler: Callable[[int], Any], *,
                schema: str = "public", lease: Seconds = None, retention: Seconds = None,
                scope: str = "", wait: bool = True, lock_timeout: Seconds = None,
                wait_for: Seconds = None, timeout: Seconds = None, retries: int = 0,
                remember: Seconds = None, holder: Optional[str] = None,
                _before_store: Optional[Callable[[], Any]] = None) -> "list[Result]":
    """A batch in one transaction on ``conn`` with the handlers' writes:
    one Result per item of ``items`` ((key, fingerprint) pairs), in input
    order.

    One idem_begin_many call claims every key (the keys locked in the
    server's order: two overlapping batches never deadlock); then, for
    each claimed item in input order, ``handler(i)`` runs inside a
    savepoint of its own and returns its Response (or (status, body));
    one statement stores the responses (idem_complete_many) and releases
    the claims of the items whose handler raised, and the transaction
    commits (``conn.transaction()``: inside the caller's transaction, a
    savepoint, and the caller commits).  A handler that raises rolls back
    its own savepoint only: its writes are undone, its item is EXECUTED
    with ``error`` and failed_step "handler" and its key is free again;
    the other items commit.  Items not claimed answer REPLAYED, CONFLICT,
    IN_FLIGHT (after waiting up to ``wait_for``, one deadline for the
    batch), EXPIRED; a key repeated in the batch runs once and its later
    occurrences get a copy of its Result (``duplicate_of``).  An error of
    the claim, the store or the COMMIT raises (the whole batch rolled
    back: nothing ran for good), after ``retries`` as in atomic().
    ``lock_timeout`` and ``timeout`` bound the claim (+ wait_for) and the
    store as in atomic()."""
    st, b, claim_bounds, store_bounds = _many(conn, items, schema, lease, retention, scope,
                                              wait, lock_timeout, wait_for, timeout,
                                              remember, holder)
    if not b.items:
        return []
    tries = _Retries(retries, timeout)
    while True:
        fresh = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        tries.begin()
        try:
            return _atomic_many_once(conn, st, b, handler, claim_bounds, store_bounds,
                                     _before_store)
        except BaseException as exc:
            if not tries.again(exc, conn, fresh):
                raise
        time.sleep(cast(float, tries.delay))


def _atomic_many_once(conn: psycopg.Connection, st: Statements, b: Batch,
                      handler: Callable[[int], Any], claim_bounds: Any, store_bounds: Any,
                      before_store: Optional[Callable[[], Any]]) -> "list[Result]":
    b.answers, b.failed, b.kept = {}, {}, set()
    with conn.transaction():
        try:
            with conn.cursor(binary=True) as cur:
                todo = b.start(_bounded(cur, claim_bounds, b.begin_query, b.begin_params))
        except psycopg.Error as exc:
            raise _error(exc, "idem_begin_many", st) from exc
        for i in todo:
            try:
                with conn.transaction():
                    resp = as_response(handler(i))
            except Exception as exc:  # noqa: BLE001 - this item only
                b.raised(i, exc)
                continue
            b.answered(i, resp)
        if before_store is not None:
            before_store()
        if b.to_finish():
            try:
                with conn.cursor(binary=True) as cur:
                    b.finished(_bounded(cur, store_bounds, finish_many_query(st),
                                        b.finish_params()))
            except psycopg.Error as exc:
                raise _error(exc, "idem_complete_many", st) from exc
    return b.done()


def atomic_many_async(conn: Any, items: Any, handler: Callable[[int], Awaitable[Any]], *,
                      schema: str = "public", lease: Seconds = None,
                      retention: Seconds = None, scope: str = "", wait: bool = True,
                      lock_timeout: Seconds = None, wait_for: Seconds = None,
                      timeout: Seconds = None, retries: int = 0, remember: Seconds = None,
                      holder: Optional[str] = None,
                      _before_store: Optional[Callable[[], Any]] = None
                      ) -> "Awaitable[list[Result]]":
    """asyncio version of atomic_many(), on a psycopg ``AsyncConnection``
    or an asyncpg ``Connection``, with ``await handler(i)``.  If the task
    is cancelled while a statement runs, it is cancelled on the server and
    ``conn`` closed (its transaction rolls back)."""
    st, b, claim_bounds, store_bounds = _many(conn, items, schema, lease, retention, scope,
                                              wait, lock_timeout, wait_for, timeout,
                                              remember, holder)
    return _atomic_many_async(conn, st, b, handler, claim_bounds, store_bounds,
                              _Retries(retries, timeout), _before_store)


async def _atomic_many_async(conn: Any, st: Statements, b: Batch,
                             handler: Callable[[int], Awaitable[Any]], claim_bounds: Any,
                             store_bounds: Any, tries: _Retries,
                             before_store: Optional[Callable[[], Any]]) -> "list[Result]":
    if not b.items:
        return []
    drv = driver_of(conn)
    while True:
        fresh = drv.idle(conn)
        tries.begin()
        try:
            return await _atomic_many_async_once(conn, drv, st, b, handler, claim_bounds,
                                                 store_bounds, before_store)
        except asyncio.CancelledError:
            await asyncio.shield(drv.abort(conn))
            raise
        except BaseException as exc:
            if not tries.again(exc, conn, fresh):
                raise
        await asyncio.sleep(cast(float, tries.delay))


async def _fetch_bounded(drv: Any, conn: Any, bounds: Any, query: str, params: Any) -> Any:
    prev = None
    if bounds is not None:
        prev = saved_bounds(await drv.fetchrow(conn, _SET_BOUNDS, bounds))
    row = await drv.fetchrow(conn, query, params)
    if prev is not None:
        await drv.fetchrow(conn, _RESTORE, prev)
    return row


async def _atomic_many_async_once(conn: Any, drv: Any, st: Statements, b: Batch,
                                  handler: Callable[[int], Awaitable[Any]], claim_bounds: Any,
                                  store_bounds: Any,
                                  before_store: Optional[Callable[[], Any]]) -> "list[Result]":
    b.answers, b.failed, b.kept = {}, {}, set()
    async with drv.transaction(conn):
        try:
            todo = b.start(await _fetch_bounded(drv, conn, claim_bounds, b.begin_query,
                                                b.begin_params))
        except driver_errors() as exc:
            raise _error(exc, "idem_begin_many", st) from exc
        for i in todo:
            try:
                async with drv.transaction(conn):
                    resp = as_response(await handler(i))
            except Exception as exc:  # noqa: BLE001 - this item only
                b.raised(i, exc)
                continue
            b.answered(i, resp)
        if before_store is not None:
            got = before_store()
            if inspect.isawaitable(got):
                await got
        if b.to_finish():
            try:
                b.finished(await _fetch_bounded(drv, conn, store_bounds, finish_many_query(st),
                                                b.finish_params()))
            except driver_errors() as exc:
                raise _error(exc, "idem_complete_many", st) from exc
    return b.done()
