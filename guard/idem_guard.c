/*-------------------------------------------------------------------------
 *
 * idem_guard.c
 *	  The client guard: claim, run the handler, store the response.
 *
 * Every server call is one statement in its own transaction (or, when
 * the test clock is moved, one short explicit transaction), sent with
 * parameters through the connection core (guard_conn.c), which never
 * blocks past the call's deadline: the client side timeout, if any, plus
 * the time a cancel may take.  Every call names the schema of the idem
 * functions and casts every parameter to the exact type of the function's
 * argument, so that the caller's search_path and look-alike functions
 * (another schema, or other argument types such as varchar) cannot
 * capture it.
 *
 * A claim that cannot be made for any reason makes the outcome UNAVAILABLE
 * and the handler is not run.  A statement whose result arrives after the
 * client timeout fired is used: the cancel came too late to stop it.  A
 * claim whose statement answered but whose commit was not confirmed (an
 * error or a lost connection after the answer) is released, as far as the
 * connection allows, and the outcome is UNAVAILABLE.  After the handler
 * ran, the response is stored with the claim's fencing token; if that
 * fails the outcome stays EXECUTED and the failure is reported.  A failure
 * that a retry of the same call may not see (a lost connection, a
 * timeout, a serialization failure or deadlock, a shutdown, a lack of
 * resources) or a claim that is no longer ours leaves the key PROCESSING
 * until its lease ends; any other (the server refused the response: a
 * data error) stores IDEM_NOT_STORED_BODY with status 500 in its place,
 * so that the key is never claimable again once the handler ran.
 *
 * With a timeout, each call runs in a short transaction that ends it on
 * the server too (guard_conn.c): a claim waiting for another one is never
 * made, let alone committed, for a call the client gave up on.
 *
 * The claim is read in binary format: bodies arrive as their bytes, with
 * no escaping, and a body that cannot be copied (out of memory) is a
 * failure, never an empty replay.  The heartbeat extends the lease every
 * third of the lease the claim returned (the server's default lease when
 * lease_ms is 0), and re-makes a lost connection without blocking longer
 * than one period.  Stopping it never waits for an idem_extend that is
 * stuck (on a row lock, say): the extend in flight is cancelled, and a
 * heartbeat thread that has not ended soon after is left to end on its
 * own, with nothing of the caller's in its hands.
 *
 *-------------------------------------------------------------------------
 */
#include "idem_guard.h"
#include "guard_conn.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/*
 * The statements, with %s for the quoted schema.  idem_begin's row also
 * gives the lease in milliseconds, from its lease_until and the clock idem
 * used (the server clock plus idem.clock_offset).
 */
#define SQL_BEGIN_ROW \
	"SELECT b.claimed, b.state, b.token, b.status, b.body," \
	" (pg_catalog.date_part('epoch', b.lease_until OPERATOR(pg_catalog.-)" \
	" (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)" \
	" COALESCE(pg_catalog.current_setting('idem.clock_offset', true)," \
	" '0')::pg_catalog.interval))" \
	" OPERATOR(pg_catalog.*) 1000::pg_catalog.float8)::pg_catalog.int8" \
	"%s FROM %s.idem_begin($1::pg_catalog.text, $2::pg_catalog.text," \
	" $3::pg_catalog.interval, $4::pg_catalog.interval, $5::pg_catalog.text," \
	" $6::pg_catalog.bool"
/*
 * guard_claim ends it: with $7 wait_for (idem 1.4: a duplicate waits for
 * the answer) when waiting, then remember => (a server with tombstones)
 * when set, then ") b".
 */
/* The extra columns of a claim for steps: the crashed claim's checkpoint. */
#define SQL_BEGIN_STEPS_COLS	", b.phase, b.phase_data"
#define BEGIN_COLS			6
#define BEGIN_STEPS_COLS	8
#define SQL_COMPLETE \
	"SELECT %s.idem_complete($1::pg_catalog.text, $2::pg_catalog.text," \
	" $3::pg_catalog.int4, $4::pg_catalog.bytea, $5::pg_catalog.int8," \
	" $6::pg_catalog.interval, $7::pg_catalog.text)"
#define SQL_RELEASE \
	"SELECT %s.idem_release($1::pg_catalog.text, $2::pg_catalog.int8," \
	" $3::pg_catalog.text)"
#define SQL_CHECKPOINT \
	"SELECT %s.idem_checkpoint($1::pg_catalog.text, $2::pg_catalog.int8," \
	" $3::pg_catalog.text, $4::pg_catalog.bytea, $5::pg_catalog.text)"
#define SQL_HOLD \
	"SELECT %s.idem_hold($1::pg_catalog.text, $2::pg_catalog.int8," \
	" $3::pg_catalog.text)"
#define SQL_EXTEND \
	"SELECT %s.idem_extend($1::pg_catalog.text, $2::pg_catalog.int8," \
	" $3::pg_catalog.interval, $4::pg_catalog.text)"

/* The functions the statements call, as a missing one is named. */
#define FN_BEGIN \
	"idem_begin(text, text, interval, interval, text, boolean)"
#define FN_BEGIN_WAIT \
	"idem_begin(text, text, interval, interval, text, boolean, interval)"
#define FN_BEGIN_REMEMBER \
	"idem_begin(text, text, interval, interval, text, boolean, remember => interval)"
#define FN_BEGIN_WAIT_REMEMBER \
	"idem_begin(text, text, interval, interval, text, boolean, interval, remember => interval)"
#define FN_COMPLETE \
	"idem_complete(text, text, integer, bytea, bigint, interval, text)"
#define FN_RELEASE	"idem_release(text, bigint, text)"
#define FN_CHECKPOINT	"idem_checkpoint(text, bigint, text, bytea, text)"
#define FN_HOLD		"idem_hold(text, bigint, text)"

/* Room for a statement with its schema. */
#define SQL_LEN					1024

/* Longest schema name (NAMEDATALEN - 1), and its quoted form's room. */
#define SCHEMA_MAX				63
#define QUOTED_SCHEMA_LEN		(2 * SCHEMA_MAX + 3)

/*
 * How long stopping the heartbeat waits for its thread beyond the time
 * its statement's cancel may take.
 */
#define HEARTBEAT_EXIT_MS		100

/* One guarded call: its arguments as the statements send them. */
typedef struct GuardCall
{
	PGconn	   *conn;
	const IdemGuardOptions *opts;
	const char *key;
	const char *fingerprint;
	const char *scope;
	char		schema[QUOTED_SCHEMA_LEN];	/* quoted */
	const char *lease;			/* NULL: the server's default */
	const char *retention;		/* NULL: the server's default */
	char		lease_buf[32];
	char		retention_buf[32];
	char		token[24];		/* of the claim, as text */
	long		lease_ms;		/* the claim's lease, from its lease_until */
} GuardCall;

/*
 * The steps of one guarded call (IdemGuardOptions.steps): what a takeover
 * inherited, the output the next step gets, and the step running now.
 */
typedef struct IdemSteps
{
	GuardCall  *gc;
	char	   *resume;			/* phase to resume after; NULL: none */
	bool		resuming;		/* skipping steps until resume is met */
	bool		checkpointed;	/* the claim holds a checkpoint */
	unsigned char *data;		/* output of the last finished step */
	size_t		data_len;
	bool		has_data;
	/* The step running now. */
	unsigned char *out;
	size_t		out_len;
	bool		has_out;
	bool		stored;			/* checkpointed inside its transaction */
	GuardError	err;			/* its last failure */
	int			run;
	int			skipped;
	bool		failed;			/* a step failed: err tells why */
	char		failed_step[64];
} IdemSteps;

/*
 * A running heartbeat: a thread extending one claim's lease.  It keeps
 * copies of what it sends, so that a thread left to end on its own after
 * the call returned uses nothing of the caller's.
 */
