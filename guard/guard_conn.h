/*-------------------------------------------------------------------------
 *
 * guard_conn.h
 *	  The guard's connection core: one statement at a time over libpq,
 *	  never blocking past a deadline.  Private to libidem_guard.
 *
 * A deadline is a CLOCK_MONOTONIC time; NULL means none.  A statement
 * gets its answer until GUARD_CANCEL_GRACE_MS before its deadline; then
 * it is cancelled, and a connection whose statement has not ended by the
 * deadline is shut down, so that it reports itself broken.  The server
 * ends the statement GUARD_SERVER_END_MS before the deadline by itself.
 *
 *-------------------------------------------------------------------------
 */
#ifndef GUARD_CONN_H
#define GUARD_CONN_H

#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>

#include <libpq-fe.h>

/* How long a cancel and the end of the statement it stops may take. */
#define GUARD_CANCEL_GRACE_MS	1000

/*
 * How long before its deadline a statement is ended by the server on its
 * own (lock_timeout and statement_timeout): after the client's cancel, so
 * that the cancel normally ends it, and before the client gives the
 * connection up, so that a cancel that never arrives cannot leave the
 * statement running for a client that has gone.
 */
#define GUARD_SERVER_END_MS		(GUARD_CANCEL_GRACE_MS / 2)

/* Why a server call failed. */
typedef struct GuardError
{
	char		sqlstate[6];
	char		message[256];
	bool		timed_out;		/* the deadline cut the statement short */
} GuardError;

/* One statement with its parameters, as PQsendQueryParams takes them. */
typedef struct GuardStatement
{
	const char *sql;
	int			nparams;
	const char *const *values;
	const int  *lengths;
	const int  *formats;
	int			result_format;	/* 0 text, 1 binary */
} GuardStatement;

/*
 * A request from another thread to stop waiting: the statement in flight
 * is cancelled and given up by the request's deadline.
 */
typedef struct GuardStop
{
	atomic_bool requested;
	struct timespec deadline;	/* written before requested is set */
} GuardStop;

extern void idem_guard_error(GuardError *err, const char *fmt,...)
			__attribute__((format(printf, 2, 3)));
extern void idem_guard_error_text(GuardError *err, const char *sqlstate,
							 const char *text);

extern void idem_guard_time_add(struct timespec *ts, long ms);
extern void idem_guard_time_after(struct timespec *ts, long ms);
extern long idem_guard_ms_until(const struct timespec *deadline);
extern void idem_guard_statement_deadline(struct timespec *deadline,
									 int timeout_ms);

extern void idem_guard_stop_init(GuardStop *stop);
extern void idem_guard_stop_request(GuardStop *stop, long grace_ms);
extern bool idem_guard_stop_requested(GuardStop *stop);

extern PGresult *idem_guard_conn_exec(PGconn *conn, const GuardStatement *st,
								 int clock_offset_s,
								 const struct timespec *deadline,
								 GuardStop *stop, GuardError *err,
								 bool *uncertain);
extern PGresult *idem_guard_conn_exec_in_tx(PGconn *conn,
										const GuardStatement *st,
										int clock_offset_s,
										const struct timespec *deadline,
										GuardError *err);
extern bool idem_guard_conn_reset(PGconn *conn, const struct timespec *deadline,
							 GuardStop *stop);

#endif							/* GUARD_CONN_H */
