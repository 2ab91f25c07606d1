'use strict';

// A consumer process for test/inbox.test.js's kill tests: it consumes the
// queue (RabbitMQ) or stream (Redis) named in its environment through
// inbox(), the handler inserting one row per message into inbox_effects,
// a table without a unique constraint.  The test SIGKILLs it; a test-only
// pause lets it be killed at an exact point:
//
//   IDEM_INBOX_PAUSE=commit   after the PAUSE_BATCH-th batch's COMMIT, before its ack
//   IDEM_INBOX_PAUSE=handler  in that batch's first handler, after its insert, before the COMMIT
//
// where it prints "paused <point>" and waits to be killed.  Message ids
// in IDEM_INBOX_FAIL (comma-separated) make the handler throw the first
// time this process sees them.  On SIGTERM it stops consuming, acks what
// it committed and exits 0.  It prints "ready" once consuming and
// "batch <executed> <replayed> <failed>" per batch.

const { inbox } = require('..');
const { makePool } = require('./helpers');

const env = process.env;
const pauseAt = env.IDEM_INBOX_PAUSE || 'none';
const pauseBatch = Number(env.IDEM_INBOX_PAUSE_BATCH || 1);
const failOnce = new Set((env.IDEM_INBOX_FAIL || '').split(',').filter(Boolean));
const queue = env.IDEM_INBOX_QUEUE;
const pool = makePool({ max: 2 });
let batches = 0;
let pausedHandler = false;

const forever = () => new Promise(() => {});
const say = (line) => new Promise((resolve) => process.stdout.write(`${line}\n`, resolve));

async function main() {
  const box = inbox(pool, {
    queue,
    id: env.IDEM_INBOX_BROKER === 'amqp' ? (m) => m.properties.messageId : (m) => m.fields.id,
    handle: async (message, client) => {
      const id = env.IDEM_INBOX_BROKER === 'amqp' ? message.properties.messageId : message.fields.id;
      await client.query('INSERT INTO inbox_effects (queue, msg_id, pid) VALUES ($1, $2, $3)', [queue, id, process.pid]);
      if (failOnce.delete(id)) throw new Error(`failing ${id} once`);
      if (pauseAt === 'handler' && batches + 1 === pauseBatch && !pausedHandler) {
        pausedHandler = true;
        await say('paused handler');
        await forever();
      }
    },
    beforeAck: async (results) => {
      batches += 1;
      const n = (f) => results.filter(f).length;
      await say(`batch ${n((r) => r.outcome === 'executed' && !r.error)} ${n((r) => r.outcome === 'replayed' || r.duplicateOf != null)} ${n((r) => r.error)}`);
      if (pauseAt === 'commit' && batches === pauseBatch) {
        await say('paused commit');
        await forever();
      }
    },
  });
  let consumer;
  let close;
  if (env.IDEM_INBOX_BROKER === 'amqp') {
    const amqp = require('amqplib');
    const conn = await amqp.connect(env.IDEM_TEST_AMQP_URL);
    const ch = await conn.createChannel();
    await ch.prefetch(20);
    consumer = await box.consumeAmqp(ch, env.IDEM_INBOX_AMQP_QUEUE || queue, { batchSize: 10, lingerMs: 10 });
    close = () => conn.close();
  } else {
    const Redis = require('ioredis');
    const redis = new Redis({ host: '127.0.0.1', port: Number(env.IDEM_TEST_REDIS_PORT), maxRetriesPerRequest: 1 });
    consumer = await box.consumeRedisStream(redis, {
      stream: env.IDEM_INBOX_STREAM, group: 'workers', consumer: env.IDEM_INBOX_CONSUMER,
      count: 10, blockMs: 100, claimIdleMs: 300,
    });
    close = () => redis.quit();
  }
  process.on('SIGTERM', async () => {
    await consumer.stop();
    await close();
    await pool.end();
    process.exit(0);
  });
  await say('ready');
}

main().catch((err) => {
  process.stderr.write(`${err.stack}\n`);
  process.exit(2);
});
