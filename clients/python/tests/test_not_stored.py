"""Issue #23: once a handler has run, its key is never left claimable by a
failure to store its response.  A complete that fails for good stores the
fixed 500 "Response not stored" (doc/http.md) in the guards and the
middleware (default and transactional mode); a transient failure does
not.  Also: the parse of the header, the replay policy, the envelope,
Idempotency-Expires, the bounds on every wait, and the error for a
function not found."""

import asyncio
import datetime as dt
import email.utils
import json
import logging

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_pg import (AsyncGuard, FailN, FunctionNotFound, Guard, Outcome, Response,
                     Timeout, atomic)
from idem_pg._common import NOT_STORED_BODY
from idem_pg._http import BadKey, Settings, pack, parse_key, unpack
from idem_pg.asgi import IdempotencyMiddleware
from idem_pg.atomic import AsyncAtomic, Atomic
from idem_pg.errors import IdemError, transient
from idem_pg.wsgi import IdempotencyWSGIMiddleware

from conftest import lookup, new_key, setting

FP = "fp-not-stored"
NOT_STORED = json.loads(NOT_STORED_BODY)
BROKEN = "22000"        # data_exception: a failure a retry of the call cannot fix


@pytest.fixture(scope="module", autouse=True)
def table():
    from conftest import DSN
    with psycopg.connect(DSN, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS tx_rows (id bigserial PRIMARY KEY,"
                  " key text NOT NULL)")
    yield


def rows(db, key):
    return db.execute("SELECT count(*) FROM tx_rows WHERE key = %s", [key]).fetchone()[0]


# -- the header, the policy, the envelope --------------------------------------------


def test_parse_key_forms():
    assert parse_key('"U"') == parse_key("U") == "U"
    assert parse_key(' "a\\"b\\\\c" ') == 'a"b\\c'
    assert parse_key("8e03978e-40d5") == "8e03978e-40d5"
    assert parse_key("x" * 255) == "x" * 255
    assert parse_key(None) is None
    for bad in ("a\x01b", "a\x7fb", "a\x1bb", '"a\x1b"', "caf\xe9", '"abc', '"a\\qb"',
                '"a"b', '"a\\"', "", '""', " ", "x" * 256, '"%s"' % ("x" * 256)):
        with pytest.raises(BadKey):
            parse_key(bad)


def test_policy_and_envelope():
    s = Settings(shared=True)
    assert [s.stores(c) for c in (200, 201, 404, 409, 422, 429, 500, 503)] == \
        [True, True, True, True, True, False, False, False]
    assert all(Settings(shared=True, store_server_errors=True).stores(c) for c in (429, 500, 503))
    only_500 = Settings(shared=True, store_status=lambda c: c != 503)
    assert only_500.stores(500) and not only_500.stores(503)
    with pytest.raises(TypeError):
        Settings(shared=True, store_status=lambda c: True, store_server_errors=True)
    data = pack(s.kept([("Content-Type", "text/plain"), ("X-Other", "no"),
                        ("ETag", '"1"')]), b"\x00body")
    assert data == b'idem-http/1\n[["content-type","text/plain"],["etag","\\"1\\""]]\n\x00body'
    assert unpack(data) == ([("content-type", "text/plain"), ("etag", '"1"')], b"\x00body")
    when = dt.datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=dt.timezone.utc)
    assert Settings.expires(when) == [("idempotency-expires", "Wed, 02 Jan 2030 03:04:05 GMT")]
    key, bad = s.key_of('"K"')
    assert (key, bad) == ("K", None)
    key, bad = s.key_of("K\x01")
    assert key is None and bad[0] == 400


def test_transient():
    def err(state):
        return IdemError("x", sqlstate=state)
    for state in ("08006", "40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03",
                  "53300", "ID002", "ID003", "42501", None):
        assert transient(err(state)), state
    for state in ("54000", "22000", "22023", "ID001", "XX000", "42883"):
        assert not transient(err(state)), state


# -- the guards ---------------------------------------------------------------------


