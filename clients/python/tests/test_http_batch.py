"""idem_pg.http_batch: a batch route behind the WSGI (Flask) and ASGI
(Starlette) middleware, in process: the envelope's key replays the whole
envelope, item keys (K:i or the item's own) are claimed with do_many."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from flask import Flask, g, request
from starlette.applications import Starlette
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route

import drivers
from conftest import lookup, new_key
from idem_pg import AsyncGuard, Guard
from idem_pg import http_batch
from idem_pg.asgi import IdempotencyMiddleware
from idem_pg.wsgi import IdempotencyWSGIMiddleware


def flask_app(dsn, runs):
    guard = Guard(dsn)
    fl = Flask("batch")

    @fl.post("/batch")
    def batch():
        def handler(i, item, claim):
            runs.append(claim.key)
            if item.get("fail"):
                raise RuntimeError("item fails")
            return 201, {"sku": item["sku"], "n": len(runs)}

        status, headers, body = http_batch.run_batch(
            guard, g.idem_key, (request.get_json(silent=True) or {}).get("items"), handler,
            scope=request.environ["idem_pg.scope"], wait_for=0)
        return body, status, headers

    fl.wsgi_app = IdempotencyWSGIMiddleware(
        fl.wsgi_app, guard=guard, scope=lambda environ: environ.get("HTTP_X_TENANT", ""),
        shared=True, wait_for=0)
    return fl


def post(client, key, items, tenant="t1"):
    headers = {"Idempotency-Key": key, "X-Tenant": tenant} if key else {"X-Tenant": tenant}
    r = client.post("/batch", data=json.dumps({"items": items}), headers=headers,
                    content_type="application/json")
    return r.status_code, r.headers, json.loads(r.get_data())


def test_wsgi_batch(dsn, db):
    runs = []
    client = flask_app(dsn, runs).test_client()
    k = new_key("env")
    own = new_key("own")
    items = [{"sku": "A"}, {"sku": "B", "idempotency_key": own}, {"sku": "C"}]
    status, headers, body = post(client, k, items)
    assert status == 200
    assert [(x["index"], x["key"], x["status"], x["replayed"], x["body"]["sku"])
            for x in body["items"]] == [(0, k + ":0", 201, False, "A"),
                                        (1, own, 201, False, "B"),
                                        (2, k + ":2", 201, False, "C")]
    assert runs == [k + ":0", own, k + ":2"]
    # the envelope's retry: replayed whole by the middleware
    status2, headers2, body2 = post(client, k, items)
    assert (status2, body2) == (200, body)
    assert headers2.get("Idempotent-Replayed") == "true"
    assert runs == [k + ":0", own, k + ":2"]
    # another envelope with the same own item key: that item replayed, not run
    k2 = new_key("env")
    status, _, body = post(client, k2, [{"sku": "B", "idempotency_key": own}, {"sku": "D"}])
    assert status == 200
    assert [(x["key"], x["status"], x["replayed"]) for x in body["items"]] == [
        (own, 201, True), (k2 + ":1", 201, False)]
    assert runs == [k + ":0", own, k + ":2", k2 + ":1"]
    # the item key with other content: 422 for that item
    k3 = new_key("env")
    status, _, body = post(client, k3, [{"sku": "Z", "idempotency_key": own}])
    assert (status, body["items"][0]["status"]) == (200, 422)
    assert lookup(db, k + ":0", "t1")["state"] == "DONE"


def test_wsgi_batch_failed_item_runs_again(dsn):
    runs = []
    client = flask_app(dsn, runs).test_client()
    k = new_key("envf")
    items = [{"sku": "A"}, {"sku": "B", "fail": True}]
    status, headers, body = post(client, k, items)
    assert status == 503 and headers["Retry-After"] == "1"
    assert [x["status"] for x in body["items"]] == [201, 500]
    # not stored: the retry runs the batch again; A replays, B runs again
    status, headers, body = post(client, k, items)
    assert [(x["status"], x["replayed"]) for x in body["items"]] == [(201, True), (500, False)]
    assert runs == [k + ":0", k + ":1", k + ":1"]


def test_wsgi_bad_batch(dsn):
    client = flask_app(dsn, []).test_client()
    r = client.post("/batch", data=json.dumps({"items": [{"idempotency_key": "bad\u00e9"}]}),
                    headers={"Idempotency-Key": new_key("bad")}, content_type="application/json")
    assert r.status_code == 400
    assert "items[0].idempotency_key" in r.get_json()["detail"]
    r = client.post("/batch", data=b"{}", headers={"Idempotency-Key": new_key("bad")},
                    content_type="application/json")
    assert r.status_code == 400


def test_asgi_batch(adriver, dsn):
    runs = []

    async def main():
        guard = AsyncGuard(drivers.target(adriver, dsn))

        async def batch(request):
            items = (await request.json())["items"]

            async def handler(i, item, claim):
                runs.append(claim.key)
                return 201, {"sku": item["sku"]}

            status, headers, body = await http_batch.run_batch_async(
                guard, request.state.idem_key, items, handler,
                scope=request.state.idem_scope)
            return StarletteResponse(body, status, dict(headers))

        app = IdempotencyMiddleware(Starlette(routes=[Route("/batch", batch,
                                                            methods=["POST"])]),
                                    guard=guard, shared=True)
        k = new_key("aenv")
        items = [{"sku": "A"}, {"sku": "B"}, {"sku": "A", "idempotency_key": k + ":0"}]
        async with httpx.AsyncClient(app=app, base_url="http://t") as c:
            r = await c.post("/batch", json={"items": items}, headers={"Idempotency-Key": k})
            assert r.status_code == 200
            got = [(x["key"], x["status"], x["replayed"]) for x in r.json()["items"]]
            # the third item names the first's derived key with the same
            # content: the first's answer, not a second run
            assert got == [(k + ":0", 201, False), (k + ":1", 201, False),
                           (k + ":0", 201, False)]
            r2 = await c.post("/batch", json={"items": items}, headers={"Idempotency-Key": k})
            assert (r2.status_code, r2.json()) == (200, r.json())
            assert r2.headers.get("idempotent-replayed") == "true"
        assert runs == [k + ":0", k + ":1"]

    asyncio.run(main())
