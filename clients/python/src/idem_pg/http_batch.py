"""Batch routes: one Idempotency-Key for the envelope, one key per item.

A batch route sits behind IdempotencyMiddleware (ASGI) or
IdempotencyWSGIMiddleware (WSGI) like any other: the envelope's key K
claims the whole request, and a retry of a completed envelope replays
it whole.  Inside, ``run_batch`` (a Guard) or ``run_batch_async`` (an
AsyncGuard) claims one key per item with one idem_begin_many call
(Guard.do_many) in the scope of the envelope's key:

- item i's key is the item's own ``"idempotency_key"`` member when it has
  one (a str), else ``K:i``;
- its fingerprint is the SHA-256 of the item's canonical JSON (keys
  sorted, no spaces) without its own key member;
- the handler runs once per item key: an item done under another envelope
  (the same item key, the same content) is replayed, not run again.

The answer is JSON::

    {"items": [{"index": 0, "key": "K:0", "status": 201, "replayed": false,
                "body": {...}}, ...]}

one member per item in input order; ``body`` is what the handler
returned (or the stored copy, ``replayed`` true) or a problem object.
Item statuses: the handler's; 422 for an item key reused with other
content; 409 for an item in flight elsewhere (after waiting up to
``wait_for``); 410 for one expired on a server with tombstones; 500 for a
handler that raised (its key is released); 503 when the store failed.
The envelope's status is 200 when every item has its final answer (the
middleware stores it, and a retry of K replays it whole), else 503 with
``Retry-After: 1`` (not stored: a retry of K runs the batch again, where
the items done replay and the others run).  A body that is no JSON object
with an ``"items"`` array, or an item key that is no key, answers 400.

    @app.post("/batch")
    def batch():
        status, headers, body = http_batch.run_batch(
            guard, g.idem_key, request.get_json()["items"], handler,
            scope=request.environ["idem_pg.scope"])
        return body, status, headers
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Awaitable, Callable, List, Optional, Sequence, Tuple

from ._common import Outcome, Response, Result, Seconds
from ._http import BadKey, parse_key, problem
from .aio import AsyncGuard
from .guard import Guard

Answer = Tuple[int, List[Tuple[str, str]], bytes]

KEY_MEMBER = "idempotency_key"
JSON = "application/json"


class BadBatch(ValueError):
    """The request is no batch (answered 400)."""


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")


def item_fingerprint(item: Any, key_member: str = KEY_MEMBER) -> str:
    """SHA-256 of the item's canonical JSON, without its own key."""
    if isinstance(item, dict) and key_member in item:
        item = {k: v for k, v in item.items() if k != key_member}
    return "sha256:" + hashlib.sha256(_canonical(item)).hexdigest()


def item_keys(key: str, items: Sequence[Any], key_member: str = KEY_MEMBER) -> List[str]:
    """Each item's key: its own ``key_member`` (a str) if given, else
    ``key:i``.  Raises BadBatch for an own key that is no key (1 to 255
    bytes of printable ASCII)."""
    out = []
    for i, item in enumerate(items):
        own = item.get(key_member) if isinstance(item, dict) else None
        if own is None:
            out.append("%s:%d" % (key, i))
            continue
        if not isinstance(own, str):
            raise BadBatch("items[%d].%s is not a string" % (i, key_member))
        try:
            k = parse_key(own)
        except BadKey as exc:
            raise BadBatch("items[%d].%s: %s" % (i, key_member, exc)) from None
        if not k:
            raise BadBatch("items[%d].%s is empty" % (i, key_member))
        out.append(k)
    return out


def _items(key: Optional[str], items: Any, key_member: str) -> List[Tuple[str, str]]:
    if not key:
        raise BadBatch("a batch needs an Idempotency-Key")
    if not isinstance(items, list):
        raise BadBatch('the body needs an "items" array')
    return list(zip(item_keys(key, items, key_member), (item_fingerprint(i, key_member) for i in items)))


