"""The synchronous guard: one test per outcome, the named exceptions, the
heartbeat, and the traps of issue 15 (uncommitted claims, bodies as
strings, a timeout that leaves the server waiting)."""

import concurrent.futures
import time
from datetime import timedelta

import psycopg
import pytest

from idem_pg import (AlreadyCompleted, FailN, FingerprintMismatch,
                     Guard, InjectedFault, InvalidArgument, NoLiveClaim, Outcome,
                     Response, Timeout, TokenSuperseded, Unavailable)
from idem_pg._common import NOT_STORED_BODY, BeginRow, statements

from conftest import lookup, new_key, wait_for

FP = "sku=A&qty=1"


class Calls:
    def __init__(self, response=Response(201, b'{"order":1}')):
        self.claims = []
        self.response = response

    def __call__(self, claim):
        self.claims.append(claim)
        return self.response


def hold_uncommitted_claim(dsn, key):
    """Another transaction claims key and does not commit: idem_begin
    callers with wait=true wait for it."""
    holder = psycopg.connect(dsn)
    holder.execute("SELECT * FROM public.idem_begin(%s::text, %s::text)", [key, FP])
    return holder


# -- outcomes ------------------------------------------------------------------


def test_executed_passes_token_and_stores_response(dsn, db):
    key, h = new_key(), Calls()
    r = Guard(dsn).do(key, FP, h)
    assert r.outcome is Outcome.EXECUTED and r.error is None and r.ok
    assert len(h.claims) == 1
    claim = h.claims[0]
    assert (claim.key, claim.scope, claim.fingerprint) == (key, "", FP)
    assert isinstance(claim.token, int) and claim.token == r.token
    row = lookup(db, key)
    assert row["state"] == "DONE" and row["status"] == 201
    assert row["token"] == r.token and row["body_size"] == len(b'{"order":1}')


def test_replayed_returns_stored_bytes_exactly(dsn):
    key = new_key()
    body = b"\\x41 \\\\ \x00 \xff\xfe '\"; -- \\000"      # bytea escapes, NUL, not UTF-8
    g = Guard(dsn)
    assert g.do(key, FP, Calls(Response(200, body))).outcome is Outcome.EXECUTED
    h = Calls()
    r = g.do(key, FP, h)
    assert r.outcome is Outcome.REPLAYED and h.claims == []
    assert r.response == Response(200, body) and r.response.body == body
    # a str body is stored as its UTF-8 bytes, not parsed as a bytea literal
    key2 = new_key()
    g.do(key2, FP, lambda c: (200, "\\x41 é"))
    assert g.do(key2, FP, Calls()).response.body == "\\x41 é".encode("utf-8")


def test_in_flight(dsn, db):
    key, h = new_key(), Calls()
    g = Guard(dsn)
    held = g.begin(key, FP)                        # a committed claim elsewhere
    assert held.claimed
    r = g.do(key, FP, h)
    assert r.outcome is Outcome.IN_FLIGHT and r.response is None and h.claims == []
    assert lookup(db, key)["token"] == held.token


def test_conflict(dsn):
    key, h = new_key(), Calls()
    g = Guard(dsn)
    g.do(key, FP, Calls())
    r = g.do(key, "sku=A&qty=2", h)
    assert r.outcome is Outcome.CONFLICT and r.response is None and h.claims == []


def test_state_as_bytes_and_unknown_states():
    """A SQL_ASCII database hands state and phase over as bytes: they are
    read as text.  A state the client does not know is an error, not an
    in-flight answer (which would answer 409 to a stored key forever)."""
    done = BeginRow.of((False, b"DONE", None, 201, b"x", None, None, None, b"charge", None))
    assert done.state == "DONE" and done.phase == "charge"
    assert done.outcome() is Outcome.REPLAYED and done.response() == Response(201, b"x")
    assert BeginRow.of((False, b"CONFLICT", None, None, None)).outcome() is Outcome.CONFLICT
    assert BeginRow.of((False, b"PROCESSING", 7, None, None)).outcome() is Outcome.IN_FLIGHT
    expired = BeginRow.of((False, b"EXPIRED", None, 201, None))
    assert expired.outcome() is Outcome.EXPIRED and expired.response() is None
    with pytest.raises(Unavailable, match="unknown state 'TOMBSTONED'"):
        BeginRow.of((False, "TOMBSTONED", None, None, None)).outcome()


