'use strict';

// Issue #43 item 12: the middleware accepts no key the server refuses.  A
// key, or a scope, longer than the server's idem.max_key_length makes
// idem_begin fail with 22001 (string_data_right_truncation); the
// middleware answers that 400 like any malformed key, not 503 (which
// clients retry): the handler does not run and nothing is claimed.  A
// store that cannot be reached is still 503.
//
// The server's limit is lowered to LIMIT bytes on the middleware's pool
// only (options -c: the tests connect as a superuser, and the setting is
// a superuser's), so a key of LIMIT + 1 bytes passes the middleware's own
// check (255 bytes) and reaches the server.

const test = require('node:test');
const assert = require('node:assert/strict');
const { makePool, uniqueKey, lookup, listen, deadPool } = require('./helpers');
const { createApp } = require('./app');

const LIMIT = 16;
const db = makePool({ max: 2 });
const limited = makePool({ max: 4, options: `-c idem.max_key_length=${LIMIT}` });
const dead = deadPool();
const servers = [];

async function start(pool, idemOptions) {
  const { app, state } = createApp(pool, idemOptions);
  const srv = await listen(app);
  servers.push(srv);
  return { url: srv.url, state };
}

test.after(async () => {
  for (const s of servers) await s.close();
  await Promise.all([db.end(), limited.end(), dead.end()]);
});

function post(url, key, tenant = '') {
  return fetch(`${url}/orders`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', 'Idempotency-Key': key, 'X-Tenant': tenant },
    body: JSON.stringify({ item: 'book' }),
  });
}

/** res is a 400 with the body of a malformed key's answer (malformed: that answer's parsed body). */
async function assertMalformed(res, malformed, sameTitle = true) {
  assert.equal(res.status, 400);
  assert.match(res.headers.get('content-type'), /^application\/problem\+json/);
  assert.equal(res.headers.get('retry-after'), null);
  const body = await res.json();
  assert.deepEqual(Object.keys(body).sort(), Object.keys(malformed).sort());
  assert.equal(body.status, 400);
  if (sameTitle) assert.equal(body.title, malformed.title);
  return body;
}

for (const transactional of [false, true]) {
  const mode = transactional ? 'transactional' : 'default';

  test(`${mode} mode: a key longer than the server's idem.max_key_length is 400, the handler not run, nothing claimed`, async () => {
    const { url, state } = await start(limited, { transactional });
    const bad = await post(url, '"unterminated');
    assert.equal(bad.status, 400);
    const malformed = await bad.json();

    const key = uniqueKey('long').padEnd(LIMIT + 1, 'x').slice(0, LIMIT + 1);
    const body = await assertMalformed(await post(url, key), malformed);
    assert.match(body.detail, /idem\.max_key_length|too long/);
    assert.equal(state.calls.orders, undefined);
    assert.equal(await lookup(db, key), null);
    assert.equal((await post(url, key)).status, 400); // a retry gets the same answer
    assert.equal(state.calls.orders, undefined);
    assert.equal(await lookup(db, key), null);

    // The server's limit itself is a key: claimed, run once, replayed.
    const ok = uniqueKey('ok').padEnd(LIMIT, 'y').slice(0, LIMIT);
    assert.equal((await post(url, ok)).status, 201);
    const again = await post(url, ok);
    assert.equal(again.status, 201);
    assert.equal(again.headers.get('idempotent-replayed'), 'true');
    assert.equal(state.calls.orders, 1);
    assert.equal((await lookup(db, ok)).state, 'DONE');
  });

  test(`${mode} mode: a scope longer than the server's idem.max_key_length is 400, the handler not run, nothing claimed`, async () => {
    const { url, state } = await start(limited, { transactional });
    const malformed = await (await post(url, '"unterminated')).json();
    const key = uniqueKey('s').slice(-LIMIT); // within the limit: the scope is what is refused
    const tenant = 't'.repeat(LIMIT + 1);
    const body = await assertMalformed(await post(url, key, tenant), malformed, false);
    assert.match(body.detail, /scope/);
    assert.equal(state.calls.orders, undefined);
    assert.equal(await lookup(db, key, tenant), null);
  });

  test(`${mode} mode: a store that cannot be reached is still 503`, async () => {
    const { url, state } = await start(dead, { transactional, timeout: 3000 });
    const res = await post(url, 'x'.repeat(LIMIT + 1));
    assert.equal(res.status, 503);
    assert.notEqual(res.headers.get('retry-after'), null);
    assert.equal(state.calls.orders, undefined);
  });
}