typedef struct IdemHeartbeat
{
	pthread_t	thread;
	pthread_mutex_t lock;
	pthread_cond_t wake;		/* to the thread: stop sleeping */
	pthread_cond_t done;		/* from the thread: it has ended */
	bool		finished;		/* under lock: the thread has ended */
	bool		abandoned;		/* under lock: the thread frees all */
	GuardStop	stop;
	atomic_bool lost;			/* token superseded or claim gone */
	atomic_int	extends;		/* successful extends */
	PGconn	   *conn;
	char	   *sql;			/* SQL_EXTEND with the schema */
	char	   *key;
	char	   *scope;
	char		token[24];
	char		lease[32];		/* the lease each extend asks for */
	int			period_ms;
	int			timeout_ms;
	int			clock_offset_s;
	IdemFaultHook fault;
	void	   *fault_arg;
} IdemHeartbeat;

/*
 * Run one statement of a guarded call under the call's timeout (0: none)
 * and, for the heartbeat, its stop request.  Returns as idem_guard_conn_exec
 * does; a timeout's message names it.
 */
static PGresult *
call_statement(PGconn *conn, const GuardStatement *st, int timeout_ms,
			   int clock_offset_s, GuardStop *stop, GuardError *err,
			   bool *uncertain)
{
	struct timespec deadline;
	PGresult   *res;

	if (timeout_ms > 0)
		idem_guard_statement_deadline(&deadline, timeout_ms);
	res = idem_guard_conn_exec(conn, st, clock_offset_s,
						  timeout_ms > 0 ? &deadline : NULL, stop, err,
						  uncertain);
	if ((res == NULL || *uncertain) && err->timed_out)
		idem_guard_error(err, "statement timed out after %d ms", timeout_ms);
	return res;
}

/*
 * Run one statement of a guarded call that must have ended for sure: a
 * result whose commit is uncertain counts as a failure.  Text results.
 */
static PGresult *
call_exec(const GuardCall *gc, const char *sql_fmt, int nparams,
		  const char *const *values, const int *lengths, const int *formats,
		  GuardError *err)
{
	char		sql[SQL_LEN];
	GuardStatement st = {sql, nparams, values, lengths, formats, 0};
	bool		uncertain;
	PGresult   *res;

	snprintf(sql, sizeof(sql), sql_fmt, gc->schema);
	res = call_statement(gc->conn, &st, gc->opts->timeout_ms,
						 gc->opts->clock_offset_s, NULL, err, &uncertain);
	if (res != NULL && uncertain)
	{
		PQclear(res);
		return NULL;
	}
	return res;
}

/*
 * Name the function and schema a call looked for when the server found
 * either missing (42883, 3F000), and what fixes it: the schema option, or
 * an update of an old version.  function is the call's signature.
 */
static void
name_missing(const GuardCall *gc, const char *function, GuardError *err)
{
	int			namelen = (int) strcspn(function, "(");

	if (strcmp(err->sqlstate, "3F000") != 0 && strcmp(err->sqlstate, "42883") != 0)
		return;
	snprintf(err->message, sizeof(err->message),
			 "%.*s%s not found in schema %.64s; set IdemGuardOptions.schema to the"
			 " schema where CREATE EXTENSION idem put it, or if the version is old"
			 " run ALTER EXTENSION idem UPDATE",
			 namelen, function,
			 strcmp(function, FN_BEGIN_WAIT) == 0 ? " with wait_for" : "",
			 gc->schema);
}

/* Record a failed step in the result. */
static void
fail_step(IdemResult *res, IdemStep step, const GuardError *err)
{
	res->failed = step;
	memcpy(res->sqlstate, err->sqlstate, sizeof(res->sqlstate));
	memcpy(res->message, err->message, sizeof(res->message));
}

/* True if the fault hook (NULL: none) makes op fail; sets *err if so. */
static bool
fault_fires(IdemFaultHook fault, void *fault_arg, const char *op,
			GuardError *err)
{
	if (fault == NULL || !fault(fault_arg, op))
		return false;
	idem_guard_error(err, "fault injected at %s", op);
	return true;
}

/* One idem_extend call for the heartbeat; returns true if it succeeded. */
static bool
heartbeat_extend(IdemHeartbeat *hb, GuardError *err)
{
	const char *values[4];
	GuardStatement st = {hb->sql, 4, values, NULL, NULL, 0};
	bool		uncertain;
	PGresult   *res;

	if (fault_fires(hb->fault, hb->fault_arg, "extend", err))
		return false;
	values[0] = hb->key;
	values[1] = hb->token;
	values[2] = hb->lease;
	values[3] = hb->scope;
	res = call_statement(hb->conn, &st, hb->timeout_ms, hb->clock_offset_s,
						 &hb->stop, err, &uncertain);
	if (res == NULL)
		return false;
	PQclear(res);
	return !uncertain;
}

/* True if an idem_extend error means the claim is no longer ours. */
static bool
claim_gone(const GuardError *err)
{
	return strcmp(err->sqlstate, "ID002") == 0 ||
		strcmp(err->sqlstate, "ID003") == 0 ||
		strcmp(err->sqlstate, "ID004") == 0;
}

/* Free the heartbeat and close its connection; its thread has ended. */
static void
heartbeat_free(IdemHeartbeat *hb)
{
	if (hb->conn != NULL)
	{
		/* The goodbye message must not wait for a stuck socket. */
		PQsetnonblocking(hb->conn, 1);
		PQfinish(hb->conn);
	}
	pthread_cond_destroy(&hb->wake);
	pthread_cond_destroy(&hb->done);
	pthread_mutex_destroy(&hb->lock);
	free(hb->sql);
	free(hb->key);
	free(hb->scope);
	free(hb);
}

/*
 * Heartbeat thread: extend every period until stopped or the claim is
 * lost.  A lost connection is re-made within one period (the next beat
 * tries again).  At the end, the thread tells heartbeat_stop, or frees
 * the heartbeat itself if heartbeat_stop stopped waiting for it.
 */
static void *
heartbeat_main(void *arg)
{
	IdemHeartbeat *hb = arg;
	struct timespec next;
	bool		abandoned;

	clock_gettime(CLOCK_MONOTONIC, &next);
	for (;;)
	{
		struct timespec reconnect_by;
		GuardError	err;
		bool		ok;

		idem_guard_time_add(&next, hb->period_ms);
		pthread_mutex_lock(&hb->lock);
		while (!idem_guard_stop_requested(&hb->stop) &&
			   pthread_cond_timedwait(&hb->wake, &hb->lock, &next) != ETIMEDOUT)
			;
		pthread_mutex_unlock(&hb->lock);
		if (idem_guard_stop_requested(&hb->stop))
			break;

		ok = heartbeat_extend(hb, &err);
		if (ok)
			atomic_fetch_add(&hb->extends, 1);
		if (idem_guard_stop_requested(&hb->stop))
			break;
		if (!ok && claim_gone(&err))
		{
			atomic_store(&hb->lost, true);
			break;
		}
		if (!ok && PQstatus(hb->conn) != CONNECTION_OK)
		{
			idem_guard_time_after(&reconnect_by, hb->period_ms);
			idem_guard_conn_reset(hb->conn, &reconnect_by, &hb->stop);
		}
	}

	pthread_mutex_lock(&hb->lock);
	hb->finished = true;
	abandoned = hb->abandoned;
	pthread_cond_signal(&hb->done);
	pthread_mutex_unlock(&hb->lock);
	if (abandoned)
		heartbeat_free(hb);
	return NULL;
}

/*
 * Connect and start the heartbeat for the claim of gc: every third of the
 * claim's lease, extend it by that lease.  Returns NULL with *err set if
 * the connection or the thread cannot be made.
 */
