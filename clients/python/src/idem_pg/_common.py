"""Types and SQL shared by the sync and async guards."""

from __future__ import annotations

import datetime as _dt
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from psycopg import sql

from .errors import InjectedFault

Seconds = Union[float, int, _dt.timedelta, None]


class Outcome(str, enum.Enum):
    """The five outcomes of the Go guard."""

    EXECUTED = "EXECUTED"        # claimed; the handler ran (see Result.failed_step)
    REPLAYED = "REPLAYED"        # completed before with this fingerprint: stored response
    IN_FLIGHT = "IN_FLIGHT"      # claimed and committed elsewhere, lease not over
    CONFLICT = "CONFLICT"        # the key was used for another fingerprint
    UNAVAILABLE = "UNAVAILABLE"  # no claim could be made; the handler did not run

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Response:
    """A status and a body (bytes; a str is stored as UTF-8)."""

    status: int
    body: bytes = b""

    def __post_init__(self) -> None:
        if isinstance(self.body, str):
            object.__setattr__(self, "body", self.body.encode("utf-8"))
        elif self.body is None:
            object.__setattr__(self, "body", b"")
        elif not isinstance(self.body, bytes):
            object.__setattr__(self, "body", bytes(self.body))


def as_response(value: Any) -> Response:
    """Accept a Response or a (status, body) pair from a handler."""
    if isinstance(value, Response):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        return Response(int(value[0]), value[1])
    raise TypeError("a handler must return idem_pg.Response or (status, body), got %r"
                    % type(value).__name__)


# The answer stored in place of a response that cannot be stored
# (doc/http.md): idem_complete stores it itself for a body over
# idem.max_body_size; a guard stores it when its complete fails for a
# reason a retry cannot fix, so that the key is never claimed again.
NOT_STORED_STATUS = 500
NOT_STORED_BODY = (b'{"type":"about:blank","title":"Response not stored","status":500,'
                   b'"detail":"The response to the first request with this key was larger '
                   b'than idem.max_body_size; it was sent then and is not replayed."}')
NOT_STORED = Response(NOT_STORED_STATUS, NOT_STORED_BODY)


@dataclass
class Result:
    """What Guard.do did.

    ``failed_step`` is None, "begin", "heartbeat", "handler" or "complete";
    ``error`` the exception of that step.  EXECUTED with failed_step
    "complete" means the handler ran but its response is not stored:
    ``not_stored`` is then True if the guard stored the fixed "Response not
    stored" answer in its place (a retry gets that 500, never a second
    execution), False if the failure was transient and the key stays
    PROCESSING until its lease ends.  IN_FLIGHT carries the holder's
    ``lease_until`` and ``lease_left``, the seconds from the server's clock
    to it (when to try again), if the server named them.  ``expires_at``:
    until when the stored response (REPLAYED, or EXECUTED and stored) is
    replayed.
    """

    outcome: Outcome
    response: Optional[Response] = None
    token: Optional[int] = None
    error: Optional[BaseException] = None
    failed_step: Optional[str] = None
    released: bool = False
    extends: int = 0
    superseded: bool = False
    lease_until: Optional[_dt.datetime] = None
    lease_left: Optional[float] = None
    expires_at: Optional[_dt.datetime] = None
    not_stored: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.outcome in (Outcome.EXECUTED, Outcome.REPLAYED)


@dataclass
class Claim:
    """Passed to the handler: pass ``key``/``token`` downstream (fencing)."""

    key: str
    fingerprint: str
    scope: str
    token: int
    _lost: Optional[threading.Event] = field(default=None, repr=False)

    @property
    def lost(self) -> bool:
        """True once the heartbeat found the claim superseded or gone."""
        return self._lost is not None and self._lost.is_set()


class FailN:
    """Fault hook: make ``op`` ("begin", "complete", "release", "extend";
    None: any) fail ``n`` times, like the Go test's store.Fault."""

    def __init__(self, op: Optional[str], n: int = 1, message: str = "store timeout",
                 sqlstate: Optional[str] = None):
        self.op = op
        self.remaining = n
        self.message = message
        self.sqlstate = sqlstate        # the server error it plays; None: a lost link
        self._lock = threading.Lock()

    def __call__(self, op: str) -> Optional[BaseException]:
        if self.op is not None and self.op != op:
            return None
        with self._lock:
            if self.remaining <= 0:
                return None
            self.remaining -= 1
        return InjectedFault("%s (fault injected at %s)" % (self.message, op),
                             sqlstate=self.sqlstate)


def fault_error(fault: Optional[Callable[[str], Any]], op: str) -> Optional[BaseException]:
    """Run the fault hook for op: an exception it returns or raises, or
    InjectedFault for a true value; None if the step may go on."""
    if fault is None:
        return None
    try:
        got = fault(op)
    except Exception as exc:  # noqa: BLE001 - the hook's own way to fail
        return exc
    if got is None or got is False:
        return None
    if isinstance(got, BaseException):
        return got
    return InjectedFault("fault injected at %s" % op)


def interval(value: Seconds) -> Optional[_dt.timedelta]:
    """Seconds or a timedelta as an interval parameter (None: server default)."""
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        return value
    return _dt.timedelta(seconds=float(value))


