"""Batches: Guard.do_many, AsyncGuard.do_many, atomic_many and
atomic_many_async (one idem_begin_many call, one idem_complete_many)."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

import drivers
from conftest import lookup, new_key
from idem_pg import (AsyncGuard, Guard, InvalidArgument, Outcome, Response, atomic_many,
                     atomic_many_async)
from idem_pg._common import text
from test_round_trips import Traced


def echo(runs):
    def handler(i, claim):
        runs.append(i)
        return Response(201, ("%s#%d" % (claim.key, i)).encode())
    return handler


def summary(results):
    return [(r.outcome, r.response.body if r.response else None, r.duplicate_of)
            for r in results]


@pytest.fixture
def business(db):
    name = "batch_effects"
    db.execute("CREATE TABLE IF NOT EXISTS %s (key text, item int)" % name)
    return name


def test_order_and_per_item_outcomes(dsn, db):
    g = Guard(dsn)
    done, conflict, held, a, b = (new_key("m") for _ in range(5))
    g.do(done, "fp", lambda c: Response(200, b"before"))
    g.do(conflict, "fp", lambda c: Response(200, b"x"))
    g.begin(held, "fp", lease=30)          # committed, in flight
    items = [(b, "fp"), (done, "fp"), (conflict, "other"), (held, "fp"), (a, "fp")]
    runs = []
    res = g.do_many(items, echo(runs), wait_for=0)
    assert runs == [0, 4]                 # the claimed items, in input order
    assert summary(res) == [
        (Outcome.EXECUTED, ("%s#0" % b).encode(), None),
        (Outcome.REPLAYED, b"before", None),
        (Outcome.CONFLICT, None, None),
        (Outcome.IN_FLIGHT, None, None),
        (Outcome.EXECUTED, ("%s#4" % a).encode(), None)]
    assert res[3].lease_left is not None and 0 < res[3].lease_left <= 30
    assert all(r.error is None for r in res)
    assert res[0].expires_at is not None and res[1].expires_at is not None
    # the retry replays in order; nothing runs again
    again = g.do_many(items, echo(runs), wait_for=0)
    assert runs == [0, 4]
    assert [r.outcome for r in again] == [Outcome.REPLAYED, Outcome.REPLAYED,
                                          Outcome.CONFLICT, Outcome.IN_FLIGHT,
                                          Outcome.REPLAYED]
    assert [r.response.body for r in again if r.outcome is Outcome.REPLAYED] == [
        ("%s#0" % b).encode(), b"before", ("%s#4" % a).encode()]
    assert (lookup(db, a)["state"], lookup(db, held)["state"]) == ("DONE", "PROCESSING")


def test_duplicate_key_gets_first_result(dsn, db):
    g = Guard(dsn)
    k, other = new_key("dup"), new_key("dup")
    runs = []
    items = [(k, "fp"), (other, "fp"), (k, "fp"), (k, "changed")]
    res = g.do_many(items, echo(runs))
    assert runs == [0, 1]
    assert summary(res) == [
        (Outcome.EXECUTED, ("%s#0" % k).encode(), None),
        (Outcome.EXECUTED, ("%s#1" % other).encode(), None),
        (Outcome.EXECUTED, ("%s#0" % k).encode(), 0),
        (Outcome.CONFLICT, None, 0)]
    res = g.do_many(items, echo(runs))
    assert runs == [0, 1]
    assert summary(res)[2] == (Outcome.REPLAYED, ("%s#0" % k).encode(), 0)


def test_handler_failure_releases_only_its_item(dsn, db):
    g = Guard(dsn)
    keys = [new_key("hf") for _ in range(3)]
    items = [(k, "fp") for k in keys]
    runs = []

    def flaky(i, claim):
        runs.append(i)
        if i == 1 and len(runs) <= 3:
            raise ValueError("item 1 fails once")
        return Response(200, b"ok%d" % i)

    res = g.do_many(items, flaky)
    assert [r.outcome for r in res] == [Outcome.EXECUTED] * 3
    assert (res[1].failed_step, str(res[1].error), res[1].released) == (
        "handler", "item 1 fails once", True)
    assert res[0].error is None and res[2].error is None
    assert lookup(db, keys[1]) is None
    res = g.do_many(items, flaky)
    assert runs == [0, 1, 2, 1]
    assert [r.outcome for r in res] == [Outcome.REPLAYED, Outcome.EXECUTED, Outcome.REPLAYED]
    assert res[1].response == Response(200, b"ok1")


def test_wait_on_some_items(dsn, db):
    g = Guard(dsn)
    soon, stuck, fresh = new_key("w"), new_key("w"), new_key("w")
    tok = g.begin(soon, "fp", lease=30).token
    g.begin(stuck, "fp", lease=30)

    def finish():
        time.sleep(0.3)
        g.complete(soon, "fp", 201, b"theirs", tok)

    t = threading.Thread(target=finish)
    t.start()
    runs = []
    start = time.monotonic()
    res = g.do_many([(soon, "fp"), (stuck, "fp"), (fresh, "fp")], echo(runs), wait_for=1.5)
    took = time.monotonic() - start
    t.join()
    assert [r.outcome for r in res] == [Outcome.REPLAYED, Outcome.IN_FLIGHT, Outcome.EXECUTED]
    assert res[0].response == Response(201, b"theirs")
    assert runs == [2]
    assert 1.2 < took < 5.0, took       # one deadline for the batch


def test_claim_failure_runs_nothing(down_dsn):
    runs = []
    res = Guard(down_dsn, timeout=2).do_many([("a", "fp"), ("b", "fp")], echo(runs))
    assert [(r.outcome, r.failed_step) for r in res] == [(Outcome.UNAVAILABLE, "begin")] * 2
    assert runs == []


def test_bad_input(dsn):
    g = Guard(dsn)
    assert g.do_many([], echo([])) == []
    with pytest.raises(InvalidArgument):
        g.do_many(["not-a-pair"], echo([]))
    with psycopg.connect(dsn) as conn:
        assert atomic_many(conn, [], lambda i: (200, b"")) == []


def test_atomic_many_savepoint_per_item(dsn, db, business):
    keys = [new_key("am") for _ in range(3)]
    items = [(keys[0], "fp"), (keys[1], "fp"), (keys[2], "fp"), (keys[0], "fp")]
    with psycopg.connect(dsn) as conn:
        def handler(i):
            conn.execute("INSERT INTO batch_effects VALUES (%s, %s)", [keys[i], i])
            if i == 1:
                raise RuntimeError("no")
            return Response(201, b"done%d" % i)

        res = atomic_many(conn, items, handler)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert [(r.outcome, r.failed_step, r.duplicate_of) for r in res] == [
        (Outcome.EXECUTED, None, None), (Outcome.EXECUTED, "handler", None),
        (Outcome.EXECUTED, None, None), (Outcome.EXECUTED, None, 0)]
    assert res[3].response == Response(201, b"done0")
    effects = [(text(k), n) for k, n in db.execute(
        "SELECT key, item FROM batch_effects WHERE key = ANY(%s) ORDER BY item",
        [keys]).fetchall()]
    assert effects == [(keys[0], 0), (keys[2], 2)]
    assert lookup(db, keys[1]) is None
    assert [lookup(db, k)["state"] for k in (keys[0], keys[2])] == ["DONE", "DONE"]
    with psycopg.connect(dsn) as conn:
        res = atomic_many(conn, items, handler)
    assert [r.outcome for r in res] == [Outcome.REPLAYED, Outcome.EXECUTED,
                                        Outcome.REPLAYED, Outcome.REPLAYED]
    assert res[1].error is not None      # it raises every time


def test_atomic_many_error_rolls_back_everything(dsn, db, business):
    key = new_key("amx")
    with psycopg.connect(dsn) as conn:
        def handler(i):
            conn.execute("INSERT INTO batch_effects VALUES (%s, %s)", [key, i])
            return Response(200, b"x")

        with pytest.raises(KeyboardInterrupt):
            def interrupted(i):
                handler(i)
                raise KeyboardInterrupt
            atomic_many(conn, [(key, "fp")], interrupted)
    assert lookup(db, key) is None
    assert db.execute("SELECT count(*) FROM batch_effects WHERE key = %s",
                      [key]).fetchone()[0] == 0


# Round trips, counted as in test_round_trips.py.  do_many: the claim and
# the store, whatever the batch's size; a replay: the claim.  Without a
# timeout each is the statement alone (autocommit); with the default
# timeout BEGIN, its SET LOCAL, the statement and COMMIT go in one pipeline.
@pytest.mark.parametrize("timeout, new, replay", [(5.0, 2, 1), (None, 2, 1)])
@pytest.mark.parametrize("size", [1, 10, 100])
def test_do_many_round_trips(dsn, timeout, new, replay, size):
    items = [(new_key("rtm"), "fp") for _ in range(size)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        g = Guard(conn, timeout=timeout)
        with Traced(conn) as t:
            res = g.do_many(items, lambda i, c: Response(200, b"x"))
        assert {r.outcome for r in res} == {Outcome.EXECUTED}
        assert t.requests == new
        with Traced(conn) as t:
            res = g.do_many(items, lambda i, c: Response(200, b"x"))
        assert {r.outcome for r in res} == {Outcome.REPLAYED}
        assert t.requests == replay


@pytest.mark.parametrize("size", [1, 10])
def test_atomic_many_round_trips(dsn, size):
    """BEGIN, the claim, a SAVEPOINT and its RELEASE per claimed item, the
    store, COMMIT; a replayed batch: BEGIN, the claim, COMMIT."""
    items = [(new_key("rta"), "fp") for _ in range(size)]
    with psycopg.connect(dsn) as conn:
        with Traced(conn) as t:
            atomic_many(conn, items, lambda i: (200, b"x"))
        assert t.requests == 4 + 2 * size
        with Traced(conn) as t:
            res = atomic_many(conn, items, lambda i: (200, b"x"))
        assert {r.outcome for r in res} == {Outcome.REPLAYED}
        assert t.requests == 3


def test_async_do_many_round_trips(dsn):
    items = [(new_key("artm"), "fp") for _ in range(20)]

    async def handler(i, claim):
        return Response(200, b"x")

    async def main():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            g = AsyncGuard(conn, timeout=None)
            with Traced(conn) as t:
                res = await g.do_many(items, handler)
            assert {r.outcome for r in res} == {Outcome.EXECUTED} and t.requests == 2
            with Traced(conn) as t:
                res = await g.do_many(items, handler)
            assert {r.outcome for r in res} == {Outcome.REPLAYED} and t.requests == 1

    asyncio.run(main())


def test_async_do_many(adriver, dsn, db):
    k, held, fresh = new_key("adm"), new_key("adm"), new_key("adm")
    Guard(dsn).begin(held, "fp", lease=30)
    runs = []

    async def handler(i, claim):
        runs.append(i)
        await asyncio.sleep(0)
        if i == 3:
            raise ValueError("fails")
        return Response(201, b"%s" % claim.key.encode())

    async def main():
        g = AsyncGuard(drivers.target(adriver, dsn))
        items = [(k, "fp"), (held, "fp"), (k, "fp"), (fresh, "fp")]
        res = await g.do_many(items, handler, wait_for=0.3)
        assert runs == [0, 3]
        assert summary(res) == [(Outcome.EXECUTED, k.encode(), None),
                                (Outcome.IN_FLIGHT, None, None),
                                (Outcome.EXECUTED, k.encode(), 0),
                                (Outcome.EXECUTED, None, None)]
        assert (res[3].failed_step, res[3].released) == ("handler", True)
        res = await g.do_many(items, handler, wait_for=0)
        assert [r.outcome for r in res] == [Outcome.REPLAYED, Outcome.IN_FLIGHT,
                                            Outcome.REPLAYED, Outcome.EXECUTED]
        assert runs == [0, 3, 3]

    asyncio.run(main())
    assert lookup(db, fresh) is None


def test_atomic_many_async(adriver, dsn, db, business):
    keys = [new_key("ama") for _ in range(3)]
    items = [(k, "fp") for k in keys]

    async def main():
        conn = await drivers.connect(adriver, dsn)
        try:
            async def handler(i):
                await drivers.fetchrow(conn, "INSERT INTO batch_effects VALUES (%s, %s)"
                                       " RETURNING 1", [keys[i], i])
                if i == 2:
                    raise RuntimeError("item 2")
                return Response(201, b"a%d" % i)

            res = await atomic_many_async(conn, items, handler)
            assert [(r.outcome, r.failed_step) for r in res] == [
                (Outcome.EXECUTED, None), (Outcome.EXECUTED, None),
                (Outcome.EXECUTED, "handler")]
            res = await atomic_many_async(conn, items, handler)
            assert [r.outcome for r in res] == [Outcome.REPLAYED, Outcome.REPLAYED,
                                                Outcome.EXECUTED]
            assert res[1].response == Response(201, b"a1")
        finally:
            await drivers.close(conn)

    asyncio.run(main())
    effects = db.execute("SELECT item FROM batch_effects WHERE key = ANY(%s) ORDER BY item",
                         [keys]).fetchall()
    assert effects == [(0,), (1,)]


def test_overlapping_batches_in_opposite_orders(dsn):
    """Two threads claim the same keys in opposite orders, many times: no
    deadlock, every key executed once."""
    keys = [new_key("ov") for _ in range(20)]
    runs = []
    lock = threading.Lock()
    errors = []

    def handler(i, claim):
        with lock:
            runs.append(claim.key)
        return Response(200, b"x")

    def worker(order):
        g = Guard(dsn)
        for _ in range(5):
            res = g.do_many([(k, "fp") for k in order], handler, wait_for=5)
            errors.extend(r.error for r in res if r.error is not None)

    ts = [threading.Thread(target=worker, args=(o,)) for o in (keys, keys[::-1])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert sorted(runs) == sorted(keys)