def test_unknown_state_is_unavailable_without_the_handler(dsn, monkeypatch):
    key, h = new_key(), Calls()
    g = Guard(dsn)
    monkeypatch.setattr(g, "begin", lambda *a, **k: BeginRow.of((False, "TOMBSTONED", None,
                                                                  None, None)))
    r = g.do(key, FP, h)
    assert r.outcome is Outcome.UNAVAILABLE and r.failed_step == "begin"
    assert isinstance(r.error, Unavailable) and h.claims == []


def test_unavailable_when_server_down(down_dsn):
    h = Calls()
    r = Guard(down_dsn, timeout=2).do(new_key(), FP, h)
    assert r.outcome is Outcome.UNAVAILABLE and r.failed_step == "begin"
    assert isinstance(r.error, Unavailable) and h.claims == []


def test_unavailable_on_read_only_server_25006(dsn, db):
    key, h = new_key(), Calls()
    ro = dsn + " options='-c default_transaction_read_only=on'"
    r = Guard(ro).do(key, FP, h)
    assert r.outcome is Outcome.UNAVAILABLE and h.claims == []
    assert isinstance(r.error, Unavailable) and r.error.sqlstate == "25006"
    assert lookup(db, key) is None


def test_unavailable_by_fault_at_begin(dsn, db):
    key, h = new_key(), Calls()
    r = Guard(dsn, fault=FailN("begin", 1)).do(key, FP, h)
    assert r.outcome is Outcome.UNAVAILABLE and isinstance(r.error, InjectedFault)
    assert h.claims == [] and lookup(db, key) is None


# -- handler errors, heartbeat ---------------------------------------------------------


def test_handler_error_releases_claim(dsn, db):
    key = new_key()

    def fails(claim):
        raise ValueError("provider said no")

    g = Guard(dsn)
    r = g.do(key, FP, fails)
    assert r.outcome is Outcome.EXECUTED and r.failed_step == "handler"
    assert isinstance(r.error, ValueError) and r.released is True
    assert lookup(db, key) is None
    assert g.do(key, FP, Calls()).outcome is Outcome.EXECUTED      # retried at once


def test_keep_claim_on_error_leaves_it_to_the_lease(dsn, db):
    key = new_key()
    g = Guard(dsn, keep_claim_on_error=True)
    r = g.do(key, FP, lambda c: 1 / 0)
    assert isinstance(r.error, ZeroDivisionError) and r.released is False
    assert lookup(db, key)["state"] == "PROCESSING"
    assert g.do(key, FP, Calls()).outcome is Outcome.IN_FLIGHT


# The heartbeat extends every third of the lease: each extend has two
# thirds of a lease (2 s) to land before the lease it renews ends.
HB_LEASE = 3.0


def server_past(conn, when):
    """True once the server's clock is past ``when``."""
    return conn.execute("SELECT clock_timestamp() > %s", [when]).fetchone()[0]


def _overlapping(dsn, db, heartbeat):
    """A handler that runs until the server's clock is half a lease past
    its claim's first lease_until; another caller tries the key then."""
    key = new_key()
    other = {}

    def slow(claim):
        end = lookup(db, key)["lease_until"] + timedelta(seconds=HB_LEASE / 2)
        wait_for(lambda: server_past(db, end), timeout=60, step=0.05,
                 what="the first lease to end")
        other["r"] = Guard(dsn, lease=HB_LEASE).do(key, FP, Calls())
        return Response(200, b"done")

    r = Guard(dsn, lease=HB_LEASE, heartbeat=heartbeat).do(key, FP, slow)
    assert r.failed_step != "handler", r.error
    return r, other["r"]


def test_heartbeat_extends_lease(dsn, db):
    r, other = _overlapping(dsn, db, heartbeat=True)
    assert other.outcome is Outcome.IN_FLIGHT
    assert r.outcome is Outcome.EXECUTED and r.error is None and r.extends >= 2
    assert r.superseded is False


