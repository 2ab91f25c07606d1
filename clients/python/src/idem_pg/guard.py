"""The synchronous guard: claim, run the handler, store the response.

Every server call runs in its own transaction on a connection found idle,
committed before the call returns, so a claim commits on its own whatever
the connection's autocommit setting: a concurrent retry sees it in flight
instead of waiting for a transaction nobody ends.  With ``timeout`` set,
each call runs under ``SET LOCAL statement_timeout``, sent with its BEGIN
in one message, and, as a backstop, a cancel request is sent if the
server has not answered shortly after (one watchdog thread for every
call), so a wait given up on the client is given up on the server too.
Without a timeout, on an autocommit connection, the statement runs alone.
A begin with ``wait_for`` gets wait_for on top of ``timeout``: the server
ends its wait for the holder's answer at wait_for, the call's
statement_timeout at wait_for + timeout, and the client's cancel a little
after that.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional, cast

import psycopg
from psycopg import pq

from ._common import (NOT_STORED, RESTORE, SET_BOUNDS, SET_CLOCK, BeginRow, Claim,
                      Outcome, Response, Result, Seconds, Statements, StepLog, _Support,
                      as_response, bounds, check_wait, fault_error, interval,
                      offset_seconds, offset_text, saved_bounds, seconds, settings, statements,
                      text, wait_seconds)
from ._batch import Batch, batch_of, finish_many_query
from .errors import (CLAIM_GONE, WHAT_TO_DO, AlreadyCompleted, FunctionNotFound,
                     Unavailable, not_found, quote_ident, translate, transient)

try:
    from psycopg_pool import ConnectionPool
except ImportError:  # pragma: no cover
    ConnectionPool = None  # type: ignore[assignment,misc]

# How long after the server-side timeout the client sends its own cancel.
CANCEL_GRACE = 1.0

# The SQLSTATE of an idem_begin called with wait_for on an extension older
# than that parameter: undefined_function.
NO_WAIT_FOR = ("42883",)
# How long a guard then calls it with six arguments before it tries again.
NO_WAIT_FOR_RETRY = 60.0

log = logging.getLogger("idem_pg")


class _Watchdog:
    """Sends the cancel requests of calls whose server has not answered by
    their deadline, the backstop to their statement_timeout: one thread
    for every guard of the process, where a timer thread per call cost
    about 130 µs to start and stop.  A call arms it before its statement
    and disarms it after.  The thread sleeps until the earliest deadline
    plus SLACK, so that cancels falling due together go out in one wake,
    drops disarmed entries as they reach the front, and starts a thread
    of its own for each cancel it sends, so that a cancel that blocks (a
    server or proxy holding the request) delays no other."""

    SLACK = 0.05

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list = []  # (deadline, seq, entry); entry[0] the action or None
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def arm(self, seconds: float, action: Callable[[], Any]) -> list:
        entry = [action]
        deadline = time.monotonic() + seconds
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="idem-watchdog",
                                                daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (deadline, next(self._seq), entry))
            if self._heap[0][2] is entry:
                self._cond.notify()
        return entry

    @staticmethod
    def disarm(entry: list) -> None:
        entry[0] = None

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2][0] is None:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                if self._heap[0][0] > now:
                    self._cond.wait(self._heap[0][0] - now + self.SLACK)
                    continue
                while self._heap and self._heap[0][0] <= now:
                    entry = heapq.heappop(self._heap)[2]
                    action, entry[0] = entry[0], None
                    if action is not None:
                        threading.Thread(target=_quietly, args=(action,), daemon=True).start()


def _quietly(action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - a cancel that fails leaves the server's timeout
        pass


_WATCHDOG = _Watchdog()


class _WaitForSupport:
    """Whether the server lacked idem_begin's wait_for lately."""

    def __init__(self) -> None:
        self.until = 0.0

    def usable(self) -> bool:
        return time.monotonic() >= self.until

    def refused(self, exc: BaseException, schema: str) -> bool:
        """Note a refusal of wait_for; True if exc is one.  A wrong schema
        is refused alike (no idem_begin at all), so the warning names the
        schema and both fixes."""
        state = getattr(exc, "sqlstate", None)
        if state not in NO_WAIT_FOR:
            return False
        if self.usable():
            cause = exc.__cause__ if isinstance(exc, FunctionNotFound) and exc.__cause__ else exc
            log.warning("idem_begin with wait_for not found in schema %s (%s: %s); "
                        "duplicates are answered in flight at once for %d s; %s",
                        quote_ident(schema), state,
                        (str(cause).strip().splitlines() or [state])[0],
                        NO_WAIT_FOR_RETRY, WHAT_TO_DO)
        self.until = time.monotonic() + NO_WAIT_FOR_RETRY
        return True

