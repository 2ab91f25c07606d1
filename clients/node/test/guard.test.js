'use strict';

// One test per guard outcome, release on handler error, the heartbeat, the
// token, bodies as bytes, error classes per SQLSTATE, schema qualification.

const test = require('node:test');
const assert = require('node:assert/strict');
const pg = require('pg');
const idem = require('..');
const {
  Guard, Outcome, Store, failTimes, IdemError, UnavailableError, TimeoutError, FingerprintMismatchError,
  TokenSupersededError, NoClaimError, AlreadyCompletedError,
} = idem;
const {
  makePool, uniqueKey, sleep, untilServerPast, untilWaitingInServer, holdKey, lookup, deadPool,
  wireCounter, countingPool,
} = require('./helpers');

const pool = makePool({ max: 10 });
test.after(() => pool.end());

test('executed: the handler gets the claim and its token, the response is stored', async () => {
  const guard = new Guard(pool, { lease: 10000, scope: 'tenant-a' });
  const key = uniqueKey('exec');
  let seen = null;
  const r = await guard.do(key, 'fp', async (claim) => {
    seen = claim;
    return { status: 201, body: Buffer.from('created') };
  });
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(r.error, null);
  assert.equal(r.failedStep, null);
  assert.equal(typeof r.token, 'bigint');
  assert.ok(r.token > 0n);
  assert.equal(seen.token, r.token);
  assert.equal(seen.key, key);
  assert.equal(seen.scope, 'tenant-a');
  assert.equal(seen.lost, false);
  assert.deepEqual(r.response, { status: 201, body: Buffer.from('created') });
  const row = await lookup(pool, key, 'tenant-a');
  assert.equal(row.state, 'DONE');
  assert.equal(row.status, 201);
  assert.equal(row.body_size, 7);
  assert.equal(BigInt(row.token), r.token);
  assert.equal(await lookup(pool, key, ''), null, 'scopes are separate');
});

test('replayed: the stored status and body, the handler not called', async () => {
  const guard = new Guard(pool);
  const key = uniqueKey('replay');
  let calls = 0;
  const h = async () => {
    calls += 1;
    return { status: 202, body: 'accepted' };
  };
  assert.equal((await guard.do(key, 'fp', h)).outcome, Outcome.EXECUTED);
  const r = await guard.do(key, 'fp', h);
  assert.equal(r.outcome, Outcome.REPLAYED);
  assert.equal(r.token, null);
  assert.equal(r.response.status, 202);
  assert.deepEqual(r.response.body, Buffer.from('accepted'));
  assert.equal(calls, 1);
});

test('in flight: a live committed claim elsewhere; with wait=false also an uncommitted one', async () => {
  const guard = new Guard(pool, { lease: 10000 });
  const key = uniqueKey('inflight');
  let release;
  const gate = new Promise((resolve) => { release = resolve; });
  let calls = 0;
  const first = guard.do(key, 'fp', async () => {
    calls += 1;
    await gate;
    return { status: 200, body: 'ok' };
  });
  while (calls === 0) await sleep(5);
  const second = await guard.do(key, 'fp', async () => { calls += 1; return { status: 200 }; });
  assert.equal(second.outcome, Outcome.IN_FLIGHT);
  assert.equal(second.response, null);
  assert.equal(calls, 1);
  release();
  assert.equal((await first).outcome, Outcome.EXECUTED);

  // An uncommitted claim: wait=false answers in flight at once.
  const key2 = uniqueKey('inflight-nowait');
  const holder = new pg.Client();
  await holder.connect();
  try {
    await holder.query('BEGIN');
    await holder.query("SELECT * FROM public.idem_begin($1::text, 'fp'::text)", [key2]);
    const t0 = Date.now();
    const r = await guard.do(key2, 'fp', async () => { calls += 1; return { status: 200 }; }, { wait: false });
    const elapsed = Date.now() - t0;
    assert.equal(r.outcome, Outcome.IN_FLIGHT);
    // Waiting would last until the guard's timeout (10 s) cancels it.
    assert.ok(elapsed < guard.options.timeout / 2, `answered after ${elapsed} ms`);
    assert.equal(calls, 1);
  } finally {
    await holder.query('ROLLBACK');
    await holder.end();
  }
});