def test_without_heartbeat_lease_is_taken_over(dsn, db):
    r, other = _overlapping(dsn, db, heartbeat=False)
    assert other.outcome is Outcome.EXECUTED and other.token > r.token
    assert r.failed_step == "complete" and isinstance(r.error, TokenSuperseded)


def test_heartbeat_notices_superseded_token(dsn):
    key = new_key()
    seen = {}

    def handler(claim):
        taker = Guard(dsn, clock_offset=5).do(key, FP, Calls())   # after the lease
        seen["taker"] = taker
        wait_for(lambda: claim.lost, timeout=30, what="the heartbeat to notice")
        return Response(200, b"late")

    r = Guard(dsn, lease=0.9, heartbeat=True).do(key, FP, handler)
    assert seen["taker"].outcome is Outcome.EXECUTED
    assert r.superseded is True
    assert r.failed_step == "complete" and isinstance(r.error, TokenSuperseded)


# -- named exceptions ----------------------------------------------------------


def test_id001_fingerprint_mismatch(dsn):
    g, key = Guard(dsn), new_key()
    row = g.begin(key, FP)
    with pytest.raises(FingerprintMismatch) as e:
        g.complete(key, "other", 200, b"x", row.token)
    assert e.value.sqlstate == "ID001"
    assert isinstance(e.value.__cause__, psycopg.Error)


def test_id002_token_superseded(dsn):
    g, key = Guard(dsn, lease=1), new_key()
    stale = g.begin(key, FP)
    fresh = Guard(dsn, lease=1, clock_offset=2).begin(key, FP)
    assert fresh.claimed and fresh.token > stale.token
    with pytest.raises(TokenSuperseded) as e:
        g.complete(key, FP, 200, b"x", stale.token)
    assert e.value.sqlstate == "ID002"


def test_id003_no_live_claim(dsn):
    with pytest.raises(NoLiveClaim) as e:
        Guard(dsn).complete(new_key(), FP, 200, b"x", 1)
    assert e.value.sqlstate == "ID003"


def test_id004_already_completed(dsn):
    g, key = Guard(dsn), new_key()
    row = g.begin(key, FP)
    g.complete(key, FP, 200, b"x", row.token)
    with pytest.raises(AlreadyCompleted) as e:
        g.release(key, row.token)
    assert e.value.sqlstate == "ID004"
    with pytest.raises(AlreadyCompleted):
        g.complete(key, FP, 200, b"other", row.token)


def test_invalid_arguments(dsn):
    g = Guard(dsn)
    with pytest.raises(InvalidArgument) as e:
        g.begin("", FP)
    assert e.value.sqlstate == "22023" and isinstance(e.value, ValueError)
    key = new_key()
    row = g.begin(key, FP)
    # a body over idem.max_body_size is no error: the server stores the
    # fixed 500 in its place
    assert g.complete(key, FP, 200, b"x" * (1024 * 1024 + 1), row.token) is not None
    replay = g.begin(key, FP)
    assert (replay.state, replay.status, replay.body) == ("DONE", 500, NOT_STORED_BODY)
    r = g.do("", FP, Calls())
    assert r.outcome is Outcome.UNAVAILABLE and isinstance(r.error, InvalidArgument)


# -- traps ------------------------------------------------------------------------


def test_claim_commits_on_its_own_without_autocommit(dsn, db):
    """Python drivers open transactions implicitly; the guard's claim must
    still commit before the handler runs, so a retry answers in flight at
    once instead of waiting."""
    key = new_key()
    conn = psycopg.connect(dsn)                   # autocommit off, as by default
    assert conn.autocommit is False
    seen = {}

    def handler(claim):
        start = time.monotonic()
        # an uncommitted claim would hold the retry for its whole timeout
        seen["retry"] = Guard(dsn, timeout=10).do(key, FP, Calls())
        seen["elapsed"] = time.monotonic() - start
        seen["stored"] = lookup(db, key)
        return Response(200, b"ok")

    r = Guard(conn).do(key, FP, handler)
    assert r.outcome is Outcome.EXECUTED and r.error is None
    assert seen["retry"].outcome is Outcome.IN_FLIGHT and seen["elapsed"] < 5.0
    assert seen["stored"]["state"] == "PROCESSING"
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert lookup(db, key)["state"] == "DONE"
    conn.close()


