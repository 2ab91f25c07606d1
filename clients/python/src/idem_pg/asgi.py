"""Idempotency-Key middleware for ASGI (Starlette, FastAPI, ...).

    app.add_middleware(IdempotencyMiddleware, guard=AsyncGuard(DSN))

The whole request body and response are buffered: a streamed response is
sent only once it has ended.  The behaviour is doc/http.md's.

``transactional=True`` runs the handler inside the transaction that holds
the claim, on the connection ``request.state.idem_connection`` (FastAPI:
``Depends(idem_connection)``); the claim, the handler's writes and the
stored response commit together before the response is sent.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, List, Optional, cast

import psycopg

from ._common import Outcome, Response
from ._http import (FIRST_SENT, REQUEST_ID, WINDOW_SQL, window_of_row,
                    HandlerFailed, Headers, NotStored,
                    Release, Settings, pack, twice)
from ._drivers import driver_errors, driver_of
from .aio import AsyncGuard
from .atomic import atomic_async
from .errors import IdemError, Timeout, transient, translate

try:  # for the dependency's signature; the middleware needs no Starlette
    from starlette.requests import Request
except ImportError:  # pragma: no cover
    Request = Any  # type: ignore[misc,assignment]

log = logging.getLogger("idem_pg")


def idem_connection(request: Request) -> Any:
    """The request's connection in transactional mode, inside the
    transaction that holds the claim: the guard's driver's (a psycopg
    AsyncConnection, or an asyncpg Connection).  FastAPI:
    ``conn: AsyncConnection = Depends(idem_connection)``."""
    conn = request.scope.get("state", {}).get("idem_connection")
    if conn is None:
        raise RuntimeError("no idempotent transaction for this request: the route is not "
                           "under IdempotencyMiddleware(transactional=True), or the "
                           "request has no Idempotency-Key")
    return conn


class _Captured:
    def __init__(self) -> None:
        self.status = 500
        self.headers: Headers = []
        self.chunks: List[bytes] = []
        self.started = False

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class _Out:
    """The ASGI send of a request under the middleware: adds
    Repeatability-Result (an OASIS request; ``accepted`` once the answer
    is the handler's or a replay) and Idempotency-Key-Lifetime (``window``,
    when advertised) to the response's start."""

    def __init__(self, send, settings: Settings) -> None:
        self.send = send
        self.settings = settings
        self.oasis = False
        self.accepted = False
        self.window: Optional[float] = None

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start" and (self.oasis or self.window is not None):
            extra = self.settings.decorate([], self.oasis, self.accepted, self.window)
            message = dict(message, headers=list(message.get("headers", [])) +
                           [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in extra])
        await self.send(message)


