'use strict';

const { IdemError, toIdemError, storesNotStored, isRetryableTransaction, unknownState } = require('./errors');
const { Store } = require('./store');
const { around } = require('./pipeline');
const { normalizeOptions, clockOffsetOf, beginBudget } = require('./options');
const { Outcome, normalizeResponse, NOT_STORED } = require('./outcome');

/**
 * The wait between two attempts of transaction() with options.retries, in
 * ms: a random time from 0 to RETRY_BASE_MS doubled for each retry, at
 * most RETRY_CAP_MS ("full jitter").
 */
const RETRY_BASE_MS = 10;
const RETRY_CAP_MS = 1000;

/**
 * The one-transaction pattern on the caller's client: BEGIN, claim the
 * key, run handler(claim) (the business writes, on claim.client), store
 * its response, COMMIT.  The claim, the writes and the response commit
 * together or not at all.  A concurrent retry waits for this transaction
 * and then replays the response.
 *
 * Resolves to { outcome, response, token, leaseUntil, expiresAt,
 * notStored }: executed (committed), replayed, in_flight (a guard's
 * committed claim is live; leaseUntil is when its lease ends), conflict or
 * expired (a server with tombstones, options.remember: completed once, its
 * response no longer kept; status is the first response's status);
 * expiresAt is until when the stored response is replayed.  With options.waitFor
 * (ms) a duplicate of a guard's committed claim waits in the server, up to
 * that long, for its answer: the replay, or the key to claim if the holder
 * released it or its lease ended; in flight only when the wait runs out.
 * Rejects, after ROLLBACK, with the handler's own error or an idem error
 * (TimeoutError when the claim waited longer than options.timeout, plus
 * waitFor when set, or than options.lockTimeout for another transaction's
 * uncommitted claim of the key (55P03): the server cancelled the wait, so
 * no claim is left behind; IdemError 42883 when waitFor is set and the database's
 * idem_begin has no wait_for).
 *
 * An idem_complete refused for good (a data error; not the connection, a
 * timeout, a serialization failure) is rolled back to a savepoint taken
 * before it, and the fixed answer (options.notStored, by default the 500
 * "Response not stored") is stored instead, with the handler's writes:
 * notStored is true, and options.logger (console) warns with the key.
 *
 * The client must be idle (not inside a transaction).  The timeout applies
 * to idem_begin and idem_complete; statement_timeout and lock_timeout are
 * restored for the handler's statements.
 *
 * options.retries (default 0): run the transaction again, up to that many
 * more times, when it fails with a serialization failure (40001) or a
 * deadlock (40P01), from the handler, the claim, idem_complete or the
 * COMMIT (PostgreSQL rolls a transaction back when it answers COMMIT with
 * either).  Each attempt is a new transaction: BEGIN, the claim again (the
 * failed attempt's was rolled back with the handler's writes; a retry may
 * now replay what another caller stored), the handler (claim.attempt
 * counts from 1), idem_complete, COMMIT.  Any other error, or one without
 * a SQLSTATE (a lost connection: the COMMIT's result is unknown), rejects
 * at once, as does the last attempt's error.  Between attempts it waits a
 * random time from 0 to 10 ms, doubled for each retry, at most 1 s; no
 * attempt starts later than options.timeout after the first began.  The
 * handler must be safe to run again: its only effects must be its
 * statements on claim.client, which the rollback undoes.
 */
