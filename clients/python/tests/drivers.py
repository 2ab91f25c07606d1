"""The asyncio drivers the async tests run against: psycopg 3 and asyncpg.

A test parametrized with the ``adriver`` fixture (conftest.py) runs once
with each; the test apps (apps/asgi_app.py, apps/conformance_asgi.py)
pick theirs from IDEM_TEST_DRIVER.  The helpers take a libpq conninfo
string (the suite's DSNs) and give the driver's own objects.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Sequence

import psycopg
from psycopg.conninfo import conninfo_to_dict

from idem_pg._drivers import driver_of

ASYNC_DRIVERS = ("psycopg", "asyncpg")


def asyncpg_params(dsn: str) -> dict:
    """asyncpg.connect's keyword arguments for a libpq conninfo string
    (host, port, user, dbname, connect_timeout, options='-c name=value')."""
    d = conninfo_to_dict(dsn)
    kw: dict = {"host": d.get("host"), "user": d.get("user"), "database": d.get("dbname")}
    if d.get("port"):
        kw["port"] = int(d["port"])
    if d.get("connect_timeout"):
        kw["timeout"] = float(d["connect_timeout"])
    settings = {}
    for opt in (d.get("options") or "").split("-c")[1:]:
        name, _, value = opt.strip().partition("=")
        settings[name.strip()] = value.strip()
    if settings:
        kw["server_settings"] = settings
    return kw


def target(driver: str, dsn: str) -> Any:
    """What an AsyncGuard is given for ``dsn``: the string (psycopg), or
    an async factory of asyncpg connections."""
    if driver == "psycopg":
        return dsn
    import asyncpg
    kw = asyncpg_params(dsn)
    return lambda: asyncpg.connect(**kw)


async def connect(driver: str, dsn: str) -> Any:
    """A connection of the caller's (psycopg: not in autocommit)."""
    if driver == "psycopg":
        return await psycopg.AsyncConnection.connect(dsn)
    import asyncpg
    return await asyncpg.connect(**asyncpg_params(dsn))


@contextlib.asynccontextmanager
async def pool(driver: str, dsn: str, min_size: int = 1, max_size: int = 4) -> AsyncIterator[Any]:
    if driver == "psycopg":
        from psycopg_pool import AsyncConnectionPool
        async with AsyncConnectionPool(dsn, min_size=min_size, max_size=max_size) as p:
            yield p
    else:
        import asyncpg
        p = await asyncpg.create_pool(min_size=min_size, max_size=max_size,
                                      **asyncpg_params(dsn))
        try:
            yield p
        finally:
            await p.close()


async def fetchrow(conn: Any, query: str, params: Sequence[Any] = ()) -> Any:
    """One statement (placeholders %s) on either driver's connection."""
    return await driver_of(conn).fetchrow(conn, query, params)


def closed(conn: Any) -> bool:
    return driver_of(conn).closed(conn)


async def close(conn: Any) -> None:
    await conn.close()
