'use strict';

// A client-side timeout must cancel the server-side wait and leave no
// orphan claim.  node-pg's query_timeout does not (the trap, shown first).

const test = require('node:test');
const assert = require('node:assert/strict');
const pg = require('pg');
const { Guard, Outcome, transaction, TimeoutError, UnavailableError } = require('..');
const { makePool, uniqueKey, sleep, waitFor, lookup } = require('./helpers');

const pool = makePool({ max: 10 });
test.after(() => pool.end());

/** Holders not ended yet: a test that fails before ending its own still lets the file finish. */
const holders = new Set();
test.afterEach(async () => {
  for (const holder of holders) await endHolder(holder).catch(() => {});
});

/** A session holding an uncommitted claim of key. */
async function holdClaim(key) {
  const holder = new pg.Client();
  holders.add(holder);
  await holder.connect();
  await holder.query('BEGIN');
  const r = await holder.query("SELECT claimed FROM public.idem_begin($1::text, 'fp'::text, '60s'::interval)", [key]);
  assert.equal(r.rows[0].claimed, true);
  return holder;
}

async function endHolder(holder) {
  holders.delete(holder);
  try {
    await holder.query('ROLLBACK');
  } finally {
    await holder.end();
  }
}

/** Sessions waiting in idem_begin behind holder's claim (as seen in pg_stat_activity). */
async function waiters(holder) {
  const r = await pool.query(`SELECT count(*)::int AS n FROM pg_stat_activity
    WHERE $1::integer = ANY (pg_catalog.pg_blocking_pids(pid)) AND wait_event_type = 'Lock'
      AND query LIKE '%idem_begin%'`, [holder.processID]);
  return r.rows[0].n;
}

test('the trap: node-pg query_timeout abandons a waiting idem_begin, which later claims the key with nobody to complete it', async () => {
  const key = uniqueKey('trap');
  const holder = await holdClaim(key);
  const naive = new pg.Client({ query_timeout: 300 });
  naive.on('error', () => {});
  await naive.connect();
  try {
    await assert.rejects(naive.query("SELECT * FROM public.idem_begin($1::text, 'fp'::text, '60s'::interval)", [key]),
      /timeout/i);
    await endHolder(holder);
    // The abandoned statement goes on, claims the key and commits it.
    assert.ok(await waitFor(async () => (await lookup(pool, key)) !== null, 30000));
    assert.equal((await lookup(pool, key)).state, 'PROCESSING');
  } finally {
    await naive.end().catch(() => {});
  }
});

test('Guard timeout: the server cancels the wait (57014), no orphan claim, the key free afterwards', async () => {
  const key = uniqueKey('guard-timeout');
  const holder = await holdClaim(key);
  // An open idle connection in the pool: the 300 ms go to the wait, not to connecting.
  await pool.query('SELECT 1');
  const guard = new Guard(pool, { timeout: 300, lease: 60000 });
  let calls = 0;
  const t0 = Date.now();
  const r = await guard.do(key, 'fp', async () => { calls += 1; return { status: 200 }; });
  const elapsed = Date.now() - t0;
  assert.equal(r.outcome, Outcome.UNAVAILABLE);
  assert.ok(r.error instanceof TimeoutError, String(r.error));
  // A SQLSTATE: the server cancelled the wait itself (the client's own deadline has none).
  assert.ok(['57014', '55P03'].includes(r.error.code), `code ${r.error.code}`);
  assert.ok(elapsed >= 250, `cancelled after ${elapsed} ms`);
  assert.equal(calls, 0);
  assert.equal(await waiters(holder), 0, 'nothing is still waiting on the server');
  await endHolder(holder);
  await sleep(300);
  assert.equal(await lookup(pool, key), null, 'no orphan claim');
  // This call must succeed: a generous timeout.
  const again = await guard.do(key, 'fp', async () => { calls += 1; return { status: 200 }; }, { timeout: 10000 });
  assert.equal(again.outcome, Outcome.EXECUTED);
  assert.equal(calls, 1);
});

