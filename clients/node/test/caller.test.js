'use strict';

// Issue #44 items 1-3 in the Express middleware: keys bound to the caller
// (principal), a middleware that decides nothing refused, re-authorized
// replays (authorize), and 401, 403, 407, 408, 425 released like 429 and
// 5xx.  Each app runs in default and transactional mode.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const http = require('node:http');
const express = require('express');
const { idempotency, saveRawBody } = require('..');
const express_ = require('../lib/express');
const { makePool, uniqueKey, lookup, listen } = require('./helpers');

const pool = makePool({ max: 12 });
const servers = [];

test.before(async () => {
  await pool.query('CREATE TABLE IF NOT EXISTS caller_orders (id bigserial PRIMARY KEY, key text NOT NULL, who text)');
});
test.after(async () => {
  for (const s of servers) await s.close();
  await pool.end();
});

const callerScope = (...args) => express_.callerScope(...args);

/** The principal hook of these apps: X-User; "throw", "none" and "number" fail. */
function user(req) {
  const who = req.get('X-User');
  if (who === 'throw') throw new Error('no session');
  if (who === 'none') return undefined;
  if (who === 'number') return 42;
  return who;
}

/** Handler runs per key, counted in the app (a transactional run's insert may be rolled back). */
const runs = new Map();

/** POST /orders behind the middleware: inserts (key, user), answers X-Status (201) naming the user. */
async function start(options) {
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: saveRawBody }));
  app.use(idempotency(pool, { lease: 30000, principal: user, ...options }));
  app.post('/orders', async (req, res, next) => {
    try {
      runs.set(req.idempotency.key, (runs.get(req.idempotency.key) || 0) + 1);
      const db = req.idempotency.client || pool;
      await db.query('INSERT INTO caller_orders (key, who) VALUES ($1, $2)', [req.idempotency.key, req.get('X-User') || null]);
      res.status(Number(req.get('X-Status')) || 201).json({ secret: `for ${req.get('X-User')}` });
    } catch (err) {
      next(err);
    }
  });
  const srv = await listen(app);
  servers.push(srv);
  return srv.url;
}

/** POST /orders (node:http: fetch refuses a 407 answer). */
function post(url, key, who, headers = {}) {
  const h = { 'Content-Type': 'application/json', 'Idempotency-Key': key, ...headers };
  if (who !== undefined) h['X-User'] = who;
  return new Promise((resolve, reject) => {
    const req = http.request(`${url}/orders`, { method: 'POST', headers: h }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => resolve({
        status: res.statusCode,
        headers: { get: (name) => res.headers[name.toLowerCase()] ?? null },
        text: Buffer.concat(chunks).toString('utf8'),
      }));
      res.on('error', reject);
    });
    req.on('error', reject);
    req.end('{}');
  });
}

async function executions(key) {
  return Number((await pool.query('SELECT count(*) AS n FROM caller_orders WHERE key = $1', [key])).rows[0].n);
}

/** Rows of the key in any scope. */
async function rows(key) {
  return Number((await pool.query('SELECT count(*) AS n FROM public.idem_keys WHERE key = $1', [key])).rows[0].n);
}

for (const transactional of [false, true]) {
  const mode = transactional ? 'transactional' : 'default';

  test(`${mode}: two principals, one key and body: two executions, each replayed to its own caller`, async () => {
    const url = await start({ transactional });
    const key = uniqueKey('two');
    const a1 = await post(url, key, 'alice');
    const b1 = await post(url, key, 'bob');
    assert.equal(a1.status, 201);
    assert.equal(b1.status, 201);
    assert.equal(a1.headers.get('idempotent-replayed'), null);
    assert.equal(b1.headers.get('idempotent-replayed'), null);
    assert.equal(await executions(key), 2);
    const a2 = await post(url, key, 'alice');
    const b2 = await post(url, key, 'bob');
    assert.equal(a2.headers.get('idempotent-replayed'), 'true');
    assert.equal(b2.headers.get('idempotent-replayed'), 'true');
    assert.deepEqual(JSON.parse(a2.text), { secret: 'for alice' });
    assert.deepEqual(JSON.parse(b2.text), { secret: 'for bob' });
    assert.equal(await executions(key), 2);
    assert.equal((await lookup(pool, key, callerScope('', 'alice'))).state, 'DONE');
    assert.equal((await lookup(pool, key, callerScope('', 'bob'))).state, 'DONE');
    assert.equal(await lookup(pool, key), null);
  });

  test(`${mode}: a replay the authorize hook denies is 403 without the body`, async () => {
    const url = await start({ transactional, authorize: (req) => req.get('X-Revoked') === undefined });
    const key = uniqueKey('authz');
    const r1 = await post(url, key, 'alice');
    assert.equal(r1.status, 201);
    const r2 = await post(url, key, 'alice', { 'X-Revoked': '1' });
    assert.equal(r2.status, 403);
    assert.match(r2.headers.get('content-type'), /^application\/problem\+json/);
    assert.equal(r2.headers.get('idempotent-replayed'), null);
    assert.doesNotMatch(r2.text, /secret|alice/);
    assert.equal(await executions(key), 1);
    const r3 = await post(url, key, 'alice');
    assert.equal(r3.headers.get('idempotent-replayed'), 'true');
    assert.equal(r3.text, r1.text);
    assert.equal(await executions(key), 1);
  });

  for (const status of [401, 403, 407, 408, 425]) {
    test(`${mode}: ${status} is not stored: the retry runs the handler again`, async () => {
      const url = await start({ transactional });
      const key = uniqueKey(`s${status}`);
      const r1 = await post(url, key, 'alice', { 'X-Status': String(status) });
      assert.equal(r1.status, status);
      assert.equal(await lookup(pool, key, callerScope('', 'alice')), null);
      assert.equal(runs.get(key), 1);
      const r2 = await post(url, key, 'alice');
      assert.equal(r2.status, 201);
      assert.equal(r2.headers.get('idempotent-replayed'), null);
      assert.equal(runs.get(key), 2);
      const r3 = await post(url, key, 'alice');
      assert.equal(r3.headers.get('idempotent-replayed'), 'true');
      assert.equal(runs.get(key), 2);
      assert.equal(await executions(key), transactional ? 1 : 2); // a released run's writes roll back
    });
  }

  for (const who of ['throw', 'none', 'number']) {
    test(`${mode}: a principal hook that fails (${who}) is 500; the handler does not run, nothing is claimed`, async () => {
      const url = await start({ transactional });
      const key = uniqueKey(`bad-${who}`);
      const r = await post(url, key, who);
      assert.equal(r.status, 500);
      assert.match(r.headers.get('content-type'), /^application\/problem\+json/);
      assert.equal(await executions(key), 0);
      assert.equal(runs.get(key), undefined);
      assert.equal(await rows(key), 0);
    });
  }

  test(`${mode}: shared: true is one namespace for every caller`, async () => {
    const url = await start({ transactional, principal: undefined, shared: true });
    const key = uniqueKey('shared');
    assert.equal((await post(url, key, 'alice')).status, 201);
    const r = await post(url, key, 'bob');
    assert.equal(r.headers.get('idempotent-replayed'), 'true');
    assert.deepEqual(JSON.parse(r.text), { secret: 'for alice' });
    assert.equal((await lookup(pool, key)).state, 'DONE');
  });
}

