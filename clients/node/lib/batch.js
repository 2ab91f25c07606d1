'use strict';

const { IdemError, toIdemError, storesNotStored, isRetryableTransaction, unknownState } = require('./errors');
const { Store } = require('./store');
const { around } = require('./pipeline');
const { timeoutStatements, openingStatements } = require('./transaction');
const { normalizeOptions, clockOffsetOf, beginBudget } = require('./options');
const { Outcome, normalizeResponse, NOT_STORED } = require('./outcome');

/*
 * Batches: many keys claimed with one idem_begin_many and completed with
 * one idem_complete_many, for the guard (Guard#doMany, work outside the
 * database) and for the one-transaction pattern (transactionMany, the
 * business writes in the claim's transaction).  Both answer one result per
 * item in input order; a key repeated in the batch runs once, its later
 * occurrences answer the first one's result with duplicateOf.
 */

/** The items of a batch, checked: [{ key, fingerprint }]. */
function checkItems(items) {
  if (!Array.isArray(items)) throw new TypeError('items must be an array of { key, fingerprint }');
  return items.map((it, i) => {
    if (it == null || typeof it.key !== 'string') throw new TypeError(`items[${i}].key must be a string`);
    const fingerprint = it.fingerprint ?? '';
    if (typeof fingerprint !== 'string') throw new TypeError(`items[${i}].fingerprint must be a string`);
    return { key: it.key, fingerprint };
  });
}

/** A result with nothing happened yet. */
function emptyResult(index, key) {
  return {
    index,
    key,
    outcome: Outcome.UNAVAILABLE,
    response: null,
    token: null,
    error: null,
    failedStep: null,
    released: false,
    duplicateOf: null,
    leaseUntil: null,
    expiresAt: null,
    notStored: false,
    status: null,
  };
}

/**
 * The result of an item idem_begin_many did not claim, or null if it did
 * (or is a DUPLICATE, answered from its first occurrence at the end).
 */
function unclaimedResult(row, result) {
  result.leaseUntil = row.leaseUntil ?? null;
  result.duplicateOf = row.duplicateOf;
  if (row.claimed || row.state === 'DUPLICATE') return result;
  if (row.state === 'DONE') {
    result.outcome = Outcome.REPLAYED;
    result.response = { status: row.status, body: row.body };
    result.expiresAt = row.expiresAt ?? null;
  } else if (row.state === 'CONFLICT') {
    result.outcome = Outcome.CONFLICT;
  } else if (row.state === 'PROCESSING') {
    result.outcome = Outcome.IN_FLIGHT;
  } else if (row.state === 'EXPIRED') {
    result.outcome = Outcome.EXPIRED;
    result.status = row.status;
  } else {
    result.error = unknownState(row.state);
    result.failedStep = 'begin';
  }
  return result;
}

/** Copy each DUPLICATE's first occurrence's result into it (its index and duplicateOf kept). */
function answerDuplicates(rows, results) {
  rows.forEach((row, i) => {
    if (row.state !== 'DUPLICATE') return;
    const first = results[row.duplicateOf];
    results[i] = { ...first, index: i, key: results[i].key, duplicateOf: row.duplicateOf };
  });
}

/** Run fn over the indexes, at most n at a time; resolves when all have settled. */
async function eachLimited(indexes, n, fn) {
  let next = 0;
  const worker = async () => {
    while (next < indexes.length) {
      const i = indexes[next++];
      await fn(i);
    }
  };
  await Promise.all(Array.from({ length: Math.max(1, Math.min(n, indexes.length)) }, worker));
}

/**
 * Guard#doMany: claim every item with one idem_begin_many (its own short
 * transaction, committed), run handler(claim, item, index) for each item
 * claimed (o.concurrency at a time, 1 by default, in input order),
 * release the claim of an item whose handler throws, and store the
 * responses of the others with one idem_complete_many.  Never throws for
 * the store or a handler: each item's result says what happened.
 */
