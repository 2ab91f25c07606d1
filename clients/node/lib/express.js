'use strict';

const crypto = require('node:crypto');
const { Guard, Outcome } = require('./guard');
const { normalizeOptions } = require('./options');

/*
 * Express middleware for the Idempotency-Key header
 * (draft-ietf-httpapi-idempotency-key-header) over a Guard.
 *
 * Stored per key: the response's status, the headers listed in
 * storedHeaders and the body, in one bytea (an envelope: a marker line,
 * the headers as JSON, then the body bytes).
 */

const ENVELOPE = Buffer.from('IDEMHTTP1\n');

const DEFAULT_STORED_HEADERS = ['content-type', 'content-language', 'content-encoding', 'location', 'etag', 'cache-control'];

/** How long a concurrent retry waits for the first request's answer by default (ms). */
const DEFAULT_WAIT_FOR_MS = 5000;

/**
 * Retry-After of a 409: the seconds until the holder's lease ends (at least
 * 1) after the retry waited for it; otherwise, or without a lease from the
 * server, the fixed retryAfter.
 */
function retryAfterSeconds(result, waitFor, retryAfter) {
  const until = result.leaseUntil;
  if (!(waitFor > 0) || !(until instanceof Date) || Number.isNaN(until.getTime())) return retryAfter;
  return Math.max(1, Math.ceil((until.getTime() - Date.now()) / 1000));
}

function encodeEnvelope(headers, body) {
  return Buffer.concat([ENVELOPE, Buffer.from(JSON.stringify(headers) + '\n'), body]);
}

function decodeEnvelope(stored) {
  const buf = stored || Buffer.alloc(0);
  if (buf.length >= ENVELOPE.length && buf.subarray(0, ENVELOPE.length).equals(ENVELOPE)) {
    const nl = buf.indexOf(0x0a, ENVELOPE.length);
    if (nl > 0) {
      try {
        const headers = JSON.parse(buf.subarray(ENVELOPE.length, nl).toString('utf8'));
        return { headers, body: buf.subarray(nl + 1) };
      } catch {
        // not an envelope after all
      }
    }
  }
  return { headers: {}, body: buf };
}

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

/** The key from the header: an sf-string ("...") or a bare token; null if unusable. */
function parseKey(value, maxLength) {
  if (Array.isArray(value)) value = value.join(',');
  let key = String(value).trim();
  if (key.length >= 2 && key.startsWith('"') && key.endsWith('"')) key = key.slice(1, -1);
  if (key === '' || Buffer.byteLength(key, 'utf8') > maxLength) return null;
  return key;
}

function problem(res, status, title, detail, headers = {}) {
  res.status(status);
  for (const [k, v] of Object.entries(headers)) res.setHeader(k, v);
  res.setHeader('Content-Type', 'application/problem+json');
  res.end(JSON.stringify({ type: 'about:blank', title, status, detail }));
}

class ResponseNotStored extends Error {
  constructor(status) {
    super(`the handler answered ${status}: released for a retry`);
    this.name = 'ResponseNotStored';
    this.status = status;
  }
}

/**
 * Run the rest of the chain under the claim and capture the response.
 * Writes go out as they come; the final end() is held until the guard has
 * stored the response, so a client that has the answer finds it stored.
 */
