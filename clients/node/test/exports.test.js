'use strict';

// The package's exports: the same names from require() and from an ESM import.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { pathToFileURL } = require('node:url');

const NAMES = ['Guard', 'Outcome', 'Store', 'transaction', 'failTimes', 'idempotency', 'saveRawBody',
  'defaultFingerprint', 'parseKey', 'parseHttpDate', 'callerScope', 'NOT_STORED', 'IdemError', 'FingerprintMismatchError', 'TokenSupersededError', 'NoClaimError',
  'AlreadyCompletedError', 'CheckpointDataError', 'stepIdempotencyKey', 'UnavailableError', 'TimeoutError', 'toIdemError', 'isDatabaseError', 'isTransient',
  'isRetryableTransaction', 'transactionMany', 'inbox'];

test('every name is exported to CommonJS and ESM; error classes form one hierarchy', async () => {
  const cjs = require('..');
  const esm = await import(pathToFileURL(path.join(__dirname, '..', 'index.js')).href);
  for (const name of NAMES) {
    assert.notEqual(cjs[name], undefined, `require: ${name}`);
    assert.equal(esm[name], cjs[name], `import: ${name}`);
  }
  assert.deepEqual(Object.keys(cjs).sort(), [...NAMES].sort());
  assert.deepEqual(Object.values(cjs.Outcome).sort(), ['conflict', 'executed', 'expired', 'in_flight', 'replayed', 'unavailable']);
  const { IdemError, UnavailableError, TimeoutError, toIdemError } = cjs;
  assert.ok(new TimeoutError('x') instanceof UnavailableError);
  for (const name of ['FingerprintMismatchError', 'TokenSupersededError', 'NoClaimError', 'AlreadyCompletedError']) {
    assert.ok(new cjs[name]('x') instanceof IdemError);
    assert.ok(!(new cjs[name]('x') instanceof UnavailableError));
  }
  // Errors without a SQLSTATE come from the connection: unavailable.
  const refused = Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' });
  assert.ok(toIdemError(refused) instanceof UnavailableError);
  assert.equal(toIdemError(refused).code, null);
  const dbErr = (code) => Object.assign(new Error(code), { code, severity: 'ERROR' });
  assert.ok(toIdemError(dbErr('57P01')) instanceof UnavailableError, 'admin shutdown');
  assert.ok(toIdemError(dbErr('08006')) instanceof UnavailableError, 'connection failure');
  assert.ok(toIdemError(dbErr('25006')) instanceof UnavailableError, 'read-only');
  assert.ok(toIdemError(dbErr('55P03')) instanceof TimeoutError, 'lock_timeout');
  assert.ok(toIdemError(dbErr('ID002')) instanceof cjs.TokenSupersededError);
  const other = toIdemError(dbErr('40001'));
  assert.equal(other.constructor, IdemError);
  assert.equal(other.code, '40001');
});
