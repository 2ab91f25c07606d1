"""Issue #44 items 1-3: keys bound to the caller, re-authorized replays,
answers that are not stored.

- The middleware takes the caller's identity from ``principal`` and claims
  the key in a scope made of the tenant (``scope``) and the principal: two
  callers who send the same key, method, URL and body each get their own
  execution, and a replay only ever goes to the caller who made it.
- A middleware built without a principal hook and without ``shared=True``
  does not start.
- ``authorize`` runs before a stored response is replayed: a caller it
  denies gets 403 (or the hook's answer), never the stored body.
- 401, 403, 407, 408 and 425 are released like 429 and 5xx: a retry after
  a token refresh runs the handler again.
- A principal hook that raises or returns something other than a string:
  500, the handler does not run, nothing is claimed.

Each app runs in the test's process (httpx over ASGI or WSGI), in default
and transactional mode."""

import asyncio
import hashlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_pg import AsyncGuard, Guard
from idem_pg import _http
from idem_pg.asgi import IdempotencyMiddleware
from idem_pg.wsgi import IdempotencyWSGIMiddleware

from conftest import lookup, new_key


def caller_scope(*args, **kwargs):
    return _http.caller_scope(*args, **kwargs)

MODES = [("asgi", False), ("asgi", True), ("wsgi", False), ("wsgi", True)]


def header(scope_or_environ, name):
    """A request header from an ASGI scope or a WSGI environ, or None."""
    if "headers" in scope_or_environ:
        for k, v in scope_or_environ["headers"]:
            if k.decode("latin-1").lower() == name.lower():
                return v.decode("latin-1")
        return None
    return scope_or_environ.get("HTTP_" + name.upper().replace("-", "_"))


def user(request):
    """The principal hook of these apps: X-User, or a failure X-User asks for."""
    who = header(request, "X-User")
    if who == "raise":
        raise RuntimeError("no session")
    if who == "none":
        return None
    if who == "int":
        return 42
    return who


def allowed(request):
    """The authorize hook: X-Revoked denies."""
    return header(request, "X-Revoked") is None


def app_of(mode, transactional, dsn, ran, **settings):
    """POST /orders behind the middleware; the handler appends (key, user)
    to ``ran`` and answers X-Status (default 201) with a body naming the
    user.  Returns post(key, user, **headers)."""
    settings.setdefault("principal", user)
    if mode == "asgi":
        async def orders(request):
            who = request.headers.get("x-user")
            ran.append((request.state.idem_key, who))
            return JSONResponse({"secret": "for %s" % who},
                                status_code=int(request.headers.get("x-status", "201")))

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        mw = IdempotencyMiddleware(app, guard=AsyncGuard(dsn, timeout=5),
                                   transactional=transactional, **settings)

        def post(key, who=None, **headers):
            h = {"Idempotency-Key": key}
            if who is not None:
                h["X-User"] = who
            h.update({k.replace("_", "-"): v for k, v in headers.items()})

            async def main():
                async with httpx.AsyncClient(app=mw, base_url="http://app") as c:
                    return await c.post("/orders", content=b"{}", headers=h)
            return asyncio.run(main())
        return post

    def orders(environ, start_response):
        who = environ.get("HTTP_X_USER")
        ran.append((environ["idem_pg.key"], who))
        status = int(environ.get("HTTP_X_STATUS", "201"))
        start_response("%d Whatever" % status, [("Content-Type", "application/json")])
        return [('{"secret": "for %s"}' % who).encode()]

    wapp = IdempotencyWSGIMiddleware(orders, guard=Guard(dsn, timeout=5),
                                     transactional=transactional, **settings)

    def post(key, who=None, **headers):
        h = {"Idempotency-Key": key}
        if who is not None:
            h["X-User"] = who
        h.update({k.replace("_", "-"): v for k, v in headers.items()})
        with httpx.Client(app=wapp, base_url="http://app") as c:
            return c.post("/orders", content=b"{}", headers=h)
    return post


def rows(db, key):
    """Rows of ``key`` in any scope."""
    return db.execute("SELECT count(*) FROM public.idem_keys WHERE key = %s",
                      [key]).fetchone()[0]


