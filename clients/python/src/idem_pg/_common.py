"""Types and SQL shared by the sync and async guards."""

from __future__ import annotations

import datetime as _dt
import enum
import functools
import inspect
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

from .errors import CheckpointUnreadable, InjectedFault, InvalidArgument, Unavailable

Seconds = Union[float, int, _dt.timedelta, None]


class Outcome(str, enum.Enum):
    """The outcomes of the Go guard: its five, and EXPIRED (a server with
    tombstones, idem_begin's ``remember``)."""

    EXECUTED = "EXECUTED"        # claimed; the handler ran (see Result.failed_step)
    REPLAYED = "REPLAYED"        # completed before with this fingerprint: stored response
    IN_FLIGHT = "IN_FLIGHT"      # claimed and committed elsewhere, lease not over
    CONFLICT = "CONFLICT"        # the key was used for another fingerprint
    UNAVAILABLE = "UNAVAILABLE"  # no claim could be made; the handler did not run
    EXPIRED = "EXPIRED"          # executed and completed once, response no longer kept

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
    replayed.  EXPIRED (a server with tombstones: idem_begin's
    ``remember``): the request was executed and completed once, its
    response's retention is over but the key is still remembered; the
    handler does not run, ``response`` is None and ``status`` is the
    status the first response had.

    In a batch (do_many, atomic_many), ``duplicate_of`` is the position
    (from 0) of an item's first occurrence when its key came earlier in
    the same batch, else None: with the same fingerprint the item gets a
    copy of that occurrence's Result (its handler does not run again),
    with another one CONFLICT.
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
    status: Optional[int] = None
    duplicate_of: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.outcome in (Outcome.EXECUTED, Outcome.REPLAYED)


