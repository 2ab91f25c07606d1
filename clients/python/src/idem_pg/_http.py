"""What the ASGI and WSGI middleware share: settings, the parse of the
header, the fingerprint, the replay policy, the stored form of a response
(the envelope) and the error responses.  The behaviour is doc/http.md's."""

from __future__ import annotations

import datetime as _dt
import email.utils
import hashlib
import json
import logging
import math
import re
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

from ._common import NOT_STORED, Response, Seconds, seconds, wait_seconds

Headers = List[Tuple[str, str]]
Answer = Tuple[int, Headers, bytes]

# Headers stored with a response and sent again on replay.
DEFAULT_STORED_HEADERS = ("content-type", "content-encoding", "content-language",
                          "content-location", "location", "etag", "last-modified",
                          "link", "cache-control")

_MAGIC = b"idem-http/1\n"

# How long a duplicate of a request in flight waits for its answer.
DEFAULT_WAIT_FOR = 5.0


class BadKey(ValueError):
    """The header's value is no key (doc/http.md): answered 400."""


# The SQLSTATE of a key or scope longer than the server's
# idem.max_key_length (string_data_right_truncation).  The server is asked,
# not a copy of its limit: the setting may differ per role or database and
# change at any reload.
KEY_TOO_LONG = "22001"


def refused_key(error: Optional[BaseException]) -> Optional[str]:
    """The server's message when ``error``, the error of a claim made
    before the handler ran, is the server refusing the key or the scope
    (22001: longer than idem.max_key_length), else None.  A claim's other
    data errors are not the request's: the middleware never sends an empty
    or NULL key (22023, 22004), and the lease, retention and wait are the
    route's settings."""
    state = getattr(error, "sqlstate", None)
    if state is None and error is not None and error.__cause__ is not None:
        state = getattr(error.__cause__, "sqlstate", None)
    if state != KEY_TOO_LONG:
        return None
    return str(error).strip() or "too long"


def parse_key(value: Optional[str], max_length: int = 255) -> Optional[str]:
    """The key of an Idempotency-Key header value (its bytes as latin-1
    text; None: no header), for ASGI and WSGI alike.  The value is a
    Structured Field string (``"K"``, with ``\\"`` and ``\\\\``
    escapes) or a bare token (``K``): both give the key K.  A key is 1 to
    ``max_length`` bytes of printable ASCII (0x20 to 0x7e); anything else
    raises BadKey."""
    if value is None:
        return None
    v = value.strip(" \t")
    if v.startswith('"'):
        out = []
        i, n = 1, len(v)
        while True:
            if i >= n:
                raise BadKey("an unterminated string")
            c = v[i]
            if c == "\\":
                if i + 1 >= n or v[i + 1] not in '"\\':
                    raise BadKey("a backslash not followed by \\ or \"")
                out.append(v[i + 1])
                i += 2
            elif c == '"':
                if i + 1 != n:
                    raise BadKey("characters after the closing quote")
                break
            elif " " <= c <= "~":
                out.append(c)
                i += 1
            else:
                raise BadKey("a character outside printable ASCII (0x%02x)" % ord(c))
        key = "".join(out)
    else:
        key = v
        for c in key:
            if not " " <= c <= "~":
                raise BadKey("a character outside printable ASCII (0x%02x)" % ord(c))
    if not key or len(key) > max_length:
        raise BadKey("the key must have 1 to %d bytes" % max_length)
    return key


class BadDate(ValueError):
    """The header's value is no IMF-fixdate (doc/http.md): answered 400."""


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_IMF_FIXDATE = re.compile(r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), ([0-9]{2}) "
                          r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) ([0-9]{4}) "
                          r"([0-9]{2}):([0-9]{2}):([0-9]{2}) GMT")


def parse_http_date(value: str) -> _dt.datetime:
    """The time of an IMF-fixdate (RFC 9110 section 5.6.7, e.g. ``Sun, 06
    Nov 1994 08:49:37 GMT``), as an aware UTC datetime; the header's
    optional whitespace around it is ignored.  The obsolete RFC 850 and
    asctime forms, a day name that is not the date's, a date or time out
    of range raise BadDate.  A leap second (60) is read as 59."""
    m = _IMF_FIXDATE.fullmatch(value.strip(" \t"))
    if m is None:
        raise BadDate("not an IMF-fixdate (like Sun, 06 Nov 1994 08:49:37 GMT)")
    day, month = int(m.group(2)), _MONTHS.index(m.group(3)) + 1
    hour, minute, second = int(m.group(5)), int(m.group(6)), int(m.group(7))
    if second == 60:
        second = 59
    try:
        at = _dt.datetime(int(m.group(4)), month, day, hour, minute, second,
                          tzinfo=_dt.timezone.utc)
    except ValueError as exc:
        raise BadDate("a date or time out of range (%s)" % exc) from None
    if _DAYS[at.weekday()] != m.group(1):
        raise BadDate("%s is a %s, not a %s" % (at.date().isoformat(), _DAYS[at.weekday()],
                                                 m.group(1)))
    return at


