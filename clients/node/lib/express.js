'use strict';

const crypto = require('node:crypto');
const { Guard, Outcome, withDeadline } = require('./guard');
const { normalizeOptions } = require('./options');
const { transaction } = require('./transaction');
const { NOT_STORED_BODY } = require('./outcome');
const { IdemError, UnavailableError, TimeoutError } = require('./errors');

/*
 * Express middleware for the Idempotency-Key header
 * (draft-ietf-httpapi-idempotency-key-header) over a Guard, or in
 * transactional mode over transaction().  The behaviour is doc/http.md's.
 *
 * Stored per key: the response's status, the headers listed in
 * storedHeaders and the body, in one bytea (the envelope: a marker line,
 * the headers as a JSON array of [name, value] pairs, then the body bytes).
 */

const ENVELOPE = Buffer.from('idem-http/1\n');
/** The envelope of responses stored before idem-http/1: headers as a JSON object. */
const OLD_ENVELOPE = Buffer.from('IDEMHTTP1\n');

const DEFAULT_STORED_HEADERS = ['content-type', 'content-language', 'content-encoding', 'location', 'etag', 'cache-control'];

/** How long a concurrent retry waits for the first request's answer by default (ms). */
const DEFAULT_WAIT_FOR_MS = 5000;

/**
 * Answers released rather than stored (doc/http.md's policy): besides 5xx,
 * those about the caller's credentials or timing, which a retry (after a
 * token refresh, a proxy login, a pause) should see run again.
 */
const NOT_STORED_STATUSES = new Set([401, 403, 407, 408, 425, 429]);

/** The replay policy of doc/http.md: store unless 401, 403, 407, 408, 425, 429 or 5xx. */
function defaultStoreStatus(status) {
  return !NOT_STORED_STATUSES.has(status) && status < 500;
}

/**
 * The scope of a key claimed for principal within tenant (doc/http.md):
 * `<n>:<tenant>=<principal>`, n the tenant's length in UTF-8 bytes, so that
 * no two (tenant, principal) pairs give one scope.  A principal that is not
 * printable ASCII, or that would make the scope longer than maxLength bytes,
 * is written as `#` and the hex SHA-256 of its UTF-8 bytes instead.
 */
function callerScope(tenant, principal, maxLength = 255) {
  const head = `${Buffer.byteLength(tenant, 'utf8')}:${tenant}`;
  const plain = `${head}=${principal}`;
  if (/^[\x20-\x7e]*$/.test(principal) && Buffer.byteLength(plain, 'utf8') <= maxLength) return plain;
  return `${head}#${crypto.createHash('sha256').update(principal, 'utf8').digest('hex')}`;
}

/**
 * Retry-After of a 409: the seconds until the holder's lease ends (at least
 * 1), from the claim's lease_until; without a lease from the server (an
 * uncommitted claim), the fixed retryAfter.
 */
function retryAfterSeconds(result, retryAfter) {
  const until = result.leaseUntil;
  if (!(until instanceof Date) || Number.isNaN(until.getTime())) return retryAfter;
  return Math.max(1, Math.ceil((until.getTime() - Date.now()) / 1000));
}

/** headers: [[name, value], ...] (names lower-cased here). */
function encodeEnvelope(headers, body) {
  const pairs = headers.map(([k, v]) => [String(k).toLowerCase(), String(v)]);
  return Buffer.concat([ENVELOPE, Buffer.from(JSON.stringify(pairs) + '\n'), Buffer.from(body)]);
}

/**
 * { headers: [[name, value], ...], body } of a stored response: the
 * envelope of doc/http.md, or the IDEMHTTP1 form (headers as an object of
 * strings or arrays of strings); anything else is all body.
 */
function decodeEnvelope(stored) {
  const buf = stored || Buffer.alloc(0);
  for (const marker of [ENVELOPE, OLD_ENVELOPE]) {
    if (buf.length < marker.length || !buf.subarray(0, marker.length).equals(marker)) continue;
    const nl = buf.indexOf(0x0a, marker.length);
    if (nl < 0) break;
    let parsed;
    try {
      parsed = JSON.parse(buf.subarray(marker.length, nl).toString('utf8'));
    } catch {
      break; // not an envelope after all
    }
    const headers = [];
    if (marker === ENVELOPE && Array.isArray(parsed)) {
      for (const pair of parsed) if (Array.isArray(pair) && pair.length === 2) headers.push([String(pair[0]), String(pair[1])]);
    } else if (marker === OLD_ENVELOPE && parsed !== null && typeof parsed === 'object' && !Array.isArray(parsed)) {
      for (const [k, v] of Object.entries(parsed)) {
        for (const one of Array.isArray(v) ? v : [v]) headers.push([k.toLowerCase(), String(one)]);
      }
    } else {
      break;
    }
    return { headers, body: buf.subarray(nl + 1) };
  }
  return { headers: [], body: buf };
}

