'use strict';
// End to end in Node (make bench, rows 7): the three patterns of
// test/bench/e2e.py, through node-pg and ioredis, from one process whose
// WORKERS concurrent loops share one pg.Pool of WORKERS connections and
// one ioredis client, as a Node service would.
//
//   idem   the Node client's transaction(): claim, the order INSERT and
//          complete in one transaction on a pool client
//   table  a hand-written key table in the same transaction: INSERT ... ON
//          CONFLICT DO NOTHING RETURNING, the order INSERT, an UPDATE of the
//          stored response; a replay reads the stored response
//   redis  SET key NX GET PX (one round trip: claimed, or the stored
//          value), the order INSERT (autocommit), SET key response PX
//
// Each round runs, for each pattern in turn, new keys then replays of the
// same keys.  Prints, per pattern and phase, "pattern phase
// requests_per_s server_cpu_us_per_request rps_spread
// client_cpu_us_per_request" (medians of the rounds; server CPU: the
// cluster's processes and Redis, from /proc; client CPU: this process's).
// Exits 1 if a replay differs from the first response or a key made other
// than one order.
//
//   node e2e.js --host DIR --port PORT --redis-port P --redis-pid PID
//       [--workers 8] [--requests 2000] [--rounds 3]

const fs = require('node:fs');
const path = require('node:path');
const { Pool } = require('pg');
const Redis = require('ioredis');
const { transaction } = require('../../../clients/node');

const args = {};
for (let i = 2; i < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, '')] = process.argv[i + 1];
const workers = Number(args.workers || 8);
const requests = Number(args.requests || 2000);
const rounds = Number(args.rounds || 3);
const redisPid = Number(args['redis-pid']);
const TTL = 86400000;
const PATTERNS = ['idem', 'table', 'redis'];
const PHASES = ['new', 'replay'];
const orderBody = (id) => `{"order":"${id}","status":"accepted","amount":4200,"currency":"EUR","items":[1,2,3]}`;

const pool = new Pool({ host: args.host, port: Number(args.port), user: 'postgres', database: args.dbname || 'bench', max: workers });
const redis = new Redis({ host: '127.0.0.1', port: Number(args['redis-port']) });
// keys of this run only, whatever the tables or Redis hold already
const RUN = `node-${Date.now().toString(16)}`;
const INSERT_ORDER = 'INSERT INTO e2e_orders (key, amount) VALUES ($1, 4200) RETURNING id';

async function idem(key) {
  const client = await pool.connect();
  try {
    const r = await transaction(client, key, 'amount=4200', async ({ client: c }) => {
      const { rows } = await c.query(INSERT_ORDER, [key]);
      return { status: 201, body: orderBody(rows[0].id) };
    });
    return String(r.response.body);
  } finally {
    client.release();
  }
}

async function table(key) {
  const client = await pool.connect();
  try {
    await client.query('BEGIN');
    try {
      const claimed = await client.query('INSERT INTO e2e_keys (key) VALUES ($1) ON CONFLICT DO NOTHING RETURNING true', [key]);
      let body;
      if (claimed.rowCount === 0) {
        body = String((await client.query('SELECT body FROM e2e_keys WHERE key = $1', [key])).rows[0].body);
      } else {
        const { rows } = await client.query(INSERT_ORDER, [key]);
        body = orderBody(rows[0].id);
        await client.query('UPDATE e2e_keys SET status = 201, body = $1 WHERE key = $2', [Buffer.from(body), key]);
      }
      await client.query('COMMIT');
      return body;
    } catch (err) {
      await client.query('ROLLBACK');
      throw err;
    }
  } finally {
    client.release();
  }
}

async function viaRedis(key) {
  const old = await redis.set(key, 'processing', 'PX', TTL, 'NX', 'GET');
  if (old !== null) return old;
  const { rows } = await pool.query(INSERT_ORDER, [key]);
  const body = orderBody(rows[0].id);
  await redis.set(key, body, 'PX', TTL);
  return body;
}

const handlers = { idem, table, redis: viaRedis };

function serverTicks(dataDir) {
  const ppid = Number(fs.readFileSync(path.join(dataDir, 'postmaster.pid'), 'utf8').split('\n')[0]);
  let total = 0;
  for (const ent of fs.readdirSync('/proc')) {
    if (!/^\d+$/.test(ent)) continue;
    let s;
    try {
      s = fs.readFileSync(`/proc/${ent}/stat`, 'utf8');
    } catch {
      continue;
    }
    const f = s.slice(s.lastIndexOf(')') + 1).trim().split(/\s+/);
    const pid = Number(ent);
    if (pid === ppid || pid === redisPid || Number(f[1]) === ppid) total += Number(f[11]) + Number(f[12]);
  }
  return total;
}

const median = (v) => {
  const s = [...v].sort((a, b) => a - b);
  const n = s.length;
  return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
};

async function main() {
  const dataDir = (await pool.query('SHOW data_directory')).rows[0].data_directory;
  const TICK = 100; // USER_HZ on Linux
  const n = workers * requests;
  const results = {};
  for (let r = 0; r < rounds; r++) {
    for (const p of PATTERNS) {
      const first = Array.from({ length: workers }, () => new Array(requests));
      // warm: every connection open, statements parsed, on keys of their own
      await Promise.all(Array.from({ length: workers }, (_, w) => handlers[p](`warm-${RUN}-${p}${r}-${w}`)));
      for (const ph of PHASES) {
        const s0 = serverTicks(dataDir);
        const c0 = process.cpuUsage();
        const t0 = process.hrtime.bigint();
        await Promise.all(Array.from({ length: workers }, async (_, w) => {
          for (let i = 0; i < requests; i++) {
            const key = `${RUN}-${p}${r}-${w}-${i}`;
            const body = await handlers[p](key);
            if (ph === 'new') first[w][i] = body;
            else if (body !== first[w][i]) throw new Error(`${p}: the replay of ${key} differs: ${body}, first ${first[w][i]}`);
          }
        }));
        const el = Number(process.hrtime.bigint() - t0) / 1e9;
        const c = process.cpuUsage(c0);
        const s1 = serverTicks(dataDir);
        (results[`${p} ${ph}`] ||= []).push({
          rps: n / el, server: ((s1 - s0) * 1e6) / TICK / n, client: (c.user + c.system) / n,
        });
      }
    }
  }
  const dup = Number((await pool.query('SELECT count(*) FROM (SELECT key FROM e2e_orders WHERE key LIKE $1 GROUP BY key HAVING count(*) > 1) d', [`${RUN}-%`])).rows[0].count);
  const total = Number((await pool.query('SELECT count(*) FROM e2e_orders WHERE key LIKE $1', [`${RUN}-%`])).rows[0].count);
  const want = rounds * PATTERNS.length * n;
  if (dup !== 0 || total !== want) throw new Error(`${total} orders for ${want} requests, ${dup} keys with more than one`);
  for (const p of PATTERNS) {
    for (const ph of PHASES) {
      const v = results[`${p} ${ph}`];
      const rps = v.map((x) => x.rps);
      const m = median(rps);
      console.log(`${p} ${ph} ${m.toFixed(0)} ${median(v.map((x) => x.server)).toFixed(1)} ` +
        `${((Math.max(...rps) - Math.min(...rps)) / m).toFixed(3)} ${median(v.map((x) => x.client)).toFixed(1)}`);
    }
  }
}

main().then(() => Promise.all([pool.end(), redis.quit()]), (err) => {
  console.error(`e2e node: ${err.stack || err}`);
  process.exit(1);
});