test('a middleware with no principal hook and no shared opt-out is refused at construction', () => {
  assert.throws(() => idempotency(pool), (err) => err instanceof TypeError && /principal/.test(err.message) && /shared: true/.test(err.message));
  assert.throws(() => idempotency(pool, { scope: () => 'tenant' }), /principal/);
  assert.throws(() => idempotency(pool, { principal: user, shared: true }), TypeError);
  assert.throws(() => idempotency(pool, { principal: 'alice' }), TypeError);
  assert.throws(() => idempotency(pool, { principal: user, authorize: true }), TypeError);
  assert.equal(typeof idempotency(pool, { principal: user }), 'function');
  assert.equal(typeof idempotency(pool, { shared: true }), 'function');
});

test('the tenant and the principal both scope the key, encoded without ambiguity', async () => {
  const url = await start({ scope: (req) => req.get('X-Tenant') || '' });
  const key = uniqueKey('tp');
  assert.equal((await post(url, key, 'bc', { 'X-Tenant': 'a' })).status, 201);
  assert.equal((await post(url, key, 'c', { 'X-Tenant': 'ab' })).status, 201);
  assert.equal(await executions(key), 2);
  assert.equal((await lookup(pool, key, callerScope('a', 'bc'))).state, 'DONE');
  assert.equal((await lookup(pool, key, callerScope('ab', 'c'))).state, 'DONE');
});

test('callerScope: length-prefixed tenant, the principal as is or hashed', () => {
  const sha = (s) => crypto.createHash('sha256').update(s, 'utf8').digest('hex');
  assert.equal(callerScope('', 'alice'), '0:=alice');
  assert.equal(callerScope('acme', 'alice'), '4:acme=alice');
  assert.notEqual(callerScope('a', 'bc'), callerScope('ab', 'c'));
  assert.notEqual(callerScope('a=b', 'c'), callerScope('a', 'b=c'));
  assert.equal(callerScope('\u00e9', 'x'), '2:\u00e9=x');
  assert.equal(callerScope('t', 'u'.repeat(300)), `1:t#${sha('u'.repeat(300))}`);
  assert.equal(callerScope('t', '\u00e9'), `1:t#${sha('\u00e9')}`);
  assert.equal(callerScope('t', '='.repeat(10), 12), `1:t#${sha('='.repeat(10))}`);
  assert.equal(callerScope('t', 'ab', 6), '1:t=ab');
});

test('a long principal is hashed into the scope', async () => {
  const url = await start({});
  const key = uniqueKey('long');
  const who = 'p'.repeat(300);
  assert.equal((await post(url, key, who)).status, 201);
  assert.equal((await post(url, key, who)).headers.get('idempotent-replayed'), 'true');
  assert.equal(await executions(key), 1);
  assert.equal((await lookup(pool, key, callerScope('', who))).state, 'DONE');
});

test('the default policy releases 401, 403, 407, 408, 425, 429 and 5xx', () => {
  for (const s of [200, 201, 204, 301, 400, 404, 409, 410, 422]) assert.equal(express_.defaultStoreStatus(s), true, String(s));
  for (const s of [401, 403, 407, 408, 425, 429, 500, 502, 503, 504]) assert.equal(express_.defaultStoreStatus(s), false, String(s));
});

test('authorize may answer itself; one that throws sends no body', async () => {
  const url = await start({
    authorize: (req, res) => {
      if (req.get('X-Revoked') === 'gone') return res.status(404).type('text/plain').send('gone');
      if (req.get('X-Revoked') === 'throw') throw new Error('the permission service is down');
      return true;
    },
  });
  const key = uniqueKey('authz-own');
  assert.equal((await post(url, key, 'alice')).status, 201);
  const gone = await post(url, key, 'alice', { 'X-Revoked': 'gone' });
  assert.equal(gone.status, 404);
  assert.equal(gone.text, 'gone');
  const thrown = await post(url, key, 'alice', { 'X-Revoked': 'throw' });
  assert.equal(thrown.status, 500);
  assert.doesNotMatch(thrown.text, /secret/);
  assert.equal(await executions(key), 1);
});
