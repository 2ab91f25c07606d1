'use strict';

// The reference Go guard's two tests, against the real server.  The Go
// test's lease (1 s) and window (1 h) become 10 s and 1 h; its clock moves
// (2 s, then 2 h) become idem.clock_offset, set per call by the guard.

const test = require('node:test');
const assert = require('node:assert/strict');
const { Guard, Outcome, failTimes, UnavailableError } = require('..');
const { makePool, uniqueKey, Ledger, ledgerHandler, countOutcomes, deadPool, lookup } = require('./helpers');

const LEASE_MS = 10000;
const RETENTION_MS = 3600 * 1000;
const PAST_LEASE_S = 20;
const PAST_WINDOW_S = 7200;

const pool = makePool({ max: 12 });
test.after(() => pool.end());

test('eight concurrent callers, one key: executed=1 calls=1 stock=9; changed fingerprint is a conflict', async () => {
  const guard = new Guard(pool, { lease: LEASE_MS, retention: RETENTION_MS });
  const key = uniqueKey('order-1');
  const ledger = new Ledger(10);
  const calls = { n: 0 };
  const results = await Promise.all(Array.from({ length: 8 }, () =>
    guard.do(key, 'sku=A&qty=1', ledgerHandler(ledger, key, calls, 20))));
  const counts = countOutcomes(results);
  assert.equal(counts.executed, 1, JSON.stringify(counts));
  assert.equal(counts.in_flight + counts.replayed, 7);
  assert.equal(counts.unavailable + counts.conflict, 0);
  assert.equal(calls.n, 1);
  assert.equal(ledger.stock, 9);
  assert.equal(ledger.reservations.size, 1);
  assert.equal(ledger.charges.size, 1);
  for (const r of results) assert.equal(r.error, null);
  const executed = results.find((r) => r.outcome === Outcome.EXECUTED);
  assert.equal(executed.response.status, 200);
  assert.deepEqual(executed.response.body, Buffer.from('paid'));
  for (const r of results.filter((x) => x.outcome === Outcome.REPLAYED)) {
    assert.equal(r.response.status, 200);
    assert.deepEqual(r.response.body, Buffer.from('paid'));
  }

  const conflict = await guard.do(key, 'sku=A&qty=2', ledgerHandler(ledger, key, calls, 0));
  assert.equal(conflict.outcome, Outcome.CONFLICT);
  assert.equal(conflict.response, null);
  assert.equal(calls.n, 1);
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(row.status, 200);
});

test('complete fails once: in flight in the lease, takeover after it, executed again after the window; no server: unavailable', async () => {
  let offset = 0;
  const guard = new Guard(pool, {
    lease: LEASE_MS,
    retention: RETENTION_MS,
    fault: failTimes(1, 'complete'),
    clockOffset: () => offset,
  });
  const key = uniqueKey('order-2');
  const ledger = new Ledger(10);
  const calls = { n: 0 };
  const h = ledgerHandler(ledger, key, calls, 0);

  const first = await guard.do(key, 'sku=A&qty=1', h);
  assert.equal(first.outcome, Outcome.EXECUTED);
  assert.equal(first.failedStep, 'complete');
  assert.ok(first.error instanceof UnavailableError);
  assert.equal((await lookup(pool, key)).state, 'PROCESSING');

  const inLease = await guard.do(key, 'sku=A&qty=1', h);
  assert.equal(inLease.outcome, Outcome.IN_FLIGHT);
  assert.equal(calls.n, 1);

  offset = PAST_LEASE_S;
  const takeover = await guard.do(key, 'sku=A&qty=1', h);
  assert.equal(takeover.outcome, Outcome.EXECUTED);
  assert.equal(takeover.failedStep, null);
  assert.ok(takeover.token > first.token, 'a takeover gets a greater token');
  assert.equal(calls.n, 2);
  assert.equal(ledger.stock, 9);
  assert.equal(ledger.reservations.size, 1);
  assert.equal(ledger.charges.size, 1);
  const replay = await guard.do(key, 'sku=A&qty=1', h);
  assert.equal(replay.outcome, Outcome.REPLAYED);
  assert.equal(calls.n, 2);

  offset = PAST_LEASE_S + PAST_WINDOW_S;
  const window = await guard.do(key, 'sku=A&qty=1', h);
  assert.equal(window.outcome, Outcome.EXECUTED);
  assert.equal(window.failedStep, null);
  assert.equal(calls.n, 3);
  assert.equal(ledger.stock, 9);

  const down = deadPool();
  try {
    const downGuard = new Guard(down, { lease: LEASE_MS, retention: RETENTION_MS, timeout: 3000 });
    const r = await downGuard.do(uniqueKey('order-3'), 'sku=A&qty=1', h);
    assert.equal(r.outcome, Outcome.UNAVAILABLE);
    assert.equal(r.failedStep, 'begin');
    assert.ok(r.error instanceof UnavailableError, String(r.error));
    assert.equal(calls.n, 3);
  } finally {
    await down.end();
  }
});
