/*-------------------------------------------------------------------------
 *
 * guard_conn.c
 *	  The guard's connection core: send a statement, wait for its result,
 *	  cancel it, re-make a lost connection, none of it blocking past the
 *	  deadline the caller passes down.
 *
 * A statement is sent in non-blocking mode (PQsetnonblocking, then
 * PQsendQueryParams and PQflush until the message is out), and its
 * results are read only when poll() on PQsocket says they have arrived,
 * so that PQgetResult never waits.  The connection's blocking mode is
 * restored afterwards.
 *
 * At GUARD_CANCEL_GRACE_MS before the deadline, or when another thread
 * asks through a GuardStop, the statement is cancelled.  libpq 17 and
 * later send the cancel request without blocking (PQcancelStart and
 * PQcancelPoll), given up at the deadline.  Older libpq has only PQcancel,
 * which blocks in connect and recv for as long as the server, or a proxy
 * in front of it, holds the request: it runs in a detached thread with a
 * PGcancel of its own, which it frees when it is done, and nobody waits
 * for it.  Either way, a statement that has not ended by the deadline has
 * its socket shut down, so that the connection reports itself broken
 * instead of hanging.
 *
 * A cancel request goes to the address the connection was made to; a
 * reconnect (PQresetStart) still resolves host names without a bound: use
 * hostaddr where DNS may hang.
 *
 *-------------------------------------------------------------------------
 */
#include "guard_conn.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

/* A call and its settings go in one pipeline (libpq 14 and later). */
#ifndef LIBPQ_HAS_PIPELINING
#error "the idem guard needs libpq 14 or later (pipeline mode)"
#endif

/* Longest wait between two looks at a stop request. */
#define STOP_SLICE_MS			50

/*
 * Set idem.clock_offset, the timeouts, or both, for the current
 * transaction only.
 */
#define SQL_CLOCK \
	"SELECT pg_catalog.set_config('idem.clock_offset', $1::pg_catalog.text," \
	" true)"
/*
 * The timeouts: $N, or the session's own where they are shorter.
 */
#define SQL_SET_TIMEOUTS(N) \
	" pg_catalog.set_config('lock_timeout', CASE WHEN s.l = '0' OR" \
	" s.l::pg_catalog.interval > ($" N "::pg_catalog.text)::pg_catalog.interval" \
	" THEN $" N "::pg_catalog.text ELSE s.l END, true)," \
	" pg_catalog.set_config('statement_timeout', CASE WHEN s.st = '0' OR" \
	" s.st::pg_catalog.interval > ($" N "::pg_catalog.text)::pg_catalog.interval" \
	" THEN $" N "::pg_catalog.text ELSE s.st END, true)" \
	" FROM (SELECT pg_catalog.current_setting('lock_timeout') AS l," \
	" pg_catalog.current_setting('statement_timeout') AS st) s"
#define SQL_TIMEOUTS		"SELECT" SQL_SET_TIMEOUTS("1")
#define SQL_CLOCK_TIMEOUTS \
	"SELECT pg_catalog.set_config('idem.clock_offset', $1::pg_catalog.text," \
	" true)," SQL_SET_TIMEOUTS("2")

/* What a wait for a result ended on. */
typedef enum GuardWait
{
	GUARD_READY,				/* a result (maybe an error) can be read */
	GUARD_TIMEOUT,				/* the time given ran out */
	GUARD_STOPPED				/* another thread asked to stop */
} GuardWait;

/* Set *err from a printf-style message, with an empty SQLSTATE. */
void
idem_guard_error(GuardError *err, const char *fmt,...)
{
	va_list		ap;

	err->sqlstate[0] = '\0';
	va_start(ap, fmt);
	vsnprintf(err->message, sizeof(err->message), fmt, ap);
	va_end(ap);
}

/* Copy a libpq message into *err without its trailing newline. */
void
idem_guard_error_text(GuardError *err, const char *sqlstate, const char *text)
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

/* Move *ts by ms milliseconds (either way). */
void
idem_guard_time_add(struct timespec *ts, long ms)
{
	ts->tv_sec += ms / 1000;
	ts->tv_nsec += (ms % 1000) * 1000000L;
	if (ts->tv_nsec >= 1000000000L)
	{
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000L;
	}
	else if (ts->tv_nsec < 0)
	{
		ts->tv_sec--;
		ts->tv_nsec += 1000000000L;
	}
}

