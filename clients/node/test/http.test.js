'use strict';

// doc/http.md in the Node client: the fixed answer stored when a response
// cannot be stored (guard, transaction(), middleware), transactional mode,
// the replay policy per route, the envelope (and the old one still read),
// Idempotency-Expires, client timeouts that leave no claim, and the error
// of a schema without the idem functions.  test/http/conformance.py checks
// the rest over test/conformance_app.js (test.sh).

const test = require('node:test');
const assert = require('node:assert/strict');
const express = require('express');
const pg = require('pg');
const {
  Guard, Outcome, transaction, idempotency, saveRawBody, defaultFingerprint, parseKey, NOT_STORED, IdemError,
  TimeoutError, UnavailableError,
} = require('..');
const { encodeEnvelope, decodeEnvelope } = require('../lib/express');
const { makePool, uniqueKey, sleep, waitFor, lookup, listen } = require('./helpers');

const pool = makePool({ max: 12 });
// idem.max_body_size of 1000 bytes for this pool's sessions (superuser).
const small = makePool({ max: 6, options: '-c idem.max_body_size=1000' });
const servers = [];
const holders = new Set();

test.before(async () => {
  await pool.query('CREATE TABLE IF NOT EXISTS http_orders (id bigserial PRIMARY KEY, key text NOT NULL)');
});
test.afterEach(async () => {
  for (const h of holders) await endHolder(h).catch(() => {});
});
test.after(async () => {
  for (const s of servers) await s.close();
  await pool.end();
  await small.end();
});

/** A logger keeping its warnings. */
function recorder() {
  const lines = [];
  return { lines, warn: (m) => lines.push(m) };
}

async function rows(key) {
  return Number((await pool.query('SELECT count(*) AS n FROM http_orders WHERE key = $1', [key])).rows[0].n);
}

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

/**
 * An app with POST /orders (inserts into http_orders on the request's
 * client in transactional mode, else on the pool) answering X-Status
 * (201), with X-Size bytes of body when given, and /throw (inserts, then
 * throws).  state.gate, when set, holds the handler after its insert.
 */
async function start(p, idemOptions) {
  const state = { calls: 0, gate: null };
  const app = express();
  app.set('env', 'test');
  app.use(express.json({ verify: saveRawBody }));
  app.use(idempotency(p, { lease: 30000, shared: true, ...idemOptions }));
  const db = (req) => (req.idempotency.client || p);
  app.post('/orders', async (req, res, next) => {
    try {
      state.calls += 1;
      const r = await db(req).query('INSERT INTO http_orders (key) VALUES ($1) RETURNING id', [req.idempotency.key]);
      if (state.gate) await state.gate;
      const size = Number(req.get('X-Size'));
      res.status(Number(req.get('X-Status')) || 201).set('Location', `/orders/${r.rows[0].id}`);
      if (size > 0) res.type('application/octet-stream').send(Buffer.alloc(size, 'y'));
      else res.json({ order: Number(r.rows[0].id) });
    } catch (err) {
      next(err);
    }
  });
  app.post('/throw', async (req, res, next) => {
    state.calls += 1;
    try {
      await db(req).query('INSERT INTO http_orders (key) VALUES ($1)', [req.idempotency.key]);
      throw new Error('boom');
    } catch (err) {
      next(err);
    }
  });
  const srv = await listen(app);
  servers.push(srv);
  return { url: srv.url, state };
}

function post(url, key, headers = {}, body = '{}') {
  return fetch(url, { method: 'POST', headers: { 'Content-Type': 'application/json', 'Idempotency-Key': key, ...headers }, body });
}

