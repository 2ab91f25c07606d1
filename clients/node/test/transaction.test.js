'use strict';

// The one-transaction helper: claim, business writes and response commit
// together on the caller's client.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Guard, Outcome, transaction, IdemError } = require('..');
const { makePool, uniqueKey, sleep, lookup, countOutcomes, untilWaitingInServer, holdKey, wireCounter,
} = require('./helpers');

const pool = makePool({ max: 12 });
const table = `stock_${process.pid}`;

test.before(async () => {
  await pool.query(`CREATE TABLE ${table} (sku text PRIMARY KEY, qty integer NOT NULL)`);
});
test.after(async () => {
  await pool.query(`DROP TABLE IF EXISTS ${table}`);
  await pool.end();
});

async function resetStock(sku, qty) {
  await pool.query(`INSERT INTO ${table} VALUES ($1, $2) ON CONFLICT (sku) DO UPDATE SET qty = EXCLUDED.qty`, [sku, qty]);
}

async function stockOf(sku) {
  return (await pool.query(`SELECT qty FROM ${table} WHERE sku = $1`, [sku])).rows[0].qty;
}

function order(sku, delayMs, calls) {
  return async (claim) => {
    calls.n += 1;
    if (delayMs) await sleep(delayMs);
    await claim.client.query(`UPDATE ${table} SET qty = qty - 1 WHERE sku = $1`, [sku]);
    return { status: 201, body: Buffer.from(JSON.stringify({ sku, token: String(claim.token) })) };
  };
}

test('executed: the write and the response commit together; a retry replays', async () => {
  await resetStock('A', 10);
  const key = uniqueKey('tx');
  const calls = { n: 0 };
  const c = await pool.connect();
  try {
    const r = await transaction(c, key, 'sku=A&qty=1', order('A', 0, calls));
    assert.equal(r.outcome, Outcome.EXECUTED);
    assert.equal(typeof r.token, 'bigint');
    assert.equal(r.response.status, 201);
    assert.equal(await stockOf('A'), 9);
    assert.equal((await lookup(pool, key)).state, 'DONE');
    const again = await transaction(c, key, 'sku=A&qty=1', order('A', 0, calls));
    assert.equal(again.outcome, Outcome.REPLAYED);
    assert.equal(again.response.status, 201);
    assert.deepEqual(again.response.body, r.response.body);
    assert.equal(calls.n, 1);
    assert.equal(await stockOf('A'), 9);
  } finally {
    c.release();
  }
});

test('eight concurrent clients: stock decremented once, the other seven wait and replay', async () => {
  await resetStock('B', 10);
  const key = uniqueKey('tx-8');
  const calls = { n: 0 };
  const clients = await Promise.all(Array.from({ length: 8 }, () => pool.connect()));
  try {
    const results = await Promise.all(clients.map((c) => transaction(c, key, 'sku=B&qty=1', order('B', 20, calls))));
    const counts = countOutcomes(results);
    assert.equal(counts.executed, 1, JSON.stringify(counts));
    assert.equal(counts.replayed, 7, JSON.stringify(counts));
    assert.equal(calls.n, 1);
    assert.equal(await stockOf('B'), 9);
    const body = results.find((r) => r.outcome === Outcome.EXECUTED).response.body;
    for (const r of results) assert.deepEqual(r.response.body, body);
  } finally {
    for (const c of clients) c.release();
  }
});

test('a handler error rolls everything back: the error as thrown, stock unchanged, the key free', async () => {
  await resetStock('C', 10);
  const key = uniqueKey('tx-fail');
  const c = await pool.connect();
  try {
    const boom = new Error('card declined');
    await assert.rejects(transaction(c, key, 'fp', async (claim) => {
      await claim.client.query(`UPDATE ${table} SET qty = qty - 1 WHERE sku = 'C'`);
      throw boom;
    }), (e) => e === boom);
    assert.equal(await stockOf('C'), 10);
    assert.equal(await lookup(pool, key), null);
    const calls = { n: 0 };
    assert.equal((await transaction(c, key, 'fp', order('C', 0, calls))).outcome, Outcome.EXECUTED);
    assert.equal(await stockOf('C'), 9);
  } finally {
    c.release();
  }
});