/* Set *ts to ms milliseconds from now on the monotonic clock. */
void
idem_guard_time_after(struct timespec *ts, long ms)
{
	clock_gettime(CLOCK_MONOTONIC, ts);
	idem_guard_time_add(ts, ms);
}

/* Milliseconds from now until the deadline (may be negative). */
long
idem_guard_ms_until(const struct timespec *deadline)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (deadline->tv_sec - now.tv_sec) * 1000L +
		(deadline->tv_nsec - now.tv_nsec) / 1000000L;
}

/*
 * The deadline of a statement given timeout_ms to answer: it is cancelled
 * then, and given up GUARD_CANCEL_GRACE_MS later.
 */
void
idem_guard_statement_deadline(struct timespec *deadline, int timeout_ms)
{
	idem_guard_time_after(deadline, (long) timeout_ms + GUARD_CANCEL_GRACE_MS);
}

/* Prepare a stop request that nobody has made yet. */
void
idem_guard_stop_init(GuardStop *stop)
{
	memset(&stop->deadline, 0, sizeof(stop->deadline));
	atomic_init(&stop->requested, false);
}

/*
 * Ask the thread waiting under stop to give up its statement within
 * grace_ms from now.
 */
void
idem_guard_stop_request(GuardStop *stop, long grace_ms)
{
	idem_guard_time_after(&stop->deadline, grace_ms);
	atomic_store_explicit(&stop->requested, true, memory_order_release);
}

/* True once a stop was requested (NULL: never); its deadline is then set. */
bool
idem_guard_stop_requested(GuardStop *stop)
{
	return stop != NULL &&
		atomic_load_explicit(&stop->requested, memory_order_acquire);
}

/*
 * How long a poll may sleep before until (NULL: no limit) or the next look
 * at stop: -1 for ever, 0 if until has passed.
 */
static int
poll_ms(const struct timespec *until, GuardStop *stop)
{
	long		ms = -1;

	if (until != NULL)
	{
		ms = idem_guard_ms_until(until);
		if (ms <= 0)
			return 0;
	}
	if (stop != NULL && (ms < 0 || ms > STOP_SLICE_MS))
		ms = STOP_SLICE_MS;
	return (int) ms;
}

/*
 * Push the statement queued by PQsendQueryParams out to the server, until
 * until.  False with *err set if it could not be sent in time.
 */
static bool
flush_statement(PGconn *conn, const struct timespec *until, GuardStop *stop,
				GuardError *err)
{
	for (;;)
	{
		struct pollfd pfd;
		int			timeout;
		int			rc = PQflush(conn);

		if (rc == 0)
			return true;
		if (rc < 0)
		{
			idem_guard_error_text(err, NULL, PQerrorMessage(conn));
			return false;
		}
		timeout = poll_ms(until, stop);
		if (idem_guard_stop_requested(stop))
		{
			idem_guard_error(err, "statement stopped");
			return false;
		}
		if (timeout == 0)
		{
			idem_guard_error(err, "statement timed out");
			err->timed_out = true;
			return false;
		}
		pfd.fd = PQsocket(conn);
		pfd.events = POLLIN | POLLOUT;
		pfd.revents = 0;
		rc = poll(&pfd, 1, timeout);
		if (rc < 0 && errno != EINTR)
		{
			idem_guard_error(err, "could not wait for the server: %s",
						strerror(errno));
			return false;
		}
		/* The server may answer early (an error): read it, then go on. */
		if (rc > 0 && (pfd.revents & POLLIN) && !PQconsumeInput(conn))
		{
			idem_guard_error_text(err, NULL, PQerrorMessage(conn));
			return false;
		}
	}
}

/*
 * Shut the connection's socket down and read to its end, so that
 * PQgetResult reports the broken connection at once instead of waiting.
 */
static void
give_up(PGconn *conn)
{
	if (PQsocket(conn) >= 0)
		shutdown(PQsocket(conn), SHUT_RDWR);
	while (PQisBusy(conn) && PQconsumeInput(conn))
		;
}

