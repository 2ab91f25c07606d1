'use strict';

// transaction() with options.retries: a transaction that fails with 40001
// or 40P01 runs again, claim included; any other error rejects at once.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Guard, Outcome, transaction, isRetryableTransaction } = require('..');
const { makePool, uniqueKey, sleep, lookup } = require('./helpers');

const pool = makePool({ max: 6 });
const orders = `retry_orders_${process.pid}`;
const commitFails = `retry_commit_${process.pid}`;
const onCall = `retry_oncall_${process.pid}`;

test.before(async () => {
  await pool.query(`CREATE TABLE ${orders} (key text PRIMARY KEY)`);
});
test.after(async () => {
  await pool.query(`DROP TABLE IF EXISTS ${orders}, ${commitFails}, ${onCall};
    DROP SEQUENCE IF EXISTS ${commitFails}_seq; DROP FUNCTION IF EXISTS ${commitFails}_fail()`);
  await pool.end();
});

const raiseSql = (code) => `DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '${code}'; END$$`;

async function orderRows(key) {
  return Number((await pool.query(`SELECT count(*) FROM ${orders} WHERE key = $1`, [key])).rows[0].count);
}

/**
 * The handler of the tests: an order row for the key, then, in its first
 * `failures` runs, a failure: SQLSTATE `code` raised on the client, or
 * `error` thrown.  Counts its runs (attempts) and keeps each claim's
 * token and attempt number.
 */
function order({ code = null, failures = 0, error = null } = {}) {
  const h = async (claim) => {
    h.attempts += 1;
    h.tokens.push(claim.token);
    h.numbers.push(claim.attempt);
    await claim.client.query(`INSERT INTO ${orders} VALUES ($1)`, [claim.key]);
    if (h.attempts <= failures) {
      if (error) throw error;
      await claim.client.query(raiseSql(code));
    }
    return { status: 201, body: `order ${claim.key}` };
  };
  h.attempts = 0;
  h.tokens = [];
  h.numbers = [];
  return h;
}

async function withClient(fn) {
  const c = await pool.connect();
  try {
    return await fn(c);
  } finally {
    c.release();
  }
}

for (const code of ['40001', '40P01']) {
  test(`${code} in the handler: the transaction runs again, the claim with it, and commits once`, async () => {
    const key = uniqueKey(`retry-${code}`);
    const h = order({ code, failures: 1 });
    await withClient(async (c) => {
      const r = await transaction(c, key, 'fp', h, { retries: 3 });
      assert.equal(r.outcome, Outcome.EXECUTED);
      assert.equal(r.response.status, 201);
      assert.equal(h.attempts, 2);
      assert.deepEqual(h.numbers, [1, 2]);
      // The first claim was rolled back with its row: the retry claimed the key again.
      assert.ok(h.tokens[1] > h.tokens[0]);
      assert.equal(r.token, h.tokens[1]);
      const row = await lookup(pool, key);
      assert.equal(row.state, 'DONE');
      assert.equal(row.status, 201);
      assert.equal(String(row.token), String(h.tokens[1]));
      assert.equal(await orderRows(key), 1);
      const again = await transaction(c, key, 'fp', h, { retries: 3 });
      assert.equal(again.outcome, Outcome.REPLAYED);
      assert.equal(again.response.body.toString(), `order ${key}`);
      assert.equal(h.attempts, 2);
    });
  });
}

test('off by default: the 40001 rejects, nothing is stored, the key is free', async () => {
  const key = uniqueKey('retry-off');
  const h = order({ code: '40001', failures: 1 });
  await withClient(async (c) => {
    await assert.rejects(transaction(c, key, 'fp', h), (err) => err.code === '40001' && isRetryableTransaction(err));
    assert.equal(h.attempts, 1);
    assert.equal(await lookup(pool, key), null);
    assert.equal(await orderRows(key), 0);
    const r = await transaction(c, key, 'fp', h); // the caller's own retry claims it
    assert.equal(r.outcome, Outcome.EXECUTED);
    assert.equal(h.attempts, 2);
  });
  assert.equal(await orderRows(key), 1);
});

test('retries exhausted: the last error rejects after retries + 1 attempts, nothing stored', async () => {
  const key = uniqueKey('retry-exhausted');
  const h = order({ code: '40P01', failures: 100 });
  await withClient(async (c) => {
    await assert.rejects(transaction(c, key, 'fp', h, { retries: 2 }), (err) => err.code === '40P01');
    assert.equal(c.getTransactionStatus(), 'I');
  });
  assert.equal(h.attempts, 3);
  assert.deepEqual(h.numbers, [1, 2, 3]);
  assert.equal(await lookup(pool, key), null);
  assert.equal(await orderRows(key), 0);
});

