"""The reference Go guard's two tests, ported to idem_pg against the
real server.  Time moves with idem.clock_offset, not with sleeps: the Go
test's lease (1 s) becomes 10 s, so that no claim ends while the test runs,
and its clock moves (2 s, then 2 h) become 20 s and 20 s + 2 h."""

import asyncio
import threading
import time

from psycopg_pool import ConnectionPool

from idem_pg import (AsyncGuard, FailN, Guard, InjectedFault, Outcome, Response,
                     Unavailable)

from conftest import lookup, new_key

LEASE = 10                  # never reached in real time by these tests
RETENTION = 3600
PAST_LEASE = 2 * LEASE      # clock moves, with idem.clock_offset
PAST_WINDOW = PAST_LEASE + 2 * RETENTION


class Ledger:
    def __init__(self, stock):
        self.lock = threading.Lock()
        self.stock = stock
        self.reservations = {}
        self.charges = {}

    def apply(self, key, qty, cents):
        with self.lock:
            if key in self.reservations:
                return True
            if self.stock < qty:
                return False
            self.stock -= qty
            self.reservations[key] = qty
            self.charges[key] = cents
            return True


class Counter:
    def __init__(self):
        self.lock = threading.Lock()
        self.n = 0

    def add(self):
        with self.lock:
            self.n += 1


def handler(ledger, key, calls, delay):
    def h(claim):
        calls.add()
        time.sleep(delay)
        if not ledger.apply(key, 1, 1000):
            return Response(409, b"OUT_OF_STOCK")
        return Response(200, b"paid")
    return h


def test_concurrent_same_key_and_fingerprint_conflict(dsn):
    key = new_key("order-1")
    ledger, calls = Ledger(10), Counter()
    # a pool of ordinary (not autocommit) connections: claims still commit
    with ConnectionPool(dsn, min_size=8, max_size=8) as pool:
        guard = Guard(pool, lease=LEASE, retention=RETENTION)
        barrier = threading.Barrier(8)
        results = [None] * 8

        def worker(i):
            barrier.wait()
            results[i] = guard.do(key, "sku=A&qty=1", handler(ledger, key, calls, 0.020))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        outcomes = [r.outcome for r in results]
        executed = outcomes.count(Outcome.EXECUTED)
        assert (executed, calls.n, ledger.stock, len(ledger.reservations),
                len(ledger.charges)) == (1, 1, 9, 1, 1), outcomes
        assert set(outcomes) <= {Outcome.EXECUTED, Outcome.IN_FLIGHT, Outcome.REPLAYED}
        assert all(r.error is None for r in results), [r.error for r in results]
        assert all(r.response == Response(200, b"paid")
                   for r in results if r.outcome is Outcome.REPLAYED)

        r = guard.do(key, "sku=A&qty=2", handler(ledger, key, calls, 0))
        assert r.outcome is Outcome.CONFLICT and r.response is None
        assert calls.n == 1


def test_lease_takeover_fault_injection_and_window(dsn, down_dsn, db):
    key = new_key("order-2")
    ledger, calls = Ledger(10), Counter()
    clock = [0.0]
    guard = Guard(dsn, lease=LEASE, retention=RETENTION, fault=FailN("complete", 1),
                  clock_offset=lambda: clock[0])
    h = handler(ledger, key, calls, 0)

    first = guard.do(key, "sku=A&qty=1", h)
    assert first.outcome is Outcome.EXECUTED
    assert first.failed_step == "complete" and isinstance(first.error, InjectedFault)
    assert lookup(db, key)["state"] == "PROCESSING"

    inside = guard.do(key, "sku=A&qty=1", h)
    assert inside.outcome is Outcome.IN_FLIGHT and inside.error is None

    clock[0] = PAST_LEASE                              # after the lease
    after = guard.do(key, "sku=A&qty=1", h)
    assert after.outcome is Outcome.EXECUTED and after.error is None
    assert after.token > first.token
    assert (calls.n, ledger.stock, len(ledger.reservations), len(ledger.charges)) == (2, 9, 1, 1)
    assert lookup(db, key)["state"] == "DONE"

    replay = guard.do(key, "sku=A&qty=1", h)
    assert replay.outcome is Outcome.REPLAYED and replay.response == Response(200, b"paid")

    clock[0] = PAST_WINDOW                             # after the window
    window = guard.do(key, "sku=A&qty=1", h)
    assert window.outcome is Outcome.EXECUTED and window.error is None
    assert calls.n == 3

    down = Guard(down_dsn).do(new_key("order-3"), "sku=A&qty=1", h)
    assert down.outcome is Outcome.UNAVAILABLE and isinstance(down.error, Unavailable)
    assert calls.n == 3

    failing = Guard(dsn, fault=lambda op: ConnectionRefusedError("connection refused"))
    down = failing.do(new_key("order-3"), "sku=A&qty=1", h)
    assert down.outcome is Outcome.UNAVAILABLE and down.failed_step == "begin"
    assert calls.n == 3


def test_concurrent_scenario_async(dsn):
    key = new_key("order-1a")
    ledger, calls = Ledger(10), Counter()

    async def h(claim):
        calls.add()
        await asyncio.sleep(0.020)
        ledger.apply(key, 1, 1000)
        return Response(200, b"paid")

    async def main():
        guard = AsyncGuard(dsn, lease=LEASE, retention=RETENTION)
        results = await asyncio.gather(*[guard.do(key, "sku=A&qty=1", h) for _ in range(8)])
        conflict = await guard.do(key, "sku=A&qty=2", h)
        return results, conflict

    results, conflict = asyncio.run(main())
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.EXECUTED) == 1, outcomes
    assert set(outcomes) <= {Outcome.EXECUTED, Outcome.IN_FLIGHT, Outcome.REPLAYED}
    assert (calls.n, ledger.stock, len(ledger.reservations), len(ledger.charges)) == (1, 9, 1, 1)
    assert conflict.outcome is Outcome.CONFLICT and calls.n == 1
