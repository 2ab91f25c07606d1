'use strict';
// The names the documentation's JavaScript examples take as given, loaded
// by test/docs.sh with `node --require` before each block: a pool (the
// connection from PGHOST, PGPORT, PGUSER and PGDATABASE), a payment
// provider, an Express app that never listens and the handlers of its
// routes.
const { Pool } = require('pg');
const express = require('express');

globalThis.pool = new Pool({ allowExitOnIdle: true });
globalThis.provider = { async charge() { return { id: 'ch_1' }; } };
globalThis.app = express();
const ok = (req, res) => res.status(201).json({ ok: true });
globalThis.createOrder = ok;
globalThis.runReport = ok;
globalThis.ping = ok;
