'use strict';

/**
 * Error classes for idem's SQLSTATEs and for a store that cannot answer.
 *
 *   ID001 FingerprintMismatchError   idem_complete with another fingerprint
 *   ID002 TokenSupersededError       another caller took the key over
 *   ID003 NoClaimError               no live claim (missing, expired, NULL token)
 *   ID004 AlreadyCompletedError      completed already with another response
 *   UnavailableError                 connection refused or lost, read-only
 *                                    server (25006), injected fault
 *   TimeoutError (an UnavailableError) statement_timeout (57014),
 *                                    lock_timeout (55P03), client deadline
 * Any other database error becomes an IdemError carrying its SQLSTATE.
 */

class IdemError extends Error {
  constructor(message, options = {}) {
    super(message, options.cause !== undefined ? { cause: options.cause } : undefined);
    this.name = new.target.name;
    /** SQLSTATE of the server error, or null when there was none. */
    this.code = options.code ?? null;
  }
}

class FingerprintMismatchError extends IdemError {}
class TokenSupersededError extends IdemError {}
class NoClaimError extends IdemError {}
class AlreadyCompletedError extends IdemError {}
class UnavailableError extends IdemError {}
class TimeoutError extends UnavailableError {}

const BY_SQLSTATE = {
  ID001: FingerprintMismatchError,
  ID002: TokenSupersededError,
  ID003: NoClaimError,
  ID004: AlreadyCompletedError,
  25006: UnavailableError, // read_only_sql_transaction: a standby or read-only server
  57014: TimeoutError, // query_canceled: statement_timeout or a cancel request
  '55P03': TimeoutError, // lock_not_available: lock_timeout while waiting for a claim
  53300: UnavailableError, // too_many_connections
};

/** True for an error the server sent (node-pg's DatabaseError). */
function isDatabaseError(err) {
  return err != null && typeof err === 'object' && typeof err.severity === 'string' &&
    typeof err.code === 'string' && /^[0-9A-Z]{5}$/.test(err.code);
}

/**
 * The idem error for err.  Server errors map by SQLSTATE (class 08 and
 * 57P01-57P05 mean the connection is gone: unavailable); errors without a
 * SQLSTATE come from the connection (refused, reset, terminated) and are
 * unavailable too.
 */
function toIdemError(err) {
  if (err instanceof IdemError) return err;
  if (isDatabaseError(err)) {
    let Cls = BY_SQLSTATE[err.code];
    if (!Cls && (err.code.startsWith('08') || err.code.startsWith('57P'))) Cls = UnavailableError;
    return new (Cls || IdemError)(err.message, { code: err.code, cause: err });
  }
  const message = err instanceof Error ? err.message : String(err);
  return new UnavailableError(message || 'idem store unavailable', { cause: err });
}

module.exports = {
  IdemError,
  FingerprintMismatchError,
  TokenSupersededError,
  NoClaimError,
  AlreadyCompletedError,
  UnavailableError,
  TimeoutError,
  toIdemError,
  isDatabaseError,
};