/** The fixed answer of doc/http.md in the envelope: what replays get for a response not stored. */
const NOT_STORED_ENVELOPE = Object.freeze({
  status: 500,
  body: encodeEnvelope([['content-type', 'application/problem+json']], Buffer.from(NOT_STORED_BODY)),
});

/** A verify function for express.json()/raw()/text(): keeps the exact bytes for the fingerprint. */
function saveRawBody(req, res, buf) {
  req.rawBody = Buffer.from(buf);
}

/** The request body as bytes: raw if known, else what a body parser made of it, else read now. */
async function requestBody(req, limit) {
  if (Buffer.isBuffer(req.rawBody)) return req.rawBody;
  if (req._body) {
    const b = req.body;
    if (Buffer.isBuffer(b)) return b;
    if (typeof b === 'string') return Buffer.from(b, 'utf8');
    return Buffer.from(JSON.stringify(b === undefined ? null : b), 'utf8');
  }
  if (req.readableEnded) return Buffer.alloc(0);
  const chunks = [];
  let size = 0;
  for await (const chunk of req) {
    size += chunk.length;
    if (size > limit) {
      const err = new Error('request body too large');
      err.status = 413;
      throw err;
    }
    chunks.push(chunk);
  }
  const buf = Buffer.concat(chunks);
  req.rawBody = buf;
  // Body parsers that did not match the content type leave {} behind.
  const empty = req.body !== null && typeof req.body === 'object' && !Buffer.isBuffer(req.body) &&
    Object.getPrototypeOf(req.body) === Object.prototype && Object.keys(req.body).length === 0;
  if (req.body === undefined || empty) req.body = buf;
  req._body = true; // the stream is consumed: later body parsers skip it
  return buf;
}

/** SHA-256 (hex) of method, original URL (path and query) and body bytes. */
function defaultFingerprint(req, body) {
  const h = crypto.createHash('sha256');
  h.update(req.method);
  h.update('\n');
  h.update(req.originalUrl || req.url);
  h.update('\n');
  h.update(body);
  return h.digest('hex');
}

/**
 * The key of an Idempotency-Key header value: a Structured Field string
 * ("..." with \" and \\ escapes) or a bare token; either way 1 to
 * maxLength bytes of printable ASCII (0x20-0x7e).  null when the value is
 * none of these: a control character, a byte outside ASCII, an
 * unterminated or badly escaped sf-string, an empty or too long key.
 */
function parseKey(value, maxLength = 255) {
  if (Array.isArray(value)) value = value.join(', ');
  if (typeof value !== 'string') return null;
  const v = value.replace(/^[ \t]+|[ \t]+$/g, ''); // the header's optional whitespace
  let key = '';
  if (v.startsWith('"')) {
    let i = 1;
    for (;;) {
      if (i >= v.length) return null; // unterminated
      const c = v.charCodeAt(i);
      if (c === 0x5c) { // backslash: only \" and \\ are escapes
        const n = v[i + 1];
        if (n !== '"' && n !== '\\') return null;
        key += n;
        i += 2;
      } else if (c === 0x22) {
        if (i !== v.length - 1) return null; // something after the closing quote
        break;
      } else if (c < 0x20 || c > 0x7e) {
        return null;
      } else {
        key += v[i];
        i += 1;
      }
    }
  } else {
    if (!/^[\x20-\x7e]*$/.test(v)) return null;
    key = v;
  }
  if (key === '' || key.length > maxLength) return null;
  return key;
}

const DAYS = ['Sun', 'Mon', 'Tue', 'Wed', 'Thu', 'Fri', 'Sat'];
const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];
const IMF_FIXDATE = /^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), ([0-9]{2}) (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) ([0-9]{4}) ([0-9]{2}):([0-9]{2}):([0-9]{2}) GMT$/;

