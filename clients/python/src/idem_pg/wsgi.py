"""Idempotency-Key middleware for WSGI (Flask, ...).

    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, guard=Guard(DSN))

The request body and the response are buffered.  The behaviour is
doc/http.md's.

``transactional=True`` runs the handler inside the transaction that holds
the claim, on the connection ``environ["idem_pg.connection"]`` (Flask:
``g.idem_connection``); the claim, the handler's writes and the stored
response commit together before the response is sent.
"""

from __future__ import annotations

import io
import logging
from typing import Any, Optional, cast

import psycopg

from ._common import Outcome, Response
from ._http import (FIRST_SENT, REQUEST_ID, WINDOW_SQL, window_of_row,
                    HandlerFailed, NotStored, Release,
                    Settings, pack, twice)
from .atomic import atomic
from .errors import IdemError, Timeout, transient, translate
from .guard import Guard

log = logging.getLogger("idem_pg")

_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 403: "Forbidden", 409: "Conflict",
            422: "Unprocessable Entity", 500: "Internal Server Error",
            503: "Service Unavailable"}

# What the middleware puts in the environ; a Flask app gets them in g too.
ENVIRON_KEY = "idem_pg.key"
# The scope of the request's key (the caller's), for http_batch's item keys.
ENVIRON_SCOPE = "idem_pg.scope"
ENVIRON_CLAIM = "idem_pg.claim"
ENVIRON_CONNECTION = "idem_pg.connection"


def _status_line(status: int) -> str:
    try:
        from http import HTTPStatus
        return "%d %s" % (status, HTTPStatus(status).phrase)
    except ValueError:
        return "%d %s" % (status, _REASONS.get(status, "Unknown"))


def _flask_hook(app: Any) -> None:
    """When ``app`` is a Flask app's wsgi_app, copy what the middleware
    found into ``g`` (idem_key, idem_claim, idem_connection) before each
    request."""
    flask_app = getattr(app, "__self__", None)
    if flask_app is None or not hasattr(flask_app, "before_request") \
            or not hasattr(flask_app, "app_context"):
        return

    def copy_to_g() -> None:
        from flask import g, request
        environ = request.environ
        if ENVIRON_KEY in environ:
            g.idem_key = environ[ENVIRON_KEY]
            g.idem_claim = environ.get(ENVIRON_CLAIM)
            g.idem_connection = environ.get(ENVIRON_CONNECTION)

    flask_app.before_request(copy_to_g)


class _Out:
    """The start_response of a request under the middleware: adds
    Repeatability-Result (an OASIS request; ``accepted`` once the answer
    is the handler's or a replay) and Idempotency-Key-Lifetime (``window``,
    when advertised)."""

    def __init__(self, start_response, settings: Settings) -> None:
        self.start_response = start_response
        self.settings = settings
        self.oasis = False
        self.accepted = False
        self.window: Optional[float] = None

    def __call__(self, status, headers, exc_info=None):
        headers = self.settings.decorate(list(headers), self.oasis, self.accepted, self.window)
        if exc_info is None:
            return self.start_response(status, headers)
        return self.start_response(status, headers, exc_info)