def test_guard_stores_the_fixed_answer_when_complete_fails_for_good(dsn, db, caplog):
    key, runs = new_key("ns"), []
    g = Guard(dsn, fault=FailN("complete", 1, "broken", sqlstate=BROKEN))
    with caplog.at_level(logging.WARNING, logger="idem_pg"):
        r = g.do(key, FP, lambda claim: runs.append(1) or Response(201, b"done"))
    assert r.outcome is Outcome.EXECUTED and r.failed_step == "complete"
    assert r.not_stored and r.error.sqlstate == BROKEN and r.expires_at is not None
    assert r.response == Response(201, b"done")          # what the caller answers
    assert any(key in m and "not stored" in m for m in caplog.messages)
    again = g.do(key, FP, lambda claim: runs.append(1) or Response(201, b"again"))
    assert again.outcome is Outcome.REPLAYED and runs == [1]
    assert again.response == Response(500, NOT_STORED_BODY)
    assert lookup(db, key)["state"] == "DONE"


def test_guard_leaves_a_transient_failure_to_the_lease(dsn, db):
    key = new_key("tr")
    g = Guard(dsn, fault=FailN("complete", 1, "link lost"))       # no SQLSTATE
    r = g.do(key, FP, lambda claim: Response(201, b"done"))
    assert r.failed_step == "complete" and not r.not_stored
    assert lookup(db, key)["state"] == "PROCESSING"
    assert g.do(key, FP, lambda claim: Response(201, b"x"), wait_for=0).outcome \
        is Outcome.IN_FLIGHT


def test_async_guard_stores_the_fixed_answer(dsn, db):
    key, runs = new_key("ans"), []

    async def handler(claim):
        runs.append(1)
        return Response(201, b"done")

    async def main():
        g = AsyncGuard(dsn, fault=FailN("complete", 1, "broken", sqlstate="54000"))
        return await g.do(key, FP, handler), await g.do(key, FP, handler)

    first, again = asyncio.run(main())
    assert first.failed_step == "complete" and first.not_stored
    assert again.outcome is Outcome.REPLAYED and runs == [1]
    assert again.response == Response(500, NOT_STORED_BODY)
    assert again.expires_at is not None


def test_a_too_large_body_is_stored_as_not_stored_by_the_server(dsn, db):
    key, runs = new_key("big"), []
    size = int(db.execute("SELECT setting FROM pg_settings"
                          " WHERE name = 'idem.max_body_size'").fetchone()[0])
    g = Guard(dsn)
    r = g.do(key, FP, lambda claim: runs.append(1) or Response(201, b"x" * (size + 1)))
    assert r.ok and not r.not_stored
    again = g.do(key, FP, lambda claim: runs.append(1) or Response(201, b"x"))
    assert again.response == Response(500, NOT_STORED_BODY) and runs == [1]


# -- the middleware -----------------------------------------------------------------


def asgi_app(dsn, **settings):
    async def orders(request):
        conn = request.state.idem_connection if settings.get("transactional") else None
        key = request.state.idem_key
        if conn is not None:
            await conn.execute("INSERT INTO tx_rows (key) VALUES (%s)", [key])
        else:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
                await c.execute("INSERT INTO tx_rows (key) VALUES (%s)", [key])
        if request.query_params.get("raise"):
            raise RuntimeError("handler failed")
        code = int(request.query_params.get("status", "201"))
        return JSONResponse({"key": key}, status_code=code, headers={"ETag": '"e"'})

    app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
    fault = settings.pop("fault", None)
    app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(dsn, timeout=5, fault=fault),
                       shared=True, **settings)
    return app


def asgi_post(app, key, path="/orders"):
    async def main():
        async with httpx.AsyncClient(app=app, base_url="http://app") as c:
            return await c.post(path, content=b"{}", headers={"Idempotency-Key": key})
    return asyncio.run(main())


def test_middleware_stores_the_fixed_answer_in_the_envelope(dsn, db):
    key = new_key("mw")
    app = asgi_app(dsn, fault=FailN("complete", 1, "broken", sqlstate=BROKEN))
    r1 = asgi_post(app, '"%s"' % key)
    assert r1.status_code == 201 and r1.json() == {"key": key}
    assert "idempotency-expires" not in r1.headers        # its response is not stored
    r2 = asgi_post(app, key)
    assert r2.status_code == 500 and r2.json() == NOT_STORED
    assert r2.headers["content-type"] == "application/problem+json"
    assert r2.headers["idempotent-replayed"] == "true"
    assert rows(db, key) == 1