# The SQLSTATE of an idem_begin that has no phase columns (before 1.4):
# undefined_column.
NO_PHASE = ("42703",)


def phase_support() -> _Support:
    return _Support(NO_PHASE, "the server's idem_begin has no phase columns: a takeover "
                    "runs every step again; ALTER EXTENSION idem UPDATE")


_IDLE = pq.TransactionStatus.IDLE
# psycopg's pipeline mode (libpq 14 or later)
_PIPELINE = psycopg.Pipeline.is_supported()
_IN_TX = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


def _connect_timeout(timeout: Optional[float]) -> int:
    # libpq's connect_timeout is whole seconds, and at least 2.
    return max(2, math.ceil(timeout)) if timeout else 10


class _Source:
    """Where the guard gets a connection for one call."""

    def __init__(self, target: Any, timeout: Optional[float]):
        self.target = target
        self.timeout = timeout
        self.lock = threading.Lock()
        if not (isinstance(target, (str, psycopg.Connection))
                or (ConnectionPool is not None and isinstance(target, ConnectionPool))
                or callable(target)):
            raise TypeError("Guard needs a conninfo string, a psycopg.Connection, "
                            "a psycopg_pool.ConnectionPool or a connection factory")

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        t = self.target
        if isinstance(t, str):
            conn = psycopg.connect(t, autocommit=True,
                                   connect_timeout=_connect_timeout(self.timeout))
            try:
                yield conn
            finally:
                conn.close()
        elif isinstance(t, psycopg.Connection):
            # One connection: one call at a time (a call is several statements).
            with self.lock:
                if t.closed:
                    raise Unavailable("the guard's connection is closed")
                yield t
        elif ConnectionPool is not None and isinstance(t, ConnectionPool):
            with t.connection(timeout=self.timeout or 30.0) as conn:
                yield conn
        else:
            conn = t()
            try:
                yield conn
            finally:
                conn.close()


def _rollback_quietly(conn: psycopg.Connection) -> None:
    if conn.closed:
        return
    try:
        if conn.info.transaction_status in _IN_TX:
            conn.rollback()
    except Exception:  # noqa: BLE001 - the link is broken: drop it
        conn.close()


def one_transaction(conn: psycopg.Connection, cur: psycopg.Cursor, sets: Any,
                    query: Any, params: Any) -> None:
    """Run ``query`` on ``cur`` in a transaction of its own, after the
    SET LOCALs ``sets`` (``settings()``: SQL and parameters, or None), in
    one round trip: on an autocommit connection with nothing to set, the
    statement alone (its own transaction, in a pipeline of its own);
    otherwise BEGIN, the settings,
    the statement and COMMIT in one pipeline (one Sync), the connection
    put in autocommit for the call so that psycopg sends no BEGIN of its
    own.  Every statement is prepared (psycopg's ``prepare=True``: none
    when the connection's prepare_threshold is None, as behind pgbouncer
    in transaction pooling).  A failure leaves the transaction for the
    caller to roll back."""
    if sets is None and conn.autocommit:
        # in a pipeline too: a statement prepared for the first time goes
        # with its Parse in the same Sync, where alone psycopg waits for
        # the Parse first
        if _PIPELINE:
            with conn.pipeline():
                cur.execute(query, params, prepare=True)
        else:
            cur.execute(query, params)
        return
    restore = not conn.autocommit
    if restore:
        conn.autocommit = True      # no message: the connection is idle
    try:
        aux = conn.cursor()
        if _PIPELINE:
            with conn.pipeline():
                aux.execute("BEGIN", prepare=True)
                if sets is not None:
                    aux.execute(sets[0], sets[1], prepare=True)
                cur.execute(query, params, prepare=True)
                aux.execute("COMMIT", prepare=True)
        else:  # libpq before 14: one round trip each
            aux.execute("BEGIN")
            if sets is not None:
                aux.execute(sets[0], sets[1], prepare=True)
            cur.execute(query, params, prepare=True)
            aux.execute("COMMIT")
    finally:
        if restore:
            _rollback_quietly(conn)
            if not conn.closed:
                conn.autocommit = False


