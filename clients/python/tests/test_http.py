"""The middleware over real HTTP: FastAPI/Starlette under uvicorn (a
separate process) and Flask under werkzeug, with httpx as the client."""

import concurrent.futures
import random
import threading
import time

import httpx
import pytest

from idem_pg._http import DEFAULT_WAIT_FOR, Settings

from conftest import calls, lookup, new_key, wait_for

REPLAYED = "idempotent-replayed"


def post(server, path, key=None, body=b"sku=A&qty=1", tenant=None, timeout=30):
    headers = {"content-type": "application/x-www-form-urlencoded"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if tenant is not None:
        headers["X-Tenant"] = tenant
    return httpx.post(server.url + path, content=body, headers=headers, timeout=timeout)


def test_missing_key_when_required_is_400(server, db):
    before = calls(db, app="req")
    r = post(server, "/req/orders")
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/problem+json"
    assert "Idempotency-Key" in r.json()["title"]
    assert calls(db, app="req") == before       # the handler did not run


def test_key_too_long_is_400(server, db):
    before = calls(db, app="opt")
    r = post(server, "/opt/orders", key="x" * 256)
    assert r.status_code == 400
    assert calls(db, app="opt") == before


def test_missing_key_when_optional_passes_through(server, db):
    before = calls(db, app="opt")
    r1 = post(server, "/opt/orders")
    r2 = post(server, "/opt/orders")
    assert (r1.status_code, r2.status_code) == (201, 201)
    assert REPLAYED not in r2.headers
    assert r1.json()["order"] != r2.json()["order"]
    assert calls(db, app="opt") == before + 2
    # methods not configured are not guarded, even where a key is required
    assert httpx.get(server.url + "/req/orders", timeout=30).status_code == 200


def test_replay_with_marker_header_and_content_type(server, db):
    key = new_key("replay")
    r1 = post(server, "/opt/orders", key)
    assert r1.status_code == 201
    assert r1.headers["content-type"] == "application/json"
    assert REPLAYED not in r1.headers
    assert "x-order" in r1.headers
    r2 = post(server, "/opt/orders", key)
    assert r2.status_code == 201
    assert r2.headers[REPLAYED] == "true"
    assert r2.headers["content-type"] == "application/json"
    assert r2.headers["location"] == r1.headers["location"]
    assert "x-order" not in r2.headers           # not a stored header
    assert r2.content == r1.content
    assert calls(db, key=key) == 1
    row = lookup(db, key)
    assert row["state"] == "DONE" and row["status"] == 201


def test_binary_body_replayed_byte_for_byte(server, db):
    key = new_key("bin")
    r1 = post(server, "/opt/bytes", key)
    r2 = post(server, "/opt/bytes", key)
    expected = bytes(range(256)) + b"\\x41\\\\000"
    assert r1.status_code == r2.status_code == 200
    assert r1.content == expected
    assert r2.content == expected
    assert r2.headers["content-type"] == "application/octet-stream"
    assert r2.headers[REPLAYED] == "true"
    assert calls(db, key=key) == 1


def _gated_duplicate(server, db, mount):
    """The first request's handler waits for an advisory lock the test
    holds until a duplicate is answered; returns that answer, how long it
    took, and the first request's answer."""
    key = new_key("inflight")
    gate = random.getrandbits(62)
    path = "/%s/gated?gate=%d" % (mount, gate)
    first = {}
    db.execute("SELECT pg_advisory_lock(%s::bigint)", [gate])
    t = threading.Thread(target=lambda: first.update(r=post(server, path, key)))
    t.start()
    try:
        wait_for(lambda: (lookup(db, key) or {}).get("state") == "PROCESSING",
                 what="the first request's claim")
        start = time.monotonic()
        r = post(server, path, key)
        elapsed = time.monotonic() - start
    finally:
        db.execute("SELECT pg_advisory_unlock(%s::bigint)", [gate])
        t.join(30)
    assert first["r"].status_code == 201
    assert calls(db, key=key) == 1
    again = post(server, path, key)
    assert again.status_code == 201 and again.headers[REPLAYED] == "true"
    assert again.content == first["r"].content
    assert calls(db, key=key) == 1
    return r, elapsed


def test_in_flight_after_the_wait_is_409_with_retry_after_from_lease(server, db):
    r, elapsed = _gated_duplicate(server, db, "opt")    # /opt/gated waits 1 s
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert elapsed >= 0.9                                # it waited
    # the seconds left of the first request's 30 s lease, not retry_after=1
    assert 20 <= int(r.headers["retry-after"]) <= 30


def test_in_flight_without_wait_is_409_at_once(server, db):
    """/store has wait_for=0: no wait, although its guard has wait_for=30."""
    r, elapsed = _gated_duplicate(server, db, "store")
    assert r.status_code == 409
    assert elapsed < 15
    assert 20 <= int(r.headers["retry-after"]) <= 30


def test_payload_reuse_is_422(server, db):
    key = new_key("reuse")
    assert post(server, "/req/orders", key, body=b"sku=A&qty=1").status_code == 201
    r = post(server, "/req/orders", key, body=b"sku=A&qty=2")
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert calls(db, key=key) == 1
    # the same key on another path is another request too
    assert post(server, "/req/slow?ms=1", key, body=b"sku=A&qty=1").status_code == 422


def test_unavailable_is_503_and_handler_not_run(server, db):
    key = new_key("down")
    r = post(server, "/down/orders", key)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert calls(db, key=key) == 0
    assert lookup(db, key) is None


def test_server_error_released_by_default(server, db):
    key = new_key("r500")
    r1 = post(server, "/req/fail500", key)
    assert r1.status_code == 500 and r1.text == "boom"
    assert REPLAYED not in r1.headers
    assert lookup(db, key) is None              # released: free for a retry at once
    r2 = post(server, "/req/fail500", key)
    assert r2.status_code == 500 and REPLAYED not in r2.headers
    assert calls(db, key=key) == 2


def test_exception_released_by_default(server, db):
    key = new_key("rexc")
    assert post(server, "/req/raise", key).status_code == 500
    assert lookup(db, key) is None
    assert post(server, "/req/raise", key).status_code == 500
    assert calls(db, key=key) == 2


def test_server_error_stored_when_configured(server, db):
    key = new_key("s500")
    r1 = post(server, "/store/fail500", key)
    assert r1.status_code == 500 and r1.text == "boom"
    row = lookup(db, key)
    assert row["state"] == "DONE" and row["status"] == 500
    r2 = post(server, "/store/fail500", key)
    assert r2.status_code == 500 and r2.text == "boom"
    assert r2.headers[REPLAYED] == "true"
    assert r2.headers["content-type"].startswith("text/plain")
    assert calls(db, key=key) == 1


def test_exception_stored_when_configured(server, db):
    key = new_key("sexc")
    r1 = post(server, "/store/raise", key)
    assert r1.status_code == 500
    assert lookup(db, key)["status"] == 500
    r2 = post(server, "/store/raise", key)
    assert r2.status_code == 500 and r2.headers[REPLAYED] == "true"
    assert calls(db, key=key) == 1


def test_scope_from_tenant(server, db):
    key = new_key("tenant")
    ra = post(server, "/opt/orders", key, tenant="acme")
    rb = post(server, "/opt/orders", key, tenant="globex")
    assert ra.status_code == rb.status_code == 201
    assert ra.json()["order"] != rb.json()["order"]
    assert calls(db, key=key) == 2
    assert lookup(db, key, "acme")["state"] == "DONE"
    assert lookup(db, key, "globex")["state"] == "DONE"
    assert lookup(db, key) is None
    again = post(server, "/opt/orders", key, tenant="acme")
    assert again.headers[REPLAYED] == "true" and again.content == ra.content


def test_concurrent_retries_execute_once(server, db):
    key = new_key("conc")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: post(server, "/opt/slow?ms=300", key), range(8)))
    executed = [r for r in rs if r.status_code == 201 and REPLAYED not in r.headers]
    replayed = [r for r in rs if r.status_code == 201 and REPLAYED in r.headers]
    in_flight = [r for r in rs if r.status_code == 409]
    assert len(executed) == 1, [r.status_code for r in rs]
    assert len(executed) + len(replayed) + len(in_flight) == 8
    assert all(r.content == executed[0].content for r in replayed)
    assert calls(db, key=key) == 1