def test_middleware_replays_with_idempotency_expires(dsn, db):
    key = new_key("exp")
    app = asgi_app(dsn)
    r1, r2 = asgi_post(app, key), asgi_post(app, key)
    assert r1.status_code == r2.status_code == 201
    assert r1.headers["idempotency-expires"] == r2.headers["idempotency-expires"]
    expires = email.utils.parsedate_to_datetime(r1.headers["idempotency-expires"])
    stored = lookup(db, key)["expires_at"].replace(microsecond=0)
    assert expires == stored
    assert r2.headers["etag"] == '"e"' and rows(db, key) == 1


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_transactional_mode(dsn, db, mode):
    """The handler's write, the claim and the response commit together; a
    response not stored (503) or an exception rolls all of it back."""
    if mode == "asgi":
        app = asgi_app(dsn, transactional=True)
        post = lambda key, q="": asgi_post(app, key, "/orders" + q)  # noqa: E731
    else:
        app = wsgi_app(dsn)

        def post(key, q=""):
            with httpx.Client(app=app, base_url="http://app") as c:
                return c.post("/orders" + q, content=b"{}", headers={"Idempotency-Key": key})
    key = new_key("tx")
    r1 = post(key)
    assert r1.status_code == 201 and r1.json() == {"key": key} and rows(db, key) == 1
    assert "idempotency-expires" in r1.headers
    r2 = post(key)
    assert r2.status_code == 201 and r2.headers["idempotent-replayed"] == "true"
    assert r2.content == r1.content and rows(db, key) == 1

    key = new_key("tx503")
    assert post(key, "?status=503").status_code == 503
    assert rows(db, key) == 0 and lookup(db, key) is None
    r = post(key, "?status=503")
    assert r.status_code == 503 and "idempotent-replayed" not in r.headers

    key = new_key("txraise")
    if mode == "asgi":
        with pytest.raises(RuntimeError):
            post(key, "?raise=1")
    else:                               # Flask answers 500 itself: not stored
        assert post(key, "?raise=1").status_code == 500
    assert rows(db, key) == 0 and lookup(db, key) is None


def wsgi_app(dsn):
    from flask import Flask, g, jsonify, request

    fl = Flask("tx")

    @fl.post("/orders")
    def orders():
        g.idem_connection.execute("INSERT INTO tx_rows (key) VALUES (%s)", [g.idem_key])
        if request.args.get("raise"):
            raise RuntimeError("handler failed")
        resp = jsonify({"key": g.idem_key})
        resp.status_code = int(request.args.get("status", "201"))
        return resp

    fl.wsgi_app = IdempotencyWSGIMiddleware(fl.wsgi_app, guard=Guard(dsn, timeout=5),
                                            transactional=True, shared=True)
    return fl


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_transactional_mode_stores_the_fixed_answer(dsn, db, monkeypatch, mode):
    """idem_complete fails for good inside the transaction: the savepoint
    is rolled back, the fixed answer stored, the handler's write kept."""
    calls = []
    cls = AsyncAtomic if mode == "asgi" else Atomic
    real = cls.complete

    def failing(self, status, body=b"", **kw):
        calls.append(status)
        if len(calls) == 1:
            raise IdemError("broken", sqlstate=BROKEN)
        return real(self, status, body, **kw)

    if mode == "asgi":
        async def failing_async(self, status, body=b"", **kw):
            calls.append(status)
            if len(calls) == 1:
                raise IdemError("broken", sqlstate=BROKEN)
            return await real(self, status, body, **kw)
        monkeypatch.setattr(cls, "complete", failing_async)
        app = asgi_app(dsn, transactional=True)
        post = lambda key: asgi_post(app, key)  # noqa: E731
    else:
        monkeypatch.setattr(cls, "complete", failing)
        app = wsgi_app(dsn)

        def post(key):
            with httpx.Client(app=app, base_url="http://app") as c:
                return c.post("/orders", content=b"{}", headers={"Idempotency-Key": key})
    key = new_key("txns")
    r1 = post(key)
    assert r1.status_code == 201 and rows(db, key) == 1 and calls == [201, 500]
    r2 = post(key)
    assert r2.status_code == 500 and r2.json() == NOT_STORED and rows(db, key) == 1


