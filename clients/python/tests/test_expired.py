"""EXPIRED (issue #44, item 4): a server with tombstones answers a retry
whose response's retention is over, but whose key idem_begin's
``remember`` still keeps, with the state EXPIRED.  Played by a look-alike
idem_begin (conftest.expired_schema) that answers EXPIRED with status 201
and records the remember of each call; the server's own tombstones are
not in this branch."""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_pg import (AsyncGuard, FunctionNotFound, Guard, Outcome, Response, Unavailable,
                     atomic, atomic_async)
from idem_pg._common import statements
from idem_pg.asgi import IdempotencyMiddleware
from idem_pg.wsgi import IdempotencyWSGIMiddleware

from conftest import calls, lookup, new_key, remembered, wait_for

FP = "fp-expired"


def test_guard_answers_expired_with_the_status_and_never_runs_the_handler(
        dsn, db, expired_schema):
    ran = []
    key = new_key("exp")
    r = Guard(dsn, schema=expired_schema).do(key, FP, lambda claim: ran.append(1) or Response(200))
    assert r.outcome is Outcome.EXPIRED and str(r.outcome) == "EXPIRED"
    assert r.status == 201 and r.response is None and r.token is None
    assert r.error is None and r.failed_step is None and not r.ok
    assert ran == []
    assert remembered(db, expired_schema, key) == [None]


def test_async_guard_answers_expired(dsn, db, expired_schema):
    ran = []

    async def handler(claim):
        ran.append(1)
        return Response(200)

    key = new_key("exp")
    r = asyncio.run(AsyncGuard(dsn, schema=expired_schema).do(key, FP, handler))
    assert r.outcome is Outcome.EXPIRED and r.status == 201 and r.response is None
    assert r.error is None and ran == []


def test_guard_sends_remember_when_set(dsn, db, expired_schema):
    """The guard's remember, else none; do()'s and begin()'s own override it."""
    g = Guard(dsn, schema=expired_schema, remember=30)
    k1, k2, k3 = new_key("exp"), new_key("exp"), new_key("exp")
    assert g.do(k1, FP, lambda claim: Response(200)).outcome is Outcome.EXPIRED
    assert g.do(k2, FP, lambda claim: Response(200),
                remember=dt.timedelta(hours=2)).outcome is Outcome.EXPIRED
    assert g.begin(k3, FP, wait_for=1, remember=5).outcome() is Outcome.EXPIRED
    assert remembered(db, expired_schema, k1) == [30.0]
    assert remembered(db, expired_schema, k2) == [7200.0]
    assert remembered(db, expired_schema, k3) == [5.0]
    ag = AsyncGuard(dsn, schema=expired_schema, remember=40)
    k4 = new_key("exp")
    r = asyncio.run(ag.do(k4, FP, lambda claim: Response(200)))
    assert r.outcome is Outcome.EXPIRED and remembered(db, expired_schema, k4) == [40.0]


def test_remember_is_sent_only_when_set(dsn, future_schema):
    """Against an idem_begin without remember (seven parameters), a call
    without remember reaches it (its unknown state: Unavailable), one
    with remember names an argument it lacks (42883)."""
    plain = Guard(dsn, schema=future_schema).do(new_key(), FP, lambda claim: Response(200))
    assert isinstance(plain.error, Unavailable) and "unknown state" in str(plain.error)
    r = Guard(dsn, schema=future_schema, remember=30).do(new_key(), FP,
                                                          lambda claim: Response(200))
    assert isinstance(r.error, FunctionNotFound) and r.error.sqlstate == "42883"
    st = statements("s")
    for q in (st.begin, st.begin_wait, st.begin_phase, st.begin_atomic_defaults):
        assert "remember" not in q
        assert st.with_remember(q, None) == q
        assert st.with_remember(q, dt.timedelta(seconds=1)).endswith(
            ", remember => %s::interval)")


def test_atomic_answers_expired(dsn, db, expired_schema):
    ran = []
    key = new_key("exp")
    with psycopg.connect(dsn, autocommit=True) as conn:
        with atomic(conn, key, FP, schema=expired_schema, remember=60) as tx:
            assert tx.outcome is Outcome.EXPIRED and not tx.claimed
            assert tx.status == 201 and tx.response is None and tx.token is None
            if tx.claimed:
                ran.append(1)
        key2 = new_key("exp")
        with atomic(conn, key2, FP, schema=expired_schema, wait_for=1, scope="t") as tx:
            assert tx.outcome is Outcome.EXPIRED and tx.status == 201
    assert ran == []
    assert remembered(db, expired_schema, key) == [60.0]
    assert remembered(db, expired_schema, key2) == [None]

    async def main():
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            async with atomic_async(conn, key, FP, schema=expired_schema, remember=9) as tx:
                return tx.outcome, tx.status
        finally:
            await conn.close()

    assert asyncio.run(main()) == (Outcome.EXPIRED, 201)
    assert remembered(db, expired_schema, key) == [60.0, 9.0]


