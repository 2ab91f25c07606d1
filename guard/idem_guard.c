/*-------------------------------------------------------------------------
 *
 * idem_guard.c
 *	  The client guard: claim, run the handler, store the response.
 *
 * Every server call is one statement in its own transaction (or, when
 * the test clock is moved, one short explicit transaction), sent with
 * parameters and waited for with an optional client side timeout.  Every
 * call names the schema of the idem functions and casts every parameter to
 * the exact type of the function's argument, so that the caller's
 * search_path and look-alike functions (another schema, or other argument
 * types such as varchar) cannot capture it.
 *
 * A claim that cannot be made for any reason makes the outcome UNAVAILABLE
 * and the handler is not run.  A statement whose result arrives after the
 * client timeout fired is used: the cancel came too late to stop it.  A
 * claim whose statement answered but whose commit was not confirmed (an
 * error or a lost connection after the answer) is released, as far as the
 * connection allows, and the outcome is UNAVAILABLE.  After the handler
 * ran, the response is stored with the claim's fencing token; if that
 * fails the outcome stays EXECUTED, the failure is reported and the key
 * stays PROCESSING until its lease ends.
 *
 * The claim is read in binary format: bodies arrive as their bytes, with
 * no escaping, and a body that cannot be copied (out of memory) is a
 * failure, never an empty replay.  The heartbeat extends the lease every
 * third of the lease the claim returned (the server's default lease when
 * lease_ms is 0), and re-makes a lost connection without blocking longer
 * than one period, so that stopping it never hangs.
 *
 *-------------------------------------------------------------------------
 */
#include "idem_guard.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/*
 * The statements, with %s for the quoted schema.  idem_begin's row also
 * gives the lease in milliseconds, from its lease_until and the clock idem
 * used (the server clock plus idem.clock_offset).
 */
#define SQL_BEGIN \
	"SELECT b.claimed, b.state, b.token, b.status, b.body," \
	" (pg_catalog.date_part('epoch', b.lease_until OPERATOR(pg_catalog.-)" \
	" (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)" \
	" COALESCE(pg_catalog.current_setting('idem.clock_offset', true)," \
	" '0')::pg_catalog.interval))" \
	" OPERATOR(pg_catalog.*) 1000::pg_catalog.float8)::pg_catalog.int8" \
	" FROM %s.idem_begin($1::pg_catalog.text, $2::pg_catalog.text," \
	" $3::pg_catalog.interval, $4::pg_catalog.interval, $5::pg_catalog.text," \
	" $6::pg_catalog.bool) b"
#define SQL_COMPLETE \
	"SELECT %s.idem_complete($1::pg_catalog.text, $2::pg_catalog.text," \
	" $3::pg_catalog.int4, $4::pg_catalog.bytea, $5::pg_catalog.int8," \
	" $6::pg_catalog.interval, $7::pg_catalog.text)"
#define SQL_RELEASE \
	"SELECT %s.idem_release($1::pg_catalog.text, $2::pg_catalog.int8," \
	" $3::pg_catalog.text)"
#define SQL_EXTEND \
	"SELECT %s.idem_extend($1::pg_catalog.text, $2::pg_catalog.int8," \
	" $3::pg_catalog.interval, $4::pg_catalog.text)"
#define SQL_CLOCK \
	"SELECT pg_catalog.set_config('idem.clock_offset', $1::pg_catalog.text," \
	" true)"

/* Room for a statement with its schema. */
#define SQL_LEN					1024

/* Longest schema name (NAMEDATALEN - 1), and its quoted form's room. */
#define SCHEMA_MAX				63
#define QUOTED_SCHEMA_LEN		(2 * SCHEMA_MAX + 3)

/* How long to wait for a cancelled statement before dropping the link. */
#define CANCEL_GRACE_MS			1000

/* Slice of a heartbeat reconnect's wait, to notice a stop request. */
#define RECONNECT_SLICE_MS		50

/* Why a server call failed. */
typedef struct GuardError
{
	char		sqlstate[6];
	char		message[256];
} GuardError;

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

