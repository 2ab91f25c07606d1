"""What the ASGI and WSGI middleware share: settings, the fingerprint,
the stored form of a response and the error responses."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

from ._common import wait_seconds

Headers = List[Tuple[str, str]]

# Headers stored with a response and sent again on replay.
DEFAULT_STORED_HEADERS = ("content-type", "content-encoding", "content-language",
                          "content-location", "location", "etag", "last-modified",
                          "link", "cache-control")

_MAGIC = b"idem-http/1\n"

# How long a duplicate of a request in flight waits for its answer.
DEFAULT_WAIT_FOR = 5.0


def default_fingerprint(method: str, path: str, body: bytes) -> str:
    """SHA-256 of the method, the path with its query string, and the body."""
    h = hashlib.sha256()
    h.update(method.upper().encode("ascii"))
    h.update(b" ")
    h.update(path.encode("utf-8", "surrogateescape"))
    h.update(b"\n")
    h.update(body)
    return "sha256:" + h.hexdigest()


def pack(headers: Headers, body: bytes) -> bytes:
    """The stored body: a marker line, the kept headers as JSON, the body."""
    return _MAGIC + json.dumps(headers, separators=(",", ":")).encode("utf-8") + b"\n" + body


def unpack(data: bytes) -> Tuple[Headers, bytes]:
    if not data.startswith(_MAGIC):
        return [], data             # stored by something else: body only
    rest = data[len(_MAGIC):]
    line, _, body = rest.partition(b"\n")
    return [(str(k), str(v)) for k, v in json.loads(line.decode("utf-8"))], body


def problem(status: int, title: str, extra: Optional[Headers] = None) -> Tuple[int, Headers, bytes]:
    body = json.dumps({"title": title, "status": status}).encode("utf-8")
    headers = [("content-type", "application/problem+json"),
               ("content-length", str(len(body)))]
    return status, headers + list(extra or []), body


class Settings:
    """Middleware settings (see README): the same for ASGI and WSGI.

    ``wait_for``: seconds a duplicate of a request in flight waits for the
    first one's response (None or 0: 409 at once), or a function of the
    ASGI scope or WSGI environ returning them, for a wait per route.
    """

    def __init__(self, *, header: str = "Idempotency-Key",
                 methods: Iterable[str] = ("POST", "PATCH"), required: bool = False,
                 fingerprint: Optional[Callable[[str, str, bytes], str]] = None,
                 scope: Optional[Callable[[Any], str]] = None,
                 store_server_errors: bool = False,
                 replay_header: Optional[str] = "Idempotent-Replayed",
                 retry_after: int = 1,
                 stored_headers: Sequence[str] = DEFAULT_STORED_HEADERS,
                 max_key_length: int = 255,
                 wait_for: Union[None, float, Callable[[Any], Optional[float]]] = DEFAULT_WAIT_FOR):
        self.header = header
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.fingerprint = fingerprint or default_fingerprint
        self.scope = scope
        self.store_server_errors = store_server_errors
        self.replay_header = replay_header
        self.retry_after = retry_after
        self.stored_headers = frozenset(h.lower() for h in stored_headers)
        self.max_key_length = max_key_length
        if not callable(wait_for):
            wait_seconds(wait_for)          # a bad number fails here, not per request
        self.wait_for = wait_for

    def wait_of(self, request: Any) -> float:
        """The wait for this request (ASGI scope or WSGI environ); 0: none."""
        w = self.wait_for(request) if callable(self.wait_for) else self.wait_for
        return wait_seconds(w) or 0.0

    def kept(self, headers: Headers) -> Headers:
        return [(k, v) for k, v in headers if k.lower() in self.stored_headers]

    def bad_key(self, key: Optional[str]) -> Optional[Tuple[int, Headers, bytes]]:
        if key is None:
            if self.required:
                return problem(400, "the %s header is missing" % self.header)
            return None
        if key == "" or len(key.encode("utf-8")) > self.max_key_length:
            return problem(400, "the %s header must have 1 to %d bytes"
                           % (self.header, self.max_key_length))
        return None

    def replay(self, status: int, data: bytes) -> Tuple[int, Headers, bytes]:
        headers, body = unpack(data)
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        headers.append(("content-length", str(len(body))))
        if self.replay_header:
            headers.append((self.replay_header, "true"))
        return status, headers, body

    def in_flight(self, lease_left: Optional[float] = None) -> Tuple[int, Headers, bytes]:
        """409; Retry-After: the seconds left of the holder's lease when
        the server named it (at least 1), else ``retry_after``."""
        after = self.retry_after
        if lease_left is not None:
            after = max(1, math.ceil(lease_left))
        return problem(409, "a request with this %s is being processed" % self.header,
                       [("retry-after", str(after))])

    def conflict(self) -> Tuple[int, Headers, bytes]:
        return problem(422, "this %s was used for a different request" % self.header)

    def unavailable(self) -> Tuple[int, Headers, bytes]:
        return problem(503, "the idempotency store is unavailable",
                       [("retry-after", str(self.retry_after))])


class NotStored(Exception):
    """Raised from the guard's handler so that a response is sent but the
    claim released (a 5xx when server errors are not stored)."""

    def __init__(self, response):
        super().__init__("server error response released for retry")
        self.response = response
