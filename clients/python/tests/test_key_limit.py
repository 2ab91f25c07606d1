"""Issue #43 item 12: the middleware accepts no key the server refuses.  A
key, or a scope, longer than the server's idem.max_key_length makes
idem_begin fail with 22001 (string_data_right_truncation); the middleware
answers that 400 like any malformed key, not 503 (which clients retry):
the handler does not run and nothing is claimed.  A store that cannot be
reached is still 503.

The server's limit is lowered to LIMIT bytes for the guard's connections
only (``options=-c``: the tests connect as a superuser, and the setting is
a superuser's), so a key of LIMIT + 1 bytes passes the middleware's own
check (255 bytes) and reaches the server."""

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_pg import AsyncGuard, Guard
from idem_pg.asgi import IdempotencyMiddleware
from idem_pg.wsgi import IdempotencyWSGIMiddleware

from conftest import lookup, new_key

LIMIT = 16


def limited(dsn: str) -> str:
    """dsn with the server's idem.max_key_length lowered to LIMIT."""
    return "%s options='-c idem.max_key_length=%d'" % (dsn, LIMIT)


def app_of(mode, dsn, ran, **settings):
    """A POST /orders behind the middleware (asgi or wsgi) whose handler
    appends the key to ``ran``; returns post(key, tenant='')."""
    if mode == "asgi":
        async def orders(request):
            ran.append(request.state.idem_key)
            return JSONResponse({"ok": True}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(dsn, timeout=5),
                           scope=lambda scope: dict(scope["headers"]).get(
                               b"x-tenant", b"").decode("latin-1"), shared=True,
                           **settings)

        def post(key, tenant=""):
            async def main():
                async with httpx.AsyncClient(app=app, base_url="http://app") as c:
                    return await c.post("/orders", content=b"{}",
                                        headers={"Idempotency-Key": key, "X-Tenant": tenant})
            return asyncio.run(main())
        return post

    def orders(environ, start_response):
        ran.append(environ["idem_pg.key"])
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"ok": true}']

    wapp = IdempotencyWSGIMiddleware(orders, guard=Guard(dsn, timeout=5),
                                     scope=lambda environ: environ.get("HTTP_X_TENANT", ""),
                                     shared=True, **settings)

    def post(key, tenant=""):
        with httpx.Client(app=wapp, base_url="http://app") as c:
            return c.post("/orders", content=b"{}",
                          headers={"Idempotency-Key": key, "X-Tenant": tenant})
    return post


def assert_malformed(r, malformed):
    """r is a 400 with the body of a malformed key's answer."""
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/problem+json"
    assert "retry-after" not in r.headers
    assert r.headers["content-type"] == malformed.headers["content-type"]
    assert sorted(r.json()) == sorted(malformed.json())
    assert r.json()["status"] == 400


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
@pytest.mark.parametrize("transactional", [False, True])
def test_a_key_longer_than_the_servers_limit_is_400(dsn, db, mode, transactional):
    ran = []
    post = app_of(mode, limited(dsn), ran, transactional=transactional)
    malformed = post('"unterminated')
    assert malformed.status_code == 400

    key = new_key("long").ljust(LIMIT + 1, "x")[:LIMIT + 1]
    r = post(key)
    assert_malformed(r, malformed)
    assert "Idempotency-Key" in r.json()["title"]
    assert ran == [] and lookup(db, key) is None
    again = post(key)                        # a retry gets the same answer
    assert again.status_code == 400 and ran == [] and lookup(db, key) is None

    # the server's limit itself is a key: claimed, run once, replayed
    ok = new_key("ok").ljust(LIMIT, "y")[:LIMIT]
    assert post(ok).status_code == 201 and ran == [ok]
    assert post(ok).headers["idempotent-replayed"] == "true" and ran == [ok]
    assert lookup(db, ok)["state"] == "DONE"


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
@pytest.mark.parametrize("transactional", [False, True])
def test_a_scope_longer_than_the_servers_limit_is_400(dsn, db, mode, transactional):
    ran = []
    post = app_of(mode, limited(dsn), ran, transactional=transactional)
    malformed = post('"unterminated')
    key, tenant = new_key("sc"), "t" * (LIMIT + 1)
    assert len(key) <= LIMIT                 # the scope is what is refused
    r = post(key, tenant)
    assert_malformed(r, malformed)
    assert "scope" in r.json()["title"]
    assert ran == [] and lookup(db, key, tenant) is None


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
@pytest.mark.parametrize("transactional", [False, True])
def test_a_store_that_cannot_be_reached_is_still_503(down_dsn, mode, transactional):
    ran = []
    post = app_of(mode, limited(down_dsn), ran, transactional=transactional)
    r = post("x" * (LIMIT + 1))
    assert r.status_code == 503 and "retry-after" in r.headers and ran == []