/* A running heartbeat: a thread extending one claim's lease. */
typedef struct IdemHeartbeat
{
	pthread_t	thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool		stop;			/* under lock */
	int			stopping;		/* atomic copy of stop, for reconnects */
	int			lost;			/* atomic: token superseded or claim gone */
	int			extends;		/* under lock */
	PGconn	   *conn;
	const GuardCall *call;
	char		lease[32];		/* the lease each extend asks for */
	int			period_ms;
	GuardError	err;			/* last failure, under lock */
} IdemHeartbeat;

/* Set *err from a printf-style message, with an empty SQLSTATE. */
static void
set_error(GuardError *err, const char *fmt,...)
{
	va_list		ap;

	err->sqlstate[0] = '\0';
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof(err->message), fmt, ap);
	va_end(ap);
}

/* Copy a libpq message into *err without its trailing newline. */
static void
set_error_text(GuardError *err, const char *sqlstate, const char *text)
{
	size_t		len;

	snprintf(err->sqlstate, sizeof(err->sqlstate), "%s",
			 sqlstate ? sqlstate : "");
	snprintf(err->message, sizeof(err->message), "%s",
			 (text && *text) ? text : "unknown error");
	len = strlen(err->message);
	while (len > 0 && (err->message[len - 1] == '\n' ||
					   err->message[len - 1] == ' '))
		err->message[--len] = '\0';
}

/* Milliseconds from now until the monotonic deadline (may be negative). */
static long
ms_until(const struct timespec *deadline)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (deadline->tv_sec - now.tv_sec) * 1000L +
		(deadline->tv_nsec - now.tv_nsec) / 1000000L;
}

