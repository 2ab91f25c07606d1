"""The one-transaction helper on the caller's connection."""

import asyncio
import threading
import time

import psycopg
import pytest

from idem_pg import (ClaimNotCompleted, Guard, Outcome, Response, Timeout, Unavailable,
                     atomic, atomic_async)

import drivers
from conftest import lookup, new_key, setting, wait_for
from test_guard import FP, hold_uncommitted_claim


def stock_row(db, sku, qty=10):
    db.execute("INSERT INTO stock VALUES (%s, %s) ON CONFLICT (sku) DO UPDATE SET qty = %s",
               [sku, qty, qty])


def qty(db, sku):
    return db.execute("SELECT qty FROM stock WHERE sku = %s", [sku]).fetchone()[0]


def order(conn, key, sku, body=b'{"order":42}'):
    with atomic(conn, key, FP) as tx:
        if not tx.claimed:
            return tx
        conn.execute("UPDATE stock SET qty = qty - 1 WHERE sku = %s", [sku])
        tx.complete(201, body)
        return tx


def test_claim_writes_and_response_commit_together(dsn, db):
    key, sku = new_key(), new_key("sku")
    stock_row(db, sku)
    body = b"\\x41\x00{\"order\":42}"
    with psycopg.connect(dsn) as conn:
        tx = order(conn, key, sku, body)
        assert tx.outcome is Outcome.EXECUTED and tx.completed and tx.expires_at is not None
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # committed
        again = order(conn, key, sku)
        assert again.outcome is Outcome.REPLAYED
        assert again.response == Response(201, body)
    assert qty(db, sku) == 9
    assert lookup(db, key)["state"] == "DONE"


def test_exception_rolls_back_claim_and_writes(dsn, db):
    key, sku = new_key(), new_key("sku")
    stock_row(db, sku)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(RuntimeError):
            with atomic(conn, key, FP) as tx:
                assert tx.claimed
                conn.execute("UPDATE stock SET qty = qty - 1 WHERE sku = %s", [sku])
                raise RuntimeError("payment declined")
        assert qty(db, sku) == 10 and lookup(db, key) is None
        assert order(conn, key, sku).outcome is Outcome.EXECUTED
    assert qty(db, sku) == 9


def test_claim_without_complete_is_rolled_back(dsn, db):
    key, sku = new_key(), new_key("sku")
    stock_row(db, sku)
    with psycopg.connect(dsn) as conn:
        with pytest.raises(ClaimNotCompleted):
            with atomic(conn, key, FP):
                conn.execute("UPDATE stock SET qty = qty - 1 WHERE sku = %s", [sku])
    assert qty(db, sku) == 10 and lookup(db, key) is None


def test_eight_concurrent_clients_one_execution(dsn, db):
    key, sku = new_key(), new_key("sku")
    stock_row(db, sku)
    barrier = threading.Barrier(8)
    outcomes, bodies = [], []

    def client():
        with psycopg.connect(dsn) as conn:
            barrier.wait()
            with atomic(conn, key, FP) as tx:
                if tx.claimed:
                    conn.execute("UPDATE stock SET qty = qty - 1 WHERE sku = %s", [sku])
                    time.sleep(0.02)
                    tx.complete(201, b"reserved")
                else:
                    bodies.append(tx.response.body)
                outcomes.append(tx.outcome)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outcomes.count(Outcome.EXECUTED) == 1
    assert outcomes.count(Outcome.REPLAYED) == 7          # they waited, then replayed
    assert bodies == [b"reserved"] * 7
    assert qty(db, sku) == 9


def test_conflict_and_in_flight(dsn):
    key = new_key()
    with psycopg.connect(dsn) as conn:
        with atomic(conn, key, FP) as tx:
            tx.complete(200, b"x")
        with atomic(conn, key, "other") as tx:
            assert tx.outcome is Outcome.CONFLICT and tx.response is None
        key2 = new_key()
        Guard(dsn).begin(key2, FP)                      # a committed multi-step claim
        with atomic(conn, key2, FP) as tx:
            assert tx.outcome is Outcome.IN_FLIGHT
            with pytest.raises(ClaimNotCompleted):
                tx.complete(200, b"x")


def test_lock_timeout_bounds_the_wait_and_is_restored(dsn, db):
    key = new_key()
    holder = hold_uncommitted_claim(dsn, key)
    try:
        with psycopg.connect(dsn) as conn:
            start = time.monotonic()
            with pytest.raises(Timeout) as e:
                with atomic(conn, key, FP, lock_timeout=0.3):
                    pass
            # without lock_timeout the wait lasts as long as the holder
            assert e.value.sqlstate == "55P03" and time.monotonic() - start < 5
            with atomic(conn, new_key(), FP, lock_timeout=0.3) as tx:
                assert setting(conn, "lock_timeout") == "0"
                tx.complete(200, b"")
    finally:
        holder.rollback()
        holder.close()
    assert lookup(db, key) is None


