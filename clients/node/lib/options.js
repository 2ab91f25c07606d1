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
  wait: true,
  timeout: 10000, // ms per server call, enforced by the server; 0: none
  keepClaimOnError: false,
  heartbeat: false, // true: extend every lease/3; a number: every that many ms
  clockOffset: 0, // seconds (tests, superuser): SET LOCAL idem.clock_offset
  fault: null, // (op) => truthy to make that server call fail
});

/** The defaults overridden by the options given (undefined: the default), checked. */
function normalizeOptions(options) {
  const o = { ...DEFAULTS };
  for (const [k, v] of Object.entries(options || {})) if (v !== undefined) o[k] = v;
  if (!Number.isFinite(o.timeout) || o.timeout < 0) throw new TypeError('timeout must be a number of milliseconds >= 0');
  o.timeout = Math.round(o.timeout);
  if (typeof o.scope !== 'string') throw new TypeError('scope must be a string');
  intervalParam(o.lease, 'lease');
  intervalParam(o.retention, 'retention');
  if (typeof o.clockOffset !== 'function') clockOffsetOf(o);
  if (o.fault != null && typeof o.fault !== 'function') throw new TypeError('fault must be a function');
  if (typeof o.heartbeat === 'number' && !(o.heartbeat > 0)) throw new TypeError('heartbeat must be true, false or a period in ms');
  return o;
}

/** Seconds added to the server clock for a call (clockOffset may be a function). */
function clockOffsetOf(o) {
  const v = typeof o.clockOffset === 'function' ? o.clockOffset() : o.clockOffset;
  if (v == null) return 0;
  if (!Number.isInteger(v)) throw new TypeError('clockOffset must be an integer number of seconds');
  return v;
}

module.exports = { DEFAULTS, normalizeOptions, clockOffsetOf };