@dataclass(frozen=True)
class Step:
    """What a step's function gets: the claim's ``key``, ``scope`` and
    fencing ``token``, and the step's ``name``.

    Pass ``token`` to a downstream that fences (it refuses a token lower
    than one it has seen), and ``idempotency_key`` to a provider that
    deduplicates (a payment API): it is the same in every attempt of the
    step, a takeover's included, so a charge made by a holder that crashed
    before its checkpoint is not made twice when the step runs again.
    Never build a provider key from the token: it changes on a takeover."""

    name: str
    key: str
    scope: str
    token: int

    @property
    def idempotency_key(self) -> str:
        """``key:name``, or ``scope:key:name`` in a scope."""
        if self.scope:
            return "%s:%s:%s" % (self.scope, self.key, self.name)
        return "%s:%s" % (self.key, self.name)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class StepLog:
    """The steps of one claim: the outputs restored from the previous
    holder's checkpoint (phase, phase_data) and those finished since.

    phase_data is a UTF-8 JSON object whose members are the finished steps
    in the order they finished, each with its output, and phase names the
    last one: {"reserve":{"hold":"h-1"},"charge":"ch_1"}.  Every checkpoint
    carries the whole object.  The Go, Node and C guards write and read the
    same format.  A step whose name is in it is skipped."""

    def __init__(self, phase: Optional[str] = None, data: Optional[bytes] = None):
        self.resumed_from = phase
        self.unreadable: Optional[str] = None
        self.outputs: Dict[str, Any] = {}
        if phase is not None:
            decoded: Any = None
            if data is None:
                self.unreadable = "no data"
            else:
                try:
                    decoded = json.loads(bytes(data).decode("utf-8"))
                except ValueError as exc:
                    self.unreadable = str(exc)
            if self.unreadable is None:
                if not isinstance(decoded, dict):
                    self.unreadable = "not a JSON object"
                elif phase not in decoded:
                    self.unreadable = "no member %r for its phase" % phase
                else:
                    self.outputs = decoded
        self.skipped: list = []
        self.ran: list = []

    def start(self, key: str, name: str) -> Tuple[bool, Any]:
        """(True, stored output) to skip the step, because it finished (in
        a previous holder's claim or in this one); (False, None) to run it."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument("a step needs a name (a non-empty str), got %r" % (name,))
        if self.unreadable is not None:
            raise CheckpointUnreadable(
                "the recovery point of key %r (phase %r) was not written by steps (%s): "
                "they cannot tell which work finished" % (key, self.resumed_from,
                                                          self.unreadable))
        if name in self.outputs:
            self.skipped.append(name)
            return True, self.outputs[name]
        return False, None

    def encode(self, name: str, output: Any) -> Tuple[bytes, Any]:
        """(phase_data with this step's output, the output as a skipped
        step would return it: through JSON and back)."""
        try:
            text = _json(output)
        except (TypeError, ValueError) as exc:
            raise TypeError("the output of step %r cannot be checkpointed: it must be "
                            "JSON-serializable (%s)" % (name, exc)) from exc
        value = json.loads(text)
        outputs = dict(self.outputs)
        outputs[name] = value
        return _json(outputs).encode("utf-8"), value

    def done(self, name: str, value: Any) -> None:
        self.outputs[name] = value
        self.ran.append(name)

    @property
    def checkpointed(self) -> bool:
        """True if the key holds a checkpoint (restored or made)."""
        return bool(self.outputs) or self.resumed_from is not None


@dataclass
class Claim:
    """Passed to the handler: pass ``key``/``token`` downstream (fencing).

    ``step(name, fn)`` and ``step_tx(name, fn)`` divide the work into
    steps that a takeover resumes after the last one checkpointed
    (README "Multi-step work"); ``phase`` is that last step when this
    claim took over from a holder that checkpointed, else None."""

    key: str
    fingerprint: str
    scope: str
    token: int
    _lost: Optional[threading.Event] = field(default=None, repr=False)
    phase: Optional[str] = None
    _steps: StepLog = field(default_factory=StepLog, repr=False)
    _guard: Any = field(default=None, repr=False)

    @property
    def lost(self) -> bool:
        """True once the heartbeat found the claim superseded or gone."""
        return self._lost is not None and self._lost.is_set()

    @property
    def outputs(self) -> Dict[str, Any]:
        """The output of every step finished so far, restored ones included."""
        return dict(self._steps.outputs)

    @property
    def skipped(self) -> list:
        """The steps skipped so far (they had finished), in order."""
        return list(self._steps.skipped)

    def _step_arg(self, name: str) -> Step:
        return Step(name, self.key, self.scope, self.token)

    def _runner(self) -> Any:
        if self._guard is None:
            raise RuntimeError("steps need a claim made by Guard.do or AsyncGuard.do")
        return self._guard

    def step(self, name: str, fn: Callable[[Step], Any]) -> Any:
        """Run ``fn(Step)`` unless a previous holder checkpointed ``name``,
        then checkpoint its output (idem_checkpoint, its own transaction);
        returns the output (as JSON gives it back), the stored one when
        skipped."""
        runner = self._runner()
        skip, out = self._steps.start(self.key, name)
        if skip:
            return out
        data, value = self._steps.encode(name, fn(self._step_arg(name)))
        runner.checkpoint(self.key, self.token, name, data, scope=self.scope)
        self._steps.done(name, value)
        return value

    def step_tx(self, name: str, fn: Callable[[Any], Any], conn: Any = None) -> Any:
        """As step(), but ``fn(conn)`` runs in a transaction that first holds
        the key (idem_hold: TokenSuperseded before any write of a stale
        holder) and commits fn's writes with the step's checkpoint.
        ``conn``: a psycopg.Connection (in a transaction already: a
        savepoint, and the caller commits); None: one of the guard's."""
        runner = self._runner()
        skip, out = self._steps.start(self.key, name)
        if skip:
            return out
        value = runner._step_tx(self, name, fn, conn)
        self._steps.done(name, value)
        return value


class AsyncClaim(Claim):
    """The claim an AsyncGuard handler gets: ``step`` and ``step_tx`` are
    coroutines; a step's function may be sync or async."""

    async def step(self, name: str, fn: Callable[[Step], Any]) -> Any:  # type: ignore[override]
        runner = self._runner()
        skip, out = self._steps.start(self.key, name)
        if skip:
            return out
        output = fn(self._step_arg(name))
        if inspect.isawaitable(output):
            output = await output
        data, value = self._steps.encode(name, output)
        await runner.checkpoint(self.key, self.token, name, data, scope=self.scope)
        self._steps.done(name, value)
        return value

    async def step_tx(self, name: str, fn: Callable[[Any], Any],  # type: ignore[override]
                      conn: Any = None) -> Any:
        runner = self._runner()
        skip, out = self._steps.start(self.key, name)
        if skip:
            return out
        value = await runner._step_tx(self, name, fn, conn)
        self._steps.done(name, value)
        return value


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


