"""An inbox for message consumers: each batch of delivered messages in
one transaction with the handlers' business writes.

    deliveries = idem_pg.inbox.process_batch(conn, "orders", messages, handle)
    for m, d in zip(messages, deliveries):
        if d.ack:
            channel.basic_ack(m.body.delivery_tag)    # after the COMMIT

``process_batch`` claims every message id with one idem_begin_many call
(scope = the queue), runs ``handle(conn, message)`` for each new message
inside a savepoint of its own, stores the outcomes (idem_complete_many)
and commits, all before it returns, so before the consumer acks anything
(atomic_many).  A message redelivered after its transaction committed is
acked without running again; one whose transaction did not commit (the
consumer died before the COMMIT) left nothing behind and runs again.  So
a handler's writes on ``conn`` happen once per message id, wherever the
consumer dies: between the handler and the COMMIT, the writes roll back
with the claim; between the COMMIT and the ack, the redelivery is
answered from the stored claim.

A handler that raises rolls back its own savepoint (its writes and its
claim): that message is not acked and comes back; the others commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, List, Optional, Sequence

from ._common import Outcome, Response, Seconds
from .atomic import atomic_many, atomic_many_async

# The fingerprint of a message that has none: its id alone tells two
# messages apart.
MESSAGE_FINGERPRINT = "message"

_DONE = Response(200, b"")


@dataclass(frozen=True)
class Message:
    """A delivered message: ``id``, the producer's message id (the same on
    every redelivery); ``body``, anything the handler needs (the broker's
    delivery, say); ``fingerprint``, optionally, of its content (a message
    id reused with another fingerprint is refused, CONFLICT)."""

    id: str
    body: Any = None
    fingerprint: str = ""


@dataclass
class Delivery:
    """What process_batch did with one message.

    ``ack``: acknowledge it to the broker (after process_batch returned):
    its effects are committed, now (EXECUTED) or by an earlier delivery
    (REPLAYED; EXPIRED on a server with tombstones).  A message not to be
    acked (its handler raised: ``error``; in flight in another consumer;
    its id came with another fingerprint, CONFLICT) must be left to come
    back: nack it with requeue, or leave it pending.  ``duplicate_of``:
    the position of the same id earlier in the batch, whose answer this
    one shares."""

    message: Message
    outcome: Outcome
    ack: bool
    error: Optional[BaseException] = None
    duplicate_of: Optional[int] = None


def _items(messages: Sequence[Message]) -> list:
    return [(m.id, m.fingerprint or MESSAGE_FINGERPRINT) for m in messages]


def _deliveries(messages: Sequence[Message], results: list) -> List[Delivery]:
    out = []
    for m, r in zip(messages, results):
        ack = r.error is None and r.outcome in (Outcome.EXECUTED, Outcome.REPLAYED,
                                                 Outcome.EXPIRED)
        out.append(Delivery(m, r.outcome, ack, r.error, r.duplicate_of))
    return out


def process_batch(conn: Any, queue: str, messages: Sequence[Message],
                  handle: Callable[[Any, Message], Any], *, schema: str = "public",
                  retention: Seconds = None, wait_for: Seconds = None,
                  lock_timeout: Seconds = None, timeout: Seconds = None,
                  retries: int = 2,
                  before_commit: Optional[Callable[[], Any]] = None) -> List[Delivery]:
    """Run ``handle(conn, message)`` for each message of the batch that the
    queue has not seen done, in one transaction on ``conn`` (a
    psycopg.Connection, idle: the transaction commits before this
    returns); one Delivery per message, in input order.

    ``retention``: how long a message id is remembered after its
    handler committed (None: the server's idem.default_retention); make
    it longer than the broker may redeliver a message.  ``wait_for``: how
    long a message in flight in another consumer's open batch is waited
    for (its claim is committed with that batch's writes, so a concurrent
    batch waits on the row lock anyway).  ``retries``: the batch runs
    again after a serialization failure or a deadlock (40001, 40P01).
    ``before_commit``: called after the handlers, before the responses
    are stored and the transaction commits (a test's hook).  An error of
    the claim, the store or the COMMIT raises: then nothing committed
    and no message may be acked."""
    results = atomic_many(conn, _items(messages), lambda i: _run(conn, handle, messages[i]),
                          schema=schema, scope=queue, retention=retention,
                          wait_for=wait_for, lock_timeout=lock_timeout, timeout=timeout,
                          retries=retries, _before_store=before_commit)
    return _deliveries(messages, results)


def _run(conn: Any, handle: Callable[[Any, Message], Any], message: Message) -> Response:
    handle(conn, message)
    return _DONE


async def process_batch_async(conn: Any, queue: str, messages: Sequence[Message],
                              handle: Callable[[Any, Message], Awaitable[Any]], *,
                              schema: str = "public", retention: Seconds = None,
                              wait_for: Seconds = None, lock_timeout: Seconds = None,
                              timeout: Seconds = None, retries: int = 2,
                              before_commit: Optional[Callable[[], Any]] = None
                              ) -> List[Delivery]:
    """process_batch on a psycopg ``AsyncConnection`` or an asyncpg
    ``Connection``, with ``await handle(conn, message)``."""

    async def run(i: int) -> Response:
        await handle(conn, messages[i])
        return _DONE

    results = await atomic_many_async(conn, _items(messages), run, schema=schema, scope=queue,
                                      retention=retention, wait_for=wait_for,
                                      lock_timeout=lock_timeout, timeout=timeout,
                                      retries=retries, _before_store=before_commit)
    return _deliveries(messages, results)
