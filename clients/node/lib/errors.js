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

/**
 * True for a failure a retry of the same call may not repeat: no SQLSTATE
 * (the connection, the client's deadline), class 08 (connection), 40001
 * and 40P01 (serialization failure, deadlock), 55P03 and 57014 (lock and
 * statement timeouts, cancel), 57P01-57P03 (shutdown, crash recovery),
 * class 53 (the server's resources).
 */
function isTransient(err) {
  const code = err != null && typeof err.code === 'string' && /^[0-9A-Z]{5}$/.test(err.code) ? err.code : null;
  if (code === null) return true;
  return code.startsWith('08') || code.startsWith('53') ||
    ['40001', '40P01', '55P03', '57014', '57P01', '57P02', '57P03'].includes(code);
}

/** The SQLSTATEs after which PostgreSQL (and Citus) ask for the transaction to run again. */
const RETRY_TRANSACTION_CODES = new Set(['40001', '40P01']);

/**
 * True for a serialization failure (40001) or a deadlock (40P01), the
 * error itself or its cause: the server rolled the transaction back and
 * asks for it to run again.
 */
function isRetryableTransaction(err) {
  if (err == null || typeof err !== 'object') return false;
  const code = typeof err.code === 'string' ? err.code : (err.cause != null ? err.cause.code : null);
  return RETRY_TRANSACTION_CODES.has(code);
}

/**
 * SQLSTATEs of an idem_complete refused because the key is no longer the
 * caller's (superseded, no claim, another role's claim) or is stored
 * already: there is nothing left to store for it.
 */
const NOT_OURS = new Set(['ID002', 'ID003', 'ID004', '42501']);

/**
 * True when an idem_complete failed for good with the key still claimed by
 * the caller (a data error, a body too large for the server): the caller
 * stores the fixed "Response not stored" answer instead, so the key is
 * never claimable again after its handler ran.
 */
function storesNotStored(err) {
  return !isTransient(err) && !NOT_OURS.has(err.code);
}

/**
 * The error of an idem_begin answer whose state the client does not know
 * (a server newer than the client): not an in-flight answer, which would
 * answer a stored response with 409 for as long as it is kept.
 */
function unknownState(state) {
  return new UnavailableError(`idem: idem_begin answered an unknown state ${JSON.stringify(state)}`);
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
  isTransient,
  isRetryableTransaction,
  storesNotStored,
  unknownState,
};
