"""Idempotency-Key middleware for ASGI (Starlette, FastAPI, ...).

    app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(DSN))

The whole request body and response are buffered: a streamed response is
sent only once it has ended.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple, cast

from ._common import Outcome, Response
from ._http import Headers, NotStored, Settings, pack
from .aio import AsyncGuard

log = logging.getLogger("idem_pg")


class _Captured:
    def __init__(self) -> None:
        self.status = 500
        self.headers: Headers = []
        self.chunks: List[bytes] = []
        self.started = False

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class IdempotencyMiddleware:
    """ASGI middleware; ``guard`` is an AsyncGuard (or pass ``dsn``).
    Keyword settings: see idem_pg._http.Settings.  ``scope`` gets the ASGI
    scope and returns the tenant."""

    def __init__(self, app: Any, guard: Optional[AsyncGuard] = None, *,
                 dsn: Optional[str] = None, **settings: Any):
        if guard is None:
            if dsn is None:
                raise TypeError("IdempotencyMiddleware needs guard= or dsn=")
            guard = AsyncGuard(dsn)
        self.app = app
        self.guard = guard
        self.settings = Settings(**settings)
        self._header = self.settings.header.lower().encode("latin-1")

    async def _send(self, send, status: int, headers: Headers, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in headers]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        s = self.settings
        if scope["type"] != "http" or scope["method"].upper() not in s.methods:
            await self.app(scope, receive, send)
            return
        raw = [v for k, v in scope.get("headers", []) if k.lower() == self._header]
        key = raw[0].decode("latin-1") if raw else None
        bad = s.bad_key(key)
        if bad is not None:
            await self._send(send, *bad)
            return
        if key is None:                       # not required: pass through
            await self.app(scope, receive, send)
            return

        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        raw_path = scope.get("raw_path")     # the full path, also under a Mount
        path = (raw_path.decode("latin-1") if raw_path
                else scope.get("root_path", "") + scope["path"])
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        fingerprint = s.fingerprint(scope["method"].upper(), path, body)
        tenant = s.scope(scope) if s.scope is not None else None
        captured = _Captured()

        async def replay_receive():
            nonlocal body
            if body is not None:
                out, body = body, None
                return {"type": "http.request", "body": out, "more_body": False}
            return await receive()

        async def capture(message) -> None:
            if message["type"] == "http.response.start":
                captured.started = True
                captured.status = message["status"]
                captured.headers = [(k.decode("latin-1"), v.decode("latin-1"))
                                    for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                captured.chunks.append(message.get("body", b""))

        async def handler(claim) -> Response:
            try:
                await self.app(scope, replay_receive, capture)
            except Exception:
                if not s.store_server_errors:
                    raise
                log.exception("idempotent request %r failed; storing a 500", key)
                captured.status = 500
                captured.headers = [("content-type", "text/plain; charset=utf-8")]
                captured.chunks = [b"Internal Server Error"]
            if captured.status >= 500 and not s.store_server_errors:
                raise NotStored(captured)
            return Response(captured.status, pack(s.kept(captured.headers), captured.body))

        result = await self.guard.do(key, fingerprint, handler, scope=tenant,
                                     wait_for=s.wait_of(scope))
        if result.outcome is Outcome.REPLAYED:
            stored = cast(Response, result.response)
            await self._send(send, *s.replay(stored.status, stored.body))
        elif result.outcome is Outcome.IN_FLIGHT:
            await self._send(send, *s.in_flight(result.lease_left))
        elif result.outcome is Outcome.CONFLICT:
            await self._send(send, *s.conflict())
        elif result.outcome is Outcome.UNAVAILABLE:
            log.warning("idempotency store unavailable for key %r: %s", key, result.error)
            await self._send(send, *s.unavailable())
        else:
            if result.failed_step == "handler" and not isinstance(result.error, NotStored):
                raise cast(BaseException, result.error)   # released; the framework answers 500
            if result.failed_step == "complete":
                log.error("response for key %r not stored: %s", key, result.error)
            await self._send(send, captured.status, captured.headers, captured.body)