/* Drop the results of a connection given up, a pipeline's too. */
static void
drain(PGconn *conn)
{
	PGresult   *res;

	for (;;)
	{
		res = PQgetResult(conn);
		if (res != NULL)
			PQclear(res);
		else if (PQpipelineStatus(conn) == PQ_PIPELINE_OFF ||
				 PQstatus(conn) != CONNECTION_OK ||
				 PQexitPipelineMode(conn))
			break;
	}
}

/*
 * Wait until a result can be read without blocking, until until.  What
 * has arrived by then is read, once, before a timeout or a stop is told.
 */
static GuardWait
wait_result(PGconn *conn, const struct timespec *until, GuardStop *stop)
{
	while (PQisBusy(conn))
	{
		struct pollfd pfd;
		bool		stopped = idem_guard_stop_requested(stop);
		int			timeout = stopped ? 0 : poll_ms(until, stop);
		int			rc;

		pfd.fd = PQsocket(conn);
		if (pfd.fd < 0)
			break;
		pfd.events = POLLIN;
		pfd.revents = 0;
		rc = poll(&pfd, 1, timeout);
		if ((rc < 0 && errno != EINTR) ||
			(rc > 0 && !PQconsumeInput(conn)))
			give_up(conn);		/* PQgetResult reports it */
		else if (stopped && PQisBusy(conn))
			return GUARD_STOPPED;
		else if (timeout == 0 && PQisBusy(conn))
			return GUARD_TIMEOUT;
	}
	return GUARD_READY;
}

/*
 * libpq-fe.h defines LIBPQ_HAS_ASYNC_CANCEL from libpq 17 on.  It describes
 * the libpq the guard is built against, which PG_VERSION_NUM (of the
 * server's headers) need not.
 */
#ifdef LIBPQ_HAS_ASYNC_CANCEL

/*
 * Send a cancel request for conn's statement without blocking: poll the
 * cancel connection until the server has taken the request or the
 * deadline passes.
 */
static void
cancel_request(PGconn *conn, const struct timespec *deadline)
{
	PGcancelConn *cancel = PQcancelCreate(conn);
	PostgresPollingStatusType st = PGRES_POLLING_WRITING;

	if (cancel == NULL)
		return;
	if (PQcancelStatus(cancel) != CONNECTION_BAD && PQcancelStart(cancel))
	{
		while (st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED)
		{
			struct pollfd pfd;
			long		remaining = idem_guard_ms_until(deadline);
			int			rc;

			if (remaining <= 0)
				break;
			pfd.fd = PQcancelSocket(cancel);
			if (pfd.fd < 0)
				break;
			pfd.events = (st == PGRES_POLLING_READING) ? POLLIN : POLLOUT;
			pfd.revents = 0;
			rc = poll(&pfd, 1, (int) remaining);
			if (rc < 0 && errno != EINTR)
				break;
			if (rc > 0)
				st = PQcancelPoll(cancel);
		}
	}
	PQcancelFinish(cancel);
}

#else

/* Detached thread: deliver one cancel request, however long it takes. */
static void *
cancel_main(void *arg)
{
	PGcancel   *cancel = arg;
	char		errbuf[256];

	(void) PQcancel(cancel, errbuf, sizeof(errbuf));
	PQfreeCancel(cancel);
	return NULL;
}

/*
 * Send a cancel request for conn's statement from a detached thread, as
 * PQcancel blocks: the caller waits for the statement's end, not for the
 * request.  The thread owns its PGcancel, so nothing it uses is freed
 * under it, and runs with every signal blocked, so that the process's
 * signals (and a SIGPIPE from the request) stay with the application.
 */
static void
cancel_request(PGconn *conn, const struct timespec *deadline)
{
	PGcancel   *cancel = PQgetCancel(conn);
	pthread_attr_t attr;
	pthread_t	thread;
	sigset_t	all;
	sigset_t	saved;

	(void) deadline;
	if (cancel == NULL)
		return;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &saved);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&thread, &attr, cancel_main, cancel) != 0)
		PQfreeCancel(cancel);
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &saved, NULL);
}

#endif							/* LIBPQ_HAS_ASYNC_CANCEL */

/* The earlier of two deadlines (a NULL one is no limit). */
static const struct timespec *
earlier(const struct timespec *a, const struct timespec *b)
{
	if (a == NULL)
		return b;
	if (b == NULL)
		return a;
	if (a->tv_sec != b->tv_sec)
		return a->tv_sec < b->tv_sec ? a : b;
	return a->tv_nsec <= b->tv_nsec ? a : b;
}