test('a statement that failed inside the handler (error swallowed): storing the response fails (25P02), nothing committed', async () => {
  await resetStock('D', 10);
  const key = uniqueKey('tx-aborted');
  const c = await pool.connect();
  try {
    await assert.rejects(transaction(c, key, 'fp', async (claim) => {
      await claim.client.query(`UPDATE ${table} SET qty = qty - 1 WHERE sku = 'D'`);
      await claim.client.query('SELECT 1/0').catch(() => {});
      return { status: 200 };
    }), (e) => e instanceof IdemError && e.code === '25P02');
    assert.equal(await stockOf('D'), 10);
    assert.equal(await lookup(pool, key), null);
  } finally {
    c.release();
  }
});

test('conflict and in flight: nothing written, the handler not called', async () => {
  await resetStock('E', 10);
  const c = await pool.connect();
  const calls = { n: 0 };
  try {
    const key = uniqueKey('tx-conflict');
    await transaction(c, key, 'sku=E&qty=1', order('E', 0, calls));
    const r = await transaction(c, key, 'sku=E&qty=2', order('E', 0, calls));
    assert.equal(r.outcome, Outcome.CONFLICT);
    assert.equal(r.response, null);

    // A guard's claim is committed on its own: the helper sees it in flight.
    const key2 = uniqueKey('tx-inflight');
    const guard = new Guard(pool, { lease: 10000 });
    let release;
    const gate = new Promise((resolve) => { release = resolve; });
    let started = false;
    const held = guard.do(key2, 'fp', async () => { started = true; await gate; return { status: 200 }; });
    while (!started) await sleep(5);
    const r2 = await transaction(c, key2, 'fp', order('E', 0, calls));
    assert.equal(r2.outcome, Outcome.IN_FLIGHT);
    release();
    await held;
    assert.equal(calls.n, 1);
    assert.equal(await stockOf('E'), 9);
  } finally {
    c.release();
  }
});

test('waitFor: the helper waits for a guard\'s claim and replays its answer; when the wait runs out, in flight with its lease_until', async (t) => {
  await resetStock('W', 10);
  const waiters = makePool({ max: 1, application_name: 'idem-wait-tx' });
  let holder = null;
  t.after(async () => {
    if (holder) holder.open({ status: 200 }); // a test that fails with the holder parked ends it
    await waiters.end();
  });
  const c = await waiters.connect();
  const calls = { n: 0 };
  const guard = new Guard(pool, { lease: 60000 });
  try {
    const key = uniqueKey('tx-wait');
    holder = await holdKey(guard, key);
    // timeout alone (1 s) is shorter than the wait: the budget of the claim is timeout + waitFor.
    const waiting = transaction(c, key, 'fp', order('W', 0, calls), { waitFor: 30000, timeout: 1000 });
    await untilWaitingInServer(pool, 'idem-wait-tx');
    await sleep(1500); // past timeout alone
    holder.open({ status: 202, body: Buffer.from([1, 0, 255]) });
    assert.equal((await holder.done).outcome, Outcome.EXECUTED);
    const r = await waiting;
    assert.equal(r.outcome, Outcome.REPLAYED);
    assert.equal(r.response.status, 202);
    assert.deepEqual(r.response.body, Buffer.from([1, 0, 255]));
    assert.equal(calls.n, 0);
    assert.equal(await stockOf('W'), 10);
    // The session's own timeouts are untouched afterwards.
    assert.equal((await c.query('SHOW statement_timeout')).rows[0].statement_timeout, '0');

    const key2 = uniqueKey('tx-wait-out');
    const holder2 = await holdKey(guard, key2);
    try {
      const t0 = Date.now();
      const r2 = await transaction(c, key2, 'fp', order('W', 0, calls), { waitFor: 1500 });
      assert.equal(r2.outcome, Outcome.IN_FLIGHT);
      assert.ok(Date.now() - t0 >= 1400, `answered after ${Date.now() - t0} ms, before the wait ran out`);
      assert.equal(r2.leaseUntil.getTime(), holder2.claim.leaseUntil.getTime());
      assert.equal(calls.n, 0);
    } finally {
      holder2.open({ status: 200 });
      await holder2.done;
    }
  } finally {
    c.release();
  }
});

