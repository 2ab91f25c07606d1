"""The asyncio guard, on psycopg 3 or asyncpg (idem_pg._drivers).

Same protocol as idem_pg.Guard.  Cancellation is the trap here: psycopg
does not cancel a statement whose task is cancelled (asyncio.wait_for,
a client disconnect, a server shutdown), so an abandoned idem_begin would
go on waiting on the server and later claim the key for its whole lease
with nobody to complete it.  AsyncGuard catches the cancellation, sends
the server a cancel request, closes that connection (its open transaction
rolls back), releases a claim it already holds, and re-raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, cast

import psycopg

from ._common import (NOT_STORED, RESTORE, SET_BOUNDS, SET_CLOCK, AsyncClaim, BeginRow,
                      Claim, Outcome, Response, Result, Seconds, Statements, StepLog,
                      as_response, bounds, check_wait, fault_error, interval,
                      offset_seconds, offset_text, saved_bounds, seconds, statements,
                      wait_seconds)
from ._batch import Batch, batch_of, finish_many_query
from ._drivers import driver_errors, driver_of, is_asyncpg
from .errors import (CLAIM_GONE, AlreadyCompleted, Timeout, Unavailable, not_found,
                     translate, transient)
from .guard import CANCEL_GRACE, _connect_timeout, _WaitForSupport, phase_support

try:
    from psycopg_pool import AsyncConnectionPool
except ImportError:  # pragma: no cover
    AsyncConnectionPool = None  # type: ignore[assignment,misc]

log = logging.getLogger("idem_pg")


async def abort_statement(conn: Any) -> None:
    """Cancel whatever the connection runs on the server, then close it
    (the server rolls the open transaction back)."""
    await driver_of(conn).abort(conn)


class _AsyncSource:
    def __init__(self, target: Any, timeout: Optional[float]):
        self.target = target
        self.timeout = timeout
        self.lock: Optional[asyncio.Lock] = None
        # asyncpg: a Pool (created and awaited by the caller) or a Connection
        self.asyncpg = is_asyncpg(target)
        self.asyncpg_pool = self.asyncpg and hasattr(target, "acquire")
        if not (isinstance(target, (str, psycopg.AsyncConnection)) or self.asyncpg
                or (AsyncConnectionPool is not None and isinstance(target, AsyncConnectionPool))
                or callable(target)):
            raise TypeError("AsyncGuard needs a conninfo string, a psycopg.AsyncConnection, "
                            "a psycopg_pool.AsyncConnectionPool, an asyncpg Pool or "
                            "Connection, or an async connection factory")

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        t = self.target
        if isinstance(t, str):
            conn = await psycopg.AsyncConnection.connect(
                t, autocommit=True, connect_timeout=_connect_timeout(self.timeout))
            try:
                yield conn
            finally:
                await conn.close()
        elif self.asyncpg_pool:
            async with t.acquire(timeout=self.timeout or 30.0) as conn:
                yield conn
        elif self.asyncpg or isinstance(t, psycopg.AsyncConnection):
            if self.lock is None:
                self.lock = asyncio.Lock()
            async with self.lock:
                if driver_of(t).closed(t):
                    raise Unavailable("the guard's connection is closed")
                yield t
        elif AsyncConnectionPool is not None and isinstance(t, AsyncConnectionPool):
            async with t.connection(timeout=self.timeout or 30.0) as conn:
                yield conn
        else:
            conn = await t()
            try:
                yield conn
            finally:
                await conn.close()


class _AsyncHeartbeat:
    def __init__(self, guard: "AsyncGuard", claim: Claim, lease: Seconds):
        self.guard = guard
        self.claim = claim
        self.lease = interval(lease)
        self.period = (seconds(lease) or 60.0) / 3.0
        self.lost = threading.Event()
        self.extends = 0
        self.last_error: Optional[BaseException] = None
        self.task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self.claim._lost = self.lost
        self.task = asyncio.ensure_future(self._main())

    async def _main(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.guard.extend(self.claim.key, self.claim.token, self.lease,
                                        scope=self.claim.scope)
                self.extends += 1
            except CLAIM_GONE as exc:
                self.last_error = exc
                self.lost.set()
                return
            except Exception as exc:  # noqa: BLE001 - retried next period
                self.last_error = exc

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


class AsyncGuard:
    """asyncio version of Guard; ``connection`` is a conninfo string, a
    ``psycopg_pool.AsyncConnectionPool`` (opened by the caller), an
    ``AsyncConnection`` (one call at a time), an asyncpg ``Pool`` (created
    by the caller) or ``Connection`` (one call at a time), or an async
    factory of either driver's connections (closed after each call).
    ``wait_for``: as for Guard; a cancelled task ends the server's wait."""

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
        self._source = _AsyncSource(connection, self.timeout)
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

    async def _exec(self, conn: Any, query, params, on_row,
                    offset_s: float, extra: float):
        drv = driver_of(conn)
        if drv.closed(conn):
            raise Unavailable("the connection is closed")
        if not drv.idle(conn):
            raise Unavailable("the connection is busy or inside a transaction: "
                              "a claim made there would not commit on its own")
        timeout = self.timeout + extra if self.timeout else None
        try:
            # Results in binary, as in Guard._exec.
            if timeout:
                # the server ends the wait at timeout; this is the backstop
                row = await asyncio.wait_for(
                    drv.one_transaction(conn, timeout, offset_s, query, params),
                    timeout + CANCEL_GRACE)
            else:
                row = await drv.one_transaction(conn, timeout, offset_s, query, params)
            if on_row is not None:
                on_row(row)
            return row
        except asyncio.TimeoutError as exc:
            await asyncio.shield(abort_statement(conn))
            raise Timeout("no answer from the server in %.1f s" % ((timeout or 0.0) + CANCEL_GRACE)) from exc
        except asyncio.CancelledError:
            await asyncio.shield(abort_statement(conn))
            raise
        except BaseException:
            if not drv.closed(conn):
                try:
                    if not drv.idle(conn):
                        await drv.rollback(conn)
                except Exception:  # noqa: BLE001
                    await drv.abort(conn)
            raise

    async def _run(self, op: str, query, params, on_row=None,
                   offset_s: Optional[float] = None, extra: float = 0.0):
        err = fault_error(self.fault, op)
        if err is not None:
            raise err
        if offset_s is None:
            offset_s = offset_seconds(self.clock_offset)
        try:
            async with self._source.connection() as conn:
                return await self._exec(conn, query, params, on_row, offset_s, extra)
        except Exception as exc:
            mapped = not_found(translate(exc), self.sql.functions.get(op, op), self.sql.schema)
            if mapped is exc:
                raise
            raise mapped from exc

    async def begin(self, key: str, fingerprint: str, *, lease: Seconds = None,
                    retention: Seconds = None, scope: Optional[str] = None,
                    wait: Optional[bool] = None, wait_for: Seconds = None,
                    remember: Seconds = None,
                    on_row=None) -> BeginRow:
        wait = self.wait if wait is None else wait
        params = [key, fingerprint,
                  interval(self.lease if lease is None else lease),
                  interval(self.retention if retention is None else retention),
                  self.scope if scope is None else scope, wait]
        w = (self.wait_for if wait else None) if wait_for is None else wait_seconds(wait_for)
        offset_s = offset_seconds(self.clock_offset)
        # remember (a server with tombstones): sent only when set
        r = interval(self.remember if remember is None else remember)

        def query(with_wait: bool, phase: bool) -> str:
            return self.sql.with_remember(self.sql.begin_query(with_wait, phase), r)

        async def call(with_wait: bool) -> BeginRow:
            p = params + [interval(w)] if with_wait else params
            if r is not None:
                p = p + [r]
            extra = (w or 0.0) if with_wait else 0.0
            if self._phase_support.usable():
                try:
                    return BeginRow.of(await self._run(
                        "begin", query(with_wait, True), p, on_row,
                        offset_s=offset_s, extra=extra), offset_s)
                except Exception as exc:
                    if not self._phase_support.refused(exc, log):
                        raise
            return BeginRow.of(await self._run(
                "begin", query(with_wait, False), p, on_row,
                offset_s=offset_s, extra=extra), offset_s)

        if w and self._wait_for_support.usable():
            try:
                return await call(True)
            except Exception as exc:
                if not self._wait_for_support.refused(exc, self.sql.schema):
                    raise
        return await call(False)

    async def complete(self, key: str, fingerprint: str, status: int, body: bytes,
                       token: int, *, retention: Seconds = None,
                       scope: Optional[str] = None):
        resp = Response(status, body)
        row = await self._run("complete", self.sql.complete, [
            key, fingerprint, resp.status, resp.body, token,
            interval(self.retention if retention is None else retention),
            self.scope if scope is None else scope])
        return row[0]

    async def release(self, key: str, token: int, *, scope: Optional[str] = None) -> bool:
        row = await self._run("release", self.sql.release,
                              [key, token, self.scope if scope is None else scope])
        return bool(row[0])

    async def extend(self, key: str, token: int, lease: Seconds = None, *,
                     scope: Optional[str] = None):
        row = await self._run("extend", self.sql.extend, [
            key, token, interval(self.lease if lease is None else lease) or interval(60),
            self.scope if scope is None else scope])
        return row[0]

    async def checkpoint(self, key: str, token: int, phase: str,
                         data: Optional[bytes] = None, *,
                         scope: Optional[str] = None) -> None:
        """idem_checkpoint in its own transaction (AsyncClaim.step calls it)."""
        await self._run("checkpoint", self.sql.checkpoint,
                        [key, token, phase, data, self.scope if scope is None else scope])

    async def _step_tx(self, claim: Claim, name: str, fn: Callable[[Any], Any],
                       conn: Any) -> Any:
        """AsyncClaim.step_tx: hold, fn(conn), checkpoint, in one transaction.
        A cancelled step cancels its statement and closes the connection
        (the transaction rolls back)."""
        err = fault_error(self.fault, "hold")
        if err is not None:
            raise err
        if conn is not None:
            return await self._step_tx_on(conn, claim, name, fn)
        async with self._source.connection() as own:
            return await self._step_tx_on(own, claim, name, fn)

    async def _idem_call(self, conn: Any, op: str, query: Any, params: list) -> None:
        drv = driver_of(conn)
        b = bounds(None, self.timeout)
        try:
            if b is not None:
                prev = saved_bounds(await drv.fetchrow(conn, SET_BOUNDS, b))
            await drv.fetchrow(conn, query, params)
            if b is not None:
                await drv.fetchrow(conn, RESTORE, prev)
        except driver_errors() as exc:
            raise not_found(translate(exc), self.sql.functions[op], self.sql.schema) from exc

    async def _step_tx_on(self, conn: Any, claim: Claim, name: str,
                          fn: Callable[[Any], Any]) -> Any:
        drv = driver_of(conn)
        if drv.closed(conn):
            raise Unavailable("the connection is closed")
        offset = offset_text(offset_seconds(self.clock_offset))
        try:
            async with drv.transaction(conn):
                if offset is not None:
                    await drv.fetchrow(conn, SET_CLOCK, [offset])
                await self._idem_call(conn, "hold", self.sql.hold,
                                      [claim.key, claim.token, claim.scope])
                output = fn(conn)
                if inspect.isawaitable(output):
                    output = await output
                data, value = claim._steps.encode(name, output)
                err = fault_error(self.fault, "checkpoint")
                if err is not None:
                    raise err
                await self._idem_call(conn, "checkpoint", self.sql.checkpoint,
                                      [claim.key, claim.token, name, data, claim.scope])
        except asyncio.CancelledError:
            await asyncio.shield(abort_statement(conn))
            raise
        return value

    async def _release_quietly(self, result: Result, key: str, token: int, scope: str) -> None:
        try:
            result.released = await self.release(key, token, scope=scope)
        except Exception as exc:  # noqa: BLE001
            if result.error is None:
                result.error = exc

    async def _store_not_stored(self, result: Result, key: str, fingerprint: str,
                                token: int, retention: Seconds, scope: str,
                                answer: Response) -> None:
        try:
            result.expires_at = await self.complete(key, fingerprint, answer.status,
                                                    answer.body, token,
                                                    retention=retention, scope=scope)
        except Exception as exc:  # noqa: BLE001 - left to the lease
            log.error("response for key %r not stored (%s), nor the %d in its place (%s): "
                      "the key stays in flight until its lease ends",
                      key, result.error, answer.status, translate(exc))
            return
        result.not_stored = True
        log.warning("response for key %r not stored (%s: %s); a retry gets %d "
                    "\"Response not stored\"", key, getattr(result.error, "sqlstate", None),
                    result.error, answer.status)

    async def do(self, key: str, fingerprint: str,
                 handler: Callable[[AsyncClaim], Awaitable[Any]], *,
                 scope: Optional[str] = None, lease: Seconds = None,
                 retention: Seconds = None, wait: Optional[bool] = None,
                 wait_for: Seconds = None, remember: Seconds = None,
                 not_stored: Response = NOT_STORED) -> Result:
        """Claim ``key``; replay, refuse, or await ``handler(claim)`` and store
        the Response it returns.  If the calling task is cancelled, the
        server's wait is cancelled too and a claim already made is released.
        A response that cannot be stored: as for Guard.do."""
        scope = self.scope if scope is None else scope
        lease = self.lease if lease is None else lease
        retention = self.retention if retention is None else retention
        result = Result(Outcome.UNAVAILABLE)
        got = {}

        def seen(row):
            if row is not None and row[0]:
                got["token"] = row[2]

        try:
            row = await self.begin(key, fingerprint, lease=lease, retention=retention,
                                   scope=scope, wait=wait, wait_for=wait_for,
                                   remember=remember, on_row=seen)
            outcome = row.outcome()
        except asyncio.CancelledError:
            if "token" in got:  # claimed, and the COMMIT may have gone through
                await asyncio.shield(self._release_quietly(result, key, got["token"], scope))
            raise
        except Exception as exc:  # noqa: BLE001
            if "token" in got:
                await asyncio.shield(self._release_quietly(result, key, got["token"], scope))
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
        claim = AsyncClaim(key, fingerprint, scope, token, phase=row.phase,
                           _steps=StepLog(row.phase, row.phase_data), _guard=self)
        hb = None
        if self.heartbeat:
            hb = _AsyncHeartbeat(self, claim, lease)
            hb.start()

        result.outcome = Outcome.EXECUTED
        try:
            resp = as_response(await handler(claim))
        except BaseException as exc:
            if hb is not None:
                await asyncio.shield(hb.stop())
                result.extends, result.superseded = hb.extends, hb.lost.is_set()
            result.error = exc
            result.failed_step = "handler"
            # a key that holds a checkpoint keeps it for the next holder
            if not self.keep_claim_on_error and not claim._steps.checkpointed:
                await asyncio.shield(self._release_quietly(result, key, token, scope))
                result.error = exc
            if not isinstance(exc, Exception):
                raise
            return result
        if hb is not None:
            await hb.stop()
            result.extends, result.superseded = hb.extends, hb.lost.is_set()

        result.response = resp
        try:
            result.expires_at = await self.complete(key, fingerprint, resp.status, resp.body,
                                            token, retention=retention, scope=scope)
        except Exception as exc:  # noqa: BLE001 - executed, not stored
            result.error = translate(exc)
            result.failed_step = "complete"
            # (a key completed already is not claimable: nothing to store)
            if not transient(result.error) and not isinstance(result.error,
                                                              AlreadyCompleted):
                await self._store_not_stored(result, key, fingerprint, token, retention,
                                             scope, not_stored)
        return result

    # -- batches -------------------------------------------------------------------

    def _batch(self, items: Any, scope: Optional[str], lease: Seconds, retention: Seconds,
               wait: Optional[bool], wait_for: Seconds, remember: Seconds,
               holder: Optional[str]) -> Batch:
        return batch_of(self, items, scope, lease, retention, wait, wait_for, remember, holder)

    async def _store_each(self, b: Batch, error: BaseException, not_stored: Response) -> None:
        """As Guard._store_each."""
        for i in b.claimed:
            key, fp = b.items[i]
            r = b.results[i]
            token = cast(int, r.token)
            if i in b.answers:
                resp = b.answers[i]
                try:
                    r.expires_at = await self.complete(key, fp, resp.status, resp.body, token,
                                                       retention=b.retention, scope=b.scope)
                except Exception as exc:  # noqa: BLE001
                    r.error, r.failed_step = translate(exc), "complete"
                    if not transient(r.error) and not isinstance(r.error, AlreadyCompleted):
                        await self._store_not_stored(r, key, fp, token, b.retention, b.scope,
                                                     not_stored)
            elif i in b.failed and i not in b.kept:
                await self._release_quietly(r, key, token, b.scope)
                r.error = b.failed[i]

    async def _finish(self, b: Batch, not_stored: Response) -> None:
        if not b.to_finish():
            return
        try:
            b.finished(await self._run("complete_many", finish_many_query(self.sql),
                                       b.finish_params()))
        except Exception as exc:  # noqa: BLE001 - executed, not stored
            err = translate(exc)
            if transient(err) or isinstance(err, AlreadyCompleted):
                b.store_failed(err)
            else:
                await self._store_each(b, err, not_stored)

    async def do_many(self, items: Any,
                      handler: Callable[[int, AsyncClaim], Awaitable[Any]], *,
                      scope: Optional[str] = None, lease: Seconds = None,
                      retention: Seconds = None, wait: Optional[bool] = None,
                      wait_for: Seconds = None, remember: Seconds = None,
                      holder: Optional[str] = None,
                      not_stored: Response = NOT_STORED) -> "list[Result]":
        """Guard.do_many with ``await handler(i, claim)``.  If the calling
        task is cancelled while the claim waits, the server's wait is
        cancelled and the claims already made are released; while a
        handler runs, the responses stored so far are stored and the
        other claims released, then the cancellation goes on."""
        b = self._batch(items, scope, lease, retention, wait, wait_for, remember, holder)
        if not b.items:
            return []
        offset_s = offset_seconds(self.clock_offset)
        got: dict = {}

        def seen(row: Any) -> None:
            got["row"] = row

        async def release_seen() -> None:
            # claimed, and the COMMIT may have gone through
            if "row" in got:
                with contextlib.suppress(Exception):
                    b.start(got["row"], offset_s)
                    for i in b.claimed:
                        await self._release_quietly(b.results[i], b.items[i][0],
                                                    cast(int, b.results[i].token), b.scope)

        try:
            row = await self._run("begin_many", b.begin_query, b.begin_params, seen,
                                  offset_s=offset_s, extra=b.wait_for or 0.0)
            todo = b.start(row, offset_s)
        except asyncio.CancelledError:
            await asyncio.shield(release_seen())
            raise
        except Exception as exc:  # noqa: BLE001 - no claim, no handler
            await asyncio.shield(release_seen())
            return b.unavailable(translate(exc))
        interrupted: Optional[BaseException] = None
        for i in todo:
            if interrupted is not None:
                b.raised(i, interrupted)
                continue
            key, fp = b.items[i]
            br = b.rows[i]
            claim = AsyncClaim(key, fp, b.scope, cast(int, br.token), phase=br.phase,
                               _steps=StepLog(br.phase, br.phase_data), _guard=self)
            try:
                b.answered(i, as_response(await handler(i, claim)))
            except BaseException as exc:
                b.raised(i, exc, keep=self.keep_claim_on_error or claim._steps.checkpointed)
                if not isinstance(exc, Exception):
                    interrupted = exc
        if interrupted is not None:
            await asyncio.shield(self._finish(b, not_stored))
            raise interrupted
        await self._finish(b, not_stored)
        return b.done()
