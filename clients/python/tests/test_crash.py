"""A crash mid-request: the app server is killed while the handler runs
(the client's connection is cut); the claim stays in flight (409) until its
lease ends, then a retry takes the key over with a greater token."""

import threading

import httpx

from conftest import UvicornServer, calls, lookup, new_key, wait_for

# Long: the kill and the restart (up to a minute on a loaded machine) must
# not outlast it; time is then moved past it with idem.clock_offset.
LEASE = 600.0


def test_connection_cut_mid_request_then_takeover_after_lease(db):
    key = new_key("crash")
    headers = {"Idempotency-Key": key}
    server = UvicornServer(lease=LEASE).start()
    outcome = {}

    def first():
        try:
            outcome["r"] = httpx.post(server.url + "/req/hang", content=b"sku=A",
                                      headers=headers, timeout=30)
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    t = threading.Thread(target=first)
    t.start()
    try:
        row = wait_for(lambda: lookup(db, key), what="the claim")
        wait_for(lambda: calls(db, key=key) == 1, what="the handler to start")
        assert row["state"] == "PROCESSING"
        server.kill()
        t.join(10)
        assert "error" in outcome and "r" not in outcome   # connection cut, no answer

        server.start()                                      # a new process, same app
        r = httpx.post(server.url + "/req/hang", content=b"sku=A", headers=headers,
                       timeout=30)
        assert r.status_code == 409                         # lease not over
        assert 500 < int(r.headers["retry-after"]) <= LEASE  # until the lease ends
        assert calls(db, key=key) == 1

        moved = httpx.post(server.url + "/_test/clock", json={"offset": LEASE + 1},
                           timeout=30)
        assert moved.status_code == 200
        r = httpx.post(server.url + "/req/hang", content=b"sku=A", headers=headers,
                       timeout=30)
        assert r.status_code == 201                         # taken over, executed again
        assert "idempotent-replayed" not in r.headers
        assert calls(db, key=key) == 2
        after = lookup(db, key)
        assert after["state"] == "DONE" and after["token"] > row["token"]

        r = httpx.post(server.url + "/req/hang", content=b"sku=A", headers=headers,
                       timeout=30)
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
        assert calls(db, key=key) == 2
    finally:
        server.stop()
        t.join(10)
