'use strict';

// The Express app of test/http/README.md, which test/http/conformance.py
// checks over HTTP.  Run as a script: a node:cluster primary with two
// workers on IDEM_CONF_PORT (127.0.0.1; 0 or unset: a free port), re-forking
// any worker that dies; once both workers listen it writes the port to the
// file IDEM_CONF_READY (when set) and prints {"port": n}.  The database is PGHOST/PGPORT/PGUSER/PGDATABASE; its
// table conf_orders is the suite's to create.  SIGTERM stops the workers
// and the primary.

const cluster = require('node:cluster');
const fs = require('node:fs');

const WORKERS = 2;

function createApp(pool, downPool, shortPool) {
  const express = require('express');
  const { idempotency, saveRawBody } = require('..');
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  // The caller: X-Conf-Principal ("raise": the hook throws, "none": it returns undefined).
  const principal = (req) => {
    const who = req.get('X-Conf-Principal') || '';
    if (who === 'raise') throw new Error('no session');
    return who === 'none' ? undefined : who;
  };
  const common = { required: true, lease: 30000, retention: 3600000, waitFor: 5000, principal };
  const mw = {
    plain: idempotency(pool, common),
    tx: idempotency(pool, { ...common, transactional: true }),
    nowait: idempotency(pool, { ...common, waitFor: 0 }),
    store5xx: idempotency(pool, { ...common, storeStatus: () => true }),
    down: idempotency(downPool, { ...common, timeout: 2000 }),
    short: idempotency(shortPool, common),
    authz: idempotency(pool, { ...common, authorize: (req) => req.get('X-Conf-Revoked') === undefined }),
    advertise: idempotency(pool, { ...common, advertiseWindow: true }),
    remember: idempotency(pool, { ...common, lease: 1000, retention: 1000, remember: 3600000 }),
  };
  // A middleware built with neither a principal hook nor shared: true: the error it gets.
  let noDecision = null;
  try {
    idempotency(pool, { required: true });
  } catch (err) {
    noDecision = err.message;
  }

  const app = express();
  app.set('env', 'test'); // Express's default error handler: no stack traces on stderr
  app.use(express.json({ verify: saveRawBody }));

  /** Insert (key, route) on db, then sleep and die as the request's headers say; resolves to the row's id. */
  async function work(req, db, route) {
    const r = await db.query('INSERT INTO conf_orders (key, route) VALUES ($1, $2) RETURNING id',
      [req.idempotency.key, route]);
    const ms = Number(req.get('X-Conf-Sleep-Ms'));
    if (ms > 0) await sleep(ms);
    if (req.get('X-Conf-Kill') === 'after-write') process.kill(process.pid, 'SIGKILL');
    return String(r.rows[0].id);
  }

  const orders = (route, db) => async (req, res, next) => {
    try {
      const id = await work(req, db(req), route);
      res.status(201).set('Location', `/orders/${id}`).set('ETag', `"${id}"`).json({ order: Number(id) });
    } catch (err) {
      next(err);
    }
  };
  const status = (route) => async (req, res, next) => {
    try {
      await work(req, pool, route);
      const code = Number(req.params.code);
      res.status(code).json({ status: code });
    } catch (err) {
      next(err);
    }
  };

  app.post('/plain/orders', mw.plain, orders('plain', () => pool));
  app.post('/tx/orders', mw.tx, orders('tx', (req) => req.idempotency.client));
  app.post('/nowait/orders', mw.nowait, orders('nowait', () => pool));
  app.post('/down/orders', mw.down, orders('down', () => pool));
  app.post('/short/orders', mw.short, orders('short', () => pool));
  app.post('/authz/orders', mw.authz, orders('authz', () => pool));
  app.post('/advertise/orders', mw.advertise, orders('advertise', () => pool));
  app.post('/remember/orders', mw.remember, orders('remember', () => pool));
  // GET: passed through by the middleware, answered by the app.
  app.get('/plain/orders', mw.plain, (req, res) => res.json({ orders: [] }));
  app.get('/advertise/orders', mw.advertise, (req, res) => res.json({ orders: [] }));
  app.get('/no-decision', (req, res) => res.json({ error: noDecision }));
  app.post('/plain/binary', mw.plain, async (req, res, next) => {
    try {
      await work(req, pool, 'binary');
      const bytes = Buffer.alloc(1024);
      for (let i = 0; i < bytes.length; i++) bytes[i] = i % 256;
      res.status(200).type('application/octet-stream').send(bytes);
    } catch (err) {
      next(err);
    }
  });
  app.post('/plain/big', mw.plain, async (req, res, next) => {
    try {
      await work(req, pool, 'big');
      const size = Number(req.get('X-Conf-Size')) || 0;
      res.status(201).type('application/octet-stream').send(Buffer.alloc(size, 'x'));
    } catch (err) {
      next(err);
    }
  });
  // A batch (doc/http.md, "Batches"): the envelope under the request's key,
  // each item under its own key ("key" in the item, else <key>:<index>),
  // X-Conf-Fail-Item: i makes item i's handler throw; 503 with Retry-After: 1
  // while an item must run again.
  app.post('/batch/orders', mw.plain, async (req, res, next) => {
    try {
      const fail = req.get('X-Conf-Fail-Item');
      const { results, retry } = await req.idempotency.items((req.body && req.body.items) || [], async (item, i, claim) => {
        if (fail !== undefined && Number(fail) === i) throw new Error(`item ${i} failed`);
        const r = await pool.query('INSERT INTO conf_orders (key, route) VALUES ($1, $2) RETURNING id', [claim.key, 'batch']);
        return { status: 201, body: { order: Number(r.rows[0].id) } };
      }, { key: (item, i) => (item && typeof item.key === 'string' ? item.key : `${req.idempotency.key}:${i}`) });
      if (retry) res.set('Retry-After', '1');
      res.status(retry ? 503 : 200).json({ results });
    } catch (err) {
      next(err);
    }
  });
  app.post('/plain/status/:code', mw.plain, status('status'));
  app.post('/store5xx/status/:code', mw.store5xx, status('store5xx'));
  return app;
}