test('waitFor: a duplicate waits in the server while the holder runs and replays the same bytes', async (t) => {
  const waiters = makePool({ max: 2, application_name: 'idem-wait-replay' });
  let holder = null;
  t.after(async () => {
    if (holder) holder.open({ status: 200 }); // a test that fails with the holder parked ends it
    await waiters.end();
  });
  const key = uniqueKey('wait-replay');
  const bytes = Buffer.from([0, 255, 10, 13, 92, 120, 52, 49, 0xc3, 0x28]);
  holder = await holdKey(new Guard(pool, { lease: 60000 }), key);
  let calls = 0;
  const duplicate = new Guard(waiters, { lease: 60000, waitFor: 30000 })
    .do(key, 'fp', async () => { calls += 1; return { status: 500 }; });
  // The duplicate's idem_begin is running: it waits for the holder instead of answering in flight.
  await untilWaitingInServer(pool, 'idem-wait-replay');
  holder.open({ status: 201, body: bytes });
  const first = await holder.done;
  assert.equal(first.outcome, Outcome.EXECUTED);
  assert.equal(first.failedStep, null);
  const r = await duplicate;
  assert.equal(r.outcome, Outcome.REPLAYED, `the duplicate answered ${r.outcome} (${r.error})`);
  assert.equal(r.error, null);
  assert.equal(r.token, null);
  assert.equal(r.response.status, 201);
  assert.ok(Buffer.isBuffer(r.response.body));
  assert.deepEqual(r.response.body, bytes);
  assert.equal(calls, 0);
});

test('waitFor: the holder releases while the duplicate waits, the duplicate claims with a greater token', async (t) => {
  const waiters = makePool({ max: 2, application_name: 'idem-wait-release' });
  let holder = null;
  t.after(async () => {
    if (holder) holder.open({ status: 200 }); // a test that fails with the holder parked ends it
    await waiters.end();
  });
  const key = uniqueKey('wait-release');
  holder = await holdKey(new Guard(pool, { lease: 60000 }), key);
  let seen = null;
  const duplicate = new Guard(waiters, { lease: 60000, waitFor: 30000 })
    .do(key, 'fp', async (claim) => { seen = claim.token; return { status: 200, body: 'second' }; });
  await untilWaitingInServer(pool, 'idem-wait-release');
  const boom = new Error('provider said no');
  holder.open(boom);
  const first = await holder.done;
  assert.equal(first.failedStep, 'handler');
  assert.equal(first.error, boom);
  assert.equal(first.released, true);
  const r = await duplicate;
  assert.equal(r.outcome, Outcome.EXECUTED, `the duplicate answered ${r.outcome} (${r.error})`);
  assert.equal(r.failedStep, null);
  assert.equal(seen, r.token);
  assert.ok(r.token > holder.claim.token, `${r.token} > ${holder.claim.token}`);
  const row = await lookup(pool, key);
  assert.equal(row.state, 'DONE');
  assert.equal(BigInt(row.token), r.token);
  assert.deepEqual((await new Guard(pool).do(key, 'fp', async () => ({ status: 500 }))).response.body, Buffer.from('second'));
});

test('waitFor: the wait runs out, in flight with the holder\'s lease_until; the call\'s budget is timeout + waitFor', async () => {
  const key = uniqueKey('wait-out');
  const holder = await holdKey(new Guard(pool, { lease: 60000 }), key);
  try {
    // timeout (1 s) alone is shorter than the wait (2 s): the wait must still end by itself, not in a timeout.
    const guard = new Guard(pool, { waitFor: 2000, timeout: 1000 });
    let calls = 0;
    const t0 = Date.now();
    const r = await guard.do(key, 'fp', async () => { calls += 1; return { status: 200 }; });
    const elapsed = Date.now() - t0;
    assert.equal(r.outcome, Outcome.IN_FLIGHT, `answered ${r.outcome} (${r.error})`);
    assert.equal(r.error, null);
    assert.equal(r.token, null);
    assert.equal(r.response, null);
    assert.equal(calls, 0);
    assert.ok(elapsed >= 1900, `answered after ${elapsed} ms, before the wait ran out`);
    assert.ok(r.leaseUntil instanceof Date);
    assert.equal(r.leaseUntil.getTime(), holder.claim.leaseUntil.getTime());
  } finally {
    holder.open({ status: 200, body: 'ok' });
    assert.equal((await holder.done).outcome, Outcome.EXECUTED);
  }
});

