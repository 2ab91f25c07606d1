'use strict';

// The inbox for message consumers: one transaction per batch, a savepoint
// per message, COMMIT before the ack.  Against the real brokers test.sh
// starts (IDEM_TEST_AMQP_URL: RabbitMQ; IDEM_TEST_REDIS_PORT: Redis): a
// consumer process (test/inbox_consumer.js) is SIGKILLed at random
// points, between its COMMIT and its ack, and between a handler and the
// COMMIT, at least IDEM_INBOX_KILLS (50) times per broker, and restarted;
// at the end every message's effect is in inbox_effects exactly once and
// every message is acked.  The kill tests run in the first database only
// (test.sh runs the suite twice).

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { inbox, Outcome } = require('..');
const { makePool, uniqueKey, sleep, recordPid, lookup } = require('./helpers');

const pool = makePool({ max: 10 });
test.after(() => pool.end());
const KILLS = Number(process.env.IDEM_INBOX_KILLS || 50);
const killTests = process.env.PGDATABASE !== 'idem_odd';
const amqpUrl = process.env.IDEM_TEST_AMQP_URL;
const redisPort = process.env.IDEM_TEST_REDIS_PORT;

test.before(async () => {
  await pool.query('CREATE TABLE IF NOT EXISTS inbox_effects (queue text NOT NULL, msg_id text NOT NULL, pid int)');
});

test('process(): new messages run once in one transaction; a redelivered one is acked without running; a repeated id runs once; a throwing handler undoes only its message, which is not acked', async () => {
  const queue = uniqueKey('q-unit');
  const runs = [];
  const box = inbox(pool, {
    queue,
    handle: async (m, client) => {
      runs.push(m.id);
      await client.query('INSERT INTO inbox_effects (queue, msg_id) VALUES ($1, $2)', [queue, m.id]);
      if (m.fail) throw new Error('poison');
      return { seen: m.id };
    },
  });
  const first = await box.process([{ id: 'a' }, { id: 'b', fail: true }, { id: 'c' }, { id: 'a' }, { notAnId: 1 }]);
  assert.deepEqual(runs, ['a', 'b', 'c']);
  assert.deepEqual(first.map((r) => r.ack), [true, false, true, true, false]);
  assert.deepEqual(first.map((r) => r.outcome), [Outcome.EXECUTED, Outcome.EXECUTED, Outcome.EXECUTED, Outcome.EXECUTED, Outcome.UNAVAILABLE]);
  assert.equal(first[1].error.message, 'poison');
  assert.equal(first[3].duplicateOf, 0);
  assert.match(first[4].error.message, /no id/);
  const effects = async () => (await pool.query('SELECT msg_id FROM inbox_effects WHERE queue = $1 ORDER BY msg_id', [queue])).rows.map((r) => r.msg_id);
  assert.deepEqual(await effects(), ['a', 'c']);
  assert.equal((await lookup(pool, 'a', queue)).state, 'DONE');
  assert.equal(await lookup(pool, 'b', queue), null);
  // The broker delivers a, b and c again: b runs, a and c are acked without running.
  runs.length = 0;
  const again = await box.process([{ id: 'a' }, { id: 'b' }, { id: 'c' }]);
  assert.deepEqual(runs, ['b']);
  assert.deepEqual(again.map((r) => [r.outcome, r.ack]), [[Outcome.REPLAYED, true], [Outcome.EXECUTED, true], [Outcome.REPLAYED, true]]);
  assert.deepEqual(await effects(), ['a', 'b', 'c']);
  // The stored outcome is what handle() returned.
  const stored = await pool.query('SELECT convert_from(body, \'UTF8\') AS body FROM idem_begin($1, \'\', scope => $2)', ['a', queue]);
  assert.deepEqual(JSON.parse(stored.rows[0].body), { seen: 'a' });
  assert.throws(() => inbox(pool, { handle: async () => {} }), /queue/);
  assert.throws(() => inbox(pool, { queue: 'q' }), /handle/);
});

