// Types for idem-pg: the Node client of the idem PostgreSQL extension.

import type { Pool, PoolClient, ClientBase } from 'pg';
import type { Request, RequestHandler, Response as ExpressResponse } from 'express';

/** A duration: milliseconds, or PostgreSQL interval text such as '30s'. */
export type Duration = number | string;

/** A response body: stored as bytea, sent as bytes (strings as UTF-8). */
export type Body = Buffer | Uint8Array | ArrayBuffer | string | null;

export interface Response {
  status: number;
  body?: Body;
}

/** A stored or executed response, body as bytes. */
export interface StoredResponse {
  status: number;
  body: Buffer | null;
}

export type Op = 'begin' | 'complete' | 'release' | 'extend' | 'checkpoint' | 'hold';

/** Return truthy (or an Error) to make that server call fail as if the server did not answer. */
export type FaultHook = (op: Op) => unknown;

export interface GuardOptions {
  /** Schema the extension is installed in (default 'public'); every call is qualified with it. */
  schema?: string;
  /**
   * Send the idem calls as named prepared statements, parsed once per connection (default true);
   * false behind pgbouncer in transaction pooling, which cannot keep them across transactions.
   */
  prepare?: boolean;
  /** Namespace of the keys (default ''): take it from the authenticated tenant. */
  scope?: string;
  /** Lease of a claim (default: idem.default_lease, 60 s). */
  lease?: Duration | null;
  /** Dedup window (default: idem.default_retention, 1 day). */
  retention?: Duration | null;
  /**
   * idem_begin's remember (a server with tombstones; default null: not sent): how long after
   * its response's retention a completed key is still remembered.  A retry then gets the outcome
   * 'expired' and never runs the handler.  Sent as the named argument only when set.
   */
  remember?: Duration | null;
  /** Wait for an uncommitted claim (default true); false answers in flight at once. */
  wait?: boolean;
  /**
   * Milliseconds a duplicate of a committed, live claim waits in the server for its answer
   * (default 0: in flight at once).  It gets the replay when the holder completes, the claim
   * (a greater token) when the holder releases or its lease ends, and in flight with
   * leaseUntil when the wait runs out.  Needs wait: true and idem_begin's wait_for form;
   * without that form (42883) a guard calls the six-argument one.  The claim's budget is
   * timeout + waitFor.
   */
  waitFor?: number | null;
  /**
   * Per server call, in ms (default 10000; 0: none): statement_timeout and lock_timeout on the
   * server, the link cut 1 s later.  The claim gets timeout + waitFor.
   */
  timeout?: number;
  /** On a handler error leave the claim to its lease instead of releasing it (default false). */
  keepClaimOnError?: boolean;
  /** Extend the lease while the handler runs: true (every lease/3, or 20 s) or a period in ms. */
  heartbeat?: boolean | number;
  /** Seconds added to the server clock (idem.clock_offset; superuser; tests and drills). */
  clockOffset?: number | (() => number);
  /** Fault injection for tests, like the reference store's Fault. */
  fault?: FaultHook | null;
  /** Where a response that was not stored is reported, with its key (default console). */
  logger?: Logger | null;
  /**
   * Stored instead of a response idem_complete refused for a reason a retry cannot fix (any
   * SQLSTATE but a lost connection, a serialization failure, a deadlock, a timeout, class 53,
   * or a key that is not the claim's any more); default NOT_STORED: 500, the problem+json
   * "Response not stored" of doc/http.md.  The middleware stores it in its envelope.
   */
  notStored?: Response | null;
  /**
   * transaction() only: ms its idem_begin waits for another transaction's uncommitted claim of
   * the key before a TimeoutError of code 55P03 (default: the whole budget, timeout + waitFor).
   */
  lockTimeout?: number | null;
  /**
   * transaction() only: run the transaction again, up to this many more times, when it fails
   * with a serialization failure (40001) or a deadlock (40P01), from the handler, the claim,
   * idem_complete or the COMMIT (default 0: once).  Each attempt is a new transaction, the claim
   * included; the wait between two is random, from 0 to 10 ms doubled for each retry, at most
   * 1 s, and no attempt starts later than timeout after the first.  The handler must be safe to
   * run again: its only effects must be its statements on claim.client.  The middleware's
   * transactional mode does not retry.
   */
  retries?: number;
}

