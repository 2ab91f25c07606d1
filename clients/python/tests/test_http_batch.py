"""idem_pg.http_batch: a batch route behind the WSGI (Flask) and ASGI
(Starlette) middleware, in process: the envelope's key replays the whole
envelope, item keys (K:i or the item's own) are claimed with do_many; the
envelope and the item fingerprints of doc/http.md ("Batches"), the Node
middleware's byte for byte."""

from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest
from flask import Flask, g, request
from starlette.applications import Starlette
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route

import drivers
from conftest import lookup, new_key
from idem_pg import AsyncGuard, Guard, Outcome, Response, Result
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
    items = [{"sku": "A"}, {"sku": "B", "key": own}, {"sku": "C"}]
    status, headers, body = post(client, k, items)
    assert status == 200
    assert [(x["index"], x["key"], x["status"], x["replayed"], x["body"]["sku"])
            for x in body["results"]] == [(0, k + ":0", 201, False, "A"),
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
    status, _, body = post(client, k2, [{"sku": "B", "key": own}, {"sku": "D"}])
    assert status == 200
    assert [(x["key"], x["status"], x["replayed"]) for x in body["results"]] == [
        (own, 201, True), (k2 + ":1", 201, False)]
    assert runs == [k + ":0", own, k + ":2", k2 + ":1"]
    # the item key with other content: 422 for that item
    k3 = new_key("env")
    status, _, body = post(client, k3, [{"sku": "Z", "key": own}])
    assert (status, body["results"][0]["status"]) == (200, 422)
    assert lookup(db, k + ":0", "t1")["state"] == "DONE"


def test_wsgi_batch_failed_item_runs_again(dsn):
    runs = []
    client = flask_app(dsn, runs).test_client()
    k = new_key("envf")
    items = [{"sku": "A"}, {"sku": "B", "fail": True}]
    status, headers, body = post(client, k, items)
    assert status == 503 and headers["Retry-After"] == "1"
    assert [x["status"] for x in body["results"]] == [201, 500]
    # not stored: the retry runs the batch again; A replays, B runs again
    status, headers, body = post(client, k, items)
    assert [(x["status"], x["replayed"]) for x in body["results"]] == [(201, True), (500, False)]
    assert runs == [k + ":0", k + ":1", k + ":1"]


def test_wsgi_bad_batch(dsn):
    client = flask_app(dsn, []).test_client()
    r = client.post("/batch", data=json.dumps({"items": [{"key": "bad\u00e9"}]}),
                    headers={"Idempotency-Key": new_key("bad")}, content_type="application/json")
    assert r.status_code == 400
    assert "items[0].key" in r.get_json()["detail"]
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
        items = [{"sku": "A"}, {"sku": "B"}, {"sku": "A"}, {"sku": "A", "key": k + ":0"}]
        items[2]["key"] = k + ":1"
        async with httpx.AsyncClient(app=app, base_url="http://t") as c:
            r = await c.post("/batch", json={"items": items}, headers={"Idempotency-Key": k})
            assert r.status_code == 200
            got = [(x["key"], x["status"], x["replayed"]) for x in r.json()["results"]]
            # the third item names the second's derived key, the fourth the
            # first's: their items differ (the fingerprint is the whole item,
            # its key member included), 422 each
            assert got == [(k + ":0", 201, False), (k + ":1", 201, False),
                           (k + ":1", 422, False), (k + ":0", 422, False)]
            assert [x["duplicateOf"] for x in r.json()["results"]] == [None, None, 1, 0]
            r2 = await c.post("/batch", json={"items": items}, headers={"Idempotency-Key": k})
            assert (r2.status_code, r2.json()) == (200, r.json())
            assert r2.headers.get("idempotent-replayed") == "true"
        assert runs == [k + ":0", k + ":1"]

    asyncio.run(main())


def test_envelope_bytes_and_fingerprint():
    """The envelope's bytes and the default fingerprint: JSON.stringify's."""
    assert http_batch.item_json({"b": 1.0, "a": [2.50, 1e21, 1e-7, None, "caf\u00e9\n"]}) == \
        '{"b":1,"a":[2.5,1e+21,1e-7,null,"caf\u00e9\\n"]}'
    item = json.loads('{"key": "k-1", "sku": "w", "qty": 2.50}')
    assert http_batch.item_fingerprint(item) == hashlib.sha256(
        b'{"key":"k-1","sku":"w","qty":2.5}').hexdigest()
    results = [Result(Outcome.EXECUTED, response=Response(201, b'{"order":1}')),
               Result(Outcome.CONFLICT, duplicate_of=0)]
    status, headers, body = http_batch._answer([("k-1", "f"), ("k-1", "g")], results)
    assert (status, headers) == (200, [("Content-Type", "application/json")])
    assert body == (b'{"results":[{"index":0,"key":"k-1","status":201,"body":{"order":1},'
                    b'"replayed":false,"duplicateOf":null},{"index":1,"key":"k-1","status":422,'
                    b'"body":{"type":"about:blank","title":"item key reused","status":422,'
                    b'"detail":"this item\'s key was used with another item"},'
                    b'"replayed":false,"duplicateOf":0}]}')