async function transaction(client, key, fingerprint, handler, options) {
  if (client == null || typeof client.query !== 'function') throw new TypeError('transaction needs a pg client');
  if (typeof key !== 'string' || typeof fingerprint !== 'string') throw new TypeError('key and fingerprint must be strings');
  if (typeof handler !== 'function') throw new TypeError('handler must be a function');
  const o = normalizeOptions(options);
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    try {
      return await attemptTransaction(client, key, fingerprint, handler, o, attempt);
    } catch (err) {
      if (attempt > o.retries || !isRetryableTransaction(err)) throw err;
      const delay = Math.random() * Math.min(RETRY_CAP_MS, RETRY_BASE_MS * 2 ** (attempt - 1));
      if (o.timeout > 0 && Date.now() + delay - started > o.timeout) throw err;
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}

/**
 * The statements that set statement_timeout and lock_timeout for the rest
 * of the transaction (none when both are 0).
 */
function timeoutStatements(st, lt, prepare) {
  if (!(st > 0) && !(lt > 0)) return [];
  return [{
    text: "SELECT pg_catalog.set_config('statement_timeout', $1::text, true), pg_catalog.set_config('lock_timeout', $2::text, true)",
    values: [String(st), String(lt)],
    prepare,
  }];
}

/**
 * The statements before a transaction's claim (BEGIN, the session's
 * timeouts saved in the transaction's idem_client.* settings and the
 * claim's bounds set, the clock offset) and after it (the session's
 * timeouts back, for the handler).
 */
function openingStatements(o, budget, lockBudget, offset, prepare) {
  const opening = [{ text: 'BEGIN' }];
  const closing = [];
  if (budget > 0 || lockBudget > 0) {
    opening.push({
      text: "SELECT pg_catalog.set_config('idem_client.statement_timeout', pg_catalog.current_setting('statement_timeout'), true)," +
        " pg_catalog.set_config('idem_client.lock_timeout', pg_catalog.current_setting('lock_timeout'), true)",
      prepare,
    }, ...timeoutStatements(budget, lockBudget, prepare));
    closing.push({
      text: "SELECT pg_catalog.set_config('statement_timeout', pg_catalog.current_setting('idem_client.statement_timeout'), true)," +
        " pg_catalog.set_config('lock_timeout', pg_catalog.current_setting('idem_client.lock_timeout'), true)",
      prepare,
    });
  }
  if (offset !== 0) {
    opening.push({ text: "SELECT pg_catalog.set_config('idem.clock_offset', $1::text, true)", values: [String(offset)] });
  }
  return { opening, closing };
}

/** One transaction of transaction(): ROLLBACK unless it commits. */
async function attemptTransaction(client, key, fingerprint, handler, o, attempt) {
  const store = new Store({ schema: o.schema, prepare: o.prepare });
  const q = async (text, values) => {
    try {
      return await client.query(text, values);
    } catch (err) {
      throw toIdemError(err);
    }
  };

  // Our COMMIT or ROLLBACK would end a transaction the caller has open.
  const tx = typeof client.getTransactionStatus === 'function' ? client.getTransactionStatus() : null;
  if (tx === 'T' || tx === 'E') throw new IdemError('transaction() needs an idle client, not one inside a transaction');
  const budget = beginBudget(o, o.waitFor);
  const lockBudget = o.lockTimeout > 0 ? o.lockTimeout : budget;
  const offset = clockOffsetOf(o);
  const args = {
    key, fingerprint, lease: o.lease, retention: o.retention, scope: o.scope, wait: o.wait, waitFor: o.waitFor, remember: o.remember,
  };
  // BEGIN, the session's timeouts saved and the claim's set, the clock
  // offset, the claim itself and the session's timeouts put back for the
  // handler: one round trip (lib/pipeline.js).
  const { opening, closing } = openingStatements(o, budget, lockBudget, offset, store.prepare);
  let ended = false;
  try {
    const { value: row } = await around(client, opening, (c) => store.begin(c, args), closing, store.prepare);
    // An answer that claims nothing is rolled back at once, its timeouts
    // with it.
    if (!row.claimed) {
      await q('ROLLBACK');
      ended = true;
      if (row.state === 'DONE') {
        return {
          outcome: Outcome.REPLAYED, response: { status: row.status, body: row.body }, token: null, leaseUntil: null,
          expiresAt: row.expiresAt ?? null, notStored: false,
        };
      }
      const none = { response: null, token: null, expiresAt: null, notStored: false };
      if (row.state === 'CONFLICT') return { outcome: Outcome.CONFLICT, ...none, leaseUntil: null };
      if (row.state === 'EXPIRED') return { outcome: Outcome.EXPIRED, ...none, leaseUntil: null, status: row.status };
      if (row.state !== 'PROCESSING') throw unknownState(row.state);
      return { outcome: Outcome.IN_FLIGHT, ...none, leaseUntil: row.leaseUntil ?? null };
    }

    const claim = { key, fingerprint, scope: o.scope, token: row.token, leaseUntil: row.leaseUntil, client, attempt };
    const response = normalizeResponse(await handler(claim));
    // The handler's statements are done: the complete gets the timeout, a
    // savepoint to fall back to if the response cannot be stored, and the
    // COMMIT, in one round trip.
    const pre = [...timeoutStatements(o.timeout, o.timeout, store.prepare), { text: 'SAVEPOINT idem_complete' }];
    const complete = (c, r) => store.complete(c, {
      key, fingerprint, status: r.status, body: r.body, token: row.token, retention: o.retention, scope: o.scope,
    });
    let expiresAt;
    let notStored = false;
    let results;
    try {
      ({ value: expiresAt, results } = await around(client, pre, (c) => complete(c, response), [{ text: 'COMMIT' }], store.prepare));
    } catch (err) {
      if (!storesNotStored(err) || err.pipelineIndex !== pre.length) throw err;
      ({ value: expiresAt, results } = await around(client, [{ text: 'ROLLBACK TO SAVEPOINT idem_complete' }],
        (c) => complete(c, normalizeResponse(o.notStored || NOT_STORED)), [{ text: 'COMMIT' }], store.prepare));
      notStored = true;
      (o.logger || console).warn(`idem: the response to key ${JSON.stringify(key)} was not stored (${err.code}: ${err.message});` +
        ' stored "Response not stored" (500) for it instead');
    }
    ended = true;
    if (results[results.length - 1].command === 'ROLLBACK') {
      throw new IdemError('the transaction was rolled back: a statement in it failed');
    }
    return {
      outcome: Outcome.EXECUTED, response, token: row.token, leaseUntil: row.leaseUntil ?? null, expiresAt, notStored,
    };
  } catch (err) {
    if (!ended) {
      try {
        await client.query('ROLLBACK');
      } catch {
        // the connection is gone: the server rolls back
      }
    }
    throw err;
  }
}

module.exports = { transaction, timeoutStatements, openingStatements };
