"""The WSGI test app: Flask apps with the middleware, mounted like the
ASGI app's (/req, /opt, /store, /down) with the same waits for a request
in flight; every executed handler inserts a row into http_calls."""

import os
import time

import psycopg
from flask import Flask, Response, jsonify, request
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from idem_pg import Guard
from idem_pg.wsgi import IdempotencyWSGIMiddleware

DSN = os.environ["IDEM_TEST_DSN"]
DOWN_DSN = os.environ["IDEM_TEST_DOWN_DSN"]
LEASE = float(os.environ.get("IDEM_TEST_LEASE", "30"))


def record(app: str) -> int:
    with psycopg.connect(DSN, autocommit=True) as c:
        return c.execute(
            "INSERT INTO http_calls (app, tenant, key, path) VALUES (%s, %s, %s, %s)"
            " RETURNING id", [app, request.headers.get("X-Tenant", ""),
                              request.headers.get("Idempotency-Key"),
                              request.path]).fetchone()[0]


def flask_app(name: str, dsn: str, **settings) -> Flask:
    fl = Flask(name)

    @fl.post("/orders")
    def orders():
        n = record(name)
        resp = jsonify({"order": n, "echo": request.get_data().decode("utf-8", "replace")})
        resp.status_code = 201
        resp.headers["X-Order"] = str(n)
        resp.headers["Location"] = "/orders/%d" % n
        return resp

    @fl.post("/slow")
    def slow():
        time.sleep(int(request.args.get("ms", "500")) / 1000)
        return orders()

    @fl.post("/gated")
    def gated():
        # waits until the test releases the advisory lock numbered ?gate=
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute("SELECT pg_advisory_lock_shared(%s::bigint)",
                      [int(request.args["gate"])])
        return orders()

    @fl.post("/fail500")
    def fail500():
        record(name)
        return Response("boom", status=500, content_type="text/plain; charset=utf-8")

    @fl.post("/raise")
    def raises():
        record(name)
        raise RuntimeError("handler failed")

    @fl.post("/bytes")
    def binary():
        record(name)
        return Response(bytes(range(256)) + b"\\x41\\\\000", content_type="application/octet-stream")

    @fl.get("/orders")
    def list_orders():
        return jsonify({"ok": True})

    guard = Guard(dsn, lease=LEASE, timeout=5, wait_for=30)
    fl.wsgi_app = IdempotencyWSGIMiddleware(
        fl.wsgi_app, guard=guard,
        scope=lambda environ: environ.get("HTTP_X_TENANT", ""), shared=True, **settings)
    return fl


def opt_wait(environ) -> float:
    return 1.0 if environ.get("PATH_INFO", "").endswith("/gated") else 5.0


root = Flask("root")


@root.get("/health")
def health():
    return jsonify({"ok": True})


app = DispatcherMiddleware(root, {
    "/req": flask_app("req", DSN, required=True),
    "/opt": flask_app("opt", DSN, wait_for=opt_wait),
    "/store": flask_app("store", DSN, store_server_errors=True, wait_for=0),
    "/down": flask_app("down", DOWN_DSN),
})