export interface Logger {
  warn(message: string): void;
}

export type OutcomeName = 'executed' | 'replayed' | 'in_flight' | 'conflict' | 'unavailable' | 'expired';

export declare const Outcome: Readonly<{
  EXECUTED: 'executed';
  REPLAYED: 'replayed';
  IN_FLIGHT: 'in_flight';
  CONFLICT: 'conflict';
  UNAVAILABLE: 'unavailable';
  /** Executed and completed once; its response is no longer kept (a server with tombstones): never run again. */
  EXPIRED: 'expired';
}>;

/** The claim a handler runs under. */
export interface Claim {
  key: string;
  fingerprint: string;
  scope: string;
  /** Fencing token: pass it downstream; a takeover gets a greater one. */
  token: bigint;
  leaseUntil: Date;
  /** Aborted when the heartbeat finds the claim superseded or gone. */
  signal: AbortSignal;
  readonly lost: boolean;
  /**
   * The step a previous holder of the key finished last, when this claim took the key over
   * after its lease; null for a new claim or a previous holder that finished no step.
   */
  resumedFrom: string | null;
  /**
   * Run one step of the work.  If the step finished already (in this claim, or in a previous
   * holder's before a takeover), fn does not run and its stored output is returned (as
   * JSON.parse gives it back).  Otherwise fn runs; its output (JSON: undefined is null) is
   * checkpointed on the claim (idem_checkpoint, its own transaction) and returned.  fn's error is
   * thrown and nothing is checkpointed.  A superseded claim's checkpoint rejects with
   * TokenSupersededError: stop the handler.  Step names must be unique within a handler; run
   * steps one after another.
   */
  step<T>(name: string, fn: (step: StepInfo) => T | Promise<T>): Promise<T>;
  /**
   * step for writes to PostgreSQL: one transaction on a client of the guard's pool holds the key
   * (idem_hold: a superseded holder gets TokenSupersededError before fn runs), runs fn with the
   * client, checkpoints the step and commits: the writes and the checkpoint commit together.
   */
  stepTx<T>(name: string, fn: (client: PoolClient, step: StepInfo) => T | Promise<T>): Promise<T>;
  /** The finished steps (the previous holders' and this claim's). */
  stepsDone(): string[];
}

/** What a step gets to pass downstream. */
export interface StepInfo {
  key: string;
  scope: string;
  /** The step's name. */
  name: string;
  /** The fencing token of this attempt's claim: a system that keeps the greatest token refuses a stale holder. */
  token: bigint;
  /**
   * Key for the step's call to a system outside the database (a payment provider's
   * Idempotency-Key): scope (if any), key and step name joined by ':'.  The same in every attempt,
   * so a step run again after a takeover is deduplicated there.
   */
  idempotencyKey: string;
  /** The claim's signal (aborted when the heartbeat finds the claim lost). */
  signal: AbortSignal;
}

export interface GuardResult {
  outcome: OutcomeName;
  /** Executed: the handler's response; replayed: the stored one; otherwise null. */
  response: StoredResponse | null;
  /** Token of the claim when executed, else null. */
  token: bigint | null;
  /** What failed, if anything (an idem error, or the handler's own error). */
  error: unknown;
  failedStep: null | 'begin' | 'handler' | 'complete';
  /** The handler failed and the claim was released. */
  released: boolean;
  /** Why the release after a handler error failed, if it did. */
  releaseError?: unknown;
  /** The heartbeat found the token superseded. */
  superseded: boolean;
  /** Successful heartbeats. */
  extends: number;
  /** Executed: the end of the claim's first lease; in flight: the end of the holder's lease (when the server gave it); otherwise null. */
  leaseUntil: Date | null;
  /** Until when the stored response is replayed (executed and stored, or replayed); otherwise null. */
  expiresAt: Date | null;
  /** failedStep 'complete': the fixed notStored answer was stored instead of the response. */
  notStored: boolean;
  /** Expired: the status the first response had (its body is gone); otherwise null. */
  status: number | null;
  /** Why storing the notStored answer failed too, if it did. */
  notStoredError?: unknown;
  /** Executed: the step the claim resumed from after a takeover (claim.resumedFrom), else null. */
  resumedFrom: string | null;
  /**
   * Executed: the finished steps when the handler ended.  A handler error with finished steps
   * leaves the claim to its lease (released false), so that the retry resumes after them.
   */
  steps: string[];
}

