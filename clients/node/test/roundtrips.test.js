'use strict';

// Round trips counted on the wire (helpers.wireCounter: a Sync or a
// simple Query message each) for the paths the other files do not count:
// transactionMany, the Express middleware in both modes, the steps.

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const { Guard, Outcome, transactionMany, idempotency } = require('..');
const { makePool, uniqueKey, wireCounter, countingPool, listen } = require('./helpers');

const pool = makePool({ max: 4 });
test.after(() => pool.end());
const ok = (body) => ({ status: 201, body: Buffer.from(body) });

test('transactionMany: claim 1, a savepoint per item, complete with COMMIT 1; a replay 2 (claim, ROLLBACK)', async () => {
  const c = await pool.connect();
  const counter = wireCounter();
  counter.count(c);
  try {
    const items = [0, 1, 2].map((i) => ({ key: uniqueKey(`rt-many${i}`), fingerprint: 'fp' }));
    const r = await transactionMany(c, items, async () => ok('x'));
    assert.deepEqual(r.map((x) => [x.outcome, String(x.error)]), items.map(() => [Outcome.EXECUTED, 'null']));
    assert.equal(counter.n, 1 + 3 + 1, counter.texts.join('\n'));
    counter.reset();
    const again = await transactionMany(c, items, async () => ok('y'));
    assert.ok(again.every((x) => x.outcome === Outcome.REPLAYED));
    assert.equal(counter.n, 2);
  } finally {
    counter.restore();
    c.release();
  }
});

test('steps: a step\'s checkpoint is one round trip; stepTx two besides the step\'s statements', async () => {
  const counter = wireCounter();
  const guard = new Guard(countingPool(pool, counter));
  const seen = [];
  const r = await guard.do(uniqueKey('rt-steps'), 'fp', async (claim) => {
    counter.reset();
    await claim.step('one', async () => 'a');
    seen.push(counter.n);
    counter.reset();
    await claim.stepTx('two', async (client) => {
      await client.query('SELECT 1');
      return 'b';
    });
    seen.push(counter.n);
    counter.reset();
    return ok('done');
  });
  assert.equal(r.outcome, Outcome.EXECUTED, String(r.error));
  assert.deepEqual(seen, [1, 3]);
  assert.equal(counter.n, 1); // the complete
});

for (const transactional of [false, true]) {
  test(`Express middleware (${transactional ? 'transactional' : 'default'} mode): a replay is ${transactional ? 2 : 1} round trip(s), a new key ${transactional ? '2 besides the handler\'s' : 2}`, async () => {
    const counter = wireCounter();
    const guard = new Guard(countingPool(pool, counter), { retention: 3600000 });
    const app = express();
    app.use(express.json());
    app.post('/o', idempotency(guard, { shared: true, transactional }), async (req, res) => {
      res.status(201).json({ ok: 1 });
    });
    const server = await listen(app);
    try {
      const url = `${server.url}/o`;
      const key = uniqueKey('rt-mw');
      const post = () => fetch(url, { method: 'POST', headers: { 'Idempotency-Key': key, 'Content-Type': 'application/json' }, body: '{"a":1}' });
      assert.equal((await post()).status, 201);
      assert.equal(counter.n, 2, counter.texts.join('\n'));
      counter.reset();
      const again = await post();
      assert.equal(again.status, 201);
      assert.equal(counter.n, transactional ? 2 : 1, counter.texts.join('\n'));
    } finally {
      await server.close();
    }
  });
}
