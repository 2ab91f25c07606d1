"""The ASGI test app: FastAPI sub-apps and one plain Starlette sub-app,
each with the middleware in one line and its own settings.

  /req    FastAPI, key required                 /opt    Starlette, key optional
  /store  FastAPI, 5xx and exceptions stored     /down   FastAPI, guard on a dead server

A duplicate of a request in flight waits for its response: 5 s (the
default) under /req and /down, 1 s for /opt/gated and 5 s for the rest of
/opt (a wait per route), not at all under /store, although every guard
would wait 30 s (the middleware's setting decides).

Every executed handler inserts a row into http_calls.
"""

import asyncio
import os

import psycopg
from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import drivers
from idem_pg import AsyncGuard
from idem_pg.asgi import IdempotencyMiddleware

DSN = os.environ["IDEM_TEST_DSN"]
DOWN_DSN = os.environ["IDEM_TEST_DOWN_DSN"]
LEASE = float(os.environ.get("IDEM_TEST_LEASE", "30"))
# The guards' driver (tests/drivers.py): psycopg, or asyncpg
DRIVER = os.environ.get("IDEM_TEST_DRIVER", "psycopg")
CLOCK = [0.0]     # idem.clock_offset in seconds, moved by POST /_test/clock


def tenant(scope) -> str:
    for k, v in scope.get("headers", []):
        if k == b"x-tenant":
            return v.decode("latin-1")
    return ""


async def record(app: str, request: Request) -> int:
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as c:
        cur = await c.execute(
            "INSERT INTO http_calls (app, tenant, key, path) VALUES (%s, %s, %s, %s)"
            " RETURNING id", [app, request.headers.get("x-tenant", ""),
                              request.headers.get("idempotency-key"), request.url.path])
        return (await cur.fetchone())[0]


async def count(key: str) -> int:
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as c:
        cur = await c.execute("SELECT count(*) FROM http_calls WHERE key = %s", [key])
        return (await cur.fetchone())[0]


def endpoints(app: str):
    async def orders(request: Request):
        n = await record(app, request)
        body = await request.body()
        return JSONResponse({"order": n, "echo": body.decode("utf-8", "replace")},
                            status_code=201,
                            headers={"X-Order": str(n), "Location": "/orders/%d" % n})

    async def slow(request: Request):
        await asyncio.sleep(int(request.query_params.get("ms", "500")) / 1000)
        return await orders(request)

    async def gated(request: Request):
        # waits until the test releases the advisory lock numbered ?gate=
        async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as c:
            await c.execute("SELECT pg_advisory_lock_shared(%s::bigint)",
                            [int(request.query_params["gate"])])
        return await orders(request)

    async def hang(request: Request):
        # the first execution of a key hangs (the test kills the server)
        n = await record(app, request)
        if await count(request.headers.get("idempotency-key")) == 1:
            await asyncio.sleep(3600)
        return JSONResponse({"order": n}, status_code=201)

    async def fail500(request: Request):
        await record(app, request)
        return PlainTextResponse("boom", status_code=500)

    async def raises(request: Request):
        await record(app, request)
        raise RuntimeError("handler failed")

    async def binary(request: Request):
        await record(app, request)
        return Response(bytes(range(256)) + b"\\x41\\\\000", media_type="application/octet-stream")

    async def list_orders(request: Request):
        return JSONResponse({"ok": True})

    return [("/orders", orders, "POST"), ("/slow", slow, "POST"), ("/gated", gated, "POST"),
            ("/hang", hang, "POST"),
            ("/fail500", fail500, "POST"), ("/raise", raises, "POST"),
            ("/bytes", binary, "POST"), ("/orders", list_orders, "GET")]


def guard(dsn: str) -> AsyncGuard:
    return AsyncGuard(drivers.target(DRIVER, dsn), lease=LEASE, timeout=5, clock_offset=lambda: CLOCK[0],
                      wait_for=30)


def opt_wait(scope) -> float:
    return 1.0 if scope["path"].endswith("/gated") else 5.0


def fastapi_app(name: str, dsn: str, **settings) -> FastAPI:
    api = FastAPI()
    api.add_middleware(IdempotencyMiddleware, guard=guard(dsn), scope=tenant, shared=True,
                       **settings)
    for path, fn, method in endpoints(name):
        api.add_api_route(path, fn, methods=[method])
    return api


def starlette_app(name: str, dsn: str, **settings) -> Starlette:
    app = Starlette(routes=[Route(path, fn, methods=[method])
                            for path, fn, method in endpoints(name)])
    app.add_middleware(IdempotencyMiddleware, guard=guard(dsn), scope=tenant, shared=True,
                       **settings)
    return app


app = FastAPI()
app.mount("/req", fastapi_app("req", DSN, required=True))
app.mount("/opt", starlette_app("opt", DSN, wait_for=opt_wait))
app.mount("/store", fastapi_app("store", DSN, store_server_errors=True, wait_for=0))
app.mount("/down", fastapi_app("down", DOWN_DSN))


@app.get("/health")
async def health():
    return {"ok": True}


@app.post("/_test/clock")
async def set_clock(request: Request):
    CLOCK[0] = float((await request.json())["offset"])
    return {"offset": CLOCK[0]}