# -- bounded waits ------------------------------------------------------------------


def hold_uncommitted_claim(dsn, key):
    holder = psycopg.connect(dsn)
    holder.execute("SELECT * FROM public.idem_begin(%s::text, %s::text)", [key, FP])
    return holder


def lock_waiters(db):
    return db.execute("SELECT count(*) FROM pg_stat_activity"
                      " WHERE wait_event_type = 'Lock'").fetchone()[0]


def test_atomic_timeout_ends_the_server_wait(dsn, db):
    """A claim given up on by its timeout is given up on in the server: when
    the holder rolls back, the abandoned call does not claim the key."""
    key = new_key("atm")
    holder = hold_uncommitted_claim(dsn, key)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            with pytest.raises(Timeout):
                with atomic(conn, key, FP, timeout=0.3):
                    pass
            assert lock_waiters(db) == 0
            # the session's statement_timeout is back
            assert setting(conn, "statement_timeout") == "0"
    finally:
        holder.rollback()
        holder.close()
    assert lookup(db, key) is None


def test_guard_complete_and_extend_are_bounded(dsn, db):
    """idem_complete and idem_extend wait for a transaction that holds the
    key's row; the guard's timeout ends that wait in the server."""
    key = new_key("cx")
    g = Guard(dsn, timeout=0.3)
    row = g.begin(key, FP)
    holder = psycopg.connect(dsn)
    try:
        holder.execute("SELECT public.idem_extend(%s::text, %s::bigint, interval '60 s')",
                       [key, row.token])
        with pytest.raises(Timeout):
            g.complete(key, FP, 200, b"late", row.token)
        with pytest.raises(Timeout):
            g.extend(key, row.token)
        assert lock_waiters(db) == 0
    finally:
        holder.rollback()
        holder.close()
    assert lookup(db, key)["state"] == "PROCESSING"


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_transactional_retry_gives_up_in_the_server(dsn, db, mode):
    """A retry in transactional mode waits for the transaction that holds
    the key only up to the guard's timeout: 409, and once the holder rolls
    back the key is free, not claimed by the retry that gave up."""
    key = new_key("txw")
    holder = hold_uncommitted_claim(dsn, key)
    try:
        if mode == "asgi":
            app = Starlette(routes=[Route("/orders", lambda request: JSONResponse({}),
                                          methods=["POST"])])
            app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(dsn, timeout=0.3),
                               transactional=True, wait_for=0, shared=True)
            r = asgi_post(app, key)
        else:
            from flask import Flask
            fl = Flask("w")
            fl.post("/orders")(lambda: {})
            fl.wsgi_app = IdempotencyWSGIMiddleware(fl.wsgi_app, guard=Guard(dsn, timeout=0.3),
                                                    transactional=True, wait_for=0, shared=True)
            with httpx.Client(app=fl, base_url="http://app") as c:
                r = c.post("/orders", content=b"{}", headers={"Idempotency-Key": key})
        assert r.status_code == 409 and r.headers["retry-after"] == "1"
        assert lock_waiters(db) == 0
    finally:
        holder.rollback()
        holder.close()
    assert lookup(db, key) is None


# -- a function not found -----------------------------------------------------------


def test_function_not_found_names_function_and_schema(dsn, db):
    r = Guard(dsn, schema="nowhere").do(new_key(), FP, lambda claim: Response(200))
    assert r.outcome is Outcome.UNAVAILABLE and isinstance(r.error, FunctionNotFound)
    text = str(r.error)
    assert text.startswith('idem_begin not found in schema "nowhere" (3F000: ')
    fix = ("set schema= (of the guard, atomic() or the middleware's guard) to the schema "
           "where CREATE EXTENSION idem put it, or if the version is old run "
           "ALTER EXTENSION idem UPDATE")
    assert text.endswith("; " + fix)
    assert r.error.sqlstate == "3F000"                 # no such schema
    db.execute("CREATE SCHEMA IF NOT EXISTS idem_empty")
    r = Guard(dsn, schema="idem_empty").do(new_key(), FP, lambda claim: Response(200))
    assert isinstance(r.error, FunctionNotFound) and r.error.sqlstate == "42883"
    assert str(r.error).startswith('idem_begin not found in schema "idem_empty" (42883: ')
    assert str(r.error).endswith("; " + fix)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(FunctionNotFound) as e:
            with atomic(conn, new_key(), FP, schema="elsewhere"):
                pass
    assert str(e.value).startswith('idem_begin not found in schema "elsewhere"')
    assert str(e.value).endswith("; " + fix)