test('waitFor on a database whose idem_begin has no wait_for: the six-argument call, asked again only after a while', async (t) => {
  const admin = new pg.Client();
  await admin.connect();
  // A schema with the functions as a database without wait_for has them.
  await admin.query(`CREATE SCHEMA IF NOT EXISTS idem_nowait;
    CREATE OR REPLACE FUNCTION idem_nowait.idem_begin(text, text, interval, interval, text, boolean)
      RETURNS TABLE (claimed boolean, state text, token bigint, status integer, body bytea,
                     lease_until timestamptz, expires_at timestamptz)
      LANGUAGE sql AS $$ SELECT claimed, state, token, status, body, lease_until, expires_at
                         FROM public.idem_begin($1, $2, $3, $4, $5, $6) $$;
    CREATE OR REPLACE FUNCTION idem_nowait.idem_complete(text, text, integer, bytea, bigint, interval, text)
      RETURNS timestamptz LANGUAGE sql AS $$ SELECT public.idem_complete($1, $2, $3, $4, $5, $6, $7) $$;`);
  t.after(async () => {
    await admin.query('DROP SCHEMA idem_nowait CASCADE');
    await admin.end();
  });
  const texts = [];
  const spy = {
    async connect() {
      const c = await pool.connect();
      return {
        query: (q, v) => {
          texts.push(typeof q === 'string' ? q : q.text);
          return c.query(q, v);
        },
        release: (e) => c.release(e),
        on: (...a) => c.on(...a),
      };
    },
  };
  const calls = () => texts.filter((q) => q.includes('idem_begin'));
  const guard = new Guard(spy, { schema: 'idem_nowait', waitFor: 5000 });
  const key = uniqueKey('nowait');
  const r = await guard.do(key, 'fp', async () => ({ status: 201, body: 'made' }));
  assert.equal(r.outcome, Outcome.EXECUTED, `answered ${r.outcome} (${r.error})`);
  assert.equal(r.failedStep, null);
  const first = calls();
  assert.equal(first.length, 2);
  assert.match(first[0], /\$7::interval\)/);
  assert.doesNotMatch(first[1], /\$7/);
  const again = await guard.do(key, 'fp', async () => ({ status: 500 }));
  assert.equal(again.outcome, Outcome.REPLAYED);
  assert.deepEqual(again.response.body, Buffer.from('made'));
  assert.equal(calls().length, 3, 'the second call goes straight to the six-argument form');
  assert.doesNotMatch(calls()[2], /\$7/);
});

test('a state the client does not know (a newer server) is a failed claim, not in flight: guard and transaction()', async (t) => {
  const admin = new pg.Client();
  await admin.connect();
  const schema = `idem_future_${process.pid}`;
  await admin.query(`CREATE SCHEMA ${schema};
    CREATE FUNCTION ${schema}.idem_begin(text, text, interval, interval, text, boolean)
      RETURNS TABLE (claimed boolean, state text, token bigint, status integer, body bytea,
                     lease_until timestamptz, expires_at timestamptz)
      LANGUAGE sql AS $$ SELECT false, 'TOMBSTONED', NULL::bigint, 200, pg_catalog.decode('6f6b', 'hex'), NULL::timestamptz,
                                now() + interval '1 day' $$;`);
  t.after(async () => {
    await admin.query(`DROP SCHEMA ${schema} CASCADE`);
    await admin.end();
  });
  let calls = 0;
  const handler = async () => { calls++; return { status: 201, body: 'x' }; };
  const r = await new Guard(pool, { schema }).do(uniqueKey('future'), 'fp', handler);
  assert.equal(r.outcome, Outcome.UNAVAILABLE);
  assert.equal(r.failedStep, 'begin');
  assert.ok(r.error instanceof UnavailableError);
  assert.match(r.error.message, /unknown state "TOMBSTONED"/);
  const c = await pool.connect();
  try {
    await assert.rejects(idem.transaction(c, uniqueKey('future-tx'), 'fp', handler, { schema }),
      (err) => err instanceof UnavailableError && /unknown state "TOMBSTONED"/.test(err.message));
    assert.equal((await c.query('SELECT pg_catalog.txid_current_if_assigned() IS NULL AS idle')).rows[0].idle, true);
  } finally {
    c.release();
  }
  assert.equal(calls, 0);
});

test('conflict: the key with another fingerprint, nothing revealed, the handler not called', async () => {
  const guard = new Guard(pool);
  const key = uniqueKey('conflict');
  let calls = 0;
  await guard.do(key, 'sku=A&qty=1', async () => { calls += 1; return { status: 200, body: 'secret' }; });
  const r = await guard.do(key, 'sku=A&qty=2', async () => { calls += 1; return { status: 200 }; });
  assert.equal(r.outcome, Outcome.CONFLICT);
  assert.equal(r.response, null);
  assert.equal(r.error, null);
  assert.equal(calls, 1);
});

