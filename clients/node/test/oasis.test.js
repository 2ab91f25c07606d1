'use strict';

// Issue #44 items 5 and 6 in the Express middleware: OASIS Repeatable
// Requests (Repeatability-Request-ID with an IMF-fixdate
// Repeatability-First-Sent, 412 past the window, Repeatability-Result)
// beside Idempotency-Key, and the window advertised
// (Idempotency-Key-Lifetime, off by default).  Default and transactional
// mode.

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const { idempotency, saveRawBody, parseHttpDate } = require('..');
const express_ = require('../lib/express');
const { makePool, uniqueKey, lookup, listen } = require('./helpers');

const pool = makePool({ max: 12 });
const servers = [];

test.before(async () => {
  await pool.query('CREATE TABLE IF NOT EXISTS oasis_orders (id bigserial PRIMARY KEY, key text NOT NULL, who text)');
});
test.after(async () => {
  for (const s of servers) await s.close();
  await pool.end();
});

const LONG_AGO = 'Sun, 06 Nov 1994 08:49:37 GMT';
const now = () => new Date().toUTCString();
const runs = [];

/** POST /orders (inserts a row, answers 201) and GET /orders (200) behind the middleware. */
async function start(options) {
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: saveRawBody }));
  app.use(idempotency(pool, { retention: 3600 * 1000, principal: (req) => req.get('X-User') || '', ...options }));
  app.get('/orders', (req, res) => res.type('text').send('list'));
  app.post('/orders', async (req, res, next) => {
    try {
      const key = req.idempotency ? req.idempotency.key : null;
      runs.push(key);
      if (key !== null) {
        await (req.idempotency.client || pool).query('INSERT INTO oasis_orders (key, who) VALUES ($1, $2)', [key, req.get('X-User') || null]);
      }
      res.status(201).json({ n: runs.filter((k) => k === key).length });
    } catch (err) {
      next(err);
    }
  });
  const srv = await listen(app);
  servers.push(srv);
  return srv.url;
}

function call(url, method, headers = {}, body = '{}') {
  return fetch(`${url}/orders`, {
    method,
    headers: { 'Content-Type': 'application/json', ...headers },
    body: method === 'GET' ? undefined : body,
  });
}
const oasis = (id, first, more = {}) => ({ 'Repeatability-Request-ID': id, 'Repeatability-First-Sent': first, ...more });
const ranFor = (key) => runs.filter((k) => k === key).length;
async function rows(key) {
  const r = await pool.query('SELECT (SELECT count(*) FROM idem_keys WHERE key = $1)::int AS k, (SELECT count(*) FROM oasis_orders WHERE key = $1)::int AS o', [key]);
  return r.rows[0];
}
async function isProblem(r, status) {
  assert.equal(r.status, status);
  assert.equal(r.headers.get('content-type'), 'application/problem+json');
  assert.equal((await r.json()).status, status);
}

for (const transactional of [false, true]) {
  const mode = transactional ? 'transactional' : 'default';

  test(`${mode}: OASIS request accepted, its retry replayed and accepted, bound to the caller`, async () => {
    const url = await start({ transactional });
    const id = uniqueKey('oasis');
    const sent = now();
    const r1 = await call(url, 'POST', oasis(id, sent, { 'X-User': 'alice' }));
    assert.equal(r1.status, 201);
    assert.deepEqual(await r1.json(), { n: 1 });
    assert.equal(r1.headers.get('repeatability-result'), 'accepted');
    assert.equal(r1.headers.get('idempotent-replayed'), null);
    const r2 = await call(url, 'POST', oasis(id, sent, { 'X-User': 'alice' }));
    assert.equal(r2.status, 201);
    assert.deepEqual(await r2.json(), { n: 1 });
    assert.equal(r2.headers.get('repeatability-result'), 'accepted');
    assert.equal(r2.headers.get('idempotent-replayed'), 'true');
    assert.equal(ranFor(id), 1);
    assert.equal((await lookup(pool, id, express_.callerScope('', 'alice'))).state, 'DONE');
    assert.deepEqual(await rows(id), { k: 1, o: 1 });
    const r3 = await call(url, 'POST', oasis(id, sent, { 'X-User': 'bob' }));
    assert.equal(r3.status, 201);
    assert.equal(r3.headers.get('repeatability-result'), 'accepted');
    assert.equal(ranFor(id), 2);
    assert.deepEqual(await rows(id), { k: 2, o: 2 });
  });

  test(`${mode}: a First-Sent older than the window is 412, rejected, the handler not run`, async () => {
    const url = await start({ transactional });
    const id = uniqueKey('old');
    const r = await call(url, 'POST', oasis(id, LONG_AGO, { 'X-User': 'alice' }));
    await isProblem(r, 412);
    assert.equal(r.headers.get('repeatability-result'), 'rejected');
    assert.equal(ranFor(id), 0);
    assert.deepEqual(await rows(id), { k: 0, o: 0 });
  });

  test(`${mode}: the same request id with another request is 422, rejected`, async () => {
    const url = await start({ transactional });
    const id = uniqueKey('other');
    assert.equal((await call(url, 'POST', oasis(id, now(), { 'X-User': 'a' }))).headers.get('repeatability-result'), 'accepted');
    const r = await call(url, 'POST', oasis(id, now(), { 'X-User': 'a' }), '{"other":1}');
    await isProblem(r, 422);
    assert.equal(r.headers.get('repeatability-result'), 'rejected');
    assert.equal(ranFor(id), 1);
  });

  test(`${mode}: advertiseWindow puts Idempotency-Key-Lifetime on every response of the route`, async () => {
    const url = await start({ transactional, advertiseWindow: true });
    const key = uniqueKey('life');
    const answers = [
      await call(url, 'POST', { 'Idempotency-Key': key, 'X-User': 'a' }),
      await call(url, 'POST', { 'Idempotency-Key': key, 'X-User': 'a' }),
      await call(url, 'POST', { 'Idempotency-Key': key, 'X-User': 'a' }, '[]'),
      await call(url, 'POST', { 'Idempotency-Key': '', 'X-User': 'a' }),
      await call(url, 'POST', { 'X-User': 'a' }),
      await call(url, 'GET'),
      await call(url, 'POST', oasis(uniqueKey('o'), LONG_AGO, { 'X-User': 'a' })),
    ];
    assert.deepEqual(answers.map((r) => r.status), [201, 201, 422, 400, 201, 200, 412]);
    for (const r of answers) assert.equal(r.headers.get('idempotency-key-lifetime'), '3600');
    assert.equal(answers[1].headers.get('idempotent-replayed'), 'true');
  });
}