class IdempotencyWSGIMiddleware:
    """WSGI middleware; ``guard`` is a Guard (or pass ``dsn``).
    ``principal`` (or ``shared=True``) is required: it gets the WSGI
    environ and returns the caller's identity, which scopes the keys;
    ``scope`` gets the environ and returns the tenant; ``authorize`` gets
    it before a replay.  ``transactional``: see
    the module doc; the guard's connection (string, pool, factory) gives
    the request's connection, its ``timeout`` bounds the claim's and the
    complete's waits (lock_timeout and statement_timeout, + ``wait_for``
    for the claim).

    The parsed key is ``environ["idem_pg.key"]`` (Flask: ``g.idem_key``),
    the claim ``environ["idem_pg.claim"]`` (``g.idem_claim``).
    """

    def __init__(self, app: Any, guard: Optional[Guard] = None, *,
                 dsn: Optional[str] = None, transactional: bool = False, **settings: Any):
        if guard is None:
            if dsn is None:
                raise TypeError("IdempotencyWSGIMiddleware needs guard= or dsn=")
            guard = Guard(dsn)
        self.app = app
        self.guard = guard
        self.transactional = transactional
        self.settings = Settings(**settings)
        self._environ_key = "HTTP_" + self.settings.header.upper().replace("-", "_")
        self._window: Optional[float] = None
        _flask_hook(app)

    def window(self) -> Optional[float]:
        """The route's window in seconds: the guard's retention, else the
        server's idem.default_retention (asked once, then kept); None when
        the server could not be asked."""
        if self._window is None:
            w = self.settings.window_known(self.guard.retention)
            if w is None:
                try:
                    with self.guard._source.connection() as conn:
                        with conn.transaction():
                            row = conn.execute(WINDOW_SQL).fetchone()
                except Exception as exc:  # noqa: BLE001 - the store is down: no window
                    log.warning("the window (idem.default_retention) could not be read: %s", exc)
                    return None
                w = window_of_row(row, log)
                if w is None:
                    return None
            self._window = w
        return self._window

    @staticmethod
    def _reply(start_response, status: int, headers, body: bytes):
        start_response(_status_line(status), list(headers))
        return [body]

    def _reply_captured(self, start_response, captured, extra):
        start_response.accepted = True      # the handler's answer
        headers = [(k, v) for k, v in captured["headers"] if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(captured["body"]))))
        return self._reply(start_response, captured["status"], headers + extra,
                           captured["body"])

    def _replay(self, environ, start_response, status: int, data: bytes, expires_at):
        """The stored response, if ``authorize`` lets this caller have it."""
        s = self.settings
        if s.authorize is not None:
            try:
                denied = s.denied(s.authorize(environ))
            except Exception:
                log.exception("the authorize hook failed; the stored response is not sent")
                return self._reply(start_response, *s.authorize_failed())
            if denied is not None:
                return self._reply(start_response, *denied)
        start_response.accepted = True
        return self._reply(start_response, *s.replay(status, data, expires_at))

    def __call__(self, environ, start_response):
        s = self.settings
        start_response = _Out(start_response, s)
        if s.advertise_window:
            start_response.window = self.window()
        if environ.get("REQUEST_METHOD", "GET").upper() not in s.methods:
            return self.app(environ, start_response)
        key_header = environ.get(self._environ_key)
        request_id = environ.get("HTTP_" + REQUEST_ID.upper().replace("-", "_"))
        first_sent = environ.get("HTTP_" + FIRST_SENT.upper().replace("-", "_"))
        if request_id is not None or first_sent is not None:
            start_response.oasis = True     # OASIS Repeatable Requests
            key, first, bad = s.oasis_of(request_id, first_sent, key_header)
            if bad is None:
                window = self.window()
                bad = s.unavailable() if window is None else s.too_old(cast(Any, first), window)
        else:
            key, bad = s.key_of(key_header)
        if bad is not None:
            return self._reply(start_response, *bad)
        if key is None:
            return self.app(environ, start_response)
        principal = None
        if s.principal is not None:
            try:
                principal = s.principal(environ)
            except Exception:
                log.exception("the principal hook failed for key %r; nothing claimed", key)
                return self._reply(start_response, *s.principal_failed())
            if not isinstance(principal, str):
                log.error("the principal hook returned %s for key %r, not a str; nothing "
                          "claimed", type(principal).__name__, key)
                return self._reply(start_response, *s.principal_failed())

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
        if s.principal is not None:
            tenant = s.scope_of(self.guard.scope if tenant is None else tenant, principal)
        environ[ENVIRON_KEY] = key
        environ[ENVIRON_SCOPE] = self.guard.scope if tenant is None else tenant
        captured = {"status": 500, "headers": [], "body": b""}

        def start(status, headers, exc_info=None):
            captured["status"] = int(status.split(" ", 1)[0])
            captured["headers"] = [(k, v) for k, v in headers]
            return lambda data: captured.setdefault("written", []).append(data)

        def run_app() -> None:
            it = self.app(environ, start)
            try:
                captured["body"] = b"".join(captured.pop("written", [])) + b"".join(it)
            finally:
                if hasattr(it, "close"):
                    it.close()

        if self.transactional:
            return self._transactional(environ, start_response, key, fingerprint, tenant,
                                       run_app, captured)

        def handler(claim) -> Response:
            environ[ENVIRON_CLAIM] = claim
            try:
                run_app()
            except Exception:
                if not s.stores(500):
                    raise
                log.exception("idempotent request %r failed; storing a 500", key)
                captured.update(status=500, body=b"Internal Server Error",
                                headers=[("Content-Type", "text/plain; charset=utf-8")])
            if not s.stores(captured["status"]):
                raise NotStored(captured)
            return Response(captured["status"], pack(s.kept(captured["headers"]), captured["body"]))

        result = self.guard.do(key, fingerprint, handler, scope=tenant,
                               wait_for=s.wait_of(environ), remember=s.remember,
                               not_stored=s.not_stored)
        s.store_state(result, log)
        if result.outcome is Outcome.REPLAYED:
            return self._replay(environ, start_response, result.response.status,
                                result.response.body, result.expires_at)
        if result.outcome is Outcome.IN_FLIGHT:
            return self._reply(start_response, *s.in_flight(result.lease_left))
        if result.outcome is Outcome.CONFLICT:
            return self._reply(start_response, *s.conflict())
        if result.outcome is Outcome.EXPIRED:
            return self._reply(start_response, *s.expired())
        if result.outcome is Outcome.UNAVAILABLE:
            bad = s.refused(result.error) if result.failed_step == "begin" else None
            if bad is not None:             # the server's limit: no claim, no handler
                return self._reply(start_response, *bad)
            return self._reply(start_response, *s.unavailable())
        if result.failed_step == "handler" and not isinstance(result.error, NotStored):
            raise result.error
        if result.failed_step == "complete" and not result.not_stored:
            log.error("response for key %r not stored: %s; the key is in flight "
                      "until its lease ends", key, result.error)
        stored = result.failed_step is None
        return self._reply_captured(start_response, captured,
                                    s.expires(result.expires_at) if stored else [])

    def _transactional(self, environ, start_response, key, fingerprint, tenant,
                       run_app, captured):
        """Claim, handler and stored response in one transaction."""
        s, g = self.settings, self.guard
        ran = False
        row = None
        expires = None
        try:
            with g._source.connection() as conn:
                with atomic(conn, key, fingerprint, schema=g.sql.schema, lease=g.lease,
                            retention=g.retention, scope=g.scope if tenant is None else tenant,
                            wait=True, lock_timeout=g.timeout,
                            wait_for=s.wait_of(environ) or None, timeout=twice(g.timeout),
                            remember=g.remember if s.remember is None else s.remember) as tx:
                    if not tx.claimed:
                        row = tx.row
                    else:
                        environ[ENVIRON_CONNECTION], environ[ENVIRON_CLAIM] = conn, tx
                        ran = True
                        try:
                            run_app()
                        except Exception as exc:
                            raise HandlerFailed(exc) from exc
                        finally:
                            environ.pop(ENVIRON_CONNECTION, None)
                        if not s.stores(captured["status"]):
                            raise Release()
                        expires = self._complete(conn, tx, key, captured)
        except Release:
            return self._reply_captured(start_response, captured, [])  # rolled back
        except HandlerFailed as failed:
            raise failed.error              # rolled back; the server answers 500
        except (IdemError, psycopg.Error, OSError) as exc:
            err = translate(exc)
            if not ran and isinstance(err, Timeout) and err.sqlstate == "55P03":
                # the transaction of the first request still holds the key
                return self._reply(start_response, *s.in_flight(None))
            bad = None if ran else s.refused(err)
            if bad is not None:             # the server's limit: rolled back, nothing claimed
                return self._reply(start_response, *bad)
            log.warning("idempotent transaction for key %r not done (%s); "
                        "nothing is committed", key, err)
            return self._reply(start_response, *s.unavailable())
        if row is None:
            return self._reply_captured(start_response, captured, s.expires(expires))
        if row.outcome() is Outcome.REPLAYED:
            return self._replay(environ, start_response, row.status, row.body or b"",
                                row.expires_at)
        if row.outcome() is Outcome.IN_FLIGHT:
            return self._reply(start_response, *s.in_flight(row.lease_left))
        if row.outcome() is Outcome.EXPIRED:
            return self._reply(start_response, *s.expired())
        return self._reply(start_response, *s.conflict())

    def _complete(self, conn, tx, key, captured):
        """Store the response (a savepoint); if that fails for good, the
        fixed "Response not stored" answer instead.  Returns expires_at,
        or None when the fixed answer was stored."""
        s = self.settings
        try:
            with conn.transaction():
                return tx.complete(captured["status"],
                                   pack(s.kept(captured["headers"]), captured["body"]))
        except (IdemError, psycopg.Error) as exc:
            err = translate(exc)
            if transient(err):
                raise
        nope = s.not_stored
        with conn.transaction():
            tx.complete(nope.status, nope.body)
        log.warning("response for key %r not stored (%s: %s); a retry gets %d "
                    "\"Response not stored\"", key, err.sqlstate, err, nope.status)
        return None
