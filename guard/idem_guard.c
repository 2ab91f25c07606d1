/*-------------------------------------------------------------------------
 *
 * idem_guard.c
 *	  The client guard: claim, run the handler, store the response.
 *
 * Every server call is one statement in its own transaction (or, when
 * the test clock is moved, one short explicit transaction), sent with
 * PQexecParams-style parameters and waited for with an optional client
 * side timeout.  A claim that cannot be made for any reason makes the
 * outcome UNAVAILABLE and the handler is not run.  After the handler ran,
 * the response is stored with the claim's fencing token; if that fails
 * the outcome stays EXECUTED, the failure is reported and the key stays
 * PROCESSING until its lease ends.
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

#define SQL_BEGIN \
	"SELECT claimed, state, token, status, body" \
	" FROM idem_begin($1, $2, $3::interval, $4::interval, $5, $6::boolean)"
#define SQL_COMPLETE \
	"SELECT idem_complete($1, $2, $3::integer, $4::bytea, $5::bigint," \
	" $6::interval, $7)"
#define SQL_RELEASE \
	"SELECT idem_release($1, $2::bigint, $3)"
#define SQL_EXTEND \
	"SELECT idem_extend($1, $2::bigint, $3::interval, $4)"
#define SQL_CLOCK \
	"SELECT pg_catalog.set_config('idem.clock_offset', $1, true)"

/* Heartbeat period when the lease is the server's default (60 s). */
#define DEFAULT_HEARTBEAT_MS	20000

/* How long to wait for a cancelled statement before dropping the link. */
#define CANCEL_GRACE_MS			1000

/* Why a server call failed. */
typedef struct GuardError
{
	char		sqlstate[6];
	char		message[256];
} GuardError;