/*
 * Send st, after pre unless pre is NULL: with pre, both go in one pipeline
 * ending in a single Sync, one round trip.  The server runs them in one
 * implicit transaction, which commits at the Sync when both succeed; an
 * error of pre skips st.  False with conn's error message if libpq could
 * not queue them.
 */
static bool
send_statements(PGconn *conn, const GuardStatement *pre,
				const GuardStatement *st)
{
	if (pre == NULL)
		return PQsendQueryParams(conn, st->sql, st->nparams, NULL, st->values,
								 st->lengths, st->formats, st->result_format);
	return PQenterPipelineMode(conn) &&
		PQsendQueryParams(conn, pre->sql, pre->nparams, NULL, pre->values,
						  pre->lengths, pre->formats, pre->result_format) &&
		PQsendQueryParams(conn, st->sql, st->nparams, NULL, st->values,
						  st->lengths, st->formats, st->result_format) &&
		PQpipelineSync(conn);
}

/*
 * Run one statement and read its results, within the deadline, after the
 * statement pre in the same implicit transaction (NULL: none; see
 * send_statements).  Returns the statement's result (tuples or command
 * OK), or NULL with *err set; pre's result is dropped, and an error of
 * pre is the call's.
 *
 * A result that arrives although the statement was cancelled is returned:
 * it ended before the cancel reached it.  A result followed by an error
 * (the implicit commit failed, or the connection was lost before the
 * server confirmed the end of the transaction) is returned with
 * *uncertain set and *err describing the error: the statement's effect
 * may or may not have been committed.
 */
static PGresult *
run_statement(PGconn *conn, const GuardStatement *pre,
			  const GuardStatement *st, const struct timespec *deadline,
			  GuardStop *stop, GuardError *err, bool *uncertain)
{
	struct timespec cancel_at;
	const struct timespec *until = deadline;
	bool		was_blocking = !PQisnonblocking(conn);
	bool		cut = false;
	GuardWait	why = GUARD_READY;
	PGresult   *ok = NULL;
	PGresult   *failed = NULL;
	PGresult   *res;
	bool		pre_result = (pre != NULL);	/* pre's result still to come */
	bool		synced = (pre == NULL); /* the pipeline's end was read */

	*uncertain = false;
	/* Leave the grace for the cancel, unless it is already eaten into. */
	if (deadline != NULL)
	{
		cancel_at = *deadline;
		idem_guard_time_add(&cancel_at, -GUARD_CANCEL_GRACE_MS);
		if (idem_guard_ms_until(&cancel_at) > 0)
			until = &cancel_at;
	}
	if (PQsetnonblocking(conn, 1) != 0 || !send_statements(conn, pre, st))
	{
		idem_guard_error_text(err, NULL, PQerrorMessage(conn));
		if (PQpipelineStatus(conn) != PQ_PIPELINE_OFF)
		{
			/* Part of the pipeline may be queued: the connection is done for. */
			give_up(conn);
			drain(conn);
		}
		if (was_blocking && PQstatus(conn) == CONNECTION_OK)
			PQsetnonblocking(conn, 0);
		return NULL;
	}
	if (!flush_statement(conn, until, stop, err))
	{
		/* Half a message on the wire: the connection is done for. */
		give_up(conn);
		drain(conn);
		return NULL;
	}

	/* Keep the statement's result and the first error after it. */
	for (;;)
	{
		GuardWait	w = wait_result(conn, until, stop);
		ExecStatusType status;

		if (w != GUARD_READY)
		{
			if (!cut)
			{
				/* Cancel, and give the statement until the deadline. */
				cut = true;
				why = w;
				until = (w == GUARD_STOPPED) ?
					earlier(deadline, &stop->deadline) : deadline;
				stop = NULL;
				if (idem_guard_ms_until(until) > 0)
					cancel_request(conn, until);
			}
			else
				give_up(conn);
			continue;
		}
		res = PQgetResult(conn);
		if (res == NULL)
		{
			/* In a pipeline, NULL ends one statement's results. */
			if (synced || PQstatus(conn) != CONNECTION_OK)
				break;
			continue;
		}
		status = PQresultStatus(res);
		if (status == PGRES_PIPELINE_SYNC)
			synced = true;
		if (pre_result &&
			(status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK))
		{
			pre_result = false;
			PQclear(res);
			continue;
		}
		pre_result = false;
		if (status == PGRES_PIPELINE_SYNC || status == PGRES_PIPELINE_ABORTED)
			PQclear(res);	/* the end, or st skipped after pre's error */
		else if (ok == NULL && failed == NULL &&
			(status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK))
			ok = res;
		else if (failed == NULL && status != PGRES_TUPLES_OK &&
				 status != PGRES_COMMAND_OK)
			failed = res;
		else
			PQclear(res);
	}
	if (pre != NULL && PQstatus(conn) == CONNECTION_OK &&
		!PQexitPipelineMode(conn) && failed == NULL)
		failed = PQmakeEmptyPGresult(conn, PGRES_FATAL_ERROR);
	if (was_blocking && PQstatus(conn) == CONNECTION_OK)
		PQsetnonblocking(conn, 0);

	if (ok == NULL && cut)
	{
		if (why == GUARD_STOPPED)
			idem_guard_error(err, "statement stopped");
		else
		{
			idem_guard_error(err, "statement timed out");
			err->timed_out = true;
		}
	}
	else if (failed != NULL)
		idem_guard_error_text(err, PQresultErrorField(failed, PG_DIAG_SQLSTATE),
						 PQresultErrorField(failed, PG_DIAG_MESSAGE_PRIMARY) ?
						 PQresultErrorField(failed, PG_DIAG_MESSAGE_PRIMARY) :
						 PQresultErrorMessage(failed));
	else if (ok == NULL)
		idem_guard_error_text(err, NULL, PQerrorMessage(conn));
	*uncertain = (ok != NULL && failed != NULL);
	PQclear(failed);
	return ok;
}

