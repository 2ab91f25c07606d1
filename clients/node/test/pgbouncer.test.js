'use strict';

// The guard, its heartbeat, timeouts, the clock offset and the
// one-transaction helper through pgbouncer in transaction pooling mode,
// with fewer server connections than clients: nothing may depend on
// session state.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const { spawn, execFileSync } = require('node:child_process');
const { Guard, Outcome, transaction, failTimes } = require('..');
const {
  makePool, uniqueKey, waitFor, untilServerPast, Ledger, ledgerHandler, countOutcomes, lookup, recordPid,
} = require('./helpers');

const PGBOUNCER = '/usr/sbin/pgbouncer';

// pgbouncer listens on a Unix socket in its own directory, on no TCP
// port: no other suite's server can answer in its place.  The port only
// names the socket file.
const BOUNCER_PORT = 6432;

async function startBouncer() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'idem-node-bouncer-'));
  fs.chmodSync(dir, 0o777);
  const port = BOUNCER_PORT;
  const socket = path.join(dir, `.s.PGSQL.${port}`);
  const user = process.env.PGUSER || 'postgres';
  fs.writeFileSync(path.join(dir, 'userlist.txt'), `"${user}" ""\n`);
  fs.writeFileSync(path.join(dir, 'pgbouncer.ini'), `[databases]
${process.env.PGDATABASE || 'postgres'} = host=${process.env.PGHOST} port=${process.env.PGPORT}

[pgbouncer]
listen_addr =
listen_port = ${port}
unix_socket_dir = ${dir}
auth_type = trust
auth_file = ${dir}/userlist.txt
pool_mode = transaction
server_check_delay = 0
default_pool_size = 3
max_client_conn = 100
logfile = ${dir}/pgbouncer.log
`);
  // pgbouncer refuses to run as root: then as the test cluster's user.
  const args = process.getuid && process.getuid() === 0 ? ['-u', 'idemtest', `${dir}/pgbouncer.ini`] : [`${dir}/pgbouncer.ini`];
  const child = spawn(PGBOUNCER, args, { stdio: 'ignore' });
  recordPid(child.pid);
  const up = await waitFor(async () => {
    if (child.exitCode !== null || child.signalCode !== null) return 'exited';
    return new Promise((resolve) => {
      const s = net.connect(socket, () => { s.end(); resolve(true); });
      s.on('error', () => resolve(false));
    });
  });
  if (up !== true) {
    child.kill('SIGKILL');
    let log = '';
    try {
      log = fs.readFileSync(path.join(dir, 'pgbouncer.log'), 'utf8');
    } catch {
      // no log written
    }
    fs.rmSync(dir, { recursive: true, force: true });
    throw new Error(`pgbouncer did not start on ${socket}\n${log}`);
  }
  return {
    host: dir,
    port,
    stop: async () => {
      child.kill('SIGTERM');
      await new Promise((resolve) => (child.exitCode !== null ? resolve() : child.once('exit', resolve)));
      fs.rmSync(dir, { recursive: true, force: true });
    },
  };
}

test('through pgbouncer (transaction pooling, 3 server connections)', { skip: !fs.existsSync(PGBOUNCER) && `${PGBOUNCER} is not installed` }, async (t) => {
  try {
    execFileSync('id', ['idemtest'], { stdio: 'ignore' });
  } catch {
    if (process.getuid() === 0) return t.skip('no user idemtest to run pgbouncer as');
  }
  const bouncer = await startBouncer();
  const pool = makePool({ host: bouncer.host, port: bouncer.port, max: 10 });
  const direct = makePool({ max: 2 });
  t.after(async () => {
    await pool.end();
    await direct.end();
    await bouncer.stop();
  });

  await t.test('eight concurrent callers: one execution', async () => {
    const guard = new Guard(pool, { prepare: false, lease: 10000, retention: 3600000, timeout: 5000 });
    const key = uniqueKey('bouncer-order-1');
    const ledger = new Ledger(10);
    const calls = { n: 0 };
    const results = await Promise.all(Array.from({ length: 8 }, () =>
      guard.do(key, 'sku=A&qty=1', ledgerHandler(ledger, key, calls, 20))));
    const counts = countOutcomes(results);
    assert.equal(counts.executed, 1, JSON.stringify(counts));
    assert.equal(counts.in_flight + counts.replayed, 7);
    assert.equal(calls.n, 1);
    assert.equal(ledger.stock, 9);
  });

  await t.test('clock offset and timeouts stay in their transaction', async () => {
    let offset = 0;
    const guard = new Guard(pool, { prepare: false, lease: 10000, fault: failTimes(1, 'complete'), clockOffset: () => offset });
    const key = uniqueKey('bouncer-order-2');
    const calls = { n: 0 };
    const h = ledgerHandler(new Ledger(10), key, calls, 0);
    assert.equal((await guard.do(key, 'fp', h)).failedStep, 'complete');
    assert.equal((await guard.do(key, 'fp', h)).outcome, Outcome.IN_FLIGHT);
    offset = 20;
    assert.equal((await guard.do(key, 'fp', h)).outcome, Outcome.EXECUTED);
    assert.equal(calls.n, 2);
    // No server connection kept the offset or the timeouts.
    for (let i = 0; i < 6; i++) {
      const r = await pool.query("SELECT pg_catalog.current_setting('idem.clock_offset') AS o," +
        " pg_catalog.current_setting('statement_timeout') AS st, pg_catalog.current_setting('lock_timeout') AS lt");
      assert.deepEqual(r.rows[0], { o: '0', st: '0', lt: '0' });
    }
  });

  await t.test('heartbeat and the one-transaction helper', async () => {
    // Ten beats per lease: the lease outlives a few beats kept waiting for a server connection.
    const guard = new Guard(pool, { prepare: false, lease: 3000, heartbeat: 300 });
    const key = uniqueKey('bouncer-hb');
    let probe;
    const r = await guard.do(key, 'fp', async (claim) => {
      // Past the lease the claim was made with, by the server's clock.
      await untilServerPast(direct, claim.leaseUntil);
      probe = await guard.do(key, 'fp', async () => ({ status: 200 }));
      return { status: 200, body: 'ok' };
    });
    assert.equal(probe.outcome, Outcome.IN_FLIGHT);
    assert.ok(r.extends >= 3, `extends=${r.extends}`);
    assert.equal(r.failedStep, null);

    const key2 = uniqueKey('bouncer-tx');
    const c = await pool.connect();
    try {
      const tx = await transaction(c, key2, 'fp', async ({ client }) => {
        await client.query('SELECT 1');
        return { status: 201, body: 'tx' };
      }, { timeout: 2000, prepare: false });
      assert.equal(tx.outcome, Outcome.EXECUTED);
    } finally {
      c.release();
    }
    assert.equal((await lookup(direct, key2)).state, 'DONE');
  });
});