/**
 * Node's HTTP parser answers a request whose header value holds a control
 * character (0x01, 0x7f, ESC) 400 itself, before Express and the
 * middleware see it; this makes that 400 a problem+json too.
 */
function problemOnClientError(server) {
  server.on('clientError', (err, socket) => {
    if (!socket.writable || err.code === 'ECONNRESET') return socket.destroy();
    const body = JSON.stringify({ type: 'about:blank', title: 'Bad Request', status: 400, detail: err.message });
    socket.end('HTTP/1.1 400 Bad Request\r\nContent-Type: application/problem+json\r\nConnection: close\r\n' +
      `Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
  });
  return server;
}

function primary() {
  let stopping = false;
  let listening = 0;
  const fork = () => {
    cluster.fork().once('listening', (address) => {
      listening += 1;
      if (listening !== WORKERS) return;
      if (process.env.IDEM_CONF_READY) fs.writeFileSync(process.env.IDEM_CONF_READY, `${address.port}\n`);
      process.stdout.write(`${JSON.stringify({ port: address.port })}\n`);
    });
  };
  cluster.on('exit', () => {
    if (!stopping) fork();
  });
  const stop = () => {
    stopping = true;
    for (const w of Object.values(cluster.workers)) w.process.kill('SIGKILL');
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
  for (let i = 0; i < WORKERS; i++) fork();
}

function worker() {
  const pg = require('pg');
  // Retries waiting for an answer hold a connection each.
  const pool = new pg.Pool({ max: 20 });
  pool.on('error', () => {});
  // A socket directory with no server in it (test.sh's own, IDEM_TEST_DOWN_HOST):
  // connections fail at once, and no other server can answer them.
  const downPool = new pg.Pool({
    host: process.env.IDEM_TEST_DOWN_HOST || '/nonexistent-idem-socket-dir', port: 1, max: 2, connectionTimeoutMillis: 2000,
  });
  downPool.on('error', () => {});
  // The server's idem.max_key_length lowered to 64 bytes for /short's claims.
  const shortPool = new pg.Pool({ max: 4, options: '-c idem.max_key_length=64' });
  shortPool.on('error', () => {});
  problemOnClientError(createApp(pool, downPool, shortPool).listen(Number(process.env.IDEM_CONF_PORT) || 0, '127.0.0.1'));
}

if (require.main === module) {
  if (cluster.isPrimary) primary();
  else worker();
}

module.exports = { createApp, problemOnClientError };