test('the guard stores the fixed 500 when idem_complete fails for good, warns with the key; a retry replays it', async () => {
  const key = uniqueKey('notstored-guard');
  const log = recorder();
  let failed = 0;
  // The first idem_complete fails with a data error (22023), the fixed answer's goes through.
  const fault = (op) => (op === 'complete' && failed++ === 0 ? new IdemError('bad value', { code: '22023' }) : null);
  const guard = new Guard(pool, { fault, logger: log });
  let calls = 0;
  const r = await guard.do(key, 'fp', async () => { calls += 1; return { status: 201, body: 'made' }; });
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(r.failedStep, 'complete');
  assert.equal(r.error.code, '22023');
  assert.equal(r.notStored, true);
  assert.ok(r.expiresAt instanceof Date);
  assert.deepEqual(r.response, { status: 201, body: Buffer.from('made') });
  assert.equal(log.lines.length, 1);
  assert.match(log.lines[0], new RegExp(`${key}.*22023.*Response not stored`));
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(row.status, 500);
  const again = await guard.do(key, 'fp', async () => { calls += 1; return { status: 201 }; });
  assert.equal(again.outcome, Outcome.REPLAYED);
  assert.equal(again.response.status, 500);
  assert.deepEqual(again.response.body, NOT_STORED.body);
  assert.deepEqual(JSON.parse(again.response.body), {
    type: 'about:blank', title: 'Response not stored', status: 500,
    detail: 'The response to the first request with this key was larger than idem.max_body_size; it was sent then and is not replayed.',
  });
  assert.equal(calls, 1);
});

test('a transient idem_complete failure keeps the claim (never released to a retry) and warns', async () => {
  const key = uniqueKey('notstored-transient');
  const log = recorder();
  const guard = new Guard(pool, { fault: (op) => op === 'complete', logger: log, lease: 60000 });
  const r = await guard.do(key, 'fp', async () => ({ status: 201, body: 'made' }));
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(r.failedStep, 'complete');
  assert.ok(r.error instanceof UnavailableError);
  assert.equal(r.notStored, false);
  assert.equal(log.lines.length, 1);
  assert.match(log.lines[0], new RegExp(`${key}.*stays claimed`));
  assert.equal((await lookup(pool, key)).state, 'PROCESSING');
  const retry = await new Guard(pool, { wait: false }).do(key, 'fp', async () => ({ status: 201 }));
  assert.equal(retry.outcome, Outcome.IN_FLIGHT);
});

test('a body over idem.max_body_size through the guard: stored as the fixed 500, the retry replays it', async () => {
  const key = uniqueKey('big-guard');
  const log = recorder();
  const guard = new Guard(small, { logger: log });
  const r = await guard.do(key, 'fp', async () => ({ status: 200, body: Buffer.alloc(1001, 'z') }));
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(r.response.body.length, 1001);
  assert.ok(r.failedStep === null || r.notStored, `failedStep ${r.failedStep}`);
  const again = await guard.do(key, 'fp', async () => ({ status: 200 }));
  assert.equal(again.outcome, Outcome.REPLAYED);
  assert.equal(again.response.status, 500);
  assert.deepEqual(again.response.body, NOT_STORED.body);
});

test('transaction(): a refused idem_complete falls back to a savepoint and commits the fixed 500 with the handler\'s writes', async () => {
  const client = await pool.connect();
  try {
    // A negative status: idem_complete refuses it (a data error), the fixed answer is stored instead.
    // A body over idem.max_body_size: idem_complete stores the fixed answer itself.
    for (const [name, response, set] of [
      ['bad-status', { status: -1, body: 'made' }, null],
      ['big-body', { status: 201, body: 'x'.repeat(11) }, "SELECT pg_catalog.set_config('idem.max_body_size', '10', true)"],
    ]) {
      const key = uniqueKey(`notstored-tx-${name}`);
      const log = recorder();
      const r = await transaction(client, key, 'fp', async (claim) => {
        await claim.client.query('INSERT INTO http_orders (key) VALUES ($1)', [key]);
        if (set) await claim.client.query(set);
        return response;
      }, { logger: log });
      assert.equal(r.outcome, Outcome.EXECUTED, name);
      assert.equal(r.response.status, response.status, name);
      assert.ok(r.expiresAt instanceof Date, name);
      assert.equal(r.notStored, set === null, name);
      assert.equal(log.lines.length, set === null ? 1 : 0, name);
      if (set === null) assert.match(log.lines[0], new RegExp(key));
      assert.equal(await rows(key), 1, `${name}: the handler's write committed`);
      const row = await lookup(pool, key);
      assert.equal(row.state, 'DONE', name);
      assert.equal(row.status, 500, name);
    }
  } finally {
    client.release();
  }
});