/** Spawn the consumer process with env; lines(): its stdout lines so far; exited: its exit. */
function consumer(env) {
  const child = spawn(process.execPath, [path.join(__dirname, 'inbox_consumer.js')], {
    env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'],
  });
  recordPid(child.pid);
  const out = [];
  let err = '';
  let buf = '';
  child.stdout.on('data', (d) => {
    buf += d;
    const parts = buf.split('\n');
    buf = parts.pop();
    out.push(...parts);
  });
  child.stderr.on('data', (d) => { err += d; });
  const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  return { child, out, stderr: () => err, exited };
}

async function until(cond, ms, what) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    if (await cond()) return true;
    await sleep(20);
  }
  throw new Error(`timed out waiting for ${what}`);
}

/**
 * The kill test against one broker: publish(ids) sends messages (ids may
 * repeat: a producer's redelivery), drained() says every message is
 * acked, idle() that none waits while a consumer runs, env(round) the consumer's broker settings.
 */
async function killTest(t, { name, publish, drained, idle, env }) {
  const queue = uniqueKey(`kill-${name}`);
  const counts = { kills: 0, commit: 0, handler: 0, random: 0, executed: 0, replayed: 0, failed: 0 };
  let next = 0;
  const ids = [];
  const fresh = (n) => {
    const batch = [];
    for (let i = 0; i < n; i++) batch.push(`m-${next++}`);
    ids.push(...batch);
    return batch;
  };
  const tally = (lines) => {
    for (const l of lines) {
      const m = /^batch (\d+) (\d+) (\d+)$/.exec(l);
      if (m) { counts.executed += +m[1]; counts.replayed += +m[2]; counts.failed += +m[3]; }
    }
  };
  await publish(fresh(20));
  const modes = ['commit', 'handler', 'random'];
  for (let round = 0; counts.kills < KILLS; round++) {
    // New messages each round, a producer's redelivery of two old ones, and
    // one that fails the first time a process sees it.
    const more = fresh(8);
    await publish([...more, ids[Math.floor(Math.random() * ids.length)], ids[Math.floor(Math.random() * ids.length)]]);
    const mode = modes[round % 3];
    const c = consumer({
      ...env(round), IDEM_INBOX_QUEUE: queue, IDEM_INBOX_PAUSE: mode === 'random' ? 'none' : mode,
      IDEM_INBOX_PAUSE_BATCH: String(1 + Math.floor(Math.random() * 2)), IDEM_INBOX_FAIL: more[3],
    });
    try {
      await until(() => c.out.includes('ready') || c.child.exitCode !== null, 20000, `${name} consumer ready`);
      if (c.child.exitCode !== null) throw new Error(`the consumer exited: ${c.stderr()}`);
      if (mode === 'random') await sleep(5 + Math.random() * 150);
      else await until(() => c.out.some((l) => l.startsWith('paused')), 3000, 'a pause').catch(() => {});
      const paused = c.out.find((l) => l.startsWith('paused'));
      c.child.kill('SIGKILL');
      await c.exited;
      counts.kills += 1;
      counts[paused ? paused.split(' ')[1] : 'random'] += 1;
      tally(c.out);
    } finally {
      c.child.kill('SIGKILL');
    }
  }
  // The last consumer runs until every message is acked, then stops.
  let last;
  for (let attempt = 0; attempt < 3; attempt++) {
    last = consumer({ ...env(1000 + attempt), IDEM_INBOX_QUEUE: queue, IDEM_INBOX_PAUSE: 'none' });
    try {
      await until(() => last.out.includes('ready'), 20000, `${name} last consumer ready`);
      await until(async () => (await idle()) && (await effectsOf(queue)).distinct === ids.length, 30000,
        `${name}: every message acked`).catch(() => {});
    } finally {
      last.child.kill('SIGTERM');
      const { code } = await last.exited;
      assert.equal(code, 0, last.stderr());
      tally(last.out);
    }
    if (await drained()) break;
  }
  const effects = await effectsOf(queue);
  const msg = `${name}: ${counts.kills} kills (${counts.commit} between COMMIT and ack, ${counts.handler} between a handler and COMMIT,` +
    ` ${counts.random} at random), ${ids.length} messages (${new Set(ids).size} distinct), ${effects.rows} effects,` +
    ` ${effects.duplicated} duplicated, ${effects.distinct} distinct; batches committed ${counts.executed} runs,` +
    ` acked ${counts.replayed} redeliveries without running, ${counts.failed} handler failures`;
  t.diagnostic(msg);
  assert.ok(counts.kills >= KILLS);
  if (KILLS >= 10) assert.ok(counts.commit > 0 && counts.handler > 0, 'killed at both exact points');
  assert.equal(effects.duplicated, 0, 'no effect twice');
  assert.equal(effects.distinct, new Set(ids).size, 'every message has its effect');
  assert.equal(effects.rows, new Set(ids).size);
  assert.ok(await drained(), 'every message acked');
}