def _render(template: str, schema: str) -> str:
    """``template`` with ``{}`` replaced by the quoted ``schema``."""
    return template.replace("{}", schema)


class Statements:
    """The SQL, schema-qualified, every parameter cast to its exact type;
    bodies go as binary bytea parameters (%b)."""

    def __init__(self, schema: str = "public"):
        if not schema:
            raise ValueError("schema must not be empty")
        # Rendered once, as text: a Composed is rendered again (the
        # identifier escaped through libpq) on every execute.  A % in the
        # name is doubled, as psycopg reads the text for placeholders.
        s = '"' + schema.replace('"', '""').replace("%", "%%") + '"'
        self.schema = schema
        # The server's clock, read once idem_begin has answered, dates the
        # lease_until of an in-flight answer without trusting this host's.
        # The guards also read phase and phase_data (1.4: the checkpoint a
        # takeover resumes from); the plain forms serve atomic() and servers
        # without those columns.
        cols = ("SELECT claimed, state, token, status, body, lease_until, expires_at,"
                " pg_catalog.clock_timestamp()")
        # atomic(): the dates matter only to an answer that claimed nothing
        # (the block's complete() returns the expiry of a claim); NULLs cost
        # the client no decoding.
        acols = ("SELECT claimed, state, token, status, body,"
                 " CASE WHEN NOT claimed THEN lease_until END,"
                 " CASE WHEN NOT claimed THEN expires_at END,"
                 " CASE WHEN NOT claimed THEN pg_catalog.clock_timestamp() END")
        # The wait_for argument only when the caller asks for a wait: an
        # extension older than idem_begin's wait_for answers six arguments.
        args6 = "%s::text, %s::text, %s::interval, %s::interval, %s::text, %s::boolean"

        def begin(columns: str, wait: bool) -> str:
            return _render(columns + " FROM {}.idem_begin(" + args6
                           + (", %s::interval)" if wait else ")"), s)

        self.begin = begin(cols, False)
        self.begin_wait = begin(cols, True)
        self.begin_phase = begin(cols + ", phase, phase_data", False)
        self.begin_wait_phase = begin(cols + ", phase, phase_data", True)
        self.begin_atomic = begin(acols, False)
        self.begin_wait_atomic = begin(acols, True)
        # atomic() with every default: the arguments left to the server's
        # defaults are not sent (each costs psycopg a dumper per call).
        self.begin_atomic_defaults = _render(
            acols + " FROM {}.idem_begin(%s::text, %s::text)", s)
        self.checkpoint = _render(
            "SELECT {}.idem_checkpoint(%s::text, %s::bigint, %s::text, %b::bytea, %s::text)",
            s)
        self.hold = _render(
            "SELECT {}.idem_hold(%s::text, %s::bigint, %s::text)", s)
        self.complete = _render(
            "SELECT {}.idem_complete(%s::text, %s::text, %s::integer, %b::bytea, "
            "%s::bigint, %s::interval, %s::text)", s)
        # Without a token, in the scope '' and with the default retention.
        self.complete_defaults = _render(
            "SELECT {}.idem_complete(%s::text, %s::text, %s::integer, %b::bytea)", s)
        self.release = _render(
            "SELECT {}.idem_release(%s::text, %s::bigint, %s::text)", s)
        self.extend = _render(
            "SELECT {}.idem_extend(%s::text, %s::bigint, %s::interval, %s::text)", s)
        # What a call of each step names when the server has no such function.
        self.functions = {"begin": "idem_begin", "complete": "idem_complete",
                          "release": "idem_release", "extend": "idem_extend",
                          "lookup": "idem_lookup", "checkpoint": "idem_checkpoint",
                          "hold": "idem_hold", "begin_many": "idem_begin_many",
                          "complete_many": "idem_complete_many"}
        self.lookup = _render(
            "SELECT state, token, status, lease_until, expires_at, body_size"
            " FROM {}.idem_lookup(%s::text, %s::text)", s)

    @staticmethod
    def with_remember(query: str, remember: Any) -> str:
        """``query`` (an idem_begin call, its last character the call's
        closing parenthesis) with ``remember => %s::interval`` added when
        ``remember`` is set: named, and only then, so that a server without
        the argument answers the calls that do not use it."""
        if remember is None:
            return query
        return query[:-1] + ", remember => %s::interval)"

    def begin_query(self, wait: bool, phase: bool) -> str:
        if wait:
            return self.begin_wait_phase if phase else self.begin_wait
        return self.begin_phase if phase else self.begin

    @staticmethod
    def opening(begin: bool, timeout_s: Optional[float], offset_s: float) -> Optional[str]:
        """What goes before a guard statement as one message of the simple
        protocol, one round trip: BEGIN (``begin``: on an autocommit
        connection) and the SET LOCALs of the call's timeout and clock
        offset; None when there is nothing to set and the statement runs
        on its own.  The values are numbers this client writes, so they go
        in as literals."""
        parts = []
        if timeout_s:
            # the session's own statement_timeout where it is shorter
            parts.append("pg_catalog.set_config('statement_timeout', CASE WHEN s.st = '0'"
                         " OR s.st::pg_catalog.interval > '{0}ms'::pg_catalog.interval"
                         " THEN '{0}ms' ELSE s.st END, true)"
                         .format(max(1, round(timeout_s * 1000))))
        if offset_s:
            parts.append("pg_catalog.set_config('idem.clock_offset', '%d ms', true)"
                         % round(offset_s * 1000))
        if not parts:
            return None
        sets = ("SELECT " + ", ".join(parts) + " FROM (SELECT"
                " pg_catalog.current_setting('statement_timeout') AS st) s")
        return "BEGIN; " + sets if begin else sets