static IdemHeartbeat *
heartbeat_start(const GuardCall *gc, GuardError *err)
{
	IdemHeartbeat *hb = calloc(1, sizeof(IdemHeartbeat));
	char		sql[SQL_LEN];
	pthread_condattr_t attr;

	if (hb == NULL)
	{
		idem_guard_error(err, "out of memory");
		return NULL;
	}
	snprintf(sql, sizeof(sql), SQL_EXTEND, gc->schema);
	hb->sql = strdup(sql);
	hb->key = strdup(gc->key);
	hb->scope = strdup(gc->scope);
	if (hb->sql == NULL || hb->key == NULL || hb->scope == NULL)
	{
		idem_guard_error(err, "out of memory");
		free(hb->sql);
		free(hb->key);
		free(hb->scope);
		free(hb);
		return NULL;
	}
	snprintf(hb->token, sizeof(hb->token), "%s", gc->token);
	snprintf(hb->lease, sizeof(hb->lease), "%ld milliseconds", gc->lease_ms);
	hb->period_ms = (int) (gc->lease_ms / 3);
	if (hb->period_ms < 1)
		hb->period_ms = 1;
	hb->timeout_ms = gc->opts->timeout_ms;
	hb->clock_offset_s = gc->opts->clock_offset_s;
	hb->fault = gc->opts->fault;
	hb->fault_arg = gc->opts->fault_arg;
	idem_guard_stop_init(&hb->stop);
	atomic_init(&hb->lost, false);
	atomic_init(&hb->extends, 0);
	pthread_mutex_init(&hb->lock, NULL);
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&hb->wake, &attr);
	pthread_cond_init(&hb->done, &attr);
	pthread_condattr_destroy(&attr);

	hb->conn = PQconnectdb(gc->opts->heartbeat_conninfo);
	if (PQstatus(hb->conn) != CONNECTION_OK)
	{
		idem_guard_error_text(err, NULL, PQerrorMessage(hb->conn));
		heartbeat_free(hb);
		return NULL;
	}
	if (pthread_create(&hb->thread, NULL, heartbeat_main, hb) != 0)
	{
		idem_guard_error(err, "could not start the heartbeat thread");
		heartbeat_free(hb);
		return NULL;
	}
	return hb;
}

/*
 * Stop the heartbeat and report what it did in *res.  An extend in flight
 * is cancelled within GUARD_CANCEL_GRACE_MS; a thread that has not ended
 * shortly after is left to end on its own and free the heartbeat.
 */
static void
heartbeat_stop(IdemHeartbeat *hb, IdemResult *res)
{
	struct timespec wait_until;
	pthread_t	thread = hb->thread;
	bool		finished;

	idem_guard_stop_request(&hb->stop, GUARD_CANCEL_GRACE_MS);
	idem_guard_time_after(&wait_until, GUARD_CANCEL_GRACE_MS + HEARTBEAT_EXIT_MS);
	pthread_mutex_lock(&hb->lock);
	pthread_cond_signal(&hb->wake);
	while (!hb->finished &&
		   pthread_cond_timedwait(&hb->done, &hb->lock, &wait_until) != ETIMEDOUT)
		;
	finished = hb->finished;
	hb->abandoned = !finished;
	res->extends = atomic_load(&hb->extends);
	res->superseded = atomic_load(&hb->lost);
	pthread_mutex_unlock(&hb->lock);

	/* Once abandoned, hb belongs to the thread. */
	if (finished)
	{
		pthread_join(thread, NULL);
		heartbeat_free(hb);
	}
	else
		pthread_detach(thread);
}

/* Give up the claim with idem_release; returns true if the key is free. */
static bool
release_claim(const GuardCall *gc, GuardError *err)
{
	const char *values[3];
	PGresult   *res;
	bool		released;

	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "release", err))
		return false;
	values[0] = gc->key;
	values[1] = gc->token;
	values[2] = gc->scope;
	res = call_exec(gc, SQL_RELEASE, 3, values, NULL, NULL, err);
	if (res == NULL)
	{
		name_missing(gc, FN_RELEASE, err);
		return false;
	}
	released = PQntuples(res) == 1 && strcmp(PQgetvalue(res, 0, 0), "t") == 0;
	if (!released)
		idem_guard_error(err, "idem_release found no claim to release");
	PQclear(res);
	return released;
}

/* Store the handler's response with idem_complete and the claim's token. */
static bool
complete_claim(const GuardCall *gc, const IdemResponse *resp,
			   GuardError *err)
{
	const char *values[7];
	int			lengths[7] = {0, 0, 0, 0, 0, 0, 0};
	int			formats[7] = {0, 0, 0, 1, 0, 0, 0};
	char		status[16];
	PGresult   *res;

	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "complete", err))
		return false;
	snprintf(status, sizeof(status), "%d", resp->status);
	values[0] = gc->key;
	values[1] = gc->fingerprint;
	values[2] = status;
	values[3] = (const char *) resp->body;
	lengths[3] = (int) resp->body_len;
	values[4] = gc->token;
	values[5] = gc->retention;
	values[6] = gc->scope;
	res = call_exec(gc, SQL_COMPLETE, 7, values, lengths, formats, err);
	if (res == NULL)
	{
		name_missing(gc, FN_COMPLETE, err);
		return false;
	}
	PQclear(res);
	return true;
}

/*
 * True if a failed idem_complete refused the response for good, so that
 * the fixed 500 is stored in its place.  Not for a failure without a
 * SQLSTATE (connection lost, timeout, injected fault), a connection
 * failure (class 08), a serialization failure or deadlock, a lock or
 * statement timeout or cancel, a shutdown, a lack of resources (class 53):
 * the same call may yet succeed; nor for a key that is no longer this
 * claim's (ID002, ID003, 42501) or is completed already (ID004).
 */
static bool
response_refused(const GuardError *err)
{
	static const char *const keep[] = {
		"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03",
		"ID002", "ID003", "ID004", "42501"
	};
	size_t		i;

	if (err->sqlstate[0] == '\0' || strncmp(err->sqlstate, "08", 2) == 0 ||
		strncmp(err->sqlstate, "53", 2) == 0)
		return false;
	for (i = 0; i < sizeof(keep) / sizeof(keep[0]); i++)
		if (strcmp(err->sqlstate, keep[i]) == 0)
			return false;
	return true;
}

/*
 * The server refused the response (err): store the fixed 500 in its
 * place, and report both, with the key, in res.
 */
static void
store_not_stored(const GuardCall *gc, const GuardError *err, IdemResult *res)
{
	IdemResponse fixed = {IDEM_NOT_STORED_STATUS,
		(unsigned char *) IDEM_NOT_STORED_BODY, strlen(IDEM_NOT_STORED_BODY)};
	GuardError	ferr;

	fail_step(res, IDEM_STEP_COMPLETE, err);
	res->not_stored = complete_claim(gc, &fixed, &ferr);
	if (res->not_stored)
		snprintf(res->message, sizeof(res->message),
				 "response to key \"%.64s\" not stored (%.100s); 500"
				 " \"Response not stored\" stored in its place",
				 gc->key, err->message);
	else
		snprintf(res->message, sizeof(res->message),
				 "response to key \"%.48s\" not stored (%.64s), nor 500"
				 " \"Response not stored\" in its place (%.64s)",
				 gc->key, err->message, ferr.message);
}

/* A binary boolean of the claim row; false if NULL or malformed. */
static bool
row_bool(const PGresult *row, int col)
{
	return !PQgetisnull(row, 0, col) && PQgetlength(row, 0, col) == 1 &&
		PQgetvalue(row, 0, col)[0] != 0;
}

/* A binary integer of n bytes (4 or 8) of the claim row; false if NULL. */
static bool
row_int(const PGresult *row, int col, int n, int64_t *value)
{
	const unsigned char *p;
	uint64_t	v = 0;
	int			i;

	if (PQgetisnull(row, 0, col) || PQgetlength(row, 0, col) != n)
		return false;
	p = (const unsigned char *) PQgetvalue(row, 0, col);
	for (i = 0; i < n; i++)
		v = (v << 8) | p[i];
	*value = (n == 4) ? (int64_t) (int32_t) (uint32_t) v : (int64_t) v;
	return true;
}

/*
 * Copy the stored response out of a claim row (binary: the body is its
 * bytes).  Returns false, leaving resp empty, if memory ran out.
 */
static bool
copy_response(const GuardCall *gc, const PGresult *row, IdemResponse *resp)
{
	int64_t		status = 0;
	GuardError	ignored;

	(void) row_int(row, 3, 4, &status);
	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "replay", &ignored))
		return false;
	if (PQgetisnull(row, 0, 4))
		return idem_response_set(resp, (int) status, NULL, 0) == 0;
	return idem_response_set(resp, (int) status, PQgetvalue(row, 0, 4),
							 (size_t) PQgetlength(row, 0, 4)) == 0;
}

