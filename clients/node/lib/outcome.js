'use strict';

const { toBuffer } = require('./store');

/** What happened to a request, as in the reference guard. */
const Outcome = Object.freeze({
  EXECUTED: 'executed', // the handler ran under a claim
  REPLAYED: 'replayed', // the stored response was returned
  IN_FLIGHT: 'in_flight', // another caller holds a live claim
  CONFLICT: 'conflict', // the key was used with another fingerprint
  UNAVAILABLE: 'unavailable', // no claim could be made: the handler did not run
  EXPIRED: 'expired', // executed and completed once; its response is no longer kept (a server with tombstones)
});

/** A handler's response as stored: { status, body } with the body as a Buffer or null. */
function normalizeResponse(value) {
  if (value == null || typeof value !== 'object' || !Number.isInteger(value.status)) {
    throw new TypeError('the handler must return { status: integer, body?: Buffer | string }');
  }
  return { status: value.status, body: toBuffer(value.body ?? null) };
}

/**
 * The body stored instead of a response idem_complete refused for good
 * (doc/http.md, "A response that cannot be stored"), as the server stores
 * it for a body larger than idem.max_body_size.
 */
const NOT_STORED_BODY = '{"type":"about:blank","title":"Response not stored","status":500,' +
  '"detail":"The response to the first request with this key was larger than idem.max_body_size;' +
  ' it was sent then and is not replayed."}';

/** The fixed answer a guard stores when idem_complete refuses a response: 500, problem+json. */
const NOT_STORED = Object.freeze({ status: 500, body: Buffer.from(NOT_STORED_BODY) });

module.exports = { Outcome, normalizeResponse, NOT_STORED, NOT_STORED_BODY };