export declare class Guard {
  constructor(pool: Pool | { connect(): Promise<PoolClient> }, options?: GuardOptions);
  readonly pool: Pool;
  readonly options: Readonly<Required<GuardOptions>>;
  /** Claim key, then replay, refuse, or run handler and store its response. Never rejects for the store or the handler. */
  do(key: string, fingerprint: string, handler: (claim: Claim) => Response | Promise<Response>, options?: GuardOptions): Promise<GuardResult>;
  /** transaction() with this guard's options. */
  transaction(client: ClientBase, key: string, fingerprint: string,
    handler: (claim: TransactionClaim) => Response | Promise<Response>, options?: GuardOptions): Promise<TransactionResult>;
  /**
   * One idem_begin_many for every item, handler for each item claimed, one idem_complete_many;
   * one result per item in input order. Never rejects for the store or a handler.
   */
  doMany<I extends BatchItem>(items: I[], handler: (claim: BatchClaim, item: I, index: number) => Response | Promise<Response>,
    options?: BatchOptions): Promise<BatchResult[]>;
  /** transactionMany() with this guard's options. */
  transactionMany<I extends BatchItem>(client: ClientBase, items: I[],
    handler: (claim: TransactionBatchClaim, item: I, index: number) => Response | Promise<Response>,
    options?: GuardOptions): Promise<BatchResult[]>;
}

/** An item of a batch: its key and fingerprint (default ''). */
export interface BatchItem {
  key: string;
  fingerprint?: string;
}

export interface BatchOptions extends GuardOptions {
  /** How many handlers run at once (default 1). */
  concurrency?: number;
}

export interface BatchClaim {
  key: string;
  fingerprint: string;
  scope: string;
  index: number;
  token: bigint;
  leaseUntil: Date;
  signal: AbortSignal;
  readonly lost: boolean;
}

export interface TransactionBatchClaim extends TransactionClaim {
  index: number;
}

export interface BatchResult {
  index: number;
  key: string;
  outcome: OutcomeName;
  response: StoredResponse | null;
  token: bigint | null;
  error: unknown;
  failedStep: 'begin' | 'handler' | 'complete' | null;
  released: boolean;
  /** A key repeated in the batch: the index of its first occurrence, whose result this is; otherwise null. */
  duplicateOf: number | null;
  leaseUntil: Date | null;
  expiresAt: Date | null;
  notStored: boolean;
  status: number | null;
}

/**
 * A batch in one transaction on the caller's idle client: idem_begin_many, each claimed item's
 * handler in a savepoint (a throwing one is rolled back and released alone), idem_complete_many, COMMIT.
 */
export declare function transactionMany<I extends BatchItem>(client: ClientBase, items: I[],
  handler: (claim: TransactionBatchClaim, item: I, index: number) => Response | Promise<Response>,
  options?: GuardOptions): Promise<BatchResult[]>;

export interface InboxResult<M> {
  message: M;
  id: string | null;
  outcome: OutcomeName | null;
  /** Whether the broker may forget the message (acked). */
  ack: boolean;
  error: unknown;
  duplicateOf: number | null;
}

export interface InboxOptions<M> extends Omit<GuardOptions, 'scope'> {
  /** The scope of the message ids. */
  queue: string;
  /** The business writes on client (the batch's transaction); the value returned is stored as the outcome. */
  handle: (message: M, client: ClientBase, claim: TransactionBatchClaim) => unknown;
  id?: (message: M) => string | null | undefined;
  fingerprint?: (message: M) => string;
  beforeAck?: (results: InboxResult<M>[]) => void | Promise<void>;
}

export interface Consumer {
  stop(): Promise<void>;
}