async function effectsOf(queue) {
  const r = await pool.query('SELECT count(*)::int AS rows, count(DISTINCT msg_id)::int AS distinct,' +
    ' count(*) FILTER (WHERE n > 1)::int AS duplicated FROM (SELECT msg_id, count(*) OVER (PARTITION BY msg_id) AS n' +
    ' FROM inbox_effects WHERE queue = $1) e', [queue]);
  return r.rows[0];
}

test('RabbitMQ: SIGKILL between COMMIT and ack, between a handler and COMMIT and at random: every effect once, every message acked',
  { skip: !killTests ? 'kill tests run in the first database only' : (!amqpUrl && 'IDEM_TEST_AMQP_URL not set (test.sh starts RabbitMQ)') },
  async (t) => {
    const amqp = require('amqplib');
    const conn = await amqp.connect(amqpUrl);
    const ch = await conn.createConfirmChannel();
    const qname = uniqueKey('amqp-q');
    await ch.assertQueue(qname, { durable: false });
    try {
      await killTest(t, {
        name: 'RabbitMQ',
        publish: async (ids) => {
          for (const id of ids) ch.sendToQueue(qname, Buffer.from(id), { messageId: id });
          await ch.waitForConfirms();
        },
        drained: async () => {
          const q = await ch.checkQueue(qname);
          return q.messageCount === 0 && q.consumerCount === 0;
        },
        idle: async () => (await ch.checkQueue(qname)).messageCount === 0,
        env: () => ({ IDEM_INBOX_BROKER: 'amqp', IDEM_INBOX_AMQP_QUEUE: qname }),
      });
    } finally {
      await ch.deleteQueue(qname).catch(() => {});
      await conn.close();
    }
  });

test('Redis streams: SIGKILL between COMMIT and ack, between a handler and COMMIT and at random, a new consumer name each time (XAUTOCLAIM of the dead one\'s entries): every effect once, every entry acked',
  { skip: !killTests ? 'kill tests run in the first database only' : (!redisPort && 'IDEM_TEST_REDIS_PORT not set (test.sh starts Redis)') },
  async (t) => {
    const Redis = require('ioredis');
    const redis = new Redis({ host: '127.0.0.1', port: Number(redisPort) });
    const stream = uniqueKey('stream');
    await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    try {
      await killTest(t, {
        name: 'Redis',
        publish: async (ids) => {
          for (const id of ids) await redis.xadd(stream, '*', 'id', id);
        },
        drained: async () => {
          const [count] = await redis.xpending(stream, 'workers');
          const groups = await redis.xinfo('GROUPS', stream);
          const g = groups[0];
          const lag = g[g.indexOf('lag') + 1];
          return Number(count) === 0 && Number(lag) === 0;
        },
        get idle() { return this.drained; },
        env: (round) => ({
          IDEM_INBOX_BROKER: 'redis', IDEM_INBOX_STREAM: stream, IDEM_INBOX_CONSUMER: `c${round}`,
        }),
      });
    } finally {
      await redis.del(stream);
      await redis.quit();
    }
  });
