'use strict';

// EXPIRED (issue #44, item 4): a server with tombstones answers a retry
// whose response's retention is over, but whose key idem_begin's remember
// still keeps, with the state EXPIRED.  Played by a look-alike idem_begin
// in its own schema that answers EXPIRED (status 201, no body, no token)
// and records the remember of each call.

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const pg = require('pg');
const idem = require('..');
const { Guard, Outcome, idempotency, saveRawBody } = idem;
const { makePool, uniqueKey, listen } = require('./helpers');

const pool = makePool({ max: 8 });
const servers = [];
const schema = `idem_expired_${process.pid}`;
const future = `idem_future_exp_${process.pid}`;

test.before(async () => {
  await pool.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE; DROP SCHEMA IF EXISTS ${future} CASCADE;
    CREATE SCHEMA ${schema};
    CREATE TABLE ${schema}.calls (id bigserial PRIMARY KEY, key text, remember interval);
    CREATE TABLE ${schema}.orders (key text);
    CREATE FUNCTION ${schema}.idem_begin(key text, fingerprint text, lease interval DEFAULT NULL,
        retention interval DEFAULT NULL, scope text DEFAULT '', wait boolean DEFAULT true,
        wait_for interval DEFAULT NULL, remember interval DEFAULT NULL)
      RETURNS SETOF idem.begin_result LANGUAGE plpgsql AS $$ BEGIN
        INSERT INTO ${schema}.calls (key, remember) VALUES (idem_begin.key, idem_begin.remember);
        RETURN QUERY SELECT false, 'EXPIRED'::text, NULL::bigint, 201, NULL::bytea, NULL::timestamptz,
          now() + interval '1 day', NULL::text, NULL::bytea;
      END $$;
    CREATE SCHEMA ${future};
    CREATE FUNCTION ${future}.idem_begin(text, text, interval DEFAULT NULL, interval DEFAULT NULL,
        text DEFAULT '', boolean DEFAULT true, interval DEFAULT NULL)
      RETURNS SETOF idem.begin_result LANGUAGE sql AS $$ SELECT false, 'TOMBSTONED', NULL::bigint, 200,
        NULL::bytea, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::bytea $$;`);
});
test.after(async () => {
  for (const s of servers) await s.close();
  await pool.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE; DROP SCHEMA IF EXISTS ${future} CASCADE`);
  await pool.end();
});

/** The remember of each call for key, in ms (null: not sent). */
async function remembered(key) {
  const r = await pool.query(`SELECT (extract(epoch FROM remember) * 1000)::int8::text AS ms FROM ${schema}.calls
    WHERE key = $1 ORDER BY id`, [key]);
  return r.rows.map((row) => (row.ms === null ? null : Number(row.ms)));
}

test('guard: EXPIRED is the outcome expired with the stored status; the handler does not run', async () => {
  let ran = 0;
  const handler = async () => { ran++; return { status: 200, body: 'x' }; };
  const key = uniqueKey('exp');
  const r = await new Guard(pool, { schema }).do(key, 'fp', handler);
  assert.equal(r.outcome, Outcome.EXPIRED);
  assert.equal(Outcome.EXPIRED, 'expired');
  assert.equal(r.status, 201);
  assert.equal(r.response, null);
  assert.equal(r.token, null);
  assert.equal(r.error, null);
  assert.equal(r.failedStep, null);
  assert.equal(ran, 0);
  assert.deepEqual(await remembered(key), [null]);
});

test('guard: remember is sent when set (the guard\'s, or the call\'s), with and without waitFor', async () => {
  const g = new Guard(pool, { schema, remember: 30000 });
  const k1 = uniqueKey('exp');
  const k2 = uniqueKey('exp');
  const k3 = uniqueKey('exp');
  assert.equal((await g.do(k1, 'fp', async () => ({ status: 200 }))).outcome, Outcome.EXPIRED);
  assert.equal((await g.do(k2, 'fp', async () => ({ status: 200 }), { remember: '2 hours' })).outcome, Outcome.EXPIRED);
  assert.equal((await g.do(k3, 'fp', async () => ({ status: 200 }), { waitFor: 1000, remember: 5000 })).outcome, Outcome.EXPIRED);
  assert.deepEqual(await remembered(k1), [30000]);
  assert.deepEqual(await remembered(k2), [7200000]);
  assert.deepEqual(await remembered(k3), [5000]);
});

test('remember is sent only when set: a server without it answers the calls without it', async () => {
  const plain = await new Guard(pool, { schema: future }).do(uniqueKey('exp'), 'fp', async () => ({ status: 200 }));
  assert.equal(plain.outcome, Outcome.UNAVAILABLE);
  assert.match(plain.error.message, /unknown state "TOMBSTONED"/);
  const r = await new Guard(pool, { schema: future, remember: 1000 }).do(uniqueKey('exp'), 'fp', async () => ({ status: 200 }));
  assert.equal(r.outcome, Outcome.UNAVAILABLE);
  assert.equal(r.error.code, '42883');
  const { Store } = require('../lib/store');
  const store = new Store({ schema: 's' });
  assert.doesNotMatch(store._beginCall({ key: 'k', fingerprint: 'f' }).text, /remember/);
  assert.doesNotMatch(store._beginCall({ key: 'k', fingerprint: 'f', waitFor: 5 }).text, /remember/);
  assert.match(store._beginCall({ key: 'k', fingerprint: 'f', remember: 5 }).text, /, remember => \$7::interval\) b$/);
  assert.match(store._beginCall({ key: 'k', fingerprint: 'f', waitFor: 5, remember: 5 }).text, /\$7::interval, remember => \$8::interval\) b$/);
});