export declare class Inbox<M = any> {
  /** One batch in one transaction; resolves after the COMMIT. */
  process(messages: M[]): Promise<InboxResult<M>[]>;
  consumeAmqp(channel: any, queue: string, options?: { batchSize?: number; lingerMs?: number; onError?: (err: unknown) => void }): Promise<Consumer>;
  consumeRedisStream(redis: any, options: {
    stream: string; group: string; consumer: string; count?: number; blockMs?: number; claimIdleMs?: number;
    onError?: (err: unknown) => void;
  }): Promise<Consumer & { done: Promise<void> }>;
}

export declare function inbox<M = any>(pool: Pool | { connect(): Promise<PoolClient> }, options: InboxOptions<M>): Inbox<M>;

export interface TransactionClaim {
  key: string;
  fingerprint: string;
  scope: string;
  token: bigint;
  leaseUntil: Date;
  /** The caller's client, inside the transaction: run the business writes on it. */
  client: ClientBase;
  /** The attempt, from 1 (options.retries runs the transaction again after 40001 or 40P01). */
  attempt: number;
}

export interface TransactionResult {
  outcome: Exclude<OutcomeName, 'unavailable'>;
  response: StoredResponse | null;
  token: bigint | null;
  /** Executed: the claim's lease end; in flight: the holder's (when the server gave it); otherwise null. */
  leaseUntil: Date | null;
  /** Executed or replayed: until when the stored response is replayed; otherwise null. */
  expiresAt: Date | null;
  /** Executed: idem_complete refused the response and the notStored answer was stored instead. */
  notStored: boolean;
  /** Expired: the status the first response had; otherwise absent or null. */
  status?: number | null;
}

/**
 * BEGIN, claim, handler (business writes), store the response, COMMIT, on the caller's idle client.
 * Rejects after ROLLBACK with the handler's error or an idem error; with options.retries, runs
 * again first after 40001 or 40P01.
 */
export declare function transaction(client: ClientBase, key: string, fingerprint: string,
  handler: (claim: TransactionClaim) => Response | Promise<Response>, options?: GuardOptions): Promise<TransactionResult>;

/** A fault hook failing op (any op if omitted) the next n times. */
export declare function failTimes(n: number, op?: Op): FaultHook;

export interface BeginRow {
  claimed: boolean;
  state: 'PROCESSING' | 'DONE' | 'CONFLICT';
  token: bigint | null;
  status: number | null;
  body: Buffer | null;
  leaseUntil: Date | null;
  expiresAt: Date | null;
  /** A takeover's recovery point (the previous holder's last checkpoint), else null. */
  phase: string | null;
  phaseData: Buffer | null;
}

export interface LookupRow {
  state: 'PROCESSING' | 'DONE';
  token: bigint;
  status: number | null;
  leaseUntil: Date | null;
  expiresAt: Date;
  bodySize: number | null;
}

/** The idem functions as single statements on a client (no transaction control). */
export declare class Store {
  constructor(options?: { schema?: string; prepare?: boolean });
  readonly schema: string;
  readonly prepare: boolean;
  /** waitFor (ms or interval text; 0/null: none) calls the seven-argument idem_begin with wait_for. */
  begin(client: ClientBase, args: { key: string; fingerprint: string; lease?: Duration | null; retention?: Duration | null; scope?: string; wait?: boolean; waitFor?: Duration | null; remember?: Duration | null }): Promise<BeginRow>;
  complete(client: ClientBase, args: { key: string; fingerprint: string; status: number; body?: Body; token?: bigint | null; retention?: Duration | null; scope?: string }): Promise<Date>;
  release(client: ClientBase, args: { key: string; token?: bigint | null; scope?: string }): Promise<boolean>;
  extend(client: ClientBase, args: { key: string; token?: bigint | null; lease: Duration; scope?: string }): Promise<Date>;
  lookup(client: ClientBase, args: { key: string; scope?: string }): Promise<LookupRow | null>;
  /** idem_checkpoint: the recovery point of the claim held with token (fenced like complete). */
  checkpoint(client: ClientBase, args: { key: string; token?: bigint | null; phase: string; data?: Body; scope?: string }): Promise<void>;
  /** idem_hold, inside the caller's transaction: check the holder, keep a takeover waiting until commit. */
  hold(client: ClientBase, args: { key: string; token?: bigint | null; scope?: string }): Promise<void>;
}