def _as_response(value: Any) -> Response:
    """A handler's (status, JSON value) or Response (its body JSON) as the
    item's stored Response."""
    if isinstance(value, Response):
        return value
    status, body = value
    return Response(int(status), _canonical(body))


def _bad(exc: BaseException) -> Answer:
    return problem(400, "Bad batch", str(exc))


def _answer(items: List[Tuple[str, str]], results: List[Result]) -> Answer:
    out, final = [], True
    for i, ((key, _), r) in enumerate(zip(items, results)):
        replayed = r.outcome is Outcome.REPLAYED
        if r.outcome in (Outcome.EXECUTED, Outcome.REPLAYED) and r.error is None \
                and r.response is not None:
            status, body = r.response.status, _json_body(r.response.body)
        elif r.outcome is Outcome.EXECUTED and r.failed_step == "complete" \
                and r.response is not None:
            # ran; its answer is not stored: the batch is answered, not stored
            status, body, final = r.response.status, _json_body(r.response.body), False
        elif r.outcome is Outcome.EXECUTED:
            status, body, final = 500, _problem(500, "Item failed", "the item's handler "
                                                "failed; a retry runs it again"), False
        elif r.outcome is Outcome.CONFLICT:
            status, body = 422, _problem(422, "Item key reused", "the key %r was used "
                                         "for another item" % key)
        elif r.outcome is Outcome.IN_FLIGHT:
            status, body, final = 409, _problem(409, "Item in flight", "an earlier request "
                                                "with this item's key is still running"), False
        elif r.outcome is Outcome.EXPIRED:
            status, body = 410, _problem(410, "Item expired", "the item was completed once; "
                                         "its response is no longer kept")
        else:
            status, body, final = 503, _problem(503, "Store unavailable", "the idempotency "
                                                "store failed; nothing ran"), False
        out.append({"index": i, "key": key, "status": status, "replayed": replayed,
                    "body": body})
    headers = [("Content-Type", JSON)]
    if not final:
        headers.append(("Retry-After", "1"))
    body = json.dumps({"items": out}, separators=(",", ":"), ensure_ascii=False)
    return (200 if final else 503), headers, body.encode("utf-8")


def _json_body(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except ValueError:
        return body.decode("utf-8", "replace")


def _problem(status: int, title: str, detail: str) -> Any:
    return {"type": "about:blank", "title": title, "status": status, "detail": detail}


def run_batch(guard: Guard, key: Optional[str], items: Any,
              handler: Callable[[int, Any, Any], Any], *, scope: Optional[str] = None,
              wait_for: Seconds = None, key_member: str = KEY_MEMBER) -> Answer:
    """Run a batch route's items (see the module doc) with ``guard``:
    ``handler(i, item, claim)`` returns (status, JSON value) or a
    Response whose body is JSON.  ``key``: the envelope's key (the
    middleware's ``g.idem_key`` / ``environ["idem_pg.key"]``); ``scope``:
    its scope (``environ["idem_pg.scope"]``).  Returns (status, headers,
    body)."""
    try:
        pairs = _items(key, items, key_member)
    except BadBatch as exc:
        return _bad(exc)
    results = guard.do_many(pairs, lambda i, claim: _as_response(handler(i, items[i], claim)),
                            scope=scope, wait_for=wait_for)
    return _answer(pairs, results)


async def run_batch_async(guard: AsyncGuard, key: Optional[str], items: Any,
                          handler: Callable[[int, Any, Any], Awaitable[Any]], *,
                          scope: Optional[str] = None, wait_for: Seconds = None,
                          key_member: str = KEY_MEMBER) -> Answer:
    """run_batch with an AsyncGuard and ``await handler(i, item, claim)``;
    ``key`` and ``scope`` are ``request.state.idem_key`` and
    ``request.state.idem_scope``."""
    try:
        pairs = _items(key, items, key_member)
    except BadBatch as exc:
        return _bad(exc)

    async def run(i: int, claim: Any) -> Response:
        return _as_response(await handler(i, items[i], claim))

    results = await guard.do_many(pairs, run, scope=scope, wait_for=wait_for)
    return _answer(pairs, results)