/* Run a text statement that must succeed; drop its result. */
static bool
run_command(PGconn *conn, const char *sql, int nparams,
			const char *const *values, const struct timespec *deadline,
			GuardStop *stop, GuardError *err)
{
	GuardStatement st = {sql, nparams, values, NULL, NULL, 0};
	bool		uncertain;
	PGresult   *res = run_statement(conn, NULL, &st, deadline, stop, err,
									&uncertain);

	PQclear(res);
	return res != NULL && !uncertain;
}

/* The statement that sets a call's clock offset and timeouts. */
typedef struct GuardLocals
{
	char		offset[16];
	char		timeout[32];
	const char *values[2];
	GuardStatement st;
} GuardLocals;

/*
 * Make in *lc the statement that sets, for the transaction it runs in, the
 * test clock offset (0: none) and, with a deadline, lock_timeout and
 * statement_timeout ending each statement on the server
 * GUARD_SERVER_END_MS before the deadline (or sooner, by the session's own
 * where they are shorter).
 */
static void
locals_statement(GuardLocals *lc, int clock_offset_s,
				 const struct timespec *deadline)
{
	long		ms;

	memset(lc, 0, sizeof(GuardLocals));
	lc->st.values = lc->values;
	snprintf(lc->offset, sizeof(lc->offset), "%d", clock_offset_s);
	if (deadline == NULL)
	{
		lc->values[0] = lc->offset;
		lc->st.sql = SQL_CLOCK;
		lc->st.nparams = 1;
		return;
	}
	/* 0 would be no timeout at all. */
	ms = idem_guard_ms_until(deadline) - GUARD_SERVER_END_MS;
	snprintf(lc->timeout, sizeof(lc->timeout), "%ldms", ms > 0 ? ms : 1);
	if (clock_offset_s == 0)
	{
		lc->values[0] = lc->timeout;
		lc->st.sql = SQL_TIMEOUTS;
		lc->st.nparams = 1;
		return;
	}
	lc->values[0] = lc->offset;
	lc->values[1] = lc->timeout;
	lc->st.sql = SQL_CLOCK_TIMEOUTS;
	lc->st.nparams = 2;
}

