"""The asyncio drivers the async forms run on: psycopg 3 and asyncpg.

AsyncGuard, atomic_async() and the ASGI middleware run one code path and
reach the connection only through a Driver, found from the object the
caller passed (``driver_of``).  The interface is small on purpose: one
statement with parameters and its first row (``fetchrow``), a message of
the simple protocol without parameters (``execute``), transactions and
savepoints (``transaction``), the transaction state, and what ends a
statement that cannot be awaited any longer (``abort``).  The statements
are written once, with psycopg's placeholders (``%s``, ``%b``); a driver
whose placeholders differ rewrites them (asyncpg: ``$1``, ``$2``, ...),
once per statement text.

    drv = driver_of(conn)
    async with drv.transaction(conn):
        row = await drv.fetchrow(conn, "SELECT %s::int + 1", [41])
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from typing import (Any, AsyncContextManager, AsyncIterator, Dict, Optional, Sequence, Tuple,
                    Type)

import psycopg
from psycopg import pq

_IDLE = pq.TransactionStatus.IDLE
# psycopg's pipeline mode (libpq 14 or later)
_PIPELINE = psycopg.Pipeline.is_supported()


class Driver:
    """What the async code asks of a connection.  ``conn`` is the driver's
    own connection object (psycopg.AsyncConnection, asyncpg.Connection)."""

    name = ""

    def closed(self, conn: Any) -> bool:
        raise NotImplementedError

    def idle(self, conn: Any) -> bool:
        """No transaction open on the connection (and no statement running)."""
        raise NotImplementedError

    def autocommit(self, conn: Any) -> bool:
        """A statement runs in a transaction of its own unless BEGIN was sent."""
        raise NotImplementedError

    async def fetchrow(self, conn: Any, query: str, params: Sequence[Any] = ()) -> Optional[tuple]:
        """Run ``query`` (placeholders %s and %b) with ``params``; its first
        row as a tuple (None: no row).  Dates, integers and bytea are read
        in binary, whatever the session's DateStyle or bytea_output."""
        raise NotImplementedError

    async def execute(self, conn: Any, sql: str) -> None:
        """``sql`` (no parameters, possibly several statements) as one
        message of the simple protocol: one round trip."""
        raise NotImplementedError

    async def one_transaction(self, conn: Any, timeout_s: Optional[float], offset_s: float,
                              query: str, params: Sequence[Any]) -> Optional[tuple]:
        """``query``'s first row (as ``fetchrow``), run in a transaction of
        its own under the call's SET LOCALs (its statement_timeout, its
        idem.clock_offset; none: the statement alone), in as few round
        trips as the driver allows.  A failure may leave the transaction
        open for the caller to roll back."""
        raise NotImplementedError

    def transaction(self, conn: Any) -> AsyncContextManager[Any]:
        """A transaction, or a savepoint inside an open one: committed (or
        released) at the end of the block, rolled back on an exception."""
        raise NotImplementedError

    async def commit(self, conn: Any) -> None:
        """COMMIT a transaction opened with BEGIN by ``execute``, if one is open."""
        raise NotImplementedError

    async def rollback(self, conn: Any) -> None:
        raise NotImplementedError

    async def abort(self, conn: Any) -> None:
        """Cancel whatever the connection runs on the server, then close it
        (its open transaction rolls back): for a statement whose task was
        cancelled or timed out."""
        raise NotImplementedError

    def errors(self) -> Tuple[Type[BaseException], ...]:
        """The driver's own exception classes (server errors, lost connections)."""
        raise NotImplementedError


