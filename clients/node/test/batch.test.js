'use strict';

// Batches: Guard#doMany and transactionMany over idem_begin_many and
// idem_complete_many: input order, per-item outcomes, a key repeated in a
// batch, items in flight waited for, one handler failing, round trips.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Guard, Outcome, transactionMany } = require('..');
const { makePool, uniqueKey, holdKey, lookup, sleep, wireCounter, countingPool } = require('./helpers');

const pool = makePool({ max: 10 });
test.after(() => pool.end());

test.before(async () => {
  await pool.query('CREATE TABLE IF NOT EXISTS batch_effects (key text NOT NULL, note text)');
});

/** A pool whose clients record the statements they are sent (one round trip each). */
function countedPool(texts) {
  return {
    connect: async () => {
      const c = await pool.connect();
      const real = c.query;
      c.query = function recorded(q, ...rest) {
        texts.push(typeof q === 'string' ? q : q.text);
        return real.call(this, q, ...rest);
      };
      const release = c.release;
      c.release = (...a) => { c.query = real; c.release = release; return release.apply(c, a); };
      return c;
    },
  };
}

const ok = (body) => ({ status: 201, body: Buffer.from(body) });

test('doMany: results in input order with each item\'s outcome; the handlers run in input order; a replay comes back in order', async () => {
  const guard = new Guard(pool, { scope: 'batch-a' });
  const [done, other, n1, n2] = [uniqueKey('b-done'), uniqueKey('b-conflict'), uniqueKey('b-new1'), uniqueKey('b-new2')];
  assert.equal((await guard.do(done, 'fp', async () => ok('before'))).outcome, Outcome.EXECUTED);
  assert.equal((await guard.do(other, 'fp-old', async () => ok('old'))).outcome, Outcome.EXECUTED);
  const ran = [];
  const items = [{ key: n2, fingerprint: 'fp' }, { key: done, fingerprint: 'fp' }, { key: other, fingerprint: 'fp-new' },
    { key: n1, fingerprint: 'fp' }];
  const r = await guard.doMany(items, async (claim, item, i) => {
    ran.push(i);
    assert.equal(claim.key, item.key);
    assert.equal(claim.index, i);
    assert.equal(typeof claim.token, 'bigint');
    return ok(`item ${i}`);
  });
  assert.deepEqual(ran, [0, 3]);
  assert.deepEqual(r.map((x) => x.index), [0, 1, 2, 3]);
  assert.deepEqual(r.map((x) => x.key), items.map((x) => x.key));
  assert.deepEqual(r.map((x) => x.outcome), [Outcome.EXECUTED, Outcome.REPLAYED, Outcome.CONFLICT, Outcome.EXECUTED]);
  assert.equal(r[1].response.body.toString(), 'before');
  assert.ok(r[0].expiresAt instanceof Date && r[3].expiresAt instanceof Date);
  assert.ok(r.every((x) => x.error === null && x.duplicateOf === null));
  assert.equal((await lookup(pool, n1, 'batch-a')).state, 'DONE');
  // The retry of the whole batch: every item replayed or refused, in order, nothing run.
  const again = await guard.doMany(items, async () => { throw new Error('must not run'); });
  assert.deepEqual(again.map((x) => x.outcome), [Outcome.REPLAYED, Outcome.REPLAYED, Outcome.CONFLICT, Outcome.REPLAYED]);
  assert.deepEqual(again.map((x) => (x.response ? x.response.body.toString() : null)), ['item 0', 'before', null, 'item 3']);
  assert.deepEqual(await guard.doMany([], async () => ok('x')), []);
});

test('doMany: a key repeated in the batch runs once; its later occurrences get the first one\'s result, with duplicateOf', async () => {
  const guard = new Guard(pool);
  const a = uniqueKey('b-dup');
  const b = uniqueKey('b-dup-other');
  let runs = 0;
  const items = [{ key: a, fingerprint: 'x' }, { key: b, fingerprint: 'x' }, { key: a, fingerprint: 'x' },
    { key: a, fingerprint: 'y' }];
  const r = await guard.doMany(items, async (claim) => { runs += 1; return ok(claim.key); });
  assert.equal(runs, 2);
  assert.deepEqual(r.map((x) => x.outcome), [Outcome.EXECUTED, Outcome.EXECUTED, Outcome.EXECUTED, Outcome.CONFLICT]);
  assert.deepEqual(r.map((x) => x.duplicateOf), [null, null, 0, 0]);
  assert.equal(r[2].index, 2);
  assert.equal(r[2].response.body.toString(), a);
  assert.equal(r[2].token, r[0].token);
  const again = await guard.doMany(items, async () => { runs += 1; return ok('again'); });
  assert.equal(runs, 2);
  assert.deepEqual(again.map((x) => x.outcome), [Outcome.REPLAYED, Outcome.REPLAYED, Outcome.REPLAYED, Outcome.CONFLICT]);
  assert.equal(again[2].response.body.toString(), a);
});