# The call's settings, each SET LOCAL (set_config(..., true)), as one
# statement with parameters: the statement_timeout (the session's own where
# it is shorter), the clock offset, or both.
_SET_TIMEOUT = ("pg_catalog.set_config('statement_timeout', CASE WHEN s.st = '0'"
                " OR s.st::pg_catalog.interval > %s::pg_catalog.interval"
                " THEN %s::text ELSE s.st END, true)")
_SET_OFFSET = "pg_catalog.set_config('idem.clock_offset', %s::text, true)"
_SETTINGS = {
    (t, o): "SELECT " + ", ".join(([_SET_TIMEOUT] if t else []) + ([_SET_OFFSET] if o else []))
    + " FROM (SELECT pg_catalog.current_setting('statement_timeout') AS st) s"
    for t in (False, True) for o in (False, True) if t or o}


def settings(timeout_s: Optional[float], offset_s: float) -> Optional[Tuple[str, list]]:
    """The SET LOCALs of a guard call (its statement_timeout, its
    idem.clock_offset) as one statement and its parameters, for the
    pipeline that sends BEGIN, it, the call's statement and COMMIT
    together; None when there is nothing to set."""
    if not timeout_s and not offset_s:
        return None
    params: list = []
    if timeout_s:
        ms_ = "%dms" % max(1, round(timeout_s * 1000))
        params += [ms_, ms_]
    if offset_s:
        params.append("%d ms" % round(offset_s * 1000))
    return _SETTINGS[(bool(timeout_s), bool(offset_s))], params


