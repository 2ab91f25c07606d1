"""AsyncGuard: outcomes, the heartbeat, pools, and cancellation (the
asyncio.wait_for trap of issue 15), with each driver (psycopg, asyncpg)."""

import asyncio
import time
from datetime import timedelta

import psycopg
import pytest

from idem_pg import AsyncGuard, Outcome, Response, Timeout, Unavailable

import drivers
from conftest import lookup, new_key, wait_for
from test_guard import FP, HB_LEASE, hold_uncommitted_claim


class Calls:
    def __init__(self, response=Response(201, b"ok"), delay=0.0):
        self.n = 0
        self.tokens = []
        self.response = response
        self.delay = delay

    async def __call__(self, claim):
        self.n += 1
        self.tokens.append(claim.token)
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.response


def lock_waiters(db):
    return db.execute("SELECT count(*) FROM pg_stat_activity"
                      " WHERE wait_event_type = 'Lock'").fetchone()[0]


def test_outcomes(dsn, down_dsn, db, adriver):
    key = new_key()

    async def main():
        g = AsyncGuard(drivers.target(adriver, dsn))
        h = Calls(Response(201, b"\\x41\x00"))
        ex = await g.do(key, FP, h)
        rp = await g.do(key, FP, h)
        cf = await g.do(key, "other", h)
        other = new_key()
        await g.begin(other, FP)
        fl = await g.do(other, FP, h)
        dn = await AsyncGuard(drivers.target(adriver, down_dsn), timeout=2).do(new_key(), FP, h)
        return h, ex, rp, cf, fl, dn

    h, ex, rp, cf, fl, dn = asyncio.run(main())
    assert ex.outcome is Outcome.EXECUTED and ex.error is None and h.tokens == [ex.token]
    assert rp.outcome is Outcome.REPLAYED and rp.response == Response(201, b"\\x41\x00")
    assert cf.outcome is Outcome.CONFLICT
    assert fl.outcome is Outcome.IN_FLIGHT
    assert dn.outcome is Outcome.UNAVAILABLE and isinstance(dn.error, Unavailable)
    assert h.n == 1
    assert lookup(db, key)["state"] == "DONE"


def test_pool_source_and_heartbeat(dsn, adriver):
    key = new_key()

    async def main():
        async with drivers.pool(adriver, dsn, min_size=2, max_size=4) as pool, \
                await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watch:
            g = AsyncGuard(pool, lease=HB_LEASE, heartbeat=True)
            seen = {}

            async def server_past(when):
                cur = await watch.execute("SELECT clock_timestamp() > %s", [when])
                return (await cur.fetchone())[0]

            async def slow(claim):
                # runs until the server's clock is half a lease past the
                # claim's first lease_until, without blocking the event
                # loop the heartbeat runs on
                cur = await watch.execute(
                    "SELECT lease_until FROM public.idem_lookup(%s::text, '')", [key],
                    binary=True)
                end = (await cur.fetchone())[0] + timedelta(seconds=HB_LEASE / 2)
                deadline = time.monotonic() + 60
                while not await server_past(end):
                    assert time.monotonic() < deadline, "the first lease did not end"
                    await asyncio.sleep(0.05)
                seen["other"] = await AsyncGuard(pool, lease=HB_LEASE).do(key, FP, Calls())
                return Response(200, b"done")

            r = await g.do(key, FP, slow)
            assert r.failed_step != "handler", r.error
            return r, seen["other"], await g.do(key, FP, Calls())

    r, other, replay = asyncio.run(main())
    assert other.outcome is Outcome.IN_FLIGHT
    assert r.outcome is Outcome.EXECUTED and r.error is None and r.extends >= 2
    assert replay.outcome is Outcome.REPLAYED and replay.response.body == b"done"


def test_wait_for_cancels_server_wait_and_leaves_no_orphan(dsn, db, adriver):
    key = new_key()
    holder = hold_uncommitted_claim(dsn, key)
    h = Calls()

    async def main():
        g = AsyncGuard(drivers.target(adriver, dsn), timeout=None)          # no server-side limit: only the cancel
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(g.do(key, FP, h), 0.3)

    try:
        asyncio.run(main())
        wait_for(lambda: lock_waiters(db) == 0, timeout=30, what="the wait to be cancelled")
    finally:
        holder.rollback()
        holder.close()
    time.sleep(0.3)
    assert lookup(db, key) is None and h.n == 0


def test_naive_wait_for_leaves_orphan_claim(dsn, db):
    """Control: asyncio.wait_for around a bare psycopg execute abandons the
    statement on the client only; the server claims the key afterwards."""
    key = new_key()
    holder = hold_uncommitted_claim(dsn, key)

    async def main():
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(conn.execute(
                "SELECT claimed FROM public.idem_begin(%s::text, %s::text)", [key, FP]), 0.3)
        return conn

    conn = asyncio.run(main())
    try:
        # given up on the client, still waiting on the server
        wait_for(lambda: lock_waiters(db) == 1, timeout=30, what="the statement to wait")
        holder.rollback()
        row = wait_for(lambda: lookup(db, key), timeout=30, what="the orphan claim")
        assert row["state"] == "PROCESSING"
    finally:
        holder.close()
        conn.pgconn.finish()


def test_server_side_timeout(dsn, db, adriver):
    key = new_key()
    holder = hold_uncommitted_claim(dsn, key)
    h = Calls()
    try:
        start = time.monotonic()
        r = asyncio.run(AsyncGuard(drivers.target(adriver, dsn), timeout=0.5).do(key, FP, h))
        # a wait not bounded by timeout=0.5 would last at least the default 5 s
        assert time.monotonic() - start < 4.0
        assert r.outcome is Outcome.UNAVAILABLE and isinstance(r.error, Timeout)
        assert lock_waiters(db) == 0
    finally:
        holder.rollback()
        holder.close()
    time.sleep(0.3)
    assert lookup(db, key) is None and h.n == 0


def test_cancel_during_handler_releases_claim(dsn, db, adriver):
    key = new_key()
    started = {}

    async def handler(claim):
        started["token"] = claim.token
        await asyncio.sleep(30)
        return Response(200, b"never")

    async def main():
        g = AsyncGuard(drivers.target(adriver, dsn))
        task = asyncio.ensure_future(g.do(key, FP, handler))
        while "token" not in started:
            await asyncio.sleep(0.01)
        assert lookup(db, key)["state"] == "PROCESSING"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert lookup(db, key) is None                # released: a retry runs at once
