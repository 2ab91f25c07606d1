"""The conformance app of test/http/README.md for ASGI: FastAPI sub-apps,
each with the middleware and its settings, served by test.sh under
gunicorn with two uvicorn workers.

  /plain     default mode                 /tx        transactional mode
  /nowait    default, wait_for 0          /store5xx  5xx and 429 stored
  /down      a store nobody listens on     /short     the server's idem.max_key_length 64
  /authz     default, authorize: X-Conf-Revoked denies a replay
  /advertise default, advertise_window=True (Idempotency-Key-Lifetime)
  /remember  default, lease and retention 1 s, remember=3600 (410 after the retention)
  /batch     default; POST /batch/orders is the batch route of doc/http.md
             ("Batches"): each item under its "key" or <key>:<index>, its
             handler inserting (item key, 'batch') and answering 201
             {"order": id}; X-Conf-Fail-Item: i makes item i's handler raise

GET /<route>/orders answers 200 {"orders": []} (the middleware passes it
through).

Every route's principal is X-Conf-Principal ("raise": the hook raises,
"none": it returns None).  GET /no-decision reports the error of a
middleware built with neither a principal hook nor shared=True.

IDEM_CONF_DSN is the database (conf_orders), IDEM_CONF_DOWN_DSN the
dead one.
"""

import asyncio
import os
import signal

import psycopg
from fastapi import Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

import drivers
from idem_pg import AsyncGuard, http_batch
from idem_pg.asgi import IdempotencyMiddleware, idem_connection

DSN = os.environ["IDEM_CONF_DSN"]
DOWN_DSN = os.environ["IDEM_CONF_DOWN_DSN"]
# The guards' driver (tests/drivers.py): psycopg, or asyncpg
DRIVER = os.environ.get("IDEM_TEST_DRIVER", "psycopg")


async def insert(request: Request, route: str, conn=None) -> int:
    """The handler's write: on the request's transaction when given one,
    else on a connection of its own (committed at once)."""
    key = request.state.idem_key
    q = "INSERT INTO conf_orders (key, route) VALUES (%s, %s) RETURNING id"
    if conn is not None:
        return (await drivers.fetchrow(conn, q, [key, route]))[0]
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as own:
        cur = await own.execute(q, [key, route])
        return (await cur.fetchone())[0]


async def steer(request: Request) -> None:
    """X-Conf-Sleep-Ms and X-Conf-Kill, after the insert."""
    ms = request.headers.get("x-conf-sleep-ms")
    if ms:
        await asyncio.sleep(int(ms) / 1000)
    if request.headers.get("x-conf-kill") == "after-write":
        os.kill(os.getpid(), signal.SIGKILL)


def order(n: int) -> JSONResponse:
    return JSONResponse({"order": n}, status_code=201,
                        headers={"Location": "/orders/%d" % n, "ETag": '"%d"' % n})


def principal(scope):
    """The caller: X-Conf-Principal."""
    who = dict(scope["headers"]).get(b"x-conf-principal", b"").decode("latin-1")
    if who == "raise":
        raise RuntimeError("no session")
    return None if who == "none" else who


def authorize(scope) -> bool:
    return b"x-conf-revoked" not in dict(scope["headers"])


def sub_app(name: str, dsn: str, lease: float = 30, retention: float = 3600,
            **settings) -> FastAPI:
    api = FastAPI()
    guard = AsyncGuard(drivers.target(DRIVER, dsn), lease=lease, retention=retention, timeout=5)
    api.add_middleware(IdempotencyMiddleware, guard=guard, required=True,
                       principal=principal, **settings)
    status_route = "store5xx" if name == "store5xx" else "status"

    if settings.get("transactional"):
        @api.post("/orders")
        async def tx_orders(request: Request,
                            conn=Depends(idem_connection)):
            n = await insert(request, name, conn)
            await steer(request)
            return order(n)
    else:
        @api.post("/orders")
        async def orders(request: Request):
            n = await insert(request, name)
            await steer(request)
            return order(n)

    @api.get("/orders")
    async def list_orders():
        return {"orders": []}

    @api.post("/binary")
    async def binary(request: Request):
        await insert(request, "binary")
        await steer(request)
        return Response(bytes(range(256)) * 4, media_type="application/octet-stream")

    @api.post("/big")
    async def big(request: Request):
        await insert(request, "big")
        await steer(request)
        return Response(b"x" * int(request.headers["x-conf-size"]), status_code=201,
                        media_type="application/octet-stream")

    @api.post("/status/{code}")
    async def status(request: Request, code: int):
        await insert(request, status_route)
        await steer(request)
        return JSONResponse({"status": code}, status_code=code)

    return api


def batch_app(dsn: str) -> FastAPI:
    """/batch/orders: the items of a batch, each under its own key."""
    api = FastAPI()
    guard = AsyncGuard(drivers.target(DRIVER, dsn), lease=30, retention=3600, timeout=5)
    api.add_middleware(IdempotencyMiddleware, guard=guard, required=True, principal=principal)

    @api.post("/orders")
    async def orders(request: Request):
        fail = request.headers.get("x-conf-fail-item")
        try:
            items = (await request.json()).get("items")
        except ValueError:
            items = None

        async def handler(i, item, claim):
            if fail is not None and int(fail) == i:
                raise RuntimeError("item %d failed" % i)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as own:
                cur = await own.execute("INSERT INTO conf_orders (key, route) VALUES"
                                        " (%s, 'batch') RETURNING id", [claim.key])
                return 201, {"order": (await cur.fetchone())[0]}

        status, headers, body = await http_batch.run_batch_async(
            guard, request.state.idem_key, items, handler, scope=request.state.idem_scope)
        return Response(body, status_code=status, headers=dict(headers))

    return api


app = FastAPI()
app.mount("/plain", sub_app("plain", DSN))
app.mount("/tx", sub_app("tx", DSN, transactional=True))
app.mount("/nowait", sub_app("nowait", DSN, wait_for=0))
app.mount("/store5xx", sub_app("store5xx", DSN, store_status=lambda status: True))
app.mount("/down", sub_app("down", DOWN_DSN))
app.mount("/short", sub_app("short", DSN + " options='-c idem.max_key_length=64'"))
app.mount("/authz", sub_app("authz", DSN, authorize=authorize))
app.mount("/advertise", sub_app("advertise", DSN, advertise_window=True))
app.mount("/remember", sub_app("remember", DSN, lease=1, retention=1, remember=3600))
app.mount("/batch", batch_app(DSN))

try:
    IdempotencyMiddleware(app, guard=AsyncGuard(DSN))
    NO_DECISION = None
except TypeError as exc:
    NO_DECISION = str(exc)


@app.get("/no-decision")
async def no_decision():
    return {"error": NO_DECISION}


@app.get("/health")
async def health():
    return {"ok": True}