test('unavailable: no server, a read-only server (25006), an injected fault; the handler never runs', async () => {
  let calls = 0;
  const h = async () => { calls += 1; return { status: 200 }; };

  const down = deadPool();
  const r1 = await new Guard(down, { timeout: 3000 }).do(uniqueKey('down'), 'fp', h);
  await down.end();
  assert.equal(r1.outcome, Outcome.UNAVAILABLE);
  assert.ok(r1.error instanceof UnavailableError);

  const ro = makePool({ max: 2, options: '-c default_transaction_read_only=on' });
  const r2 = await new Guard(ro).do(uniqueKey('readonly'), 'fp', h);
  await ro.end();
  assert.equal(r2.outcome, Outcome.UNAVAILABLE);
  assert.ok(r2.error instanceof UnavailableError);
  assert.equal(r2.error.code, '25006');

  const key3 = uniqueKey('fault');
  const r3 = await new Guard(pool, { fault: failTimes(1, 'begin') }).do(key3, 'fp', h);
  assert.equal(r3.outcome, Outcome.UNAVAILABLE);
  assert.equal(r3.failedStep, 'begin');
  assert.equal(await lookup(pool, key3), null);
  assert.equal(calls, 0);
});

test('a handler error releases the claim: the retry runs at once', async () => {
  const guard = new Guard(pool, { lease: 60000 });
  const key = uniqueKey('release');
  const boom = new Error('provider said no');
  const r = await guard.do(key, 'fp', async () => { throw boom; });
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(r.failedStep, 'handler');
  assert.equal(r.error, boom);
  assert.equal(r.released, true);
  assert.equal(await lookup(pool, key), null);
  const again = await guard.do(key, 'fp', async () => ({ status: 200, body: 'ok' }));
  assert.equal(again.outcome, Outcome.EXECUTED);
  assert.ok(again.token > r.token);
});

test('keepClaimOnError leaves the claim to its lease, as the reference guard does', async () => {
  const guard = new Guard(pool, { lease: 60000, keepClaimOnError: true });
  const key = uniqueKey('keep');
  const r = await guard.do(key, 'fp', async () => { throw new Error('x'); });
  assert.equal(r.failedStep, 'handler');
  assert.equal(r.released, false);
  assert.equal((await lookup(pool, key)).state, 'PROCESSING');
  assert.equal((await guard.do(key, 'fp', async () => ({ status: 200 }))).outcome, Outcome.IN_FLIGHT);
});

test('heartbeat keeps a slow handler\'s claim past its lease; without it the key is taken over (ID002 on complete)', async () => {
  // Ten beats per lease: the lease outlives a few late beats.
  const LEASE = 3000;
  const BEAT = 300;
  for (const heartbeat of [true, false]) {
    const guard = new Guard(pool, { lease: LEASE, heartbeat: heartbeat ? BEAT : false });
    const key = uniqueKey(`hb-${heartbeat}`);
    let probe = null;
    const r = await guard.do(key, 'fp', async (claim) => {
      // Past the lease the claim was made with, by the server's clock.
      await untilServerPast(pool, claim.leaseUntil);
      probe = await guard.do(key, 'fp', async () => ({ status: 200, body: 'second' }));
      return { status: 200, body: 'first' };
    });
    if (heartbeat) {
      assert.equal(probe.outcome, Outcome.IN_FLIGHT);
      assert.ok(r.extends >= 3, `extends=${r.extends}`);
      assert.equal(r.superseded, false);
      assert.equal(r.failedStep, null);
      const row = await lookup(pool, key);
      assert.equal(row.state, 'DONE');
      assert.equal(BigInt(row.token), r.token);
    } else {
      assert.equal(probe.outcome, Outcome.EXECUTED, 'taken over after the lease');
      assert.ok(probe.token > r.token);
      assert.equal(r.failedStep, 'complete');
      assert.ok(r.error instanceof TokenSupersededError);
      assert.equal(r.error.code, 'ID002');
    }
  }
});