/**
 * The time of an IMF-fixdate (RFC 9110 section 5.6.7, e.g. `Sun, 06 Nov
 * 1994 08:49:37 GMT`) as a Date; the header's optional whitespace around it
 * is ignored.  null for anything else: the obsolete RFC 850 and asctime
 * forms, a day name that is not the date's, a date or time out of range.
 * A leap second (60) is read as 59.
 */
function parseHttpDate(value) {
  if (Array.isArray(value)) value = value.join(', ');
  if (typeof value !== 'string') return null;
  const m = IMF_FIXDATE.exec(value.replace(/^[ \t]+|[ \t]+$/g, ''));
  if (m === null) return null;
  const [year, month, day] = [Number(m[4]), MONTHS.indexOf(m[3]), Number(m[2])];
  const [hour, minute] = [Number(m[5]), Number(m[6])];
  const second = Math.min(Number(m[7]), 59);
  if (hour > 23 || minute > 59 || day < 1) return null;
  const at = new Date(Date.UTC(year, month, day, hour, minute, second));
  at.setUTCFullYear(year); // Date.UTC takes years 0 to 99 as 1900 to 1999
  if (at.getUTCMonth() !== month || at.getUTCDate() !== day) return null; // 31 Nov
  if (DAYS[at.getUTCDay()] !== m[1]) return null;
  return at;
}

/**
 * The key of a Repeatability-Request-ID value (OASIS Repeatable Requests):
 * 1 to maxLength printable ASCII characters, taken as they are (no
 * sf-string unquoting); null otherwise.
 */
function parseRequestId(value, maxLength = 255) {
  if (Array.isArray(value)) value = value.join(', ');
  if (typeof value !== 'string') return null;
  const v = value.replace(/^[ \t]+|[ \t]+$/g, '');
  if (v === '' || v.length > maxLength || !/^[\x20-\x7e]*$/.test(v)) return null;
  return v;
}

/** The window as Idempotency-Key-Lifetime's whole seconds (rounded down). */
function lifetime(windowSeconds) {
  return String(Math.floor(windowSeconds));
}

/**
 * The SQLSTATE of a key or scope longer than the server's
 * idem.max_key_length (string_data_right_truncation).  The server is
 * asked, not a copy of its limit: the setting may differ per role or
 * database and change at any reload.
 */
const KEY_TOO_LONG = '22001';

/**
 * The server's message when err, the error of a claim made before the
 * handler ran, is the server refusing the key or the scope (22001: longer
 * than idem.max_key_length), else null.  A claim's other data errors are
 * not the request's: the middleware never sends an empty key (22023), and
 * the lease, retention and wait are the route's settings.
 */
function refusedKey(err) {
  if (err == null || typeof err !== 'object') return null;
  const code = err.code ?? (err.cause != null ? err.cause.code : null);
  if (code !== KEY_TOO_LONG) return null;
  return String(err.message || 'too long');
}

function problem(res, status, title, detail, headers = {}) {
  res.status(status);
  // An OASIS request: the middleware's own answers refuse it.
  if (res.getHeader('Repeatability-Result') !== undefined) res.setHeader('Repeatability-Result', 'rejected');
  for (const [k, v] of Object.entries(headers)) res.setHeader(k, v);
  res.setHeader('Content-Type', 'application/problem+json');
  res.end(JSON.stringify({ type: 'about:blank', title, status, detail }));
}

/** Idempotency-Expires: the HTTP date (IMF-fixdate) until which the stored response is replayed. */
function setExpires(res, expiresAt) {
  if (expiresAt instanceof Date && !Number.isNaN(expiresAt.getTime()) && !res.headersSent) {
    res.setHeader('Idempotency-Expires', expiresAt.toUTCString());
  }
}

class ResponseNotStored extends Error {
  constructor(status) {
    super(`the handler answered ${status}: released for a retry`);
    this.name = 'ResponseNotStored';
    this.status = status;
  }
}

/**
 * req.idempotency.items(items, handler, { key, fingerprint }): the items of
 * a batch request (doc/http.md, "Batches"), each under a key of its own in
 * the envelope's scope: key(item, index) when given (a key the client
 * sent per item), else `<envelope key>:<index>`; its fingerprint
 * fingerprint(item, index), by default the SHA-256 of JSON.stringify(item).
 * One idem_begin_many claims them all and one idem_complete_many stores
 * the answers of those whose handler(item, index, claim) ran: { status,
 * body } with body any JSON value.  Resolves to { results, retry }:
 * results in input order, { index, key, status, body, replayed,
 * duplicateOf }, a problem body for an item that did not run (409 in
 * flight, 422 reused with another item, 503 store unavailable, 500 its
 * handler threw and its claim was released); retry is true if any item
 * should run again (409, 500, 503): answer the envelope with a status the
 * replay policy does not store (503), so that a retry with the same
 * Idempotency-Key runs it again, replaying the items that are done.
 * Default mode only.
 */
