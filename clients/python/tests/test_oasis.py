"""Issue #44 items 5 and 6: OASIS Repeatable Requests beside
Idempotency-Key, and the window advertised.

- ``Repeatability-Request-ID`` with ``Repeatability-First-Sent`` (an
  IMF-fixdate) claims the request id as the key, bound to the caller like
  an Idempotency-Key; the answer carries ``Repeatability-Result:
  accepted`` when the handler ran or a stored response was replayed,
  ``rejected`` when the middleware refused (400, 412, 422, ...).
- A First-Sent older than the window: 412, the handler does not run,
  nothing is claimed.  A malformed First-Sent, a Request-ID without
  First-Sent (or the reverse), or both it and Idempotency-Key: 400.
- ``advertise_window=True``: every response of the route, passed through
  or not, carries ``Idempotency-Key-Lifetime: <seconds>``; off by default.

Each app runs in the test's process (httpx over ASGI or WSGI)."""

import asyncio
import datetime as dt

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from idem_pg import AsyncGuard, Guard
from idem_pg import _http
from idem_pg.asgi import IdempotencyMiddleware
from idem_pg.wsgi import IdempotencyWSGIMiddleware

from conftest import lookup, new_key

MODES = [("asgi", False), ("asgi", True), ("wsgi", False), ("wsgi", True)]
LONG_AGO = "Sun, 06 Nov 1994 08:49:37 GMT"


def now():
    return _http.http_date(dt.datetime.now(dt.timezone.utc))


def user(request):
    if "headers" in request:
        return dict((k.decode().lower(), v.decode()) for k, v in request["headers"]).get("x-user", "")
    return request.get("HTTP_X_USER", "")


def app_of(mode, transactional, dsn, ran, retention=3600, **settings):
    """POST /orders (the handler appends the key to ``ran`` and answers
    201) and GET /orders (200) behind the middleware.  Returns
    call(method, body=b"{}", **headers)."""
    settings.setdefault("principal", user)
    if mode == "asgi":
        async def orders(request):
            if request.method == "GET":
                return PlainTextResponse("list")
            ran.append(getattr(request.state, "idem_key", None))
            return JSONResponse({"n": len(ran)}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["GET", "POST"])])
        mw = IdempotencyMiddleware(app, guard=AsyncGuard(dsn, timeout=5, retention=retention),
                                   transactional=transactional, **settings)

        def call(method, body=b"{}", **headers):
            h = {k.replace("_", "-"): v for k, v in headers.items()}

            async def main():
                async with httpx.AsyncClient(app=mw, base_url="http://app") as c:
                    return await c.request(method, "/orders", content=body, headers=h)
            return asyncio.run(main())
        return call

    def orders(environ, start_response):
        if environ["REQUEST_METHOD"] == "GET":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"list"]
        ran.append(environ.get("idem_pg.key"))
        start_response("201 Created", [("Content-Type", "application/json")])
        return [('{"n": %d}' % len(ran)).encode()]

    wapp = IdempotencyWSGIMiddleware(orders, guard=Guard(dsn, timeout=5, retention=retention),
                                     transactional=transactional, **settings)

    def call(method, body=b"{}", **headers):
        h = {k.replace("_", "-"): v for k, v in headers.items()}
        with httpx.Client(app=wapp, base_url="http://app") as c:
            return c.request(method, "/orders", content=body, headers=h)
    return call


def oasis(rid, first_sent, **more):
    return dict({"Repeatability_Request_ID": rid, "Repeatability_First_Sent": first_sent},
                **more)


def rows(db, key):
    return db.execute("SELECT count(*) FROM public.idem_keys WHERE key = %s",
                      [key]).fetchone()[0]


def is_problem(r, status):
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["status"] == status


@pytest.mark.parametrize("mode,transactional", MODES)
def test_oasis_accepted_then_replayed_accepted(dsn, db, mode, transactional):
    ran = []
    call = app_of(mode, transactional, dsn, ran)
    rid = new_key("oasis")
    sent = now()
    r1 = call("POST", **oasis(rid, sent, X_User="alice"))
    assert r1.status_code == 201 and r1.json() == {"n": 1}
    assert r1.headers["repeatability-result"] == "accepted"
    assert "idempotent-replayed" not in r1.headers
    r2 = call("POST", **oasis(rid, sent, X_User="alice"))
    assert r2.status_code == 201 and r2.json() == {"n": 1}
    assert r2.headers["repeatability-result"] == "accepted"
    assert r2.headers["idempotent-replayed"] == "true"
    assert ran == [rid]
    # the request id is the key, in the caller's scope, like an Idempotency-Key
    assert lookup(db, rid, _http.caller_scope("", "alice"))["state"] == "DONE"
    assert rows(db, rid) == 1
    # another caller with the same id: its own execution
    r3 = call("POST", **oasis(rid, sent, X_User="bob"))
    assert r3.status_code == 201 and r3.json() == {"n": 2}
    assert r3.headers["repeatability-result"] == "accepted"
    assert ran == [rid, rid] and rows(db, rid) == 2


