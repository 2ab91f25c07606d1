// Compiled by test.sh with tsc --strict against the installed package: the
// middleware (default and transactional mode), the guard and transaction().

import express from 'express';
import { Pool } from 'pg';
import {
  idempotency, saveRawBody, Guard, Outcome, transaction, IdemError, TimeoutError, GuardResult,
  isRetryableTransaction, BatchResult, inbox,
} from 'idem-pg';

const pool = new Pool();
pool.on('error', () => {});
const app = express();
app.use(express.json({ verify: saveRawBody }));

app.post('/orders', idempotency(pool, {
  schema: 'public', lease: 30000, required: true, waitFor: 2000,
  principal: (req) => String(req.get('X-User') ?? ''),
  authorize: (req, res) => req.get('X-Revoked') === undefined || res.status(404).end(),
  storeStatus: (status: number) => status < 500,
  logger: { warn: (message: string) => console.warn(message) },
  onResult: (r: GuardResult) => { if (r.notStored) console.warn(r.expiresAt?.toISOString()); },
}), (req, res) => {
  const key: string | undefined = req.idempotency?.key;
  const token: bigint | undefined = req.idempotency?.token;
  res.status(201).json({ key, token: String(token) });
});

app.post('/tx/orders', idempotency(pool, { transactional: true, storeServerErrors: false, shared: true }), async (req, res, next) => {
  try {
    const client = req.idempotency?.client;
    if (!client) throw new Error('not transactional');
    const r = await client.query<{ id: string }>('INSERT INTO orders DEFAULT VALUES RETURNING id');
    res.status(201).json({ order: r.rows[0].id });
  } catch (err) {
    next(err);
  }
});

async function main(): Promise<void> {
  const guard = new Guard(pool, { lease: 30000, heartbeat: true, timeout: 5000, prepare: false });
  const r = await guard.do('pay-7', 'amount=10', async (claim) => {
    const t: bigint = claim.token;
    return { status: 200, body: `charged ${t}` };
  });
  if (r.outcome === Outcome.EXECUTED && r.failedStep === 'complete' && !r.notStored) console.warn(r.error);

  // Multi-step work: each step checkpointed, skipped after a takeover.
  const order = await guard.do('order-9', 'sku=A', async (claim) => {
    const hold: { hold: string } = await claim.step('reserve', async (s) => ({ hold: `h-${s.token}` }));
    const charge = await claim.step('charge', (s) => ({ id: s.idempotencyKey, at: s.name }));
    const rows: number = await claim.stepTx('record', async (c, s) => {
      const q = await c.query('INSERT INTO orders DEFAULT VALUES RETURNING id');
      return q.rowCount ?? s.token.toString().length;
    });
    const from: string | null = claim.resumedFrom;
    return { status: 201, body: `${hold.hold} ${charge.id} ${rows} ${from} ${claim.stepsDone().join(',')}` };
  });
  const done: string[] = order.steps;
  console.log(order.resumedFrom, done);
  const expires: Date | null = r.expiresAt;

  const client = await pool.connect();
  try {
    const t = await transaction(client, 'order-42', 'sku=A', async ({ client: c, leaseUntil }) => {
      await c.query('SELECT 1');
      return { status: 201, body: JSON.stringify({ at: leaseUntil.toISOString() }) };
    }, { timeout: 5000, lockTimeout: 1000 });
    const stored: boolean = t.notStored;
    console.log(t.outcome, t.expiresAt, stored, expires);
    // Run again after 40001 or 40P01, up to 3 more times.
    const retried = await transaction(client, 'order-43', 'sku=A', async ({ client: c, attempt }) => {
      const n: number = attempt;
      await c.query('SELECT $1::integer', [n]);
      return { status: 201 };
    }, { retries: 3 });
    console.log(retried.outcome, isRetryableTransaction(new Error('x')));
  } catch (err) {
    if (err instanceof TimeoutError || (err instanceof IdemError && err.code === '42883')) console.error(err.message);
  } finally {
    client.release();
  }
}

async function batches(): Promise<void> {
  const guard = new Guard(pool);
  const results: BatchResult[] = await guard.doMany([{ key: 'a', fingerprint: 'x' }, { key: 'b' }],
    async (claim, item, index) => ({ status: 201, body: `${claim.key} ${item.key} ${index}` }), { concurrency: 2 });
  console.log(results.map((r) => [r.index, r.outcome, r.duplicateOf]));
  const box = inbox<{ id: string; qty: number }>(pool, {
    queue: 'moves',
    handle: async (m, c) => { await c.query('SELECT $1::integer', [m.qty]); },
  });
  const acked: boolean[] = (await box.process([{ id: 'm1', qty: 1 }])).map((r) => r.ack);
  console.log(acked);
}

app.post('/batch', async (req, res) => {
  const batch = await req.idempotency!.items([1, 2], async (item, i) => ({ status: 201, body: { item, i } }));
  res.status(batch.retry ? 503 : 200).json(batch.results);
});

app.listen(0);
void main();
void batches();