def _headers(key, oasis):
    if oasis:
        now = dt.datetime.now(dt.timezone.utc)
        return {"Repeatability-Request-ID": key,
                "Repeatability-First-Sent": email.utils.format_datetime(now, usegmt=True)}
    return {"Idempotency-Key": key}


@pytest.mark.parametrize("oasis", [False, True])
@pytest.mark.parametrize("mode", ["asgi", "wsgi"])
@pytest.mark.parametrize("transactional", [False, True])
def test_middleware_answers_410_and_does_not_run_the_handler(dsn, db, expired_schema, mode,
                                                             transactional, oasis):
    """410 Gone, application/problem+json with the other problems' shape,
    Repeatability-Result: rejected for an OASIS request; the handler (which
    would write a row of http_calls) does not run; the middleware's
    remember reaches idem_begin."""
    ran = []
    key = new_key("exp")

    def write():
        ran.append(key)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO http_calls (app, key, path) VALUES ('expired', %s, '/orders')",
                      [key])

    if mode == "asgi":
        async def orders(request):
            write()
            return JSONResponse({"ok": True}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(dsn, schema=expired_schema),
                           transactional=transactional, shared=True, remember=3600)

        async def main():
            async with httpx.AsyncClient(app=app, base_url="http://app") as c:
                return await c.post("/orders", content=b"{}", headers=_headers(key, oasis))
        r = asyncio.run(main())
    else:
        def worders(environ, start_response):
            write()
            start_response("201 Created", [("Content-Type", "application/json")])
            return [b"{}"]

        wapp = IdempotencyWSGIMiddleware(worders, guard=Guard(dsn, schema=expired_schema),
                                         transactional=transactional, shared=True,
                                         remember=3600)
        with httpx.Client(app=wapp, base_url="http://app") as c:
            r = c.post("/orders", content=b"{}", headers=_headers(key, oasis))
    assert r.status_code == 410, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert list(body) == ["type", "title", "status", "detail"] and body["status"] == 410
    assert body["title"] == "response expired"
    assert "idempotent-replayed" not in r.headers
    if oasis:
        assert r.headers["repeatability-result"] == "rejected"
    else:
        assert "repeatability-result" not in r.headers
    assert ran == [] and calls(db, key=key) == 0
    assert remembered(db, expired_schema, key) == [3600.0]


def test_middleware_without_remember_uses_the_guards(dsn, db, expired_schema):
    key = new_key("exp")
    wapp = IdempotencyWSGIMiddleware(lambda e, s: [b""], shared=True,
                                     guard=Guard(dsn, schema=expired_schema, remember=12))
    with httpx.Client(app=wapp, base_url="http://app") as c:
        r = c.post("/orders", content=b"{}", headers={"Idempotency-Key": key})
    assert r.status_code == 410 and remembered(db, expired_schema, key) == [12.0]


# -- against the server's own tombstones (extension 1.6) ----------------------


def _retention_over(db, key):
    return db.execute("SELECT coalesce(bool_and(expires_at < now()), false)"
                      " FROM public.idem_keys WHERE key = %s", [key]).fetchone()[0]


def test_server_tombstone_answers_expired_and_never_runs_again(dsn, db):
    """The real idem_begin: a key completed with retention 1 s and remember
    1 hour, retried once its retention is over (expires_at < now(),
    polled), is EXPIRED with the stored status and the handler does not
    run; the same without remember runs the handler again."""
    ran = {"kept": 0, "plain": 0}

    def handler(name):
        def run(claim):
            ran[name] += 1
            return Response(201, body=b'{"order": 1}')
        return run

    kept, plain = new_key("tomb"), new_key("tomb-plain")
    g = Guard(dsn, lease=1, retention=1, remember=3600)
    first = g.do(kept, FP, handler("kept"))
    assert first.outcome is Outcome.EXECUTED and first.response.status == 201
    p = Guard(dsn, lease=1, retention=1).do(plain, FP, handler("plain"))
    assert p.outcome is Outcome.EXECUTED
    assert ran == {"kept": 1, "plain": 1}
    wait_for(lambda: _retention_over(db, kept) and _retention_over(db, plain), timeout=30,
             step=0.05, what="the retention to be over")
    for _ in range(2):
        r = g.do(kept, FP, handler("kept"))
        assert r.outcome is Outcome.EXPIRED
        assert r.status == 201 and r.response is None and r.token is None and r.error is None
    a = asyncio.run(AsyncGuard(dsn, lease=1, retention=1, remember=3600).do(kept, FP, handler("kept")))
    assert a.outcome is Outcome.EXPIRED and a.status == 201
    assert ran["kept"] == 1                       # never again
    again = Guard(dsn, lease=1, retention=1).do(plain, FP, handler("plain"))
    assert again.outcome is Outcome.EXECUTED and ran["plain"] == 2
    row = lookup(db, kept)
    assert (row["state"], row["status"]) == ("EXPIRED", 201)
