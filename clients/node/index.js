'use strict';

// Named exports in shorthand, one by one, so that ESM `import { ... } from
// 'idem-pg'` finds every one of them (Node detects CommonJS exports
// statically).
const {
  IdemError, FingerprintMismatchError, TokenSupersededError, NoClaimError, AlreadyCompletedError,
  UnavailableError, TimeoutError, toIdemError, isDatabaseError, isTransient, isRetryableTransaction,
} = require('./lib/errors');
const { Store } = require('./lib/store');
const { Guard, Outcome, failTimes } = require('./lib/guard');
const { transaction } = require('./lib/transaction');
const { transactionMany } = require('./lib/batch');
const { inbox } = require('./lib/inbox');
const { NOT_STORED } = require('./lib/outcome');
const { CheckpointDataError, stepIdempotencyKey } = require('./lib/steps');
const { idempotency, saveRawBody, defaultFingerprint, parseKey, parseHttpDate, callerScope } = require('./lib/express');

module.exports = {
  Guard,
  Outcome,
  Store,
  transaction,
  transactionMany,
  inbox,
  failTimes,
  idempotency,
  saveRawBody,
  defaultFingerprint,
  parseKey,
  parseHttpDate,
  callerScope,
  NOT_STORED,
  IdemError,
  FingerprintMismatchError,
  TokenSupersededError,
  NoClaimError,
  AlreadyCompletedError,
  CheckpointDataError,
  stepIdempotencyKey,
  UnavailableError,
  TimeoutError,
  toIdemError,
  isDatabaseError,
  isTransient,
  isRetryableTransaction,
};