/* Move *ts forward by ms milliseconds. */
static void
add_ms(struct timespec *ts, long ms)
{
	ts->tv_sec += ms / 1000;
	ts->tv_nsec += (ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L)
	{
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
}

/*
 * Wait until the connection has a complete result, at most timeout_ms
 * (0: no limit).  Returns 0 when ready (the result may be an error),
 * 1 on timeout.
 */
static int
wait_result(PGconn *conn, int timeout_ms)
{
	struct timespec deadline;

	clock_gettime(CLOCK_MONOTONIC, &deadline);
	add_ms(&deadline, timeout_ms);
	while (PQisBusy(conn))
	{
		struct pollfd pfd;
		long		remaining = -1;
		int			rc;

		if (timeout_ms > 0)
		{
			remaining = ms_until(&deadline);
			if (remaining <= 0)
				return 1;
		}
		pfd.fd = PQsocket(conn);
		pfd.events = POLLIN;
		pfd.revents = 0;
		if (pfd.fd < 0)
			return 0;
		rc = poll(&pfd, 1, (int) remaining);
		if (rc < 0 && errno != EINTR)
			return 0;
		if (rc > 0 && !PQconsumeInput(conn))
			return 0;			/* connection lost: PQgetResult says so */
	}
	return 0;
}

/*
 * Cancel the running statement; if the server does not answer soon, shut
 * the socket down so that the connection reports itself broken instead of
 * hanging.  The caller then drains the results.
 */
static void
cancel_statement(PGconn *conn)
{
	PGcancel   *cancel = PQgetCancel(conn);
	char		buf[256];

	if (cancel != NULL)
	{
		PQcancel(cancel, buf, sizeof(buf));
		PQfreeCancel(cancel);
	}
	if (wait_result(conn, CANCEL_GRACE_MS) != 0 && PQsocket(conn) >= 0)
		shutdown(PQsocket(conn), SHUT_RDWR);
}

/*
 * Run one statement with parameters and wait for its result, in text or
 * binary format (result_format 0 or 1).  Returns the statement's result
 * (tuples or command OK), or NULL with *err set.
 *
 * A result that arrives although the timeout fired is returned: the
 * statement ended before the cancel reached it.  A result followed by an
 * error (the implicit commit failed, or the connection was lost before
 * the server confirmed the end of the transaction) is returned with
 * *uncertain set and *err describing the error: the statement's effect
 * may or may not have been committed.
 */
static PGresult *
run_statement(PGconn *conn, const char *sql, int nparams,
			  const char *const *values, const int *lengths,
			  const int *formats, int result_format, int timeout_ms,
			  GuardError *err, bool *uncertain)
{
	PGresult   *ok = NULL;
	PGresult   *failed = NULL;
	PGresult   *res;
	bool		timed_out = false;

	*uncertain = false;
	if (!PQsendQueryParams(conn, sql, nparams, NULL, values, lengths,
						   formats, result_format))
	{
		set_error_text(err, NULL, PQerrorMessage(conn));
		return NULL;
	}
	if (wait_result(conn, timeout_ms) != 0)
	{
		timed_out = true;
		cancel_statement(conn);
	}
	/* Keep the statement's result and the first error after it. */
	while ((res = PQgetResult(conn)) != NULL)
	{
		ExecStatusType status = PQresultStatus(res);

		if (ok == NULL && failed == NULL &&
			(status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK))
			ok = res;
		else if (failed == NULL && status != PGRES_TUPLES_OK &&
				 status != PGRES_COMMAND_OK)
			failed = res;
		else
			PQclear(res);
	}
	if (failed != NULL)
	{
		if (timed_out && ok == NULL)
			set_error(err, "statement timed out after %d ms", timeout_ms);
		else
			set_error_text(err, PQresultErrorField(failed, PG_DIAG_SQLSTATE),
						   PQresultErrorField(failed, PG_DIAG_MESSAGE_PRIMARY) ?
						   PQresultErrorField(failed, PG_DIAG_MESSAGE_PRIMARY) :
						   PQresultErrorMessage(failed));
		PQclear(failed);
		if (ok != NULL)
			*uncertain = true;
		return ok;
	}
	if (ok == NULL)
	{
		if (timed_out)
			set_error(err, "statement timed out after %d ms", timeout_ms);
		else
			set_error_text(err, NULL, PQerrorMessage(conn));
	}
	return ok;
}

/* Run a statement that must succeed for the guard to go on; drop its result. */
static bool
run_command(PGconn *conn, const char *sql, int nparams,
			const char *const *values, int timeout_ms, GuardError *err)
{
	bool		uncertain;
	PGresult   *res = run_statement(conn, sql, nparams, values, NULL, NULL,
									0, timeout_ms, err, &uncertain);

	PQclear(res);
	return res != NULL && !uncertain;
}

/*
 * Run one guard statement in its own transaction: as a single statement,
 * or, with a test clock offset, between BEGIN and COMMIT after setting
 * idem.clock_offset for that transaction only.  Returns the result or
 * NULL with *err set; *uncertain as for run_statement (with an offset: the
 * statement answered but its COMMIT did not).
 */
static PGresult *
guard_exec(PGconn *conn, const IdemGuardOptions *opts, const char *sql,
		   int nparams, const char *const *values, const int *lengths,
		   const int *formats, int result_format, GuardError *err,
		   bool *uncertain)
{
	PGresult   *res;
	char		offset[16];
	const char *clock_values[1];
	GuardError	ignored;

	*uncertain = false;
	if (conn == NULL || PQstatus(conn) != CONNECTION_OK)
	{
		set_error_text(err, NULL, conn ? PQerrorMessage(conn) :
					   "no connection");
		return NULL;
	}
	if (PQtransactionStatus(conn) != PQTRANS_IDLE)
	{
		set_error(err, "connection is busy or inside a transaction");
		return NULL;
	}
	if (opts->clock_offset_s == 0)
		return run_statement(conn, sql, nparams, values, lengths, formats,
							 result_format, opts->timeout_ms, err, uncertain);

	snprintf(offset, sizeof(offset), "%d", opts->clock_offset_s);
	clock_values[0] = offset;
	if (!run_command(conn, "BEGIN", 0, NULL, opts->timeout_ms, err))
		return NULL;
	if (run_command(conn, SQL_CLOCK, 1, clock_values, opts->timeout_ms, err))
	{
		res = run_statement(conn, sql, nparams, values, lengths, formats,
							result_format, opts->timeout_ms, err, uncertain);
		if (res != NULL && !*uncertain)
		{
			if (!run_command(conn, "COMMIT", 0, NULL, opts->timeout_ms, err))
				*uncertain = true;
			return res;
		}
		/* Inside a transaction, a statement's error rolls it back. */
		PQclear(res);
		*uncertain = false;
	}
	if (PQstatus(conn) == CONNECTION_OK &&
		PQtransactionStatus(conn) != PQTRANS_IDLE)
		run_command(conn, "ROLLBACK", 0, NULL, opts->timeout_ms, &ignored);
	return NULL;
}

/*
 * Run one statement of a guarded call that must have ended for sure: a
 * result whose commit is uncertain counts as a failure.  Text results.
 */
static PGresult *
call_exec(PGconn *conn, const GuardCall *gc, const char *sql_fmt,
		  int nparams, const char *const *values, const int *lengths,
		  const int *formats, GuardError *err)
{
	char		sql[SQL_LEN];
	bool		uncertain;
	PGresult   *res;

	snprintf(sql, sizeof(sql), sql_fmt, gc->schema);
	res = guard_exec(conn, gc->opts, sql, nparams, values, lengths, formats,
					 0, err, &uncertain);
	if (res != NULL && uncertain)
	{
		PQclear(res);
		return NULL;
	}
	return res;
}

/* Record a failed step in the result. */
static void
fail_step(IdemResult *res, IdemStep step, const GuardError *err)
{
	res->failed = step;
	memcpy(res->sqlstate, err->sqlstate, sizeof(res->sqlstate));
	memcpy(res->message, err->message, sizeof(res->message));
}

/* True if the fault hook makes op fail; sets *err if so. */
static bool
fault_fires(const IdemGuardOptions *opts, const char *op, GuardError *err)
{
	if (opts->fault == NULL || !opts->fault(opts->fault_arg, op))
		return false;
	set_error(err, "fault injected at %s", op);
	return true;
}

/* One idem_extend call for the heartbeat; returns true if it succeeded. */
static bool
heartbeat_extend(IdemHeartbeat *hb, GuardError *err)
{
	const GuardCall *gc = hb->call;
	const char *values[4];
	PGresult   *res;

	if (fault_fires(gc->opts, "extend", err))
		return false;
	values[0] = gc->key;
	values[1] = gc->token;
	values[2] = hb->lease;
	values[3] = gc->scope;
	res = call_exec(hb->conn, gc, SQL_EXTEND, 4, values, NULL, NULL, err);
	PQclear(res);
	return res != NULL;
}

/* True if an idem_extend error means the claim is no longer ours. */
static bool
claim_gone(const GuardError *err)
{
	return strcmp(err->sqlstate, "ID002") == 0 ||
		strcmp(err->sqlstate, "ID003") == 0 ||
		strcmp(err->sqlstate, "ID004") == 0;
}

/*
 * Re-make the heartbeat's lost connection without blocking: give up after
 * one period or as soon as the heartbeat is being stopped (the next beat
 * tries again).  A host name is still resolved without a bound; use
 * hostaddr to avoid that.
 */
static void
heartbeat_reconnect(IdemHeartbeat *hb)
{
	struct timespec deadline;
	PostgresPollingStatusType st = PGRES_POLLING_WRITING;

	clock_gettime(CLOCK_MONOTONIC, &deadline);
	add_ms(&deadline, hb->period_ms);
	if (!PQresetStart(hb->conn))
		return;
	while (st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED)
	{
		struct pollfd pfd;
		long		remaining = ms_until(&deadline);
		int			rc;

		if (remaining <= 0 || __atomic_load_n(&hb->stopping, __ATOMIC_SEQ_CST))
			return;
		pfd.fd = PQsocket(hb->conn);
		if (pfd.fd < 0)
			return;
		pfd.events = (st == PGRES_POLLING_READING) ? POLLIN : POLLOUT;
		pfd.revents = 0;
		rc = poll(&pfd, 1, (int) (remaining < RECONNECT_SLICE_MS ?
								  remaining : RECONNECT_SLICE_MS));
		if (rc < 0 && errno != EINTR)
			return;
		if (rc > 0)
			st = PQresetPoll(hb->conn);
	}
}

/* Heartbeat thread: extend every period until stopped or the claim is lost. */
static void *
heartbeat_main(void *arg)
{
	IdemHeartbeat *hb = arg;
	struct timespec next;

	clock_gettime(CLOCK_MONOTONIC, &next);
	pthread_mutex_lock(&hb->lock);
	for (;;)
	{
		GuardError	err;
		bool		ok;

		add_ms(&next, hb->period_ms);
		while (!hb->stop &&
			   pthread_cond_timedwait(&hb->cond, &hb->lock, &next) != ETIMEDOUT)
			;
		if (hb->stop)
			break;
		pthread_mutex_unlock(&hb->lock);

		ok = heartbeat_extend(hb, &err);
		if (!ok && PQstatus(hb->conn) != CONNECTION_OK)
			heartbeat_reconnect(hb);

		pthread_mutex_lock(&hb->lock);
		if (ok)
			hb->extends++;
		else
		{
			hb->err = err;
			if (claim_gone(&err))
			{
				__atomic_store_n(&hb->lost, 1, __ATOMIC_SEQ_CST);
				break;
			}
		}
	}
	pthread_mutex_unlock(&hb->lock);
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
	pthread_condattr_t attr;

	if (hb == NULL)
	{
		set_error(err, "out of memory");
		return NULL;
	}
	hb->conn = PQconnectdb(gc->opts->heartbeat_conninfo);
	if (PQstatus(hb->conn) != CONNECTION_OK)
	{
		set_error_text(err, NULL, PQerrorMessage(hb->conn));
		PQfinish(hb->conn);
		free(hb);
		return NULL;
	}
	hb->call = gc;
	snprintf(hb->lease, sizeof(hb->lease), "%ld milliseconds", gc->lease_ms);
	hb->period_ms = (int) (gc->lease_ms / 3);
	if (hb->period_ms < 1)
		hb->period_ms = 1;
	pthread_mutex_init(&hb->lock, NULL);
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&hb->cond, &attr);
	pthread_condattr_destroy(&attr);
	if (pthread_create(&hb->thread, NULL, heartbeat_main, hb) != 0)
	{
		set_error(err, "could not start the heartbeat thread");
		pthread_cond_destroy(&hb->cond);
		pthread_mutex_destroy(&hb->lock);
		PQfinish(hb->conn);
		free(hb);
		return NULL;
	}
	return hb;
}

