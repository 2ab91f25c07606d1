'use strict';

// A crash mid-request: the app process is killed while its handler runs
// (the client's connection is cut).  The key stays claimed for its lease
// (retries wait, then get 409 until the lease ends), then a new app takes
// it over with a greater token.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawn } = require('node:child_process');
const readline = require('node:readline');
const { makePool, uniqueKey, lookup, listen, recordPid } = require('./helpers');
const { createApp } = require('./app');

// The killed app's lease: long enough to cover the kill, the restart and
// the retry on a slow machine.  The clock is then moved past it.
const CRASHED_LEASE_MS = 600 * 1000;
const PAST_LEASE_S = 1200;

const pool = makePool({ max: 8 });
test.after(() => pool.end());

/** Start test/app.js in its own process; resolves to { child, url, lines }. */
function startChild(env) {
  const child = spawn(process.execPath, [path.join(__dirname, 'app.js')], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  recordPid(child.pid);
  const lines = [];
  const waiting = [];
  readline.createInterface({ input: child.stdout }).on('line', (line) => {
    const msg = JSON.parse(line);
    const w = waiting.findIndex((x) => x.field in msg);
    if (w >= 0) waiting.splice(w, 1)[0].resolve(msg);
    else lines.push(msg);
  });
  const next = (field) => {
    const i = lines.findIndex((m) => field in m);
    if (i >= 0) return Promise.resolve(lines.splice(i, 1)[0]);
    return new Promise((resolve, reject) => {
      waiting.push({ field, resolve });
      child.once('exit', () => reject(new Error(`app exited before printing ${field}`)));
    });
  };
  return next('port').then((m) => ({ child, url: `http://127.0.0.1:${m.port}`, next }));
}

test('app killed mid-request: the retry is 409 inside the lease (Retry-After until it ends), taken over after it, then replayed', async (t) => {
  const { child, url, next } = await startChild({ IDEM_APP_CRASH_ON_PAY: '1', IDEM_APP_LEASE_MS: String(CRASHED_LEASE_MS) });
  const exited = new Promise((resolve) => child.once('exit', resolve));
  t.after(() => { if (child.exitCode === null) child.kill('SIGKILL'); });

  const key = uniqueKey('crash');
  const body = JSON.stringify({ amount: 10 });
  const headers = { 'Content-Type': 'application/json', 'Idempotency-Key': key };
  const inflight = fetch(`${url}/pay`, { method: 'POST', headers, body }).then(() => null, (err) => err);
  const { started } = await next('started');
  child.kill('SIGKILL');
  await exited;
  const cut = await inflight;
  assert.ok(cut instanceof TypeError, 'the request failed: its connection was cut');

  const row = await lookup(pool, key);
  assert.equal(row.state, 'PROCESSING');
  assert.equal(String(row.token), started);

  // A new app instance on the same database; the clock is moved with idem.clock_offset.
  let offset = 0;
  const { app, state } = createApp(pool, { lease: 10000, clockOffset: () => offset });
  const srv = await listen(app);
  t.after(() => srv.close());

  // The retry waits (the middleware's 5 s) for an answer that never comes, then 409 until the lease ends.
  const retry = await fetch(`${srv.url}/pay`, { method: 'POST', headers, body });
  assert.equal(retry.status, 409);
  const after = Number(retry.headers.get('retry-after'));
  assert.ok(after > CRASHED_LEASE_MS / 2000 && after <= CRASHED_LEASE_MS / 1000, `Retry-After ${retry.headers.get('retry-after')}`);
  assert.equal(state.calls.pay, undefined);

  offset = PAST_LEASE_S; // past the killed app's lease
  const takeover = await fetch(`${srv.url}/pay`, { method: 'POST', headers, body });
  assert.equal(takeover.status, 201);
  assert.equal(takeover.headers.get('idempotent-replayed'), null);
  const paid = await takeover.json();
  assert.equal(paid.paid, 10);
  assert.ok(BigInt(paid.token) > BigInt(started), 'a greater fencing token');
  assert.equal(state.calls.pay, 1);

  const replay = await fetch(`${srv.url}/pay`, { method: 'POST', headers, body });
  assert.equal(replay.status, 201);
  assert.equal(replay.headers.get('idempotent-replayed'), 'true');
  assert.deepEqual(await replay.json(), paid);
  assert.equal(state.calls.pay, 1);
  const done = await lookup(pool, key);
  assert.equal(done.state, 'DONE');
  assert.equal(String(done.token), paid.token);
});