# OASIS Repeatable Requests 1.0 (doc/http.md): the request's headers and
# the answer's.
REQUEST_ID = "Repeatability-Request-ID"
FIRST_SENT = "Repeatability-First-Sent"
RESULT = "Repeatability-Result"
# This project's own header: the route's window in seconds (doc/http.md).
LIFETIME = "Idempotency-Key-Lifetime"

# The route's window when the guard names no retention: the server's
# idem.default_retention, in seconds, asked once.
WINDOW_SQL = ("SELECT setting::int8 FROM pg_catalog.pg_settings "
              "WHERE name = 'idem.default_retention'")


def window_of_row(row: Optional[Sequence[Any]], log: logging.Logger) -> Optional[float]:
    """The window in seconds from WINDOW_SQL's row; None, logged, if the
    server has no idem.default_retention (idem is not preloaded)."""
    if row is None or row[0] is None:
        log.warning("the server has no idem.default_retention: is idem in "
                    "shared_preload_libraries?")
        return None
    return float(row[0])


# Answers released rather than stored (doc/http.md's policy): besides 5xx,
# those about the caller's credentials or timing, which a retry (after a
# token refresh, a proxy login, a pause) should see run again.
NOT_STORED_STATUSES = frozenset((401, 403, 407, 408, 425, 429))


def default_store_status(status: int) -> bool:
    """doc/http.md's policy: store unless 401, 403, 407, 408, 425, 429 or
    5xx."""
    return status not in NOT_STORED_STATUSES and status < 500


def caller_scope(tenant: str, principal: str, max_length: int = 255) -> str:
    """The scope of a key claimed for ``principal`` within ``tenant``
    (doc/http.md): ``<n>:<tenant>=<principal>``, n the tenant's length in
    UTF-8 bytes, so that no two (tenant, principal) pairs give one scope.
    A principal that is not printable ASCII, or that would make the scope
    longer than ``max_length`` bytes, is written as ``#`` and the hex
    SHA-256 of its UTF-8 bytes instead of ``=`` and itself."""
    t = tenant.encode("utf-8", "surrogatepass")
    head = "%d:%s" % (len(t), tenant)
    plain = head + "=" + principal
    if all(" " <= c <= "~" for c in principal) and \
            len(plain.encode("utf-8", "surrogatepass")) <= max_length:
        return plain
    return head + "#" + hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()


class BadPrincipal(Exception):
    """The principal hook raised or returned something other than a str."""