test('envelope: idem-http/1 with lower-case [name, value] pairs; the old IDEMHTTP1 form still decodes', () => {
  const env = encodeEnvelope([['Content-Type', 'text/plain'], ['set-cookie', 'a=1'], ['set-cookie', 'b=2']], Buffer.from('hi\n'));
  assert.equal(env.toString(), 'idem-http/1\n[["content-type","text/plain"],["set-cookie","a=1"],["set-cookie","b=2"]]\nhi\n');
  assert.deepEqual(decodeEnvelope(env), {
    headers: [['content-type', 'text/plain'], ['set-cookie', 'a=1'], ['set-cookie', 'b=2']], body: Buffer.from('hi\n'),
  });
  const old = Buffer.from('IDEMHTTP1\n{"content-type":"text/plain","set-cookie":["a=1","b=2"]}\nhi');
  assert.deepEqual(decodeEnvelope(old), {
    headers: [['content-type', 'text/plain'], ['set-cookie', 'a=1'], ['set-cookie', 'b=2']], body: Buffer.from('hi'),
  });
  // Not an envelope: all body.
  assert.deepEqual(decodeEnvelope(Buffer.from('idem-http/1\nnot json\nx')).headers, []);
  assert.equal(decodeEnvelope(Buffer.from('plain')).body.toString(), 'plain');
});

test('parseKey: sf-string or bare token, printable ASCII, 1 to 255 bytes', () => {
  assert.equal(parseKey('abc'), 'abc');
  assert.equal(parseKey('"abc"'), 'abc');
  assert.equal(parseKey(' \t"a\\"b\\\\c" '), 'a"b\\c');
  assert.equal(parseKey('a b'), 'a b');
  assert.equal(parseKey('k'.repeat(255)), 'k'.repeat(255));
  for (const bad of ['', '""', '"abc', '"a\\qb"', '"a"b', '"a" "b"', 'a\x01b', 'a\x7fb', 'a\x1bb', 'a\tb', '"a\x1b"', 'caf\xe9', '"caf\xe9"', 'k'.repeat(256)]) {
    assert.equal(parseKey(bad), null, JSON.stringify(bad));
  }
});

test('a replay of a response stored in the old IDEMHTTP1 envelope has its headers and body', async () => {
  const { url, state } = await start(pool, {});
  const key = uniqueKey('old-envelope');
  const fp = defaultFingerprint({ method: 'POST', originalUrl: '/orders' }, Buffer.from('{}'));
  const c = await pool.connect();
  try {
    const b = await c.query("SELECT token FROM public.idem_begin($1::text, $2::text, '30s'::interval)", [key, fp]);
    await c.query('SELECT public.idem_complete($1::text, $2::text, 201, $3::bytea, $4::bigint)',
      [key, fp, Buffer.from('IDEMHTTP1\n{"content-type":"application/json","location":"/orders/9"}\n{"order":9}'), b.rows[0].token]);
  } finally {
    c.release();
  }
  const r = await post(`${url}/orders`, key);
  assert.equal(r.status, 201);
  assert.equal(r.headers.get('idempotent-replayed'), 'true');
  assert.equal(r.headers.get('content-type'), 'application/json');
  assert.equal(r.headers.get('location'), '/orders/9');
  assert.deepEqual(await r.json(), { order: 9 });
  assert.equal(state.calls, 0);
});

