'use strict';

const { transactionMany } = require('./batch');
const { Outcome } = require('./outcome');

/*
 * An inbox for message consumers.  Each batch of delivered messages is
 * one transaction: idem_begin_many claims every message id (scope: the
 * queue), the handler runs for the new ones with the business writes on
 * the transaction's client, a savepoint per message, idem_complete_many
 * stores their outcome, and the transaction commits before the broker
 * hears an ack.  A crash before the commit leaves nothing (the broker
 * delivers again, the handler runs again); a crash between the commit
 * and the ack leaves the effect and the stored outcome (the broker
 * delivers again, the id replays, the message is acked without running).
 */

/** What the broker is told for each outcome: ack, or leave the message to come back. */
function acks(result) {
  if (result.error != null) return false; // the handler threw, or the id could not be read
  switch (result.outcome) {
    case Outcome.EXECUTED: // committed with its effect
    case Outcome.REPLAYED: // done before: a redelivery
    case Outcome.EXPIRED: // done before, its outcome no longer kept
    case Outcome.CONFLICT: // the id was used by another message body: it can never run
      return true;
    default: // in flight under a guard's claim elsewhere
      return false;
  }
}

/** A stored outcome: what handle() returned, as bytes (JSON for anything but a Buffer or string). */
function outcomeOf(value) {
  if (value === undefined || value === null) return { status: 200, body: null };
  if (Buffer.isBuffer(value) || typeof value === 'string') return { status: 200, body: value };
  return { status: 200, body: Buffer.from(JSON.stringify(value)) };
}

class Inbox {
  constructor(pool, options) {
    if (pool == null || typeof pool.connect !== 'function') throw new TypeError('inbox needs a pg.Pool');
    const { queue, handle, id, fingerprint, beforeAck, ...rest } = options || {};
    if (typeof queue !== 'string' || queue === '') throw new TypeError('inbox needs queue: a non-empty string (the scope of its ids)');
    if (typeof handle !== 'function') throw new TypeError('inbox needs handle: async (message, client) => ...');
    this.pool = pool;
    this.queue = queue;
    this.handle = handle;
    this._customId = id || null;
    this.id = id || ((m) => m.id);
    this.fingerprint = fingerprint || (() => '');
    this.beforeAck = beforeAck || null;
    this.options = { ...rest, scope: queue };
  }

  /**
   * Process one batch of messages in one transaction; resolves, after the
   * COMMIT, to one result per message in input order: { message, id,
   * outcome, ack, error, duplicateOf }.  ack says whether the broker may
   * forget it.  Rejects (nothing committed, nothing to ack) if the
   * transaction fails as a whole.
   */
  async process(messages) {
    const results = messages.map((message) => ({ message, id: null, outcome: null, ack: false, error: null, duplicateOf: null }));
    const items = [];
    const at = [];
    messages.forEach((m, i) => {
      let key;
      try {
        key = this.id(m);
        if (typeof key !== 'string' || key === '') throw new TypeError('the message has no id');
      } catch (err) {
        results[i].error = err;
        results[i].outcome = Outcome.UNAVAILABLE;
        return;
      }
      results[i].id = key;
      items.push({ key, fingerprint: String(this.fingerprint(m)), message: m });
      at.push(i);
    });
    if (items.length > 0) {
      const client = await this.pool.connect();
      let broken = false;
      try {
        const done = await transactionMany(client, items, async (claim, item) =>
          outcomeOf(await this.handle(item.message, claim.client, claim)), this.options);
        done.forEach((r, j) => {
          const out = results[at[j]];
          out.outcome = r.outcome;
          out.error = r.error;
          out.duplicateOf = r.duplicateOf == null ? null : at[r.duplicateOf];
        });
      } catch (err) {
        broken = true;
        throw err;
      } finally {
        client.release(broken ? true : undefined);
      }
    }
    for (const r of results) r.ack = acks(r);
    if (this.beforeAck) await this.beforeAck(results);
    return results;
  }