class PsycopgDriver(Driver):
    name = "psycopg"

    def closed(self, conn: psycopg.AsyncConnection) -> bool:
        return conn.closed

    def idle(self, conn: psycopg.AsyncConnection) -> bool:
        return conn.info.transaction_status == _IDLE

    def autocommit(self, conn: psycopg.AsyncConnection) -> bool:
        return conn.autocommit

    async def fetchrow(self, conn, query, params=()):
        async with conn.cursor(binary=True) as cur:
            await cur.execute(query, params)
            # a statement that returns no rows (an UPDATE): None
            return None if cur.description is None else await cur.fetchone()

    async def one_transaction(self, conn, timeout_s, offset_s, query, params):
        # As guard.one_transaction: one pipeline, one Sync, every statement
        # prepared (none with prepare_threshold None).
        from ._common import settings  # (_common imports errors, which imports this)
        sets = settings(timeout_s, offset_s)
        async with conn.cursor(binary=True) as cur:
            if sets is None and conn.autocommit:
                if _PIPELINE:
                    async with _pipeline(self, conn):
                        await cur.execute(query, params, prepare=True)
                else:
                    await cur.execute(query, params)
            else:
                restore = not conn.autocommit
                if restore:
                    await conn.set_autocommit(True)     # no message: idle
                try:
                    aux = conn.cursor()
                    if _PIPELINE:
                        async with _pipeline(self, conn):
                            await aux.execute("BEGIN", prepare=True)
                            if sets is not None:
                                await aux.execute(sets[0], sets[1], prepare=True)
                            await cur.execute(query, params, prepare=True)
                            await aux.execute("COMMIT", prepare=True)
                    else:  # libpq before 14: one round trip each
                        await aux.execute("BEGIN")
                        if sets is not None:
                            await aux.execute(sets[0], sets[1], prepare=True)
                        await cur.execute(query, params, prepare=True)
                        await aux.execute("COMMIT")
                finally:
                    if restore and not conn.closed:
                        if conn.info.transaction_status != _IDLE:
                            await conn.rollback()
                        await conn.set_autocommit(False)
            return None if cur.description is None else await cur.fetchone()

    async def execute(self, conn, sql):
        # psycopg sends a query without parameters with the simple protocol
        await conn.execute(sql)

    def transaction(self, conn):
        return conn.transaction()

    async def commit(self, conn):
        await conn.commit()

    async def rollback(self, conn):
        await conn.rollback()

    async def abort(self, conn):
        # psycopg cannot resume an interrupted statement, nor does it cancel
        # one whose task was cancelled: the server would go on with it.
        if conn.closed:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, conn.cancel)
        except Exception:  # noqa: BLE001 - closing ends it too
            pass
        try:
            await conn.close()
        except Exception:  # noqa: BLE001
            pass

    def errors(self) -> Tuple[Type[BaseException], ...]:
        return (psycopg.Error,)


_PLACEHOLDER = re.compile(r"%%|%[sb]")


def dollar_placeholders(query: str) -> str:
    """``query`` with psycopg's %s and %b as $1, $2, ... and %% as %."""
    n = 0

    def sub(m: "re.Match[str]") -> str:
        nonlocal n
        if m.group(0) == "%%":
            return "%"
        n += 1
        return "$%d" % n

    return _PLACEHOLDER.sub(sub, query)


class AsyncpgDriver(Driver):
    """asyncpg: results are always binary; statements are prepared and
    kept by the connection's statement cache (asyncpg's
    ``statement_cache_size``; 0 behind pgbouncer in transaction pooling)."""

    name = "asyncpg"

    def __init__(self) -> None:
        self._queries: Dict[str, str] = {}

    def _query(self, query: str) -> str:
        q = self._queries.get(query)
        if q is None:
            if len(self._queries) > 1000:       # texts with values written in
                self._queries.clear()
            q = self._queries[query] = dollar_placeholders(query)
        return q

    def closed(self, conn) -> bool:
        return conn.is_closed()

    def idle(self, conn) -> bool:
        return not conn.is_in_transaction()

    def autocommit(self, conn) -> bool:
        return True

    async def fetchrow(self, conn, query, params=()):
        row = await conn.fetchrow(self._query(query), *params)
        return None if row is None else tuple(row)

    async def one_transaction(self, conn, timeout_s, offset_s, query, params):
        # asyncpg has no pipeline in its API: every statement with
        # parameters ends in a Sync and is awaited.  The SET LOCALs go with
        # BEGIN as one Query of the simple protocol (no parameters there:
        # numbers this client writes), then the statement, then COMMIT:
        # three round trips; with nothing to set, the statement alone, one.
        from ._common import Statements
        opening = Statements.opening(True, timeout_s, offset_s)
        if opening is None:
            return await self.fetchrow(conn, query, params)
        await conn.execute(opening)
        row = await self.fetchrow(conn, query, params)
        await conn.execute("COMMIT")
        return row

    async def execute(self, conn, sql):
        # without arguments asyncpg sends the simple protocol's Query
        await conn.execute(sql)

    def transaction(self, conn):
        return _asyncpg_transaction(conn)

    async def commit(self, conn):
        if conn.is_in_transaction():
            await conn.execute("COMMIT")

    async def rollback(self, conn):
        if conn.is_in_transaction():
            await conn.execute("ROLLBACK")

    async def abort(self, conn):
        # asyncpg sends the server a cancel request when the task awaiting
        # a statement is cancelled; this one covers a timeout too.
        if conn.is_closed():
            return
        try:
            await _asyncpg_cancel(conn)
        except Exception:  # noqa: BLE001 - closing ends it too
            pass
        conn.terminate()

    def errors(self) -> Tuple[Type[BaseException], ...]:
        import asyncpg  # type: ignore[import]
        return (asyncpg.PostgresError, asyncpg.InterfaceError)