export interface IdempotencyOptions extends Omit<GuardOptions, 'scope'> {
  /** Header name (default 'Idempotency-Key'). */
  header?: string;
  /** Methods guarded (default ['POST', 'PATCH']); others pass through. */
  methods?: string[];
  /** Missing key: 400 if true, pass through if false (default). */
  required?: boolean;
  /** Fingerprint of the request (default: SHA-256 of method, original URL and body bytes). */
  fingerprint?: (req: Request, body: Buffer) => string | Promise<string>;
  /** The tenant, e.g. the authenticated account's organisation (default ''). */
  scope?: (req: Request) => string | Promise<string>;
  /**
   * The caller's identity: keys are claimed in the scope callerScope(tenant, principal), so a
   * replay only goes to the caller who made the request.  A hook that throws or returns no
   * string: 500, nothing claimed.  Required unless shared is true.
   */
  principal?: (req: Request) => string | Promise<string>;
  /** One namespace of keys for every caller (the scope is the tenant alone): the explicit opt-out of principal. */
  shared?: boolean;
  /**
   * Runs before a stored response is replayed: true replays it; anything else answers 403
   * problem+json, unless the hook sent an answer itself (res), which is then the answer.
   */
  authorize?: (req: Request, res: ExpressResponse) => unknown | Promise<unknown>;
  /**
   * The replay policy: true to store and replay an answer of this status (default: every status
   * but 401, 403, 407, 408, 425, 429 and 5xx, which release the key for a retry).  Per
   * middleware, so per route.
   */
  storeStatus?: (status: number) => boolean;
  /** Store every status, 5xx and thrown errors included: storeStatus: () => true (default false). */
  storeServerErrors?: boolean;
  /**
   * Run the handler inside the transaction that holds the claim, on req.idempotency.client (a pool
   * client): the claim, its writes and the stored response commit together before the answer is
   * sent (default false).  Needs a pool, or a Guard over one.
   */
  transactional?: boolean;
  /** Response headers stored and replayed (default: content-type, content-language, content-encoding, location, etag, cache-control). */
  storedHeaders?: string[];
  /** Header set on a replay, with value 'true' (default 'Idempotent-Replayed'). */
  replayHeader?: string;
  /** Retry-After seconds on 503, and on 409 when the server gave no lease (an uncommitted claim; default 1). */
  retryAfter?: number;
  /**
   * Milliseconds a retry that arrives while the first request with its key runs waits for that
   * request's answer (default 5000; 0 when wait is false; 0: 409 at once).  It then gets the
   * answer replayed; 409 with Retry-After until the first request's lease ends (at least 1 s)
   * only when the wait runs out.  Per mount: each route's middleware has its own; overrides a
   * given Guard's waitFor.
   */
  waitFor?: number | null;
  /** Longest key in bytes (default 255); longer: 400. */
  maxKeyLength?: number;
  /**
   * true: every response of the route carries Idempotency-Key-Lifetime: <seconds>, the window
   * (the guard's retention, else the server's idem.default_retention).  Default false.
   */
  advertiseWindow?: boolean;
  /**
   * This route's idem_begin remember (a server with tombstones; default: the guard's, null: not
   * sent).  A retry after the stored response's retention but within remember is answered 410
   * (problem+json, 'response expired'); the handler does not run.
   */
  remember?: Duration | null;
  /** Largest body read by the middleware itself, in bytes (default 1 MiB); larger: 413. */
  limit?: number;
  /** Called with each guard result (in transactional mode, transaction()'s in the same shape). */
  onResult?: (result: GuardResult, req: Request) => void;
}

/** The scope of a key claimed for principal within tenant (doc/http.md): `<n>:<tenant>=<principal>` or `<n>:<tenant>#<sha256 hex>`. */
export declare function callerScope(tenant: string, principal: string, maxLength?: number): string;

/** Express middleware: the Idempotency-Key header over a Guard (or a pool and guard options). */
export declare function idempotency(poolOrGuard: Pool | Guard, options?: IdempotencyOptions): RequestHandler;