test('transaction(): EXPIRED resolves to expired with the status; the handler does not run', async () => {
  for (const literal of [true, false]) {
    const c = new pg.Client();
    await c.connect();
    if (!literal) c.escapeLiteral = undefined; // the statement-at-a-time path
    try {
      let ran = 0;
      const key = uniqueKey('exp-tx');
      const r = await idem.transaction(c, key, 'fp', async () => { ran++; return { status: 200 }; }, { schema, remember: 60000 });
      assert.equal(r.outcome, Outcome.EXPIRED);
      assert.equal(r.status, 201);
      assert.equal(r.response, null);
      assert.equal(r.token, null);
      assert.equal(ran, 0);
      assert.equal(c.getTransactionStatus ? c.getTransactionStatus() : 'I', 'I');
      // Rolled back at once, as every answer that claims nothing: the look-alike's record with it.
      assert.deepEqual(await remembered(key), []);
    } finally {
      await c.end();
    }
  }
});

async function start(options) {
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: saveRawBody }));
  app.use(idempotency(options.guard || pool, { schema, shared: true, ...options, guard: undefined }));
  app.post('/orders', async (req, res, next) => {
    try {
      await (req.idempotency.client || pool).query(`INSERT INTO ${schema}.orders (key) VALUES ($1)`, [req.idempotency.key]);
      res.status(201).json({ ok: true });
    } catch (err) {
      next(err);
    }
  });
  const srv = await listen(app);
  servers.push(srv);
  return srv.url;
}

for (const transactional of [false, true]) {
  for (const oasis of [false, true]) {
    test(`express (${transactional ? 'transactional' : 'default'}, ${oasis ? 'OASIS' : 'Idempotency-Key'}): 410 problem+json, the handler not run`, async () => {
      const url = await start({ transactional, remember: 3600000 });
      const key = uniqueKey('exp-mw');
      const headers = oasis
        ? { 'Repeatability-Request-ID': key, 'Repeatability-First-Sent': new Date().toUTCString() }
        : { 'Idempotency-Key': key };
      const r = await fetch(`${url}/orders`, { method: 'POST', headers: { 'Content-Type': 'application/json', ...headers }, body: '{}' });
      assert.equal(r.status, 410);
      assert.equal(r.headers.get('content-type'), 'application/problem+json');
      const body = await r.json();
      assert.deepEqual(Object.keys(body).sort(), ['detail', 'status', 'title', 'type']);
      assert.equal(body.status, 410);
      assert.equal(body.title, 'response expired');
      assert.equal(r.headers.get('idempotent-replayed'), null);
      assert.equal(r.headers.get('repeatability-result'), oasis ? 'rejected' : null);
      const rows = await pool.query(`SELECT count(*)::int AS n FROM ${schema}.orders WHERE key = $1`, [key]);
      assert.equal(rows.rows[0].n, 0);
      if (!transactional) assert.deepEqual(await remembered(key), [3600000]);
    });
  }
}

test('express: without its own remember, the guard\'s is sent', async () => {
  const url = await start({ guard: new Guard(pool, { schema, remember: 12000 }) });
  const key = uniqueKey('exp-mw');
  const r = await fetch(`${url}/orders`, { method: 'POST', headers: { 'Content-Type': 'application/json', 'Idempotency-Key': key }, body: '{}' });
  assert.equal(r.status, 410);
  assert.deepEqual(await remembered(key), [12000]);
});

// Against the server's own tombstones (extension 1.6), not a look-alike.
test('server tombstones: retention 1 s and remember 1 hour, the retry after the retention is expired and never runs', async () => {
  const { waitFor, lookup } = require('./helpers');
  const ran = { kept: 0, plain: 0 };
  const handler = (name) => async () => { ran[name]++; return { status: 201, body: '{"order":1}' }; };
  const kept = uniqueKey('tomb');
  const plain = uniqueKey('tomb-plain');
  const g = new Guard(pool, { lease: 1000, retention: 1000, remember: 3600000 });
  const noRemember = new Guard(pool, { lease: 1000, retention: 1000 });
  assert.equal((await g.do(kept, 'fp', handler('kept'))).outcome, Outcome.EXECUTED);
  assert.equal((await noRemember.do(plain, 'fp', handler('plain'))).outcome, Outcome.EXECUTED);
  assert.deepEqual(ran, { kept: 1, plain: 1 });
  const over = async () => (await pool.query(
    'SELECT coalesce(bool_and(expires_at < now()), false) AS over FROM public.idem_keys WHERE key = ANY($1)',
    [[kept, plain]])).rows[0].over;
  assert.equal(await waitFor(over, 30000, 50), true, 'the retention is over');
  for (let i = 0; i < 2; i++) {
    const r = await g.do(kept, 'fp', handler('kept'));
    assert.equal(r.outcome, Outcome.EXPIRED);
    assert.equal(r.status, 201);
    assert.equal(r.response, null);
    assert.equal(r.token, null);
    assert.equal(r.error, null);
  }
  assert.equal(ran.kept, 1, 'the handler never ran again');
  const again = await noRemember.do(plain, 'fp', handler('plain'));
  assert.equal(again.outcome, Outcome.EXECUTED, 'without remember the retry runs again');
  assert.equal(ran.plain, 2);
  const row = await lookup(pool, kept);
  assert.equal(row.state, 'EXPIRED');
  assert.equal(row.status, 201);
});