test('heartbeat finds the token superseded: claim.signal aborts, result.superseded', async () => {
  const guard = new Guard(pool, { lease: 10000, heartbeat: 200 });
  const later = new Guard(pool, { lease: 10000, clockOffset: 20 });
  const key = uniqueKey('superseded');
  const r = await guard.do(key, 'fp', async (claim) => {
    const taken = await later.do(key, 'fp', async () => ({ status: 200, body: 'taker' }));
    assert.equal(taken.outcome, Outcome.EXECUTED);
    await Promise.race([
      new Promise((resolve) => claim.signal.addEventListener('abort', resolve)),
      sleep(5000),
    ]);
    assert.equal(claim.lost, true);
    assert.ok(claim.signal.reason instanceof IdemError);
    return { status: 200, body: 'stale' };
  });
  assert.equal(r.superseded, true);
  assert.equal(r.failedStep, 'complete');
  assert.ok(r.error instanceof IdemError);
  // The taker's response is the one stored.
  const replay = await guard.do(key, 'fp', async () => ({ status: 500 }));
  assert.equal(replay.outcome, Outcome.REPLAYED);
  assert.deepEqual(replay.response.body, Buffer.from('taker'));
});

test('bodies are bytes: every byte value and backslashes round-trip; a string given to bytea as text does not', async () => {
  const guard = new Guard(pool);
  const key = uniqueKey('bytes');
  const bytes = Buffer.concat([Buffer.from(Array.from({ length: 256 }, (_, i) => i)), Buffer.from('\\x41\\\\')]);
  await guard.do(key, 'fp', async () => ({ status: 200, body: bytes }));
  const r = await guard.do(key, 'fp', async () => ({ status: 500 }));
  assert.equal(r.outcome, Outcome.REPLAYED);
  assert.ok(Buffer.isBuffer(r.response.body));
  assert.deepEqual(r.response.body, bytes);

  const key2 = uniqueKey('bytes-string');
  await guard.do(key2, 'fp', async () => ({ status: 200, body: '\\x41' }));
  assert.equal((await lookup(pool, key2)).body_size, 4);
  assert.deepEqual((await guard.do(key2, 'fp', async () => ({ status: 500 }))).response.body, Buffer.from('\\x41'));

  // The trap: the same text passed as a string parameter goes through bytea's escape parser.
  const trap = await pool.query('SELECT $1::bytea AS b', ['\\x41']);
  assert.deepEqual(trap.rows[0].b, Buffer.from('A'));
});

test('error classes for idem SQLSTATEs ID001-ID004 and others', async () => {
  const store = new Store();
  const c = await pool.connect();
  try {
    const key = uniqueKey('errors');
    const row = await store.begin(c, { key, fingerprint: 'fp', lease: 60000 });
    assert.equal(row.claimed, true);
    await assert.rejects(store.complete(c, { key, fingerprint: 'other', status: 200, body: 'x', token: row.token }),
      (e) => e instanceof FingerprintMismatchError && e.code === 'ID001');
    await assert.rejects(store.complete(c, { key, fingerprint: 'fp', status: 200, body: 'x', token: row.token - 1n }),
      (e) => e instanceof TokenSupersededError && e.code === 'ID002');
    await assert.rejects(store.complete(c, { key: uniqueKey('missing'), fingerprint: 'fp', status: 200, token: 1n }),
      (e) => e instanceof NoClaimError && e.code === 'ID003');
    await store.complete(c, { key, fingerprint: 'fp', status: 200, body: 'x', token: row.token });
    await assert.rejects(store.release(c, { key, token: row.token }),
      (e) => e instanceof AlreadyCompletedError && e.code === 'ID004');
    await assert.rejects(store.complete(c, { key, fingerprint: 'fp', status: 201, body: 'y', token: row.token }),
      (e) => e instanceof AlreadyCompletedError);
    await assert.rejects(store.begin(c, { key: '', fingerprint: 'fp' }),
      (e) => e instanceof IdemError && e.code === '22023' && !(e instanceof UnavailableError));
    await c.query('SET statement_timeout = 1');
    await assert.rejects(c.query('SELECT pg_sleep(1)').catch((e) => { throw idem.toIdemError(e); }),
      (e) => e instanceof TimeoutError && e.code === '57014');
    await c.query('RESET statement_timeout');
    const lk = await store.lookup(c, { key });
    assert.equal(lk.state, 'DONE');
    assert.equal(lk.bodySize, 1);
  } finally {
    c.release();
  }
});