def seconds(value: Seconds) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        return value.total_seconds()
    return float(value)


def offset_seconds(clock_offset: Any) -> float:
    """idem.clock_offset for this call in seconds (a number, timedelta or a
    callable returning one); 0 when not moved."""
    value = clock_offset() if callable(clock_offset) else clock_offset
    return seconds(value) or 0.0


def offset_text(offset_s: float) -> Optional[str]:
    """idem.clock_offset as a setting; None when not moved."""
    if not offset_s:
        return None
    return "%d ms" % round(offset_s * 1000)


def wait_seconds(value: Seconds) -> Optional[float]:
    """A wait_for as positive seconds, or None for no wait (None or 0)."""
    s = seconds(value)
    if s is None or s == 0:
        return None
    if s < 0 or s != s:
        raise ValueError("wait_for must be a number of seconds, 0 or more, got %r" % (value,))
    return s


def check_wait(wait: bool, wait_for: Seconds) -> None:
    if not wait and wait_seconds(wait_for):
        raise ValueError("wait=False and a wait_for: a caller that never waits "
                         "for a holder cannot wait for its answer")


class Statements:
    """The SQL, schema-qualified, every parameter cast to its exact type;
    bodies go as binary bytea parameters (%b)."""

    def __init__(self, schema: str = "public"):
        if not schema:
            raise ValueError("schema must not be empty")
        s = sql.Identifier(schema)
        self.schema = schema
        # The server's clock, read once idem_begin has answered, dates the
        # lease_until of an in-flight answer without trusting this host's.
        self.begin = sql.SQL(
            "SELECT claimed, state, token, status, body, lease_until, expires_at,"
            " pg_catalog.clock_timestamp() FROM {}.idem_begin("
            "%s::text, %s::text, %s::interval, %s::interval, %s::text, %s::boolean)"
        ).format(s)
        # Only when the caller asks for a wait: an extension older than
        # idem_begin's wait_for still answers six arguments.
        self.begin_wait = sql.SQL(
            "SELECT claimed, state, token, status, body, lease_until, expires_at,"
            " pg_catalog.clock_timestamp() FROM {}.idem_begin("
            "%s::text, %s::text, %s::interval, %s::interval, %s::text, %s::boolean,"
            " %s::interval)"
        ).format(s)
        self.complete = sql.SQL(
            "SELECT {}.idem_complete(%s::text, %s::text, %s::integer, %b::bytea, "
            "%s::bigint, %s::interval, %s::text)"
        ).format(s)
        self.release = sql.SQL(
            "SELECT {}.idem_release(%s::text, %s::bigint, %s::text)").format(s)
        self.extend = sql.SQL(
            "SELECT {}.idem_extend(%s::text, %s::bigint, %s::interval, %s::text)").format(s)
        # What a call of each step names when the server has no such function.
        self.functions = {"begin": "idem_begin", "complete": "idem_complete",
                          "release": "idem_release", "extend": "idem_extend",
                          "lookup": "idem_lookup"}
        self.lookup = sql.SQL(
            "SELECT state, token, status, lease_until, expires_at, body_size"
            " FROM {}.idem_lookup(%s::text, %s::text)").format(s)

    @staticmethod
    def prelude(timeout_s: Optional[float], clock: Optional[str]):
        """The SET LOCALs that go before a guard statement, or None."""
        parts, args = [], []
        if timeout_s:
            parts.append("pg_catalog.set_config('statement_timeout', %s::text, true)")
            args.append("%d" % max(1, round(timeout_s * 1000)))
        if clock:
            parts.append("pg_catalog.set_config('idem.clock_offset', %s::text, true)")
            args.append(clock)
        if not parts:
            return None
        return sql.SQL("SELECT " + ", ".join(parts)), args


@dataclass(frozen=True)
class BeginRow:
    """The row idem_begin answered.  ``lease_left``: seconds from the
    server's clock (idem.clock_offset included) to ``lease_until``."""

    claimed: bool
    state: str
    token: Optional[int]
    status: Optional[int]
    body: Optional[bytes]
    lease_until: Optional[_dt.datetime] = None
    expires_at: Optional[_dt.datetime] = None
    lease_left: Optional[float] = None

    @classmethod
    def of(cls, row, offset_s: float = 0.0) -> "BeginRow":
        claimed, state, token, status, body = row[:5]
        lease_until = row[5] if len(row) > 5 else None
        expires_at = row[6] if len(row) > 6 else None
        now = row[7] if len(row) > 7 else None
        if body is not None and not isinstance(body, bytes):
            body = bytes(body)
        left = None
        if lease_until is not None and now is not None:
            left = (lease_until - now).total_seconds() - offset_s
        return cls(bool(claimed), state, token, status, body, lease_until, expires_at, left)

    def outcome(self) -> Outcome:
        if self.claimed:
            return Outcome.EXECUTED
        if self.state == "DONE":
            return Outcome.REPLAYED
        if self.state == "CONFLICT":
            return Outcome.CONFLICT
        return Outcome.IN_FLIGHT

    def response(self) -> Optional[Response]:
        if self.state != "DONE" or self.claimed:
            return None
        return Response(self.status if self.status is not None else 0, self.body or b"")