  /**
   * Consume an AMQP queue (amqplib's channel): deliveries are gathered
   * into batches of up to batchSize (or what arrived within lingerMs),
   * processed one batch at a time, then acked, or nacked with requeue
   * when their handler threw.  The message id is
   * msg.properties.messageId unless options.id says otherwise.  Set
   * channel.prefetch(batchSize) or more.  Resolves to { stop() }.
   */
  async consumeAmqp(channel, queueName, { batchSize = 50, lingerMs = 20, onError = null } = {}) {
    if (!this._customId) this.id = (m) => (m.properties && m.properties.messageId) || null;
    let pending = [];
    let timer = null;
    let chain = Promise.resolve();
    const flush = () => {
      if (timer) clearTimeout(timer);
      timer = null;
      if (pending.length === 0) return;
      const batch = pending;
      pending = [];
      chain = chain.then(async () => {
        let results;
        try {
          results = await this.process(batch);
        } catch (err) {
          if (onError) onError(err);
          for (const m of batch) channel.nack(m, false, true);
          return;
        }
        for (const r of results) {
          if (r.ack) channel.ack(r.message);
          else channel.nack(r.message, false, true);
        }
      });
    };
    const { consumerTag } = await channel.consume(queueName, (msg) => {
      if (msg == null) return; // the queue was deleted
      pending.push(msg);
      if (pending.length >= batchSize) flush();
      else if (!timer) timer = setTimeout(flush, lingerMs);
    }, { noAck: false });
    return {
      stop: async () => {
        await channel.cancel(consumerTag);
        flush();
        await chain;
      },
    };
  }

  /**
   * Consume a Redis stream through a consumer group (ioredis, a
   * connection of its own: XREADGROUP blocks it).  First this consumer's
   * own pending entries (a restart under the same name), then new ones;
   * every claimIdleMs, XAUTOCLAIM takes over entries another consumer
   * left pending for longer than that (a consumer that died).  Each batch
   * of up to count entries is processed, then XACKed; an entry whose
   * handler threw stays pending and comes back through XAUTOCLAIM.  A
   * message is { id, fields } (the entry id, the field-value pairs as an
   * object); its idem key is the entry id unless options.id says
   * otherwise.  Resolves, once running, to { stop(), done } (done
   * settles when the loop ends).
   */
  async consumeRedisStream(redis, {
    stream, group, consumer, count = 50, blockMs = 1000, claimIdleMs = 30000, onError = null,
  }) {
    if (!stream || !group || !consumer) throw new TypeError('consumeRedisStream needs stream, group and consumer');
    let stopped = false;
    const toMessage = ([id, pairs]) => {
      const fields = {};
      for (let i = 0; i + 1 < pairs.length; i += 2) fields[pairs[i]] = pairs[i + 1];
      return { id, fields };
    };
    const run = async (entries) => {
      const messages = entries.filter((e) => e && e[1]).map(toMessage);
      if (messages.length === 0) return;
      let results;
      try {
        results = await this.process(messages);
      } catch (err) {
        if (onError) onError(err);
        return; // all stay pending
      }
      const ids = results.filter((r) => r.ack).map((r) => r.message.id);
      if (ids.length > 0) await redis.xack(stream, group, ...ids);
    };
    const loop = async () => {
      // This consumer's own pending entries first.
      for (let start = '0'; !stopped;) {
        const got = await redis.xreadgroup('GROUP', group, consumer, 'COUNT', count, 'STREAMS', stream, start);
        const entries = got && got[0] ? got[0][1] : [];
        if (entries.length === 0) break;
        await run(entries);
        start = entries[entries.length - 1][0];
      }
      let lastClaim = 0;
      let cursor = '0-0';
      while (!stopped) {
        if (Date.now() - lastClaim >= Math.min(claimIdleMs, 1000)) {
          lastClaim = Date.now();
          const [next, entries] = await redis.xautoclaim(stream, group, consumer, claimIdleMs, cursor, 'COUNT', count);
          cursor = next;
          if (entries.length > 0) {
            await run(entries);
            continue;
          }
        }
        const got = await redis.xreadgroup('GROUP', group, consumer, 'COUNT', count, 'BLOCK', blockMs, 'STREAMS', stream, '>');
        if (got && got[0]) await run(got[0][1]);
      }
    };
    const done = loop();
    done.catch(() => {});
    return {
      done,
      stop: async () => {
        stopped = true;
        await done.catch(() => {});
      },
    };
  }
}

/**
 * inbox(pool, { queue, handle, id, fingerprint, beforeAck, ...options }):
 * queue names the scope of the message ids; handle(message, client,
 * claim) does the business writes on client (the batch's transaction)
 * and may return a value stored as the message's outcome; id(message)
 * its id (default message.id); fingerprint(message) a digest of what
 * the message says (default '': the id alone); beforeAck(results) runs
 * after the COMMIT, before any ack (a hook for tests and metrics); the
 * other options are transactionMany's (retention: keep the ids at least
 * as long as the broker may redeliver).
 */
function inbox(pool, options) {
  return new Inbox(pool, options);
}

module.exports = { inbox, Inbox, acks };
