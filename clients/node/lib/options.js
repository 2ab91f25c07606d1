'use strict';

const { intervalParam } = require('./store');

/**
 * The options of a guard and of transaction(): their defaults, their
 * checks, and the clock offset a call runs with.
 */
const DEFAULTS = Object.freeze({
  schema: 'public',
  scope: '',
  lease: null, // ms or interval text; null: idem.default_lease
  retention: null, // ms or interval text; null: idem.default_retention
  remember: null, // ms or interval text: idem_begin's remember (a server with tombstones); null: not sent
  wait: true,
  waitFor: 0, // ms a duplicate waits in the server for a committed claim's answer; 0: none
  timeout: 10000, // ms per server call, enforced by the server; 0: none
  lockTimeout: null, // ms transaction()'s claim waits for another transaction's uncommitted claim; null: its whole budget
  retries: 0, // transaction() only: times it runs again after 40001 or 40P01
  keepClaimOnError: false,
  heartbeat: false, // true: extend every lease/3; a number: every that many ms
  clockOffset: 0, // seconds (tests, superuser): SET LOCAL idem.clock_offset
  fault: null, // (op) => truthy to make that server call fail
  logger: null, // { warn(message) }: where a response not stored is reported; null: console
  notStored: null, // { status, body } stored when idem_complete refuses a response; null: NOT_STORED
  prepare: true, // named prepared statements, parsed once per connection; false behind pgbouncer's transaction pooling
});

/** The defaults overridden by the options given (undefined: the default), checked. */
function normalizeOptions(options) {
  const o = { ...DEFAULTS };
  for (const [k, v] of Object.entries(options || {})) if (v !== undefined) o[k] = v;
  if (!Number.isFinite(o.timeout) || o.timeout < 0) throw new TypeError('timeout must be a number of milliseconds >= 0');
  o.timeout = Math.round(o.timeout);
  if (o.waitFor === null) o.waitFor = 0;
  if (!Number.isFinite(o.waitFor) || o.waitFor < 0) throw new TypeError('waitFor must be a number of milliseconds >= 0');
  o.waitFor = Math.round(o.waitFor);
  if (o.lockTimeout != null && (!Number.isFinite(o.lockTimeout) || o.lockTimeout <= 0)) {
    throw new TypeError('lockTimeout must be a number of milliseconds > 0, or null');
  }
  if (o.lockTimeout != null) o.lockTimeout = Math.round(o.lockTimeout);
  if (!Number.isInteger(o.retries) || o.retries < 0) throw new TypeError('retries must be an integer >= 0');
  if (o.waitFor > 0 && o.wait === false) throw new TypeError('waitFor needs wait: true (a duplicate that does not wait cannot wait for an answer)');
  if (typeof o.scope !== 'string') throw new TypeError('scope must be a string');
  intervalParam(o.lease, 'lease');
  intervalParam(o.retention, 'retention');
  intervalParam(o.remember, 'remember');
  if (typeof o.clockOffset !== 'function') clockOffsetOf(o);
  if (o.fault != null && typeof o.fault !== 'function') throw new TypeError('fault must be a function');
  if (o.logger != null && typeof o.logger.warn !== 'function') throw new TypeError('logger must have a warn(message) method');
  if (o.notStored != null && (typeof o.notStored !== 'object' || !Number.isInteger(o.notStored.status))) {
    throw new TypeError('notStored must be { status, body }');
  }
  if (typeof o.heartbeat === 'number' && !(o.heartbeat > 0)) throw new TypeError('heartbeat must be true, false or a period in ms');
  return o;
}

/**
 * The budget of an idem_begin call in ms (0: none): timeout, plus waitFor
 * when the call waits for a committed claim's answer, so the server-side
 * wait (ended by the server at waitFor) always fits inside it.
 */
function beginBudget(o, waitFor) {
  if (!(o.timeout > 0)) return 0;
  return o.timeout + (waitFor > 0 ? waitFor : 0);
}

/** Seconds added to the server clock for a call (clockOffset may be a function). */
function clockOffsetOf(o) {
  const v = typeof o.clockOffset === 'function' ? o.clockOffset() : o.clockOffset;
  if (v == null) return 0;
  if (!Number.isInteger(v)) throw new TypeError('clockOffset must be an integer number of seconds');
  return v;
}

module.exports = { DEFAULTS, normalizeOptions, clockOffsetOf, beginBudget };