/*
 * Take the crashed claim's checkpoint from a claim row (binary: phase is
 * its text, phase_data its bytes): the phase to resume after and the
 * output its step left.  False if memory ran out.
 */
static bool
steps_inherit(IdemSteps *steps, const PGresult *row, IdemResult *res)
{
	if (PQgetisnull(row, 0, 6))
		return true;
	steps->resume = strdup(PQgetvalue(row, 0, 6));
	if (steps->resume == NULL)
		return false;
	steps->resuming = true;
	steps->checkpointed = true;
	snprintf(res->resumed_after, sizeof(res->resumed_after), "%s",
			 steps->resume);
	if (PQgetisnull(row, 0, 7))
		return true;
	steps->data_len = (size_t) PQgetlength(row, 0, 7);
	steps->data = malloc(steps->data_len > 0 ? steps->data_len : 1);
	if (steps->data == NULL)
		return false;
	memcpy(steps->data, PQgetvalue(row, 0, 7), steps->data_len);
	steps->has_data = true;
	return true;
}

/* Free what the steps of a call hold. */
static void
steps_free(IdemSteps *steps)
{
	free(steps->resume);
	free(steps->data);
	free(steps->out);
}

/*
 * Prepare a guarded call: defaults, the quoted schema, and the lease and
 * retention as the statements send them.  False with *err set if the
 * schema name is too long.
 */
static bool
call_init(GuardCall *gc, PGconn *conn, const IdemGuardOptions *opts,
		  const char *key, const char *fingerprint, GuardError *err)
{
	const char *schema = (opts->schema && *opts->schema) ? opts->schema :
		"public";
	size_t		i;
	size_t		n = 0;

	memset(gc, 0, sizeof(GuardCall));
	gc->conn = conn;
	gc->opts = opts;
	gc->key = key;
	gc->fingerprint = fingerprint;
	gc->scope = opts->scope ? opts->scope : "";
	if (strlen(schema) > SCHEMA_MAX)
	{
		idem_guard_error(err, "schema name \"%.63s...\" is longer than %d bytes",
				  schema, SCHEMA_MAX);
		return false;
	}
	/* A quoted identifier: any name, no search_path, no case folding. */
	gc->schema[n++] = '"';
	for (i = 0; schema[i] != '\0'; i++)
	{
		if (schema[i] == '"')
			gc->schema[n++] = '"';
		gc->schema[n++] = schema[i];
	}
	gc->schema[n++] = '"';
	gc->schema[n] = '\0';
	if (opts->lease_ms > 0)
	{
		snprintf(gc->lease_buf, sizeof(gc->lease_buf), "%d milliseconds",
				 opts->lease_ms);
		gc->lease = gc->lease_buf;
	}
	if (opts->retention_ms > 0)
	{
		snprintf(gc->retention_buf, sizeof(gc->retention_buf),
				 "%d milliseconds", opts->retention_ms);
		gc->retention = gc->retention_buf;
	}
	return true;
}

/*
 * Claim the key.  Returns true if the call holds the claim (token and
 * lease set in gc and res); otherwise res->outcome says what happened:
 * REPLAYED, CONFLICT, IN_FLIGHT, or UNAVAILABLE with the failed step.
 */
static bool
guard_claim(GuardCall *gc, IdemSteps *steps, IdemResult *res)
{
	const char *values[8];
	char		sql[SQL_LEN];
	char		wait_for[32];
	char		remember[32];
	char		remember_arg[64] = "";
	GuardStatement st = {sql, 6, values, NULL, NULL, 1};
	PGresult   *row;
	GuardError	err;
	bool		uncertain;
	int			timeout_ms = gc->opts->timeout_ms;
	int			ncols = steps ? BEGIN_STEPS_COLS : BEGIN_COLS;
	const char *cols = steps ? SQL_BEGIN_STEPS_COLS : "";
	int64_t		token;
	int64_t		lease_ms;
	const char *state;

	/* Any failure means no dedup protection, so do not run. */
	res->outcome = IDEM_UNAVAILABLE;
	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "begin", &err))
	{
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return false;
	}
	values[0] = gc->key;
	values[1] = gc->fingerprint;
	values[2] = gc->lease;
	values[3] = gc->retention;
	values[4] = gc->scope;
	values[5] = gc->opts->wait ? "true" : "false";
	if (gc->opts->wait_for_ms > 0)
	{
		/* The server ends its wait at wait_for; the call's timeout leaves room for it. */
		snprintf(wait_for, sizeof(wait_for), "%d milliseconds",
				 gc->opts->wait_for_ms);
		values[6] = wait_for;
		st.nparams = 7;
		if (timeout_ms > 0)
			timeout_ms += gc->opts->wait_for_ms;
	}
	if (gc->opts->remember_ms > 0)
	{
		/* Named, and only when set: a server without it serves the rest. */
		snprintf(remember, sizeof(remember), "%d milliseconds",
				 gc->opts->remember_ms);
		values[st.nparams] = remember;
		st.nparams++;
		snprintf(remember_arg, sizeof(remember_arg),
				 ", remember => $%d::pg_catalog.interval", st.nparams);
	}
	snprintf(sql, sizeof(sql), SQL_BEGIN_ROW "%s%s) b", cols, gc->schema,
			 gc->opts->wait_for_ms > 0 ? ", $7::pg_catalog.interval" : "",
			 remember_arg);
	row = call_statement(gc->conn, &st, timeout_ms,
						 gc->opts->clock_offset_s, NULL, &err, &uncertain);
	if (row == NULL)
	{
		name_missing(gc, gc->opts->remember_ms > 0 ?
					 (gc->opts->wait_for_ms > 0 ? FN_BEGIN_WAIT_REMEMBER : FN_BEGIN_REMEMBER) :
					 (gc->opts->wait_for_ms > 0 ? FN_BEGIN_WAIT : FN_BEGIN), &err);
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return false;
	}
	if (PQntuples(row) != 1 || PQnfields(row) != ncols ||
		PQgetisnull(row, 0, 1))
	{
		PQclear(row);
		idem_guard_error(&err, "idem_begin returned an unexpected result");
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return false;
	}

	state = PQgetvalue(row, 0, 1);
	if (!row_bool(row, 0))
	{
		if (strcmp(state, "DONE") == 0)
		{
			if (copy_response(gc, row, &res->resp))
				res->outcome = IDEM_REPLAYED;
			else
			{
				idem_guard_error(&err, "out of memory copying the stored response");
				fail_step(res, IDEM_STEP_REPLAY, &err);
			}
		}
		else if (strcmp(state, "CONFLICT") == 0)
			res->outcome = IDEM_CONFLICT;
		else if (strcmp(state, "PROCESSING") == 0)
			res->outcome = IDEM_IN_FLIGHT;
		else if (strcmp(state, "EXPIRED") == 0)
		{
			/* Completed once, its response gone: never run again. */
			int64_t		status = 0;

			(void) row_int(row, 3, 4, &status);
			res->resp.status = (int) status;
			res->outcome = IDEM_EXPIRED;
		}
		else
		{
			/*
			 * A state this guard does not know (a newer server): not in
			 * flight, which would answer a stored response with 409 for as
			 * long as it is kept.
			 */
			idem_guard_error(&err, "idem_begin answered an unknown state \"%.32s\"",
							 state);
			fail_step(res, IDEM_STEP_BEGIN, &err);
		}
		PQclear(row);
		return false;
	}

	if (!row_int(row, 2, 8, &token) || !row_int(row, 5, 8, &lease_ms))
	{
		PQclear(row);
		idem_guard_error(&err, "idem_begin returned a claim without token or lease");
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return false;
	}
	res->token = token;
	if (steps != NULL && !steps_inherit(steps, row, res))
	{
		/* Not released: that would drop the crashed claim's checkpoint. */
		PQclear(row);
		idem_guard_error(&err, "out of memory copying the checkpoint");
		fail_step(res, IDEM_STEP_BEGIN, &err);
		res->checkpointed = true;
		return false;
	}
	PQclear(row);
	snprintf(gc->token, sizeof(gc->token), "%" PRId64, token);
	gc->lease_ms = (long) (lease_ms > 0 ? lease_ms : 1);

	if (uncertain)
	{
		/*
		 * Claimed, but maybe not committed: give it up, do not run.  A
		 * takeover of a checkpointed claim is left to its lease instead,
		 * as a release would drop the checkpoint.
		 */
		GuardError	rerr;

		if (steps == NULL || !steps->checkpointed)
			res->released = release_claim(gc, &rerr);
		snprintf(res->message, sizeof(res->message),
				 "claim not confirmed (%.150s); %s", err.message,
				 res->released ? "released" :
				 (steps != NULL && steps->checkpointed) ?
				 "left to its lease (checkpointed)" : "not released");
		memcpy(res->sqlstate, err.sqlstate, sizeof(res->sqlstate));
		res->failed = IDEM_STEP_BEGIN;
		return false;
	}
	return true;
}

