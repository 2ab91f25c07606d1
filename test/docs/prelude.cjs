'use strict';
// The names the documentation's JavaScript examples take as given, loaded
// by test/docs.sh with `node --require` before each block: a pool (the
// connection from PGHOST, PGPORT, PGUSER and PGDATABASE), a payment
// provider, an Express app that never listens and the handlers of its
// routes.  Guard.prototype.do, which reports failures in its result,
// throws when the result says the call was unavailable or a step failed.
const { Pool } = require('pg');
const express = require('express');
const { Guard } = require('idem-pg');

const doOnce = Guard.prototype.do;
Guard.prototype.do = async function (...args) {
  const r = await doOnce.apply(this, args);
  if (r.outcome === 'unavailable' || r.failedStep) {
    throw new Error(`do(): ${r.outcome}, failed step ${r.failedStep}`, { cause: r.error });
  }
  return r;
};

globalThis.pool = new Pool({ allowExitOnIdle: true });
globalThis.provider = { async charge() { return { id: 'ch_1' }; } };
globalThis.app = express();
const ok = (req, res) => res.status(201).json({ ok: true });
globalThis.createOrder = ok;
globalThis.runReport = ok;
globalThis.ping = ok;