@pytest.mark.parametrize("mode,transactional", MODES)
def test_two_principals_two_executions_each_replayed_to_its_own(dsn, db, mode, transactional):
    ran = []
    post = app_of(mode, transactional, dsn, ran)
    key = new_key("two")
    a1 = post(key, "alice")
    b1 = post(key, "bob")
    assert a1.status_code == b1.status_code == 201
    assert "idempotent-replayed" not in a1.headers and "idempotent-replayed" not in b1.headers
    assert ran == [(key, "alice"), (key, "bob")]
    a2, b2 = post(key, "alice"), post(key, "bob")
    assert a2.headers["idempotent-replayed"] == b2.headers["idempotent-replayed"] == "true"
    assert a2.json() == {"secret": "for alice"} and b2.json() == {"secret": "for bob"}
    assert len(ran) == 2
    # the scope is caller_scope(tenant, principal): here the tenant is ''
    assert lookup(db, key, caller_scope("", "alice"))["state"] == "DONE"
    assert lookup(db, key, caller_scope("", "bob"))["state"] == "DONE"
    assert lookup(db, key) is None and rows(db, key) == 2


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_tenant_and_principal_both_scope_the_key(dsn, db, mode):
    ran = []
    post = app_of(mode, False, dsn, ran, scope=lambda r: header(r, "X-Tenant") or "")
    key = new_key("tp")
    # "a" + "bc" and "ab" + "c" are different scopes (the tenant's length is in it)
    assert post(key, "bc", X_Tenant="a").status_code == 201
    assert post(key, "c", X_Tenant="ab").status_code == 201
    assert len(ran) == 2
    assert lookup(db, key, caller_scope("a", "bc"))["state"] == "DONE"
    assert lookup(db, key, caller_scope("ab", "c"))["state"] == "DONE"


def test_caller_scope_encoding():
    assert caller_scope("", "alice") == "0:=alice"
    assert caller_scope("acme", "alice") == "4:acme=alice"
    assert caller_scope("a", "bc") != caller_scope("ab", "c")
    assert caller_scope("a=b", "c") != caller_scope("a", "b=c")
    assert caller_scope("\u00e9", "x") == "2:\u00e9=x"         # the tenant's UTF-8 bytes
    # a principal that would make the scope too long, or is not printable
    # ASCII, is hashed
    long = "u" * 300
    h = hashlib.sha256(long.encode()).hexdigest()
    assert caller_scope("t", long) == "1:t#" + h
    assert caller_scope("t", "\u00e9") == "1:t#" + hashlib.sha256("\u00e9".encode()).hexdigest()
    assert caller_scope("t", "=" * 10, max_length=12) == "1:t#" + \
        hashlib.sha256(b"=" * 10).hexdigest()
    assert caller_scope("t", "ab", max_length=6) == "1:t=ab"


@pytest.mark.parametrize("mode,transactional", MODES)
def test_a_long_principal_is_hashed_into_the_scope(dsn, db, mode, transactional):
    ran = []
    post = app_of(mode, transactional, dsn, ran)
    key, who = new_key("long"), "p" * 300
    assert post(key, who).status_code == 201
    assert post(key, who).headers["idempotent-replayed"] == "true" and len(ran) == 1
    assert lookup(db, key, caller_scope("", who))["state"] == "DONE"


@pytest.mark.parametrize("cls", [IdempotencyMiddleware, IdempotencyWSGIMiddleware])
def test_no_principal_decision_does_not_start(dsn, cls):
    guard = AsyncGuard(dsn) if cls is IdempotencyMiddleware else Guard(dsn)
    with pytest.raises(TypeError, match="principal") as e:
        cls(lambda *a: None, guard=guard)
    assert "shared=True" in str(e.value)
    with pytest.raises(TypeError, match="principal"):
        cls(lambda *a: None, guard=guard, scope=lambda r: "tenant")
    with pytest.raises(TypeError):                  # both: which one?
        cls(lambda *a: None, guard=guard, principal=user, shared=True)
    with pytest.raises(TypeError):
        cls(lambda *a: None, guard=guard, principal="alice")
    cls(lambda *a: None, guard=guard, principal=user)
    cls(lambda *a: None, guard=guard, shared=True)