class _Heartbeat:
    """Extends one claim's lease every third of it until stopped or lost."""

    def __init__(self, guard: "Guard", claim: Claim, lease: Seconds):
        self.guard = guard
        self.claim = claim
        self.lease = interval(lease)
        self.period = (seconds(lease) or 60.0) / 3.0
        self.stop_event = threading.Event()
        self.lost = threading.Event()
        self.extends = 0
        self.last_error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._main, name="idem-heartbeat", daemon=True)

    def start(self) -> None:
        self.claim._lost = self.lost
        self.thread.start()

    def _main(self) -> None:
        while not self.stop_event.wait(self.period):
            try:
                self.guard.extend(self.claim.key, self.claim.token,
                                  self.lease, scope=self.claim.scope)
                self.extends += 1
            except CLAIM_GONE as exc:
                self.last_error = exc
                self.lost.set()
                return
            except Exception as exc:  # noqa: BLE001 - retried next period
                self.last_error = exc

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join()


class Guard:
    """Runs a handler at most once per key within the dedup window.

    ``connection``: a conninfo string (a connection per call), a
    ``psycopg_pool.ConnectionPool``, a ``psycopg.Connection`` (used by one
    call at a time), or a factory returning a new connection.  The
    connection is not held while the handler runs.

    ``wait_for`` (seconds; None or 0: no wait): a duplicate of a request
    in flight waits in the server up to that long for the holder's answer
    and replays it, or claims the key if the holder releases it or its
    lease ends.  The waiting call holds its connection meanwhile.

    ``remember`` (seconds or a timedelta; None: not sent): idem_begin's
    ``remember`` on a server with tombstones, how long after its response's
    retention a completed key is still remembered: a retry then gets the
    outcome EXPIRED and never runs the handler again.  Sent as the named
    argument ``remember =>`` only when set, so that a server without it
    answers every call that does not use it.
    """

    def __init__(self, connection: Any, *, schema: str = "public",
                 lease: Seconds = None, retention: Seconds = None, scope: str = "",
                 wait: bool = True, timeout: Seconds = 5.0,
                 keep_claim_on_error: bool = False, heartbeat: bool = False,
                 fault: Optional[Callable[[str], Any]] = None,
                 clock_offset: Any = None, wait_for: Seconds = None,
                 remember: Seconds = None):
        check_wait(wait, wait_for)
        self.wait_for = wait_seconds(wait_for)
        self._wait_for_support = _WaitForSupport()
        self._phase_support = phase_support()
        self.timeout = seconds(timeout)
        self._source = _Source(connection, self.timeout)
        self.sql = statements(schema)
        self.lease = lease
        self.retention = retention
        self.remember = remember
        self.scope = scope
        self.wait = wait
        self.keep_claim_on_error = keep_claim_on_error
        self.heartbeat = heartbeat
        self.fault = fault
        self.clock_offset = clock_offset

    # -- one call, one transaction ------------------------------------------

    def _exec(self, conn: psycopg.Connection, query, params,
              on_row: Optional[Callable[[Any], None]], offset_s: float, extra: float):
        if conn.closed:
            raise Unavailable("the connection is closed")
        if conn.info.transaction_status != _IDLE:
            raise Unavailable("the connection is busy or inside a transaction: "
                              "a claim made there would not commit on its own")
        watch = None
        timeout = self.timeout + extra if self.timeout else None
        try:
            # Results in binary: timestamps, bytea and integers do not
            # depend on the session's DateStyle, TimeZone or bytea_output.
            with conn.cursor(binary=True) as cur:
                if timeout:
                    watch = _WATCHDOG.arm(timeout + CANCEL_GRACE, conn.cancel)
                one_transaction(conn, cur, settings(timeout, offset_s), query, params)
                row = cur.fetchone()
            if on_row is not None:
                on_row(row)
            return row
        except BaseException:
            _rollback_quietly(conn)
            raise
        finally:
            if watch is not None:
                _WATCHDOG.disarm(watch)

    def _run(self, op: str, query, params, on_row=None, offset_s: Optional[float] = None,
             extra: float = 0.0):
        err = fault_error(self.fault, op)
        if err is not None:
            raise err
        if offset_s is None:
            offset_s = offset_seconds(self.clock_offset)
        try:
            with self._source.connection() as conn:
                return self._exec(conn, query, params, on_row, offset_s, extra)
        except Exception as exc:
            mapped = not_found(translate(exc), self.sql.functions.get(op, op), self.sql.schema)
            if mapped is exc:
                raise
            raise mapped from exc

    # -- the SQL functions, named exceptions on failure -------------------------

    def begin(self, key: str, fingerprint: str, *, lease: Seconds = None,
              retention: Seconds = None, scope: Optional[str] = None,
              wait: Optional[bool] = None, wait_for: Seconds = None,
              remember: Seconds = None) -> BeginRow:
        """idem_begin in its own committed transaction; with a wait_for
        (this call's, else the guard's; 0: none), its 7-argument form."""
        wait = self.wait if wait is None else wait
        params = [key, fingerprint,
                  interval(self.lease if lease is None else lease),
                  interval(self.retention if retention is None else retention),
                  self.scope if scope is None else scope, wait]
        # wait=False for one call drops the guard's wait_for, not one given with it
        w = (self.wait_for if wait else None) if wait_for is None else wait_seconds(wait_for)
        offset_s = offset_seconds(self.clock_offset)
        # remember (a server with tombstones): sent only when set
        r = interval(self.remember if remember is None else remember)

        def query(with_wait: bool, phase: bool) -> str:
            return self.sql.with_remember(self.sql.begin_query(with_wait, phase), r)

        def call(with_wait: bool) -> BeginRow:
            p = params + [interval(w)] if with_wait else params
            if r is not None:
                p = p + [r]
            extra = (w or 0.0) if with_wait else 0.0
            if self._phase_support.usable():
                try:
                    return BeginRow.of(self._run("begin", query(with_wait, True),
                                                 p, offset_s=offset_s, extra=extra), offset_s)
                except Exception as exc:
                    if not self._phase_support.refused(exc, log):
                        raise
            return BeginRow.of(self._run("begin", query(with_wait, False),
                                         p, offset_s=offset_s, extra=extra), offset_s)

        if w and self._wait_for_support.usable():
            try:
                return call(True)
            except Exception as exc:
                if not self._wait_for_support.refused(exc, self.sql.schema):
                    raise
        return call(False)

    def complete(self, key: str, fingerprint: str, status: int, body: bytes,
                 token: int, *, retention: Seconds = None,
                 scope: Optional[str] = None):
        """idem_complete with the claim's token; returns the new expires_at."""
        resp = Response(status, body)
        row = self._run("complete", self.sql.complete, [
            key, fingerprint, resp.status, resp.body, token,
            interval(self.retention if retention is None else retention),
            self.scope if scope is None else scope])
        return row[0]

    def release(self, key: str, token: int, *, scope: Optional[str] = None) -> bool:
        """idem_release: True if the claim was deleted."""
        row = self._run("release", self.sql.release,
                        [key, token, self.scope if scope is None else scope])
        return bool(row[0])

    def extend(self, key: str, token: int, lease: Seconds = None, *,
               scope: Optional[str] = None):
        """idem_extend: moves lease_until to now + lease; returns it."""
        row = self._run("extend", self.sql.extend, [
            key, token, interval(self.lease if lease is None else lease) or interval(60),
            self.scope if scope is None else scope])
        return row[0]

    def checkpoint(self, key: str, token: int, phase: str, data: Optional[bytes] = None, *,
                   scope: Optional[str] = None) -> None:
        """idem_checkpoint in its own transaction: ``phase`` finished, with
        ``data`` (bytes) as its output.  Claim.step calls it."""
        self._run("checkpoint", self.sql.checkpoint,
                  [key, token, phase, data, self.scope if scope is None else scope])

    def _step_tx(self, claim: Claim, name: str, fn: Callable[[psycopg.Connection], Any],
                 conn: Optional[psycopg.Connection]) -> Any:
        """Claim.step_tx: hold, fn(conn), checkpoint, in one transaction."""
        err = fault_error(self.fault, "hold")
        if err is not None:
            raise err
        if conn is not None:
            return self._step_tx_on(conn, claim, name, fn)
        with self._source.connection() as own:
            return self._step_tx_on(own, claim, name, fn)

    def _idem_call(self, cur: Any, op: str, query: Any, params: list) -> None:
        """One idem statement in the step's transaction, under the guard's
        timeout (restored after it), errors named."""
        b = bounds(None, self.timeout)
        try:
            if b is not None:
                cur.execute(SET_BOUNDS, b)
                prev = saved_bounds(cur.fetchone())
            cur.execute(query, params)
            if b is not None:
                cur.execute(RESTORE, prev)
        except psycopg.Error as exc:
            raise not_found(translate(exc), self.sql.functions[op], self.sql.schema) from exc

    def _step_tx_on(self, conn: psycopg.Connection, claim: Claim, name: str,
                    fn: Callable[[psycopg.Connection], Any]) -> Any:
        if conn.closed:
            raise Unavailable("the connection is closed")
        offset = offset_text(offset_seconds(self.clock_offset))
        with conn.transaction():
            with conn.cursor() as cur:
                if offset is not None:
                    cur.execute(SET_CLOCK, [offset])
                self._idem_call(cur, "hold", self.sql.hold,
                                [claim.key, claim.token, claim.scope])
            data, value = claim._steps.encode(name, fn(conn))
            err = fault_error(self.fault, "checkpoint")
            if err is not None:
                raise err
            with conn.cursor() as cur:
                self._idem_call(cur, "checkpoint", self.sql.checkpoint,
                                [claim.key, claim.token, name, data, claim.scope])
        return value

    def lookup(self, key: str, *, scope: Optional[str] = None):
        """idem_lookup (needs the operator grant): a dict, or None."""
        row = self._run("lookup", self.sql.lookup,
                        [key, self.scope if scope is None else scope])
        if row is None:
            return None
        names = ("state", "token", "status", "lease_until", "expires_at", "body_size")
        return dict(zip(names, (text(row[0]),) + tuple(row[1:])))

    # -- the guard ---------------------------------------------------------------

    def _release_quietly(self, result: Result, key: str, token: int, scope: str) -> None:
        try:
            result.released = self.release(key, token, scope=scope)
        except Exception as exc:  # noqa: BLE001 - reported, the lease ends it
            if result.error is None:
                result.error = exc

    def _store_not_stored(self, result: Result, key: str, fingerprint: str, token: int,
                          retention: Seconds, scope: str, answer: Response) -> None:
        """The handler ran and its response cannot be stored: store the
        fixed answer instead, so that a retry gets it and never runs the
        handler again."""
        try:
            result.expires_at = self.complete(key, fingerprint, answer.status, answer.body,
                                              token, retention=retention, scope=scope)
        except Exception as exc:  # noqa: BLE001 - left to the lease
            log.error("response for key %r not stored (%s), nor the %d in its place (%s): "
                      "the key stays in flight until its lease ends",
                      key, result.error, answer.status, translate(exc))
            return
        result.not_stored = True
        log.warning("response for key %r not stored (%s: %s); a retry gets %d "
                    "\"Response not stored\"", key, getattr(result.error, "sqlstate", None),
                    result.error, answer.status)

    def do(self, key: str, fingerprint: str, handler: Callable[[Claim], Any], *,
           scope: Optional[str] = None, lease: Seconds = None,
           retention: Seconds = None, wait: Optional[bool] = None,
           wait_for: Seconds = None, remember: Seconds = None,
           not_stored: Response = NOT_STORED) -> Result:
        """Claim ``key``; replay, refuse, or run ``handler(claim)`` and store
        the Response it returns.  Never raises for the store: see Result.
        ``wait_for`` overrides the guard's for this call (0: no wait),
        ``remember`` the guard's remember.  EXPIRED (a server with
        tombstones): the handler does not run; Result.status is the
        first response's status.
        If idem_complete fails for a reason a retry cannot fix (see
        errors.transient), ``not_stored`` (a 500 "Response not stored") is
        stored in the response's place and a WARNING logged."""
        scope = self.scope if scope is None else scope
        lease = self.lease if lease is None else lease
        retention = self.retention if retention is None else retention
        result = Result(Outcome.UNAVAILABLE)
        try:
            row = self.begin(key, fingerprint, lease=lease, retention=retention,
                             scope=scope, wait=wait, wait_for=wait_for,
                             remember=remember)
            outcome = row.outcome()
        except Exception as exc:  # noqa: BLE001 - no claim, no handler
            result.error = translate(exc)
            result.failed_step = "begin"
            return result
        if outcome is not Outcome.EXECUTED:
            result.outcome = outcome
            result.response = row.response()
            if outcome is Outcome.IN_FLIGHT:
                result.lease_until, result.lease_left = row.lease_until, row.lease_left
            elif outcome is Outcome.REPLAYED:
                result.expires_at = row.expires_at
            elif outcome is Outcome.EXPIRED:
                result.status = row.status
            return result

        token = cast(int, row.token)  # an executed claim has its token
        result.token = token
        claim = Claim(key, fingerprint, scope, token, phase=row.phase,
                      _steps=StepLog(row.phase, row.phase_data), _guard=self)
        hb = None
        if self.heartbeat:
            try:
                hb = _Heartbeat(self, claim, lease)
                hb.start()
            except Exception as exc:  # noqa: BLE001 - no heartbeat, do not run
                result.error = exc
                result.failed_step = "heartbeat"
                self._release_quietly(result, key, token, scope)
                return result

        result.outcome = Outcome.EXECUTED
        try:
            resp = as_response(handler(claim))
        except BaseException as exc:
            if hb is not None:
                hb.stop()
                result.extends, result.superseded = hb.extends, hb.lost.is_set()
            result.error = exc
            result.failed_step = "handler"
            # a key that holds a checkpoint keeps it for the next holder
            if not self.keep_claim_on_error and not claim._steps.checkpointed:
                self._release_quietly(result, key, token, scope)
                result.error = exc
            if not isinstance(exc, Exception):
                raise
            return result
        if hb is not None:
            hb.stop()
            result.extends, result.superseded = hb.extends, hb.lost.is_set()

        result.response = resp
        try:
            result.expires_at = self.complete(key, fingerprint, resp.status, resp.body,
                                      token, retention=retention, scope=scope)
        except Exception as exc:  # noqa: BLE001 - executed, not stored
            result.error = translate(exc)
            result.failed_step = "complete"
            # (a key completed already is not claimable: nothing to store)
            if not transient(result.error) and not isinstance(result.error,
                                                              AlreadyCompleted):
                self._store_not_stored(result, key, fingerprint, token, retention,
                                       scope, not_stored)
        return result

    # -- batches -------------------------------------------------------------------

    def _batch(self, items: Any, scope: Optional[str], lease: Seconds, retention: Seconds,
               wait: Optional[bool], wait_for: Seconds, remember: Seconds,
               holder: Optional[str]) -> Batch:
        return batch_of(self, items, scope, lease, retention, wait, wait_for, remember, holder)

    def _store_each(self, b: Batch, error: BaseException, not_stored: Response) -> None:
        """idem_complete_many was refused for good (a body over
        idem.max_body_size): store the responses one by one, as do() does,
        so that only the item at fault gets ``not_stored``; release the
        failed items' claims."""
        for i in b.claimed:
            key, fp = b.items[i]
            r = b.results[i]
            token = cast(int, r.token)
            if i in b.answers:
                resp = b.answers[i]
                try:
                    r.expires_at = self.complete(key, fp, resp.status, resp.body, token,
                                                 retention=b.retention, scope=b.scope)
                except Exception as exc:  # noqa: BLE001
                    r.error, r.failed_step = translate(exc), "complete"
                    if not transient(r.error) and not isinstance(r.error, AlreadyCompleted):
                        self._store_not_stored(r, key, fp, token, b.retention, b.scope,
                                               not_stored)
            elif i in b.failed and i not in b.kept:
                self._release_quietly(r, key, token, b.scope)
                r.error = b.failed[i]

    def do_many(self, items: Any, handler: Callable[[int, Claim], Any], *,
                scope: Optional[str] = None, lease: Seconds = None,
                retention: Seconds = None, wait: Optional[bool] = None,
                wait_for: Seconds = None, remember: Seconds = None,
                holder: Optional[str] = None,
                not_stored: Response = NOT_STORED) -> "list[Result]":
        """Run ``handler(i, claim)`` at most once for each item of a batch
        whose key it claims; one Result per item, in input order.

        ``items``: (key, fingerprint) pairs.  One idem_begin_many call
        commits the claims of the whole batch (one round trip, the keys
        locked in the server's order), then the handlers of the claimed
        items run one after another in input order, then one statement
        stores their responses (idem_complete_many) and releases the claim
        of every item whose handler raised (that item is EXECUTED with
        failed_step "handler"; a retry of the batch runs it again, the
        others replay).  The other items answer as do() would: REPLAYED,
        CONFLICT, IN_FLIGHT (after waiting up to ``wait_for``, one deadline
        for the whole batch), EXPIRED.  A key repeated in the batch is
        claimed once, for its first occurrence; a later occurrence gets a
        copy of its Result with ``duplicate_of`` set (CONFLICT if its
        fingerprint differs).  If the claim fails, every item is
        UNAVAILABLE and no handler runs.  ``holder`` is idem_begin_many's
        (doc/sql.md, "Re-entrant holders").  No heartbeat: the lease must
        cover the handlers of the whole batch."""
        b = self._batch(items, scope, lease, retention, wait, wait_for, remember, holder)
        if not b.items:
            return []
        offset_s = offset_seconds(self.clock_offset)
        try:
            row = self._run("begin_many", b.begin_query, b.begin_params, offset_s=offset_s,
                            extra=b.wait_for or 0.0)
            todo = b.start(row, offset_s)
        except Exception as exc:  # noqa: BLE001 - no claim, no handler
            return b.unavailable(translate(exc))
        interrupted: Optional[BaseException] = None
        for i in todo:
            if interrupted is not None:
                b.raised(i, interrupted)
                continue
            key, fp = b.items[i]
            br = b.rows[i]
            claim = Claim(key, fp, b.scope, cast(int, br.token), phase=br.phase,
                          _steps=StepLog(br.phase, br.phase_data), _guard=self)
            try:
                b.answered(i, as_response(handler(i, claim)))
            except BaseException as exc:
                b.raised(i, exc, keep=self.keep_claim_on_error or claim._steps.checkpointed)
                if not isinstance(exc, Exception):
                    interrupted = exc
        if b.to_finish():
            try:
                b.finished(self._run("complete_many", finish_many_query(self.sql),
                                     b.finish_params()))
            except Exception as exc:  # noqa: BLE001 - executed, not stored
                err = translate(exc)
                if transient(err) or isinstance(err, AlreadyCompleted):
                    b.store_failed(err)
                else:
                    self._store_each(b, err, not_stored)
        if interrupted is not None:
            raise interrupted
        return b.done()