function runCaptured(req, res, next, claim, capture, ctx) {
  return new Promise((resolve) => {
    req.idempotency = { key: ctx.key, scope: ctx.scope, token: claim.token, signal: claim.signal, replayed: false };
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
      const headers = {};
      for (const name of ctx.storedHeaders) {
        const v = res.getHeader(name);
        if (v !== undefined) headers[name] = Array.isArray(v) ? v : String(v);
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
    if (capture.status >= 500 && !ctx.storeServerErrors) throw new ResponseNotStored(capture.status);
    return { status: capture.status, body: encodeEnvelope(capture.headers, capture.body) };
  });
}

/**
 * idempotency(poolOrGuard, options): Express middleware.
 *
 * options: header ('Idempotency-Key'), methods (['POST', 'PATCH']),
 * required (false: requests without the header pass through; true: 400),
 * fingerprint(req, body) (method, URL and body), scope(req) (''),
 * storeServerErrors (false: a 5xx or a thrown error releases the key),
 * storedHeaders, replayHeader ('Idempotent-Replayed'), retryAfter (1 s),
 * maxKeyLength (255), limit (1 MiB, for bodies read here), onResult(result,
 * req), waitFor (5000 ms; 0 when wait is false), and any Guard option
 * (lease, retention, timeout, wait, ...) when a pool is given.
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
    storeServerErrors = false,
    storedHeaders = DEFAULT_STORED_HEADERS,
    replayHeader = 'Idempotent-Replayed',
    retryAfter = 1,
    maxKeyLength = 255,
    limit = 1024 * 1024,
    onResult = null,
    waitFor: waitForOption,
    ...guardOptions
  } = options;
  const guard = poolOrGuard instanceof Guard ? poolOrGuard : new Guard(poolOrGuard, guardOptions);
  const waitFor = normalizeOptions({
    ...guard.options,
    waitFor: waitForOption !== undefined ? waitForOption : (guard.options.wait === false ? 0 : DEFAULT_WAIT_FOR_MS),
  }).waitFor;
  const methodSet = new Set(methods.map((m) => m.toUpperCase()));
  const headerName = header.toLowerCase();
  const stored = storedHeaders.map((h) => h.toLowerCase());

  async function handle(req, res, next) {
    const rawKey = req.headers[headerName];
    if (rawKey === undefined) {
      if (required) return problem(res, 400, 'Idempotency-Key required', `this request needs the ${header} header`);
      return next();
    }
    const key = parseKey(rawKey, maxKeyLength);
    if (key === null) return problem(res, 400, 'invalid Idempotency-Key', `the ${header} header must be 1 to ${maxKeyLength} bytes`);

    let body;
    try {
      body = await requestBody(req, limit);
    } catch (err) {
      if (err.status === 413) return problem(res, 413, 'request too large', err.message);
      throw err;
    }
    const fp = await fingerprint(req, body);
    const sc = await scope(req);
    if (typeof fp !== 'string' || typeof sc !== 'string') throw new TypeError('fingerprint and scope must return strings');

    const capture = {};
    const ctx = { key, scope: sc, storedHeaders: stored, storeServerErrors };
    const result = await guard.do(key, fp, (claim) => runCaptured(req, res, next, claim, capture, ctx), { scope: sc, waitFor });
    if (onResult) onResult(result, req);

    switch (result.outcome) {
      case Outcome.REPLAYED: {
        const { headers, body: replayBody } = decodeEnvelope(result.response.body);
        res.status(result.response.status);
        for (const [k, v] of Object.entries(headers)) res.setHeader(k, v);
        res.setHeader(replayHeader, 'true');
        return res.end(replayBody);
      }
      case Outcome.IN_FLIGHT:
        return problem(res, 409, 'request in flight', 'a request with this key is being processed; retry later',
          { 'Retry-After': String(retryAfterSeconds(result, waitFor, retryAfter)) });
      case Outcome.CONFLICT:
        return problem(res, 422, 'Idempotency-Key reused', 'this key was used with a different request');
      case Outcome.UNAVAILABLE:
        return problem(res, 503, 'idempotency store unavailable', 'the request was not processed; retry later',
          { 'Retry-After': String(retryAfter) });
      default: // executed: send what the handler answered (stored, or released)
        if (capture.finish) return capture.finish();
        throw result.error || new Error('the handler did not respond');
    }
  }

  return function idempotencyMiddleware(req, res, next) {
    if (!methodSet.has(req.method)) return next();
    handle(req, res, next).catch(next);
  };
}

module.exports = {
  idempotency, saveRawBody, defaultFingerprint, encodeEnvelope, decodeEnvelope, parseKey, retryAfterSeconds, DEFAULT_WAIT_FOR_MS,
};