def test_no_principal_decision_the_starlette_app_does_not_start(dsn):
    app = Starlette(routes=[])
    app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(dsn))

    async def main():
        async with httpx.AsyncClient(app=app, base_url="http://app") as c:
            await c.post("/", headers={"Idempotency-Key": "k"})
    with pytest.raises(TypeError, match="principal"):
        asyncio.run(main())


@pytest.mark.parametrize("mode,transactional", MODES)
def test_shared_is_one_namespace(dsn, db, mode, transactional):
    ran = []
    post = app_of(mode, transactional, dsn, ran, principal=None, shared=True)
    key = new_key("shared")
    assert post(key, "alice").status_code == 201
    r = post(key, "bob")
    assert r.headers["idempotent-replayed"] == "true" and r.json() == {"secret": "for alice"}
    assert len(ran) == 1 and lookup(db, key)["state"] == "DONE"


@pytest.mark.parametrize("mode,transactional", MODES)
def test_authorize_denies_the_replay(dsn, db, mode, transactional):
    ran = []
    post = app_of(mode, transactional, dsn, ran, authorize=allowed)
    key = new_key("authz")
    r1 = post(key, "alice")
    assert r1.status_code == 201 and b"for alice" in r1.content
    r2 = post(key, "alice", X_Revoked="1")
    assert r2.status_code == 403
    assert r2.headers["content-type"] == "application/problem+json"
    assert b"for alice" not in r2.content and b"secret" not in r2.content
    assert "idempotent-replayed" not in r2.headers
    assert len(ran) == 1
    r3 = post(key, "alice")                  # allowed again: replayed
    assert r3.headers["idempotent-replayed"] == "true" and r3.content == r1.content
    assert len(ran) == 1 and lookup(db, key, caller_scope("", "alice"))["state"] == "DONE"


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_authorize_may_answer_itself(dsn, mode):
    ran = []

    def authorize(request):
        if header(request, "X-Revoked"):
            return 404, [("content-type", "text/plain")], b"gone"
        return True
    post = app_of(mode, False, dsn, ran, authorize=authorize)
    key = new_key("authz404")
    assert post(key, "alice").status_code == 201
    r = post(key, "alice", X_Revoked="1")
    assert (r.status_code, r.content) == (404, b"gone") and len(ran) == 1


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_authorize_raising_sends_no_body(dsn, mode):
    ran = []

    def authorize(request):
        raise RuntimeError("the permission service is down")
    post = app_of(mode, False, dsn, ran, authorize=authorize)
    key = new_key("authzerr")
    assert post(key, "alice").status_code == 201       # the first request runs
    r = post(key, "alice")
    assert r.status_code == 500 and b"secret" not in r.content and len(ran) == 1


@pytest.mark.parametrize("status", [401, 403, 407, 408, 425])
@pytest.mark.parametrize("mode,transactional", MODES)
def test_an_auth_failure_is_not_stored(dsn, db, mode, transactional, status):
    ran = []
    post = app_of(mode, transactional, dsn, ran)
    key = new_key("s%d" % status)
    r1 = post(key, "alice", X_Status=str(status))
    assert r1.status_code == status and len(ran) == 1
    assert lookup(db, key, caller_scope("", "alice")) is None       # released
    r2 = post(key, "alice")                  # after the token refresh
    assert r2.status_code == 201 and "idempotent-replayed" not in r2.headers
    assert len(ran) == 2
    assert post(key, "alice").headers["idempotent-replayed"] == "true" and len(ran) == 2


def test_default_policy():
    for s in (200, 201, 204, 301, 400, 404, 409, 410, 422):
        assert _http.default_store_status(s), s
    for s in (401, 403, 407, 408, 425, 429, 500, 502, 503, 504):
        assert not _http.default_store_status(s), s


@pytest.mark.parametrize("who", ["raise", "none", "int"])
@pytest.mark.parametrize("mode,transactional", MODES)
def test_a_failing_principal_hook_is_500_and_claims_nothing(dsn, db, mode, transactional, who):
    ran = []
    post = app_of(mode, transactional, dsn, ran)
    key = new_key("bad")
    r = post(key, who)
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/problem+json"
    assert ran == [] and rows(db, key) == 0
