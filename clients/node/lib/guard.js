'use strict';

const {
  IdemError, UnavailableError, TimeoutError, TokenSupersededError, NoClaimError,
  AlreadyCompletedError, toIdemError, isDatabaseError, isTransient, storesNotStored, unknownState,
} = require('./errors');
const { Store } = require('./store');
const { around } = require('./pipeline');
const { DEFAULTS, normalizeOptions, clockOffsetOf, beginBudget } = require('./options');
const { Outcome, normalizeResponse, NOT_STORED } = require('./outcome');
const { transaction, timeoutStatements, openingStatements } = require('./transaction');
const { Steps } = require('./steps');
const { doMany, transactionMany } = require('./batch');

/** Extra time the client gives the server to report its own timeout. */
const CLIENT_GRACE_MS = 1000;
/** client_connection_check_interval while a call runs. */
const CONNECTION_CHECK_MS = 1000;
/** Heartbeat period when the lease is the server default (60 s) or text. */
const DEFAULT_HEARTBEAT_MS = 20000;
/** How long a guard uses the six-argument idem_begin after finding no wait_for form. */
const NO_WAIT_FOR_RETRY_MS = 60000;

/** Make a call fail if the fault hook says so (as if the server did not answer). */
function fireFault(o, op) {
  if (typeof o.fault !== 'function') return;
  const f = o.fault(op);
  if (!f) return;
  if (f instanceof IdemError) throw f;
  const msg = f instanceof Error ? f.message : `fault injected at ${op}`;
  throw new UnavailableError(msg, f instanceof Error ? { cause: f } : {});
}

/** A fault hook failing op (any op if omitted) the next n times. */
function failTimes(n, op) {
  let remaining = n;
  return (o) => {
    if (op != null && o !== op) return false;
    if (remaining <= 0) return false;
    remaining--;
    return new UnavailableError(`fault injected at ${o}`);
  };
}

/** Race promise against a deadline; onExpire runs when it passes. */
function withDeadline(promise, ms, onExpire, what) {
  if (!(ms > 0)) return promise;
  let timer;
  const deadline = new Promise((_, reject) => {
    timer = setTimeout(() => {
      try {
        if (onExpire) onExpire();
      } finally {
        reject(new TimeoutError(`${what} got no answer within ${ms} ms`));
      }
    }, ms);
  });
  return Promise.race([promise, deadline]).finally(() => clearTimeout(timer));
}

/** Drop a connection at once; the server rolls its open transaction back. */
function cutConnection(client) {
  client.on('error', () => {});
  const stream = client.connection && client.connection.stream;
  if (stream && typeof stream.destroy === 'function') stream.destroy();
  else client.end().catch(() => {});
}

/** True if the error means the connection itself cannot be used any more. */
function connectionGone(err) {
  const db = isDatabaseError(err) ? err : (err && isDatabaseError(err.cause) ? err.cause : null);
  if (db == null) return true;
  return db.code.startsWith('08') || db.code.startsWith('57P');
}

function isClaimGone(err) {
  return err instanceof TokenSupersededError || err instanceof NoClaimError || err instanceof AlreadyCompletedError;
}

/**
 * Protects work done outside the database.  Each server call runs in its
 * own short transaction on a connection from the pool, with
 * SET LOCAL statement_timeout and lock_timeout, so a call the client gives
 * up on is cancelled by the server and leaves nothing committed.
 */
class Guard {
  /**
   * @param pool a pg.Pool (anything with connect() returning a client
   *   with query() and release())
   */
  constructor(pool, options = {}) {
    if (pool == null || typeof pool.connect !== 'function') throw new TypeError('Guard needs a pg.Pool');
    this.pool = pool;
    this.options = normalizeOptions(options);
    this.store = new Store({ schema: this.options.schema, prepare: this.options.prepare });
    /** Until then (ms since the epoch) idem_begin is called without wait_for: the database has none. */
    this._noWaitForUntil = 0;
  }

  _opts(overrides) {
    if (!overrides) return this.options;
    const o = normalizeOptions({ ...this.options, ...overrides });
    return o;
  }

