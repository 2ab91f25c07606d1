"""atomic(..., retries=N): a transaction that fails with 40001 or 40P01
runs again, claim included; any other error surfaces at once."""

import asyncio
import threading
import time

import psycopg
import pytest

from idem_pg import Outcome, Response, atomic, atomic_async, retry_transaction

from conftest import lookup, new_key
from test_guard import FP

BODY = b'{"order":42}'


def raise_sql(code):
    return "DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '%s'; END$$" % code


def orders(db, key):
    return db.execute("SELECT count(*) FROM orders WHERE key = %s", [key]).fetchone()[0]


class Order:
    """The block of the tests: an order row for the key, then, in its first
    ``failures`` runs, a failure: SQLSTATE ``code`` raised on the
    connection, or ``error`` raised in Python.  Counts its runs and keeps
    each claim's token."""

    def __init__(self, conn, key, code=None, failures=0, error=None):
        self.conn, self.key, self.code, self.failures, self.error = conn, key, code, failures, error
        self.attempts = 0
        self.tokens = []

    def run(self, tx):
        self.attempts += 1
        if not tx.claimed:
            return
        self.tokens.append(tx.token)
        self.conn.execute("INSERT INTO orders VALUES (%s, 'A', 1)", [self.key])
        if self.attempts <= self.failures:
            if self.error is not None:
                raise self.error
            self.conn.execute(raise_sql(self.code))
        tx.complete(201, BODY)

    def loop(self, retries, **kw):
        tx, before = None, self.attempts
        for attempt in atomic(self.conn, self.key, FP, retries=retries, **kw):
            with attempt as tx:
                assert attempt.number == self.attempts - before + 1
                self.run(tx)
        return tx


@pytest.mark.parametrize("code", ["40001", "40P01"])
def test_retried_then_committed(dsn, db, code):
    key = new_key()
    with psycopg.connect(dsn) as conn:
        order = Order(conn, key, code, failures=1)
        tx = order.loop(retries=3)
        assert tx.outcome is Outcome.EXECUTED and tx.completed and order.attempts == 2
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # committed
        # The retry claimed the key again: the first claim rolled back with its row.
        row = lookup(db, key)
        assert row["state"] == "DONE" and row["status"] == 201
        assert order.tokens[1] > order.tokens[0] and row["token"] == order.tokens[1]
        assert orders(db, key) == 1
        again = order.loop(retries=3)
        assert again.outcome is Outcome.REPLAYED and again.response == Response(201, BODY)
        assert order.attempts == 3 and orders(db, key) == 1


def test_off_by_default(dsn, db):
    key = new_key()
    with psycopg.connect(dsn) as conn:
        order = Order(conn, key, "40001", failures=1)
        with pytest.raises(psycopg.errors.SerializationFailure):
            with atomic(conn, key, FP) as tx:
                order.run(tx)
        assert order.attempts == 1 and orders(db, key) == 0 and lookup(db, key) is None
        order.failures = 2
        with pytest.raises(psycopg.errors.SerializationFailure):
            order.loop(retries=0)                    # the loop form, one attempt
        assert order.attempts == 2 and orders(db, key) == 0 and lookup(db, key) is None
        # The key is free: the caller's own retry claims it.
        assert order.loop(retries=0).outcome is Outcome.EXECUTED
    assert orders(db, key) == 1 and lookup(db, key)["state"] == "DONE"


def test_exhausted_surfaces_the_last_error(dsn, db):
    key = new_key()
    with psycopg.connect(dsn, autocommit=True) as conn:
        order = Order(conn, key, "40P01", failures=100)
        with pytest.raises(psycopg.errors.DeadlockDetected):
            order.loop(retries=2)
        assert order.attempts == 3
    assert orders(db, key) == 0 and lookup(db, key) is None


@pytest.mark.parametrize("failure", ["23505", "exception"])
def test_other_errors_not_retried(dsn, db, failure):
    key = new_key()
    with psycopg.connect(dsn) as conn:
        if failure == "23505":
            order = Order(conn, key, failure, failures=1)
            db.execute("INSERT INTO orders VALUES (%s, 'A', 1)", [key])  # the insert is a duplicate
            with pytest.raises(psycopg.errors.UniqueViolation):
                order.loop(retries=3)
            assert orders(db, key) == 1
        else:
            order = Order(conn, key, failures=1, error=RuntimeError("card declined"))
            with pytest.raises(RuntimeError):
                order.loop(retries=3)
            assert orders(db, key) == 0
        assert order.attempts == 1 and lookup(db, key) is None


def test_commit_40001_is_retried(dsn, db):
    # A deferred constraint trigger fails the first COMMIT with 40001: the
    # server rolled the transaction back, so it runs again.
    db.execute("""
        DROP TABLE IF EXISTS py_retry_commit;
        DROP SEQUENCE IF EXISTS py_retry_commit_seq;
        CREATE SEQUENCE py_retry_commit_seq;
        CREATE TABLE py_retry_commit (key text NOT NULL);
        CREATE OR REPLACE FUNCTION py_retry_commit_fail() RETURNS trigger LANGUAGE plpgsql AS
        $$BEGIN
            IF nextval('py_retry_commit_seq') = 1 THEN
                RAISE EXCEPTION 'serialization failure at commit' USING ERRCODE = '40001';
            END IF;
            RETURN NULL;
        END$$;
        CREATE CONSTRAINT TRIGGER fail_first_commit AFTER INSERT ON py_retry_commit
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION py_retry_commit_fail()""")
    key = new_key()
    attempts = 0
    with psycopg.connect(dsn) as conn:
        for attempt in atomic(conn, key, FP, retries=1):
            with attempt as tx:
                attempts += 1
                conn.execute("INSERT INTO py_retry_commit VALUES (%s)", [key])
                tx.complete(201, BODY)
    assert attempts == 2
    assert db.execute("SELECT count(*) FROM py_retry_commit").fetchone()[0] == 1
    assert lookup(db, key)["state"] == "DONE"


