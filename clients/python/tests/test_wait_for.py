"""wait_for: a duplicate of a request in flight waits in the server for
the holder's answer (Guard, AsyncGuard, atomic), and what it gets when the
holder completes, releases, or outlasts the wait."""

import asyncio
import logging
import threading
import time
import uuid

import psycopg
import pytest

from idem_pg import (AsyncGuard, Guard, InvalidArgument, Outcome, Response,
                     atomic, atomic_async)

from conftest import lookup, new_key, setting, wait_for
from test_guard import FP, Calls

# bytea escapes, NUL, not UTF-8: a replay must give these bytes back as they are
BODY = b"\\x41 \\\\ \x00 \xff\xfe '\"; -- \\000"
LONG_WAIT = 30.0


def named(dsn):
    """The DSN with an application_name of its own, to find its backend."""
    name = "idem-wait-%s" % uuid.uuid4().hex[:8]
    return dsn + " application_name=" + name, name


def waiting(db, name):
    """How many backends of that name are running a statement."""
    return db.execute("SELECT count(*) FROM pg_stat_activity"
                      " WHERE application_name = %s AND state = 'active'",
                      [name]).fetchone()[0]


class Background:
    """Runs fn in a thread; .result() joins it and returns (value, seconds)."""

    def __init__(self, fn):
        self.out = {}

        def main():
            start = time.monotonic()
            try:
                self.out["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self.out["error"] = exc
            self.out["elapsed"] = time.monotonic() - start

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def result(self, timeout=60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running after %s s" % timeout
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"], self.out["elapsed"]


# -- Guard ---------------------------------------------------------------------------


def test_holder_completes_while_duplicate_waits_replay_of_same_bytes(dsn, db):
    key, h = new_key("wf-done"), Calls()
    holder = Guard(dsn, lease=60)
    held = holder.begin(key, FP)                       # committed, running elsewhere
    assert held.claimed
    dup_dsn, name = named(dsn)
    dup = Background(lambda: Guard(dup_dsn, wait_for=LONG_WAIT).do(key, FP, h))
    wait_for(lambda: waiting(db, name) == 1, what="the duplicate to wait in the server")
    holder.complete(key, FP, 201, BODY, held.token)
    r, elapsed = dup.result()
    assert r.outcome is Outcome.REPLAYED and r.error is None
    assert r.response == Response(201, BODY) and r.response.body == BODY
    assert h.claims == []                              # the handler did not run twice
    assert elapsed < LONG_WAIT / 2                     # answered by the completion
    assert lookup(db, key)["token"] == held.token


def test_holder_releases_while_duplicate_waits_duplicate_claims(dsn, db):
    key, h = new_key("wf-rel"), Calls(Response(200, b"second"))
    holder = Guard(dsn, lease=60)
    held = holder.begin(key, FP)
    dup_dsn, name = named(dsn)
    dup = Background(lambda: Guard(dup_dsn, wait_for=LONG_WAIT).do(key, FP, h))
    wait_for(lambda: waiting(db, name) == 1, what="the duplicate to wait in the server")
    assert holder.release(key, held.token) is True
    r, elapsed = dup.result()
    assert r.outcome is Outcome.EXECUTED and r.error is None
    assert len(h.claims) == 1 and h.claims[0].token == r.token
    assert r.token > held.token                        # a new, greater token
    assert elapsed < LONG_WAIT / 2
    row = lookup(db, key)
    assert row["state"] == "DONE" and row["token"] == r.token and row["status"] == 200


def test_wait_runs_out_in_flight_with_lease_until(dsn, db):
    key, h = new_key("wf-out"), Calls()
    Guard(dsn, lease=60).begin(key, FP)
    start = time.monotonic()
    r = Guard(dsn, wait_for=1).do(key, FP, h)
    elapsed = time.monotonic() - start
    assert r.outcome is Outcome.IN_FLIGHT and r.response is None and r.error is None
    assert h.claims == [] and r.token is None
    assert elapsed >= 0.9                              # it did wait
    assert r.lease_until == lookup(db, key)["lease_until"]
    assert 30 < r.lease_left < 60                      # about 59 s of the 60 s lease


def test_call_timeout_leaves_room_for_the_wait(dsn, db):
    """timeout=1 with wait_for=2.5: the begin runs under a statement_timeout
    of 3.5 s, so the wait ends by itself (in flight), not by a Timeout."""
    key, h = new_key("wf-tmo"), Calls()
    Guard(dsn, lease=60).begin(key, FP)
    start = time.monotonic()
    r = Guard(dsn, timeout=1, wait_for=2.5).do(key, FP, h)
    elapsed = time.monotonic() - start
    assert r.outcome is Outcome.IN_FLIGHT and r.error is None, r.error
    assert elapsed >= 2.4 and h.claims == []


def test_statement_timeout_still_bounds_a_wait_on_an_uncommitted_holder(dsn, db):
    """The server's wait for an uncommitted claim is not covered by
    wait_for: timeout still ends it (57014), with wait_for added."""
    key, h = new_key("wf-unc"), Calls()
    holder = psycopg.connect(dsn)
    holder.execute("SELECT * FROM public.idem_begin(%s::text, %s::text)", [key, FP])
    try:
        start = time.monotonic()
        r = Guard(dsn, timeout=0.5, wait_for=1).do(key, FP, h)
        elapsed = time.monotonic() - start
        assert r.outcome is Outcome.UNAVAILABLE and r.error.sqlstate == "57014"
        assert 1.4 <= elapsed < 15 and h.claims == []
    finally:
        holder.rollback()
        holder.close()


def test_no_wait_without_wait_for_and_per_call_zero(dsn, db):
    key, h = new_key("wf-none"), Calls()
    Guard(dsn, lease=60).begin(key, FP)
    r = Guard(dsn).do(key, FP, h)                      # the 6-argument form
    assert r.outcome is Outcome.IN_FLIGHT
    assert r.lease_until == lookup(db, key)["lease_until"] and r.lease_left > 30
    g = Guard(dsn, wait_for=LONG_WAIT)
    for kwargs in ({"wait_for": 0}, {"wait": False}):  # each turns the guard's wait off
        start = time.monotonic()
        r = g.do(key, FP, h, **kwargs)
        assert r.outcome is Outcome.IN_FLIGHT and r.error is None, (kwargs, r.error)
        assert time.monotonic() - start < LONG_WAIT / 2
    assert h.claims == []


def test_wait_false_with_wait_for_is_refused(dsn):
    with pytest.raises(ValueError):
        Guard(dsn, wait=False, wait_for=1)
    with pytest.raises(ValueError):
        Guard(dsn, wait_for=-1)
    with pytest.raises(InvalidArgument) as e:          # the server's 22023
        Guard(dsn).begin(new_key(), FP, wait=False, wait_for=1)
    assert e.value.sqlstate == "22023"


def test_server_without_wait_for_answers_the_six_argument_form(dsn, db, caplog):
    """An extension without the 7-argument idem_begin (42883): the guard
    falls back to the 6-argument form, warns once, and keeps to it."""
    schema = "idem_old_%s" % uuid.uuid4().hex[:8]
    db.execute('CREATE SCHEMA "%s"' % schema)
    try:
        db.execute(f"""CREATE FUNCTION "{schema}".idem_begin(
                         text, text, interval, interval, text, boolean)
                       RETURNS TABLE (claimed boolean, state text, token bigint,
                                      status integer, body bytea,
                                      lease_until timestamptz, expires_at timestamptz)
                       LANGUAGE sql AS $$ SELECT false, 'PROCESSING', NULL::bigint,
                           NULL::integer, NULL::bytea, clock_timestamp() + interval '20 s',
                           clock_timestamp() + interval '1 day' $$""")
        g, h = Guard(dsn, schema=schema, wait_for=LONG_WAIT), Calls()
        with caplog.at_level(logging.WARNING, logger="idem_pg"):
            first = g.do(new_key(), FP, h)
            second = g.do(new_key(), FP, h)
        for r in (first, second):
            assert r.outcome is Outcome.IN_FLIGHT and r.error is None, r.error
            assert 10 < r.lease_left <= 20
        warnings = [m for m in caplog.messages if "idem_begin with wait_for not found in schema" in m]
        assert len(warnings) == 1 and h.claims == []
    finally:
        db.execute('DROP SCHEMA "%s" CASCADE' % schema)


# -- AsyncGuard ----------------------------------------------------------------------


def test_async_holder_completes_while_duplicate_waits(dsn, db):
    key = new_key("awf-done")
    calls = []

    async def handler(claim):
        calls.append(claim)
        return Response(200, b"not me")

    async def main():
        holder = AsyncGuard(dsn, lease=60)
        held = await holder.begin(key, FP)
        dup_dsn, name = named(dsn)
        task = asyncio.ensure_future(AsyncGuard(dup_dsn, wait_for=LONG_WAIT).do(key, FP, handler))
        await asyncio.to_thread(wait_for, lambda: waiting(db, name) == 1,
                                what="the duplicate to wait in the server")
        await holder.complete(key, FP, 201, BODY, held.token)
        start = time.monotonic()
        r = await asyncio.wait_for(task, 60)
        return r, time.monotonic() - start

    r, elapsed = asyncio.run(main())
    assert r.outcome is Outcome.REPLAYED and r.response == Response(201, BODY)
    assert calls == [] and elapsed < LONG_WAIT / 2


def test_async_cancelled_duplicate_ends_the_server_wait(dsn, db):
    key, h = new_key("awf-cancel"), Calls()
    held = Guard(dsn, lease=60).begin(key, FP)
    dup_dsn, name = named(dsn)

    async def handler(claim):
        return h(claim)

    async def main():
        g = AsyncGuard(dup_dsn, wait_for=LONG_WAIT)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(g.do(key, FP, handler), 1.0)

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < LONG_WAIT / 2
    # the server's wait was cancelled and its connection closed
    wait_for(lambda: waiting(db, name) == 0, what="the server's wait to end")
    assert db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                      [name]).fetchone()[0] == 0
    assert h.claims == [] and lookup(db, key)["token"] == held.token


# -- atomic ----------------------------------------------------------------------------


def test_atomic_waits_for_a_guard_claim_past_its_lock_timeout(dsn, db):
    """lock_timeout=0.5 with wait_for: the claim runs under lock_timeout
    0.5 s + wait_for, so a holder answering after 1.5 s is replayed."""
    key = new_key("atx-done")
    holder = Guard(dsn, lease=60)
    held = holder.begin(key, FP)
    dup_dsn, name = named(dsn)
    conn = psycopg.connect(dup_dsn, autocommit=True)
    before = setting(conn, "lock_timeout")

    def claim():
        with atomic(conn, key, FP, lock_timeout=0.5, wait_for=LONG_WAIT) as tx:
            return tx.outcome, tx.response

    try:
        dup = Background(claim)
        wait_for(lambda: waiting(db, name) == 1, what="the claim to wait in the server")
        time.sleep(1.5)                                # past lock_timeout alone
        holder.complete(key, FP, 201, BODY, held.token)
        (outcome, response), elapsed = dup.result()
        assert outcome is Outcome.REPLAYED and response == Response(201, BODY)
        assert elapsed < LONG_WAIT / 2
        assert setting(conn, "lock_timeout") == before
    finally:
        conn.close()


def test_atomic_wait_runs_out_in_flight(dsn, db):
    key = new_key("atx-out")
    Guard(dsn, lease=60).begin(key, FP)
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.monotonic()
        with atomic(conn, key, FP, wait_for=1) as tx:
            outcome, row = tx.outcome, tx.row
        assert time.monotonic() - start >= 0.9
    assert outcome is Outcome.IN_FLIGHT and not row.claimed
    assert row.lease_until == lookup(db, key)["lease_until"] and row.lease_left > 30


def test_atomic_async_holder_releases_duplicate_claims(dsn, db):
    key = new_key("atx-rel")
    holder = Guard(dsn, lease=60)
    held = holder.begin(key, FP)
    dup_dsn, name = named(dsn)

    async def main():
        async with await psycopg.AsyncConnection.connect(dup_dsn, autocommit=True) as conn:
            async def claim():
                async with atomic_async(conn, key, FP, wait_for=LONG_WAIT) as tx:
                    claimed, token = tx.claimed, tx.token
                    await tx.complete(200, b"second")
                return claimed, token

            task = asyncio.ensure_future(claim())
            await asyncio.to_thread(wait_for, lambda: waiting(db, name) == 1,
                                    what="the claim to wait in the server")
            await asyncio.to_thread(holder.release, key, held.token)
            return await asyncio.wait_for(task, 60)

    claimed, token = asyncio.run(main())
    assert claimed is True and token > held.token
    row = lookup(db, key)
    assert row["state"] == "DONE" and row["token"] == token