@pytest.mark.parametrize("aio", [False, True])
def test_wrong_schema_first_warning_names_schema_and_option(dsn, db, caplog, aio):
    """With wait_for, the first call in a wrong schema is refused as if the
    server lacked wait_for: the warning names the schema looked in and
    schema=, not only ALTER EXTENSION idem UPDATE."""
    db.execute("CREATE SCHEMA IF NOT EXISTS idem_empty")
    caplog.set_level(logging.WARNING, logger="idem_pg")
    if aio:
        r = asyncio.run(AsyncGuard(dsn, schema="idem_empty").do(
            new_key(), FP, lambda claim: _aresponse(), wait_for=1))
    else:
        r = Guard(dsn, schema="idem_empty").do(new_key(), FP, lambda claim: Response(200),
                                              wait_for=1)
    assert isinstance(r.error, FunctionNotFound)
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert warnings, "no warning"
    first = warnings[0]
    assert first.startswith('idem_begin with wait_for not found in schema "idem_empty" (42883: '), first
    assert "set schema= (of the guard" in first and "ALTER EXTENSION idem UPDATE" in first, first


async def _aresponse():
    return Response(200)


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
@pytest.mark.parametrize("transactional", [False, True])
def test_unknown_state_is_503_and_the_handler_does_not_run(dsn, future_schema, mode,
                                                           transactional):
    """A state of idem_begin this client does not know (a newer server,
    played by a look-alike in its own schema) is 503, not 409, in both
    modes of both middlewares; the handler does not run."""
    ran = []
    key = new_key("future")
    if mode == "asgi":
        async def orders(request):
            ran.append(request.state.idem_key)
            return JSONResponse({"ok": True}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(dsn, schema=future_schema),
                           transactional=transactional, shared=True)
        r = asgi_post(app, key)
    else:
        def orders(environ, start_response):
            ran.append(key)
            start_response("201 Created", [("Content-Type", "application/json")])
            return [b"{}"]

        wapp = IdempotencyWSGIMiddleware(orders, guard=Guard(dsn, schema=future_schema),
                                         transactional=transactional, shared=True)
        with httpx.Client(app=wapp, base_url="http://app") as c:
            r = c.post("/orders", content=b"{}", headers={"Idempotency-Key": key})
    assert r.status_code == 503 and ran == [], (r.status_code, r.text)


# -- an unavailable store, logged once ------------------------------------------------


@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
def test_unavailable_store_is_logged_once_with_its_cause(down_dsn, caplog, mode):
    """Three requests to a store that is down: three 503, one warning, which
    says why (the connection's error); as the Node middleware does."""
    ran = []
    caplog.set_level(logging.WARNING, logger="idem_pg")
    if mode == "asgi":
        async def orders(request):
            ran.append(1)
            return JSONResponse({}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(down_dsn, timeout=2),
                           shared=True)
        statuses = [asgi_post(app, new_key("down")).status_code for _ in range(3)]
    else:
        def orders(environ, start_response):
            ran.append(1)
            start_response("201 Created", [("Content-Type", "application/json")])
            return [b"{}"]

        wapp = IdempotencyWSGIMiddleware(orders, guard=Guard(down_dsn, timeout=2), shared=True)
        with httpx.Client(app=wapp, base_url="http://app") as c:
            statuses = [c.post("/orders", content=b"{}",
                               headers={"Idempotency-Key": new_key("down")}).status_code
                        for _ in range(3)]
    assert statuses == [503, 503, 503] and ran == []
    warnings = [m for m in caplog.messages if "idempotency store unavailable" in m]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("idempotency store unavailable (")
    assert "connect" in warnings[0].lower() or "refused" in warnings[0].lower(), warnings[0]
    assert warnings[0].endswith("; requests with a key are answered 503 until it answers "
                                "again, which is not logged for each one")
