'use strict';

// Steps (issue #27): claim.step and claim.stepTx checkpoint each finished
// step; a retry that takes the key over after the lease skips them with
// their outputs and runs the rest.  A stale holder's stepTx is refused
// before its writes; a checkpoint of a completed key is refused.

const test = require('node:test');
const assert = require('node:assert/strict');
const {
  Guard, Outcome, Store, TokenSupersededError, NoClaimError, AlreadyCompletedError, CheckpointDataError,
  stepIdempotencyKey,
} = require('..');
const { makePool, uniqueKey } = require('./helpers');

const pool = makePool({ max: 10 });
test.after(() => pool.end());

const LEASE = 10000; // ms; the tests move the clock 20 s to end it
const crash = new Error('the process stopped here');

/** A guard whose clock the test moves (idem.clock_offset, in seconds). */
function clockGuard(options = {}) {
  const clock = { offset: 0 };
  const guard = new Guard(pool, { lease: LEASE, clockOffset: () => clock.offset, ...options });
  return { guard, clock };
}

async function table() {
  const name = `step_rows_${uniqueKey('t').replace(/[^a-z0-9]/gi, '_')}`.toLowerCase();
  await pool.query(`CREATE TABLE ${name} (step text NOT NULL, token bigint NOT NULL)`);
  return name;
}

async function rows(name) {
  return (await pool.query(`SELECT step, token FROM ${name} ORDER BY step`)).rows.map((r) => `${r.step}:${r.token}`);
}

test('three steps stopped after the second: the retry skips two with their outputs and runs the third once', async () => {
  const { guard, clock } = clockGuard();
  const key = uniqueKey('steps');
  const runs = { reserve: 0, charge: 0, ship: 0 };
  const providerKeys = [];
  let seen = null;
  const handler = (stopAfterCharge) => async (claim) => {
    const hold = await claim.step('reserve', async (s) => {
      runs.reserve += 1;
      return { hold: `hold-${s.token}`, token: s.token.toString() };
    });
    const charge = await claim.step('charge', async (s) => {
      runs.charge += 1;
      providerKeys.push(s.idempotencyKey);
      return { id: `ch-${s.token}` };
    });
    if (stopAfterCharge) throw crash;
    const shipped = await claim.step('ship', async () => {
      runs.ship += 1;
      return `shipped ${hold.hold} ${charge.id}`;
    });
    seen = { resumedFrom: claim.resumedFrom, done: claim.stepsDone() };
    return { status: 201, body: shipped };
  };

  const first = await guard.do(key, 'fp', handler(true));
  assert.equal(first.outcome, Outcome.EXECUTED);
  assert.equal(first.error, crash);
  assert.equal(first.failedStep, 'handler');
  // A claim with finished steps is left to its lease, not released.
  assert.equal(first.released, false);
  assert.deepEqual(first.steps, ['reserve', 'charge']);
  assert.deepEqual(runs, { reserve: 1, charge: 1, ship: 0 });

  const inLease = await guard.do(key, 'fp', handler(false));
  assert.equal(inLease.outcome, Outcome.IN_FLIGHT);

  clock.offset = 20;
  const retry = await guard.do(key, 'fp', handler(false));
  assert.equal(retry.outcome, Outcome.EXECUTED, String(retry.error));
  assert.equal(retry.error, null);
  assert.ok(retry.token > first.token);
  assert.equal(retry.resumedFrom, 'charge');
  assert.deepEqual(runs, { reserve: 1, charge: 1, ship: 1 });
  // ship got the first attempt's outputs.
  assert.equal(retry.response.body.toString(), `shipped hold-${first.token} ch-${first.token}`);
  assert.deepEqual(seen, { resumedFrom: 'charge', done: ['reserve', 'charge', 'ship'] });
  assert.deepEqual(providerKeys, [`${key}:charge`]);

  const replay = await guard.do(key, 'fp', handler(false));
  assert.equal(replay.outcome, Outcome.REPLAYED);
  assert.equal(replay.response.body.toString(), retry.response.body.toString());
  assert.equal(runs.ship, 1);
});