@pytest.mark.parametrize("mode,transactional", MODES)
def test_oasis_first_sent_past_the_window_is_412(dsn, db, mode, transactional):
    ran = []
    call = app_of(mode, transactional, dsn, ran)
    rid = new_key("old")
    r = call("POST", **oasis(rid, LONG_AGO, X_User="alice"))
    is_problem(r, 412)
    assert r.headers["repeatability-result"] == "rejected"
    assert ran == [] and rows(db, rid) == 0


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
@pytest.mark.parametrize("first_sent", [
    "yesterday",
    "Sunday, 06-Nov-94 08:49:37 GMT",          # RFC 850: obsolete, refused
    "Sun Nov  6 08:49:37 1994",                # asctime: obsolete, refused
    "Mon, 06 Nov 1994 08:49:37 GMT",           # 6 Nov 1994 was a Sunday
    "Sun, 31 Nov 1994 08:49:37 GMT",           # no 31 November
    "Sun, 06 Nov 1994 08:49:37 UTC",
])
def test_oasis_malformed_first_sent_is_400(dsn, db, mode, first_sent):
    ran = []
    call = app_of(mode, False, dsn, ran)
    rid = new_key("bad")
    r = call("POST", **oasis(rid, first_sent, X_User="alice"))
    is_problem(r, 400)
    assert "Repeatability-First-Sent" in r.json()["title"]
    assert r.headers["repeatability-result"] == "rejected"
    assert ran == [] and rows(db, rid) == 0


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_oasis_headers_that_do_not_go_together_are_400(dsn, db, mode):
    ran = []
    call = app_of(mode, False, dsn, ran)
    rid = new_key("half")
    for headers in ({"Repeatability_Request_ID": rid},
                    {"Repeatability_First_Sent": now()},
                    oasis(rid, now(), Idempotency_Key=rid),
                    oasis("x" * 256, now())):          # longer than max_key_length
        r = call("POST", X_User="alice", **headers)
        is_problem(r, 400)
        assert r.headers["repeatability-result"] == "rejected"
    assert ran == [] and rows(db, rid) == 0


@pytest.mark.parametrize("mode,transactional", MODES)
def test_oasis_same_id_other_request_is_rejected(dsn, db, mode, transactional):
    ran = []
    call = app_of(mode, transactional, dsn, ran)
    rid = new_key("other")
    assert call("POST", **oasis(rid, now(), X_User="a")).headers["repeatability-result"] == "accepted"
    r = call("POST", body=b'{"other": 1}', **oasis(rid, now(), X_User="a"))
    is_problem(r, 422)
    assert r.headers["repeatability-result"] == "rejected"
    assert ran == [rid]


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_no_repeatability_result_without_the_headers(dsn, db, mode):
    ran = []
    call = app_of(mode, False, dsn, ran, advertise_window=True)
    key = new_key("plain")
    for r in (call("POST", Idempotency_Key=key, X_User="a"),
              call("POST", Idempotency_Key=key, X_User="a"),
              call("POST", Idempotency_Key="", X_User="a"),
              call("POST", X_User="a"), call("GET")):
        assert "repeatability-result" not in r.headers
    assert ran == [key, None]


@pytest.mark.parametrize("mode,transactional", MODES)
def test_lifetime_header_on_every_response_when_advertised(dsn, db, mode, transactional):
    ran = []
    call = app_of(mode, transactional, dsn, ran, retention=3600, advertise_window=True)
    key = new_key("life")
    answers = {
        "stored": call("POST", Idempotency_Key=key, X_User="a"),
        "replayed": call("POST", Idempotency_Key=key, X_User="a"),
        "conflict": call("POST", body=b"[]", Idempotency_Key=key, X_User="a"),
        "bad key": call("POST", Idempotency_Key="", X_User="a"),
        "no key": call("POST", X_User="a"),
        "GET": call("GET"),
        "OASIS 412": call("POST", **oasis(new_key("o"), LONG_AGO, X_User="a")),
    }
    assert [r.status_code for r in answers.values()] == [201, 201, 422, 400, 201, 200, 412]
    for what, r in answers.items():
        assert r.headers.get("idempotency-key-lifetime") == "3600", what


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_lifetime_header_is_off_by_default(dsn, db, mode):
    ran = []
    call = app_of(mode, False, dsn, ran)
    key = new_key("nolife")
    for r in (call("POST", Idempotency_Key=key, X_User="a"), call("GET"),
              call("POST", **oasis(new_key("o"), now(), X_User="a"))):
        assert r.status_code in (200, 201)
        assert "idempotency-key-lifetime" not in r.headers


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_lifetime_is_the_servers_default_retention_without_one(dsn, db, mode):
    """A guard with no retention claims with idem.default_retention: that
    is the window advertised and checked."""
    ran = []
    call = app_of(mode, False, dsn, ran, retention=None, advertise_window=True)
    seconds = str(db.execute("SELECT setting::int8 FROM pg_settings"
                             " WHERE name = 'idem.default_retention'").fetchone()[0])
    r = call("GET")
    assert r.status_code == 200 and r.headers["idempotency-key-lifetime"] == seconds
    assert call("POST", **oasis(new_key("o"), LONG_AGO, X_User="a")).status_code == 412
    assert ran == []


def test_parse_http_date():
    assert _http.parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT") == \
        dt.datetime(1994, 11, 6, 8, 49, 37, tzinfo=dt.timezone.utc)
    assert _http.parse_http_date(" Sun, 06 Nov 1994 08:49:37 GMT\t").year == 1994
    # a leap second reads as :59
    assert _http.parse_http_date("Sat, 31 Dec 2016 23:59:60 GMT").second == 59
    for bad in ("", "Sun, 6 Nov 1994 08:49:37 GMT", "sun, 06 Nov 1994 08:49:37 GMT",
                "Sun, 06 Nov 1994 24:00:00 GMT", "Sun, 06 Nov 1994 08:49:37 GMT x"):
        with pytest.raises(_http.BadDate):
            _http.parse_http_date(bad)