async function batchItems(ctx, items, handler, opts = {}) {
  if (!ctx.guard) throw new TypeError('req.idempotency.items() needs the default mode (not transactional: true)');
  if (!Array.isArray(items)) throw new TypeError('items must be an array');
  const keyOf = opts.key || ((item, i) => `${ctx.key}:${i}`);
  const fpOf = opts.fingerprint || ((item) => crypto.createHash('sha256').update(JSON.stringify(item) ?? '').digest('hex'));
  const list = items.map((item, i) => {
    const key = keyOf(item, i);
    if (typeof key !== 'string' || key === '') throw new TypeError(`the key of item ${i} must be a non-empty string`);
    return { key, fingerprint: String(fpOf(item, i)) };
  });
  const done = await ctx.guard.doMany(list, async (claim, it, i) => {
    const r = await handler(items[i], i, claim);
    if (r == null || !Number.isInteger(r.status)) throw new TypeError('an item\'s handler must return { status, body }');
    return { status: r.status, body: Buffer.from(JSON.stringify(r.body ?? null)) };
  }, { ...ctx.overrides, notStored: undefined, scope: ctx.scope });
  const itemProblem = (status, title, detail) => ({ status, body: { type: 'about:blank', title, status, detail } });
  // Each item's answer, its members in doc/http.md's order.
  const answer = (r) => {
    if (r.error == null && r.response) {
      let body = null;
      try {
        body = r.response.body == null ? null : JSON.parse(r.response.body.toString('utf8'));
      } catch {
        body = r.response.body.toString('utf8');
      }
      return { status: r.response.status, body };
    }
    if (r.outcome === Outcome.CONFLICT) return itemProblem(422, 'item key reused', 'this item\'s key was used with another item');
    if (r.outcome === Outcome.IN_FLIGHT) return itemProblem(409, 'item in flight', 'this item is being processed by another request');
    if (r.outcome === Outcome.EXPIRED) return itemProblem(410, 'item expired', 'this item was processed once; its answer is no longer kept');
    if (r.failedStep === 'handler') return itemProblem(500, 'item failed', 'this item was not processed; retry the request');
    return itemProblem(503, 'store unavailable', 'this item was not processed; retry the request');
  };
  const results = done.map((r, i) => {
    const { status, body } = answer(r);
    return { index: i, key: list[i].key, status, body, replayed: r.outcome === Outcome.REPLAYED, duplicateOf: r.duplicateOf };
  });
  const retry = done.some((r) => r.error != null || r.outcome === Outcome.IN_FLIGHT || r.outcome === Outcome.UNAVAILABLE);
  return { results, retry };
}

/**
 * Run the rest of the chain under the claim and capture the response.
 * Writes go out as they come; the final end() is held until the guard has
 * stored the response, so a client that has the answer finds it stored.
 */
function runCaptured(req, res, next, claim, capture, ctx) {
  capture.started = true; // the claim is made: what fails from here is not the key's
  return new Promise((resolve) => {
    // Transactional mode has no heartbeat: a signal that never aborts.
    const signal = claim.signal || new AbortController().signal;
    req.idempotency = { key: ctx.key, scope: ctx.scope, token: claim.token, signal, replayed: false };
    if (ctx.oasis) res.setHeader('Repeatability-Result', 'accepted'); // the handler's answer
    if (claim.client) req.idempotency.client = claim.client;
    req.idempotency.items = (items, handler, opts) => batchItems(ctx, items, handler, opts);
    if (typeof claim.step === 'function') {
      req.idempotency.step = claim.step;
      req.idempotency.stepTx = claim.stepTx;
      req.idempotency.resumedFrom = claim.resumedFrom;
    }
    const chunks = [];
    const write = res.write;
    const end = res.end;
    const toBuf = (chunk, encoding) => (Buffer.isBuffer(chunk) ? chunk
      : (chunk instanceof Uint8Array ? Buffer.from(chunk) : Buffer.from(String(chunk), typeof encoding === 'string' ? encoding : 'utf8')));
    res.write = function idemWrite(chunk, encoding, cb) {
      if (chunk != null && chunk.length !== 0) chunks.push(toBuf(chunk, encoding));
      return write.call(this, chunk, encoding, cb);
    };
    res.end = function idemEnd(chunk, encoding, cb) {
      if (typeof chunk === 'function') {
        cb = chunk;
        chunk = undefined;
        encoding = undefined;
      } else if (typeof encoding === 'function') {
        cb = encoding;
        encoding = undefined;
      }
      if (chunk != null && chunk.length !== 0) chunks.push(toBuf(chunk, encoding));
      res.write = write;
      res.end = end;
      const headers = [];
      for (const name of ctx.storedHeaders) {
        const v = res.getHeader(name);
        if (v !== undefined) for (const one of Array.isArray(v) ? v : [v]) headers.push([name, String(one)]);
      }
      capture.finish = () => end.call(res, chunk, encoding, cb);
      capture.status = res.statusCode;
      capture.headers = headers;
      capture.body = Buffer.concat(chunks);
      resolve();
      return res;
    };
    next();
  }).then(() => {
    if (!ctx.storeStatus(capture.status)) throw new ResponseNotStored(capture.status);
    return { status: capture.status, body: encodeEnvelope(capture.headers, capture.body) };
  });
}

