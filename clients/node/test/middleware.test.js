'use strict';

// The Express middleware over real HTTP (fetch) against a running app.

const test = require('node:test');
const assert = require('node:assert/strict');
const { makePool, uniqueKey, sleep, waitFor, untilWaitingInServer, lookup, listen, deadPool } = require('./helpers');
const { createApp } = require('./app');

const pool = makePool({ max: 12 });
const servers = [];

async function start(idemOptions, p = pool) {
  const { app, state } = createApp(p, idemOptions);
  const srv = await listen(app);
  servers.push(srv);
  return { url: srv.url, state };
}

test.after(async () => {
  for (const s of servers) await s.close();
  await pool.end();
});

function post(url, key, body, headers = {}, method = 'POST') {
  const h = { 'Content-Type': 'application/json', ...headers };
  if (key !== null) h['Idempotency-Key'] = key;
  return fetch(url, { method, headers: h, body: typeof body === 'string' ? body : JSON.stringify(body) });
}

let def;
test.before(async () => {
  def = await start({});
});

test('400 when the key is required and missing; the handler not run', async () => {
  const { url, state } = await start({ required: true });
  const res = await post(`${url}/orders`, null, { item: 'book' });
  assert.equal(res.status, 400);
  assert.match(res.headers.get('content-type'), /^application\/problem\+json/);
  const body = await res.json();
  assert.equal(body.status, 400);
  assert.equal(state.calls.orders, undefined);
  // An unusable key (empty, too long) is a 400 too.
  assert.equal((await post(`${def.url}/orders`, '', { item: 'x' })).status, 400);
  assert.equal((await post(`${def.url}/orders`, 'k'.repeat(256), { item: 'x' })).status, 400);
});

test('pass-through without a key when not required, and for methods not configured', async () => {
  const { url, state } = await start({});
  const a = await post(`${url}/orders`, null, { item: 'book' });
  const b = await post(`${url}/orders`, null, { item: 'book' });
  assert.equal(a.status, 201);
  assert.equal(b.status, 201);
  assert.equal(a.headers.get('idempotent-replayed'), null);
  assert.equal(b.headers.get('idempotent-replayed'), null);
  assert.notDeepEqual(await a.json(), await b.json());
  assert.equal(state.calls.orders, 2);
  const key = uniqueKey('get');
  for (let i = 0; i < 2; i++) {
    const r = await fetch(`${url}/orders`, { headers: { 'Idempotency-Key': key } });
    assert.equal(r.status, 200);
  }
  assert.equal(state.calls.get, 2);
  assert.equal(await lookup(pool, key), null);
});

test('replay: same status, body, Content-Type and Location, with the replay marker; the handler ran once', async () => {
  const { url, state } = await start({});
  const key = uniqueKey('replay');
  const first = await post(`${url}/orders`, key, { item: 'book' });
  assert.equal(first.status, 201);
  assert.equal(first.headers.get('idempotent-replayed'), null);
  const firstBody = await first.text();
  const second = await post(`${url}/orders`, key, { item: 'book' });
  assert.equal(second.status, 201);
  assert.equal(second.headers.get('idempotent-replayed'), 'true');
  assert.equal(second.headers.get('content-type'), 'application/json; charset=utf-8');
  assert.equal(second.headers.get('location'), first.headers.get('location'));
  assert.equal(await second.text(), firstBody);
  assert.equal(state.calls.orders, 1);
  // The handler got the claim's token (req.idempotency.token).
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(row.status, 201);
  assert.equal(JSON.parse(firstBody).token, String(row.token));
  // A quoted key (sf-string) is the same key; PATCH is guarded too.
  const third = await post(`${url}/orders`, `"${key}"`, { item: 'book' });
  assert.equal(third.headers.get('idempotent-replayed'), 'true');
  const pkey = uniqueKey('patch');
  const p1 = await post(`${url}/orders/7`, pkey, { item: 'pen' }, {}, 'PATCH');
  const p2 = await post(`${url}/orders/7`, pkey, { item: 'pen' }, {}, 'PATCH');
  assert.equal(p1.status, 200);
  assert.equal(p2.status, 200);
  assert.equal(p2.headers.get('idempotent-replayed'), 'true');
  assert.deepEqual(await p2.json(), { order: 7, item: 'pen' });
  assert.equal(state.calls.patch, 1);
});