test('doMany: an item in flight is reported per item without waitFor, and waited for with it', async () => {
  const guard = new Guard(pool);
  const held = uniqueKey('b-held');
  const free = uniqueKey('b-free');
  const holder = await holdKey(guard, held);
  const items = [{ key: free, fingerprint: 'fp' }, { key: held, fingerprint: 'fp' }];
  const first = await guard.doMany(items, async () => ok('batch'));
  assert.deepEqual(first.map((x) => x.outcome), [Outcome.EXECUTED, Outcome.IN_FLIGHT]);
  assert.ok(first[1].leaseUntil instanceof Date);
  // With waitFor the batch waits for the holder's answer on that item only.
  const waiting = guard.doMany(items, async () => ok('batch again'), { waitFor: 10000 });
  await sleep(300);
  holder.open(ok('holder'));
  await holder.done;
  const second = await waiting;
  assert.deepEqual(second.map((x) => x.outcome), [Outcome.REPLAYED, Outcome.REPLAYED]);
  assert.deepEqual(second.map((x) => x.response.body.toString()), ['batch', 'holder']);
  // A holder that gives up while the batch waits: the batch claims the item and runs it.
  const k = uniqueKey('b-released');
  const h2 = await holdKey(guard, k);
  const w2 = guard.doMany([{ key: k, fingerprint: 'fp' }], async () => ok('mine'), { waitFor: 10000 });
  await sleep(300);
  h2.open(new Error('holder failed'));
  await h2.done;
  const third = await w2;
  assert.equal(third[0].outcome, Outcome.EXECUTED);
  assert.equal(third[0].response.body.toString(), 'mine');
});

test('doMany: a handler that throws releases only its item; the others are stored; a retry runs that item alone', async () => {
  const guard = new Guard(pool);
  const keys = [uniqueKey('b-f0'), uniqueKey('b-f1'), uniqueKey('b-f2')];
  const items = keys.map((key) => ({ key, fingerprint: 'fp' }));
  const boom = new Error('item 1 failed');
  const r = await guard.doMany(items, async (claim, item, i) => {
    if (i === 1) throw boom;
    return ok(`v${i}`);
  });
  assert.deepEqual(r.map((x) => x.outcome), [Outcome.EXECUTED, Outcome.EXECUTED, Outcome.EXECUTED]);
  assert.equal(r[1].error, boom);
  assert.equal(r[1].failedStep, 'handler');
  assert.equal(r[1].released, true);
  assert.equal(r[1].response, null);
  assert.equal(await lookup(pool, keys[1]), null);
  assert.equal((await lookup(pool, keys[0])).state, 'DONE');
  const ran = [];
  const again = await guard.doMany(items, async (claim, item, i) => { ran.push(i); return ok(`w${i}`); });
  assert.deepEqual(ran, [1]);
  assert.deepEqual(again.map((x) => x.outcome), [Outcome.REPLAYED, Outcome.EXECUTED, Outcome.REPLAYED]);
  assert.deepEqual(again.map((x) => x.response.body.toString()), ['v0', 'w1', 'v2']);
});