async function doMany(guard, items, handler, overrides) {
  const list = checkItems(items);
  if (typeof handler !== 'function') throw new TypeError('handler must be a function');
  const o = guard._opts(overrides);
  const concurrency = o.concurrency == null ? 1 : o.concurrency;
  if (!Number.isInteger(concurrency) || concurrency < 1) throw new TypeError('concurrency must be an integer >= 1');
  const results = list.map((it, i) => emptyResult(i, it.key));
  if (list.length === 0) return results;
  const { scope, lease, retention, remember } = o;

  let rows;
  try {
    rows = await guard._run(o, 'begin', (c, store) => store.beginMany(c, {
      keys: list.map((it) => it.key),
      fingerprints: list.map((it) => it.fingerprint),
      lease, retention, scope, wait: o.wait, waitFor: o.waitFor, remember, holder: o.holder ?? null,
    }), beginBudget(o, o.waitFor));
  } catch (err) {
    for (const r of results) {
      r.error = err;
      r.failedStep = 'begin';
    }
    return results;
  }

  const claimed = [];
  rows.forEach((row, i) => {
    unclaimedResult(row, results[i]);
    if (row.claimed) claimed.push(i);
  });

  const done = [];
  await eachLimited(claimed, concurrency, async (i) => {
    const row = rows[i];
    const r = results[i];
    const { key, fingerprint } = list[i];
    r.outcome = Outcome.EXECUTED;
    r.token = row.token;
    const controller = new AbortController();
    const hb = o.heartbeat ? guard._heartbeat(o, key, row.token, controller) : null;
    const claim = {
      key, fingerprint, scope, index: i, token: row.token, leaseUntil: row.leaseUntil, signal: controller.signal,
      get lost() {
        return controller.signal.aborted;
      },
    };
    let response;
    let handlerError = null;
    try {
      response = normalizeResponse(await handler(claim, items[i], i));
    } catch (err) {
      handlerError = err;
    }
    if (hb) await hb.stop();
    if (handlerError !== null) {
      r.error = handlerError;
      r.failedStep = 'handler';
      if (!o.keepClaimOnError) {
        try {
          r.released = await guard._run(o, 'release', (c, store) => store.release(c, { key, token: row.token, scope }));
        } catch (err) {
          r.releaseError = err;
        }
      }
      return;
    }
    r.response = response;
    done.push(i);
  });

  if (done.length > 0) {
    done.sort((a, b) => a - b);
    try {
      const expires = await guard._run(o, 'complete', (c, store) => store.completeMany(c, {
        items: done.map((i) => ({
          key: list[i].key, fingerprint: list[i].fingerprint, status: results[i].response.status,
          body: results[i].response.body, token: results[i].token,
        })),
        retention, scope,
      }));
      done.forEach((i, j) => { results[i].expiresAt = expires[j]; });
    } catch (batchErr) {
      // One item's error fails the whole statement: store them one by one,
      // so that each item's own error (and its fallback) is its own.
      for (const i of done) {
        const r = results[i];
        const { key, fingerprint } = list[i];
        const complete = (resp) => guard._run(o, 'complete', (c, store) => store.complete(c, {
          key, fingerprint, status: resp.status, body: resp.body, token: r.token, retention, scope,
        }));
        try {
          r.expiresAt = await complete(r.response);
        } catch (err) {
          r.error = err;
          r.failedStep = 'complete';
          await guard._notStored(o, key, err, r, complete);
        }
      }
    }
  }
  answerDuplicates(rows, results);
  return results;
}

/**
 * The one-transaction pattern for a batch, on the caller's idle client:
 * BEGIN, idem_begin_many, then for each item claimed, in input order,
 * SAVEPOINT, handler(claim, item, index) (its writes on claim.client),
 * RELEASE SAVEPOINT; idem_complete_many of the items whose handler
 * answered; COMMIT.  A handler that throws is rolled back to its
 * savepoint and its claim released in the transaction: only that item
 * is undone (its result has the error, failedStep 'handler'); the others
 * commit.  Rejects, after ROLLBACK, if the claim, the complete or the
 * COMMIT fails (options.retries: again after 40001 or 40P01, as
 * transaction()).  options.afterCommit is not called here: the caller
 * acts on the results after the promise resolves.
 */
async function transactionMany(client, items, handler, options) {
  if (client == null || typeof client.query !== 'function') throw new TypeError('transactionMany needs a pg client');
  const list = checkItems(items);
  if (typeof handler !== 'function') throw new TypeError('handler must be a function');
  const o = normalizeOptions(options);
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    try {
      return await attemptMany(client, list, items, handler, o, attempt);
    } catch (err) {
      if (attempt > o.retries || !isRetryableTransaction(err)) throw err;
      const delay = Math.random() * Math.min(1000, 10 * 2 ** (attempt - 1));
      if (o.timeout > 0 && Date.now() + delay - started > o.timeout) throw err;
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }
}