  /**
   * Run fn(client, store) in its own transaction with the call's timeouts
   * and clock offset, then commit: BEGIN, the timeouts, the clock offset,
   * fn's statement and COMMIT go in one round trip (lib/pipeline.js), fn's
   * statement with its values as parameters, prepared once per connection
   * (unless options.prepare is false).  fn is one Store call on the client
   * it is given: the call's statement is taken from it and its answer
   * handed back.  Throws idem errors.  budget (ms) replaces o.timeout for
   * the server's timeouts and the client's deadline of the call (not of
   * the connect).
   */
  async _run(o, op, fn, budget = o.timeout) {
    fireFault(o, op);
    const timeout = budget;
    const store = o.schema === this.store.schema && o.prepare === this.store.prepare
      ? this.store : new Store({ schema: o.schema, prepare: o.prepare });
    const connecting = this.pool.connect();
    let client;
    try {
      client = await withDeadline(connecting, o.timeout,
        () => connecting.then((c) => c.release(), () => {}), `connect for ${op}`);
    } catch (err) {
      throw toIdemError(err);
    }
    let destroy = false;
    let sent = false;
    try {
      const statements = [{ text: 'BEGIN' }];
      if (timeout > 0) {
        statements.push({
          text: 'SELECT pg_catalog.set_config(\'statement_timeout\', $1::text, true),' +
            ' pg_catalog.set_config(\'lock_timeout\', $1::text, true),' +
            ' pg_catalog.set_config(\'client_connection_check_interval\', $2::text, true)',
          values: [String(timeout), String(CONNECTION_CHECK_MS)],
          prepare: store.prepare,
        });
      }
      const offset = clockOffsetOf(o);
      if (offset !== 0) {
        statements.push({ text: 'SELECT pg_catalog.set_config(\'idem.clock_offset\', $1::text, true)', values: [String(offset)] });
      }
      sent = true;
      const work = (async () => {
        const { value, results } = await around(client, statements, (c) => fn(c, store), [{ text: 'COMMIT' }], store.prepare);
        if (results[results.length - 1].command === 'ROLLBACK') {
          throw new IdemError('the transaction was rolled back: a statement in it failed');
        }
        return value;
      })();
      // The server cancels at `timeout`; if no answer comes even then, the
      // link is cut, so the transaction can never commit.
      return await withDeadline(work, timeout > 0 ? timeout + CLIENT_GRACE_MS : 0, () => {
        destroy = true;
        cutConnection(client);
      }, op);
    } catch (err) {
      if (!destroy) {
        if (connectionGone(err)) destroy = true;
        else if (sent) {
          try {
            await withDeadline(client.query('ROLLBACK'), timeout > 0 ? timeout + CLIENT_GRACE_MS : 0,
              () => cutConnection(client), 'ROLLBACK');
          } catch {
            destroy = true;
          }
        }
      }
      throw toIdemError(err);
    } finally {
      client.release(destroy ? true : undefined);
    }
  }