test('waitFor 0: 409 at once while the first request is in flight, Retry-After until its lease ends; then the replay', async () => {
  const { url, state } = await start({ retryAfter: 2, waitFor: 0 });
  let open;
  state.gate = new Promise((resolve) => { open = resolve; });
  const key = uniqueKey('inflight');
  const first = post(`${url}/slow`, key, { n: 1 });
  while (!state.calls.slow) await sleep(5);
  const second = await post(`${url}/slow`, key, { n: 1 });
  assert.equal(second.status, 409);
  // The seconds until the first request's lease (10 s) ends, not retryAfter (2).
  const after = Number(second.headers.get('retry-after'));
  assert.ok(Number.isInteger(after) && after > 2 && after <= 10, `Retry-After ${second.headers.get('retry-after')}`);
  assert.match(second.headers.get('content-type'), /^application\/problem\+json/);
  assert.equal((await second.json()).status, 409);
  open();
  assert.equal((await first).status, 201);
  const third = await post(`${url}/slow`, key, { n: 1 });
  assert.equal(third.status, 201);
  assert.equal(third.headers.get('idempotent-replayed'), 'true');
  assert.equal(state.calls.slow, 1);
});

test('the client drops the connection mid-request: the handler finishes, the response is stored, the retry replays it', async () => {
  const { url, state } = await start({ waitFor: 0 });
  let open;
  state.gate = new Promise((resolve) => { open = resolve; });
  const key = uniqueKey('client-abort');
  const controller = new AbortController();
  const first = fetch(`${url}/slow`, {
    method: 'POST', signal: controller.signal,
    headers: { 'Content-Type': 'application/json', 'Idempotency-Key': key }, body: '{"n":1}',
  }).then(() => null, (err) => err);
  while (!state.calls.slow) await sleep(5);
  controller.abort();
  assert.equal((await first).name, 'AbortError');
  assert.equal((await post(`${url}/slow`, key, { n: 1 })).status, 409);
  open();
  // The handler finishes on its own after the client left: wait for its response to be stored.
  await waitFor(async () => (await lookup(pool, key))?.state === 'DONE', 30000, 20);
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(row.status, 201);
  const retry = await post(`${url}/slow`, key, { n: 1 });
  assert.equal(retry.status, 201);
  assert.equal(retry.headers.get('idempotent-replayed'), 'true');
  assert.deepEqual(await retry.json(), { slow: true });
  assert.equal(state.calls.slow, 1);
});

test('a retry waits for the first request and gets its answer replayed; 409 only when the wait runs out, Retry-After until its lease ends', async (t) => {
  const named = makePool({ max: 4, application_name: 'idem-wait-http' });
  t.after(() => named.end());
  const { url, state } = await start({ waitFor: 1500, lease: 30000, retryAfter: 7 }, named);
  let open;
  state.gate = new Promise((resolve) => { open = resolve; });
  try {
    const key = uniqueKey('wait-http');
    const first = post(`${url}/slow`, key, { n: 1 });
    while (!state.calls.slow) await sleep(5);
    const t0 = Date.now();
    const busy = await post(`${url}/slow`, key, { n: 1 });
    const elapsed = Date.now() - t0;
    assert.equal(busy.status, 409);
    assert.ok(elapsed >= 1400, `409 after ${elapsed} ms, before the wait ran out`);
    assert.equal((await busy.json()).status, 409);
    // Seconds until the first request's lease (30 s) ends: neither retryAfter (7) nor past the lease.
    const after = Number(busy.headers.get('retry-after'));
    assert.ok(Number.isInteger(after) && after > 7 && after <= 30, `Retry-After ${busy.headers.get('retry-after')}`);
    const row = await lookup(pool, key);
    assert.equal(row.state, 'PROCESSING');

    // This retry is still waiting when the first request answers: it gets that answer.
    const retry = post(`${url}/slow`, key, { n: 1 });
    await untilWaitingInServer(pool, 'idem-wait-http');
    open();
    const answered = await first;
    assert.equal(answered.status, 201);
    assert.equal(answered.headers.get('idempotent-replayed'), null);
    const replay = await retry;
    assert.equal(replay.status, 201);
    assert.equal(replay.headers.get('idempotent-replayed'), 'true');
    assert.deepEqual(await replay.json(), await answered.json());
    assert.equal(state.calls.slow, 1);
  } finally {
    open();
  }
});