def test_concurrent_duplicates_wait_and_replay(server, db):
    """20 POSTs with one key to a handler that takes 2 s: the duplicates
    wait (5 s, the default under /req) and replay the first response."""
    key = new_key("wait20")
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        rs = list(pool.map(lambda _: post(server, "/req/slow?ms=2000", key), range(20)))
    codes = [r.status_code for r in rs]
    executed = [r for r in rs if r.status_code == 201 and REPLAYED not in r.headers]
    replayed = [r for r in rs if r.status_code == 201 and r.headers.get(REPLAYED) == "true"]
    assert len(executed) == 1, codes
    assert len(replayed) == 19, codes
    assert codes.count(409) == 0
    assert all(r.content == executed[0].content for r in replayed)
    assert all(r.headers["location"] == executed[0].headers["location"] for r in replayed)
    assert calls(db, key=key) == 1


def test_settings_wait_for():
    assert DEFAULT_WAIT_FOR == 5.0 and Settings(shared=True).wait_of({}) == 5.0
    assert Settings(shared=True, wait_for=None).wait_of({}) == 0.0
    assert Settings(shared=True, wait_for=0).wait_of({}) == 0.0
    per_route = Settings(shared=True, wait_for=lambda req: 30 if req["path"] == "/reports" else None)
    assert per_route.wait_of({"path": "/reports"}) == 30.0
    assert per_route.wait_of({"path": "/orders"}) == 0.0
    with pytest.raises(ValueError):
        Settings(shared=True, wait_for=-1)
    s = Settings(shared=True, retry_after=7)

    def retry_after(lease_left):
        status, headers, _ = s.in_flight(lease_left)
        assert status == 409
        return dict(headers)["retry-after"]

    assert retry_after(None) == "7"          # no lease_until from the server
    assert retry_after(29.2) == "30"         # seconds until lease_until, rounded up
    assert retry_after(0.2) == "1"           # at least 1
    assert retry_after(-3.0) == "1"