  /**
   * Claim key, then replay, refuse, or run handler(claim) and store its
   * response.  Never throws for the store or the handler: the result says
   * what happened.
   */
  async do(key, fingerprint, handler, overrides) {
    if (typeof key !== 'string' || typeof fingerprint !== 'string') throw new TypeError('key and fingerprint must be strings');
    if (typeof handler !== 'function') throw new TypeError('handler must be a function');
    const o = this._opts(overrides);
    const result = {
      outcome: Outcome.UNAVAILABLE,
      response: null,
      token: null,
      error: null,
      failedStep: null,
      released: false,
      superseded: false,
      extends: 0,
      leaseUntil: null,
      expiresAt: null,
      notStored: false,
      status: null,
      resumedFrom: null,
      steps: [],
    };
    const { scope, lease, retention, remember } = o;

    // Claim: any failure means no dedup protection, so the handler does not run.
    let row;
    try {
      row = await this._begin(o, { key, fingerprint, lease, retention, scope, wait: o.wait, remember });
    } catch (err) {
      result.error = err;
      result.failedStep = 'begin';
      return result;
    }
    result.leaseUntil = row.leaseUntil ?? null;
    if (!row.claimed) {
      if (row.state === 'DONE') {
        result.outcome = Outcome.REPLAYED;
        result.response = { status: row.status, body: row.body };
        result.expiresAt = row.expiresAt ?? null;
      } else if (row.state === 'CONFLICT') {
        result.outcome = Outcome.CONFLICT;
      } else if (row.state === 'PROCESSING') {
        result.outcome = Outcome.IN_FLIGHT;
      } else if (row.state === 'EXPIRED') {
        // Executed and completed once; the response is gone: never run again.
        result.outcome = Outcome.EXPIRED;
        result.status = row.status;
      } else {
        // Not in flight: that would answer a stored response with 409 for as long as it is kept.
        result.error = unknownState(row.state);
        result.failedStep = 'begin';
      }
      return result;
    }

    result.outcome = Outcome.EXECUTED;
    result.token = row.token;
    const controller = new AbortController();
    const hb = o.heartbeat ? this._heartbeat(o, key, row.token, controller) : null;
    const claim = {
      key,
      fingerprint,
      scope,
      token: row.token,
      leaseUntil: row.leaseUntil,
      signal: controller.signal,
      get lost() {
        return controller.signal.aborted;
      },
    };
    const steps = new Steps({
      key,
      scope,
      token: row.token,
      signal: controller.signal,
      phase: row.phase,
      phaseData: row.phaseData,
      checkpoint: (name, data) => this._run(o, 'checkpoint', (c, store) =>
        store.checkpoint(c, { key, token: row.token, phase: name, data, scope })),
      runTx: (name, fn) => this._stepTx(o, key, row.token, name, fn),
    });
    claim.resumedFrom = steps.resumedFrom;
    claim.step = (name, fn) => steps.step(name, fn);
    claim.stepTx = (name, fn) => steps.stepTx(name, fn);
    claim.stepsDone = () => steps.done();
    result.resumedFrom = steps.resumedFrom;

    let response;
    let handlerError = null;
    try {
      response = normalizeResponse(await handler(claim));
    } catch (err) {
      handlerError = err;
    }
    if (hb) {
      await hb.stop();
      result.extends = hb.extends;
      result.superseded = controller.signal.aborted;
    }

    result.steps = steps.done();

    if (handlerError !== null) {
      result.error = handlerError;
      result.failedStep = 'handler';
      // A claim with a recovery point is left to its lease: a release would
      // delete the finished steps with the key, and the retry would do
      // their work again instead of resuming after them.
      if (!o.keepClaimOnError && !steps.any) {
        try {
          result.released = await this._run(o, 'release', (c, store) =>
            store.release(c, { key, token: row.token, scope }));
        } catch (err) {
          result.releaseError = err;
        }
      }
      return result;
    }

    result.response = response;
    const complete = (r) => this._run(o, 'complete', (c, store) => store.complete(c, {
      key, fingerprint, status: r.status, body: r.body, token: row.token, retention, scope,
    }));
    try {
      result.expiresAt = await complete(response);
    } catch (err) {
      result.error = err;
      result.failedStep = 'complete';
      await this._notStored(o, key, err, result, complete);
    }
    return result;
  }

  /**
   * The handler ran but its response was not stored.  A failure a retry of
   * the call could not fix stores the fixed answer (o.notStored, by default
   * the 500 "Response not stored") so that the key is never claimable
   * again; after any other (the connection, a timeout) the key stays
   * PROCESSING until its lease ends (or is not the claim's any more:
   * superseded, completed).  Either way the logger hears of it,
   * with the key.
   */
  async _notStored(o, key, err, result, complete) {
    const logger = o.logger || console;
    const what = `idem: the response to key ${JSON.stringify(key)} was not stored (${err.code || err.name}: ${err.message})`;
    if (!storesNotStored(err)) {
      logger.warn(`${what}; ${isTransient(err) ? 'the key stays claimed until its lease ends' : 'the key is not this claim\'s any more'}`);
      return;
    }
    try {
      result.expiresAt = await complete(normalizeResponse(o.notStored || NOT_STORED));
      result.notStored = true;
      logger.warn(`${what}; stored "Response not stored" (500) for it instead`);
    } catch (again) {
      result.notStoredError = again;
      logger.warn(`${what}; storing "Response not stored" failed too (${again.code || again.name}: ${again.message}),` +
        ' the key stays claimed until its lease ends');
    }
  }

  /**
   * The claim: idem_begin in its own transaction, with wait_for when
   * o.waitFor is set.  Its budget is timeout + waitFor: the server ends the
   * wait at waitFor and the call at timeout + waitFor, the client cuts the
   * link 1 s later.  A database without the wait_for form (42883) gets the
   * six-argument form, and is asked again after NO_WAIT_FOR_RETRY_MS.
   */
  async _begin(o, args) {
    let waitFor = o.waitFor;
    if (waitFor > 0 && this._noWaitForUntil > Date.now() && o.schema === this.store.schema) waitFor = 0;
    const call = (w) => this._run(o, 'begin', (c, store) => store.begin(c, { ...args, waitFor: w }), beginBudget(o, w));
    try {
      return await call(waitFor);
    } catch (err) {
      // (with remember, a 42883 may be the server's lack of remember instead: not retried)
      if (!(waitFor > 0 && args.remember == null && err instanceof IdemError && err.code === '42883')) throw err;
      if (o.schema === this.store.schema) this._noWaitForUntil = Date.now() + NO_WAIT_FOR_RETRY_MS;
      return call(0);
    }
  }