def test_connection_inside_transaction_is_refused(dsn, db):
    key, h = new_key(), Calls()
    conn = psycopg.connect(dsn)
    conn.execute("SELECT 1")                      # an implicit transaction is open
    r = Guard(conn).do(key, FP, h)
    assert r.outcome is Outcome.UNAVAILABLE and isinstance(r.error, Unavailable)
    assert h.claims == []
    conn.commit()
    assert lookup(db, key) is None                # nothing was claimed in it
    conn.close()


def test_timeout_cancels_server_wait_and_leaves_no_orphan(dsn, db):
    key, h = new_key(), Calls()
    holder = hold_uncommitted_claim(dsn, key)
    try:
        start = time.monotonic()
        r = Guard(dsn, timeout=0.5).do(key, FP, h)
        elapsed = time.monotonic() - start
        assert r.outcome is Outcome.UNAVAILABLE and isinstance(r.error, Timeout)
        assert r.error.sqlstate == "57014"
        # a wait not bounded by timeout=0.5 would last at least the default 5 s
        assert 0.4 < elapsed < 4.0 and h.claims == []
        waiting = db.execute("SELECT count(*) FROM pg_stat_activity"
                             " WHERE wait_event_type = 'Lock'").fetchone()[0]
        assert waiting == 0
    finally:
        holder.rollback()
        holder.close()
    time.sleep(0.3)
    assert lookup(db, key) is None                # the abandoned wait claimed nothing


def test_naive_abandoned_wait_leaves_orphan_claim(dsn, db):
    """Control for the test above: giving up on the client only (a thread
    future's timeout) leaves idem_begin waiting; it claims the key once the
    holder is gone, with nobody to complete it."""
    key = new_key()
    holder = hold_uncommitted_claim(dsn, key)
    naive = psycopg.connect(dsn, autocommit=True)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(lambda: naive.execute(
        "SELECT claimed FROM public.idem_begin(%s::text, %s::text)", [key, FP]).fetchone())
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(timeout=0.3)
    holder.rollback()
    assert fut.result(timeout=30) == (True,)      # claimed after we gave up
    assert lookup(db, key)["state"] == "PROCESSING"
    pool.shutdown()
    naive.close()
    holder.close()


def test_every_call_is_schema_qualified(dsn, db):
    """A look-alike idem_begin earlier on the search_path is never called."""
    db.execute("CREATE SCHEMA IF NOT EXISTS evil")
    db.execute("""CREATE OR REPLACE FUNCTION evil.idem_begin(
                    text, text, interval DEFAULT NULL, interval DEFAULT NULL,
                    text DEFAULT '', boolean DEFAULT true)
                  RETURNS TABLE (claimed boolean, state text, token bigint,
                                 status integer, body bytea)
                  LANGUAGE sql AS $$ SELECT false, 'DONE', NULL::bigint, 200, 'evil'::bytea $$""")
    key, h = new_key(), Calls()
    g = Guard(dsn + " options='-c search_path=evil,public'")
    r = g.do(key, FP, h)
    assert r.outcome is Outcome.EXECUTED and len(h.claims) == 1
    assert lookup(db, key)["state"] == "DONE"
    for stmt in (g.sql.begin, g.sql.begin_wait, g.sql.complete, g.sql.release,
                 g.sql.extend):
        assert '"public".idem_' in stmt and "%s::" in stmt
    assert "%b::bytea" in g.sql.complete


def test_schema_name_quoted_once(dsn):
    """The statements are rendered once per schema, with the name quoted
    as an identifier: a quote and a % in it reach the server intact."""
    assert statements("public") is statements("public")
    st = statements('we"ird%')
    assert '"we""ird%%".idem_lookup(' in st.lookup
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(
            psycopg.errors.InvalidSchemaName, match='schema "we"ird%" does not exist'):
        conn.execute(st.lookup, ("k", ""))