/** One transaction of transactionMany(): ROLLBACK unless it commits. */
async function attemptMany(client, list, items, handler, o, attempt) {
  const store = new Store({ schema: o.schema, prepare: o.prepare });
  const q = async (text, values) => {
    try {
      return await client.query(text, values);
    } catch (err) {
      throw toIdemError(err);
    }
  };
  const tx = typeof client.getTransactionStatus === 'function' ? client.getTransactionStatus() : null;
  if (tx === 'T' || tx === 'E') throw new IdemError('transactionMany() needs an idle client, not one inside a transaction');
  const results = list.map((it, i) => emptyResult(i, it.key));
  if (list.length === 0) return results;
  const budget = beginBudget(o, o.waitFor);
  const lockBudget = o.lockTimeout > 0 ? o.lockTimeout : budget;
  const offset = clockOffsetOf(o);
  // BEGIN, the timeouts, the clock offset, the claim and the session's
  // timeouts back for the handlers: one round trip (lib/pipeline.js).
  const { opening, closing } = openingStatements(o, budget, lockBudget, offset, store.prepare);
  let ended = false;
  try {
    const { value: rows } = await around(client, opening, (c) => store.beginMany(c, {
      keys: list.map((it) => it.key),
      fingerprints: list.map((it) => it.fingerprint),
      lease: o.lease, retention: o.retention, scope: o.scope, wait: o.wait, waitFor: o.waitFor,
      remember: o.remember, holder: o.holder ?? null,
    }), closing, store.prepare);
    const claimed = [];
    rows.forEach((row, i) => {
      unclaimedResult(row, results[i]);
      if (row.claimed) claimed.push(i);
    });
    if (claimed.length === 0) {
      await q('ROLLBACK');
      ended = true;
      answerDuplicates(rows, results);
      return results;
    }
    const done = [];
    // Each item's savepoint; the one before it, released, goes in the same
    // message (the last is released by the COMMIT).
    let held = false;
    for (const i of claimed) {
      const r = results[i];
      const row = rows[i];
      r.outcome = Outcome.EXECUTED;
      r.token = row.token;
      r.leaseUntil = row.leaseUntil ?? null;
      const claim = {
        key: list[i].key, fingerprint: list[i].fingerprint, scope: o.scope, index: i, token: row.token,
        leaseUntil: row.leaseUntil, client, attempt,
      };
      await q(held ? 'RELEASE SAVEPOINT idem_item; SAVEPOINT idem_item' : 'SAVEPOINT idem_item');
      held = true;
      try {
        r.response = normalizeResponse(await handler(claim, items[i], i));
        done.push(i);
      } catch (err) {
        // Only this item is undone: its writes, then its claim.
        await q('ROLLBACK TO SAVEPOINT idem_item; RELEASE SAVEPOINT idem_item');
        held = false;
        r.error = err;
        r.failedStep = 'handler';
        r.response = null;
        r.released = await store.release(client, { key: list[i].key, token: row.token, scope: o.scope });
      }
    }
    // The complete: the timeouts, a savepoint, idem_complete_many and the
    // COMMIT in one round trip.
    let committed = null;
    if (done.length > 0) {
      const pre = [...timeoutStatements(o.timeout, o.timeout, store.prepare), { text: 'SAVEPOINT idem_complete' }];
      try {
        const { value: expires, results: sent } = await around(client, pre, (c) => store.completeMany(c, {
          items: done.map((i) => ({
            key: list[i].key, fingerprint: list[i].fingerprint, status: results[i].response.status,
            body: results[i].response.body, token: results[i].token,
          })),
          retention: o.retention, scope: o.scope,
        }), [{ text: 'COMMIT' }], store.prepare);
        committed = sent[sent.length - 1];
        done.forEach((i, j) => { results[i].expiresAt = expires[j]; });
      } catch (err) {
        if (!storesNotStored(err) || err.pipelineIndex !== pre.length) throw err;
        // One response the server refuses for good: each item on its own,
        // the refused ones with the fixed answer.
        await q('ROLLBACK TO SAVEPOINT idem_complete');
        for (const i of done) {
          const r = results[i];
          const complete = (resp) => store.complete(client, {
            key: list[i].key, fingerprint: list[i].fingerprint, status: resp.status, body: resp.body, token: r.token,
            retention: o.retention, scope: o.scope,
          });
          await q('SAVEPOINT idem_complete_item');
          try {
            r.expiresAt = await complete(r.response);
          } catch (one) {
            if (!storesNotStored(one)) throw one;
            await q('ROLLBACK TO SAVEPOINT idem_complete_item');
            r.expiresAt = await complete(normalizeResponse(o.notStored || NOT_STORED));
            r.notStored = true;
            (o.logger || console).warn(`idem: the response to key ${JSON.stringify(list[i].key)} was not stored` +
              ` (${one.code}: ${one.message}); stored "Response not stored" (500) for it instead`);
          }
          await q('RELEASE SAVEPOINT idem_complete_item');
        }
      }
    }
    const res = committed ?? await q('COMMIT');
    ended = true;
    if (res && res.command === 'ROLLBACK') throw new IdemError('the transaction was rolled back: a statement in it failed');
    answerDuplicates(rows, results);
    return results;
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

module.exports = { doMany, transactionMany, checkItems };