test('a step stopped between the provider call and its checkpoint runs again with the same provider key', async () => {
  const { guard, clock } = clockGuard({ scope: 'tenant-s' });
  const key = uniqueKey('provider');
  const provider = new Map(); // idempotency key -> charge id, as a payment provider keeps them
  const tokens = [];
  const handler = (stop) => async (claim) => {
    const id = await claim.step('charge', async (s) => {
      tokens.push(s.token);
      if (!provider.has(s.idempotencyKey)) provider.set(s.idempotencyKey, `ch-${provider.size + 1}`);
      if (stop) throw crash; // charged, then stopped before the checkpoint
      return provider.get(s.idempotencyKey);
    });
    return { status: 200, body: id };
  };
  const first = await guard.do(key, 'fp', handler(true), { keepClaimOnError: true });
  assert.equal(first.error, crash);
  clock.offset = 20;
  const retry = await guard.do(key, 'fp', handler(false));
  assert.equal(retry.outcome, Outcome.EXECUTED);
  assert.equal(retry.response.body.toString(), 'ch-1');
  assert.equal(provider.size, 1);
  assert.deepEqual([...provider.keys()], [`tenant-s:${key}:charge`]);
  assert.equal(stepIdempotencyKey('tenant-s', key, 'charge'), `tenant-s:${key}:charge`);
  assert.ok(tokens[1] > tokens[0]);
});

test('stepTx: the writes and the checkpoint commit together; an error rolls both back', async () => {
  const { guard, clock } = clockGuard();
  const key = uniqueKey('steptx');
  const t = await table();
  let bRuns = 0;
  const handler = (fail) => async (claim) => {
    const a = await claim.stepTx('a', async (client, s) => {
      await client.query(`INSERT INTO ${t} VALUES ($1, $2)`, [s.name, s.token.toString()]);
      return s.token.toString();
    });
    const b = await claim.stepTx('b', async (client, s) => {
      bRuns += 1;
      await client.query(`INSERT INTO ${t} VALUES ($1, $2)`, [s.name, s.token.toString()]);
      if (fail) throw new Error('the business refused');
      return s.token.toString();
    });
    return { status: 200, body: `${a} ${b}` };
  };
  const first = await guard.do(key, 'fp', handler(true));
  assert.equal(first.failedStep, 'handler');
  assert.equal(first.error.message, 'the business refused');
  assert.deepEqual(await rows(t), [`a:${first.token}`]);
  assert.deepEqual(first.steps, ['a']);
  clock.offset = 20;
  const retry = await guard.do(key, 'fp', handler(false));
  assert.equal(retry.outcome, Outcome.EXECUTED, String(retry.error));
  assert.equal(retry.resumedFrom, 'a');
  assert.deepEqual(await rows(t), [`a:${first.token}`, `b:${retry.token}`]);
  assert.equal(retry.response.body.toString(), `${first.token} ${retry.token}`);
  assert.equal(bRuns, 2);
});

test('a stale holder: its stepTx is refused before its write, its step\'s checkpoint is refused', async () => {
  const { guard, clock } = clockGuard();
  const key = uniqueKey('stale');
  const t = await table();
  let txRan = false;
  let stepRan = false;
  let staleTx = null;
  let staleStep = null;
  let takeover = null;
  const first = await guard.do(key, 'fp', async (claim) => {
    await claim.stepTx('reserve', async (client, s) => {
      await client.query(`INSERT INTO ${t} VALUES ($1, $2)`, [s.name, s.token.toString()]);
      return true;
    });
    // This holder stalls past its lease; another caller takes the key
    // over and keeps it (its handler fails after resuming).
    clock.offset = 20;
    takeover = await guard.do(key, 'fp', async (c2) => {
      assert.equal(c2.resumedFrom, 'reserve');
      throw crash;
    });
    // The stale holder goes on.
    try {
      await claim.stepTx('charge', async (client, s) => {
        txRan = true;
        await client.query(`INSERT INTO ${t} VALUES ($1, $2)`, [s.name, s.token.toString()]);
        return true;
      });
    } catch (err) {
      staleTx = err;
    }
    try {
      await claim.step('notify', async () => {
        stepRan = true;
        return true;
      });
    } catch (err) {
      staleStep = err;
    }
    return { status: 200 };
  });
  assert.equal(takeover.outcome, Outcome.EXECUTED);
  assert.equal(takeover.error, crash);
  assert.equal(takeover.released, false);
  assert.ok(takeover.token > first.token);
  assert.ok(staleTx instanceof TokenSupersededError, String(staleTx));
  assert.equal(staleTx.code, 'ID002');
  assert.equal(txRan, false);
  // Work outside the database cannot be held back; its checkpoint is refused.
  assert.ok(staleStep instanceof TokenSupersededError, String(staleStep));
  assert.equal(stepRan, true);
  assert.deepEqual(await rows(t), [`reserve:${first.token}`]);
  // The stale holder's complete is refused too.
  assert.equal(first.failedStep, 'complete');
  assert.ok(first.error instanceof TokenSupersededError);
});

