"""Batch routes: one Idempotency-Key for the envelope, one key per item.

The contract is doc/http.md's "Batches", the same as the Node
middleware's ``req.idempotency.items``: byte for byte the same envelope
for the same items and answers, and the same item fingerprints, so that
the same item sent to a Python-served and a Node-served API is the same
item.

A batch route sits behind IdempotencyMiddleware (ASGI) or
IdempotencyWSGIMiddleware (WSGI) like any other: the envelope's key K
claims the whole request, and a retry of a completed envelope replays
it whole.  Inside, ``run_batch`` (a Guard) or ``run_batch_async`` (an
AsyncGuard) claims one key per item with one idem_begin_many call
(Guard.do_many) in the scope of the envelope's key:

- item i's key is ``item_key(item, i)`` when given, else the item's own
  ``"key"`` member (``key_member``; a str) when it has one, else ``K:i``;
- its fingerprint is ``fingerprint(item, i)`` when given, else the
  lower-case hex SHA-256 of the item's JSON as JavaScript's
  JSON.stringify writes it (``item_json``): the whole item, its own key
  member included, members in the order they came, no spaces, numbers
  as JavaScript writes them, non-ASCII as UTF-8;
- the handler runs once per item key: an item done under another envelope
  (the same item key, the same item) is replayed, not run again; a key
  repeated in the batch runs once (``duplicateOf``).

The answer is JSON::

    {"results":[{"index":0,"key":"K:0","status":201,"body":{...},
                 "replayed":false,"duplicateOf":null}, ...]}

one member per item in input order; ``body`` is what the handler
returned (or the stored copy, ``replayed`` true) or a problem object.
Item statuses: the handler's; 422 for an item key used with another
item; 409 for an item in flight elsewhere (after waiting up to
``wait_for``); 410 for one expired on a server with tombstones; 500 for a
handler that raised (its key is released); 503 when the store failed.
The envelope's status is 200 when every item has its final answer (the
middleware stores it, and a retry of K replays it whole), else 503 with
``Retry-After: 1`` (not stored: a retry of K runs the batch again, where
the items done replay and the others run).  Items that are no JSON array,
or an item key that is no key, answer 400.

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
import math
import re
from decimal import Decimal
from typing import Any, Awaitable, Callable, List, Optional, Sequence, Tuple

from ._common import Outcome, Response, Result, Seconds
from ._http import BadKey, parse_key, problem
from .aio import AsyncGuard
from .guard import Guard

Answer = Tuple[int, List[Tuple[str, str]], bytes]
KeyOf = Callable[[Any, int], str]
FingerprintOf = Callable[[Any, int], str]

KEY_MEMBER = "key"
JSON = "application/json"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class BadBatch(ValueError):
    """The request is no batch (answered 400)."""


def _js_number(x: Any) -> str:
    """A JSON number as JavaScript writes it (Number.prototype.toString of
    the double it parses to); null for one that is not finite."""
    try:
        f = float(x)
    except OverflowError:
        return "null"
    if not math.isfinite(f):
        return "null"
    if f == 0:
        return "0"
    sign = "-" if f < 0 else ""
    # repr: the shortest digits that read back as f, as JavaScript's
    t = Decimal(repr(abs(f))).normalize().as_tuple()
    digits = "".join(map(str, t.digits))
    k = len(digits)
    n = k + int(t.exponent)
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * -n + digits
    else:
        e = n - 1
        exp = "e" + ("+" if e >= 0 else "-") + str(abs(e))
        out = (digits if k == 1 else digits[0] + "." + digits[1:]) + exp
    return sign + out


def _js_string(s: str) -> str:
    out = json.dumps(s, ensure_ascii=False)
    return _LONE_SURROGATE.sub(lambda m: "\\u%04x" % ord(m.group()), out)


def item_json(value: Any) -> str:
    """``value`` as JavaScript's JSON.stringify writes it: members in their
    order, no spaces, numbers as JavaScript writes them, non-ASCII as is
    (a lone surrogate escaped)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _js_string(value)
    if isinstance(value, (int, float)):
        return _js_number(value)
    if isinstance(value, dict):
        return "{" + ",".join(_js_string(str(k)) + ":" + item_json(v)
                              for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(item_json(v) for v in value) + "]"
    raise TypeError("%r is no JSON value" % (value,))


def item_fingerprint(item: Any, index: int = 0) -> str:
    """The default fingerprint of an item (doc/http.md, "Batches"): the
    lower-case hex SHA-256 of item_json(item), the whole item."""
    return hashlib.sha256(item_json(item).encode("utf-8", "surrogatepass")).hexdigest()


def item_keys(key: str, items: Sequence[Any], key_member: Optional[str] = KEY_MEMBER,
              key_of: Optional[KeyOf] = None) -> List[str]:
    """Each item's key: ``key_of(item, i)`` if given, else its own
    ``key_member`` (a str) if it has one, else ``key:i``.  Raises BadBatch
    for a key that is no key (1 to 255 bytes of printable ASCII)."""
    out = []
    for i, item in enumerate(items):
        own: Any
        if key_of is not None:
            own, where = key_of(item, i), "the key of item %d" % i
        else:
            own = item.get(key_member) if key_member and isinstance(item, dict) else None
            where = "items[%d].%s" % (i, key_member)
            if own is None:
                out.append("%s:%d" % (key, i))
                continue
        if not isinstance(own, str):
            raise BadBatch("%s is not a string" % where)
        try:
            k = parse_key(own)
        except BadKey as exc:
            raise BadBatch("%s: %s" % (where, exc)) from None
        if not k:
            raise BadBatch("%s is empty" % where)
        out.append(k)
    return out


def _items(key: Optional[str], items: Any, key_member: Optional[str],
           key_of: Optional[KeyOf], fingerprint_of: Optional[FingerprintOf]
           ) -> List[Tuple[str, str]]:
    if not key:
        raise BadBatch("a batch needs an Idempotency-Key")
    if not isinstance(items, list):
        raise BadBatch("the items must be a JSON array")
    fp = fingerprint_of or item_fingerprint
    return list(zip(item_keys(key, items, key_member, key_of),
                    (str(fp(item, i)) for i, item in enumerate(items))))


def _as_response(value: Any) -> Response:
    """A handler's (status, JSON value), {"status", "body"} or Response (its
    body JSON) as the item's stored Response: the body as item_json writes
    it, as the Node middleware stores it."""
    if isinstance(value, Response):
        return value
    if isinstance(value, dict):
        status, body = value["status"], value.get("body")
    else:
        status, body = value
    if isinstance(status, bool) or not isinstance(status, int):
        raise TypeError("an item's handler must return (status, body) with an integer status")
    return Response(status, item_json(body).encode("utf-8", "surrogatepass"))


def _bad(exc: BaseException) -> Answer:
    return problem(400, "Bad batch", str(exc))


def _problem(status: int, title: str, detail: str) -> Tuple[int, Any]:
    return status, {"type": "about:blank", "title": title, "status": status, "detail": detail}


# The problem of an item that has no answer of its own (doc/http.md,
# "Batches"), the Node middleware's words.
_CONFLICT = _problem(422, "item key reused", "this item's key was used with another item")
_IN_FLIGHT = _problem(409, "item in flight", "this item is being processed by another request")
_EXPIRED = _problem(410, "item expired", "this item was processed once; its answer is no "
                    "longer kept")
_FAILED = _problem(500, "item failed", "this item was not processed; retry the request")
_UNAVAILABLE = _problem(503, "store unavailable", "this item was not processed; retry the "
                        "request")


def _answer(items: List[Tuple[str, str]], results: List[Result]) -> Answer:
    out, final = [], True
    for i, ((key, _), r) in enumerate(zip(items, results)):
        if r.error is None and r.response is not None:
            status, body = r.response.status, _json_body(r.response.body)
        elif r.outcome is Outcome.CONFLICT:
            status, body = _CONFLICT
        elif r.outcome is Outcome.IN_FLIGHT:
            status, body = _IN_FLIGHT
        elif r.outcome is Outcome.EXPIRED:
            status, body = _EXPIRED
        elif r.failed_step == "handler":
            status, body = _FAILED
        else:
            status, body = _UNAVAILABLE
        if r.error is not None or r.outcome in (Outcome.IN_FLIGHT, Outcome.UNAVAILABLE):
            final = False
        out.append({"index": i, "key": key, "status": status, "body": body,
                    "replayed": r.outcome is Outcome.REPLAYED,
                    "duplicateOf": r.duplicate_of})
    headers = [("Content-Type", JSON)]
    if not final:
        headers.append(("Retry-After", "1"))
    body = item_json({"results": out}).encode("utf-8", "surrogatepass")
    return (200 if final else 503), headers, body


def _json_body(body: bytes) -> Any:
    text = body.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def run_batch(guard: Guard, key: Optional[str], items: Any,
              handler: Callable[[int, Any, Any], Any], *, scope: Optional[str] = None,
              wait_for: Seconds = None, key_member: Optional[str] = KEY_MEMBER,
              item_key: Optional[KeyOf] = None,
              fingerprint: Optional[FingerprintOf] = None) -> Answer:
    """Run a batch route's items (see the module doc) with ``guard``:
    ``handler(i, item, claim)`` returns (status, JSON value), a dict
    {"status", "body"} or a Response whose body is JSON.  ``key``: the
    envelope's key (the middleware's ``g.idem_key`` /
    ``environ["idem_pg.key"]``); ``scope``: its scope
    (``environ["idem_pg.scope"]``).  An item's key: ``item_key(item, i)``
    when given, else its ``key_member`` ("key"; None: never), else
    ``key:i``; its fingerprint ``fingerprint(item, i)`` when given, else
    item_fingerprint.  Returns (status, headers, body)."""
    try:
        pairs = _items(key, items, key_member, item_key, fingerprint)
    except BadBatch as exc:
        return _bad(exc)
    results = guard.do_many(pairs, lambda i, claim: _as_response(handler(i, items[i], claim)),
                            scope=scope, wait_for=wait_for)
    return _answer(pairs, results)


async def run_batch_async(guard: AsyncGuard, key: Optional[str], items: Any,
                          handler: Callable[[int, Any, Any], Awaitable[Any]], *,
                          scope: Optional[str] = None, wait_for: Seconds = None,
                          key_member: Optional[str] = KEY_MEMBER,
                          item_key: Optional[KeyOf] = None,
                          fingerprint: Optional[FingerprintOf] = None) -> Answer:
    """run_batch with an AsyncGuard and ``await handler(i, item, claim)``;
    ``key`` and ``scope`` are ``request.state.idem_key`` and
    ``request.state.idem_scope``."""
    try:
        pairs = _items(key, items, key_member, item_key, fingerprint)
    except BadBatch as exc:
        return _bad(exc)

    async def run(i: int, claim: Any) -> Response:
        return _as_response(await handler(i, items[i], claim))

    results = await guard.do_many(pairs, run, scope=scope, wait_for=wait_for)
    return _answer(pairs, results)
