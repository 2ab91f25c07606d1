"""The conformance app of test/http/README.md for WSGI: Flask apps, each
with the middleware and its settings, mounted like the ASGI app's and
served by test.sh under gunicorn with two workers.

/batch/orders is the batch route of doc/http.md ("Batches"): each item
under its "key" or <key>:<index>, its handler inserting (item key,
'batch') and answering 201 {"order": id}; X-Conf-Fail-Item: i makes item
i's handler raise.

IDEM_CONF_DSN is the database (conf_orders), IDEM_CONF_DOWN_DSN the
dead one.
"""

import os
import signal
import time

import psycopg
from flask import Flask, Response, g, jsonify, request
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from idem_pg import Guard, http_batch
from idem_pg.wsgi import IdempotencyWSGIMiddleware

DSN = os.environ["IDEM_CONF_DSN"]
DOWN_DSN = os.environ["IDEM_CONF_DOWN_DSN"]


def insert(route: str, conn=None) -> int:
    """The handler's write: on the request's transaction when given one,
    else on a connection of its own (committed at once)."""
    q = "INSERT INTO conf_orders (key, route) VALUES (%s, %s) RETURNING id"
    if conn is not None:
        return conn.execute(q, [g.idem_key, route]).fetchone()[0]
    with psycopg.connect(DSN, autocommit=True) as own:
        return own.execute(q, [g.idem_key, route]).fetchone()[0]


def steer() -> None:
    """X-Conf-Sleep-Ms and X-Conf-Kill, after the insert."""
    ms = request.headers.get("X-Conf-Sleep-Ms")
    if ms:
        time.sleep(int(ms) / 1000)
    if request.headers.get("X-Conf-Kill") == "after-write":
        os.kill(os.getpid(), signal.SIGKILL)


def principal(environ):
    """The caller: X-Conf-Principal ("raise": the hook raises, "none": it
    returns None)."""
    who = environ.get("HTTP_X_CONF_PRINCIPAL", "")
    if who == "raise":
        raise RuntimeError("no session")
    return None if who == "none" else who


def authorize(environ) -> bool:
    """/authz: X-Conf-Revoked denies a replay."""
    return "HTTP_X_CONF_REVOKED" not in environ


def sub_app(name: str, dsn: str, lease: float = 30, retention: float = 3600,
            **settings) -> Flask:
    fl = Flask(name)
    status_route = "store5xx" if name == "store5xx" else "status"

    @fl.post("/orders")
    def orders():
        n = insert(name, g.idem_connection if settings.get("transactional") else None)
        steer()
        resp = jsonify({"order": n})
        resp.status_code = 201
        resp.headers["Location"] = "/orders/%d" % n
        resp.headers["ETag"] = '"%d"' % n
        return resp

    @fl.get("/orders")
    def list_orders():
        return jsonify({"orders": []})

    @fl.post("/binary")
    def binary():
        insert("binary")
        steer()
        return Response(bytes(range(256)) * 4, content_type="application/octet-stream")

    @fl.post("/big")
    def big():
        insert("big")
        steer()
        return Response(b"x" * int(request.headers["X-Conf-Size"]), status=201,
                        content_type="application/octet-stream")

    @fl.post("/status/<int:code>")
    def status(code):
        insert(status_route)
        steer()
        resp = jsonify({"status": code})
        resp.status_code = code
        return resp

    guard = Guard(dsn, lease=lease, retention=retention, timeout=5)
    fl.wsgi_app = IdempotencyWSGIMiddleware(fl.wsgi_app, guard=guard, required=True,
                                            principal=principal, **settings)
    return fl


def batch_app(dsn: str) -> Flask:
    """/batch/orders: the items of a batch, each under its own key."""
    fl = Flask("batch")
    guard = Guard(dsn, lease=30, retention=3600, timeout=5)

    @fl.post("/orders")
    def orders():
        fail = request.headers.get("X-Conf-Fail-Item")

        def handler(i, item, claim):
            if fail is not None and int(fail) == i:
                raise RuntimeError("item %d failed" % i)
            with psycopg.connect(dsn, autocommit=True) as own:
                n = own.execute("INSERT INTO conf_orders (key, route) VALUES (%s, 'batch')"
                                " RETURNING id", [claim.key]).fetchone()[0]
            return 201, {"order": n}

        status, headers, body = http_batch.run_batch(
            guard, g.idem_key, (request.get_json(silent=True) or {}).get("items"), handler,
            scope=request.environ["idem_pg.scope"])
        return Response(body, status=status, headers=headers)

    fl.wsgi_app = IdempotencyWSGIMiddleware(fl.wsgi_app, guard=guard, required=True,
                                            principal=principal)
    return fl


root = Flask("root")


@root.get("/health")
def health():
    return jsonify({"ok": True})


try:
    IdempotencyWSGIMiddleware(root.wsgi_app, guard=Guard(DSN))
    NO_DECISION = None
except TypeError as exc:
    NO_DECISION = str(exc)


@root.get("/no-decision")
def no_decision():
    """The error of a middleware built with neither principal nor shared."""
    return jsonify({"error": NO_DECISION})


app = DispatcherMiddleware(root, {
    "/plain": sub_app("plain", DSN),
    "/tx": sub_app("tx", DSN, transactional=True),
    "/nowait": sub_app("nowait", DSN, wait_for=0),
    "/store5xx": sub_app("store5xx", DSN, store_status=lambda status: True),
    "/down": sub_app("down", DOWN_DSN),
    "/short": sub_app("short", DSN + " options='-c idem.max_key_length=64'"),
    "/authz": sub_app("authz", DSN, authorize=authorize),
    "/advertise": sub_app("advertise", DSN, advertise_window=True),
    "/remember": sub_app("remember", DSN, lease=1, retention=1, remember=3600),
    "/batch": batch_app(DSN),
})