/* A running heartbeat: a thread extending one claim's lease. */
typedef struct IdemHeartbeat
{
	pthread_t	thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool		stop;			/* under lock */
	int			lost;			/* atomic: token superseded or claim gone */
	int			extends;		/* under lock */
	PGconn	   *conn;
	const IdemGuardOptions *opts;
	const char *key;
	const char *scope;
	const char *token;
	const char *lease;
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
 * Run one statement with parameters and wait for its result.  Returns the
 * result (tuples or command OK) or NULL with *err set.
 */
static PGresult *
run_statement(PGconn *conn, const char *sql, int nparams,
			  const char *const *values, const int *lengths,
			  const int *formats, int timeout_ms, GuardError *err)
{
	PGresult   *first = NULL;
	PGresult   *res;
	bool		timed_out = false;
	ExecStatusType status;

	if (!PQsendQueryParams(conn, sql, nparams, NULL, values, lengths,
						   formats, 0))
	{
		set_error_text(err, NULL, PQerrorMessage(conn));
		return NULL;
	}
	if (wait_result(conn, timeout_ms) != 0)
	{
		timed_out = true;
		cancel_statement(conn);
	}
	/* Keep the first result; an error result may be followed by others. */
	while ((res = PQgetResult(conn)) != NULL)
	{
		if (first == NULL)
			first = res;
		else
			PQclear(res);
	}
	if (timed_out)
	{
		PQclear(first);
		set_error(err, "statement timed out after %d ms", timeout_ms);
		return NULL;
	}
	if (first == NULL)
	{
		set_error_text(err, NULL, PQerrorMessage(conn));
		return NULL;
	}
	status = PQresultStatus(first);
	if (status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK)
		return first;
	set_error_text(err, PQresultErrorField(first, PG_DIAG_SQLSTATE),
				   PQresultErrorField(first, PG_DIAG_MESSAGE_PRIMARY) ?
				   PQresultErrorField(first, PG_DIAG_MESSAGE_PRIMARY) :
				   PQresultErrorMessage(first));
	PQclear(first);
	return NULL;
}

/* Run a statement that must succeed for the guard to go on; drop its result. */
static bool
run_command(PGconn *conn, const char *sql, int nparams,
			const char *const *values, int timeout_ms, GuardError *err)
{
	PGresult   *res = run_statement(conn, sql, nparams, values, NULL, NULL,
									timeout_ms, err);

	PQclear(res);
	return res != NULL;
}

/*
 * Run one guard statement in its own transaction: as a single statement,
 * or, with a test clock offset, between BEGIN and COMMIT after setting
 * idem.clock_offset for that transaction only.  Returns the result or
 * NULL with *err set.
 */
static PGresult *
guard_exec(PGconn *conn, const IdemGuardOptions *opts, const char *sql,
		   int nparams, const char *const *values, const int *lengths,
		   const int *formats, GuardError *err)
{
	PGresult   *res;
	char		offset[16];
	const char *clock_values[1];
	GuardError	ignored;

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
							 opts->timeout_ms, err);

	snprintf(offset, sizeof(offset), "%d", opts->clock_offset_s);
	clock_values[0] = offset;
	if (!run_command(conn, "BEGIN", 0, NULL, opts->timeout_ms, err))
		return NULL;
	if (run_command(conn, SQL_CLOCK, 1, clock_values, opts->timeout_ms, err))
	{
		res = run_statement(conn, sql, nparams, values, lengths, formats,
							opts->timeout_ms, err);
		if (res != NULL)
		{
			if (run_command(conn, "COMMIT", 0, NULL, opts->timeout_ms, err))
				return res;
			PQclear(res);
			return NULL;
		}
	}
	if (PQstatus(conn) == CONNECTION_OK &&
		PQtransactionStatus(conn) != PQTRANS_IDLE)
		run_command(conn, "ROLLBACK", 0, NULL, opts->timeout_ms, &ignored);
	return NULL;
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
	const char *values[4];
	PGresult   *res;

	if (fault_fires(hb->opts, "extend", err))
		return false;
	values[0] = hb->key;
	values[1] = hb->token;
	values[2] = hb->lease;
	values[3] = hb->scope;
	res = guard_exec(hb->conn, hb->opts, SQL_EXTEND, 4, values, NULL, NULL,
					 err);
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
		if (!ok && PQstatus(hb->conn) == CONNECTION_BAD)
			PQreset(hb->conn);

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
 * Connect and start the heartbeat for a claim.  Returns NULL with *err
 * set if the connection or the thread cannot be made.
 */
static IdemHeartbeat *
heartbeat_start(const IdemGuardOptions *opts, const char *key,
				const char *scope, const char *token, const char *lease,
				GuardError *err)
{
	IdemHeartbeat *hb = calloc(1, sizeof(IdemHeartbeat));
	pthread_condattr_t attr;

	if (hb == NULL)
	{
		set_error(err, "out of memory");
		return NULL;
	}
	hb->conn = PQconnectdb(opts->heartbeat_conninfo);
	if (PQstatus(hb->conn) != CONNECTION_OK)
	{
		set_error_text(err, NULL, PQerrorMessage(hb->conn));
		PQfinish(hb->conn);
		free(hb);
		return NULL;
	}
	hb->opts = opts;
	hb->key = key;
	hb->scope = scope;
	hb->token = token;
	hb->lease = lease;
	hb->period_ms = opts->lease_ms > 0 ? opts->lease_ms / 3 : DEFAULT_HEARTBEAT_MS;
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

/* Give up a claim with idem_release; returns true if the key is free. */
static bool
release_claim(PGconn *conn, const IdemGuardOptions *opts, const char *key,
			  const char *scope, const char *token, GuardError *err)
{
	const char *values[3];
	PGresult   *res;
	bool		released;

	if (fault_fires(opts, "release", err))
		return false;
	values[0] = key;
	values[1] = token;
	values[2] = scope;
	res = guard_exec(conn, opts, SQL_RELEASE, 3, values, NULL, NULL, err);
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
complete_claim(PGconn *conn, const IdemGuardOptions *opts, const char *key,
			   const char *fingerprint, const char *scope, const char *token,
			   const char *retention, const IdemResponse *resp,
			   GuardError *err)
{
	const char *values[7];
	int			lengths[7] = {0, 0, 0, 0, 0, 0, 0};
	int			formats[7] = {0, 0, 0, 1, 0, 0, 0};
	char		status[16];
	PGresult   *res;

	if (fault_fires(opts, "complete", err))
		return false;
	snprintf(status, sizeof(status), "%d", resp->status);
	values[0] = key;
	values[1] = fingerprint;
	values[2] = status;
	values[3] = (const char *) resp->body;
	lengths[3] = (int) resp->body_len;
	values[4] = token;
	values[5] = retention;
	values[6] = scope;
	res = guard_exec(conn, opts, SQL_COMPLETE, 7, values, lengths, formats,
					 err);
	PQclear(res);
	return res != NULL;
}

/* Copy a stored response out of an idem_begin row. */
static void
copy_response(PGresult *row, IdemResponse *resp)
{
	resp->status = PQgetisnull(row, 0, 3) ? 0 : atoi(PQgetvalue(row, 0, 3));
	if (!PQgetisnull(row, 0, 4))
	{
		size_t		len;
		unsigned char *raw = PQunescapeBytea((const unsigned char *)
											 PQgetvalue(row, 0, 4), &len);

		if (raw != NULL)
		{
			idem_response_set(resp, resp->status, raw, len);
			PQfreemem(raw);
		}
	}
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
	const char *scope;
	char		lease_buf[32];
	char		retention_buf[32];
	char		token_buf[24];
	const char *lease = NULL;
	const char *retention = NULL;
	const char *values[6];
	PGresult   *row;
	GuardError	err;
	IdemClaim	claim;
	IdemHeartbeat *hb = NULL;
	int			herr;
	const char *state;

	if (opts == NULL)
	{
		idem_guard_options_init(&defaults);
		opts = &defaults;
	}
	memset(res, 0, sizeof(IdemResult));
	scope = opts->scope ? opts->scope : "";
	if (opts->lease_ms > 0)
	{
		snprintf(lease_buf, sizeof(lease_buf), "%d milliseconds", opts->lease_ms);
		lease = lease_buf;
	}
	if (opts->retention_ms > 0)
	{
		snprintf(retention_buf, sizeof(retention_buf), "%d milliseconds",
				 opts->retention_ms);
		retention = retention_buf;
	}

	/* Claim: any failure means no dedup protection, so do not run. */
	res->outcome = IDEM_UNAVAILABLE;
	if (fault_fires(opts, "begin", &err))
	{
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return res->outcome;
	}
	values[0] = key;
	values[1] = fingerprint;
	values[2] = lease;
	values[3] = retention;
	values[4] = scope;
	values[5] = opts->wait ? "true" : "false";
	row = guard_exec(conn, opts, SQL_BEGIN, 6, values, NULL, NULL, &err);
	if (row == NULL)
	{
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return res->outcome;
	}
	if (PQntuples(row) != 1 || PQnfields(row) != 5)
	{
		PQclear(row);
		set_error(&err, "idem_begin returned an unexpected result");
		fail_step(res, IDEM_STEP_BEGIN, &err);
		return res->outcome;
	}

	state = PQgetvalue(row, 0, 1);
	if (strcmp(PQgetvalue(row, 0, 0), "t") != 0)
	{
		if (strcmp(state, "DONE") == 0)
		{
			copy_response(row, &res->resp);
			res->outcome = IDEM_REPLAYED;
		}
		else if (strcmp(state, "CONFLICT") == 0)
			res->outcome = IDEM_CONFLICT;
		else
			res->outcome = IDEM_IN_FLIGHT;
		PQclear(row);
		return res->outcome;
	}
	res->token = strtoll(PQgetvalue(row, 0, 2), NULL, 10);
	snprintf(token_buf, sizeof(token_buf), "%" PRId64, res->token);
	PQclear(row);

	claim.key = key;
	claim.scope = scope;
	claim.token = res->token;
	claim.heartbeat = NULL;

	/* A long handler without its heartbeat could lose the key: give up. */
	if (opts->heartbeat_conninfo != NULL)
	{
		hb = heartbeat_start(opts, key, scope, token_buf, lease, &err);
		if (hb == NULL)
		{
			GuardError	rerr;

			fail_step(res, IDEM_STEP_HEARTBEAT, &err);
			res->released = release_claim(conn, opts, key, scope, token_buf,
										  &rerr);
			return res->outcome;
		}
		claim.heartbeat = hb;
	}

	res->outcome = IDEM_EXECUTED;
	herr = handler(&claim, arg, &res->resp);
	if (hb != NULL)
		heartbeat_stop(hb, res);

	if (herr != 0)
	{
		GuardError	rerr;

		set_error(&err, "handler failed (%d)", herr);
		fail_step(res, IDEM_STEP_HANDLER, &err);
		if (!opts->keep_claim_on_error)
		{
			res->released = release_claim(conn, opts, key, scope, token_buf,
										  &rerr);
			if (!res->released)
			{
				memcpy(res->sqlstate, rerr.sqlstate, sizeof(res->sqlstate));
				snprintf(res->message, sizeof(res->message),
						 "handler failed (%d); release failed: %.200s",
						 herr, rerr.message);
			}
		}
		return res->outcome;
	}

	if (!complete_claim(conn, opts, key, fingerprint, scope, token_buf,
						retention, &res->resp, &err))
		fail_step(res, IDEM_STEP_COMPLETE, &err);
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
