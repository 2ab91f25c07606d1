"""Round trips of a guard call, counted in libpq's trace of the messages
the client sends: every request ends in one Sync (extended protocol) or
is one Query (simple protocol)."""

from __future__ import annotations

import asyncio
import tempfile
import threading

import psycopg
import pytest
from psycopg import pq

from conftest import lookup, new_key
from idem_pg import AsyncGuard, Guard, Outcome, Response


class Traced:
    """Counts the requests conn sends while the block runs."""

    def __init__(self, conn):
        self.conn = conn
        self.requests = None

    def __enter__(self):
        self.file = tempfile.TemporaryFile()
        self.conn.pgconn.trace(self.file.fileno())
        self.conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        return self

    def __exit__(self, *exc):
        self.conn.pgconn.untrace()
        self.file.seek(0)
        lines = self.file.read().decode("utf-8", "replace").splitlines()
        self.file.close()
        self.requests = sum(1 for line in lines if line.startswith("F")
                            and line.split("\t")[2:3] in (["Sync"], ["Query"]))
        return False


def handler(claim):
    return Response(201, b"once")


# A new key is a claim and a complete; a replay, a claim.
# With the default timeout each is BEGIN and its SET LOCAL in one message,
# the statement, COMMIT; without one, the statement alone (autocommit).
@pytest.mark.parametrize("timeout, new, replay", [(5.0, 2, 1), (None, 2, 1)])
def test_guard_round_trips(dsn, db, timeout, new, replay):
    key = new_key("rt")
    with psycopg.connect(dsn, autocommit=True) as conn:
        g = Guard(conn, timeout=timeout)
        with Traced(conn) as t:
            r = g.do(key, "fp", handler)
        assert (r.outcome, r.error, t.requests) == (Outcome.EXECUTED, None, new)
        with Traced(conn) as t:
            r = g.do(key, "fp", handler)
        assert (r.outcome, r.response.body, t.requests) == (Outcome.REPLAYED, b"once", replay)
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    row = lookup(db, key)
    assert (row["state"], row["status"]) == ("DONE", 201)


@pytest.mark.parametrize("timeout, new, replay", [(5.0, 2, 1), (None, 2, 1)])
def test_async_guard_round_trips(dsn, db, timeout, new, replay):
    key = new_key("art")

    async def ahandler(claim):
        return Response(201, b"once")

    async def main():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            g = AsyncGuard(conn, timeout=timeout)
            with Traced(conn) as t:
                r = await g.do(key, "fp", ahandler)
            assert (r.outcome, r.error, t.requests) == (Outcome.EXECUTED, None, new)
            with Traced(conn) as t:
                r = await g.do(key, "fp", ahandler)
            assert (r.outcome, r.response.body, t.requests) == (Outcome.REPLAYED, b"once", replay)

    asyncio.run(main())
    row = lookup(db, key)
    assert (row["state"], row["status"]) == ("DONE", 201)


def test_timeout_ends_with_the_call(dsn):
    """The statement_timeout set with BEGIN is the call's transaction's
    only: the session's is back after it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        g = Guard(conn, timeout=0.3)
        r = g.do(new_key("rt-t"), "fp", lambda claim: Response(200, b""))
        assert r.outcome is Outcome.EXECUTED
        assert conn.execute("SHOW statement_timeout").fetchone()[0] in ("0", b"0")


def test_a_shorter_session_statement_timeout_is_kept(dsn, db):
    """The guard's timeout bounds a call, never loosens the session's own
    shorter statement_timeout: with timeout=3600 and a session at 200 ms, a
    claim waiting for a holder ends at 200 ms (57014)."""
    key = new_key("rt-s")
    holder = psycopg.connect(dsn)
    holder.execute("SELECT * FROM public.idem_begin(%s::text, 'fp'::text)", [key])
    conn = psycopg.connect(dsn, autocommit=True, options="-c statement_timeout=200")
    result = []
    t = threading.Thread(target=lambda: result.append(Guard(conn, timeout=3600).do(key, "fp", handler)),
                         daemon=True)
    try:
        t.start()
        t.join(60)
        ended_while_held = bool(result)
    finally:
        # a call still waiting ends once the holder is gone
        holder.rollback()
        holder.close()
        t.join(60)
    try:
        assert ended_while_held, "the call waited on: the guard's timeout replaced the session's"
        r = result[0]
        assert (r.outcome, getattr(r.error, "sqlstate", None)) == (Outcome.UNAVAILABLE, "57014")
        assert conn.execute("SHOW statement_timeout").fetchone()[0] in ("200ms", b"200ms")
    finally:
        conn.close()
    assert lookup(db, key) is None


# Every other answer of a claim is one round trip too, and a step
# (Claim.step: idem_checkpoint in its own transaction) adds one; with the
# default timeout or without (BEGIN, the SET LOCAL, the statement and
# COMMIT in one pipeline).
@pytest.mark.parametrize("timeout", [5.0, None])
def test_every_path_round_trips(dsn, db, timeout):
    with psycopg.connect(dsn, autocommit=True) as conn:
        g = Guard(conn, timeout=timeout)
        key = new_key("rtp")
        g.do(key, "fp", handler)
        with Traced(conn) as t:
            r = g.do(key, "other", handler)
        assert (r.outcome, t.requests) == (Outcome.CONFLICT, 1)
        held = new_key("rtp-h")
        db.execute("SELECT * FROM public.idem_begin(%s::text, 'fp'::text)", [held])
        db.commit()
        with Traced(conn) as t:
            r = g.do(held, "fp", handler)
        assert (r.outcome, t.requests) == (Outcome.IN_FLIGHT, 1)

        def stepped(claim):
            claim.step("one", lambda s: 1)
            claim.step("two", lambda s: 2)
            return Response(201, b"once")
        with Traced(conn) as t:
            r = g.do(new_key("rtp-s"), "fp", stepped)
        assert (r.outcome, r.error, t.requests) == (Outcome.EXECUTED, None, 4)