def http_date(at: _dt.datetime) -> str:
    """An IMF-fixdate (Sun, 06 Nov 1994 08:49:37 GMT)."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=_dt.timezone.utc)
    return email.utils.format_datetime(at.astimezone(_dt.timezone.utc).replace(microsecond=0),
                                       usegmt=True)


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
    """The envelope: a marker line, the kept headers as a JSON array of
    [name, value] pairs with lower-case names, the body."""
    pairs = [[k.lower(), v] for k, v in headers]
    return _MAGIC + json.dumps(pairs, separators=(",", ":")).encode("utf-8") + b"\n" + body


def unpack(data: bytes) -> Tuple[Headers, bytes]:
    if not data.startswith(_MAGIC):
        return [], data             # stored by something else: body only
    rest = data[len(_MAGIC):]
    line, _, body = rest.partition(b"\n")
    return [(str(k), str(v)) for k, v in json.loads(line.decode("utf-8"))], body


def problem(status: int, title: str, detail: str,
            extra: Optional[Headers] = None) -> Tuple[int, Headers, bytes]:
    """An application/problem+json answer (RFC 9457), byte for byte the
    Node middleware's for the same answer (doc/http.md): the members type,
    title, status and detail in that order, compact, UTF-8."""
    body = json.dumps({"type": "about:blank", "title": title, "status": status,
                       "detail": detail},
                      separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    headers = [("content-type", "application/problem+json"),
               ("content-length", str(len(body)))]
    return status, headers + list(extra or []), body


class Settings:
    """Middleware settings (see README): the same for ASGI and WSGI.

    ``wait_for``: seconds a duplicate of a request in flight waits for the
    first one's response (None or 0: 409 at once), or a function of the
    ASGI scope or WSGI environ returning them, for a wait per route.

    ``store_status``: a function of the handler's status, true to store
    the response (default: not 401, 403, 407, 408, 425, 429 nor 5xx);
    ``store_server_errors=True`` stores every status.

    ``principal``: a function of the request returning the caller's
    identity (a str); keys are claimed in the scope
    ``caller_scope(tenant, principal)``, the tenant being what ``scope``
    returns (else the guard's scope).  ``shared=True`` instead: one
    namespace for every caller, the scope being the tenant alone.  One of
    the two is required.

    ``authorize``: a function of the request run before a stored response
    is replayed: True replays it, anything else but a triple answers 403, a (status, headers,
    body) triple is sent instead.

    ``advertise_window=True``: every response of the route carries
    ``Idempotency-Key-Lifetime: <seconds>``, the window (the guard's
    retention, else the server's idem.default_retention).

    OASIS Repeatable Requests (``Repeatability-Request-ID`` with
    ``Repeatability-First-Sent``) are always accepted beside the
    ``header``: see oasis_of.

    ``remember`` (seconds or a timedelta; None: the guard's): idem_begin's
    ``remember`` on a server with tombstones.  A retry after the stored
    response's retention but within remember is answered 410 (expired),
    the handler not run.
    """

    def __init__(self, *, header: str = "Idempotency-Key",
                 methods: Iterable[str] = ("POST", "PATCH"), required: bool = False,
                 fingerprint: Optional[Callable[[str, str, bytes], str]] = None,
                 scope: Optional[Callable[[Any], str]] = None,
                 store_server_errors: bool = False,
                 store_status: Optional[Callable[[int], bool]] = None,
                 replay_header: Optional[str] = "Idempotent-Replayed",
                 retry_after: int = 1,
                 stored_headers: Sequence[str] = DEFAULT_STORED_HEADERS,
                 max_key_length: int = 255,
                 wait_for: Union[None, float, Callable[[Any], Optional[float]]] = DEFAULT_WAIT_FOR,
                 principal: Optional[Callable[[Any], str]] = None, shared: bool = False,
                 authorize: Optional[Callable[[Any], Any]] = None,
                 advertise_window: bool = False, remember: Seconds = None):
        if principal is None and not shared:
            raise TypeError("the idempotency middleware needs principal= (a function of the "
                            "request returning the caller's identity, which scopes its keys) "
                            "or shared=True (every caller shares one namespace of keys, and a "
                            "replay goes to whoever sends the same key and request)")
        if principal is not None and shared:
            raise TypeError("principal= and shared=True: give one")
        if principal is not None and not callable(principal):
            raise TypeError("principal must be a function of the request")
        if authorize is not None and not callable(authorize):
            raise TypeError("authorize must be a function of the request")
        self.principal = principal
        self.shared = shared
        self.advertise_window = bool(advertise_window)
        self.authorize = authorize
        self.header = header
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.fingerprint = fingerprint or default_fingerprint
        self.scope = scope
        if store_status is not None and store_server_errors:
            raise TypeError("store_status and store_server_errors: give one")
        self.store_server_errors = store_server_errors
        if store_status is None:
            store_status = (lambda status: True) if store_server_errors else default_store_status
        self.store_status = store_status
        self.replay_header = replay_header
        self.retry_after = retry_after
        self.stored_headers = frozenset(h.lower() for h in stored_headers)
        self.max_key_length = max_key_length
        if not callable(wait_for):
            wait_seconds(wait_for)          # a bad number fails here, not per request
        self.wait_for = wait_for
        if remember is not None and seconds(remember) is None:
            raise ValueError("remember must be a number of seconds or a timedelta")
        self.remember = remember
        self._store_down = False

    def scope_of(self, tenant: str, principal: Any) -> str:
        """The scope of a request's key: the tenant alone when shared, else
        caller_scope(tenant, principal); raises BadPrincipal for a
        principal that is no str."""
        if self.principal is None:
            return tenant
        if not isinstance(principal, str):
            raise BadPrincipal("the principal hook returned %s, not a str"
                               % type(principal).__name__)
        return caller_scope(tenant, principal, self.max_key_length)

    def denied(self, answer: Any) -> Optional[Answer]:
        """None when authorize's answer lets the replay go out, else what
        to send instead (403 for a false answer)."""
        if isinstance(answer, tuple):
            status, headers, body = answer
            return int(status), list(headers), bytes(body)
        if answer is True:
            return None
        return problem(403, "replay not authorized",
                       "the stored response to this request is not available to this caller")

    def principal_failed(self) -> Answer:
        return problem(500, "caller unknown", "the caller's identity could not be established")

    def authorize_failed(self) -> Answer:
        return problem(500, "replay not authorized",
                       "the caller's access to the stored response could not be checked")

    def wait_of(self, request: Any) -> float:
        """The wait for this request (ASGI scope or WSGI environ); 0: none."""
        w = self.wait_for(request) if callable(self.wait_for) else self.wait_for
        return wait_seconds(w) or 0.0

    def stores(self, status: int) -> bool:
        """Whether a response with this status is stored (else released)."""
        return bool(self.store_status(status))

    def kept(self, headers: Headers) -> Headers:
        return [(k.lower(), v) for k, v in headers if k.lower() in self.stored_headers]

    def key_of(self, value: Optional[str]) -> Tuple[Optional[str], Optional[Answer]]:
        """(the key, None), (None, None) for no header where none is
        required, or (None, the 400 to answer)."""
        if value is None:
            if self.required:
                return None, problem(400, "Idempotency-Key required",
                                     "this request needs the %s header" % self.header)
            return None, None
        try:
            return parse_key(value, self.max_key_length), None
        except BadKey:
            return None, problem(400, "invalid Idempotency-Key",
                                 "the %s header must be an sf-string or a token of 1 to %d "
                                 "printable ASCII characters" % (self.header, self.max_key_length))

    def oasis_of(self, request_id: Optional[str], first_sent: Optional[str],
                 key_header: Optional[str]) -> Tuple[Optional[str], Optional[_dt.datetime],
                                                     Optional[Answer]]:
        """An OASIS Repeatable Request's (key, first-sent time, None), or
        (None, None, the 400 to answer).  Both headers are required; the
        request id is 1 to ``max_key_length`` bytes of printable ASCII, taken
        as it is (no sf-string unquoting), and names the same key as an
        Idempotency-Key of that value; a request that also has ``header``
        (``key_header``: its value) is refused."""
        if key_header is not None:
            return None, None, problem(400, "two idempotency keys",
                                       "%s and %s in one request: send one"
                                       % (self.header, REQUEST_ID))
        if request_id is None or first_sent is None:
            return None, None, problem(400, "incomplete repeatable request",
                                       "%s and %s go together: both are required"
                                       % (REQUEST_ID, FIRST_SENT))
        rid = request_id.strip(" \t")
        if not rid or len(rid) > self.max_key_length or \
                not all(" " <= c <= "~" for c in rid):
            return None, None, problem(400, "invalid %s" % REQUEST_ID,
                                       "the %s header must be 1 to %d printable ASCII "
                                       "characters" % (REQUEST_ID, self.max_key_length))
        try:
            at = parse_http_date(first_sent)
        except BadDate:
            return None, None, problem(400, "invalid %s" % FIRST_SENT,
                                       "the %s header must be an IMF-fixdate (like Sun, "
                                       "06 Nov 1994 08:49:37 GMT)" % FIRST_SENT)
        return rid, at, None

    @staticmethod
    def too_old(first_sent: _dt.datetime, window: float) -> Optional[Answer]:
        """412 when ``first_sent`` is older than the window (seconds) by
        this server's clock: a key claimed then may be gone, and running
        the request again would not be safe."""
        age = (_dt.datetime.now(_dt.timezone.utc) - first_sent).total_seconds()
        if age <= window:
            return None
        return problem(412, "repeatable request too old",
                       "the %s time is older than this route's window of %s seconds: "
                       "the request cannot be repeated safely" % (FIRST_SENT, lifetime(window)))

    def window_known(self, retention: Seconds) -> Optional[float]:
        """The window in seconds when the guard names a retention, else
        None (the server's default, to be asked with WINDOW_SQL)."""
        return seconds(retention)

    @staticmethod
    def decorate(headers: Headers, oasis: bool, accepted: bool,
                 window: Optional[float]) -> Headers:
        """``headers`` with Repeatability-Result (an OASIS request) and
        Idempotency-Key-Lifetime (``window`` known and advertised)."""
        out = list(headers)
        if oasis:
            out.append((RESULT, "accepted" if accepted else "rejected"))
        if window is not None:
            out.append((LIFETIME, lifetime(window)))
        return out

    def refused(self, error: Optional[BaseException]) -> Optional[Answer]:
        """The 400 for a claim the server refused for its key or scope
        (see refused_key), else None: a malformed key's answer, not 503,
        which a client would retry for ever."""
        message = refused_key(error)
        if message is None:
            return None
        if message.startswith("scope"):
            return problem(400, "idempotency scope refused",
                           "the idempotency store refuses this request's scope (%s): a scope "
                           "is at most the server's idem.max_key_length bytes" % message)
        return problem(400, "invalid Idempotency-Key",
                       "the idempotency store refuses the %s header's key (%s): a key is at "
                       "most the server's idem.max_key_length bytes" % (self.header, message))

    @property
    def not_stored(self) -> Response:
        """What is stored, in the envelope, when a response cannot be."""
        return Response(NOT_STORED.status,
                        pack([("content-type", "application/problem+json")], NOT_STORED.body))

    @staticmethod
    def expires(at: Optional[_dt.datetime]) -> Headers:
        return [("idempotency-expires", http_date(at))] if at is not None else []

    def replay(self, status: int, data: bytes,
               expires_at: Optional[_dt.datetime] = None) -> Tuple[int, Headers, bytes]:
        headers, body = unpack(data)
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        headers.append(("content-length", str(len(body))))
        if self.replay_header:
            headers.append((self.replay_header, "true"))
        return status, headers + self.expires(expires_at), body

    def in_flight(self, lease_left: Optional[float] = None) -> Tuple[int, Headers, bytes]:
        """409; Retry-After: the seconds left of the holder's lease when
        the server named it (at least 1), else ``retry_after``."""
        after = self.retry_after
        if lease_left is not None:
            after = max(1, math.ceil(lease_left))
        return problem(409, "request in flight",
                       "a request with this key is being processed; retry later",
                       [("retry-after", str(after))])

    def conflict(self) -> Tuple[int, Headers, bytes]:
        return problem(422, "Idempotency-Key reused", "this key was used with a different request")

    def expired(self) -> Tuple[int, Headers, bytes]:
        """410: the request was executed and completed once; its stored
        response is gone (a server with tombstones); it is not run again."""
        return problem(410, "response expired",
                       "a request with this key was processed and completed; its response is "
                       "no longer kept, and the request is not run again")

    def store_state(self, result: Any, log: logging.Logger) -> None:
        """Log an unavailable store once, with its cause, when requests
        start failing on it, not for every request answered 503 meanwhile;
        once a request reaches it again, the next failure is logged again
        (the Node middleware alike)."""
        if result.outcome.name != "UNAVAILABLE":
            self._store_down = False
            return
        if self._store_down or refused_key(result.error) is not None:
            return
        self._store_down = True
        err = result.error
        state = getattr(err, "sqlstate", None)
        cause = ("%s: %s" % (state, err) if state else str(err)) if err is not None \
            else "no cause given"
        log.warning("idempotency store unavailable (%s); requests with a key are answered "
                    "503 until it answers again, which is not logged for each one", cause)

    def unavailable(self) -> Tuple[int, Headers, bytes]:
        return problem(503, "idempotency store unavailable",
                       "the request was not processed; retry later",
                       [("retry-after", str(self.retry_after))])


def lifetime(window: float) -> str:
    """The window as Idempotency-Key-Lifetime's whole seconds (rounded
    down: a client that keeps within it is within the window)."""
    return str(int(math.floor(window)))


class NotStored(Exception):
    """Raised from the guard's handler so that a response is sent but the
    claim released (a status the policy does not store: 401, 403, 407,
    408, 425, 429, 5xx)."""

    def __init__(self, response):
        super().__init__("server error response released for retry")
        self.response = response


def twice(timeout):
    """The claim's statement_timeout in transactional mode: its lock_timeout
    (a transaction holding the key: 409) ends a wait first."""
    return None if timeout is None else 2 * timeout


class Release(Exception):
    """Ends the transaction of a response the policy does not store."""


class HandlerFailed(Exception):
    """Carries the handler's exception out of the transaction it rolls back."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error
