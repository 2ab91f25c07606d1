"""idem_pg: Python client for the idem PostgreSQL extension.

Guard / AsyncGuard protect work outside the database with a committed
claim, a lease and a fencing token; atomic / atomic_async put the claim,
the business writes and the response in one transaction on your
connection (run again after 40001 or 40P01 with retries=N);
asgi.IdempotencyMiddleware and wsgi.IdempotencyWSGIMiddleware implement
the Idempotency-Key header.  Guard.do_many, AsyncGuard.do_many and
atomic_many / atomic_many_async claim a batch of keys in one call;
idem_pg.inbox runs a batch of broker messages in one transaction.  A guard's handler can divide its
work into steps (claim.step, claim.step_tx) that a takeover resumes after
the last one checkpointed.
"""

from ._common import AsyncClaim, BeginRow, Claim, FailN, Outcome, Response, Result, Step
from .aio import AsyncGuard
from .atomic import (AsyncAtomic, AsyncAtomicBlock, AsyncAttempt, Atomic, AtomicBlock, Attempt,
                     atomic, atomic_async, atomic_many, atomic_many_async)
from .errors import (AlreadyCompleted, BodyTooLarge, CheckpointUnreadable, ClaimNotCompleted,
                     FingerprintMismatch, FunctionNotFound, IdemError,
                     InjectedFault, InvalidArgument, NoLiveClaim, Timeout, TokenSuperseded,
                     Unavailable, retry_transaction, translate)
from .guard import Guard
from . import inbox  # noqa: E402 - idem_pg.inbox

__version__ = "0.1.0"

__all__ = [
    "AlreadyCompleted", "AsyncAtomic", "AsyncAtomicBlock", "AsyncAttempt", "AsyncClaim",
    "AsyncGuard", "Atomic", "AtomicBlock", "Attempt", "BeginRow",
    "BodyTooLarge", "CheckpointUnreadable", "Claim", "ClaimNotCompleted", "FailN",
    "FingerprintMismatch", "FunctionNotFound", "Guard", "IdemError", "InjectedFault", "InvalidArgument", "NoLiveClaim",
    "Outcome", "Response", "Result", "Step", "Timeout", "TokenSuperseded", "Unavailable",
    "atomic", "atomic_async", "atomic_many", "inbox", "atomic_many_async", "retry_transaction",
    "translate",
]