/*
 * Run the handler under the claim, with the heartbeat if asked for.
 * Returns false (outcome UNAVAILABLE, claim released) if the heartbeat
 * could not start; otherwise sets *herr to the handler's return value.
 */
static bool
guard_run(GuardCall *gc, IdemSteps *steps, IdemHandler handler, void *arg,
		  IdemResult *res, int *herr)
{
	IdemClaim	claim;
	IdemHeartbeat *hb = NULL;
	GuardError	err;

	claim.key = gc->key;
	claim.scope = gc->scope;
	claim.token = res->token;
	claim.heartbeat = NULL;
	claim.steps = steps;

	/* A long handler without its heartbeat could lose the key: give up. */
	if (gc->opts->heartbeat_conninfo != NULL)
	{
		hb = heartbeat_start(gc, &err);
		if (hb == NULL)
		{
			GuardError	rerr;

			fail_step(res, IDEM_STEP_HEARTBEAT, &err);
			if (steps == NULL || !steps->checkpointed)
				res->released = release_claim(gc, &rerr);
			res->checkpointed = steps != NULL && steps->checkpointed;
			return false;
		}
		claim.heartbeat = hb;
	}

	res->outcome = IDEM_EXECUTED;
	*herr = handler(&claim, arg, &res->resp);
	if (hb != NULL)
		heartbeat_stop(hb, res);
	if (steps != NULL)
	{
		res->steps_run = steps->run;
		res->steps_skipped = steps->skipped;
		res->checkpointed = steps->checkpointed;
	}
	return true;
}

/*
 * After the handler: release the claim if it failed (unless told to keep
 * it), or store its response.
 */
static void
guard_finish(GuardCall *gc, IdemSteps *steps, int herr, IdemResult *res)
{
	GuardError	err;

	/* Steps skipped for a checkpoint that never came: not done. */
	if (herr == 0 && steps != NULL && steps->resuming)
	{
		herr = IDEM_STEP_FAILED;
		idem_guard_error(&steps->err,
						 "the checkpointed phase \"%.64s\" is no step of the"
						 " handler: steps were skipped", steps->resume);
		steps->failed = true;
		steps->failed_step[0] = '\0';
	}
	if (herr != 0)
	{
		GuardError	rerr;

		if (steps != NULL && steps->failed)
		{
			snprintf(err.sqlstate, sizeof(err.sqlstate), "%s",
					 steps->err.sqlstate);
			if (steps->failed_step[0])
				snprintf(err.message, sizeof(err.message),
						 "step \"%.64s\" failed (%d): %.160s",
						 steps->failed_step, herr, steps->err.message);
			else
				snprintf(err.message, sizeof(err.message), "%s",
						 steps->err.message);
		}
		else
			idem_guard_error(&err, "handler failed (%d)", herr);
		fail_step(res, IDEM_STEP_HANDLER, &err);
		if (gc->opts->keep_claim_on_error)
			return;
		/* A release would drop the checkpoint: resume after the lease. */
		if (steps != NULL && steps->checkpointed)
			return;
		res->released = release_claim(gc, &rerr);
		if (!res->released)
		{
			memcpy(res->sqlstate, rerr.sqlstate, sizeof(res->sqlstate));
			snprintf(res->message, sizeof(res->message),
					 "handler failed (%d); release failed: %.200s",
					 herr, rerr.message);
		}
		return;
	}

	if (complete_claim(gc, &res->resp, &err))
		return;
	if (response_refused(&err))
		store_not_stored(gc, &err, res);
	else
		fail_step(res, IDEM_STEP_COMPLETE, &err);
}

/* Fill opts with the defaults. */
void
idem_guard_options_init(IdemGuardOptions *opts)
{
	memset(opts, 0, sizeof(IdemGuardOptions));
	opts->wait = true;
}

/* Run handler under the key with default options. */
IdemOutcome
idem_guard_do(PGconn *conn, const char *key, const char *fingerprint,
			  IdemHandler handler, void *arg, IdemResult *res)
{
	return idem_guard_do_opts(conn, NULL, key, fingerprint, handler, arg, res);
}

/*
 * Claim key, then replay, refuse, or run handler and store its response;
 * see the file header.  res must be cleared with idem_result_clear.
 */
IdemOutcome
idem_guard_do_opts(PGconn *conn, const IdemGuardOptions *opts,
				   const char *key, const char *fingerprint,
				   IdemHandler handler, void *arg, IdemResult *res)
{
	IdemGuardOptions defaults;
	GuardCall	gc;
	GuardError	err;
	IdemSteps	steps;
	IdemSteps  *sp = NULL;
	int			herr = 0;

	if (opts == NULL)
	{
		idem_guard_options_init(&defaults);
		opts = &defaults;
	}
	memset(res, 0, sizeof(IdemResult));
	res->outcome = IDEM_UNAVAILABLE;
	if (!call_init(&gc, conn, opts, key, fingerprint, &err))
	{
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return res->outcome;
	}
	if (opts->steps)
	{
		memset(&steps, 0, sizeof(steps));
		steps.gc = &gc;
		sp = &steps;
	}
	if (guard_claim(&gc, sp, res) &&
		guard_run(&gc, sp, handler, arg, res, &herr))
		guard_finish(&gc, sp, herr, res);
	if (sp != NULL)
		steps_free(sp);
	return res->outcome;
}

/* Set a response to status and a copy of body (NULL: no body). */
int
idem_response_set(IdemResponse *resp, int status, const void *body,
				  size_t body_len)
{
	free(resp->body);
	resp->body = NULL;
	resp->body_len = 0;
	resp->status = status;
	if (body == NULL)
		return 0;
	resp->body = malloc(body_len > 0 ? body_len : 1);
	if (resp->body == NULL)
		return -1;
	memcpy(resp->body, body, body_len);
	resp->body_len = body_len;
	return 0;
}

/* Free what a result holds. */
void
idem_result_clear(IdemResult *res)
{
	free(res->resp.body);
	res->resp.body = NULL;
	res->resp.body_len = 0;
}

/* True once the heartbeat has found the claim superseded or gone. */
bool
idem_claim_lost(const IdemClaim *claim)
{
	return claim->heartbeat != NULL &&
		atomic_load(&claim->heartbeat->lost);
}

/* Name of an outcome, as in the Go guard. */
const char *
idem_outcome_name(IdemOutcome outcome)
{
	switch (outcome)
	{
		case IDEM_EXECUTED:
			return "EXECUTED";
		case IDEM_REPLAYED:
			return "REPLAYED";
		case IDEM_IN_FLIGHT:
			return "IN_FLIGHT";
		case IDEM_CONFLICT:
			return "CONFLICT";
		case IDEM_UNAVAILABLE:
			return "UNAVAILABLE";
		case IDEM_EXPIRED:
			return "EXPIRED";
	}
	return "?";
}

/* Name of a failed step. */
const char *
idem_step_name(IdemStep step)
{
	switch (step)
	{
		case IDEM_STEP_NONE:
			return "none";
		case IDEM_STEP_BEGIN:
			return "begin";
		case IDEM_STEP_HEARTBEAT:
			return "heartbeat";
		case IDEM_STEP_HANDLER:
			return "handler";
		case IDEM_STEP_COMPLETE:
			return "complete";
		case IDEM_STEP_REPLAY:
			return "replay";
	}
	return "?";
}

