'use strict';

const { toBuffer } = require('./store');

/** What happened to a request, as in the reference guard. */
const Outcome = Object.freeze({
  EXECUTED: 'executed', // the handler ran under a claim
  REPLAYED: 'replayed', // the stored response was returned
  IN_FLIGHT: 'in_flight', // another caller holds a live claim
  CONFLICT: 'conflict', // the key was used with another fingerprint
  UNAVAILABLE: 'unavailable', // no claim could be made: the handler did not run
});

/** A handler's response as stored: { status, body } with the body as a Buffer or null. */
function normalizeResponse(value) {
  if (value == null || typeof value !== 'object' || !Number.isInteger(value.status)) {
    throw new TypeError('the handler must return { status: integer, body?: Buffer | string }');
  }
  return { status: value.status, body: toBuffer(value.body ?? null) };
}

module.exports = { Outcome, normalizeResponse };
