'use strict';

// The Express app the HTTP tests talk to.  Run as a script it listens on
// an ephemeral port and prints {"port": n}; with IDEM_APP_CRASH_ON_PAY=1
// POST /pay prints {"started": token} and never answers (the crash test
// kills the process there); IDEM_APP_LEASE_MS sets its lease (default 10 s).

const express = require('express');
const { idempotency, saveRawBody } = require('..');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function createApp(pool, idemOptions = {}) {
  const state = { calls: {}, gate: null, orders: 0 };
  const count = (name) => { state.calls[name] = (state.calls[name] || 0) + 1; };
  const app = express();
  app.set('env', 'test'); // Express's default error handler: no stack traces on stderr
  app.use(express.json({ verify: saveRawBody }));
  app.use(idempotency(pool, { lease: 10000, scope: (req) => req.get('X-Tenant') || '', shared: true, ...idemOptions }));

  app.post('/orders', (req, res) => {
    count('orders');
    state.orders += 1;
    res.status(201).set('Location', `/orders/${state.orders}`)
      .json({ order: state.orders, item: req.body.item, token: String(req.idempotency?.token) });
  });
  app.get('/orders', (req, res) => {
    count('get');
    res.json({ orders: state.orders });
  });
  app.patch('/orders/:id', (req, res) => {
    count('patch');
    res.json({ order: Number(req.params.id), item: req.body.item });
  });
  app.post('/slow', async (req, res) => {
    count('slow');
    if (state.gate) await state.gate;
    res.status(201).json({ slow: true });
  });
  app.post('/work', async (req, res) => {
    count('work');
    await sleep(50);
    res.status(201).json({ worked: state.calls.work });
  });
  app.post('/long', async (req, res) => {
    count('long');
    await sleep(2000);
    res.status(201).json({ long: state.calls.long, token: String(req.idempotency?.token) });
  });
  app.post('/fail', (req, res) => {
    count('fail');
    res.status(500).json({ error: 'database down' });
  });
  app.post('/throw', () => {
    count('throw');
    throw new Error('boom');
  });
  app.post('/echo', (req, res) => {
    count('echo');
    res.type('text/plain').send(`got ${Buffer.isBuffer(req.body) ? 'buffer' : typeof req.body} ${req.body.length}`);
  });
  app.post('/pay', (req, res) => {
    count('pay');
    if (process.env.IDEM_APP_CRASH_ON_PAY === '1') {
      process.stdout.write(`${JSON.stringify({ started: String(req.idempotency.token) })}\n`);
      return; // never answers
    }
    res.status(201).json({ paid: req.body.amount, token: String(req.idempotency.token) });
  });
  // Errors reach Express's default handler (500), through the middleware's capture.
  return { app, state };
}

module.exports = { createApp };

if (require.main === module) {
  const pg = require('pg');
  const pool = new pg.Pool({ max: 4 });
  pool.on('error', () => {});
  const lease = Number(process.env.IDEM_APP_LEASE_MS) || undefined;
  const { app } = createApp(pool, lease ? { lease } : {});
  const server = app.listen(0, '127.0.0.1', () => {
    process.stdout.write(`${JSON.stringify({ port: server.address().port })}\n`);
  });
}
