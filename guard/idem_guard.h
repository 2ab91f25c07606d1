/*-------------------------------------------------------------------------
 *
 * idem_guard.h
 *	  Client-side guard over libpq for work done outside the database:
 *	  claim an idempotency key with idem_begin, run a handler, store its
 *	  response with idem_complete.
 *
 * Each call is its own transaction on the caller's connection, and every
 * write after the claim carries the claim's fencing token, so the guard
 * keeps no session state on the server and works through transaction
 * pooling.  A connection is used by one thread at a time; separate
 * connections may run guards in parallel threads.
 *
 * Link with -lidem_guard -lpq -lpthread.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_GUARD_H
#define IDEM_GUARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <libpq-fe.h>

#ifdef __cplusplus
extern "C"
{
#endif

/* What happened to a request, as in the Go Guard.Do. */
typedef enum IdemOutcome
{
	IDEM_EXECUTED,				/* the handler ran under a claim */
	IDEM_REPLAYED,				/* the stored response was returned */
	IDEM_IN_FLIGHT,				/* another caller holds a live claim */
	IDEM_CONFLICT,				/* the key was used with another fingerprint */
	IDEM_UNAVAILABLE,			/* no claim could be made; handler not run */
	IDEM_EXPIRED				/* executed and completed once; its response
								 * is no longer kept (a server with
								 * tombstones, remember_ms): handler not
								 * run, resp.status the first response's,
								 * resp.body NULL */
} IdemOutcome;

/* The step that failed, if any. */
typedef enum IdemStep
{
	IDEM_STEP_NONE,
	IDEM_STEP_BEGIN,			/* claim failed: outcome UNAVAILABLE */
	IDEM_STEP_HEARTBEAT,		/* heartbeat connection failed: UNAVAILABLE */
	IDEM_STEP_HANDLER,			/* handler returned an error */
	IDEM_STEP_COMPLETE,			/* response not stored: key stays PROCESSING,
								 * or (not_stored) holds the fixed 500 */
	IDEM_STEP_REPLAY			/* stored response could not be copied (out
								 * of memory): outcome UNAVAILABLE */
} IdemStep;

/*
 * What is stored in place of a response that the server refused for good
 * (a data error, not a lost connection, a timeout or a lost claim), and
 * replayed to every retry: the server's answer to a body larger than
 * idem.max_body_size, with this detail (doc/http.md).
 */
#define IDEM_NOT_STORED_STATUS	500
#define IDEM_NOT_STORED_BODY \
	"{\"type\":\"about:blank\",\"title\":\"Response not stored\",\"status\":500," \
	"\"detail\":\"The response to the first request with this key could not be" \
	" stored; it was sent then and is not replayed.\"}"

/* A response: status and body (malloc'd, may be NULL). */
typedef struct IdemResponse
{
	int			status;
	unsigned char *body;
	size_t		body_len;
} IdemResponse;

struct IdemHeartbeat;
struct IdemSteps;

/* The claim a handler runs under. */
typedef struct IdemClaim
{
	const char *key;
	const char *scope;
	int64_t		token;			/* fencing token: pass it downstream */
	struct IdemHeartbeat *heartbeat;	/* private */
	struct IdemSteps *steps;	/* private: idem_guard_step's state */
	size_t		item;			/* idem_guard_do_many: the item's position
								 * in the batch (from 0); 0 otherwise */
} IdemClaim;

/*
 * A step of a handler run by idem_guard_step: its name, the claim's key,
 * scope and fencing token, and the output of the step before it (this
 * run's, or the checkpoint's when the claim took over a crashed one;
 * NULL if none).  Key an outside call by something that stays the same
 * on a resume, such as an input an earlier step chose ("key:token" of its
 * own run): a step that crashed before its checkpoint runs again with the
 * same input but another token.
 */
typedef struct IdemPhase
{
	const char *name;
	const char *key;
	const char *scope;
	int64_t		token;
	const unsigned char *input;
	size_t		input_len;
	struct IdemSteps *steps;	/* private */
} IdemPhase;

/*
 * A step's work.  Return 0 when it is done (its output set with
 * idem_phase_output, if any), non-zero on failure.
 */