def test_inside_callers_transaction_commits_with_it(dsn, db):
    key, sku = new_key(), new_key("sku")
    stock_row(db, sku)
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO orders VALUES (%s, %s, 1)", [key, sku])
        with atomic(conn, key, FP) as tx:            # a savepoint in the open transaction
            conn.execute("UPDATE stock SET qty = qty - 1 WHERE sku = %s", [sku])
            tx.complete(201, b"ok")
        assert lookup(db, key) is None               # not committed yet
        conn.commit()
    assert lookup(db, key)["state"] == "DONE" and qty(db, sku) == 9


def test_async_helper_and_cancelled_wait(dsn, db, adriver):
    key, sku = new_key(), new_key("sku")
    stock_row(db, sku)

    async def main():
        conn = await drivers.connect(adriver, dsn)
        try:
            async with atomic_async(conn, key, FP) as tx:
                assert tx.claimed
                await drivers.fetchrow(conn, "UPDATE stock SET qty = qty - 1 WHERE sku = %s",
                                       [sku])
                await tx.complete(201, b"async")
            async with atomic_async(conn, key, FP) as tx:
                assert tx.outcome is Outcome.REPLAYED and tx.response.body == b"async"
            if adriver == "psycopg":
                await conn.commit()
        finally:
            await conn.close()

    asyncio.run(main())
    assert qty(db, sku) == 9

    key2 = new_key()
    holder = hold_uncommitted_claim(dsn, key2)

    async def cancelled():
        conn = await drivers.connect(adriver, dsn)

        async def claim():
            async with atomic_async(conn, key2, FP) as tx:
                await tx.complete(200, b"x")

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(claim(), 0.3)
        return conn

    try:
        conn = asyncio.run(cancelled())
        assert drivers.closed(conn)
        wait_for(lambda: db.execute("SELECT count(*) FROM pg_stat_activity"
                                    " WHERE wait_event_type = 'Lock'").fetchone()[0] == 0,
                 timeout=30, what="the wait to be cancelled")
    finally:
        holder.rollback()
        holder.close()
    time.sleep(0.3)
    assert lookup(db, key2) is None


def test_arguments_reach_the_server(dsn, db):
    """atomic() with every default sends only the key and fingerprint, and
    with scope, lease and retention all of them: both reach the server."""
    def left(scope, key, col, conn=db):
        # binary: the suite also runs with extra_float_digits = -15
        return conn.execute("SELECT extract(epoch FROM %s - clock_timestamp())::float8"
                            " FROM idem.keys WHERE scope = %%s AND key = %%s" % col,
                            [scope, key], binary=True).fetchone()[0]

    default = db.execute("SELECT setting::int FROM pg_settings"
                         " WHERE name = 'idem.default_retention'").fetchone()[0]
    key, key2, key3 = new_key(), new_key(), new_key()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with atomic(conn, key, FP) as tx:
            tx.complete(200, b"d")
        with atomic(conn, key2, FP, scope="tenant-arg", lease=30, retention=120) as tx:
            assert tx.claimed
            assert 20 < left("tenant-arg", key2, "lease_until", conn) <= 30
            tx.complete(201, b"s")
        with atomic(conn, key3, FP, scope="tenant-arg") as tx:
            tx.complete(202, b"r", retention=90)
        with atomic(conn, key2, FP, scope="tenant-arg") as tx:
            assert tx.outcome is Outcome.REPLAYED and tx.response == Response(201, b"s")
    assert lookup(db, key)["state"] == "DONE" and lookup(db, key, "tenant-arg") is None
    assert default - 10 < left("", key, "expires_at") <= default
    assert lookup(db, key2) is None and lookup(db, key2, "tenant-arg")["status"] == 201
    assert 110 < left("tenant-arg", key2, "expires_at") <= 120
    assert 80 < left("tenant-arg", key3, "expires_at") <= 90


def test_unknown_state_is_unavailable(dsn, future_schema):
    """A state this client does not know (a newer server, played by a
    look-alike idem_begin) raises Unavailable at the claim: the block does
    not run and nothing is committed."""
    ran = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(Unavailable, match="unknown state 'TOMBSTONED'"):
            with atomic(conn, new_key(), FP, schema=future_schema):
                ran.append(True)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert ran == []