def test_not_retried_inside_callers_transaction(dsn, db):
    key = new_key()
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")                     # the caller's transaction is open
        order = Order(conn, key, "40001", failures=1)
        with pytest.raises(psycopg.errors.SerializationFailure):
            order.loop(retries=3)                    # a savepoint: the caller must run it all again
        assert order.attempts == 1
        conn.rollback()
    assert lookup(db, key) is None


def test_timeout_bounds_the_retries(dsn, db):
    key = new_key()
    with psycopg.connect(dsn) as conn:
        order = Order(conn, key, "40001", failures=1)
        run = order.run

        def slow(tx):
            time.sleep(1.1)                          # past the timeout before failing
            run(tx)
        order.run = slow
        with pytest.raises(psycopg.errors.SerializationFailure):
            order.loop(retries=3, timeout=1.0)
        assert order.attempts == 1
    assert lookup(db, key) is None


def test_with_form_refuses_retries(dsn):
    with psycopg.connect(dsn) as conn:
        with pytest.raises(TypeError, match="loop"):
            with atomic(conn, new_key(), FP, retries=2):
                pass
        with pytest.raises(RuntimeError, match="entered"):
            for _attempt in atomic(conn, new_key(), FP, retries=2):
                pass


def test_retry_transaction():
    assert retry_transaction(psycopg.errors.SerializationFailure())
    assert retry_transaction(psycopg.errors.DeadlockDetected())
    assert not retry_transaction(psycopg.errors.UniqueViolation())
    assert not retry_transaction(psycopg.OperationalError("connection lost"))
    wrapped = RuntimeError("order failed")
    wrapped.__cause__ = psycopg.errors.SerializationFailure()
    assert retry_transaction(wrapped)


def test_real_serialization_failure(dsn, db):
    # Two SERIALIZABLE transactions each read that two are on call and take
    # one off: PostgreSQL fails one (40001), whose retry reads one left and
    # refuses.
    db.execute("""
        DROP TABLE IF EXISTS py_oncall;
        CREATE TABLE py_oncall (name text PRIMARY KEY, on_call boolean NOT NULL);
        INSERT INTO py_oncall VALUES ('a', true), ('b', true)""")
    both_read = threading.Barrier(2, timeout=30)
    attempts, answers, errors = [], {}, []

    def off_call(name):
        serializable = "-c default_transaction_isolation=serializable"
        try:
            with psycopg.connect(dsn, options=serializable) as conn:
                key = new_key("off-" + name)
                for attempt in atomic(conn, key, FP, retries=5):
                    with attempt as tx:
                        attempts.append(name)
                        on = conn.execute("SELECT count(*) FROM py_oncall"
                                          " WHERE on_call").fetchone()[0]
                        if attempt.number == 1:  # both first attempts read before either writes
                            try:
                                both_read.wait()
                            except threading.BrokenBarrierError:
                                pass
                        if on < 2:
                            tx.complete(409, b"last on call")
                        else:
                            conn.execute("UPDATE py_oncall SET on_call = false"
                                         " WHERE name = %s", [name])
                            tx.complete(200, b"off call")
                answers[name] = (tx.outcome, key)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=off_call, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and sorted(answers) == ["a", "b"]
    assert all(outcome is Outcome.EXECUTED for outcome, _ in answers.values())
    assert sorted(lookup(db, key)["status"] for _, key in answers.values()) == [200, 409]
    assert len(attempts) >= 3                        # one of them ran again
    assert db.execute("SELECT count(*) FROM py_oncall WHERE on_call").fetchone()[0] == 1


@pytest.mark.parametrize("code", ["40001", "40P01"])
def test_async_retried_then_committed(dsn, db, code):
    key = new_key()
    tokens = []

    async def main():
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            tx = None
            async for attempt in atomic_async(conn, key, FP, retries=2):
                async with attempt as tx:
                    tokens.append(tx.token)
                    await conn.execute("INSERT INTO orders VALUES (%s, 'A', 1)", [key])
                    if len(tokens) == 1:
                        await conn.execute(raise_sql(code))
                    await tx.complete(201, BODY)
            return tx

    tx = asyncio.run(main())
    assert tx.outcome is Outcome.EXECUTED and len(tokens) == 2 and tokens[1] > tokens[0]
    assert orders(db, key) == 1 and lookup(db, key)["token"] == tokens[1]


def test_async_exhausted_and_not_retried(dsn, db):
    key, other = new_key(), new_key()
    runs = {"exhausted": 0, "other": 0}

    async def main():
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            with pytest.raises(psycopg.errors.SerializationFailure):
                async for attempt in atomic_async(conn, key, FP, retries=2):
                    async with attempt as tx:
                        runs["exhausted"] += 1
                        await conn.execute("INSERT INTO orders VALUES (%s, 'A', 1)", [key])
                        await conn.execute(raise_sql("40001"))
                        await tx.complete(201, BODY)
            with pytest.raises(RuntimeError):
                async for attempt in atomic_async(conn, other, FP, retries=2):
                    async with attempt as tx:
                        runs["other"] += 1
                        raise RuntimeError("card declined")
            with pytest.raises(TypeError, match="loop"):
                async with atomic_async(conn, new_key(), FP, retries=1):
                    pass

    asyncio.run(main())
    assert runs == {"exhausted": 3, "other": 1}
    assert orders(db, key) == 0 and lookup(db, key) is None and lookup(db, other) is None