/* Fault hook: fail the counter's op (any op if NULL) while it lasts. */
int
idem_fault_fail_n(void *fault_arg, const char *op)
{
	IdemFaultCounter *fc = fault_arg;
	int			n;

	if (fc->op != NULL && strcmp(fc->op, op) != 0)
		return 0;
	n = __atomic_load_n(&fc->remaining, __ATOMIC_SEQ_CST);
	while (n > 0)
	{
		if (__atomic_compare_exchange_n(&fc->remaining, &n, n - 1, false,
										__ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
			return 1;
	}
	return 0;
}

/*
 * Store a step's checkpoint with idem_checkpoint: on the call's connection
 * in a transaction of its own (in_tx NULL), or inside the step's open
 * transaction on in_tx.
 */
static bool
checkpoint_step(IdemSteps *st, PGconn *in_tx, const char *name,
				GuardError *err)
{
	GuardCall  *gc = st->gc;
	const char *values[5];
	int			lengths[5] = {0, 0, 0, 0, 0};
	int			formats[5] = {0, 0, 0, 1, 0};
	PGresult   *res;

	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "checkpoint", err))
		return false;
	if (st->out_len > (size_t) INT32_MAX)
	{
		idem_guard_error(err, "output of step \"%.64s\" is too large", name);
		return false;
	}
	values[0] = gc->key;
	values[1] = gc->token;
	values[2] = name;
	values[3] = st->has_out ? (const char *) (st->out ? st->out :
											  (unsigned char *) "") : NULL;
	lengths[3] = (int) st->out_len;
	values[4] = gc->scope;
	if (in_tx == NULL)
		res = call_exec(gc, SQL_CHECKPOINT, 5, values, lengths, formats, err);
	else
	{
		char		sql[SQL_LEN];
		GuardStatement stmt = {sql, 5, values, lengths, formats, 0};
		struct timespec deadline;

		snprintf(sql, sizeof(sql), SQL_CHECKPOINT, gc->schema);
		if (gc->opts->timeout_ms > 0)
			idem_guard_statement_deadline(&deadline, gc->opts->timeout_ms);
		res = idem_guard_conn_exec_in_tx(in_tx, &stmt,
										 gc->opts->clock_offset_s,
										 gc->opts->timeout_ms > 0 ?
										 &deadline : NULL, err);
	}
	if (res == NULL)
	{
		name_missing(gc, FN_CHECKPOINT, err);
		return false;
	}
	PQclear(res);
	return true;
}

/* Run fn as step name of the claim, or skip it; see idem_guard.h. */
int
idem_guard_step(const IdemClaim *claim, const char *name, IdemStepFn fn,
				void *arg)
{
	IdemSteps  *st = claim->steps;
	IdemPhase	phase;
	int			rc;

	/* Without IdemGuardOptions.steps there is no checkpoint to resume. */
	if (st == NULL)
		return IDEM_STEP_FAILED;
	/* Never a step after a failed one. */
	if (st->failed)
		return IDEM_STEP_FAILED;
	if (name == NULL || name[0] == '\0')
	{
		idem_guard_error(&st->err, "a step needs a name");
		st->failed = true;
		st->failed_step[0] = '\0';
		return IDEM_STEP_FAILED;
	}
	if (st->resuming)
	{
		/* Checkpointed by the crashed claim: this step or a later one. */
		st->skipped++;
		if (strcmp(name, st->resume) == 0)
			st->resuming = false;
		return 0;
	}

	memset(&phase, 0, sizeof(phase));
	phase.name = name;
	phase.key = claim->key;
	phase.scope = claim->scope;
	phase.token = claim->token;
	phase.input = st->has_data ? (st->data ? st->data :
								  (const unsigned char *) "") : NULL;
	phase.input_len = st->data_len;
	phase.steps = st;
	free(st->out);
	st->out = NULL;
	st->out_len = 0;
	st->has_out = false;
	st->stored = false;
	st->err.sqlstate[0] = '\0';
	st->err.message[0] = '\0';

	rc = fn(&phase, arg);
	if (rc == 0 && !st->stored && !checkpoint_step(st, NULL, name, &st->err))
		rc = IDEM_STEP_FAILED;
	if (rc != 0)
	{
		if (st->err.message[0] == '\0')
			idem_guard_error(&st->err, "step returned %d", rc);
		st->failed = true;
		snprintf(st->failed_step, sizeof(st->failed_step), "%s", name);
		return rc;
	}
	st->checkpointed = true;
	st->run++;
	free(st->data);
	st->data = st->out;
	st->data_len = st->out_len;
	st->has_data = st->has_out;
	st->out = NULL;
	st->out_len = 0;
	st->has_out = false;
	return 0;
}

/* Set the running step's output (a copy; NULL data: no output). */
int
idem_phase_output(IdemPhase *phase, const void *data, size_t len)
{
	IdemSteps  *st = phase->steps;
	unsigned char *copy = NULL;

	if (st->stored)
	{
		idem_guard_error(&st->err, "output of step \"%.64s\" set after its"
						 " checkpoint", phase->name);
		return -1;
	}
	if (data != NULL)
	{
		copy = malloc(len > 0 ? len : 1);
		if (copy == NULL)
		{
			idem_guard_error(&st->err, "out of memory");
			return -1;
		}
		memcpy(copy, data, len);
	}
	free(st->out);
	st->out = copy;
	st->out_len = data != NULL ? len : 0;
	st->has_out = data != NULL;
	return 0;
}

/* idem_hold the claim inside the step's open transaction on conn. */
int
idem_phase_hold(IdemPhase *phase, PGconn *conn)
{
	IdemSteps  *st = phase->steps;
	GuardCall  *gc = st->gc;
	const char *values[3];
	char		sql[SQL_LEN];
	GuardStatement stmt = {sql, 3, values, NULL, NULL, 0};
	struct timespec deadline;
	PGresult   *res;

	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "hold", &st->err))
		return -1;
	values[0] = gc->key;
	values[1] = gc->token;
	values[2] = gc->scope;
	snprintf(sql, sizeof(sql), SQL_HOLD, gc->schema);
	if (gc->opts->timeout_ms > 0)
		idem_guard_statement_deadline(&deadline, gc->opts->timeout_ms);
	res = idem_guard_conn_exec_in_tx(conn, &stmt, gc->opts->clock_offset_s,
									 gc->opts->timeout_ms > 0 ? &deadline : NULL,
									 &st->err);
	if (res == NULL)
	{
		name_missing(gc, FN_HOLD, &st->err);
		return -1;
	}
	PQclear(res);
	return 0;
}

/* idem_checkpoint the step inside its open transaction on conn. */
int
idem_phase_checkpoint(IdemPhase *phase, PGconn *conn)
{
	IdemSteps  *st = phase->steps;

	if (!checkpoint_step(st, conn, phase->name, &st->err))
		return -1;
	st->stored = true;
	return 0;
}

/* The running step's last failure, "" if none. */
const char *
idem_phase_error(const IdemPhase *phase)
{
	return phase->steps->err.message;
}

/* The SQLSTATE of the running step's last failure, "" if none. */
const char *
idem_phase_sqlstate(const IdemPhase *phase)
{
	return phase->steps->err.sqlstate;
}

/*
 * Batches: idem_guard_do_many.  One idem_begin_many claims every key (one
 * statement, in the server's lock order), the handlers of the claimed
 * items run in input order, and one idem_complete_many stores their
 * responses; a handler that fails has its claim released.
 */
#define SQL_BEGIN_MANY \
	"SELECT ordinality, claimed, state, token, status, body, duplicate_of" \
	" FROM %s.idem_begin_many($1::pg_catalog.text[], $2::pg_catalog.text[]," \
	" $3::pg_catalog.interval, $4::pg_catalog.interval, $5::pg_catalog.text," \
	" $6::pg_catalog.bool, $7::pg_catalog.interval, $8::pg_catalog.interval)"
#define SQL_COMPLETE_MANY \
	"SELECT ordinality FROM %s.idem_complete_many($1::pg_catalog.text[]," \
	" $2::pg_catalog.text[], $3::pg_catalog.int4[], $4::pg_catalog.bytea[]," \
	" $5::pg_catalog.int8[], $6::pg_catalog.interval, $7::pg_catalog.text)"