typedef int (*IdemStepFn) (IdemPhase *phase, void *arg);

/* What idem_guard_step returns when the guard, not the step, failed. */
#define IDEM_STEP_FAILED	(-1)

/*
 * The work to protect.  Fill resp (idem_response_set) and return 0, or
 * return non-zero on failure (resp is still returned to the caller).
 */
typedef int (*IdemHandler) (const IdemClaim *claim, void *arg,
							IdemResponse *resp);

/*
 * Fault hook for tests, like the Go MemoryStore.Fault: called before each
 * server call with op "begin", "complete", "release" or "extend"; a
 * non-zero return makes that call fail as if the server did not answer.
 * Also called with op "replay" before a stored response is copied: a
 * non-zero return makes the copy fail as if memory ran out.
 */
typedef int (*IdemFaultHook) (void *fault_arg, const char *op);

/* Options; set with idem_guard_options_init, then change fields. */
typedef struct IdemGuardOptions
{
	int			lease_ms;		/* 0: server's idem.default_lease (the
								 * heartbeat uses the lease the claim
								 * returned either way) */
	int			retention_ms;	/* 0: server's idem.default_retention */
	const char *scope;			/* NULL or "": the default scope */
	bool		wait;			/* wait for an uncommitted claim (default) */
	bool		keep_claim_on_error;	/* handler error: leave the key to
										 * the lease (Go) instead of
										 * idem_release */
	int			timeout_ms;		/* per statement; 0: none.  The server ends a
								 * statement soon after too (lock_timeout,
								 * statement_timeout), in a transaction of
								 * its own: a call the client gave up on
								 * never claims the key later */
	const char *heartbeat_conninfo;	/* non-NULL: extend the lease every
									 * third of it on this connection; a
									 * lost connection is re-made within
									 * one period */
	int			clock_offset_s; /* tests: SET LOCAL idem.clock_offset
								 * (superuser) on every call, like the Go
								 * Guard.Now hook */
	IdemFaultHook fault;
	void	   *fault_arg;
	const char *schema;			/* schema of the idem functions; NULL or "":
								 * "public".  Every call names it and casts
								 * every argument to its exact type, so no
								 * function in another schema or with other
								 * argument types is called instead. */
	int			wait_for_ms;	/* 0: a key held by a committed claim is
								 * in flight at once; else wait up to this
								 * long in the server for its answer (a
								 * replay), release or lapse (a claim);
								 * needs idem 1.4 */
	bool		steps;			/* the handler runs idem_guard_step: a
								 * takeover resumes after the crashed
								 * claim's last checkpoint; needs idem 1.4
								 * with recovery points */
	int			remember_ms;	/* 0: not sent; else idem_begin's remember
								 * (a server with tombstones), named: how
								 * long after its retention a completed key
								 * is remembered (outcome IDEM_EXPIRED) */
} IdemGuardOptions;

/* What idem_guard_do tells the caller. */
typedef struct IdemResult
{
	IdemOutcome outcome;
	IdemResponse resp;			/* executed or replayed response */
	int64_t		token;			/* token of the claim, 0 if none */
	IdemStep	failed;			/* IDEM_STEP_NONE if all went well */
	char		sqlstate[6];	/* of the failure; "" for connection loss,
								 * timeout or injected fault */
	char		message[256];	/* of the failure */
	bool		released;		/* claim given up: handler error, heartbeat
								 * not started, or claim whose commit was
								 * not confirmed */
	bool		superseded;		/* heartbeat found the token superseded */
	int			extends;		/* successful heartbeats */
	bool		not_stored;		/* the server refused the response for good:
								 * IDEM_NOT_STORED_BODY was stored in its
								 * place (failed is COMPLETE, sqlstate and
								 * message tell why, with the key) */
	char		resumed_after[64];	/* steps: the checkpointed phase a
									 * takeover resumed after; "" if none */
	int			steps_run;		/* steps: steps run and checkpointed */
	int			steps_skipped;	/* steps: steps skipped as checkpointed */
	bool		checkpointed;	/* steps: the claim holds a checkpoint, so
								 * a handler error left it to the lease */
} IdemResult;