/**
 * idempotency(poolOrGuard, options): Express middleware, doc/http.md.
 *
 * options: header ('Idempotency-Key'), methods (['POST', 'PATCH']),
 * required (false: requests without the header pass through; true: 400),
 * fingerprint(req, body) (method, URL and body), principal(req) (the
 * caller's identity, a string: keys are claimed in the scope
 * callerScope(tenant, principal)) or shared (true: one namespace for every
 * caller, the scope being the tenant alone), one of which is required,
 * scope(req) (the tenant, ''), authorize(req, res) (before a replay: true
 * replays, false answers 403, a hook that sent an answer itself has it
 * sent), storeStatus(status) (true to store and replay the answer; default:
 * all but 401, 403, 407, 408, 425, 429 and 5xx, which release the key), storeServerErrors (true: store
 * every status, a shorthand for storeStatus: () => true), transactional
 * (false; true: the handler runs inside the transaction that holds the
 * claim, on req.idempotency.client, and its writes commit with the claim
 * and the stored response), storedHeaders, replayHeader
 * ('Idempotent-Replayed'), retryAfter (1 s), maxKeyLength (255), limit
 * (1 MiB, for bodies read here), onResult(result, req), waitFor (5000 ms;
 * 0 when wait is false), and any Guard option (lease, retention, timeout,
 * wait, logger, ...) when a pool is given.
 *
 * waitFor is this middleware's, so each route it is mounted on has its
 * own: a retry that arrives while the first request with its key runs
 * waits in the server up to waitFor for the answer and gets it replayed;
 * 409 only when the wait runs out, with Retry-After until the first
 * request's lease ends.  It overrides a given Guard's waitFor.
 */
