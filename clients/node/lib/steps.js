'use strict';

/**
 * Multi-step work: a guard's handler splits its work into named steps
 * (claim.step, claim.stepTx).  Each finished step is checkpointed on the
 * claim (idem_checkpoint); when the handler's process stops and a retry
 * takes the key over after the lease, the steps that finished are skipped
 * and return the outputs they had, and the rest run.
 *
 * The recovery point is idem's phase and phase_data: phase is the name of
 * the step that finished last, phase_data a JSON object (UTF-8) whose
 * members are the finished steps with their outputs:
 *
 *   {"reserve":{"hold":"h-1"},"charge":{"id":"ch_1"}}
 *
 * Every checkpoint carries the whole object, so each skipped step returns
 * its own output.  The Go and Python clients write and read the same
 * format.
 */

const { IdemError } = require('./errors');

/** The key's recovery point was not written by steps: which work finished cannot be told. */
class CheckpointDataError extends IdemError {}

/**
 * The key for a step's call to a system outside the database (a payment
 * provider's Idempotency-Key): scope (when not empty), key and step name,
 * joined by ":".  The same in every attempt on the key: a holder that stops
 * after the provider charged but before the checkpoint is followed by one
 * that runs the step again with the same provider key, and the provider
 * answers with the first charge.  A key made of the fencing token would
 * change with the takeover and charge twice.
 */
function stepIdempotencyKey(scope, key, name) {
  return scope ? `${scope}:${key}:${name}` : `${key}:${name}`;
}

/** The outputs of a recovery point's data, in order: Map name -> JSON text. */
function decodeSteps(phase, data, key) {
  const fail = (why) => new CheckpointDataError(
    `idem: the recovery point of key ${JSON.stringify(key)} (phase ${JSON.stringify(phase)}) was not written by steps: ${why}`);
  if (data == null) throw fail('it has no data');
  let obj;
  try {
    obj = JSON.parse(Buffer.from(data).toString('utf8'));
  } catch (err) {
    throw fail(err.message);
  }
  if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) throw fail('its data is not a JSON object');
  if (!Object.prototype.hasOwnProperty.call(obj, phase)) throw fail('its data has no member for its phase');
  const outputs = new Map();
  for (const [name, out] of Object.entries(obj)) outputs.set(name, JSON.stringify(out));
  return outputs;
}

/** A step's output as JSON text: undefined is null; what JSON cannot carry throws. */
function encodeOutput(name, out) {
  let text;
  try {
    text = JSON.stringify(out === undefined ? null : out);
  } catch (err) {
    throw new TypeError(`the output of step ${JSON.stringify(name)} cannot be stored as JSON: ${err.message}`);
  }
  if (text === undefined) throw new TypeError(`the output of step ${JSON.stringify(name)} cannot be stored as JSON`);
  return text;
}

/**
 * The steps of one claim.  checkpoint(name, data) stores a recovery point
 * in its own transaction; runTx(name, data, fn) runs fn in a transaction
 * that holds the key and checkpoints before committing.
 */
class Steps {
  constructor({ key, scope, token, signal, phase, phaseData, checkpoint, runTx }) {
    this.key = key;
    this.scope = scope;
    this.token = token;
    this.signal = signal;
    this.resumedFrom = phase || null;
    this.outputs = new Map();
    this.dataError = null;
    this._checkpoint = checkpoint;
    this._runTx = runTx;
    if (this.resumedFrom !== null) {
      try {
        this.outputs = decodeSteps(this.resumedFrom, phaseData, key);
      } catch (err) {
        this.dataError = err;
      }
    }
  }

  /** Names of the finished steps (the previous holders' and this claim's). */
  done() {
    return [...this.outputs.keys()];
  }

  /** True when some step finished (a recovery point exists or is being made). */
  get any() {
    return this.outputs.size > 0;
  }

  info(name) {
    return {
      key: this.key,
      scope: this.scope,
      name,
      token: this.token,
      idempotencyKey: stepIdempotencyKey(this.scope, this.key, name),
      signal: this.signal,
    };
  }

  /** The recovery point's data with step name finished with output text. */
  data(name, text) {
    const parts = [];
    let seen = false;
    for (const [n, t] of this.outputs) {
      if (n === name) seen = true;
      parts.push(`${JSON.stringify(n)}:${n === name ? text : t}`);
    }
    if (!seen) parts.push(`${JSON.stringify(name)}:${text}`);
    return Buffer.from(`{${parts.join(',')}}`, 'utf8');
  }

  /** Checks name; returns the stored output (parsed) if the step finished. */
  _start(name) {
    if (typeof name !== 'string' || name === '') throw new TypeError('a step needs a name (a non-empty string)');
    if (this.dataError) throw this.dataError;
    if (this.outputs.has(name)) return { done: true, output: JSON.parse(this.outputs.get(name)) };
    return { done: false };
  }

  async step(name, fn) {
    if (typeof fn !== 'function') throw new TypeError('step needs a function');
    const s = this._start(name);
    if (s.done) return s.output;
    const out = await fn(this.info(name));
    const text = encodeOutput(name, out);
    await this._checkpoint(name, this.data(name, text));
    this.outputs.set(name, text);
    return out;
  }

  async stepTx(name, fn) {
    if (typeof fn !== 'function') throw new TypeError('stepTx needs a function');
    const s = this._start(name);
    if (s.done) return s.output;
    let text;
    const out = await this._runTx(name, async (client) => {
      const o = await fn(client, this.info(name));
      text = encodeOutput(name, o);
      return { output: o, data: this.data(name, text) };
    });
    this.outputs.set(name, text);
    return out;
  }
}

module.exports = { Steps, CheckpointDataError, stepIdempotencyKey, decodeSteps };