  /** Extend the lease periodically until stopped or the claim is lost. */
  _heartbeat(o, key, token, controller) {
    const period = typeof o.heartbeat === 'number' ? o.heartbeat
      : (typeof o.lease === 'number' ? Math.max(1, Math.floor(o.lease / 3)) : DEFAULT_HEARTBEAT_MS);
    const hb = { extends: 0, lastError: null };
    let running = Promise.resolve();
    let stopped = false;
    const tick = async () => {
      try {
        await this._run(o, 'extend', (c, store) => store.extend(c, { key, token, lease: o.lease, scope: o.scope }));
        hb.extends++;
      } catch (err) {
        hb.lastError = err;
        if (isClaimGone(err)) {
          clearInterval(timer);
          controller.abort(err);
        }
      }
    };
    const timer = setInterval(() => {
      if (stopped) return;
      running = running.then(tick);
    }, period);
    if (typeof timer.unref === 'function') timer.unref();
    hb.stop = async () => {
      stopped = true;
      clearInterval(timer);
      await running;
    };
    return hb;
  }

  /**
   * claim.stepTx's transaction, on a client of the pool: BEGIN, idem_hold
   * (with the call's timeout and clock offset; the transaction's own
   * timeouts are put back for the step), fn(client) (the step's writes;
   * it resolves to { output, data }), idem_checkpoint of the step with
   * data, COMMIT.  The writes and the checkpoint commit together; a
   * superseded holder is refused by idem_hold before fn runs.  Any error
   * rolls back and is thrown.
   */
  async _stepTx(o, key, token, name, fn) {
    fireFault(o, 'hold');
    const store = o.schema === this.store.schema && o.prepare === this.store.prepare
      ? this.store : new Store({ schema: o.schema, prepare: o.prepare });
    let client;
    try {
      client = await this.pool.connect();
    } catch (err) {
      throw toIdemError(err);
    }
    let destroy = false;
    let ended = false;
    try {
      // BEGIN, the call's timeouts and clock offset, idem_hold and the
      // transaction's own timeouts back for the step: one round trip.
      const { opening, closing } = openingStatements(o, o.timeout, o.timeout, clockOffsetOf(o), store.prepare);
      await around(client, opening, (c) => store.hold(c, { key, token, scope: o.scope }), closing, store.prepare);
      const { output, data } = await fn(client);
      fireFault(o, 'checkpoint');
      // The checkpoint with the timeout, and the COMMIT: one round trip.
      const { results } = await around(client, timeoutStatements(o.timeout, o.timeout, store.prepare),
        (c) => store.checkpoint(c, { key, token, phase: name, data, scope: o.scope }), [{ text: 'COMMIT' }], store.prepare);
      ended = true;
      if (results[results.length - 1].command === 'ROLLBACK') {
        throw new IdemError(`step ${JSON.stringify(name)}: the transaction was rolled back: a statement in it failed`);
      }
      return output;
    } catch (err) {
      if (!ended) {
        try {
          await client.query('ROLLBACK');
        } catch {
          destroy = true; // the connection is gone: the server rolls back
        }
      }
      throw err;
    } finally {
      client.release(destroy ? true : undefined);
    }
  }

  /**
   * Many keys at once: one idem_begin_many claims every item
   * ({ key, fingerprint }), handler(claim, item, index) runs for each item
   * claimed (options.concurrency at a time, 1 by default), one
   * idem_complete_many stores their responses.  Resolves to one result per
   * item, in input order, as do() answers it, with index and duplicateOf
   * (a key repeated in the batch runs once: its later occurrences get the
   * first one's result, duplicateOf its index).  See lib/batch.js.
   */
  doMany(items, handler, overrides) {
    return doMany(this, items, handler, overrides);
  }

  /** The one-transaction helper for a batch with this guard's options; see transactionMany(). */
  transactionMany(client, items, handler, overrides) {
    return transactionMany(client, items, handler, { ...this.options, ...(overrides || {}) });
  }

  /** The one-transaction helper with this guard's options; see transaction(). */
  transaction(client, key, fingerprint, handler, overrides) {
    return transaction(client, key, fingerprint, handler, { ...this.options, ...(overrides || {}) });
  }
}

// The helpers of options.js and outcome.js stay reachable from here too, as
// they were before they had modules of their own.
module.exports = {
  Guard, Outcome, failTimes, normalizeOptions, normalizeResponse, clockOffsetOf, DEFAULTS, withDeadline,
};