#define FN_BEGIN_MANY \
	"idem_begin_many(text[], text[], interval, interval, text, boolean, interval, interval, text)"
#define FN_COMPLETE_MANY \
	"idem_complete_many(text[], text[], integer[], bytea[], bigint[], interval, text)"

/* A growing string for array literals; len 0 and data NULL to start. */
typedef struct ManyBuf
{
	char	   *data;
	size_t		len;
	size_t		cap;
	bool		oom;
} ManyBuf;

static void
buf_put(ManyBuf *b, const char *s, size_t n)
{
	if (b->oom)
		return;
	if (b->len + n + 1 > b->cap)
	{
		size_t		cap = b->cap ? b->cap : 256;
		char	   *p;

		while (b->len + n + 1 > cap)
			cap *= 2;
		p = realloc(b->data, cap);
		if (p == NULL)
		{
			b->oom = true;
			return;
		}
		b->data = p;
		b->cap = cap;
	}
	memcpy(b->data + b->len, s, n);
	b->len += n;
	b->data[b->len] = '\0';
}

/* Append one quoted element of an array literal (its text s, n bytes). */
static void
buf_element(ManyBuf *b, const char *s, size_t n)
{
	size_t		i;

	buf_put(b, b->len > 1 ? ",\"" : "\"", b->len > 1 ? 2 : 1);
	for (i = 0; i < n; i++)
	{
		if (s[i] == '"' || s[i] == '\\')
			buf_put(b, "\\", 1);
		buf_put(b, s + i, 1);
	}
	buf_put(b, "\"", 1);
}

/* Append a bytea element in hex ("\\x..." inside the literal). */
static void
buf_bytea(ManyBuf *b, const unsigned char *p, size_t n)
{
	static const char hex[] = "0123456789abcdef";
	size_t		i;

	buf_put(b, b->len > 1 ? ",\"\\\\x" : "\"\\\\x", b->len > 1 ? 5 : 4);
	for (i = 0; i < n; i++)
	{
		char		h[2] = {hex[p[i] >> 4], hex[p[i] & 15]};

		buf_put(b, h, 2);
	}
	buf_put(b, "\"", 1);
}

/* Give every item of the batch the same failure. */
static int
many_unavailable(size_t n, IdemResult *results, int *duplicate_of,
				 const GuardError *err)
{
	size_t		i;

	for (i = 0; i < n; i++)
	{
		results[i].outcome = IDEM_UNAVAILABLE;
		fail_step(&results[i], IDEM_STEP_BEGIN, err);
		if (duplicate_of)
			duplicate_of[i] = -1;
	}
	return -1;
}

/*
 * Store the responses of the items in done[0..ndone) with one
 * idem_complete_many call, the claims' tokens in tokens.  True if stored;
 * otherwise err says why.
 */
static bool
complete_many(GuardCall *gc, size_t ndone, const size_t *done,
			  const char *const *keys, const char *const *fingerprints,
			  const IdemResult *results, GuardError *err)
{
	ManyBuf		k = {0}, f = {0}, s = {0}, body = {0}, t = {0};
	const char *values[7];
	PGresult   *res;
	size_t		j;
	bool		ok = false;

	if (fault_fires(gc->opts->fault, gc->opts->fault_arg, "complete", err))
		return false;
	buf_put(&k, "{", 1);
	buf_put(&f, "{", 1);
	buf_put(&s, "{", 1);
	buf_put(&body, "{", 1);
	buf_put(&t, "{", 1);
	for (j = 0; j < ndone; j++)
	{
		size_t		i = done[j];
		char		num[32];

		buf_element(&k, keys[i], strlen(keys[i]));
		buf_element(&f, fingerprints[i], strlen(fingerprints[i]));
		snprintf(num, sizeof(num), "%d", results[i].resp.status);
		buf_element(&s, num, strlen(num));
		buf_bytea(&body, results[i].resp.body, results[i].resp.body_len);
		snprintf(num, sizeof(num), "%" PRId64, results[i].token);
		buf_element(&t, num, strlen(num));
	}
	buf_put(&k, "}", 1);
	buf_put(&f, "}", 1);
	buf_put(&s, "}", 1);
	buf_put(&body, "}", 1);
	buf_put(&t, "}", 1);
	if (k.oom || f.oom || s.oom || body.oom || t.oom)
		idem_guard_error(err, "out of memory building the batch");
	else
	{
		values[0] = k.data;
		values[1] = f.data;
		values[2] = s.data;
		values[3] = body.data;
		values[4] = t.data;
		values[5] = gc->retention;
		values[6] = gc->scope;
		res = call_exec(gc, SQL_COMPLETE_MANY, 7, values, NULL, NULL, err);
		if (res == NULL)
			name_missing(gc, FN_COMPLETE_MANY, err);
		else
		{
			ok = true;
			PQclear(res);
		}
	}
	free(k.data);
	free(f.data);
	free(s.data);
	free(body.data);
	free(t.data);
	return ok;
}

static int	idem_guard_many_run(PGconn *conn, const IdemGuardOptions *opts,
								size_t n, const char *const *keys,
								const char *const *fingerprints,
								IdemHandler handler, void *arg,
								IdemResult *results, int *duplicate_of);

/*
 * Run handler once for each key of a batch that this call claims, and
 * answer the others as idem_guard_do_opts would; see idem_guard.h.
 */
int
idem_guard_do_many(PGconn *conn, const IdemGuardOptions *opts, size_t n,
				   const char *const *keys, const char *const *fingerprints,
				   IdemHandler handler, void *arg, IdemResult *results,
				   int *duplicate_of)
{
	IdemGuardOptions defaults;
	GuardError	err;
	size_t		i;
	int			r;
	int		   *dups;

	if (opts == NULL)
	{
		idem_guard_options_init(&defaults);
		opts = &defaults;
	}
	for (i = 0; i < n; i++)
	{
		memset(&results[i], 0, sizeof(IdemResult));
		results[i].outcome = IDEM_UNAVAILABLE;
		if (duplicate_of)
			duplicate_of[i] = -1;
	}
	if (n == 0)
		return 0;
	dups = duplicate_of ? duplicate_of : malloc(n * sizeof(int));
	if (dups == NULL)
	{
		idem_guard_error(&err, "out of memory building the batch");
		return many_unavailable(n, results, NULL, &err);
	}
	for (i = 0; i < n; i++)
		dups[i] = -1;
	r = idem_guard_many_run(conn, opts, n, keys, fingerprints, handler, arg,
							results, dups);
	if (dups != duplicate_of)
		free(dups);
	return r;
}