test('malformed or incomplete OASIS headers are 400, rejected, nothing claimed', async () => {
  const url = await start({});
  const id = uniqueKey('bad');
  const cases = [
    oasis(id, 'yesterday'),
    oasis(id, 'Sunday, 06-Nov-94 08:49:37 GMT'), // RFC 850: obsolete, refused
    oasis(id, 'Sun Nov  6 08:49:37 1994'), // asctime: obsolete, refused
    oasis(id, 'Mon, 06 Nov 1994 08:49:37 GMT'), // 6 Nov 1994 was a Sunday
    oasis(id, 'Sun, 31 Nov 1994 08:49:37 GMT'),
    oasis(id, 'Sun, 06 Nov 1994 08:49:37 UTC'),
    { 'Repeatability-Request-ID': id },
    { 'Repeatability-First-Sent': now() },
    oasis(id, now(), { 'Idempotency-Key': id }),
    oasis('x'.repeat(256), now()),
  ];
  for (const h of cases) {
    const r = await call(url, 'POST', { ...h, 'X-User': 'alice' });
    await isProblem(r, 400);
    assert.equal(r.headers.get('repeatability-result'), 'rejected', JSON.stringify(h));
  }
  assert.equal(ranFor(id), 0);
  assert.deepEqual(await rows(id), { k: 0, o: 0 });
});

test('no Repeatability-Result without the headers; no Idempotency-Key-Lifetime by default', async () => {
  const url = await start({});
  const key = uniqueKey('plain');
  for (const r of [
    await call(url, 'POST', { 'Idempotency-Key': key, 'X-User': 'a' }),
    await call(url, 'POST', { 'Idempotency-Key': key, 'X-User': 'a' }),
    await call(url, 'POST', { 'Idempotency-Key': '', 'X-User': 'a' }),
    await call(url, 'GET'),
  ]) {
    assert.equal(r.headers.get('repeatability-result'), null);
    assert.equal(r.headers.get('idempotency-key-lifetime'), null);
  }
  const r = await call(url, 'POST', oasis(uniqueKey('o'), now(), { 'X-User': 'a' }));
  assert.equal(r.status, 201);
  assert.equal(r.headers.get('idempotency-key-lifetime'), null);
  assert.equal(ranFor(key), 1);
});

test('without a retention the window is the server\'s idem.default_retention', async () => {
  const app = express();
  app.use(idempotency(pool, { shared: true, advertiseWindow: true }));
  app.get('/orders', (req, res) => res.send('list'));
  const srv = await listen(app);
  servers.push(srv);
  const { rows: [row] } = await pool.query("SELECT setting::int8::text AS s FROM pg_settings WHERE name = 'idem.default_retention'");
  const r = await call(srv.url, 'GET');
  assert.equal(r.status, 200);
  assert.equal(r.headers.get('idempotency-key-lifetime'), row.s);
});

test('parseHttpDate reads IMF-fixdate only', () => {
  assert.equal(parseHttpDate('Sun, 06 Nov 1994 08:49:37 GMT').toISOString(), '1994-11-06T08:49:37.000Z');
  assert.equal(parseHttpDate(' Sun, 06 Nov 1994 08:49:37 GMT\t').getUTCFullYear(), 1994);
  assert.equal(parseHttpDate('Sat, 31 Dec 2016 23:59:60 GMT').getUTCSeconds(), 59);
  for (const bad of ['', 'Sun, 6 Nov 1994 08:49:37 GMT', 'sun, 06 Nov 1994 08:49:37 GMT',
    'Sun, 06 Nov 1994 24:00:00 GMT', 'Sun, 06 Nov 1994 08:49:37 GMT x', undefined]) {
    assert.equal(parseHttpDate(bad), null, String(bad));
  }
});