/* Stop and free the heartbeat; report what it did in *res. */
static void
heartbeat_stop(IdemHeartbeat *hb, IdemResult *res)
{
	__atomic_store_n(&hb->stopping, 1, __ATOMIC_SEQ_CST);
	pthread_mutex_lock(&hb->lock);
	hb->stop = true;
	pthread_cond_signal(&hb->cond);
	pthread_mutex_unlock(&hb->lock);
	pthread_join(hb->thread, NULL);

	res->extends = hb->extends;
	res->superseded = __atomic_load_n(&hb->lost, __ATOMIC_SEQ_CST) != 0;
	pthread_cond_destroy(&hb->cond);
	pthread_mutex_destroy(&hb->lock);
	PQfinish(hb->conn);
	free(hb);
}

/* Give up the claim with idem_release; returns true if the key is free. */
static bool
release_claim(const GuardCall *gc, GuardError *err)
{
	const char *values[3];
	PGresult   *res;
	bool		released;

	if (fault_fires(gc->opts, "release", err))
		return false;
	values[0] = gc->key;
	values[1] = gc->token;
	values[2] = gc->scope;
	res = call_exec(gc->conn, gc, SQL_RELEASE, 3, values, NULL, NULL, err);
	if (res == NULL)
		return false;
	released = PQntuples(res) == 1 && strcmp(PQgetvalue(res, 0, 0), "t") == 0;
	if (!released)
		set_error(err, "idem_release found no claim to release");
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

	if (fault_fires(gc->opts, "complete", err))
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
	res = call_exec(gc->conn, gc, SQL_COMPLETE, 7, values, lengths, formats,
					err);
	PQclear(res);
	return res != NULL;
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
	if (fault_fires(gc->opts, "replay", &ignored))
		return false;
	if (PQgetisnull(row, 0, 4))
		return idem_response_set(resp, (int) status, NULL, 0) == 0;
	return idem_response_set(resp, (int) status, PQgetvalue(row, 0, 4),
							 (size_t) PQgetlength(row, 0, 4)) == 0;
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
		set_error(err, "schema name \"%.63s...\" is longer than %d bytes",
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
guard_claim(GuardCall *gc, IdemResult *res)
{
	const char *values[6];
	char		sql[SQL_LEN];
	PGresult   *row;
	GuardError	err;
	bool		uncertain;
	int64_t		token;
	int64_t		lease_ms;
	const char *state;

	/* Any failure means no dedup protection, so do not run. */
	res->outcome = IDEM_UNAVAILABLE;
	if (fault_fires(gc->opts, "begin", &err))
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
	snprintf(sql, sizeof(sql), SQL_BEGIN, gc->schema);
	row = guard_exec(gc->conn, gc->opts, sql, 6, values, NULL, NULL, 1, &err,
					 &uncertain);
	if (row == NULL)
	{
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return false;
	}
	if (PQntuples(row) != 1 || PQnfields(row) != 6 ||
		PQgetisnull(row, 0, 1))
	{
		PQclear(row);
		set_error(&err, "idem_begin returned an unexpected result");
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
				set_error(&err, "out of memory copying the stored response");
				fail_step(res, IDEM_STEP_REPLAY, &err);
			}
		}
		else if (strcmp(state, "CONFLICT") == 0)
			res->outcome = IDEM_CONFLICT;
		else
			res->outcome = IDEM_IN_FLIGHT;
		PQclear(row);
		return false;
	}

	if (!row_int(row, 2, 8, &token) || !row_int(row, 5, 8, &lease_ms))
	{
		PQclear(row);
		set_error(&err, "idem_begin returned a claim without token or lease");
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return false;
	}
	PQclear(row);
	res->token = token;
	snprintf(gc->token, sizeof(gc->token), "%" PRId64, token);
	gc->lease_ms = (long) (lease_ms > 0 ? lease_ms : 1);

	if (uncertain)
	{
		/* Claimed, but maybe not committed: give it up, do not run. */
		GuardError	rerr;

		res->released = release_claim(gc, &rerr);
		snprintf(res->message, sizeof(res->message),
				 "claim not confirmed (%.150s); %s", err.message,
				 res->released ? "released" : "not released");
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
guard_run(GuardCall *gc, IdemHandler handler, void *arg, IdemResult *res,
		  int *herr)
{
	IdemClaim	claim;
	IdemHeartbeat *hb = NULL;
	GuardError	err;

	claim.key = gc->key;
	claim.scope = gc->scope;
	claim.token = res->token;
	claim.heartbeat = NULL;

	/* A long handler without its heartbeat could lose the key: give up. */
	if (gc->opts->heartbeat_conninfo != NULL)
	{
		hb = heartbeat_start(gc, &err);
		if (hb == NULL)
		{
			GuardError	rerr;

			fail_step(res, IDEM_STEP_HEARTBEAT, &err);
			res->released = release_claim(gc, &rerr);
			return false;
		}
		claim.heartbeat = hb;
	}

	res->outcome = IDEM_EXECUTED;
	*herr = handler(&claim, arg, &res->resp);
	if (hb != NULL)
		heartbeat_stop(hb, res);
	return true;
}

/*
 * After the handler: release the claim if it failed (unless told to keep
 * it), or store its response.
 */
static void
guard_finish(GuardCall *gc, int herr, IdemResult *res)
{
	GuardError	err;

	if (herr != 0)
	{
		GuardError	rerr;

		set_error(&err, "handler failed (%d)", herr);
		fail_step(res, IDEM_STEP_HANDLER, &err);
		if (gc->opts->keep_claim_on_error)
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

	if (!complete_claim(gc, &res->resp, &err))
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
	if (guard_claim(&gc, res) && guard_run(&gc, handler, arg, res, &herr))
		guard_finish(&gc, herr, res);
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
		__atomic_load_n(&claim->heartbeat->lost, __ATOMIC_SEQ_CST) != 0;
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