/* idem_guard_do_many with its duplicate_of array (never NULL). */
static int
idem_guard_many_run(PGconn *conn, const IdemGuardOptions *opts, size_t n,
					const char *const *keys, const char *const *fingerprints,
					IdemHandler handler, void *arg, IdemResult *results,
					int *duplicate_of)
{
	GuardCall	gc;
	GuardError	err;
	ManyBuf		k = {0}, f = {0};
	const char *values[8];
	char		sql[SQL_LEN];
	char		wait_for[32];
	char		remember[32];
	GuardStatement st = {sql, 8, values, NULL, NULL, 0};
	PGresult   *rows = NULL;
	bool		uncertain = false;
	int			timeout_ms;
	size_t	   *done = NULL;
	size_t		ndone = 0;
	size_t		i;
	int			r;

	if (!call_init(&gc, conn, opts, NULL, NULL, &err))
		return many_unavailable(n, results, duplicate_of, &err);
	if (fault_fires(opts->fault, opts->fault_arg, "begin", &err))
		return many_unavailable(n, results, duplicate_of, &err);
	buf_put(&k, "{", 1);
	buf_put(&f, "{", 1);
	for (i = 0; i < n; i++)
	{
		if (keys[i] == NULL || fingerprints[i] == NULL)
		{
			free(k.data);
			free(f.data);
			idem_guard_error(&err, "%s[%zu] is NULL", keys[i] == NULL ?
							 "keys" : "fingerprints", i);
			return many_unavailable(n, results, duplicate_of, &err);
		}
		buf_element(&k, keys[i], strlen(keys[i]));
		buf_element(&f, fingerprints[i], strlen(fingerprints[i]));
	}
	buf_put(&k, "}", 1);
	buf_put(&f, "}", 1);
	done = malloc(n * sizeof(size_t));
	if (k.oom || f.oom || done == NULL)
	{
		free(k.data);
		free(f.data);
		free(done);
		idem_guard_error(&err, "out of memory building the batch");
		return many_unavailable(n, results, duplicate_of, &err);
	}
	values[0] = k.data;
	values[1] = f.data;
	values[2] = gc.lease;
	values[3] = gc.retention;
	values[4] = gc.scope;
	values[5] = opts->wait ? "true" : "false";
	values[6] = NULL;
	values[7] = NULL;
	timeout_ms = opts->timeout_ms;
	if (opts->wait_for_ms > 0)
	{
		snprintf(wait_for, sizeof(wait_for), "%d milliseconds", opts->wait_for_ms);
		values[6] = wait_for;
		if (timeout_ms > 0)
			timeout_ms += opts->wait_for_ms;
	}
	if (opts->remember_ms > 0)
	{
		snprintf(remember, sizeof(remember), "%d milliseconds", opts->remember_ms);
		values[7] = remember;
	}
	snprintf(sql, sizeof(sql), SQL_BEGIN_MANY, gc.schema);
	rows = call_statement(conn, &st, timeout_ms, opts->clock_offset_s, NULL,
						  &err, &uncertain);
	free(k.data);
	free(f.data);
	if (rows == NULL)
	{
		free(done);
		name_missing(&gc, FN_BEGIN_MANY, &err);
		return many_unavailable(n, results, duplicate_of, &err);
	}
	if ((size_t) PQntuples(rows) != n || PQnfields(rows) != 7)
	{
		PQclear(rows);
		free(done);
		idem_guard_error(&err, "idem_begin_many returned an unexpected result");
		return many_unavailable(n, results, duplicate_of, &err);
	}

	/* The answers: claims (token set), replays, refusals, duplicates. */
	for (r = 0; r < PQntuples(rows); r++)
	{
		long		ord = strtol(PQgetvalue(rows, r, 0), NULL, 10);
		const char *state = PQgetvalue(rows, r, 2);
		IdemResult *res;

		if (ord < 1 || (size_t) ord > n)
			continue;
		res = &results[ord - 1];
		if (!PQgetisnull(rows, r, 6))
			duplicate_of[ord - 1] = atoi(PQgetvalue(rows, r, 6)) - 1;
		if (strcmp(PQgetvalue(rows, r, 1), "t") == 0)
		{
			res->token = strtoll(PQgetvalue(rows, r, 3), NULL, 10);
			res->outcome = IDEM_EXECUTED;	/* claimed: to run */
			continue;
		}
		if (strcmp(state, "DONE") == 0 || strcmp(state, "EXPIRED") == 0)
		{
			int			status = PQgetisnull(rows, r, 4) ? 0 : atoi(PQgetvalue(rows, r, 4));
			unsigned char *body = NULL;
			size_t		len = 0;

			if (strcmp(state, "DONE") == 0 && !PQgetisnull(rows, r, 5))
				body = PQunescapeBytea((const unsigned char *) PQgetvalue(rows, r, 5), &len);
			if ((strcmp(state, "DONE") == 0 && !PQgetisnull(rows, r, 5) && body == NULL) ||
				fault_fires(opts->fault, opts->fault_arg, "replay", &err) ||
				idem_response_set(&res->resp, status, body, len) != 0)
			{
				idem_guard_error(&err, "out of memory copying the stored response");
				fail_step(res, IDEM_STEP_REPLAY, &err);
				res->outcome = IDEM_UNAVAILABLE;
			}
			else
				res->outcome = strcmp(state, "DONE") == 0 ? IDEM_REPLAYED : IDEM_EXPIRED;
			if (res->outcome == IDEM_EXPIRED)
			{
				free(res->resp.body);
				res->resp.body = NULL;
				res->resp.body_len = 0;
			}
			if (body)
				PQfreemem(body);
		}
		else if (strcmp(state, "CONFLICT") == 0)
			res->outcome = IDEM_CONFLICT;
		else if (strcmp(state, "PROCESSING") == 0)
			res->outcome = IDEM_IN_FLIGHT;
		else if (strcmp(state, "DUPLICATE") == 0)
			res->outcome = IDEM_UNAVAILABLE;	/* filled in at the end */
		else
		{
			idem_guard_error(&err, "idem_begin_many answered an unknown state \"%.32s\"",
							 state);
			fail_step(res, IDEM_STEP_BEGIN, &err);
		}
	}
	PQclear(rows);

	/* Claimed but maybe not committed: give every claim up, run nothing. */
	if (uncertain)
	{
		for (i = 0; i < n; i++)
		{
			GuardError	rerr;

			if (results[i].token == 0)
				continue;
			gc.key = keys[i];
			snprintf(gc.token, sizeof(gc.token), "%" PRId64, results[i].token);
			results[i].released = release_claim(&gc, &rerr);
			results[i].outcome = IDEM_UNAVAILABLE;
			fail_step(&results[i], IDEM_STEP_BEGIN, &err);
		}
		free(done);
		return -1;
	}

	/* The handlers of the claimed items, in input order. */
	for (i = 0; i < n; i++)
	{
		IdemClaim	claim;
		int			herr;

		if (results[i].token == 0)
			continue;
		memset(&claim, 0, sizeof(claim));
		claim.key = keys[i];
		claim.scope = gc.scope;
		claim.token = results[i].token;
		claim.item = i;
		herr = handler(&claim, arg, &results[i].resp);
		if (herr == 0)
		{
			done[ndone++] = i;
			continue;
		}
		idem_guard_error(&err, "handler failed (%d)", herr);
		fail_step(&results[i], IDEM_STEP_HANDLER, &err);
		if (!opts->keep_claim_on_error)
		{
			GuardError	rerr;

			gc.key = keys[i];
			snprintf(gc.token, sizeof(gc.token), "%" PRId64, results[i].token);
			results[i].released = release_claim(&gc, &rerr);
			if (!results[i].released)
			{
				memcpy(results[i].sqlstate, rerr.sqlstate, sizeof(results[i].sqlstate));
				snprintf(results[i].message, sizeof(results[i].message),
						 "handler failed (%d); release failed: %.200s",
						 herr, rerr.message);
			}
		}
	}

	/* One idem_complete_many; a response refused for good: one by one. */
	if (ndone > 0 &&
		!complete_many(&gc, ndone, done, keys, fingerprints, results, &err))
	{
		bool		refused = response_refused(&err);
		size_t		j;

		for (j = 0; j < ndone; j++)
		{
			IdemResult *res = &results[done[j]];
			GuardError	cerr;

			if (!refused)
			{
				fail_step(res, IDEM_STEP_COMPLETE, &err);
				continue;
			}
			gc.key = keys[done[j]];
			gc.fingerprint = fingerprints[done[j]];
			snprintf(gc.token, sizeof(gc.token), "%" PRId64, res->token);
			if (complete_claim(&gc, &res->resp, &cerr))
				continue;
			if (response_refused(&cerr))
				store_not_stored(&gc, &cerr, res);
			else
				fail_step(res, IDEM_STEP_COMPLETE, &cerr);
		}
	}
	free(done);

	/* A repeated key: its first occurrence's result (CONFLICT stays). */
	{
		for (i = 0; i < n; i++)
		{
			int			d = duplicate_of[i];

			if (d < 0 || (size_t) d >= i || results[i].outcome == IDEM_CONFLICT)
				continue;
			results[i] = results[d];
			results[i].resp.body = NULL;
			results[i].resp.body_len = 0;
			if (idem_response_set(&results[i].resp, results[d].resp.status,
								  results[d].resp.body, results[d].resp.body_len) != 0)
			{
				idem_guard_error(&err, "out of memory copying the response");
				results[i].outcome = IDEM_UNAVAILABLE;
				fail_step(&results[i], IDEM_STEP_REPLAY, &err);
			}
		}
	}
	return 0;
}