function idempotency(poolOrGuard, options = {}) {
  const {
    header = 'Idempotency-Key',
    methods = ['POST', 'PATCH'],
    required = false,
    fingerprint = defaultFingerprint,
    scope = () => '',
    principal = null,
    shared = false,
    authorize = null,
    storeStatus: storeStatusOption,
    storeServerErrors = false,
    transactional = false,
    storedHeaders = DEFAULT_STORED_HEADERS,
    replayHeader = 'Idempotent-Replayed',
    retryAfter = 1,
    maxKeyLength = 255,
    limit = 1024 * 1024,
    onResult = null,
    waitFor: waitForOption,
    advertiseWindow = false,
    remember,
    ...guardOptions
  } = options;
  if (principal == null && shared !== true) {
    throw new TypeError('idempotency() needs principal: (req) => the caller\'s identity, which scopes its keys, ' +
      'or shared: true (every caller shares one namespace of keys, and a replay goes to whoever sends the same key and request)');
  }
  if (principal != null && shared === true) throw new TypeError('give principal or shared: true, not both');
  if (principal != null && typeof principal !== 'function') throw new TypeError('principal must be a function of the request');
  if (authorize != null && typeof authorize !== 'function') throw new TypeError('authorize must be a function of the request');
  if (storeStatusOption != null && typeof storeStatusOption !== 'function') throw new TypeError('storeStatus must be a function of the status');
  if (storeStatusOption != null && storeServerErrors) throw new TypeError('give storeStatus or storeServerErrors, not both');
  const storeStatus = storeStatusOption || (storeServerErrors ? () => true : defaultStoreStatus);
  const guard = poolOrGuard instanceof Guard ? poolOrGuard : new Guard(poolOrGuard, guardOptions);
  const waitFor = normalizeOptions({
    ...guard.options,
    waitFor: waitForOption !== undefined ? waitForOption : (guard.options.wait === false ? 0 : DEFAULT_WAIT_FOR_MS),
  }).waitFor;
  const methodSet = new Set(methods.map((m) => m.toUpperCase()));
  const headerName = header.toLowerCase();
  const stored = storedHeaders.map((h) => h.toLowerCase());
  // The answer stored instead of a response idem_complete refuses, and the
  // logger that hears of it (a given Guard keeps its own unless one is given).
  const overrides = { waitFor, notStored: NOT_STORED_ENVELOPE };
  if (guardOptions.logger !== undefined) overrides.logger = guardOptions.logger;
  // This route's remember (a server with tombstones), else the guard's.
  if (remember != null) overrides.remember = normalizeOptions({ remember }).remember;

  /** Transactional mode: claim, handler and stored response in one transaction on a pool client. */
  async function inTransaction(req, res, next, key, fp, sc, capture, ctx) {
    // A retry waits for the first request's transaction (its claim is
    // uncommitted: idem_begin's wait_for, for committed claims, does not
    // apply) up to waitFor, then answers 409; waitFor 0: 409 at once.  The
    // claim's budget is the guard's: timeout + waitFor.  No retries: the
    // route's handlers cannot run twice for one request.
    const o = { ...guard.options, ...overrides, scope: sc, waitFor: 0, retries: 0 };
    if (o.timeout > 0) o.timeout += waitFor;
    if (waitFor > 0) o.lockTimeout = waitFor;
    else o.wait = false;
    let client;
    const connecting = guard.pool.connect();
    try {
      client = await withDeadline(connecting, guard.options.timeout,
        () => connecting.then((c) => c.release(), () => {}), 'connect');
    } catch (err) {
      return {
        outcome: Outcome.UNAVAILABLE, response: null, token: null, error: err, failedStep: 'begin', released: false,
        superseded: false, extends: 0, leaseUntil: null, expiresAt: null, notStored: false, status: null,
      };
    }
    let broken = false;
    const result = {
      outcome: Outcome.UNAVAILABLE, response: null, token: null, error: null, failedStep: null, released: false,
      superseded: false, extends: 0, leaseUntil: null, expiresAt: null, notStored: false, status: null,
    };
    try {
      return { ...result, ...await transaction(client, key, fp, (claim) => runCaptured(req, res, next, claim, capture, ctx), o) };
    } catch (err) {
      broken = err instanceof UnavailableError && !(err instanceof TimeoutError);
      if (!(err instanceof IdemError)) throw err; // the policy's ResponseNotStored, or a bug
      result.error = err;
      // A retry that waited lockTimeout (waitFor) for the first request's transaction.
      if (!capture.finish && err instanceof TimeoutError && err.code === '55P03') return { ...result, outcome: Outcome.IN_FLIGHT };
      // Not claimed, or rolled back with the handler's writes: nothing was done.
      return { ...result, failedStep: capture.finish ? 'complete' : 'begin' };
    } finally {
      client.release(broken ? true : undefined);
    }
  }

  // The route's window in seconds: the guard's retention, else the
  // server's idem.default_retention, asked once (null until known).
  let windowSeconds = null;
  async function routeWindow() {
    if (windowSeconds !== null) return windowSeconds;
    const r = guard.options.retention;
    if (typeof r === 'number') {
      windowSeconds = r / 1000;
      return windowSeconds;
    }
    let client;
    try {
      client = await guard.pool.connect();
      const { rows } = r == null
        ? await client.query("SELECT setting::int8::text AS s FROM pg_catalog.pg_settings WHERE name = 'idem.default_retention'")
        : await client.query('SELECT extract(epoch FROM $1::interval)::text AS s', [r]);
      if (rows.length === 0 || rows[0].s == null) {
        warn('idem: the server has no idem.default_retention: is idem in shared_preload_libraries?');
        return null;
      }
      windowSeconds = Number(rows[0].s);
      return windowSeconds;
    } catch (err) {
      warn(`idem: the window (the retention) could not be read: ${err && err.message}`);
      return null;
    } finally {
      if (client) client.release();
    }
  }

  // An unavailable store is logged once, with its cause, when requests
  // start failing on it, not for every request answered 503 meanwhile;
  // once a request reaches it again, the next failure is logged again.
  let storeDown = false;
  function storeState(result) {
    if (result.outcome !== Outcome.UNAVAILABLE) {
      storeDown = false;
      return;
    }
    if (storeDown || refusedKey(result.error) !== null) return;
    storeDown = true;
    const err = result.error;
    const cause = err ? `${err.code ? `${err.code}: ` : ''}${err.message}` : 'no cause given';
    warn(`idem: idempotency store unavailable (${cause}); requests with a key are answered 503` +
      ' until it answers again, which is not logged for each one');
  }

  /** Warnings of the hooks: the guard's logger, else console. */
  function warn(message) {
    const logger = guardOptions.logger || guard.options.logger;
    if (logger) logger.warn(message);
    else console.warn(message);
  }

  async function handle(req, res, next) {
    const rawKey = req.headers[headerName];
    const rawId = req.headers['repeatability-request-id'];
    const rawFirst = req.headers['repeatability-first-sent'];
    const oasis = rawId !== undefined || rawFirst !== undefined;
    let key;
    if (oasis) { // OASIS Repeatable Requests: doc/http.md
      res.setHeader('Repeatability-Result', 'rejected');
      if (rawKey !== undefined) {
        return problem(res, 400, 'two idempotency keys', `${header} and Repeatability-Request-ID in one request: send one`);
      }
      if (rawId === undefined || rawFirst === undefined) {
        return problem(res, 400, 'incomplete repeatable request', 'Repeatability-Request-ID and Repeatability-First-Sent go together: both are required');
      }
      key = parseRequestId(rawId, maxKeyLength);
      if (key === null) {
        return problem(res, 400, 'invalid Repeatability-Request-ID', `the Repeatability-Request-ID header must be 1 to ${maxKeyLength} printable ASCII characters`);
      }
      const first = parseHttpDate(rawFirst);
      if (first === null) {
        return problem(res, 400, 'invalid Repeatability-First-Sent', 'the Repeatability-First-Sent header must be an IMF-fixdate (like Sun, 06 Nov 1994 08:49:37 GMT)');
      }
      const w = await routeWindow();
      if (w === null) {
        return problem(res, 503, 'idempotency store unavailable', 'the request was not processed; retry later', { 'Retry-After': String(retryAfter) });
      }
      if (Date.now() - first.getTime() > w * 1000) {
        return problem(res, 412, 'repeatable request too old', `the Repeatability-First-Sent time is older than this route's window of ${lifetime(w)} seconds: the request cannot be repeated safely`);
      }
    } else {
      if (rawKey === undefined) {
        if (required) return problem(res, 400, 'Idempotency-Key required', `this request needs the ${header} header`);
        return next();
      }
      key = parseKey(rawKey, maxKeyLength);
      if (key === null) {
        return problem(res, 400, 'invalid Idempotency-Key', `the ${header} header must be an sf-string or a token` +
          ` of 1 to ${maxKeyLength} printable ASCII characters`);
      }
    }

    let who = null;
    if (principal) {
      try {
        who = await principal(req);
      } catch (err) {
        warn(`idem: the principal hook failed for key ${JSON.stringify(key)}; nothing claimed: ${err && err.message}`);
        return problem(res, 500, 'caller unknown', 'the caller\'s identity could not be established');
      }
      if (typeof who !== 'string') {
        warn(`idem: the principal hook returned ${who === null ? 'null' : typeof who} for key ${JSON.stringify(key)}, not a string; nothing claimed`);
        return problem(res, 500, 'caller unknown', 'the caller\'s identity could not be established');
      }
    }

    let body;
    try {
      body = await requestBody(req, limit);
    } catch (err) {
      if (err.status === 413) return problem(res, 413, 'request too large', err.message);
      throw err;
    }
    const fp = await fingerprint(req, body);
    const tenant = await scope(req);
    if (typeof fp !== 'string' || typeof tenant !== 'string') throw new TypeError('fingerprint and scope must return strings');
    const sc = principal ? callerScope(tenant, who, maxKeyLength) : tenant;

    const capture = {};
    const ctx = {
      key, scope: sc, storedHeaders: stored, storeStatus, oasis, guard: transactional ? null : guard, overrides,
    };
    let result;
    if (transactional) {
      try {
        result = await inTransaction(req, res, next, key, fp, sc, capture, ctx);
      } catch (err) {
        // The policy released the answer (rolled back with the handler's writes): send it as is.
        if (err instanceof ResponseNotStored && capture.finish) return capture.finish();
        throw err;
      }
    } else {
      result = await guard.do(key, fp, (claim) => runCaptured(req, res, next, claim, capture, ctx), { ...overrides, scope: sc });
    }
    if (onResult) onResult(result, req);
    storeState(result);

    switch (result.outcome) {
      case Outcome.REPLAYED: {
        if (authorize) {
          let allowed;
          try {
            allowed = await authorize(req, res);
          } catch (err) {
            warn(`idem: the authorize hook failed for key ${JSON.stringify(key)}; the stored response is not sent: ${err && err.message}`);
            if (res.headersSent) return res.destroy();
            return problem(res, 500, 'replay not authorized', 'the caller\'s access to the stored response could not be checked');
          }
          if (res.headersSent || res.writableEnded) return undefined; // the hook answered itself
          if (allowed !== true) {
            return problem(res, 403, 'replay not authorized', 'the stored response to this request is not available to this caller');
          }
        }
        const { headers, body: replayBody } = decodeEnvelope(result.response.body);
        res.status(result.response.status);
        const byName = new Map();
        for (const [k, v] of headers) byName.set(k, [...(byName.get(k) || []), v]);
        for (const [k, v] of byName) res.setHeader(k, v.length === 1 ? v[0] : v);
        res.setHeader(replayHeader, 'true');
        if (oasis) res.setHeader('Repeatability-Result', 'accepted');
        setExpires(res, result.expiresAt);
        return res.end(replayBody);
      }
      case Outcome.IN_FLIGHT:
        return problem(res, 409, 'request in flight', 'a request with this key is being processed; retry later',
          { 'Retry-After': String(retryAfterSeconds(result, retryAfter)) });
      case Outcome.CONFLICT:
        return problem(res, 422, 'Idempotency-Key reused', 'this key was used with a different request');
      case Outcome.EXPIRED:
        return problem(res, 410, 'response expired', 'a request with this key was processed and completed;' +
          ' its response is no longer kept, and the request is not run again');
      case Outcome.UNAVAILABLE: {
        // The server refused the key or the scope (longer than its
        // idem.max_key_length): a malformed key, which no retry mends.
        const refused = result.failedStep === 'begin' && !capture.started ? refusedKey(result.error) : null;
        if (refused !== null && refused.startsWith('scope')) {
          return problem(res, 400, 'idempotency scope refused', `the idempotency store refuses this request's scope (${refused}):` +
            ' a scope is at most the server\'s idem.max_key_length bytes');
        }
        if (refused !== null) {
          return problem(res, 400, 'invalid Idempotency-Key', `the idempotency store refuses the ${header} header's key (${refused}):` +
            ' a key is at most the server\'s idem.max_key_length bytes');
        }
        // Transactional mode: also after the handler ran, since its writes were rolled back with the claim.
        if (res.headersSent) return res.destroy(); // the handler's answer, partly sent, did not happen
        return problem(res, 503, 'idempotency store unavailable', 'the request was not processed; retry later',
          { 'Retry-After': String(retryAfter) });
      }
      default: // executed: send what the handler answered (stored, or released)
        if (capture.finish) {
          if (!result.failedStep || result.notStored) setExpires(res, result.expiresAt);
          return capture.finish();
        }
        throw result.error || new Error('the handler did not respond');
    }
  }

  /** Every response of the route: Idempotency-Key-Lifetime when advertised. */
  async function route(req, res, next) {
    if (advertiseWindow) {
      const w = await routeWindow();
      if (w !== null) res.setHeader('Idempotency-Key-Lifetime', lifetime(w));
    }
    if (!methodSet.has(req.method)) return next();
    return handle(req, res, next);
  }

  return function idempotencyMiddleware(req, res, next) {
    if (!advertiseWindow && !methodSet.has(req.method)) return next();
    route(req, res, next).catch(next);
  };
}

module.exports = {
  idempotency,
  saveRawBody,
  defaultFingerprint,
  encodeEnvelope,
  decodeEnvelope,
  parseKey,
  parseHttpDate,
  parseRequestId,
  retryAfterSeconds,
  defaultStoreStatus,
  callerScope,
  NOT_STORED_STATUSES,
  DEFAULT_WAIT_FOR_MS,
  NOT_STORED_ENVELOPE,
};