test('Guard#transaction uses the guard\'s schema, scope and clock', async () => {
  await resetStock('F', 10);
  const c = await pool.connect();
  const calls = { n: 0 };
  try {
    const guard = new Guard(pool, { scope: 'tenant-f', lease: 10000, retention: 3600000 });
    const key = uniqueKey('tx-guard');
    assert.equal((await guard.transaction(c, key, 'fp', order('F', 0, calls))).outcome, Outcome.EXECUTED);
    assert.equal((await lookup(pool, key, 'tenant-f')).state, 'DONE');
    assert.equal((await guard.transaction(c, key, 'fp', order('F', 0, calls))).outcome, Outcome.REPLAYED);
    // After the window (clock moved two hours) the key is new again.
    const r = await guard.transaction(c, key, 'fp', order('F', 0, calls), { clockOffset: 7200 });
    assert.equal(r.outcome, Outcome.EXECUTED);
    assert.equal(calls.n, 2);
    assert.equal(await stockOf('F'), 8);
  } finally {
    c.release();
  }
});

test('a client already inside a transaction is refused, its transaction untouched', async () => {
  const c = await pool.connect();
  try {
    await c.query('BEGIN');
    await c.query(`UPDATE ${table} SET qty = 99 WHERE sku = 'A'`);
    let calls = 0;
    await assert.rejects(transaction(c, uniqueKey('tx-nested'), 'fp', async () => { calls += 1; return { status: 200 }; }),
      (e) => e instanceof IdemError && /idle client/.test(e.message));
    assert.equal(calls, 0);
    assert.equal((await c.query(`SELECT qty FROM ${table} WHERE sku = 'A'`)).rows[0].qty, 99, 'still in the caller\'s transaction');
    await c.query('ROLLBACK');
    assert.notEqual(await stockOf('A'), 99);
  } finally {
    c.release();
  }
});

// BEGIN, the timeouts and the claim go to the server in one message, the
// claim's values written in as literals.

/** The client's query calls from now on: one round trip each. */
function countQueries(c) {
  const texts = [];
  const real = c.query;
  c.query = function counted(q, ...rest) {
    texts.push(typeof q === 'string' ? q : q.text);
    return real.call(this, q, ...rest);
  };
  return { texts, restore: () => { c.query = real; } };
}

test('round trips on the wire: a replay is two (the claim with BEGIN and the timeouts, ROLLBACK), a new key two besides the handler statements', async () => {
  await resetStock('G', 10);
  const c = await pool.connect();
  const calls = { n: 0 };
  const seen = wireCounter();
  seen.count(c);
  try {
    const key = uniqueKey('tx-one');
    const r = await transaction(c, key, 'sku=G', order('G', 0, calls));
    assert.equal(r.outcome, Outcome.EXECUTED);
    // the claim (BEGIN, the timeouts, idem_begin, the session's timeouts
    // back), the handler's UPDATE, the complete (timeouts, SAVEPOINT,
    // idem_complete, COMMIT)
    assert.equal(seen.n, 3, seen.texts.join('\n'));
    assert.ok(seen.texts.every((t) => !t.includes('tx-one')), seen.texts.join('\n'));
    seen.reset();
    const again = await transaction(c, key, 'sku=G', order('G', 0, calls));
    assert.equal(again.outcome, Outcome.REPLAYED);
    assert.deepEqual(again.response.body, r.response.body);
    assert.equal(seen.n, 2);
    seen.reset();
    assert.equal((await transaction(c, key, 'sku=G', order('G', 0, calls), { timeout: 0 })).outcome, Outcome.REPLAYED);
    assert.equal(seen.n, 2);
    seen.reset();
    assert.equal((await transaction(c, key, 'sku=H', order('G', 0, calls))).outcome, Outcome.CONFLICT);
    assert.equal(seen.n, 2);
    assert.equal(calls.n, 1);
    assert.equal(await stockOf('G'), 9);
    // The handler ran under the session's timeouts, not the claim's.
    const shown = await transaction(c, uniqueKey('tx-one-st'), 'fp', async (claim) => {
      const st = (await claim.client.query('SHOW statement_timeout')).rows[0].statement_timeout;
      const lt = (await claim.client.query('SHOW lock_timeout')).rows[0].lock_timeout;
      return { status: 200, body: Buffer.from(`${st} ${lt}`) };
    });
    assert.equal(shown.response.body.toString(), '0 0');
  } finally {
    seen.restore();
    c.release();
  }
});

