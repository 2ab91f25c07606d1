"""Through pgbouncer in transaction pooling (IDEM_TEST_PGBOUNCER_DSN, set by
test.sh; skipped without it), with the connections the README's "Behind
pgbouncer" asks for: every key executes once and replays after, from
threads sharing a pool smaller than the server's, so that transactions
move between server connections."""

import os
import threading

import pytest
from psycopg_pool import ConnectionPool

from idem_pg import Guard, Outcome, Response, atomic

from conftest import new_key

BOUNCER = os.environ.get("IDEM_TEST_PGBOUNCER_DSN", "")
pytestmark = pytest.mark.skipif(not BOUNCER, reason="IDEM_TEST_PGBOUNCER_DSN is not set")

THREADS, KEYS = 4, 25


def test_guard_and_atomic_through_transaction_pooling(db):
    # pgbouncer serves every database of the cluster: this run's
    dsn = "%s dbname=%s" % (BOUNCER, db.info.dbname)
    pool = ConnectionPool(dsn, min_size=THREADS, max_size=THREADS,
                          kwargs={"autocommit": True, "prepare_threshold": None})
    guard = Guard(pool)
    db.execute("CREATE TABLE IF NOT EXISTS bouncer_orders (key text NOT NULL)")
    runs, results, errors = [], [], []

    def handler(claim):
        runs.append(claim.key)
        return Response(201, claim.key.encode())

    def work(prefix):
        try:
            for i in range(KEYS):
                key = "%s-%d" % (prefix, i)
                first = guard.do(key, "fp", handler)
                again = guard.do(key, "fp", handler)
                with pool.connection() as conn:
                    with atomic(conn, key + "-tx", "fp") as tx:
                        if tx.claimed:
                            conn.execute("INSERT INTO bouncer_orders VALUES (%s)", [key])
                            tx.complete(201, key.encode())
                results.append((first.outcome, first.error, again.outcome,
                                again.response, key))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    prefixes = [new_key("bouncer") for _ in range(THREADS)]
    threads = [threading.Thread(target=work, args=(p,)) for p in prefixes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pool.close()
    assert errors == []
    assert len(results) == THREADS * KEYS
    for first, error, again, response, key in results:
        assert (first, error) == (Outcome.EXECUTED, None), (key, error)
        assert (again, response) == (Outcome.REPLAYED, Response(201, key.encode())), key
    keys = [r[4] for r in results]
    assert sorted(runs) == sorted(keys)
    # atomic(): one order per key, and its response stored with it
    orders = db.execute("SELECT count(*), count(DISTINCT key) FROM bouncer_orders"
                        " WHERE key = ANY(%s)", [keys]).fetchone()
    assert tuple(orders) == (THREADS * KEYS, THREADS * KEYS)
    done = db.execute("SELECT count(*) FROM idem.keys WHERE key = ANY(%s) AND status = 201",
                      [[k + "-tx" for k in keys]]).fetchone()[0]
    assert done == THREADS * KEYS