test('doMany: one claim and one complete for the whole batch, two round trips on the wire for 50 new items, one for a replay', async () => {
  const counter = wireCounter();
  const texts = counter.texts;
  const guard = new Guard(countingPool(pool, counter));
  const items = Array.from({ length: 50 }, (_, i) => ({ key: uniqueKey(`b-rt${i}`), fingerprint: `fp${i}` }));
  const r = await guard.doMany(items, async (claim, item, i) => ok(`r${i}`), { concurrency: 8 });
  assert.ok(r.every((x) => x.outcome === Outcome.EXECUTED && x.error === null));
  assert.equal(counter.n, 2, texts.join('\n'));
  assert.ok(texts.filter((t) => /idem_begin_many/.test(t)).length <= 1);
  assert.ok(texts.filter((t) => /idem_complete_many/.test(t)).length <= 1);
  assert.equal(texts.filter((t) => /idem_begin\(|idem_complete\(/.test(t)).length, 0);
  counter.reset();
  const again = await guard.doMany(items, async () => ok('no'));
  assert.ok(again.every((x, i) => x.outcome === Outcome.REPLAYED && x.response.body.toString() === `r${i}`));
  assert.equal(counter.n, 1, texts.join('\n'));
});

test('doMany: a store that is down reports every item unavailable, no handler runs; bad items are refused', async () => {
  const { deadPool } = require('./helpers');
  const dead = deadPool();
  try {
    let runs = 0;
    const r = await new Guard(dead, { timeout: 3000 }).doMany([{ key: 'a', fingerprint: '' }, { key: 'b' }], async () => { runs += 1; return ok('x'); });
    assert.equal(runs, 0);
    assert.deepEqual(r.map((x) => [x.outcome, x.failedStep]), [[Outcome.UNAVAILABLE, 'begin'], [Outcome.UNAVAILABLE, 'begin']]);
  } finally {
    await dead.end();
  }
  const guard = new Guard(pool);
  await assert.rejects(guard.doMany('nope', async () => ok('x')), TypeError);
  await assert.rejects(guard.doMany([{ key: 1 }], async () => ok('x')), /items\[0\]\.key must be a string/);
  // The server's own checks: an empty key is refused naming its position; nothing claimed.
  const k = uniqueKey('b-bad');
  const r = await guard.doMany([{ key: k }, { key: '' }], async () => ok('x'));
  assert.ok(r.every((x) => x.outcome === Outcome.UNAVAILABLE && x.error && x.error.code === '22023'));
  assert.match(r[0].error.message, /keys\[2\]/);
  assert.equal(await lookup(pool, k), null);
});

test('transactionMany: the writes of every item commit with their claims; a throwing item is rolled back to its savepoint and released', async () => {
  const c = await pool.connect();
  try {
    const keys = [uniqueKey('t-0'), uniqueKey('t-1'), uniqueKey('t-2')];
    const items = [...keys.map((key) => ({ key, fingerprint: 'fp' })), { key: keys[0], fingerprint: 'fp' }];
    const r = await transactionMany(c, items, async (claim, item, i) => {
      await claim.client.query('INSERT INTO batch_effects VALUES ($1, $2)', [claim.key, `item ${i}`]);
      if (i === 1) throw new Error('no');
      return ok(`t${i}`);
    }, { scope: 'tx-batch' });
    assert.equal(c.getTransactionStatus(), 'I');
    assert.deepEqual(r.map((x) => x.outcome), [Outcome.EXECUTED, Outcome.EXECUTED, Outcome.EXECUTED, Outcome.EXECUTED]);
    assert.equal(r[1].error.message, 'no');
    assert.equal(r[1].released, true);
    assert.equal(r[3].duplicateOf, 0);
    const rows = await pool.query('SELECT key, count(*)::int AS n FROM batch_effects WHERE key = ANY($1) GROUP BY key ORDER BY key', [keys]);
    assert.deepEqual(rows.rows.map((x) => [x.key, x.n]).sort(), [[keys[0], 1], [keys[2], 1]].sort());
    assert.equal(await lookup(pool, keys[1], 'tx-batch'), null);
    assert.equal((await lookup(pool, keys[2], 'tx-batch')).state, 'DONE');
    const again = await transactionMany(c, items, async (claim, item, i) => {
      await claim.client.query('INSERT INTO batch_effects VALUES ($1, $2)', [claim.key, `again ${i}`]);
      return ok(`again${i}`);
    }, { scope: 'tx-batch' });
    assert.deepEqual(again.map((x) => x.outcome), [Outcome.REPLAYED, Outcome.EXECUTED, Outcome.REPLAYED, Outcome.REPLAYED]);
    assert.deepEqual(again.map((x) => x.response.body.toString()), ['t0', 'again1', 't2', 't0']);
    const n = await pool.query('SELECT count(*)::int AS n FROM batch_effects WHERE key = ANY($1)', [keys]);
    assert.equal(n.rows[0].n, 3);
  } finally {
    c.release();
  }
});

test('transactionMany: an error outside the handlers (a superseded claim at complete) rolls the whole batch back', async () => {
  const c = await pool.connect();
  try {
    const key = uniqueKey('t-abort');
    await assert.rejects(transactionMany(c, [{ key, fingerprint: 'fp' }], async (claim) => {
      await claim.client.query('INSERT INTO batch_effects VALUES ($1, $2)', [claim.key, 'doomed']);
      // The claim is taken away inside the transaction: idem_complete_many fails (ID003).
      await claim.client.query('SELECT idem_release($1, $2::bigint)', [claim.key, String(claim.token)]);
      return ok('x');
    }), (e) => e.code === 'ID003');
    assert.equal(c.getTransactionStatus(), 'I');
    const n = await pool.query('SELECT count(*)::int AS n FROM batch_effects WHERE key = $1', [key]);
    assert.equal(n.rows[0].n, 0);
  } finally {
    c.release();
  }
});