test('idem_checkpoint is fenced: no claim, a superseded token, a completed key, an empty phase', async () => {
  const store = new Store();
  const c = await pool.connect();
  try {
    const key = uniqueKey('cp');
    await assert.rejects(store.checkpoint(c, { key, token: 1n, phase: 'a', data: '{"a":1}' }), NoClaimError);
    const row = await store.begin(c, { key, fingerprint: 'fp', lease: LEASE });
    assert.equal(row.claimed, true);
    assert.equal(row.phase, null);
    await store.checkpoint(c, { key, token: row.token, phase: 'a', data: '{"a":1}' });
    await assert.rejects(store.checkpoint(c, { key, token: row.token, phase: '' }), (err) => ['22023', '22004'].includes(err.code));
    await c.query("SELECT pg_catalog.set_config('idem.clock_offset', '20', false)");
    const again = await store.begin(c, { key, fingerprint: 'fp', lease: LEASE });
    assert.equal(again.claimed, true);
    assert.equal(again.phase, 'a');
    assert.equal(again.phaseData.toString(), '{"a":1}');
    await assert.rejects(store.checkpoint(c, { key, token: row.token, phase: 'b' }), TokenSupersededError);
    await store.complete(c, { key, fingerprint: 'fp', status: 200, token: again.token });
    await assert.rejects(store.checkpoint(c, { key, token: again.token, phase: 'b' }), AlreadyCompletedError);
  } finally {
    await c.query("SELECT pg_catalog.set_config('idem.clock_offset', '0', false)");
    c.release();
  }
});

test('a recovery point that steps did not write: the step refuses to guess', async () => {
  const { guard, clock } = clockGuard();
  const key = uniqueKey('foreign');
  const store = new Store();
  const c = await pool.connect();
  try {
    const row = await store.begin(c, { key, fingerprint: 'fp', lease: LEASE });
    await store.checkpoint(c, { key, token: row.token, phase: 'x', data: 'not json' });
  } finally {
    c.release();
  }
  clock.offset = 20;
  let ran = false;
  const r = await guard.do(key, 'fp', async (claim) => {
    await claim.step('x', async () => { ran = true; });
    return { status: 200 };
  });
  assert.equal(r.failedStep, 'handler');
  assert.ok(r.error instanceof CheckpointDataError, String(r.error));
  assert.equal(ran, false);
  assert.equal(r.resumedFrom, 'x');
});

test('a step called twice in one claim runs once; a step without checkpointable output fails', async () => {
  const guard = new Guard(pool, { lease: LEASE });
  let runs = 0;
  const r = await guard.do(uniqueKey('twice'), 'fp', async (claim) => {
    const a = await claim.step('once', async () => { runs += 1; return { n: 1 }; });
    const b = await claim.step('once', async () => { runs += 1; return { n: 2 }; });
    await assert.rejects(claim.step('big', async () => 1n), TypeError);
    await assert.rejects(claim.step('', async () => 1), TypeError);
    return { status: 200, body: JSON.stringify([a, b]) };
  });
  assert.equal(r.outcome, Outcome.EXECUTED, String(r.error));
  assert.equal(r.response.body.toString(), '[{"n":1},{"n":1}]');
  assert.equal(runs, 1);
  // Without finished steps, a handler error still releases the claim.
  const released = await guard.do(uniqueKey('rel'), 'fp', async () => { throw crash; });
  assert.equal(released.released, true);
});
