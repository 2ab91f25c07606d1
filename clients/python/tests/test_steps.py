"""Multi-step work (issue 27): claim.step / claim.step_tx checkpoint each
finished step (idem_checkpoint); a takeover after the lease skips the
steps checkpointed, with their outputs, and runs the rest once; a stale
holder's step_tx is refused by idem_hold before its writes."""

import asyncio
import json
import threading
import time

import psycopg
import pytest

from idem_pg import (AlreadyCompleted, AsyncGuard, CheckpointUnreadable, FailN, Guard,
                     InvalidArgument, Outcome, Response, Step, TokenSuperseded)
from idem_pg._common import StepLog

from conftest import lookup, new_key, text

FP = "order=7"
# The first holder's lease; a takeover moves the server's clock past it.
LEASE = 30.0
LATER = LEASE + 5


class Crash(Exception):
    """The first attempt stops here, as a process killed mid-handler would."""


@pytest.fixture(scope="module", autouse=True)
def step_tables():
    from conftest import DSN
    with psycopg.connect(DSN, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS step_rows (key text, step text, token bigint)")
    yield


def rows(db, key):
    return [(text(step), token) for step, token in db.execute(
        "SELECT step, token FROM step_rows WHERE key = %s ORDER BY step", [key])]


def phase_of(db, key):
    phase, data = db.execute("SELECT phase, phase_data FROM idem.keys WHERE key = %s",
                             [key]).fetchone()
    return text(phase), data


class Work:
    """Three steps; counts the runs of each; crashes after ``crash_after``."""

    def __init__(self, crash_after=None):
        self.runs = {"reserve": 0, "charge": 0, "ship": 0}
        self.crash_after = crash_after
        self.seen = []
        self.provider_keys = []

    def reserve(self, step):
        self.runs["reserve"] += 1
        assert isinstance(step, Step) and step.name == "reserve"
        return {"reservation": "r-1", "token": step.token}

    def charge(self, step):
        self.runs["charge"] += 1
        self.provider_keys.append(step.idempotency_key)
        return "ch_1"

    def ship(self, step):
        self.runs["ship"] += 1
        return ["parcel", 1]

    def __call__(self, claim):
        a = claim.step("reserve", self.reserve)
        b = claim.step("charge", self.charge)
        self.seen.append((claim.phase, a, b, claim.skipped))
        if self.crash_after == "charge":
            raise Crash()
        c = claim.step("ship", self.ship)
        return Response(201, json.dumps([a, b, c]).encode())


def test_takeover_skips_checkpointed_steps_with_their_outputs(dsn, db):
    key = new_key("steps")
    first = Work(crash_after="charge")
    r = Guard(dsn, lease=LEASE).do(key, FP, first)
    assert r.failed_step == "handler" and isinstance(r.error, Crash)
    # a key that holds a checkpoint is not released: the next holder resumes
    assert r.released is False and lookup(db, key)["state"] == "PROCESSING"
    assert phase_of(db, key)[0] == "charge"
    token1 = r.token
    assert first.runs == {"reserve": 1, "charge": 1, "ship": 0}

    # before the lease ends the key is in flight
    assert Guard(dsn, lease=LEASE).do(key, FP, Work()).outcome is Outcome.IN_FLIGHT

    retry = Work()
    r2 = Guard(dsn, lease=LEASE, clock_offset=LATER).do(key, FP, retry)
    assert r2.outcome is Outcome.EXECUTED and r2.error is None and r2.token > token1
    assert retry.runs == {"reserve": 0, "charge": 0, "ship": 1}
    phase, a, b, skipped = retry.seen[0]
    assert phase == "charge" and skipped == ["reserve", "charge"]
    assert a == {"reservation": "r-1", "token": token1} and b == "ch_1"
    assert json.loads(r2.response.body) == [a, b, ["parcel", 1]]
    assert lookup(db, key)["state"] == "DONE"

    # the provider key is the same in both attempts: the token is not in it
    assert first.provider_keys == ["%s:charge" % key]

    again = Work()
    r3 = Guard(dsn, lease=LEASE, clock_offset=LATER).do(key, FP, again)
    assert r3.outcome is Outcome.REPLAYED and r3.response == r2.response
    assert again.runs == {"reserve": 0, "charge": 0, "ship": 0}


def test_fresh_claim_runs_every_step_and_returns_json_outputs(dsn, db):
    key = new_key("steps")
    seen = {}

    def handler(claim):
        assert claim.phase is None
        seen["t"] = claim.step("t", lambda s: ("a", 1))          # a tuple comes back a list
        seen["n"] = claim.step("n", lambda s: None)
        seen["outputs"] = claim.outputs
        return Response(200, b"ok")

    r = Guard(dsn, lease=LEASE).do(key, FP, handler)
    assert r.ok, r.error
    assert seen["t"] == ["a", 1] and seen["n"] is None
    assert seen["outputs"] == {"t": ["a", 1], "n": None}


def test_step_rules_checked_before_the_step_runs(dsn):
    key = new_key("steps")
    ran = []

    def handler(claim):
        claim.step("one", lambda s: ran.append(1) or "first")
        # a name that finished returns its output (names are unique in a handler)
        assert claim.step("one", lambda s: ran.append(2)) == "first"
        with pytest.raises(InvalidArgument):
            claim.step("", lambda s: ran.append(3))
        with pytest.raises(TypeError):
            claim.step("bytes", lambda s: b"\x00")               # not JSON: not checkpointed
        return Response(200, b"")

    r = Guard(dsn, lease=LEASE).do(key, FP, handler)
    assert r.ok, r.error
    assert ran == [1]


def test_step_tx_commits_writes_with_checkpoint_and_is_skipped_after(dsn, db):
    key = new_key("steptx")

    def write(step_name):
        def fn(conn):
            conn.execute("INSERT INTO step_rows VALUES (%s, %s, NULL)", [key, step_name])
            return step_name + "-done"
        return fn

    def first(claim):
        assert claim.step_tx("a", write("a")) == "a-done"
        # not JSON: the step's transaction rolls back, its row with it
        with pytest.raises(TypeError):
            claim.step_tx("b", lambda conn: write("b")(conn) and object())
        raise Crash()

    r = Guard(dsn, lease=LEASE).do(key, FP, first)
    assert isinstance(r.error, Crash)
    assert rows(db, key) == [("a", None)]
    assert phase_of(db, key)[0] == "a"

    def retry(claim):
        assert claim.step_tx("a", write("a")) == "a-done"      # skipped: no second row
        assert claim.step_tx("b", write("b")) == "b-done"
        return Response(200, b"done")

    r2 = Guard(dsn, lease=LEASE, clock_offset=LATER).do(key, FP, retry)
    assert r2.ok, r2.error
    assert rows(db, key) == [("a", None), ("b", None)]


def test_step_tx_on_callers_connection(dsn, db):
    key = new_key("steptx")
    with psycopg.connect(dsn) as conn:
        def handler(claim):
            claim.step_tx("w", lambda c: c.execute(
                "INSERT INTO step_rows VALUES (%s, 'w', %s)", [key, claim.token]) and 1,
                conn=conn)
            return Response(200, b"")

        r = Guard(dsn, lease=LEASE).do(key, FP, handler)
        assert r.ok, r.error
        conn.commit()
    assert rows(db, key) == [("w", r.token)]


def test_stale_holder_step_tx_is_refused_before_its_write(dsn, db):
    key = new_key("stale")
    out = {}

    def stale(claim):
        claim.step_tx("a", lambda conn: conn.execute(
            "INSERT INTO step_rows VALUES (%s, 'a', %s)", [key, claim.token]) and 1)
        # the lease ends; another process takes the key over
        taker = Guard(dsn, lease=LEASE, clock_offset=LATER)
        out["row"] = taker.begin(key, FP)
        wrote = []
        with pytest.raises(TokenSuperseded):
            claim.step_tx("b", lambda conn: wrote.append(conn.execute(
                "INSERT INTO step_rows VALUES (%s, 'b', %s)", [key, claim.token])))
        out["wrote"] = wrote
        # a plain step runs (outside the database), then its checkpoint is refused
        with pytest.raises(TokenSuperseded):
            claim.step("c", lambda s: "c")
        return Response(200, b"stale")

    r = Guard(dsn, lease=LEASE).do(key, FP, stale)
    row = out["row"]
    assert row.claimed and row.token > r.token
    assert row.phase == "a" and json.loads(row.phase_data) == {"a": 1}
    assert out["wrote"] == []                                  # fn never ran
    assert rows(db, key) == [("a", r.token)]                   # no business row of "b"
    assert r.failed_step == "complete" and isinstance(r.error, TokenSuperseded)


def test_takeover_waits_for_a_step_tx_in_progress(dsn, db):
    key = new_key("hold")
    out = {}

    def handler(claim):
        def fn(conn):
            taker = threading.Thread(target=lambda: out.update(
                row=Guard(dsn, lease=LEASE, clock_offset=LATER, timeout=60).begin(key, FP)))
            taker.start()
            time.sleep(0.5)
            out["waited"] = taker.is_alive()      # held FOR SHARE by this transaction
            conn.execute("INSERT INTO step_rows VALUES (%s, 'w', %s)", [key, claim.token])
            out["taker"] = taker
            return "w"
        claim.step_tx("w", fn)
        out["taker"].join(60)
        return Response(200, b"")

    r = Guard(dsn, lease=LEASE).do(key, FP, handler)
    assert out["waited"] is True
    row = out["row"]
    # the takeover came after the commit: it sees the step's checkpoint
    assert row.claimed and row.phase == "w" and json.loads(row.phase_data) == {"w": "w"}
    assert rows(db, key) == [("w", r.token)]
    assert isinstance(r.error, TokenSuperseded)


def test_checkpoint_of_completed_key_refused(dsn):
    key = new_key("done")
    g = Guard(dsn, lease=LEASE)
    r = g.do(key, FP, lambda claim: Response(200, b"x"))
    assert r.ok
    with pytest.raises(AlreadyCompleted):
        g.checkpoint(key, r.token, "late", b"{}")


def test_failed_checkpoint_fails_the_step(dsn, db):
    key = new_key("steps")
    g = Guard(dsn, lease=LEASE, fault=FailN("checkpoint", 1))
    ran = []

    def handler(claim):
        claim.step("a", lambda s: ran.append("a"))
        return Response(200, b"")

    r = g.do(key, FP, handler)
    assert r.failed_step == "handler" and ran == ["a"]
    # nothing was checkpointed: the claim is released, a retry runs at once
    assert r.released is True and lookup(db, key) is None


def test_async_takeover_resumes(dsn, db):
    key = new_key("asteps")
    runs = []

    async def step_fn(step):
        runs.append(step.name)
        await asyncio.sleep(0)
        return step.name.upper()

    def make(crash):
        async def handler(claim):
            a = await claim.step("a", step_fn)
            b = await claim.step_tx("b", lambda conn: _insert(conn, key, "b"))
            if crash:
                raise Crash()
            c = await claim.step("c", lambda s: "C")           # a sync function too
            return Response(200, json.dumps([a, b, c]).encode())
        return handler

    async def main():
        r = await AsyncGuard(dsn, lease=LEASE).do(key, FP, make(True))
        assert isinstance(r.error, Crash) and r.released is False
        r2 = await AsyncGuard(dsn, lease=LEASE, clock_offset=LATER).do(key, FP, make(False))
        return r, r2

    r, r2 = asyncio.run(main())
    assert r2.ok, r2.error
    assert json.loads(r2.response.body) == ["A", "b", "C"]
    assert runs == ["a"]
    assert rows(db, key) == [("b", None)]


async def _insert(conn, key, name):
    await conn.execute("INSERT INTO step_rows VALUES (%s, %s, NULL)", [key, name])
    return name


def test_async_stale_holder_step_tx_refused(dsn, db):
    key = new_key("astale")

    async def main():
        wrote = []

        async def stale(claim):
            await AsyncGuard(dsn, lease=LEASE, clock_offset=LATER).begin(key, FP)
            with pytest.raises(TokenSuperseded):
                await claim.step_tx("a", lambda conn: wrote.append(1))
            return Response(200, b"")

        r = await AsyncGuard(dsn, lease=LEASE).do(key, FP, stale)
        return r, wrote

    r, wrote = asyncio.run(main())
    assert wrote == [] and rows(db, key) == []
    assert isinstance(r.error, TokenSuperseded)


# -- the checkpoint's format, without a server ------------------------------------


def test_steplog_restores_outputs_and_encodes_map():
    log = StepLog("b", b'{"a":1,"b":{"x":[1,2]}}')
    assert log.start("k", "a") == (True, 1)
    assert log.start("k", "b") == (True, {"x": [1, 2]})
    assert log.start("k", "c") == (False, None)
    data, value = log.encode("c", ("t",))
    assert value == ["t"]
    assert data == b'{"a":1,"b":{"x":[1,2]},"c":["t"]}'        # in the order they finished
    log.done("c", value)
    assert log.start("k", "c") == (True, ["t"])


def test_steplog_refuses_a_recovery_point_steps_did_not_write():
    for bad in (None, b"not json", b"[1]", b"\xff", b'{"other":1}'):
        log = StepLog("a", bad)
        with pytest.raises(CheckpointUnreadable):
            log.start("k", "a")
        assert log.checkpointed                 # still not released on an error
    fresh = StepLog()
    assert fresh.start("k", "a") == (False, None) and not fresh.checkpointed


def test_provider_key_is_stable_across_tokens():
    assert Step("charge", "pay-7", "", 1).idempotency_key == "pay-7:charge"
    assert Step("charge", "pay-7", "", 9).idempotency_key == "pay-7:charge"
    assert Step("charge", "pay-7", "t1", 9).idempotency_key == "t1:pay-7:charge"


def test_server_without_phase_columns(dsn, db, caplog):
    """A schema whose idem_begin answers the seven columns of 1.3 (42703
    for phase): the guard logs a warning once, calls without them, and the
    steps run (nothing to resume from)."""
    db.execute("CREATE SCHEMA IF NOT EXISTS steps_old")
    db.execute("""CREATE OR REPLACE FUNCTION steps_old.idem_begin(text, text, interval,
        interval, text, boolean) RETURNS TABLE (claimed boolean, state text, token bigint,
        status integer, body bytea, lease_until timestamptz, expires_at timestamptz)
        LANGUAGE sql AS $$ SELECT claimed, state, token, status, body, lease_until,
        expires_at FROM public.idem_begin($1, $2, $3, $4, $5, $6) $$""")
    db.execute("""CREATE OR REPLACE FUNCTION steps_old.idem_complete(text, text, integer,
        bytea, bigint, interval, text) RETURNS timestamptz LANGUAGE sql
        AS $$ SELECT public.idem_complete($1, $2, $3, $4, $5, $6, $7) $$""")
    db.execute("""CREATE OR REPLACE FUNCTION steps_old.idem_checkpoint(text, bigint, text,
        bytea, text) RETURNS void LANGUAGE sql
        AS $$ SELECT public.idem_checkpoint($1, $2, $3, $4, $5) $$""")
    g = Guard(dsn, schema="steps_old", lease=LEASE)
    for _ in range(2):
        key = new_key("old")
        r = g.do(key, FP, lambda claim: Response(200, json.dumps(
            claim.step("a", lambda s: "A")).encode()))
        assert r.ok and r.response.body == b'"A"', r.error
        assert phase_of(db, key) == (None, None)          # a completion keeps nothing
    warnings = [m for m in caplog.messages if "no phase columns" in m]
    assert len(warnings) == 1
