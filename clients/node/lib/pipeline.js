'use strict';

const crypto = require('crypto');
const { toIdemError } = require('./errors');

/**
 * Several statements in one round trip: on a node-pg Client, each
 * statement's Parse (once per connection for a prepared one), Bind,
 * Describe and Execute, then one Sync, written at once.  The server runs
 * them in order; the first that fails makes it skip the rest up to the
 * Sync (an explicit BEGIN among them leaves the transaction aborted, for
 * the caller's ROLLBACK).  Every statement takes parameters, so a value
 * is never written into SQL text and the server plans a prepared
 * statement once, not on every call.
 *
 * pipeline(client, statements): statements are { text, values, prepare }
 * (prepare: a named statement, 'idem_' and a hash of its text, parsed
 * once per connection; node-pg remembers it as it does its own named
 * queries).  Resolves to one node-pg result per statement; rejects with
 * the error of the first statement that failed, its index in
 * err.pipelineIndex.  A client that is not node-pg's Client (pg-native, a
 * wrapper without its connection) gets one query() per statement: the
 * same results, one round trip each.
 */
function canPipeline(client) {
  const con = client == null ? null : client.connection;
  return con != null && typeof con.parse === 'function' && typeof con.bind === 'function' &&
    typeof con.describe === 'function' && typeof con.execute === 'function' && typeof con.sync === 'function' &&
    typeof con.on === 'function' && con.parsedStatements != null && con.submittedNamedStatements != null &&
    client.constructor != null && typeof client.constructor.Query === 'function';
}

const names = new Map();
/** The name of the prepared statement of text. */
function statementName(text) {
  let name = names.get(text);
  if (name === undefined) {
    name = `idem_${crypto.createHash('sha256').update(text).digest('hex').slice(0, 24)}`;
    if (names.size < 1000) names.set(text, name);
  }
  return name;
}

let prepareValue = null;
function valueMapper() {
  if (prepareValue === null) {
    try {
      prepareValue = require('pg/lib/utils').prepareValue;
    } catch {
      prepareValue = (v) => v;
    }
  }
  return prepareValue;
}

/** The submittable node-pg's Client runs as one query (Client#query). */
class Pipeline {
  constructor(client, statements, done) {
    const Query = client.constructor.Query;
    this._done = done;
    this._finished = false;
    this._current = 0;
    this._parses = []; // per Parse sent, in order: the name it prepares, or null
    this._parsed = 0;
    this.queries = statements.map((s) => {
      const q = new Query({ text: s.text, values: s.values || [], name: s.prepare ? statementName(s.text) : undefined });
      if (q._result && !q._result._types && client._types) q._result._types = client._types;
      return q;
    });
  }

  submit(connection) {
    this._connection = connection;
    const map = valueMapper();
    let values;
    try {
      // Every value converted before anything is written: a value that
      // cannot be sent fails the call with nothing sent.
      values = this.queries.map((q) => q.values.map((v) => map(v)));
    } catch (err) {
      return err;
    }
    this._onParse = () => {
      const name = this._parses[this._parsed++];
      if (name) {
        connection.parsedStatements[name] = this.queries.find((q) => q.name === name).text;
        delete connection.submittedNamedStatements[name];
      }
    };
    connection.on('parseComplete', this._onParse);
    if (connection.stream.cork) connection.stream.cork();
    try {
      this.queries.forEach((q, i) => {
        if (!q.name || !q.hasBeenParsed(connection)) {
          connection.parse({ text: q.text, name: q.name, types: [] });
          this._parses.push(q.name || null);
          if (q.name) connection.submittedNamedStatements[q.name] = q.text;
        }
        connection.bind({ portal: '', statement: q.name, values: values[i] });
        connection.describe({ type: 'P', name: '' });
        connection.execute({ portal: '', rows: 0 });
      });
      connection.sync();
    } finally {
      if (connection.stream.uncork) connection.stream.uncork();
    }
    return null;
  }

  _finish(err) {
    if (this._finished) return;
    this._finished = true;
    if (this._connection && this._onParse) {
      this._connection.removeListener('parseComplete', this._onParse);
      // The statements whose Parse the server skipped were not prepared.
      for (const name of this._parses.slice(this._parsed)) {
        if (name) delete this._connection.submittedNamedStatements[name];
      }
    }
    if (err) this._done(err);
    else this._done(null, this.queries.map((q) => q._results));
  }

  handleRowDescription(msg) {
    const q = this.queries[this._current];
    if (q) q.handleRowDescription(msg);
  }

  handleDataRow(msg) {
    const q = this.queries[this._current];
    if (q) q.handleDataRow(msg);
  }

  handleCommandComplete(msg, connection) {
    const q = this.queries[this._current++];
    if (q) q.handleCommandComplete(msg, connection);
  }

  handleEmptyQuery() {
    this._current++;
  }

  handlePortalSuspended() {}

  handleError(err) {
    if (err && typeof err === 'object') err.pipelineIndex = this._current;
    this._finish(err);
  }

  handleReadyForQuery() {
    const bad = this.queries.find((q) => q._canceledDueToError);
    this._finish(bad ? bad._canceledDueToError : null);
  }

  handleCopyInResponse(connection) {
    connection.sendCopyFail('No source stream defined');
  }

  handleCopyData() {}
}

/** See above. */
async function pipeline(client, statements) {
  if (!canPipeline(client)) {
    const out = [];
    for (let i = 0; i < statements.length; i++) {
      const { text, values } = statements[i];
      try {
        out.push(await client.query(values && values.length > 0 ? { text, values } : text));
      } catch (err) {
        if (err && typeof err === 'object') err.pipelineIndex = i;
        throw err;
      }
    }
    return out;
  }
  return new Promise((resolve, reject) => {
    client.query(new Pipeline(client, statements, (err, res) => (err ? reject(err) : resolve(res))));
  });
}

/**
 * One Store call, fn(recorder) (store.begin(recorder, ...) and the like:
 * one query), in one round trip with the statements before and after it.
 * Resolves to { value: fn's answer, results: every statement's result };
 * rejects with fn's own error (mapped as the Store maps it) when its
 * statement failed, else with the error of the statement that failed, as
 * an idem error; either with pipelineIndex, the failed statement's index
 * (before.length: fn's).
 */
async function around(client, before, fn, after, prepare) {
  let call = null;
  const recorder = {
    query: (config) => new Promise((resolve, reject) => {
      if (call) throw new Error('idem: a store call in a pipeline made more than one query');
      call = { text: config.text, values: config.values, resolve, reject };
    }),
  };
  const answer = fn(recorder);
  if (!call) {
    await answer;
    throw new Error('idem: a store call in a pipeline made no query');
  }
  const at = before.length;
  let results;
  try {
    results = await pipeline(client, [...before, { text: call.text, values: call.values, prepare }, ...after]);
  } catch (err) {
    call.reject(err);
    const own = await answer.then(() => err, (e) => e);
    const thrown = err.pipelineIndex === at ? own : toIdemError(err);
    // Which statement failed: at is fn's.
    if (thrown && typeof thrown === 'object') thrown.pipelineIndex = err.pipelineIndex;
    throw thrown;
  }
  call.resolve(results[at]);
  return { value: await answer, results };
}

module.exports = { pipeline, around, canPipeline, statementName };