/*
 * Run one statement in its own transaction, within the deadline (NULL:
 * none) and until stop is requested (NULL: never): as a single statement
 * when there is neither a deadline nor a test clock offset, otherwise in
 * one pipeline after the statement that sets, for their implicit
 * transaction only, idem.clock_offset and the timeouts that end the
 * statement on the server before the deadline (locals_statement): one
 * round trip either way.  A statement the client gave up on is thus ended
 * by the server even if the cancel request never reaches it, and whatever
 * it did is never committed.  Returns the result or NULL with *err set;
 * *uncertain as for run_statement (the statement answered but the end of
 * its transaction was not confirmed).  err->timed_out tells a statement
 * cut by the deadline.  Nothing is sent once stop is requested.
 */
PGresult *
idem_guard_conn_exec(PGconn *conn, const GuardStatement *st, int clock_offset_s,
				const struct timespec *deadline, GuardStop *stop,
				GuardError *err, bool *uncertain)
{
	GuardLocals lc;

	*uncertain = false;
	err->timed_out = false;
	if (conn == NULL || PQstatus(conn) != CONNECTION_OK)
	{
		idem_guard_error_text(err, NULL, conn ? PQerrorMessage(conn) :
						 "no connection");
		return NULL;
	}
	if (PQtransactionStatus(conn) != PQTRANS_IDLE)
	{
		idem_guard_error(err, "connection is busy or inside a transaction");
		return NULL;
	}
	if (idem_guard_stop_requested(stop))
	{
		idem_guard_error(err, "statement stopped");
		return NULL;
	}
	if (clock_offset_s == 0 && deadline == NULL)
		return run_statement(conn, NULL, st, deadline, stop, err, uncertain);
	locals_statement(&lc, clock_offset_s, deadline);
	return run_statement(conn, &lc.st, st, deadline, stop, err, uncertain);
}

/*
 * Run one statement inside the caller's open transaction (a step's
 * business transaction), within the deadline (NULL: none): no BEGIN or
 * COMMIT of its own, and no server-side timeouts, which would last to the
 * end of the caller's transaction.  A test clock offset (0: none) is set
 * for the rest of that transaction.  Returns the result or NULL with *err
 * set; an error leaves the transaction failed, for the caller to roll back.
 */
PGresult *
idem_guard_conn_exec_in_tx(PGconn *conn, const GuardStatement *st,
					  int clock_offset_s, const struct timespec *deadline,
					  GuardError *err)
{
	PGresult   *res;
	bool		uncertain;

	err->timed_out = false;
	if (conn == NULL || PQstatus(conn) != CONNECTION_OK)
	{
		idem_guard_error_text(err, NULL, conn ? PQerrorMessage(conn) :
						 "no connection");
		return NULL;
	}
	if (PQtransactionStatus(conn) != PQTRANS_INTRANS)
	{
		idem_guard_error(err, "connection is not inside an open transaction");
		return NULL;
	}
	if (clock_offset_s != 0)
	{
		char		offset[16];
		const char *values[1] = {offset};

		snprintf(offset, sizeof(offset), "%d", clock_offset_s);
		if (!run_command(conn, SQL_CLOCK, 1, values, deadline, NULL, err))
			return NULL;
	}
	res = run_statement(conn, NULL, st, deadline, NULL, err, &uncertain);
	if (res != NULL && uncertain)
	{
		PQclear(res);
		return NULL;
	}
	return res;
}

/*
 * Re-make a lost connection without blocking: give up at the deadline or
 * as soon as stop is requested.  True if the connection is made.
 */
bool
idem_guard_conn_reset(PGconn *conn, const struct timespec *deadline,
				 GuardStop *stop)
{
	PostgresPollingStatusType st = PGRES_POLLING_WRITING;

	if (!PQresetStart(conn))
		return false;
	while (st != PGRES_POLLING_OK && st != PGRES_POLLING_FAILED)
	{
		struct pollfd pfd;
		int			timeout = poll_ms(deadline, stop);
		int			rc;

		if (timeout == 0 || idem_guard_stop_requested(stop))
			return false;
		pfd.fd = PQsocket(conn);
		if (pfd.fd < 0)
			return false;
		pfd.events = (st == PGRES_POLLING_READING) ? POLLIN : POLLOUT;
		pfd.revents = 0;
		rc = poll(&pfd, 1, timeout);
		if (rc < 0 && errno != EINTR)
			return false;
		if (rc > 0)
			st = PQresetPoll(conn);
	}
	return st == PGRES_POLLING_OK;
}
