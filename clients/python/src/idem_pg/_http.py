"""What the ASGI and WSGI middleware share: settings, the fingerprint,
the stored form of a response and the error responses."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

Headers = List[Tuple[str, str]]

# Headers stored with a response and sent again on replay.
DEFAULT_STORED_HEADERS = ("content-type", "content-encoding", "content-language",
                          "content-location", "location", "etag", "last-modified",
                          "link", "cache-control")

_MAGIC = b"idem-http/1\n"


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
    """Middleware settings (see README): the same for ASGI and WSGI."""

    def __init__(self, *, header: str = "Idempotency-Key",
                 methods: Iterable[str] = ("POST", "PATCH"), required: bool = False,
                 fingerprint: Optional[Callable[[str, str, bytes], str]] = None,
                 scope: Optional[Callable[[Any], str]] = None,
                 store_server_errors: bool = False,
                 replay_header: Optional[str] = "Idempotent-Replayed",
                 retry_after: int = 1,
                 stored_headers: Sequence[str] = DEFAULT_STORED_HEADERS,
                 max_key_length: int = 255):
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

    def in_flight(self) -> Tuple[int, Headers, bytes]:
        return problem(409, "a request with this %s is being processed" % self.header,
                       [("retry-after", str(self.retry_after))])

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