test('other errors are not retried: 23505, a plain Error', async () => {
  const dup = uniqueKey('retry-23505');
  await pool.query(`INSERT INTO ${orders} VALUES ($1)`, [dup]); // the handler's insert is a duplicate
  const h1 = order();
  const h2 = order({ failures: 1, error: new Error('card declined') });
  const plain = uniqueKey('retry-plain');
  await withClient(async (c) => {
    await assert.rejects(transaction(c, dup, 'fp', h1, { retries: 3 }), (err) => err.code === '23505');
    await assert.rejects(transaction(c, plain, 'fp', h2, { retries: 3 }), /card declined/);
  });
  assert.equal(h1.attempts, 1);
  assert.equal(h2.attempts, 1);
  assert.equal(await lookup(pool, dup), null);
  assert.equal(await lookup(pool, plain), null);
  assert.equal(await orderRows(plain), 0);
});

test('40001 from COMMIT (a deferred trigger): rolled back by the server, so run again', async () => {
  await pool.query(`CREATE SEQUENCE ${commitFails}_seq;
    CREATE TABLE ${commitFails} (key text NOT NULL);
    CREATE FUNCTION ${commitFails}_fail() RETURNS trigger LANGUAGE plpgsql AS
    $$BEGIN
      IF nextval('${commitFails}_seq') = 1 THEN
        RAISE EXCEPTION 'serialization failure at commit' USING ERRCODE = '40001';
      END IF;
      RETURN NULL;
    END$$;
    CREATE CONSTRAINT TRIGGER fail_first_commit AFTER INSERT ON ${commitFails}
      DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ${commitFails}_fail()`);
  const key = uniqueKey('retry-commit');
  let attempts = 0;
  const r = await withClient((c) => transaction(c, key, 'fp', async (claim) => {
    attempts += 1;
    await claim.client.query(`INSERT INTO ${commitFails} VALUES ($1)`, [key]);
    return { status: 201 };
  }, { retries: 1 }));
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(attempts, 2);
  assert.equal(Number((await pool.query(`SELECT count(*) FROM ${commitFails}`)).rows[0].count), 1);
  assert.equal((await lookup(pool, key)).state, 'DONE');
});

test('the timeout bounds the retries: no attempt starts after it', async () => {
  const key = uniqueKey('retry-timeout');
  const h = order({ code: '40001', failures: 1 });
  const slow = async (claim) => {
    await sleep(1100); // past the timeout before failing
    return h(claim);
  };
  await withClient(async (c) => {
    await assert.rejects(transaction(c, key, 'fp', slow, { retries: 3, timeout: 1000 }), (err) => err.code === '40001');
  });
  assert.equal(h.attempts, 1);
  assert.equal(await lookup(pool, key), null);
});

test("a guard's retries option serves guard.transaction(); a bad value is refused", async () => {
  const key = uniqueKey('retry-guard');
  const h = order({ code: '40001', failures: 2 });
  const guard = new Guard(pool, { retries: 2 });
  const r = await withClient((c) => guard.transaction(c, key, 'fp', h));
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(h.attempts, 3);
  assert.throws(() => new Guard(pool, { retries: -1 }), TypeError);
  await withClient(async (c) => {
    await assert.rejects(transaction(c, uniqueKey('retry-bad'), 'fp', h, { retries: 1.5 }), TypeError);
  });
  assert.ok(!isRetryableTransaction(new Error('x')));
  assert.ok(isRetryableTransaction({ code: null, cause: { code: '40P01' } }));
});

test('a real serialization failure: two SERIALIZABLE transactions, one runs again and sees the other', async () => {
  // Each reads that two are on call, then takes one off; PostgreSQL fails
  // one (40001), whose retry reads one left and refuses.
  await pool.query(`CREATE TABLE ${onCall} (name text PRIMARY KEY, on_call boolean NOT NULL);
    INSERT INTO ${onCall} VALUES ('a', true), ('b', true)`);
  const serializable = makePool({ max: 2, options: '-c default_transaction_isolation=serializable' });
  let attempts = 0;
  let arrived = 0;
  let release;
  const bothRead = new Promise((resolve) => { release = resolve; });
  const offCall = (name) => async ({ client, attempt }) => {
    attempts += 1;
    const on = Number((await client.query(`SELECT count(*) FROM ${onCall} WHERE on_call`)).rows[0].count);
    if (attempt === 1) { // the first attempts both read before either writes
      arrived += 1;
      if (arrived === 2) release();
      await Promise.race([bothRead, sleep(30000)]);
    }
    if (on < 2) return { status: 409, body: 'last on call' };
    await client.query(`UPDATE ${onCall} SET on_call = false WHERE name = $1`, [name]);
    return { status: 200, body: 'off call' };
  };
  try {
    const run = async (name) => {
      const c = await serializable.connect();
      try {
        return await transaction(c, uniqueKey(`off-${name}`), 'fp', offCall(name), { retries: 5 });
      } finally {
        c.release();
      }
    };
    const [a, b] = await Promise.all([run('a'), run('b')]);
    assert.deepEqual([a.response.status, b.response.status].sort(), [200, 409]);
    assert.ok(attempts >= 3, `${attempts} attempts`);
    assert.equal(Number((await pool.query(`SELECT count(*) FROM ${onCall} WHERE on_call`)).rows[0].count), 1);
  } finally {
    await serializable.end();
  }
});
