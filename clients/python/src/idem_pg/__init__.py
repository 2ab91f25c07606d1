"""idem_pg: Python client for the idem PostgreSQL extension.

Guard / AsyncGuard protect work outside the database with a committed
claim, a lease and a fencing token; atomic / atomic_async put the claim,
the business writes and the response in one transaction on your
connection; asgi.IdempotencyMiddleware and wsgi.IdempotencyWSGIMiddleware
implement the Idempotency-Key header.
"""

from ._common import BeginRow, Claim, FailN, Outcome, Response, Result
from .aio import AsyncGuard
from .atomic import Atomic, AsyncAtomic, atomic, atomic_async
from .errors import (AlreadyCompleted, BodyTooLarge, ClaimNotCompleted,
                     FingerprintMismatch, FunctionNotFound, IdemError,
                     InjectedFault, InvalidArgument, NoLiveClaim, Timeout, TokenSuperseded,
                     Unavailable, translate)
from .guard import Guard

__version__ = "0.1.0"

__all__ = [
    "AlreadyCompleted", "AsyncAtomic", "AsyncGuard", "Atomic", "BeginRow",
    "BodyTooLarge", "Claim", "ClaimNotCompleted", "FailN", "FingerprintMismatch",
    "FunctionNotFound", "Guard", "IdemError", "InjectedFault", "InvalidArgument", "NoLiveClaim",
    "Outcome", "Response", "Result", "Timeout", "TokenSuperseded", "Unavailable",
    "atomic", "atomic_async", "translate",
]
