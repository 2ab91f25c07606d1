"""The one-transaction pattern on the caller's connection.

    with idem_pg.atomic(conn, "order-42", "sku=A&qty=1") as tx:
        if not tx.claimed:
            return tx.outcome, tx.response       # REPLAYED / CONFLICT / IN_FLIGHT
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
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator, Optional, Sequence, cast

import psycopg

from ._common import (RESTORE, SET_BOUNDS, BeginRow, Outcome, Response, Seconds,
                      Statements, bounds, check_wait, interval, ms, seconds, wait_seconds)
from .aio import abort_statement
from .errors import ClaimNotCompleted, not_found, translate

_SET_BOUNDS, _RESTORE, _bounds, _ms = SET_BOUNDS, RESTORE, bounds, ms


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

    def _complete_args(self, status: int, body: Any, retention: Seconds):
        if not self.claimed:
            raise ClaimNotCompleted("complete() without a claim (outcome %s)" % self.outcome)
        resp = Response(status, body)
        return [self.key, self.fingerprint, resp.status, resp.body, None,
                interval(self.retention if retention is None else retention), self.scope]

    def complete(self, status: int, body: Any = b"", *, retention: Seconds = None):
        """Store the response in this transaction; returns expires_at.
        With the block's ``timeout``, the statement runs under it."""
        args = self._complete_args(status, body, retention)
        bounds = _bounds(None, self.timeout)
        try:
            with self.conn.cursor() as cur:
                if bounds is not None:
                    cur.execute(_SET_BOUNDS, bounds)
                    prev = cast(Sequence[Any], cur.fetchone())[:2]
                cur.execute(self._sql.complete, args)
                self.expires_at = cur.fetchone()[0]
                if bounds is not None:
                    cur.execute(_RESTORE, prev)
        except psycopg.Error as exc:
            raise _error(exc, "idem_complete", self._sql) from exc
        self.completed = True
        return self.expires_at


class AsyncAtomic(Atomic):
    async def complete(self, status: int, body: Any = b"", *,  # type: ignore[override]
                       retention: Seconds = None):
        args = self._complete_args(status, body, retention)
        bounds = _bounds(None, self.timeout)
        try:
            async with self.conn.cursor() as cur:
                if bounds is not None:
                    await cur.execute(_SET_BOUNDS, bounds)
                    prev = cast(Sequence[Any], await cur.fetchone())[:2]
                await cur.execute(self._sql.complete, args)
                self.expires_at = (await cur.fetchone())[0]
                if bounds is not None:
                    await cur.execute(_RESTORE, prev)
        except psycopg.Error as exc:
            raise _error(exc, "idem_complete", self._sql) from exc
        self.completed = True
        return self.expires_at


def _begin(st: Statements, key: str, fingerprint: str, lease: Seconds,
           retention: Seconds, scope: str, wait: bool, lock_timeout: Seconds,
           wait_for: Seconds, timeout: Seconds):
    """The claim statement, its parameters and the bounds to set for it
    (None: leave the session's).  A wait for the holder's answer ends at
    wait_for on the server, so lock_timeout and timeout (statement_timeout)
    are counted on top of it."""
    check_wait(wait, wait_for)
    w = wait_seconds(wait_for) or 0.0
    params = [key, fingerprint, interval(lease), interval(retention), scope, wait]
    bounds = _bounds(None if lock_timeout is None else cast(float, seconds(lock_timeout)) + w,
                     None if timeout is None else cast(float, seconds(timeout)) + w)
    if w:
        return st.begin_wait, params + [interval(w)], bounds
    return st.begin, params, bounds


@contextlib.contextmanager
def atomic(conn: psycopg.Connection, key: str, fingerprint: str, *,
           schema: str = "public", lease: Seconds = None, retention: Seconds = None,
           scope: str = "", wait: bool = True, lock_timeout: Seconds = None,
           wait_for: Seconds = None, timeout: Seconds = None) -> Iterator[Atomic]:
    """Claim ``key`` in a transaction on ``conn`` (see the module doc).
    ``lock_timeout`` bounds the wait for another transaction holding the
    key (Timeout, 55P03), and is restored after the claim; with
    ``wait_for`` (seconds) the claim is given lock_timeout + wait_for.
    ``timeout`` is a statement_timeout for the claim (+ wait_for) and for
    complete(), also restored after each: the block's own statements run
    under the session's.  Without it, the session's statement_timeout
    still ends any wait (Timeout)."""
    st = Statements(schema)
    query, params, bounds = _begin(st, key, fingerprint, lease, retention, scope, wait,
                                   lock_timeout, wait_for, timeout)
    with conn.transaction():
        tx = Atomic(conn, st, key, fingerprint, scope, retention, timeout)
        try:
            with conn.cursor() as cur:
                prev = None
                if bounds is not None:
                    cur.execute(_SET_BOUNDS, bounds)
                    prev = cast(Sequence[Any], cur.fetchone())[:2]
                cur.execute(query, params)
                tx.row = BeginRow.of(cur.fetchone())
                if prev is not None:
                    cur.execute(_RESTORE, prev)
        except psycopg.Error as exc:
            raise _error(exc, "idem_begin", st) from exc
        yield tx
        if tx.claimed and not tx.completed:
            raise ClaimNotCompleted("the block claimed %r but did not call complete(): "
                                    "rolled back" % key)


@contextlib.asynccontextmanager
async def atomic_async(conn: psycopg.AsyncConnection, key: str, fingerprint: str, *,
                       schema: str = "public", lease: Seconds = None,
                       retention: Seconds = None, scope: str = "", wait: bool = True,
                       lock_timeout: Seconds = None, wait_for: Seconds = None,
                       timeout: Seconds = None) -> AsyncIterator[AsyncAtomic]:
    """asyncio version of atomic().  If the task is cancelled while the
    claim waits, the wait is cancelled on the server and ``conn`` is closed
    (its transaction rolls back): psycopg cannot resume the statement."""
    st = Statements(schema)
    query, params, bounds = _begin(st, key, fingerprint, lease, retention, scope, wait,
                                   lock_timeout, wait_for, timeout)
    async with conn.transaction():
        tx = AsyncAtomic(conn, st, key, fingerprint, scope, retention, timeout)
        try:
            async with conn.cursor() as cur:
                prev = None
                if bounds is not None:
                    await cur.execute(_SET_BOUNDS, bounds)
                    prev = cast(Sequence[Any], await cur.fetchone())[:2]
                await cur.execute(query, params)
                tx.row = BeginRow.of(await cur.fetchone())
                if prev is not None:
                    await cur.execute(_RESTORE, prev)
        except asyncio.CancelledError:
            await asyncio.shield(abort_statement(conn))
            raise
        except psycopg.Error as exc:
            raise _error(exc, "idem_begin", st) from exc
        yield tx
        if tx.claimed and not tx.completed:
            raise ClaimNotCompleted("the block claimed %r but did not call complete(): "
                                    "rolled back" % key)
