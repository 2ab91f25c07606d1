'use strict';

const errors = require('./lib/errors');
const { Store } = require('./lib/store');
const { Guard, Outcome, failTimes } = require('./lib/guard');
const { transaction } = require('./lib/transaction');
const { idempotency, saveRawBody, defaultFingerprint } = require('./lib/express');

module.exports = {
  Guard,
  Outcome,
  Store,
  transaction,
  failTimes,
  idempotency,
  saveRawBody,
  defaultFingerprint,
  ...errors,
};
