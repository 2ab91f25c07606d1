"""Batches: what Guard.do_many, AsyncGuard.do_many, atomic_many and
atomic_many_async share (doc/sql.md, "Batches").

A batch is a sequence of items, each a (key, fingerprint) pair, claimed
with one call of idem_begin_many (the keys' row locks taken in the
server's order, the keys sorted, so that two overlapping batches never
deadlock) and stored with one call of idem_complete_many, which releases
in the same statement the claims of the items whose handler failed.  Both
statements answer one row (arrays in input order), so that every driver's
``fetchrow`` runs them: one round trip each.

``Batch`` is the bookkeeping, without I/O: the statements and their
parameters, the per-item Result, the claims to run in input order, what
the handlers answered, and the copies for repeated keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

from ._common import (BeginRow, Outcome, Response, Result, Seconds, Statements, interval,
                      text, wait_seconds)
from .errors import InvalidArgument

Item = Tuple[str, str]

# The state of a later occurrence of a key in one batch (same fingerprint).
DUPLICATE = "DUPLICATE"

_BEGIN_MANY = (
    "SELECT pg_catalog.array_agg(b.claimed ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.state ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.token ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.status ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.body ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.lease_until ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.expires_at ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.phase ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.phase_data ORDER BY b.ordinality),"
    " pg_catalog.array_agg(b.duplicate_of ORDER BY b.ordinality),"
    " pg_catalog.clock_timestamp()"
    " FROM {}.idem_begin_many(%s::text[], %s::text[], %s::interval, %s::interval, %s::text,"
    " %s::boolean, %s::interval, %s::interval, %s::text) b")

# idem_complete_many for the items whose handler answered, idem_release for
# those whose handler failed, in one statement.
_FINISH_MANY = (
    "SELECT (SELECT pg_catalog.array_agg(c.expires_at ORDER BY c.ordinality)"
    " FROM {}.idem_complete_many(%s::text[], %s::text[], %s::integer[], %b::bytea[],"
    " %s::bigint[], %s::interval, %s::text) c),"
    " (SELECT pg_catalog.array_agg({}.idem_release(u.k, u.t, %s::text) ORDER BY u.n)"
    " FROM ROWS FROM (pg_catalog.unnest(%s::text[]), pg_catalog.unnest(%s::bigint[]))"
    " WITH ORDINALITY AS u(k, t, n))")


def _schema(st: Statements) -> str:
    return '"' + st.schema.replace('"', '""').replace("%", "%%") + '"'


def begin_many_query(st: Statements) -> str:
    return _BEGIN_MANY.replace("{}", _schema(st))


def finish_many_query(st: Statements) -> str:
    return _FINISH_MANY.replace("{}", _schema(st))


def as_items(items: Any) -> List[Item]:
    """The batch's items as (key, fingerprint) pairs of str."""
    out = []
    for n, item in enumerate(items):
        try:
            key, fingerprint = item
        except (TypeError, ValueError):
            raise InvalidArgument("item %d of the batch is not a (key, fingerprint) pair: %r"
                                  % (n, item)) from None
        out.append((key, fingerprint))
    return out


def _array(value: Any, n: int) -> list:
    return [None] * n if value is None else list(value)