/* A fault hook argument that fails op (NULL: any op) the next n times. */
typedef struct IdemFaultCounter
{
	const char *op;
	int			remaining;
} IdemFaultCounter;

extern void idem_guard_options_init(IdemGuardOptions *opts);

extern IdemOutcome idem_guard_do(PGconn *conn, const char *key,
								 const char *fingerprint,
								 IdemHandler handler, void *arg,
								 IdemResult *res);

extern IdemOutcome idem_guard_do_opts(PGconn *conn,
									  const IdemGuardOptions *opts,
									  const char *key,
									  const char *fingerprint,
									  IdemHandler handler, void *arg,
									  IdemResult *res);

/*
 * Batches: run handler once for each of the n keys (with their
 * fingerprints) that this call claims, and answer the others as
 * idem_guard_do_opts would, item by item: results[i] is item i's result
 * (clear each with idem_result_clear), in input order.  One
 * idem_begin_many call claims every key (in the server's lock order, so
 * that two overlapping batches never deadlock) and commits; the handlers
 * of the claimed items run one after another in input order, claim->item
 * naming the item; one idem_complete_many call stores their responses.  A
 * handler that fails has its claim released (unless keep_claim_on_error):
 * that item is EXECUTED with failed HANDLER, the others are stored.  A
 * key repeated in the batch is claimed once, for its first occurrence;
 * a later occurrence gets the first one's result (a copy), or CONFLICT
 * for another fingerprint, and duplicate_of[i] (if not NULL) is the
 * first occurrence's position, -1 for an item whose key is not repeated.
 * With wait_for_ms, items in flight are waited for up to wait_for_ms in
 * all; one still in flight then is IN_FLIGHT.  A response the server
 * refuses for good is stored on its own, with IDEM_NOT_STORED_BODY in
 * its place for that item alone.  heartbeat_conninfo and steps do not
 * apply: lease_ms must cover every handler of the batch.  Returns 0, or
 * -1 when the batch could not be claimed (every item UNAVAILABLE with
 * failed BEGIN, no handler run).  Needs idem 1.7.
 */
extern int	idem_guard_do_many(PGconn *conn, const IdemGuardOptions *opts,
							   size_t n, const char *const *keys,
							   const char *const *fingerprints,
							   IdemHandler handler, void *arg,
							   IdemResult *results, int *duplicate_of);

extern int	idem_response_set(IdemResponse *resp, int status,
							  const void *body, size_t body_len);
extern void idem_result_clear(IdemResult *res);
extern bool idem_claim_lost(const IdemClaim *claim);
extern const char *idem_outcome_name(IdemOutcome outcome);
extern const char *idem_step_name(IdemStep step);
extern int	idem_fault_fail_n(void *fault_arg, const char *op);

/*
 * Steps (IdemGuardOptions.steps): run fn as step name of the handler's
 * claim, unless a crashed claim this one took over checkpointed it or a
 * later step, and checkpoint it with its output.  Returns 0 when the step
 * ran and was checkpointed or was skipped, fn's non-zero return, or
 * IDEM_STEP_FAILED when its checkpoint failed (the claim lost, the
 * server gone).  On failure, return non-zero from the handler.
 */
extern int	idem_guard_step(const IdemClaim *claim, const char *name,
							IdemStepFn fn, void *arg);
/* Set the step's output (copied): checkpointed, the next step's input. */
extern int	idem_phase_output(IdemPhase *phase, const void *data, size_t len);
/*
 * Inside the step's own transaction on conn (BEGIN sent, not yet
 * committed): idem_hold the claim before touching business rows, and
 * idem_checkpoint the step with its output (set it first) so that both
 * commit with the business writes; the guard then does not checkpoint it
 * again.  0, or -1 with the error in idem_phase_error (the transaction
 * has failed: roll it back).
 */
extern int	idem_phase_hold(IdemPhase *phase, PGconn *conn);
extern int	idem_phase_checkpoint(IdemPhase *phase, PGconn *conn);
/* The step's last failure ("" if none), and its SQLSTATE. */
extern const char *idem_phase_error(const IdemPhase *phase);
extern const char *idem_phase_sqlstate(const IdemPhase *phase);

#ifdef __cplusplus
}
#endif

#endif							/* IDEM_GUARD_H */