test('schema-qualified calls: another schema by option, a hostile search_path changes nothing', async (t) => {
  const admin = new pg.Client();
  await admin.connect();
  const db = `idem_schema_${process.pid}`;
  await admin.query(`DROP DATABASE IF EXISTS ${db}`);
  await admin.query(`CREATE DATABASE ${db}`);
  t.after(async () => {
    await admin.query(`DROP DATABASE IF EXISTS ${db} WITH (FORCE)`);
    await admin.end();
  });
  const setup = new pg.Client({ database: db });
  await setup.connect();
  await setup.query(`CREATE SCHEMA app_idem; CREATE EXTENSION idem SCHEMA app_idem;
    CREATE SCHEMA evil;
    CREATE FUNCTION evil.idem_begin(text, text, interval, interval, text, boolean)
      RETURNS TABLE (claimed boolean, state text, token bigint, status integer, body bytea,
                     lease_until timestamptz, expires_at timestamptz)
      LANGUAGE sql AS $$ SELECT true, 'PROCESSING', 1::bigint, NULL::integer, NULL::bytea, now(), now() $$;`);
  await setup.end();
  const hostile = makePool({ database: db, max: 2, options: '-c search_path=evil,app_idem,public' });
  try {
    const guard = new Guard(hostile, { schema: 'app_idem' });
    const key = uniqueKey('schema');
    let calls = 0;
    const h = async () => { calls += 1; return { status: 200, body: 'ok' }; };
    const r1 = await guard.do(key, 'fp', h);
    assert.equal(r1.outcome, Outcome.EXECUTED);
    // evil.idem_begin always answers claimed: a replay proves it was not called.
    assert.equal((await guard.do(key, 'fp', h)).outcome, Outcome.REPLAYED);
    const row = await hostile.query('SELECT state FROM app_idem.idem_lookup($1::text, $2::text)', [key, '']);
    assert.equal(row.rows[0].state, 'DONE');
    assert.equal(calls, 1);
    // The default schema is public, where this database has no idem: never the evil function.
    const r3 = await new Guard(hostile).do(uniqueKey('schema-public'), 'fp', h);
    assert.equal(r3.outcome, Outcome.UNAVAILABLE);
    assert.equal(r3.error.code, '42883');
    assert.equal(calls, 1);
  } finally {
    await hostile.end();
  }
});

test('bad options and arguments are TypeErrors', async () => {
  assert.throws(() => new Guard(null), TypeError);
  assert.throws(() => new Guard(pool, { timeout: -1 }), TypeError);
  await assert.rejects(new Guard(pool).do(1, 'fp', async () => ({ status: 200 })), TypeError);
  assert.throws(() => new Guard(pool, { clockOffset: 1.5 }), TypeError);
  assert.throws(() => new Guard(pool, { lease: -5 }), TypeError);
  assert.throws(() => new Guard(pool, { retention: {} }), TypeError);
  assert.throws(() => new Guard(pool, { waitFor: -1 }), TypeError);
  assert.throws(() => new Guard(pool, { waitFor: '5s' }), TypeError);
  assert.throws(() => new Guard(pool, { waitFor: 1000, wait: false }), TypeError);
  assert.equal(new Guard(pool, { waitFor: null }).options.waitFor, 0);
  // An offset function is read per call: a bad value there makes that call fail, the handler unrun.
  let calls = 0;
  const r = await new Guard(pool, { clockOffset: () => 1.5 }).do(uniqueKey('offset'), 'fp', async () => { calls += 1; return { status: 200 }; });
  assert.equal(r.outcome, Outcome.UNAVAILABLE);
  assert.equal(calls, 0);
  const bad = await new Guard(pool).do(uniqueKey('badresp'), 'fp', async () => 'not a response');
  assert.equal(bad.failedStep, 'handler');
  assert.ok(bad.error instanceof TypeError);
  assert.equal(bad.released, true);
});

test('round trips on the wire: a new key is two (the claim with its BEGIN and COMMIT, the complete with its own), a replay one; values are parameters, never SQL text', async () => {
  const counter = wireCounter();
  const guard = new Guard(countingPool(pool, counter), { scope: "it's \\scoped" });
  const key = uniqueKey("it's \\a key");
  const r = await guard.do(key, 'fp', async () => ({ status: 201, body: Buffer.from('once') }));
  assert.equal(r.outcome, Outcome.EXECUTED);
  assert.equal(counter.n, 2, counter.texts.join('\n'));
  assert.ok(counter.texts.every((t) => !t.includes('scoped') && !t.includes('a key')), counter.texts.join('\n'));
  counter.reset();
  const again = await guard.do(key, 'fp', async () => ({ status: 500 }));
  assert.equal(again.outcome, Outcome.REPLAYED);
  assert.equal(again.response.body.toString(), 'once');
  assert.equal(counter.n, 1);
  assert.equal((await lookup(pool, key, "it's \\scoped")).status, 201);
});