class IdempotencyMiddleware:
    """ASGI middleware; ``guard`` is an AsyncGuard (or pass ``dsn``).
    Keyword settings: see idem_pg._http.Settings.  ``principal`` (or
    ``shared=True``) is required: it gets the ASGI scope and returns the
    caller's identity, which scopes the keys; ``scope`` gets the ASGI
    scope and returns the tenant; ``authorize`` gets the ASGI scope before
    a replay.  The three may be async.  ``transactional``: see the module doc;
    the guard's connection (string, pool, factory) gives the request's
    connection, its ``timeout`` bounds the claim's and the complete's
    waits (lock_timeout and statement_timeout, + ``wait_for`` for the
    claim).

    The parsed key is ``request.state.idem_key``; the claim (a Claim, or
    in transactional mode the AsyncAtomic) ``request.state.idem_claim``.
    """

    def __init__(self, app: Any, guard: Optional[AsyncGuard] = None, *,
                 dsn: Optional[str] = None, transactional: bool = False, **settings: Any):
        if guard is None:
            if dsn is None:
                raise TypeError("IdempotencyMiddleware needs guard= or dsn=")
            guard = AsyncGuard(dsn)
        self.app = app
        self.guard = guard
        self.transactional = transactional
        self.settings = Settings(**settings)
        self._header = self.settings.header.lower().encode("latin-1")
        self._window: Optional[float] = None

    async def window(self) -> Optional[float]:
        """The route's window in seconds: the guard's retention, else the
        server's idem.default_retention (asked once, then kept); None when
        the server could not be asked."""
        if self._window is None:
            w = self.settings.window_known(self.guard.retention)
            if w is None:
                try:
                    async with self.guard._source.connection() as conn:
                        drv = driver_of(conn)
                        async with drv.transaction(conn):
                            row = await drv.fetchrow(conn, WINDOW_SQL)
                except Exception as exc:  # noqa: BLE001 - the store is down: no window
                    log.warning("the window (idem.default_retention) could not be read: %s", exc)
                    return None
                w = window_of_row(row, log)
                if w is None:
                    return None
            self._window = w
        return self._window

    async def _send(self, send, status: int, headers: Headers, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in headers]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_captured(self, send: _Out, captured: _Captured, extra: Headers) -> None:
        send.accepted = True                # the handler's answer
        headers = [(k, v) for k, v in captured.headers if k.lower() != "content-length"]
        headers.append(("content-length", str(len(captured.body))))
        await self._send(send, captured.status, headers + extra, captured.body)

    async def _replay(self, scope, send: _Out, status: int, data: bytes, expires_at) -> None:
        """The stored response, if ``authorize`` lets this caller have it."""
        s = self.settings
        if s.authorize is not None:
            try:
                answer = s.authorize(scope)
                if inspect.isawaitable(answer):
                    answer = await answer
                denied = s.denied(answer)
            except Exception:
                log.exception("the authorize hook failed; the stored response is not sent")
                await self._send(send, *s.authorize_failed())
                return
            if denied is not None:
                await self._send(send, *denied)
                return
        send.accepted = True
        await self._send(send, *s.replay(status, data, expires_at))

    async def __call__(self, scope, receive, send) -> None:
        s = self.settings
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _Out(send, s)
        if s.advertise_window:
            send.window = await self.window()
        if scope["method"].upper() not in s.methods:
            await self.app(scope, receive, send)
            return

        def value(name: bytes) -> Optional[str]:
            raw = [v for k, v in scope.get("headers", []) if k.lower() == name]
            return b", ".join(raw).decode("latin-1") if raw else None

        key_header = value(self._header)
        request_id = value(REQUEST_ID.lower().encode("latin-1"))
        first_sent = value(FIRST_SENT.lower().encode("latin-1"))
        if request_id is not None or first_sent is not None:
            send.oasis = True                 # OASIS Repeatable Requests
            key, first, bad = s.oasis_of(request_id, first_sent, key_header)
            if bad is None:
                window = await self.window()
                bad = (s.unavailable() if window is None
                       else s.too_old(cast(Any, first), window))
        else:
            key, bad = s.key_of(key_header)
        if bad is not None:
            await self._send(send, *bad)
            return
        if key is None:                       # not required: pass through
            await self.app(scope, receive, send)
            return
        principal = None
        if s.principal is not None:
            try:
                principal = s.principal(scope)
                if inspect.isawaitable(principal):
                    principal = await principal
            except Exception:
                log.exception("the principal hook failed for key %r; nothing claimed", key)
                await self._send(send, *s.principal_failed())
                return
            if not isinstance(principal, str):
                log.error("the principal hook returned %s for key %r, not a str; nothing "
                          "claimed", type(principal).__name__, key)
                await self._send(send, *s.principal_failed())
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
        if s.principal is not None:
            tenant = s.scope_of(self.guard.scope if tenant is None else tenant, principal)
        state = scope.setdefault("state", {})
        state["idem_key"] = key
        # the scope of the key (the caller's), for http_batch's item keys
        state["idem_scope"] = self.guard.scope if tenant is None else tenant
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

        if self.transactional:
            await self._transactional(scope, send, key, fingerprint, tenant, state,
                                      replay_receive, capture, captured)
            return

        async def handler(claim) -> Response:
            state["idem_claim"] = claim
            try:
                await self.app(scope, replay_receive, capture)
            except Exception:
                if not s.stores(500):
                    raise
                log.exception("idempotent request %r failed; storing a 500", key)
                captured.status = 500
                captured.headers = [("content-type", "text/plain; charset=utf-8")]
                captured.chunks = [b"Internal Server Error"]
            if not s.stores(captured.status):
                raise NotStored(captured)
            return Response(captured.status, pack(s.kept(captured.headers), captured.body))

        result = await self.guard.do(key, fingerprint, handler, scope=tenant,
                                     wait_for=s.wait_of(scope), remember=s.remember,
                                     not_stored=s.not_stored)
        s.store_state(result, log)
        if result.outcome is Outcome.REPLAYED:
            stored = cast(Response, result.response)
            await self._replay(scope, send, stored.status, stored.body, result.expires_at)
        elif result.outcome is Outcome.IN_FLIGHT:
            await self._send(send, *s.in_flight(result.lease_left))
        elif result.outcome is Outcome.CONFLICT:
            await self._send(send, *s.conflict())
        elif result.outcome is Outcome.EXPIRED:
            await self._send(send, *s.expired())
        elif result.outcome is Outcome.UNAVAILABLE:
            bad = s.refused(result.error) if result.failed_step == "begin" else None
            if bad is not None:             # the server's limit: no claim, no handler
                await self._send(send, *bad)
                return
            await self._send(send, *s.unavailable())
        else:
            if result.failed_step == "handler" and not isinstance(result.error, NotStored):
                raise cast(BaseException, result.error)   # released; the framework answers 500
            if result.failed_step == "complete" and not result.not_stored:
                log.error("response for key %r not stored: %s; the key is in flight "
                          "until its lease ends", key, result.error)
            kept = result.failed_step is None
            await self._send_captured(send, captured,
                                      s.expires(result.expires_at) if kept else [])

    async def _transactional(self, scope, send: _Out, key, fingerprint, tenant, state,
                             replay_receive, capture, captured: _Captured) -> None:
        """Claim, handler and stored response in one transaction."""
        s, g = self.settings, self.guard
        ran = False
        row = None
        expires = None
        try:
            async with g._source.connection() as conn:
                async with atomic_async(conn, key, fingerprint, schema=g.sql.schema,
                                        lease=g.lease, retention=g.retention,
                                        scope=g.scope if tenant is None else tenant,
                                        wait=True, lock_timeout=g.timeout,
                                        wait_for=s.wait_of(scope) or None,
                                        timeout=twice(g.timeout),
                                        remember=g.remember if s.remember is None
                                        else s.remember) as tx:
                    if not tx.claimed:
                        row = tx.row
                    else:
                        state["idem_connection"], state["idem_claim"] = conn, tx
                        ran = True
                        try:
                            await self.app(scope, replay_receive, capture)
                        except Exception as exc:
                            raise HandlerFailed(exc) from exc
                        finally:
                            state.pop("idem_connection", None)
                        if not s.stores(captured.status):
                            raise Release()
                        expires = await self._complete(conn, tx, key, captured)
        except Release:
            await self._send_captured(send, captured, [])   # rolled back: key free
            return
        except HandlerFailed as failed:
            raise failed.error              # rolled back; the framework answers 500
        except driver_errors(IdemError, OSError) as exc:
            err = translate(exc)
            if not ran and isinstance(err, Timeout) and err.sqlstate == "55P03":
                # the transaction of the first request still holds the key
                await self._send(send, *s.in_flight(None))
                return
            bad = None if ran else s.refused(err)
            if bad is not None:             # the server's limit: rolled back, nothing claimed
                await self._send(send, *bad)
                return
            log.warning("idempotent transaction for key %r not done (%s); "
                        "nothing is committed", key, err)
            await self._send(send, *s.unavailable())
            return
        if row is None:
            await self._send_captured(send, captured, s.expires(expires))
        elif row.outcome() is Outcome.REPLAYED:
            await self._replay(scope, send, cast(int, row.status), row.body or b"",
                               row.expires_at)
        elif row.outcome() is Outcome.IN_FLIGHT:
            await self._send(send, *s.in_flight(row.lease_left))
        elif row.outcome() is Outcome.EXPIRED:
            await self._send(send, *s.expired())
        else:
            await self._send(send, *s.conflict())

    async def _complete(self, conn, tx, key, captured: _Captured):
        """Store the response (a savepoint); if that fails for good, the
        fixed "Response not stored" answer instead.  Returns expires_at,
        or None when the fixed answer was stored."""
        s = self.settings
        drv = driver_of(conn)
        try:
            async with drv.transaction(conn):
                return await tx.complete(captured.status,
                                         pack(s.kept(captured.headers), captured.body))
        except driver_errors(IdemError) as exc:
            err = cast(IdemError, translate(exc))
            if transient(err):
                raise
        nope = s.not_stored
        async with drv.transaction(conn):
            await tx.complete(nope.status, nope.body)
        log.warning("response for key %r not stored (%s: %s); a retry gets %d "
                    "\"Response not stored\"", key, err.sqlstate, err, nope.status)
        return None
