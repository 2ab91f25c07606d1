"""Idempotency-Key middleware for WSGI (Flask, ...).

    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, guard=Guard(DSN))

The request body and the response are buffered.
"""

from __future__ import annotations

import io
import logging
from typing import Any, Optional

from ._common import Outcome, Response
from ._http import NotStored, Settings, pack
from .guard import Guard

log = logging.getLogger("idem_pg")

_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 409: "Conflict",
            422: "Unprocessable Entity", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _status_line(status: int) -> str:
    try:
        from http import HTTPStatus
        return "%d %s" % (status, HTTPStatus(status).phrase)
    except ValueError:
        return "%d %s" % (status, _REASONS.get(status, "Unknown"))


class IdempotencyWSGIMiddleware:
    """WSGI middleware; ``guard`` is a Guard (or pass ``dsn``).  ``scope``
    gets the WSGI environ and returns the tenant."""

    def __init__(self, app: Any, guard: Optional[Guard] = None, *,
                 dsn: Optional[str] = None, **settings: Any):
        if guard is None:
            if dsn is None:
                raise TypeError("IdempotencyWSGIMiddleware needs guard= or dsn=")
            guard = Guard(dsn)
        self.app = app
        self.guard = guard
        self.settings = Settings(**settings)
        self._environ_key = "HTTP_" + self.settings.header.upper().replace("-", "_")

    @staticmethod
    def _reply(start_response, status: int, headers, body: bytes):
        start_response(_status_line(status), list(headers))
        return [body]

    def __call__(self, environ, start_response):
        s = self.settings
        if environ.get("REQUEST_METHOD", "GET").upper() not in s.methods:
            return self.app(environ, start_response)
        key = environ.get(self._environ_key)
        bad = s.bad_key(key)
        if bad is not None:
            return self._reply(start_response, *bad)
        if key is None:
            return self.app(environ, start_response)

        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        stream = environ["wsgi.input"]
        body = stream.read(length) if length > 0 else b""
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        method = environ["REQUEST_METHOD"].upper()
        path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
        if environ.get("QUERY_STRING"):
            path += "?" + environ["QUERY_STRING"]
        fingerprint = s.fingerprint(method, path, body)
        tenant = s.scope(environ) if s.scope is not None else None
        captured = {"status": 500, "headers": [], "body": b""}

        def start(status, headers, exc_info=None):
            captured["status"] = int(status.split(" ", 1)[0])
            captured["headers"] = [(k, v) for k, v in headers]
            return lambda data: captured.setdefault("written", []).append(data)

        def handler(claim) -> Response:
            try:
                it = self.app(environ, start)
                try:
                    captured["body"] = b"".join(captured.pop("written", [])) + b"".join(it)
                finally:
                    if hasattr(it, "close"):
                        it.close()
            except Exception:
                if not s.store_server_errors:
                    raise
                log.exception("idempotent request %r failed; storing a 500", key)
                captured.update(status=500, body=b"Internal Server Error",
                                headers=[("Content-Type", "text/plain; charset=utf-8")])
            if captured["status"] >= 500 and not s.store_server_errors:
                raise NotStored(captured)
            return Response(captured["status"], pack(s.kept(captured["headers"]), captured["body"]))

        result = self.guard.do(key, fingerprint, handler, scope=tenant,
                               wait_for=s.wait_of(environ))
        if result.outcome is Outcome.REPLAYED:
            return self._reply(start_response, *s.replay(result.response.status,
                                                         result.response.body))
        if result.outcome is Outcome.IN_FLIGHT:
            return self._reply(start_response, *s.in_flight(result.lease_left))
        if result.outcome is Outcome.CONFLICT:
            return self._reply(start_response, *s.conflict())
        if result.outcome is Outcome.UNAVAILABLE:
            log.warning("idempotency store unavailable for key %r: %s", key, result.error)
            return self._reply(start_response, *s.unavailable())
        if result.failed_step == "handler" and not isinstance(result.error, NotStored):
            raise result.error
        if result.failed_step == "complete":
            log.error("response for key %r not stored: %s", key, result.error)
        headers = [(k, v) for k, v in captured["headers"] if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(captured["body"]))))
        return self._reply(start_response, captured["status"], headers, captured["body"])