test('twenty concurrent POSTs with one key, a handler of 2 s: one execution, nineteen replays of its body, no 409', async (t) => {
  // Each waiting retry holds a pool connection: room for all of them and the first request's idem_complete.
  const big = makePool({ max: 25 });
  t.after(() => big.end());
  const { url, state } = await start({}, big);
  const key = uniqueKey('twenty');
  const responses = await Promise.all(Array.from({ length: 20 }, () => post(`${url}/long`, key, { job: 20 })));
  const bodies = await Promise.all(responses.map((r) => r.text()));
  const statuses = responses.map((r) => r.status);
  assert.equal(statuses.filter((s) => s === 409).length, 0, `statuses ${statuses}`);
  assert.deepEqual(statuses, Array(20).fill(201), `statuses ${statuses}`);
  const replayed = responses.filter((r) => r.headers.get('idempotent-replayed') === 'true').length;
  assert.equal(replayed, 19);
  assert.equal(state.calls.long, 1);
  const fresh = bodies[responses.findIndex((r) => r.headers.get('idempotent-replayed') === null)];
  assert.equal(JSON.parse(fresh).long, 1);
  for (const b of bodies) assert.equal(b, fresh);
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(JSON.parse(fresh).token, String(row.token));
});

test('waitFor is the middleware\'s own: checked at mount, 0 by default with wait: false', async () => {
  assert.throws(() => createApp(pool, { waitFor: 1000, wait: false }), TypeError);
  assert.throws(() => createApp(pool, { waitFor: -1 }), TypeError);
  // wait: false answers at once, so the default wait is none.
  const { url, state } = await start({ wait: false, retryAfter: 3 });
  let open;
  state.gate = new Promise((resolve) => { open = resolve; });
  try {
    const key = uniqueKey('nowait-http');
    const first = post(`${url}/slow`, key, {});
    while (!state.calls.slow) await sleep(5);
    const busy = await post(`${url}/slow`, key, {});
    assert.equal(busy.status, 409);
    const after = Number(busy.headers.get('retry-after'));
    assert.ok(Number.isInteger(after) && after > 3 && after <= 10, `Retry-After ${busy.headers.get('retry-after')}`);
    open();
    assert.equal((await first).status, 201);
  } finally {
    open();
  }
});

test('422 when the key is reused with another payload', async () => {
  const { url, state } = await start({});
  const key = uniqueKey('reuse');
  assert.equal((await post(`${url}/orders`, key, { item: 'book' })).status, 201);
  const other = await post(`${url}/orders`, key, { item: 'lamp' });
  assert.equal(other.status, 422);
  assert.equal((await other.json()).status, 422);
  const otherPath = await post(`${url}/work`, key, { item: 'book' });
  assert.equal(otherPath.status, 422);
  assert.equal(state.calls.orders, 1);
  assert.equal(state.calls.work, undefined);
});

test('503 with Retry-After when idem is unavailable; the handler not run', async () => {
  const dead = deadPool();
  try {
    const { url, state } = await start({ timeout: 2000 }, dead);
    const res = await post(`${url}/orders`, uniqueKey('down'), { item: 'book' });
    assert.equal(res.status, 503);
    assert.equal(res.headers.get('retry-after'), '1');
    assert.equal((await res.json()).status, 503);
    assert.equal(state.calls.orders, undefined);
  } finally {
    await dead.end();
  }
});

test('an unavailable store is logged once, with its cause, not for every 503', async () => {
  const dead = deadPool();
  const warnings = [];
  try {
    const { url, state } = await start({ timeout: 2000, logger: { warn: (m) => warnings.push(m) } }, dead);
    for (let i = 0; i < 3; i++) {
      const res = await post(`${url}/orders`, uniqueKey('down-log'), { item: 'book' });
      assert.equal(res.status, 503);
    }
    assert.equal(state.calls.orders, undefined);
    assert.equal(warnings.length, 1, JSON.stringify(warnings));
    assert.match(warnings[0], /^idem: idempotency store unavailable \(.+\); requests with a key are answered 503 until it answers again/);
    assert.match(warnings[0], /ENOENT|ECONNREFUSED|connect|timeout/i, warnings[0]);
  } finally {
    await dead.end();
  }
});