class Batch:
    """One batch's statements and bookkeeping."""

    def __init__(self, st: Statements, items: Sequence[Item], *, lease: Seconds,
                 retention: Seconds, scope: str, wait: bool, wait_for: Seconds,
                 remember: Seconds, holder: Optional[str]):
        self.st = st
        self.items = list(items)
        self.scope = scope
        self.retention = retention
        self.wait_for = wait_seconds(wait_for)
        self.begin_query = begin_many_query(st)
        self.begin_params = [[k for k, _ in self.items], [f for _, f in self.items],
                             interval(lease), interval(retention), scope, wait,
                             interval(self.wait_for), interval(remember), holder]
        self.results: List[Result] = []
        self.rows: List[BeginRow] = []
        self.duplicate_of: List[Optional[int]] = []
        self.claimed: List[int] = []        # positions whose claim this batch holds
        self.answers: dict = {}             # position: Response to store
        self.failed: dict = {}              # position: the handler's exception
        self.kept: set = set()              # failed positions whose claim is kept

    def __len__(self) -> int:
        return len(self.items)

    def start(self, row: Any, offset_s: float = 0.0) -> List[int]:
        """Read idem_begin_many's row; the positions to run, in input order.
        A state this client does not know raises Unavailable (no handler
        runs)."""
        n = len(self.items)
        cols = [_array(row[c], n) for c in range(10)]
        now = row[10]
        self.results, self.rows, self.duplicate_of, self.claimed = [], [], [], []
        for i in range(n):
            claimed, state, token, status, body, lease_until, expires_at, phase, pdata, dup = (
                c[i] for c in cols)
            state = text(state)
            br = BeginRow.of((claimed, state, token, status, body, lease_until, expires_at,
                              now, phase, pdata), offset_s)
            self.rows.append(br)
            self.duplicate_of.append(None if dup is None else int(dup) - 1)
            if dup is not None:
                if state == DUPLICATE:
                    self.results.append(Result(Outcome.UNAVAILABLE, duplicate_of=int(dup) - 1))
                    continue
                if state == "CONFLICT":
                    self.results.append(Result(Outcome.CONFLICT, duplicate_of=int(dup) - 1))
                    continue
            outcome = br.outcome()
            r = Result(outcome, response=br.response())
            if outcome is Outcome.EXECUTED:
                r.token = br.token
                self.claimed.append(i)
            elif outcome is Outcome.IN_FLIGHT:
                r.lease_until, r.lease_left = br.lease_until, br.lease_left
            elif outcome is Outcome.REPLAYED:
                r.expires_at = br.expires_at
            elif outcome is Outcome.EXPIRED:
                r.status = br.status
            self.results.append(r)
        return list(self.claimed)

    def unavailable(self, error: BaseException) -> List[Result]:
        """Every item's Result when the claim failed: no handler ran."""
        self.results = [Result(Outcome.UNAVAILABLE, error=error, failed_step="begin")
                        for _ in self.items]
        return self.results

    def answered(self, i: int, resp: Response) -> None:
        self.answers[i] = resp
        self.results[i].response = resp

    def raised(self, i: int, exc: BaseException, keep: bool = False) -> None:
        """Item i's handler raised: its claim is released, unless ``keep``."""
        self.failed[i] = exc
        r = self.results[i]
        r.error, r.failed_step = exc, "handler"
        if keep:
            self.kept.add(i)

    def to_finish(self) -> bool:
        return bool(self.answers) or any(i not in self.kept for i in self.failed)

    def finish_params(self) -> list:
        done = [i for i in self.claimed if i in self.answers]
        drop = [i for i in self.claimed if i in self.failed and i not in self.kept]
        return [[self.items[i][0] for i in done], [self.items[i][1] for i in done],
                [self.answers[i].status for i in done], [self.answers[i].body for i in done],
                [self.results[i].token for i in done], interval(self.retention), self.scope,
                self.scope, [self.items[i][0] for i in drop],
                [self.results[i].token for i in drop]]

    def finished(self, row: Any) -> None:
        """Read the finish statement's row: each completed item's expires_at,
        each failed item's released."""
        done = [i for i in self.claimed if i in self.answers]
        drop = [i for i in self.claimed if i in self.failed and i not in self.kept]
        for i, at in zip(done, _array(row[0], len(done))):
            self.results[i].expires_at = at
        for i, rel in zip(drop, _array(row[1], len(drop))):
            self.results[i].released = bool(rel)

    def store_failed(self, error: BaseException) -> None:
        """The finish statement failed: every item that ran has that error."""
        for i in self.claimed:
            r = self.results[i]
            if i in self.answers:
                r.error, r.failed_step = error, "complete"

    def done(self) -> List[Result]:
        """The Results in input order, a repeated key's copied from its
        first occurrence (with ``duplicate_of``)."""
        for i, dup in enumerate(self.duplicate_of):
            if dup is not None and self.rows[i].state == DUPLICATE:
                self.results[i] = dataclasses.replace(self.results[dup], duplicate_of=dup)
        return self.results


def batch_of(guard: Any, items: Any, scope: Optional[str], lease: Seconds,
             retention: Seconds, wait: Optional[bool], wait_for: Seconds,
             remember: Seconds, holder: Optional[str]) -> Batch:
    """The Batch of a guard's do_many: the call's settings, else the guard's."""
    wait = guard.wait if wait is None else wait
    w = (guard.wait_for if wait else None) if wait_for is None else wait_seconds(wait_for)
    return Batch(guard.sql, as_items(items), scope=guard.scope if scope is None else scope,
                 lease=guard.lease if lease is None else lease,
                 retention=guard.retention if retention is None else retention,
                 wait=bool(wait), wait_for=w,
                 remember=guard.remember if remember is None else remember, holder=holder)
