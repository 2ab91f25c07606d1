'use strict';

const { IdemError, toIdemError } = require('./errors');
const { statementName } = require('./pipeline');

/** A SQL identifier, double-quoted. */
function quoteIdent(name) {
  if (typeof name !== 'string' || name === '') throw new TypeError('schema must be a non-empty string');
  return '"' + name.replace(/"/g, '""') + '"';
}

/**
 * An interval parameter: a number is milliseconds, a string is passed to
 * PostgreSQL's interval input ('30s', '5 minutes'), null/undefined is NULL
 * (the server's default).
 */
function intervalParam(value, name) {
  if (value == null) return null;
  if (typeof value === 'number') {
    if (!Number.isFinite(value) || value <= 0) throw new TypeError(`${name} must be a positive number of milliseconds`);
    return `${Math.round(value)} milliseconds`;
  }
  if (typeof value === 'string' && value !== '') return value;
  throw new TypeError(`${name} must be milliseconds (number) or an interval string`);
}

/** A response body as a Buffer (sent to bytea in binary, never as text). */
function toBuffer(body) {
  if (body == null) return null;
  if (Buffer.isBuffer(body)) return body;
  if (ArrayBuffer.isView(body)) return Buffer.from(body.buffer, body.byteOffset, body.byteLength);
  if (body instanceof ArrayBuffer) return Buffer.from(body);
  if (typeof body === 'string') return Buffer.from(body, 'utf8');
  throw new TypeError('body must be a Buffer, a Uint8Array or a string');
}

/**
 * A timestamptz expression as whole milliseconds since the epoch (int8):
 * the server's text form of a timestamp follows the session's DateStyle
 * and TimeZone, which node-pg's parser reads only in the ISO style.
 */
function epochMs(expr) {
  return `(pg_catalog.date_part('epoch', ${expr}) OPERATOR(pg_catalog.*) 1000::pg_catalog.float8)::pg_catalog.int8`;
}

/** A Date from epochMs's column (a string, or a bigint with a custom parser), or null. */
function msDate(value) {
  return value == null ? null : new Date(Number(value));
}

/** A token parameter (int8 as text), or null. */
function tokenParam(token) {
  if (token == null) return null;
  if (typeof token === 'bigint') return token.toString();
  if (typeof token === 'number' && Number.isSafeInteger(token)) return String(token);
  if (typeof token === 'string' && /^-?\d+$/.test(token)) return token;
  throw new TypeError('token must be a bigint');
}

function checkText(value, name) {
  if (typeof value !== 'string') throw new TypeError(`${name} must be a string`);
  return value;
}

function checkStatus(status) {
  if (!Number.isInteger(status)) throw new TypeError('status must be an integer');
  return status;
}

/**
 * The idem functions as single statements on a node-pg client,
 * schema-qualified, every parameter cast to its exact type.  Errors are
 * thrown as idem error classes.  No transaction control here.
 */
/** The types of idem_begin's arguments, in order. */
const BEGIN_TYPES = ['text', 'text', 'interval', 'interval', 'text', 'boolean', 'interval'];

class Store {
  constructor(options = {}) {
    const s = quoteIdent(options.schema ?? 'public');
    const beginTimes = `b.*, ${epochMs('b.lease_until')} AS lease_until_ms, ${epochMs('b.expires_at')} AS expires_at_ms`;
    this.schema = options.schema ?? 'public';
    // Named prepared statements (parsed once per connection), unless false:
    // behind pgbouncer in transaction pooling, where a connection's
    // statements are not the client's.
    this.prepare = options.prepare !== false;
    // idem_begin with its arguments (parameters or literals), each cast to
    // its type.
    // With remember (a server with tombstones), the last of args is its
    // value, passed by name: only then, so that a server without it keeps
    // answering every call that does not use it.
    this._beginSql = (args, remember = false) => `SELECT ${beginTimes} FROM ${s}.idem_begin(` +
      (remember ? args.slice(0, -1) : args).map((a, i) => `${a}::${BEGIN_TYPES[i]}`).join(', ') +
      (remember ? `, remember => ${args[args.length - 1]}::interval` : '') + ') b';
    this.sql = {
      // Every column, read by name: phase and phase_data (a takeover's recovery
      // point) where the server has them, the rest from any idem_begin; the
      // times as epochMs.
      begin: this._beginSql(['$1', '$2', '$3', '$4', '$5', '$6']),
      // The form with wait_for, used only when a wait is asked for, so that a database
      // whose idem_begin has no wait_for keeps working with the six-argument form.
      beginWait: this._beginSql(['$1', '$2', '$3', '$4', '$5', '$6', '$7']),
      checkpoint: `SELECT true AS ok FROM ${s}.idem_checkpoint($1::text, $2::bigint, $3::text, $4::bytea, $5::text)`,
      hold: `SELECT true AS ok FROM ${s}.idem_hold($1::text, $2::bigint, $3::text)`,
      complete: `SELECT ${epochMs(`${s}.idem_complete($1::text, $2::text, $3::integer, $4::bytea, $5::bigint,` +
        ' $6::interval, $7::text)')} AS expires_at_ms`,
      release: `SELECT ${s}.idem_release($1::text, $2::bigint, $3::text) AS released`,
      extend: `SELECT ${epochMs(`${s}.idem_extend($1::text, $2::bigint, $3::interval, $4::text)`)} AS lease_until_ms`,
      // The batch functions (idem 1.7): every argument, positional.
      beginMany: `SELECT ${beginTimes} FROM ${s}.idem_begin_many($1::text[], $2::text[], $3::interval, $4::interval,` +
        ' $5::text, $6::boolean, $7::interval, $8::interval, $9::text) b ORDER BY b.ordinality',
      completeMany: `SELECT c.ordinality, ${epochMs('c.expires_at')} AS expires_at_ms FROM ${s}.idem_complete_many(` +
        '$1::text[], $2::text[], $3::integer[], $4::bytea[], $5::bigint[], $6::interval, $7::text) c ORDER BY c.ordinality',
      lookup: `SELECT state, token, status, ${epochMs('lease_until')} AS lease_until_ms,` +
        ` ${epochMs('expires_at')} AS expires_at_ms, body_size FROM ${s}.idem_lookup($1::text, $2::text)`,
    };
  }

  async _query(client, text, values) {
    try {
      return await client.query(this.prepare ? { name: statementName(text), text, values } : { text, values });
    } catch (err) {
      if (err && (err.code === '42883' || err.code === '3F000')) throw this._notFound(text, values.length, err);
      throw toIdemError(err);
    }
  }

  /**
   * The error of a call whose function or schema the server did not find
   * (42883, 3F000): which function, in which schema, and what fixes it:
   * the schema option, or an update of an old version.
   */
  _notFound(text, nargs, err) {
    const fn = /\.(idem_[a-z_]+)\(/.exec(text)[1];
    return new IdemError(`idem: ${fn} not found in schema ${quoteIdent(this.schema)} (${err.code}: ${err.message});` +
      ' set the schema: option to the schema where CREATE EXTENSION idem put it,' +
      ' or if the version is old run ALTER EXTENSION idem UPDATE', { code: err.code, cause: err });
  }

  /**
   * idem_begin: claim the key, or learn it is done, in flight or a
   * conflict.  waitFor (ms, > 0) makes a duplicate of a committed claim
   * wait in the server, up to that long, for the holder's answer.
   */
  async begin(client, args) {
    const { text, values } = this._beginCall(args);
    const res = await this._query(client, text, values);
    return Store.beginRow(res.rows[0]);
  }

  _beginCall({ key, fingerprint, lease = null, retention = null, scope = '', wait = true, waitFor = 0, remember = null }) {
    const values = [checkText(key, 'key'), checkText(fingerprint, 'fingerprint'),
      intervalParam(lease, 'lease'), intervalParam(retention, 'retention'),
      checkText(scope, 'scope'), Boolean(wait)];
    if (waitFor != null && waitFor !== 0) values.push(intervalParam(waitFor, 'waitFor'));
    const r = intervalParam(remember, 'remember');
    if (r == null) return { text: values.length === 7 ? this.sql.beginWait : this.sql.begin, values, remember: false };
    values.push(r);
    return { text: this._beginSql(values.map((v, i) => `$${i + 1}`), true), values, remember: true };
  }

  /**
   * begin()'s statement for a pipeline (lib/pipeline.js): { text, values,
   * prepare, call, nargs }.  Results: beginRow() of its row; errors:
   * beginError().
   */
  beginStatement(args) {
    const { text, values } = this._beginCall(args);
    return { text, values, prepare: this.prepare, call: text, nargs: values.length };
  }

  /** The error of a beginStatement() statement in a pipeline, as _query() throws it. */
  beginError(err, { call, nargs }) {
    if (err && (err.code === '42883' || err.code === '3F000')) return this._notFound(call, nargs, err);
    return toIdemError(err);
  }

  /** begin()'s answer from the row of its statement. */
  static beginRow(row) {
    return {
      claimed: row.claimed,
      state: row.state,
      token: row.token == null ? null : BigInt(row.token),
      status: row.status,
      body: row.body,
      leaseUntil: msDate(row.lease_until_ms),
      expiresAt: msDate(row.expires_at_ms),
      // The recovery point a takeover returns (idem 1.4 with checkpoints): null otherwise.
      phase: row.claimed && row.phase != null && row.phase !== '' ? row.phase : null,
      phaseData: row.claimed && row.phase != null && row.phase !== '' ? (row.phase_data ?? null) : null,
    };
  }

  /**
   * idem_begin_many: claim many keys of one scope in one statement; one
   * answer per item, in input order: beginRow()'s fields with index (from
   * 0) and duplicateOf (the index of the key's first occurrence for a
   * DUPLICATE, or a CONFLICT within the batch; null otherwise).
   */
  async beginMany(client, {
    keys, fingerprints, lease = null, retention = null, scope = '', wait = true, waitFor = 0, remember = null, holder = null,
  }) {
    if (!Array.isArray(keys) || !Array.isArray(fingerprints)) throw new TypeError('keys and fingerprints must be arrays');
    keys.forEach((k, i) => checkText(k, `keys[${i}]`));
    fingerprints.forEach((f, i) => checkText(f, `fingerprints[${i}]`));
    const values = [keys, fingerprints, intervalParam(lease, 'lease'), intervalParam(retention, 'retention'),
      checkText(scope, 'scope'), Boolean(wait), waitFor ? intervalParam(waitFor, 'waitFor') : null,
      intervalParam(remember, 'remember'), holder == null ? null : checkText(holder, 'holder')];
    const res = await this._query(client, this.sql.beginMany, values);
    return res.rows.map((row) => ({
      ...Store.beginRow(row),
      index: row.ordinality - 1,
      duplicateOf: row.duplicate_of == null ? null : row.duplicate_of - 1,
    }));
  }

  /**
   * idem_complete_many: store one response per item ({ key, fingerprint,
   * status, body, token }), in one statement; returns each item's new
   * expires_at, in input order.
   */
  async completeMany(client, { items, retention = null, scope = '' }) {
    const keys = items.map((it, i) => checkText(it.key, `items[${i}].key`));
    const fps = items.map((it, i) => checkText(it.fingerprint, `items[${i}].fingerprint`));
    const statuses = items.map((it) => checkStatus(it.status));
    const bodies = items.map((it) => toBuffer(it.body ?? null));
    const tokens = items.map((it) => tokenParam(it.token ?? null));
    const res = await this._query(client, this.sql.completeMany,
      [keys, fps, statuses, bodies, tokens, intervalParam(retention, 'retention'), checkText(scope, 'scope')]);
    return res.rows.map((r) => msDate(r.expires_at_ms));
  }

  /**
   * idem_checkpoint: store phase and data as the recovery point of the
   * claim held with token (fenced like idem_complete).
   */
  async checkpoint(client, { key, token = null, phase, data = null, scope = '' }) {
    const values = [checkText(key, 'key'), tokenParam(token), checkText(phase, 'phase'), toBuffer(data),
      checkText(scope, 'scope')];
    await this._query(client, this.sql.checkpoint, values);
  }

  /**
   * idem_hold: inside the caller's transaction, check that token holds the
   * key and keep a takeover waiting until the transaction ends.
   */
  async hold(client, { key, token = null, scope = '' }) {
    const values = [checkText(key, 'key'), tokenParam(token), checkText(scope, 'scope')];
    await this._query(client, this.sql.hold, values);
  }

  /** idem_complete: store the response; returns the new expires_at. */
  async complete(client, { key, fingerprint, status, body = null, token = null, retention = null, scope = '' }) {
    const values = [checkText(key, 'key'), checkText(fingerprint, 'fingerprint'), checkStatus(status),
      toBuffer(body), tokenParam(token), intervalParam(retention, 'retention'), checkText(scope, 'scope')];
    const res = await this._query(client, this.sql.complete, values);
    return msDate(res.rows[0].expires_at_ms);
  }

  /** idem_release: give the claim up; true if the key is free now. */
  async release(client, { key, token = null, scope = '' }) {
    const values = [checkText(key, 'key'), tokenParam(token), checkText(scope, 'scope')];
    const res = await this._query(client, this.sql.release, values);
    return res.rows[0].released;
  }

  /** idem_extend: move the lease to now + lease; returns the new lease_until. */
  async extend(client, { key, token = null, lease, scope = '' }) {
    const values = [checkText(key, 'key'), tokenParam(token), intervalParam(lease, 'lease'), checkText(scope, 'scope')];
    const res = await this._query(client, this.sql.extend, values);
    return msDate(res.rows[0].lease_until_ms);
  }

  /** idem_lookup (operators): the stored row without its body, or null. */
  async lookup(client, { key, scope = '' }) {
    const res = await this._query(client, this.sql.lookup, [checkText(key, 'key'), checkText(scope, 'scope')]);
    if (res.rows.length === 0) return null;
    const r = res.rows[0];
    return {
      state: r.state,
      token: r.token == null ? null : BigInt(r.token),
      status: r.status,
      leaseUntil: msDate(r.lease_until_ms),
      expiresAt: msDate(r.expires_at_ms),
      bodySize: r.body_size,
    };
  }
}

module.exports = { Store, quoteIdent, intervalParam, toBuffer, tokenParam };