@contextlib.asynccontextmanager
async def _asyncpg_transaction(conn: Any) -> AsyncIterator[Any]:
    # asyncpg's Transaction, except that a block whose connection was
    # closed under it (abort) raises its own exception, not asyncpg's
    # "the underlying connection is closed".
    tx = conn.transaction()
    await tx.start()
    try:
        yield tx
    except BaseException:
        if not conn.is_closed():
            await tx.rollback()
        raise
    await tx.commit()


@contextlib.asynccontextmanager
async def _pipeline(drv: Driver, conn: Any) -> AsyncIterator[None]:
    # psycopg's pipeline, except that a task cancelled while it waits for
    # the results (a wait_for, asyncio.timeout) leaves no statement running
    # on the server: psycopg would go on waiting for them, or raise
    # "cannot exit pipeline mode while busy" in the CancelledError's
    # place.  The statements are cancelled and the connection closed (its
    # transaction rolls back), and the CancelledError goes on.
    try:
        async with conn.pipeline():
            yield
    except BaseException as exc:
        if isinstance(exc, psycopg.Error) and exc.sqlstate is not None:
            raise                       # the server's answer: the caller rolls back
        await asyncio.shield(drv.abort(conn))
        if not isinstance(exc, asyncio.CancelledError) and isinstance(
                exc.__context__, asyncio.CancelledError):
            raise exc.__context__ from None
        raise


async def _asyncpg_cancel(conn: Any) -> None:
    # asyncpg's cancel request of a running command (a new connection
    # sending CancelRequest with the backend's key), awaited.
    waiter = asyncio.get_running_loop().create_future()
    conn._cancel_current_command(waiter)
    await asyncio.wait_for(waiter, 5.0)


PSYCOPG = PsycopgDriver()
ASYNCPG = AsyncpgDriver()


def is_asyncpg(obj: Any) -> bool:
    """``obj`` is one of asyncpg's (a connection, a pool, a pooled
    connection's proxy), by its class's module: no import of asyncpg."""
    return type(obj).__module__.split(".")[0] == "asyncpg"


def driver_of(conn: Any) -> Driver:
    """The driver of a connection (or pool) object."""
    if is_asyncpg(conn):
        return ASYNCPG
    if isinstance(conn, (psycopg.AsyncConnection, psycopg.Connection)):
        return PSYCOPG
    raise TypeError("not a psycopg.AsyncConnection nor an asyncpg connection: %r" % (conn,))


def driver_errors(*extra: Type[BaseException]) -> Tuple[Type[BaseException], ...]:
    """The exception classes of every driver loaded, after ``extra`` (for
    ``except``)."""
    errs: Tuple[Type[BaseException], ...] = extra + PSYCOPG.errors()
    if "asyncpg" in sys.modules:
        errs = errs + ASYNCPG.errors()
    return errs


def asyncpg_error(exc: BaseException) -> Optional[Tuple[Optional[str], str]]:
    """(SQLSTATE or None, message) of an asyncpg error; None for any other."""
    mod = sys.modules.get("asyncpg")
    if mod is None:
        return None
    if isinstance(exc, mod.PostgresError):
        state = getattr(exc, "sqlstate", None)
        return state, (getattr(exc, "message", None) or str(exc)).strip()
    if isinstance(exc, mod.InterfaceError):
        # a closed connection or pool, a connection lost mid-statement
        return None, str(exc).strip()
    return None