test('Guard timeout when the server does not answer at all: the client cuts the link, the claim never commits', async (t) => {
  const TIMEOUT = 2000;
  const single = makePool({ max: 1 });
  let pid = null;
  single.on('connect', (c) => { pid = c.processID; });
  const guard = new Guard(single, { timeout: TIMEOUT, lease: 60000 });
  const key = uniqueKey('stopped');
  let stopped = false;
  try {
    // Opens the pool's one connection; this call must succeed: a generous timeout.
    assert.equal((await guard.do(uniqueKey('warm'), 'fp', async () => ({ status: 200 }), { timeout: 10000 })).outcome,
      Outcome.EXECUTED);
    assert.ok(pid > 0);
    try {
      process.kill(pid, 0);
    } catch {
      t.skip('cannot signal the server process');
      return;
    }
    const holder = await holdClaim(key);
    const t0 = Date.now();
    const pending = guard.do(key, 'fp', async () => ({ status: 200 }));
    // Stopped once it waits for the claim, long before its own timeout fires.
    assert.ok(await waitFor(async () => (await waiters(holder)) === 1, TIMEOUT), 'the guard waits for the claim');
    process.kill(pid, 'SIGSTOP'); // the backend answers nothing, not even its statement_timeout
    stopped = true;
    // Its timeout error would come only after the wait ends: still waiting, it has sent nothing.
    assert.equal(await waiters(holder), 1, 'stopped while still waiting');
    const r = await pending;
    const elapsed = Date.now() - t0;
    assert.equal(r.outcome, Outcome.UNAVAILABLE);
    assert.ok(r.error instanceof TimeoutError, String(r.error));
    assert.equal(r.error.code, null, 'the client deadline, not a server error');
    // The client gives the server its timeout and time to report it before cutting.
    assert.ok(elapsed >= TIMEOUT + 500, `cut after ${elapsed} ms, the server's timeout ${TIMEOUT} ms`);
    await endHolder(holder); // the key is free: the stopped backend, once resumed, could claim it
    process.kill(pid, 'SIGCONT');
    stopped = false;
    const gone = await waitFor(async () => {
      const a = await pool.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE pid = $1', [pid]);
      return a.rows[0].n === 0;
    });
    assert.ok(gone, 'the cut session ended');
    assert.equal(await lookup(pool, key), null, 'no orphan claim');
  } finally {
    if (stopped) process.kill(pid, 'SIGCONT');
    await single.end();
  }
});

test('transaction helper timeout: TimeoutError, rolled back, no claim, the client idle and usable', async () => {
  const key = uniqueKey('tx-timeout');
  const holder = await holdClaim(key);
  const client = await pool.connect();
  try {
    let calls = 0;
    await assert.rejects(transaction(client, key, 'fp', async () => { calls += 1; return { status: 200 }; }, { timeout: 300 }),
      (e) => e instanceof TimeoutError);
    assert.equal(calls, 0);
    const st = await client.query("SELECT pg_catalog.current_setting('statement_timeout') AS st, now() = statement_timestamp() AS idle");
    assert.equal(st.rows[0].st, '0', 'SET LOCAL ended with the transaction');
    assert.equal(st.rows[0].idle, true, 'not left inside a transaction');
    await endHolder(holder);
    await sleep(200);
    assert.equal(await lookup(pool, key), null);
    // Within the timeout the helper restores statement_timeout for the handler's statements.
    const r = await transaction(client, key, 'fp', async (claim) => {
      const s = await claim.client.query("SELECT pg_catalog.current_setting('statement_timeout') AS st");
      return { status: 200, body: s.rows[0].st };
    }, { timeout: 10000 }); // this call must succeed: a generous timeout
    assert.equal(r.outcome, Outcome.EXECUTED);
    assert.deepEqual(r.response.body, Buffer.from('0'));
  } finally {
    client.release();
  }
});

test('the guard\'s connection killed while it waits (pg_terminate_backend): unavailable, no claim, the next call reconnects', async () => {
  const single = makePool({ max: 1 });
  let pid = null;
  single.on('connect', (c) => { pid = c.processID; });
  const guard = new Guard(single, { timeout: 10000, lease: 60000 });
  try {
    assert.equal((await guard.do(uniqueKey('warm'), 'fp', async () => ({ status: 200 }))).outcome, Outcome.EXECUTED);
    const firstPid = pid;
    const key = uniqueKey('terminated');
    const holder = await holdClaim(key);
    let calls = 0;
    const pending = guard.do(key, 'fp', async () => { calls += 1; return { status: 200 }; });
    assert.ok(await waitFor(async () => (await waiters(holder)) === 1));
    await pool.query('SELECT pg_catalog.pg_terminate_backend($1::integer)', [firstPid]);
    const r = await pending;
    assert.equal(r.outcome, Outcome.UNAVAILABLE);
    assert.ok(r.error instanceof UnavailableError, String(r.error));
    assert.ok(!(r.error instanceof TimeoutError));
    assert.equal(calls, 0);
    await endHolder(holder);
    await sleep(200);
    assert.equal(await lookup(pool, key), null);
    const again = await guard.do(key, 'fp', async () => { calls += 1; return { status: 200 }; });
    assert.equal(again.outcome, Outcome.EXECUTED);
    assert.notEqual(pid, firstPid, 'a new connection');
    assert.equal(calls, 1);
  } finally {
    await single.end();
  }
});