test('5xx answers and thrown errors are released by default: the retry runs the handler again', async () => {
  const { url, state } = await start({});
  const key = uniqueKey('fail');
  const a = await post(`${url}/fail`, key, {});
  assert.equal(a.status, 500);
  assert.deepEqual(await a.json(), { error: 'database down' });
  assert.equal(await lookup(pool, key), null);
  const b = await post(`${url}/fail`, key, {});
  assert.equal(b.status, 500);
  assert.equal(b.headers.get('idempotent-replayed'), null);
  assert.equal(state.calls.fail, 2);

  const key2 = uniqueKey('throw');
  assert.equal((await post(`${url}/throw`, key2, {})).status, 500);
  assert.equal(await lookup(pool, key2), null);
  assert.equal((await post(`${url}/throw`, key2, {})).status, 500);
  assert.equal(state.calls.throw, 2);
});

test('5xx answers are stored and replayed when storeServerErrors is set', async () => {
  const { url, state } = await start({ storeServerErrors: true });
  const key = uniqueKey('fail-stored');
  assert.equal((await post(`${url}/fail`, key, {})).status, 500);
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(row.status, 500);
  const b = await post(`${url}/fail`, key, {});
  assert.equal(b.status, 500);
  assert.equal(b.headers.get('idempotent-replayed'), 'true');
  assert.deepEqual(await b.json(), { error: 'database down' });
  assert.equal(state.calls.fail, 1);
});

test('eight concurrent retries of one key: exactly one execution, the others 409 or the replay', async () => {
  const { url, state } = await start({});
  const key = uniqueKey('concurrent');
  const responses = await Promise.all(Array.from({ length: 8 }, () => post(`${url}/work`, key, { job: 1 })));
  const statuses = responses.map((r) => r.status);
  const replayed = responses.filter((r) => r.headers.get('idempotent-replayed') === 'true').length;
  const fresh = responses.filter((r) => r.status === 201 && r.headers.get('idempotent-replayed') === null).length;
  const busy = statuses.filter((s) => s === 409).length;
  assert.equal(fresh, 1, `statuses ${statuses}`);
  assert.equal(replayed + busy, 7, `statuses ${statuses}`);
  for (const r of responses) if (r.status === 201) assert.deepEqual(await r.json(), { worked: 1 });
  assert.equal(state.calls.work, 1);
  const after = await post(`${url}/work`, key, { job: 1 });
  assert.equal(after.headers.get('idempotent-replayed'), 'true');
  assert.equal(state.calls.work, 1);
});

test('the scope comes from the caller\'s function: one key, two tenants, two executions', async () => {
  const { url, state } = await start({});
  const key = uniqueKey('tenant');
  const a = await post(`${url}/orders`, key, { item: 'book' }, { 'X-Tenant': 'acme' });
  const b = await post(`${url}/orders`, key, { item: 'book' }, { 'X-Tenant': 'globex' });
  assert.equal(a.status, 201);
  assert.equal(b.status, 201);
  assert.equal(b.headers.get('idempotent-replayed'), null);
  assert.equal(state.calls.orders, 2);
  assert.equal((await lookup(pool, key, 'acme')).state, 'DONE');
  assert.equal((await lookup(pool, key, 'globex')).state, 'DONE');
  assert.equal(await lookup(pool, key, ''), null);
});

test('a body no parser took is read raw for the fingerprint and handed on as a Buffer', async () => {
  const { url, state } = await start({});
  const key = uniqueKey('raw');
  const send = (text) => fetch(`${url}/echo`, { method: 'POST', headers: { 'Content-Type': 'text/plain', 'Idempotency-Key': key }, body: text });
  const a = await send('hello world');
  assert.equal(a.status, 200);
  assert.equal(await a.text(), 'got buffer 11');
  const b = await send('hello world');
  assert.equal(b.headers.get('idempotent-replayed'), 'true');
  assert.equal(b.headers.get('content-type'), 'text/plain; charset=utf-8');
  assert.equal(await b.text(), 'got buffer 11');
  assert.equal((await send('hello there')).status, 422);
  assert.equal(state.calls.echo, 1);
});