test('middleware: a body over idem.max_body_size is sent once, then replayed as the fixed 500 problem+json', async () => {
  const { url, state } = await start(small, {});
  const key = uniqueKey('big-http');
  const first = await post(`${url}/orders`, key, { 'X-Size': '1001' });
  assert.equal(first.status, 201);
  assert.equal((await first.arrayBuffer()).byteLength, 1001);
  const again = await post(`${url}/orders`, key, { 'X-Size': '1001' });
  assert.equal(again.status, 500);
  assert.equal(again.headers.get('idempotent-replayed'), 'true');
  assert.equal(again.headers.get('content-type'), 'application/problem+json');
  assert.match(again.headers.get('idempotency-expires'), /^[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT$/);
  assert.deepEqual(Buffer.from(await again.arrayBuffer()), NOT_STORED.body);
  assert.equal(state.calls, 1);
  assert.equal(await rows(key), 1);
});

test('storeStatus per route; Idempotency-Expires is the key\'s expires_at, on the stored answer and its replay only', async () => {
  const keep418 = await start(pool, { storeStatus: (s) => s === 418 });
  const key = uniqueKey('policy');
  const a = await post(`${keep418.url}/orders`, key, { 'X-Status': '418' });
  assert.equal(a.status, 418);
  // As epoch milliseconds: the text form follows the database's DateStyle (the suite also runs in 'SQL, DMY').
  const row = await pool.query('SELECT (extract(epoch FROM expires_at) * 1000)::int8 AS ms' +
    ' FROM public.idem_lookup($1::text, \'\')', [key]);
  assert.equal(a.headers.get('idempotency-expires'), new Date(Number(row.rows[0].ms)).toUTCString());
  const b = await post(`${keep418.url}/orders`, key, { 'X-Status': '418' });
  assert.equal(b.headers.get('idempotent-replayed'), 'true');
  assert.equal(b.headers.get('idempotency-expires'), a.headers.get('idempotency-expires'));
  // 201 is not 418 for this route: released, run again, no Idempotency-Expires.
  const key2 = uniqueKey('policy-201');
  const c = await post(`${keep418.url}/orders`, key2);
  assert.equal(c.status, 201);
  assert.equal(c.headers.get('idempotency-expires'), null);
  assert.equal((await post(`${keep418.url}/orders`, key2)).headers.get('idempotent-replayed'), null);
  assert.equal(keep418.state.calls, 3);
  assert.equal(await lookup(pool, key2), null);
  assert.throws(() => idempotency(pool, { shared: true, storeStatus: () => true, storeServerErrors: true }), TypeError);
  assert.throws(() => idempotency(pool, { shared: true, storeStatus: 500 }), TypeError);
});

test('transactional mode: the handler writes on req.idempotency.client; writes, claim and response commit together', async () => {
  const { url, state } = await start(pool, { transactional: true });
  const key = uniqueKey('tx');
  const first = await post(`${url}/orders`, key);
  assert.equal(first.status, 201);
  const body = await first.json();
  assert.ok(first.headers.get('idempotency-expires'));
  assert.equal(await rows(key), 1);
  assert.equal((await lookup(pool, key)).state, 'DONE');
  const again = await post(`${url}/orders`, key);
  assert.equal(again.headers.get('idempotent-replayed'), 'true');
  assert.deepEqual(await again.json(), body);
  assert.equal(state.calls, 1);
  // A 5xx (not stored) and a handler that throws roll their writes back with the claim.
  for (const [path, headers] of [['/orders', { 'X-Status': '503' }], ['/throw', {}]]) {
    const k = uniqueKey('tx-rollback');
    const r = await post(`${url}${path}`, k, headers);
    assert.ok(r.status >= 500, `${path}: ${r.status}`);
    assert.equal(await rows(k), 0, `${path}: no write left`);
    assert.equal(await lookup(pool, k), null, `${path}: no claim left`);
  }
});

test('transactional mode: a retry waits for the first transaction and replays it; 409 once waitFor runs out', async () => {
  const { url, state } = await start(pool, { transactional: true, waitFor: 400 });
  let open;
  state.gate = new Promise((resolve) => { open = resolve; });
  try {
    const key = uniqueKey('tx-wait');
    const first = post(`${url}/orders`, key);
    while (state.calls === 0) await sleep(5);
    const busy = await post(`${url}/orders`, key);
    assert.equal(busy.status, 409);
    assert.equal(busy.headers.get('retry-after'), '1');
    assert.equal(await rows(key), 0, 'the first request\'s write is not committed yet');
    const waiting = post(`${url}/orders`, key);
    open();
    const a = await first;
    const b = await waiting.then((r) => r, () => null);
    assert.equal(a.status, 201);
    assert.equal(await rows(key), 1);
    // The waiting retry either got the replay or, if it ran out of time first, 409.
    assert.ok(b.status === 409 || b.headers.get('idempotent-replayed') === 'true', `retry ${b.status}`);
    const c = await post(`${url}/orders`, key);
    assert.equal(c.headers.get('idempotent-replayed'), 'true');
    assert.equal(state.calls, 1);
  } finally {
    open();
  }
});

test('transactional mode: a body over idem.max_body_size commits the handler\'s write with the fixed 500', async () => {
  const { url, state } = await start(small, { transactional: true });
  const key = uniqueKey('tx-big');
  const first = await post(`${url}/orders`, key, { 'X-Size': '1001' });
  assert.equal(first.status, 201);
  assert.equal((await first.arrayBuffer()).byteLength, 1001);
  assert.equal(await rows(key), 1);
  const again = await post(`${url}/orders`, key, { 'X-Size': '1001' });
  assert.equal(again.status, 500);
  assert.deepEqual(Buffer.from(await again.arrayBuffer()), NOT_STORED.body);
  assert.equal(state.calls, 1);
});

test('a middleware timeout while another session holds the key: 503 or 409, and the abandoned call never claims the key', async () => {
  // The guard's claim is cancelled at its timeout (503); in transactional mode the wait for
  // another transaction's claim ends at waitFor (409).
  for (const [options, status] of [[{ timeout: 300, waitFor: 0 }, 503], [{ timeout: 300, waitFor: 300, transactional: true }, 409]]) {
    const { url, state } = await start(pool, options);
    const key = uniqueKey('mw-timeout');
    const holder = await holdClaim(key);
    const r = await post(`${url}/orders`, key);
    assert.equal(r.status, status, JSON.stringify(options));
    assert.equal(state.calls, 0);
    // Nothing of the call is still waiting in the server.
    const waiting = await pool.query(`SELECT count(*)::int AS n FROM pg_catalog.pg_stat_activity
      WHERE $1::integer = ANY (pg_catalog.pg_blocking_pids(pid))`, [holder.processID]);
    assert.equal(waiting.rows[0].n, 0);
    await endHolder(holder);
    await sleep(300);
    assert.equal(await lookup(pool, key), null, 'no orphan claim');
    const again = await post(`${url}/orders`, key, {}, '{}');
    assert.equal(again.status, 201);
    assert.equal(state.calls, 1);
  }
});

test('the Guard\'s claim bounds its server-side wait too: a TimeoutError from the server, no claim after the holder rolls back', async () => {
  const key = uniqueKey('guard-bound');
  const holder = await holdClaim(key);
  await pool.query('SELECT 1');
  const r = await new Guard(pool, { timeout: 300, waitFor: 200 }).do(key, 'fp', async () => ({ status: 200 }));
  assert.equal(r.outcome, Outcome.UNAVAILABLE);
  assert.ok(r.error instanceof TimeoutError);
  assert.ok(['57014', '55P03'].includes(r.error.code), `code ${r.error.code}`);
  await endHolder(holder);
  assert.ok(!(await waitFor(async () => (await lookup(pool, key)) !== null, 500, 50)), 'no orphan claim');
});

test('functions not found: the error names the function, the schema and the schema option', async () => {
  await pool.query('CREATE SCHEMA IF NOT EXISTS no_idem_here');
  const r = await new Guard(pool, { schema: 'no_idem_here' }).do(uniqueKey('noschema'), 'fp', async () => ({ status: 200 }));
  assert.equal(r.outcome, Outcome.UNAVAILABLE);
  assert.equal(r.error.code, '42883');
  const fix = '; set the schema: option to the schema where CREATE EXTENSION idem put it,' +
    ' or if the version is old run ALTER EXTENSION idem UPDATE';
  assert.ok(r.error.message.startsWith('idem: idem_begin not found in schema "no_idem_here" (42883: '), r.error.message);
  assert.ok(r.error.message.endsWith(fix), r.error.message);
  const gone = await new Guard(pool, { schema: 'nosuchschema' }).do(uniqueKey('noschema'), 'fp', async () => ({ status: 200 }));
  assert.equal(gone.error.code, '3F000');
  assert.ok(gone.error.message.startsWith('idem: idem_begin not found in schema "nosuchschema" (3F000: schema "nosuchschema" does not exist'),
    gone.error.message);
  assert.ok(gone.error.message.endsWith(fix), gone.error.message);
});