/** A verify function for express.json()/raw()/text() keeping the exact body bytes for the fingerprint. */
export declare function saveRawBody(req: any, res: any, buf: Buffer): void;

export declare function defaultFingerprint(req: Request, body: Buffer): string;

/** The 500 "Response not stored" answer (problem+json body) of doc/http.md. */
export declare const NOT_STORED: Readonly<{ status: 500; body: Buffer }>;

/**
 * The Idempotency-Key header's key: an sf-string (with \" and \\ escapes) or a bare token, 1 to
 * maxLength (255) bytes of printable ASCII; null for anything else (the middleware answers 400).
 */
export declare function parseKey(value: string | string[] | undefined, maxLength?: number): string | null;

/**
 * An IMF-fixdate (Sun, 06 Nov 1994 08:49:37 GMT), as Repeatability-First-Sent carries it, as a
 * Date; null for anything else (the middleware answers 400).
 */
export declare function parseHttpDate(value: string | string[] | undefined): Date | null;

declare global {
  namespace Express {
    interface Request {
      /** Set by the idempotency middleware while the handler runs under a claim. */
      idempotency?: {
        key: string;
        scope: string;
        token: bigint;
        /** Aborted when the heartbeat finds the claim lost; never in transactional mode. */
        signal: AbortSignal;
        replayed: boolean;
        /** Transactional mode: the pool client inside the claim's transaction. Finish its queries before answering. */
        client?: PoolClient;
        /** Guard mode: the claim's steps (see Claim.step, Claim.stepTx, Claim.resumedFrom). */
        step?: Claim['step'];
        stepTx?: Claim['stepTx'];
        resumedFrom?: string | null;
        /**
         * Default mode: the items of a batch request, each under its own key (key(item, i), else
         * `<key>:<index>`), claimed with one idem_begin_many; retry: answer 503 so a retry runs them again.
         */
        items<I>(items: I[], handler: (item: I, index: number, claim: BatchClaim) =>
          { status: number; body?: unknown } | Promise<{ status: number; body?: unknown }>,
          options?: { key?: (item: I, index: number) => string; fingerprint?: (item: I, index: number) => string }):
          Promise<{ results: Array<{ index: number; key: string; status: number; body: unknown; replayed: boolean; duplicateOf: number | null }>; retry: boolean }>;
      };
      /** The raw body bytes, when kept (saveRawBody, or read by the middleware). */
      rawBody?: Buffer;
    }
  }
}

export declare class IdemError extends Error {
  constructor(message: string, options?: { code?: string | null; cause?: unknown });
  /** SQLSTATE of the server error, or null. */
  code: string | null;
}
/** ID001: idem_complete with a fingerprint other than the claim's. */
export declare class FingerprintMismatchError extends IdemError {}
/** ID002: another caller took the key over after the lease. */
export declare class TokenSupersededError extends IdemError {}
/** ID003: no live claim. */
export declare class NoClaimError extends IdemError {}
/** ID004: already completed (with another response), or release/extend of a completed key. */
export declare class AlreadyCompletedError extends IdemError {}
/** Connection refused or lost, read-only server (25006), injected fault. */
export declare class UnavailableError extends IdemError {}
/** statement_timeout (57014), lock_timeout (55P03) or the client's deadline. */
export declare class TimeoutError extends UnavailableError {}
/** The key's recovery point was not written by steps (its data is not a JSON object with its phase). */
export declare class CheckpointDataError extends IdemError {}
/** A step's provider key: scope (if any), key and step name joined by ':'. */
export declare function stepIdempotencyKey(scope: string, key: string, name: string): string;

/** The idem error class for any error from pg or the network. */
export declare function toIdemError(err: unknown): IdemError;
export declare function isDatabaseError(err: unknown): boolean;
/** True for a failure a retry of the same call may not repeat (no SQLSTATE, 08xxx, 40001, 40P01, 55P03, 57014, 57P01-57P03, 53xxx). */
export declare function isTransient(err: unknown): boolean;
/** True for a serialization failure (40001) or a deadlock (40P01), the error or its cause: the transaction is to run again. */
export declare function isRetryableTransaction(err: unknown): boolean;
