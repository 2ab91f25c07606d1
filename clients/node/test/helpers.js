'use strict';

// Shared by the test files: connections (PGHOST, PGPORT, PGUSER, PGDATABASE
// from test.sh), unique keys, the reference guard's ledger, app servers.

const fs = require('node:fs');
const pg = require('pg');

const RUN = `${process.pid.toString(36)}${Date.now().toString(36)}`;
let counter = 0;

/** A key no other test uses. */
function uniqueKey(name) {
  counter += 1;
  return `${name}-${RUN}-${counter}`;
}

/** A pool; errors of idle clients (server stopped, backend killed) are ignored. */
function makePool(config = {}) {
  const pool = new pg.Pool({ max: 10, ...config });
  pool.on('error', () => {});
  return pool;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Poll cond() every stepMs until it is truthy or ms have passed; resolves to its last value. */
async function waitFor(cond, ms = 30000, stepMs = 50) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const v = await cond();
    if (v) return v;
    await sleep(stepMs);
  }
  return cond();
}

/**
 * Wait until the server's clock (the one idem's leases use, without
 * idem.clock_offset) has passed ts, a timestamp the server returned.  ts
 * comes as a Date, cut to whole milliseconds: one more millisecond covers
 * the cut.
 */
async function untilServerPast(db, ts, ms = 30000) {
  const past = await waitFor(async () => (await db.query(
    "SELECT pg_catalog.clock_timestamp() >= $1::timestamptz + interval '1 millisecond' AS past", [ts])).rows[0].past, ms);
  if (!past) throw new Error(`the server clock did not pass ${ts.toISOString()} within ${ms} ms`);
}

/**
 * Wait until n connections named appName (application_name) are running an
 * idem_begin call, i.e. waiting in the server; throws after ms.
 */
async function untilWaitingInServer(db, appName, n = 1, ms = 30000) {
  const count = async () => Number((await db.query(
    "SELECT count(*) AS n FROM pg_catalog.pg_stat_activity WHERE application_name = $1::text AND state = 'active'" +
    " AND query LIKE '%idem_begin%'", [appName])).rows[0].n);
  const seen = await waitFor(async () => (await count()) >= n, ms);
  if (!seen) throw new Error(`${appName}: ${await count()} calls waiting in the server, not ${n}, after ${ms} ms`);
}

/**
 * A guard holding key with its handler parked on a gate: resolves once the
 * claim is committed; open(outcome) lets the handler answer (or throw).
 */
async function holdKey(guard, key, fingerprint = 'fp') {
  let open;
  const gate = new Promise((resolve) => { open = resolve; });
  let claimed;
  const started = new Promise((resolve) => { claimed = resolve; });
  const done = guard.do(key, fingerprint, async (claim) => {
    claimed(claim);
    const answer = await gate;
    if (answer instanceof Error) throw answer;
    return answer;
  });
  const claim = await Promise.race([started, done.then((r) => { throw new Error(`the holder did not run: ${r.outcome}`); })]);
  return { claim, open, done };
}

/** The reference test's ledger: stock, one reservation and one charge per key. */
class Ledger {
  constructor(stock) {
    this.stock = stock;
    this.reservations = new Map();
    this.charges = new Map();
  }

  apply(key, qty, cents) {
    if (this.reservations.has(key)) return true;
    if (this.stock < qty) return false;
    this.stock -= qty;
    this.reservations.set(key, qty);
    this.charges.set(key, cents);
    return true;
  }
}

/** The reference test's handler: count the call, wait, apply to the ledger. */
function ledgerHandler(ledger, key, calls, delayMs) {
  return async () => {
    calls.n += 1;
    if (delayMs > 0) await sleep(delayMs);
    if (!ledger.apply(key, 1, 1000)) return { status: 409, body: 'OUT_OF_STOCK' };
    return { status: 200, body: 'paid' };
  };
}

/** The stored row of a key (idem_lookup), or null. */
async function lookup(db, key, scope = '') {
  const r = await db.query('SELECT state, token, status, body_size FROM public.idem_lookup($1::text, $2::text)', [key, scope]);
  return r.rows[0] || null;
}

/** Listen on an ephemeral port; resolves to { url, close }. */
function listen(app) {
  return new Promise((resolve, reject) => {
    const server = app.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      resolve({
        server,
        url: `http://127.0.0.1:${port}`,
        close: () => new Promise((done) => {
          if (typeof server.closeAllConnections === 'function') server.closeAllConnections();
          server.close(() => done());
        }),
      });
    });
    server.on('error', reject);
  });
}

/** Note a child process id so that test.sh kills it on exit whatever happens. */
function recordPid(pid) {
  if (process.env.IDEM_TEST_PIDFILE) fs.appendFileSync(process.env.IDEM_TEST_PIDFILE, `${pid}\n`);
}

/** Count outcomes: { executed: n, ... }. */
function countOutcomes(results) {
  const counts = { executed: 0, replayed: 0, in_flight: 0, conflict: 0, unavailable: 0 };
  for (const r of results) counts[r.outcome] += 1;
  return counts;
}

/** A pool that reaches no server (a socket directory with no server in it: test.sh's own, IDEM_TEST_DOWN_HOST). */
function deadPool() {
  return makePool({ host: process.env.IDEM_TEST_DOWN_HOST || '/nonexistent-idem-socket-dir', port: 1, connectionTimeoutMillis: 2000 });
}

/**
 * Round trips counted on the wire: every request a node-pg client sends
 * ends in one Sync (the extended protocol: a parameterized query, or
 * lib/pipeline.js's statements together) or is one Query message (the
 * simple protocol), and each is answered before the next is sent.
 * count(client) counts client's from now on; counter.n is the total,
 * counter.texts the SQL each carried (a Parse's text, a Query's),
 * counter.restore() stops counting.  countingPool(pool, counter): a pool
 * whose clients are counted while checked out.
 */
function wireCounter() {
  const counter = { n: 0, texts: [], restores: [] };
  counter.count = (client) => {
    const con = client.connection;
    const { sync, query, parse } = con;
    con.sync = function countedSync(...a) { counter.n += 1; return sync.apply(this, a); };
    con.query = function countedQuery(text, ...a) { counter.n += 1; counter.texts.push(text); return query.call(this, text, ...a); };
    con.parse = function countedParse(q, ...a) { counter.texts.push(q.text); return parse.call(this, q, ...a); };
    const restore = () => { con.sync = sync; con.query = query; con.parse = parse; };
    counter.restores.push(restore);
    return restore;
  };
  counter.reset = () => { counter.n = 0; counter.texts.length = 0; };
  counter.restore = () => { counter.restores.splice(0).forEach((r) => r()); };
  return counter;
}

function countingPool(pool, counter) {
  return {
    connect: async () => {
      const c = await pool.connect();
      const restore = counter.count(c);
      const release = c.release;
      c.release = (...a) => { restore(); c.release = release; return release.apply(c, a); };
      return c;
    },
  };
}

module.exports = {
  wireCounter, countingPool,
  uniqueKey, makePool, sleep, waitFor, untilServerPast, untilWaitingInServer, holdKey, Ledger, ledgerHandler, lookup, listen, recordPid, countOutcomes, deadPool,
};
