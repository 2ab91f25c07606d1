"""idem_pg.inbox without a broker: what process_batch commits and which
messages it tells the consumer to ack (inbox_kill.sh runs it against
RabbitMQ and Redis streams)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

import drivers
from conftest import new_key
from idem_pg import Outcome
from idem_pg._common import text
from idem_pg.inbox import Message, process_batch, process_batch_async


@pytest.fixture
def effects(db):
    db.execute("CREATE TABLE IF NOT EXISTS inbox_effects (queue text, msg_id text)")
    return db


def count(db, queue):
    rows = db.execute("SELECT msg_id, count(*) FROM inbox_effects WHERE queue = %s"
                      " GROUP BY msg_id", [queue]).fetchall()
    return {text(k): n for k, n in rows}


def test_process_batch(dsn, effects):
    queue = new_key("q")
    msgs = [Message("a"), Message("b"), Message("c"), Message("a")]
    fail = {"b"}

    def handle(conn, m):
        conn.execute("INSERT INTO inbox_effects VALUES (%s, %s)", [queue, m.id])
        if m.id in fail:
            raise RuntimeError("b fails")

    with psycopg.connect(dsn) as conn:
        ds = process_batch(conn, queue, msgs, handle)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert [(d.message.id, d.outcome, d.ack, d.duplicate_of) for d in ds] == [
        ("a", Outcome.EXECUTED, True, None), ("b", Outcome.EXECUTED, False, None),
        ("c", Outcome.EXECUTED, True, None), ("a", Outcome.EXECUTED, True, 0)]
    assert str(ds[1].error) == "b fails"
    assert count(effects, queue) == {"a": 1, "c": 1}
    # redelivered: a and c acked without running, b runs again
    fail.clear()
    with psycopg.connect(dsn) as conn:
        ds = process_batch(conn, queue, msgs[:3], handle)
    assert [(d.outcome, d.ack) for d in ds] == [(Outcome.REPLAYED, True),
                                                (Outcome.EXECUTED, True),
                                                (Outcome.REPLAYED, True)]
    assert count(effects, queue) == {"a": 1, "b": 1, "c": 1}


def test_killed_before_commit_leaves_nothing(dsn, effects):
    queue = new_key("q")

    class Died(BaseException):
        pass

    def die():
        raise Died

    with psycopg.connect(dsn) as conn:
        with pytest.raises(Died):
            process_batch(conn, queue, [Message("x")],
                          lambda c, m: c.execute("INSERT INTO inbox_effects VALUES (%s, %s)",
                                                 [queue, m.id]),
                          before_commit=die)
    assert count(effects, queue) == {}
    with psycopg.connect(dsn) as conn:
        ds = process_batch(conn, queue, [Message("x")],
                           lambda c, m: c.execute("INSERT INTO inbox_effects VALUES (%s, %s)",
                                                  [queue, m.id]))
    assert (ds[0].outcome, ds[0].ack) == (Outcome.EXECUTED, True)
    assert count(effects, queue) == {"x": 1}


def test_another_fingerprint_is_not_acked(dsn, effects):
    queue = new_key("q")
    with psycopg.connect(dsn) as conn:
        process_batch(conn, queue, [Message("m", fingerprint="v1")], lambda c, m: None)
        ds = process_batch(conn, queue, [Message("m", fingerprint="v2")], lambda c, m: None)
    assert (ds[0].outcome, ds[0].ack) == (Outcome.CONFLICT, False)


def test_process_batch_async(adriver, dsn, effects):
    queue = new_key("q")
    msgs = [Message("a"), Message("b")]

    async def handle(conn, m):
        await drivers.fetchrow(conn, "INSERT INTO inbox_effects VALUES (%s, %s) RETURNING 1",
                               [queue, m.id])
        if m.id == "b":
            raise RuntimeError("no")

    async def main():
        conn = await drivers.connect(adriver, dsn)
        try:
            ds = await process_batch_async(conn, queue, msgs, handle)
            assert [(d.outcome, d.ack) for d in ds] == [(Outcome.EXECUTED, True),
                                                        (Outcome.EXECUTED, False)]
            ds = await process_batch_async(conn, queue, msgs[:1], handle)
            assert [(d.outcome, d.ack) for d in ds] == [(Outcome.REPLAYED, True)]
        finally:
            await drivers.close(conn)

    asyncio.run(main())
    assert count(effects, queue) == {"a": 1}