test('one message: keys with quotes, backslashes and non-ASCII letters, with standard_conforming_strings on and off', async () => {
  const c = await pool.connect();
  try {
    for (const scs of ['on', 'off']) {
      await c.query(`SET standard_conforming_strings = ${scs}`);
      const key = uniqueKey(`it's a \\key\\n "é" ${scs}`);
      const fp = "fp with ' and \\";
      let runs = 0;
      const handler = async () => { runs += 1; return { status: 201, body: Buffer.from(key) }; };
      assert.equal((await transaction(c, key, fp, handler, { scope: "o'scope\\" })).outcome, Outcome.EXECUTED);
      const stored = await pool.query('SELECT key, scope FROM idem.keys WHERE key = $1', [key]);
      assert.deepEqual(stored.rows, [{ key, scope: "o'scope\\" }]);
      const again = await transaction(c, key, fp, handler, { scope: "o'scope\\" });
      assert.equal(again.outcome, Outcome.REPLAYED);
      assert.equal(again.response.body.toString(), key);
      assert.equal((await transaction(c, key, `${fp}x`, handler, { scope: "o'scope\\" })).outcome, Outcome.CONFLICT);
      assert.equal(runs, 1);
    }
  } finally {
    await c.query('RESET standard_conforming_strings');
    c.release();
  }
});

test('one message: a NUL in the key is refused as a parameter would be (22021), a client without escapeLiteral sends one statement at a time', async () => {
  const c = await pool.connect();
  try {
    await assert.rejects(transaction(c, 'nul\u0000key', 'fp', async () => ({ status: 200 })),
      (e) => e instanceof IdemError && e.code === '22021');
    assert.equal(c.getTransactionStatus ? c.getTransactionStatus() : 'I', 'I');
    // A client object that only has query() (a wrapper, a proxy).
    const wrapper = { query: (...a) => c.query(...a) };
    const seen = countQueries(wrapper);
    const key = uniqueKey('tx-wrapper');
    const r = await transaction(wrapper, key, 'fp', async () => ({ status: 200, body: Buffer.from('w') }), { timeout: 0 });
    assert.equal(r.outcome, Outcome.EXECUTED);
    assert.deepEqual(seen.texts.slice(0, 1), ['BEGIN']);
    assert.match(seen.texts[1], /idem_begin\(\$1::text, \$2::text/);
    assert.equal((await transaction(wrapper, key, 'fp', async () => ({ status: 500 }), { timeout: 0 })).outcome, Outcome.REPLAYED);
  } finally {
    c.release();
  }
});

test('one message: a schema without idem names idem_begin and the schema option; nothing is left open', async () => {
  const c = await pool.connect();
  try {
    await assert.rejects(transaction(c, uniqueKey('tx-noschema'), 'fp', async () => ({ status: 200 }), { schema: 'no_such_schema' }),
      (e) => e instanceof IdemError && e.code === '3F000' && /^idem: idem_begin not found in schema "no_such_schema" \(3F000: /.test(e.message) && /; set the schema: option to the schema where CREATE EXTENSION idem put it/.test(e.message));
    await assert.rejects(transaction(c, uniqueKey('tx-noschema'), 'fp', async () => ({ status: 200 }), { schema: 'pg_catalog' }),
      (e) => e instanceof IdemError && e.code === '42883' && /^idem: idem_begin not found in schema "pg_catalog" \(42883: function pg_catalog\.idem_begin/.test(e.message));
    assert.equal(c.getTransactionStatus(), 'I');
  } finally {
    c.release();
  }
});
