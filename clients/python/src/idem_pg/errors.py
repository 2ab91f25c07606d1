"""Exceptions named for idem's SQLSTATEs.

Every exception the library raises for a server answer is an IdemError;
the driver's error it came from (psycopg's or asyncpg's) is its ``__cause__``.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import psycopg

from ._drivers import asyncpg_error

try:  # the pool is optional
    from psycopg_pool import PoolTimeout, PoolClosed
except ImportError:  # pragma: no cover
    PoolTimeout = PoolClosed = ()  # type: ignore[assignment,misc]


class IdemError(Exception):
    """Base class; ``sqlstate`` is the server's code, or None."""

    sqlstate: Optional[str] = None

    def __init__(self, message: str = "", sqlstate: Optional[str] = None):
        super().__init__(message)
        if sqlstate is not None:
            self.sqlstate = sqlstate


class FingerprintMismatch(IdemError):
    """ID001: idem_complete with a fingerprint other than the claim's."""

    sqlstate = "ID001"


class TokenSuperseded(IdemError):
    """ID002: another caller took the key over after the lease."""

    sqlstate = "ID002"


class NoLiveClaim(IdemError):
    """ID003: the key is missing or expired, or a NULL token outside the claiming transaction."""

    sqlstate = "ID003"


class AlreadyCompleted(IdemError):
    """ID004: completed already (another response), or release/extend of a completed key."""

    sqlstate = "ID004"


class Unavailable(IdemError):
    """The store cannot answer: connection refused or lost, read-only server
    (25006), shutdown, pool exhausted.  A guard never runs the handler then."""


class Timeout(Unavailable):
    """A wait ended by a timeout: statement_timeout or a cancel (57014),
    lock_timeout (55P03), or the client-side deadline."""


class InvalidArgument(IdemError, ValueError):
    """22004, 22023, 22001: NULL, empty or too long key, bad lease or retention."""


class BodyTooLarge(InvalidArgument):
    """54000: the body is larger than idem.max_body_size."""

    sqlstate = "54000"


class ClaimNotCompleted(IdemError, RuntimeError):
    """The one-transaction helper's block claimed the key but did not call complete()."""


class CheckpointUnreadable(IdemError):
    """A takeover found a checkpoint (phase_data) that is not the JSON
    object of step outputs the guards store: its steps cannot be resumed."""


class InjectedFault(IdemError):
    """Raised by a fault hook (tests and drills), like the Go store's Fault;
    ``sqlstate`` is the code it plays (None: a lost connection)."""


class FunctionNotFound(IdemError):
    """42883 or 3F000: an idem function (or its schema) is not where the
    client looked; the message names both and the ``schema=`` option."""


_BY_STATE = {
    "ID001": FingerprintMismatch,
    "ID002": TokenSuperseded,
    "ID003": NoLiveClaim,
    "ID004": AlreadyCompleted,
    "25006": Unavailable,       # read_only_sql_transaction: a standby or read-only server
    "57014": Timeout,           # query_canceled: statement_timeout or a cancel request
    "55P03": Timeout,           # lock_not_available: lock_timeout
    "22004": InvalidArgument,
    "22023": InvalidArgument,
    "22001": InvalidArgument,
    "54000": BodyTooLarge,
}

CLAIM_GONE = (TokenSuperseded, NoLiveClaim, AlreadyCompleted)


# Failures of idem_complete that a retry of the same call may get past, or
# where the key is no longer this caller's: the guard does not store the
# "Response not stored" answer in their place.
_TRANSIENT_STATES = frozenset(("40001", "40P01", "55P03", "57014", "57P01", "57P02",
                               "57P03", "ID002", "ID003", "42501"))
_TRANSIENT_CLASSES = ("08", "53")


def transient(exc: BaseException) -> bool:
    """True if ``exc`` (raised by a call such as idem_complete) may not
    happen again, or says the key is not the caller's any more: a lost
    connection, a serialization failure, a deadlock, a timeout, a shutdown,
    a lack of resources, a superseded or missing claim, no privilege.  An
    error with no SQLSTATE (the connection, a pool) counts as transient."""
    state = getattr(exc, "sqlstate", None)
    if state is None:
        cause = exc.__cause__
        state = getattr(cause, "sqlstate", None) if cause is not None else None
    if state is None:
        return True
    return state in _TRANSIENT_STATES or state[:2] in _TRANSIENT_CLASSES


# The SQLSTATEs after which PostgreSQL (and Citus) ask for the whole
# transaction to run again: serialization_failure, deadlock_detected.
RETRY_STATES = frozenset(("40001", "40P01"))


def retry_transaction(exc: BaseException) -> bool:
    """True if ``exc`` is a serialization failure (40001) or a deadlock
    (40P01), itself or as its ``__cause__``: the server rolled the
    transaction back and asks for it to run again."""
    state = getattr(exc, "sqlstate", None)
    if state is None and exc.__cause__ is not None:
        state = getattr(exc.__cause__, "sqlstate", None)
    return state in RETRY_STATES


def not_found(exc: BaseException, function: str, schema: str) -> BaseException:
    """``exc`` as FunctionNotFound when it is 42883 or 3F000, naming the
    function and the schema looked in; else ``exc``."""
    state = getattr(exc, "sqlstate", None)
    if state not in ("42883", "3F000") or isinstance(exc, FunctionNotFound):
        return exc
    first = (str(exc).strip().splitlines() or [state])[0]
    err = FunctionNotFound("%s not found in schema %s (%s: %s); %s"
                           % (function, quote_ident(schema), state, first, WHAT_TO_DO),
                           sqlstate=state)
    err.__cause__ = exc
    return err


# What fixes a missing idem function: the schema option, or an update.
WHAT_TO_DO = ("set schema= (of the guard, atomic() or the middleware's guard) to the "
              "schema where CREATE EXTENSION idem put it, or if the version is old "
              "run ALTER EXTENSION idem UPDATE")


def quote_ident(name: str) -> str:
    """``name`` in double quotes, as PostgreSQL's messages name a schema."""
    return '"' + name.replace('"', '""') + '"'


def translate(exc: BaseException) -> BaseException:
    """Map a driver (psycopg, asyncpg), pool or socket error to an IdemError
    (others unchanged)."""
    if isinstance(exc, IdemError):
        return exc
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        message = (exc.diag.message_primary if state else None) or str(exc).strip()
        cls = _BY_STATE.get(state or "")
        if cls is None:
            if state is None or state[:2] in ("08", "57", "53", "58", "3D", "28"):
                # no answer at all (connection), shutdown, resources, no database, auth
                cls = Unavailable
            else:
                return exc
        err = cls(message or cls.__name__, sqlstate=state)
        err.__cause__ = exc
        return err
    pg = asyncpg_error(exc)
    if pg is not None:
        state, message = pg
        cls = _BY_STATE.get(state or "")
        if cls is None:
            if state is None or state[:2] in ("08", "57", "53", "58", "3D", "28"):
                cls = Unavailable
            else:
                return exc
        err = cls(message or cls.__name__, sqlstate=state)
        err.__cause__ = exc
        return err
    if PoolTimeout and isinstance(exc, (PoolTimeout, PoolClosed)):  # type: ignore[truthy-function]
        err = Unavailable(str(exc) or "connection pool timeout")
        err.__cause__ = exc
        return err
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        err = Timeout(str(exc) or "timed out")
        err.__cause__ = exc
        return err
    if isinstance(exc, OSError):
        err = Unavailable(str(exc))
        err.__cause__ = exc
        return err
    return exc