def text(value: Any) -> Any:
    """A text column as str.  In a SQL_ASCII database psycopg hands every
    text value over as bytes, since it cannot know their encoding; the
    values this client reads are idem's own (ASCII), settings, and phase
    names that a client sent as UTF-8.  Undecodable bytes are kept as
    surrogates, so a value sent back compares equal."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "surrogateescape")
    return value


@dataclass(frozen=True)
class BeginRow:
    """The row idem_begin answered.  ``lease_left``: seconds from the
    server's clock (idem.clock_offset included) to ``lease_until``.
    ``phase``/``phase_data``: on a takeover, the previous holder's last
    checkpoint (None otherwise, and from servers before 1.4)."""

    claimed: bool
    state: str
    token: Optional[int]
    status: Optional[int]
    body: Optional[bytes]
    lease_until: Optional[_dt.datetime] = None
    expires_at: Optional[_dt.datetime] = None
    lease_left: Optional[float] = None
    phase: Optional[str] = None
    phase_data: Optional[bytes] = None

    @classmethod
    def of(cls, row, offset_s: float = 0.0) -> "BeginRow":
        claimed, state, token, status, body = row[:5]
        state = text(state)
        lease_until = row[5] if len(row) > 5 else None
        expires_at = row[6] if len(row) > 6 else None
        now = row[7] if len(row) > 7 else None
        phase = text(row[8]) if len(row) > 8 else None
        phase_data = row[9] if len(row) > 9 else None
        if body is not None and not isinstance(body, bytes):
            body = bytes(body)
        if phase_data is not None and not isinstance(phase_data, bytes):
            phase_data = bytes(phase_data)
        left = None
        if lease_until is not None and now is not None:
            left = (lease_until - now).total_seconds() - offset_s
        return cls(bool(claimed), state, token, status, body, lease_until, expires_at, left,
                   phase, phase_data)

    def outcome(self) -> Outcome:
        if self.claimed:
            return Outcome.EXECUTED
        if self.state == "DONE":
            return Outcome.REPLAYED
        if self.state == "CONFLICT":
            return Outcome.CONFLICT
        if self.state == "PROCESSING":
            return Outcome.IN_FLIGHT
        if self.state == "EXPIRED":
            return Outcome.EXPIRED
        # Not a guess: IN_FLIGHT would turn a stored answer into a 409
        # forever, and EXECUTED would run the handler again.
        raise Unavailable("idem_begin answered an unknown state %r" % (self.state,))

    def response(self) -> Optional[Response]:
        if self.state != "DONE" or self.claimed:
            return None
        return Response(self.status if self.status is not None else 0, self.body or b"")


@functools.lru_cache(maxsize=64)
def statements(schema: str = "public") -> Statements:
    """The Statements of ``schema``, composed once per process: atomic()
    runs on every request, and composing them costs more client CPU than
    the claim's round trip."""
    return Statements(schema)


# Bounds for one statement inside a caller's transaction (SET LOCAL; NULL:
# keep that one), then the values from before.
SET_BOUNDS = ("SELECT pg_catalog.current_setting('lock_timeout'),"
              " pg_catalog.current_setting('statement_timeout'),"
              " pg_catalog.set_config('lock_timeout', coalesce(%s::text,"
              " pg_catalog.current_setting('lock_timeout')), true),"
              " pg_catalog.set_config('statement_timeout', coalesce(%s::text,"
              " pg_catalog.current_setting('statement_timeout')), true)")
RESTORE = ("SELECT pg_catalog.set_config('lock_timeout', %s::text, true),"
           " pg_catalog.set_config('statement_timeout', %s::text, true)")
SET_CLOCK = "SELECT pg_catalog.set_config('idem.clock_offset', %s::text, true)"


def saved_bounds(row: Any) -> list:
    """RESTORE's parameters from SET_BOUNDS's row: the two settings as str
    (bytes would be sent as bytea, and set as its hex form)."""
    return [text(row[0]), text(row[1])]


def ms(value: Seconds) -> str:
    return "%d" % max(1, round((seconds(value) or 0.0) * 1000))


def bounds(lock_timeout: Optional[float], statement_timeout: Optional[float]):
    """The parameters of SET_BOUNDS, or None to leave the session's."""
    if lock_timeout is None and statement_timeout is None:
        return None
    return [ms(lock_timeout) if lock_timeout is not None else None,
            ms(statement_timeout) if statement_timeout is not None else None]


class _Support:
    """Whether the server lacked a feature lately (an SQLSTATE in
    ``states`` answered a call that used it): for ``retry`` seconds the
    guard calls without it, then tries it again."""

    def __init__(self, states: Tuple[str, ...], warning: str, retry: float = 60.0):
        self.states = states
        self.warning = warning
        self.retry = retry
        self.until = 0.0

    def usable(self) -> bool:
        return time.monotonic() >= self.until

    def refused(self, exc: BaseException, log: Any) -> bool:
        state = getattr(exc, "sqlstate", None)
        if state not in self.states:
            return False
        if self.usable():
            log.warning(self.warning + " (%s: %s)", state, str(exc).strip())
        self.until = time.monotonic() + self.retry
        return True
