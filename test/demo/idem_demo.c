/*-------------------------------------------------------------------------
 *
 * idem_demo.c
 *	  The Go guard document's scenarios against a live server, one line
 *	  per scenario with the figures its tests expect and what happened.
 *
 *	  idem_demo CONNINFO DOWN_CONNINFO [SCOPE]
 *
 * CONNINFO reaches a server with the idem extension as a superuser (the
 * lease and window are crossed with idem.clock_offset); DOWN_CONNINFO
 * reaches no server.  Exits 1 if any figure differs.
 *
 * 1. Eight threads, one key, one fingerprint, a 20 ms handler: it runs
 *    once; a changed fingerprint is a CONFLICT without running it.
 * 2. Complete fails once (fault hook): in flight inside the lease, taken
 *    over after it, executed again after the window; with no server the
 *    guard answers UNAVAILABLE without running the handler.
 * 3. The ledger in PostgreSQL tables, one transaction per request (claim,
 *    ledger writes, complete, commit): eight clients, stock decremented
 *    once, the other seven wait for the claim and get the replay.
 * 4. An order in three steps (idem_guard_step): reserve stock in a
 *    transaction that holds the key (idem_hold) and checkpoints the step
 *    with the stock row, charge a provider (a table standing for it, on a
 *    connection of its own) by the key the reserve step chose, then record
 *    the charge.  The child process that runs it is killed with SIGKILL
 *    after the charge; the retry after the lease resumes at the record
 *    step: the provider saw one charge request, the stock moved once.
 *
 *-------------------------------------------------------------------------
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem_guard.h"

#define WORKERS			8
#define MAX_KEYS		16
#define LEASE_MS		10000	/* the Go test's 1 s, with room for slow machines */
#define RETENTION_MS	3600000 /* the Go test's 1 h */
#define PAST_LEASE_S	20		/* two leases, as the Go test's 2 s */
#define PAST_WINDOW_S	7200	/* the Go test's 2 h */
#define WAIT_LIMIT_MS	30000	/* bound on waiting for the other clients */

static const char *conninfo;
static const char *down_conninfo;
static const char *scope = "demo";

/* The Go test's ledger: stock, and one reservation and charge per key. */
typedef struct Ledger
{
	pthread_mutex_t mu;
	int			stock;
	int			nkeys;
	char		keys[MAX_KEYS][64];
} Ledger;

/* What the handler works on, like the Go test's handler closure. */
typedef struct HandlerCtx
{
	Ledger	   *ledger;
	const char *key;
	int			delay_ms;
	int			calls;			/* atomic */
} HandlerCtx;

/* Sleep for ms milliseconds. */
static void
sleep_ms(int ms)
{
	struct timespec ts;

	ts.tv_sec = ms / 1000;
	ts.tv_nsec = (long) (ms % 1000) * 1000000L;
	nanosleep(&ts, NULL);
}

/* Start a ledger with stock items. */
static void
ledger_init(Ledger *l, int stock)
{
	memset(l, 0, sizeof(Ledger));
	pthread_mutex_init(&l->mu, NULL);
	l->stock = stock;
}

/* Reserve and charge once per key; -1 when out of stock. */
static int
ledger_apply(Ledger *l, const char *key, int qty)
{
	int			i;
	int			rc = 0;

	pthread_mutex_lock(&l->mu);
	for (i = 0; i < l->nkeys; i++)
		if (strcmp(l->keys[i], key) == 0)
			goto out;
	if (l->stock < qty || l->nkeys >= MAX_KEYS)
	{
		rc = -1;
		goto out;
	}
	l->stock -= qty;
	snprintf(l->keys[l->nkeys++], sizeof(l->keys[0]), "%s", key);
out:
	pthread_mutex_unlock(&l->mu);
	return rc;
}

/* The Go test's handler: count, wait, apply to the ledger, answer. */
static int
ledger_handler(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	HandlerCtx *ctx = arg;

	(void) claim;
	__atomic_add_fetch(&ctx->calls, 1, __ATOMIC_SEQ_CST);
	if (ctx->delay_ms > 0)
		sleep_ms(ctx->delay_ms);
	if (ledger_apply(ctx->ledger, ctx->key, 1) != 0)
		return idem_response_set(resp, 409, "OUT_OF_STOCK", 12);
	return idem_response_set(resp, 200, "paid", 4);
}

/* Calls made so far. */
static int
calls_of(HandlerCtx *ctx)
{
	return __atomic_load_n(&ctx->calls, __ATOMIC_SEQ_CST);
}

/* Connect, or report why not (the connection is returned either way). */
static PGconn *
connect_db(const char *info)
{
	PGconn	   *conn = PQconnectdb(info);

	if (PQstatus(conn) != CONNECTION_OK)
		fprintf(stderr, "idem_demo: %s", PQerrorMessage(conn));
	return conn;
}

/* The guard options the Go test's newGuard sets. */
static void
demo_options(IdemGuardOptions *opts)
{
	idem_guard_options_init(opts);
	opts->lease_ms = LEASE_MS;
	opts->retention_ms = RETENTION_MS;
	opts->scope = scope;
}

/* Print one scenario's line; returns true if the figures match. */
static bool
report(int n, const char *title, const char *expected, const char *actual,
	   const char *note)
{
	bool		ok = strcmp(expected, actual) == 0;

	printf("scenario %d %s: %s  expected: %s  actual: %s%s%s\n", n,
		   ok ? "OK" : "MISMATCH", title, expected, actual,
		   note[0] ? "  " : "", note);
	fflush(stdout);
	return ok;
}

/* One worker of scenario 1. */
typedef struct Worker1
{
	pthread_t	thread;
	pthread_barrier_t *start;
	HandlerCtx *ctx;
	IdemOutcome outcome;
	IdemStep	failed;
} Worker1;

/* Scenario 1 worker: one guarded call on its own connection. */
static void *
worker1_main(void *arg)
{
	Worker1    *w = arg;
	PGconn	   *conn = connect_db(conninfo);
	IdemGuardOptions opts;
	IdemResult	res;

	demo_options(&opts);
	pthread_barrier_wait(w->start);
	w->outcome = idem_guard_do_opts(conn, &opts, "order-1", "sku=A&qty=1",
									ledger_handler, w->ctx, &res);
	w->failed = res.failed;
	idem_result_clear(&res);
	PQfinish(conn);
	return NULL;
}

/* Scenario 1: eight concurrent callers of one key, then a conflict. */
static bool
scenario1(PGconn *conn)
{
	Ledger		ledger;
	HandlerCtx	ctx = {&ledger, "order-1", 20, 0};
	HandlerCtx	ctx2 = {&ledger, "order-1", 0, 0};
	Worker1		workers[WORKERS];
	pthread_barrier_t start;
	IdemGuardOptions opts;
	IdemResult	res;
	IdemOutcome conflict;
	int			executed = 0,
				in_flight = 0,
				replayed = 0,
				errors = 0;
	int			calls_before;
	int			i;
	char		actual[256];
	char		note[128];

	ledger_init(&ledger, 10);
	pthread_barrier_init(&start, NULL, WORKERS);
	for (i = 0; i < WORKERS; i++)
	{
		workers[i].start = &start;
		workers[i].ctx = &ctx;
		pthread_create(&workers[i].thread, NULL, worker1_main, &workers[i]);
	}
	for (i = 0; i < WORKERS; i++)
	{
		pthread_join(workers[i].thread, NULL);
		if (workers[i].outcome == IDEM_EXECUTED)
			executed++;
		else if (workers[i].outcome == IDEM_IN_FLIGHT)
			in_flight++;
		else if (workers[i].outcome == IDEM_REPLAYED)
			replayed++;
		if (workers[i].failed != IDEM_STEP_NONE)
			errors++;
	}
	pthread_barrier_destroy(&start);

	/* The changed fingerprint must not reach the handler. */
	demo_options(&opts);
	calls_before = calls_of(&ctx);
	conflict = idem_guard_do_opts(conn, &opts, "order-1", "sku=A&qty=2",
								  ledger_handler, &ctx2, &res);
	idem_result_clear(&res);

	snprintf(actual, sizeof(actual),
			 "executed=%d calls=%d stock=%d reservations=%d charges=%d"
			 " others=%d errors=%d conflict=%s/calls=%d",
			 executed, calls_of(&ctx) + calls_of(&ctx2), ledger.stock,
			 ledger.nkeys, ledger.nkeys, in_flight + replayed, errors,
			 idem_outcome_name(conflict), calls_before + calls_of(&ctx2));
	snprintf(note, sizeof(note), "(others: IN_FLIGHT=%d REPLAYED=%d)",
			 in_flight, replayed);
	return report(1, "eight threads, one key, 20 ms handler; changed fingerprint",
				  "executed=1 calls=1 stock=9 reservations=1 charges=1"
				  " others=7 errors=0 conflict=CONFLICT/calls=1",
				  actual, note);
}

/* Scenario 2: failed complete, lease takeover, window, server down. */
static bool
scenario2(PGconn *conn)
{
	Ledger		ledger;
	HandlerCtx	ctx = {&ledger, "order-2", 0, 0};
	IdemFaultCounter fault = {"complete", 1};
	IdemGuardOptions opts;
	IdemResult	res;
	IdemOutcome first,
				in_lease,
				takeover,
				window,
				down;
	IdemStep	first_failed,
				takeover_failed,
				window_failed;
	int			calls_takeover,
				calls_window,
				calls_down;
	int			stock,
				nkeys;
	PGconn	   *down_conn;
	char		actual[512];

	ledger_init(&ledger, 10);
	demo_options(&opts);
	opts.fault = idem_fault_fail_n;
	opts.fault_arg = &fault;

	first = idem_guard_do_opts(conn, &opts, "order-2", "sku=A&qty=1",
							   ledger_handler, &ctx, &res);
	first_failed = res.failed;
	idem_result_clear(&res);

	in_lease = idem_guard_do_opts(conn, &opts, "order-2", "sku=A&qty=1",
								  ledger_handler, &ctx, &res);
	idem_result_clear(&res);

	opts.clock_offset_s = PAST_LEASE_S;
	takeover = idem_guard_do_opts(conn, &opts, "order-2", "sku=A&qty=1",
								  ledger_handler, &ctx, &res);
	takeover_failed = res.failed;
	idem_result_clear(&res);
	calls_takeover = calls_of(&ctx);
	stock = ledger.stock;
	nkeys = ledger.nkeys;

	opts.clock_offset_s = PAST_LEASE_S + PAST_WINDOW_S;
	window = idem_guard_do_opts(conn, &opts, "order-2", "sku=A&qty=1",
								ledger_handler, &ctx, &res);
	window_failed = res.failed;
	idem_result_clear(&res);
	calls_window = calls_of(&ctx);

	down_conn = PQconnectdb(down_conninfo);
	opts.clock_offset_s = 0;
	down = idem_guard_do_opts(down_conn, &opts, "order-3", "sku=A&qty=1",
							  ledger_handler, &ctx, &res);
	idem_result_clear(&res);
	PQfinish(down_conn);
	calls_down = calls_of(&ctx);

	snprintf(actual, sizeof(actual),
			 "first=%s/failed=%s in-lease=%s takeover=%s/failed=%s calls=%d"
			 " stock=%d reservations=%d charges=%d window=%s/failed=%s/calls=%d"
			 " server-down=%s/calls=%d",
			 idem_outcome_name(first), idem_step_name(first_failed),
			 idem_outcome_name(in_lease), idem_outcome_name(takeover),
			 idem_step_name(takeover_failed), calls_takeover, stock, nkeys,
			 nkeys, idem_outcome_name(window), idem_step_name(window_failed),
			 calls_window, idem_outcome_name(down), calls_down);
	return report(2, "complete fails once, lease takeover, window, server down",
				  "first=EXECUTED/failed=complete in-lease=IN_FLIGHT"
				  " takeover=EXECUTED/failed=none calls=2 stock=9 reservations=1"
				  " charges=1 window=EXECUTED/failed=none/calls=3"
				  " server-down=UNAVAILABLE/calls=3",
				  actual, "");
}

/* Shared state of scenario 3's clients. */
typedef struct Tx3
{
	pthread_mutex_t mu;
	pthread_cond_t cond;
	bool		claimed;		/* a client holds the claim */
	bool		go;				/* the holder may finish */
	int			finished;		/* clients done */
	pthread_barrier_t start;
} Tx3;

/* One client of scenario 3. */
typedef struct Worker3
{
	pthread_t	thread;
	Tx3		   *tx;
	bool		executed;
	bool		replayed;		/* DONE with status 200 and body "paid" */
	char		error[160];
} Worker3;

/* Run a statement in scenario 3; false with w->error set on failure. */
static bool
exec3(Worker3 *w, PGconn *conn, const char *sql, int nparams,
	  const char *const *values, PGresult **out)
{
	PGresult   *res = PQexecParams(conn, sql, nparams, NULL, values, NULL,
								   NULL, 0);
	ExecStatusType st = PQresultStatus(res);

	if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK)
	{
		snprintf(w->error, sizeof(w->error), "%s", PQresultErrorMessage(res));
		PQclear(res);
		return false;
	}
	if (out)
		*out = res;
	else
		PQclear(res);
	return true;
}

/* Scenario 3 client: claim, ledger writes and complete in one transaction. */
static void *
worker3_main(void *arg)
{
	Worker3    *w = arg;
	Tx3		   *tx = w->tx;
	PGconn	   *conn = connect_db(conninfo);
	const char *claim_args[3] = {"order-4", "sku=A&qty=1", scope};
	const char *key_args[1] = {"order-4"};
	const char *sku_args[1] = {"A"};
	const char *complete_args[4] = {"order-4", "sku=A&qty=1", "paid", scope};
	PGresult   *row = NULL;

	pthread_barrier_wait(&tx->start);
	if (PQstatus(conn) != CONNECTION_OK)
	{
		snprintf(w->error, sizeof(w->error), "%s", PQerrorMessage(conn));
		goto done;
	}
	if (!exec3(w, conn, "BEGIN", 0, NULL, NULL) ||
		!exec3(w, conn,
			   "SELECT claimed, state, status, body"
			   " FROM idem_begin($1, $2, scope => $3)", 3, claim_args, &row))
		goto done;

	if (strcmp(PQgetvalue(row, 0, 0), "t") == 0)
	{
		/* Hold the claim until every other client waits on it. */
		pthread_mutex_lock(&tx->mu);
		tx->claimed = true;
		pthread_cond_broadcast(&tx->cond);
		while (!tx->go)
			pthread_cond_wait(&tx->cond, &tx->mu);
		pthread_mutex_unlock(&tx->mu);

		if (!exec3(w, conn,
				   "UPDATE idem_demo.stock SET qty = qty - 1"
				   " WHERE sku = $1 AND qty >= 1", 1, sku_args, NULL) ||
			!exec3(w, conn,
				   "INSERT INTO idem_demo.reservations (key, qty)"
				   " VALUES ($1, 1)", 1, key_args, NULL) ||
			!exec3(w, conn,
				   "INSERT INTO idem_demo.charges (key, cents)"
				   " VALUES ($1, 1000)", 1, key_args, NULL) ||
			!exec3(w, conn,
				   "SELECT idem_complete($1, $2, 200, $3::bytea, NULL,"
				   " scope => $4)", 4, complete_args, NULL))
			goto done;
		w->executed = true;
	}
	else if (strcmp(PQgetvalue(row, 0, 1), "DONE") == 0 &&
			 strcmp(PQgetvalue(row, 0, 2), "200") == 0)
	{
		size_t		len;
		unsigned char *body = PQunescapeBytea((unsigned char *) PQgetvalue(row, 0, 3),
											  &len);

		w->replayed = body != NULL && len == 4 && memcmp(body, "paid", 4) == 0;
		PQfreemem(body);
	}
	exec3(w, conn, "COMMIT", 0, NULL, NULL);

done:
	PQclear(row);
	PQfinish(conn);
	pthread_mutex_lock(&tx->mu);
	tx->finished++;
	pthread_cond_broadcast(&tx->cond);
	pthread_mutex_unlock(&tx->mu);
	return NULL;
}

/* Clients of scenario 3 waiting on a row lock, or -1 on error. */
static int
lock_waiters(PGconn *conn)
{
	PGresult   *res = PQexec(conn,
							 "SELECT count(*) FROM pg_catalog.pg_stat_activity"
							 " WHERE datname = current_database()"
							 " AND wait_event_type = 'Lock'"
							 " AND query LIKE '%idem_begin%'");
	int			n = -1;

	if (PQresultStatus(res) == PGRES_TUPLES_OK)
		n = atoi(PQgetvalue(res, 0, 0));
	PQclear(res);
	return n;
}

/* An integer from a query, or -1 on error. */
static int
query_int(PGconn *conn, const char *sql)
{
	PGresult   *res = PQexec(conn, sql);
	int			n = -1;

	if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1)
		n = atoi(PQgetvalue(res, 0, 0));
	else
		fprintf(stderr, "idem_demo: %s", PQresultErrorMessage(res));
	PQclear(res);
	return n;
}

/* Run a setup statement; false on error. */
static bool
setup(PGconn *conn, const char *sql)
{
	PGresult   *res = PQexec(conn, sql);
	bool		ok = PQresultStatus(res) == PGRES_COMMAND_OK;

	if (!ok)
		fprintf(stderr, "idem_demo: %s", PQresultErrorMessage(res));
	PQclear(res);
	return ok;
}

/* Scenario 3: one transaction per request, the ledger in tables. */
static bool
scenario3(PGconn *conn)
{
	Tx3			tx;
	Worker3		workers[WORKERS];
	int			executed = 0,
				replayed = 0,
				errors = 0,
				waited = -1;
	int			i,
				waited_ms;
	char		actual[256];
	char		note[200] = "";

	if (!setup(conn, "DROP SCHEMA IF EXISTS idem_demo CASCADE") ||
		!setup(conn, "CREATE SCHEMA idem_demo") ||
		!setup(conn, "CREATE TABLE idem_demo.stock (sku text PRIMARY KEY, qty integer NOT NULL)") ||
		!setup(conn, "CREATE TABLE idem_demo.reservations (key text PRIMARY KEY, qty integer NOT NULL)") ||
		!setup(conn, "CREATE TABLE idem_demo.charges (key text PRIMARY KEY, cents integer NOT NULL)") ||
		!setup(conn, "INSERT INTO idem_demo.stock VALUES ('A', 10)"))
		return report(3, "one transaction per request, eight clients",
					  "set-up", "failed", "");

	memset(&tx, 0, sizeof(tx));
	memset(workers, 0, sizeof(workers));
	pthread_mutex_init(&tx.mu, NULL);
	pthread_cond_init(&tx.cond, NULL);
	pthread_barrier_init(&tx.start, NULL, WORKERS);
	for (i = 0; i < WORKERS; i++)
	{
		workers[i].tx = &tx;
		pthread_create(&workers[i].thread, NULL, worker3_main, &workers[i]);
	}

	/* Once a client holds the claim, let it finish when the others wait. */
	pthread_mutex_lock(&tx.mu);
	while (!tx.claimed && tx.finished < WORKERS)
		pthread_cond_wait(&tx.cond, &tx.mu);
	pthread_mutex_unlock(&tx.mu);
	for (waited_ms = 0; tx.claimed && waited_ms < WAIT_LIMIT_MS; waited_ms += 10)
	{
		waited = lock_waiters(conn);
		if (waited < 0 || waited >= WORKERS - 1)
			break;
		sleep_ms(10);
	}
	pthread_mutex_lock(&tx.mu);
	tx.go = true;
	pthread_cond_broadcast(&tx.cond);
	pthread_mutex_unlock(&tx.mu);

	for (i = 0; i < WORKERS; i++)
	{
		pthread_join(workers[i].thread, NULL);
		executed += workers[i].executed;
		replayed += workers[i].replayed;
		if (workers[i].error[0])
		{
			errors++;
			snprintf(note, sizeof(note), "(error: %.150s)", workers[i].error);
		}
	}

	snprintf(actual, sizeof(actual),
			 "executed=%d replayed=%d waited=%d errors=%d stock=%d"
			 " reservations=%d charges=%d",
			 executed, replayed, waited, errors,
			 query_int(conn, "SELECT qty FROM idem_demo.stock WHERE sku = 'A'"),
			 query_int(conn, "SELECT count(*) FROM idem_demo.reservations"),
			 query_int(conn, "SELECT count(*) FROM idem_demo.charges"));
	return report(3, "one transaction per request, eight clients",
				  "executed=1 replayed=7 waited=7 errors=0 stock=9"
				  " reservations=1 charges=1",
				  actual, note);
}

/* What scenario 4's steps work with. */
typedef struct Order4
{
	PGconn	   *conn;			/* the steps' transactions */
	PGconn	   *provider;		/* the provider's own connection */
	int			attempt;
	int			stop_fd;		/* attempt 1: told "charged", then waits */
	bool		ran;			/* the step ran (not skipped) */
	char		error[200];
} Order4;

/* Run a statement of scenario 4 on conn; false with o->error set. */
static bool
exec4(Order4 *o, PGconn *conn, const char *sql, int nparams,
	  const char *const *values, char *out, size_t outlen)
{
	PGresult   *res = PQexecParams(conn, sql, nparams, NULL, values, NULL,
								   NULL, 0);
	ExecStatusType st = PQresultStatus(res);

	if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK)
	{
		snprintf(o->error, sizeof(o->error), "%s", PQresultErrorMessage(res));
		PQclear(res);
		return false;
	}
	if (out != NULL)
		snprintf(out, outlen, "%s", PQntuples(res) == 1 ?
				 PQgetvalue(res, 0, 0) : "");
	PQclear(res);
	return true;
}

/* A failed step's transaction: roll it back, report why. */
static int
fail4(Order4 *o, IdemPhase *phase, const char *what)
{
	PGresult   *res;

	if (what != NULL)
		snprintf(o->error, sizeof(o->error), "%s: %s", what,
				 idem_phase_error(phase));
	res = PQexec(o->conn, "ROLLBACK");
	PQclear(res);
	printf("scenario 4: attempt %d: step %s failed: %s\n", o->attempt,
		   phase->name, o->error);
	fflush(stdout);
	return 1;
}

/*
 * Step "reserve": in one transaction, hold the key, take one item of
 * stock, and checkpoint the step with the provider key it chose for the
 * charge: "key:token" of this attempt.
 */
static int
step_reserve(IdemPhase *phase, void *arg)
{
	Order4	   *o = arg;
	const char *values[2] = {phase->key, phase->name};
	char		provider_key[96];
	char		qty[16];

	o->ran = true;
	snprintf(provider_key, sizeof(provider_key), "%s:%" PRId64, phase->key,
			 phase->token);
	if (!exec4(o, o->conn, "BEGIN", 0, NULL, NULL, 0))
		return fail4(o, phase, NULL);
	if (idem_phase_hold(phase, o->conn) != 0)
		return fail4(o, phase, "idem_hold");
	if (!exec4(o, o->conn, "UPDATE idem_demo.stock SET qty = qty - 1"
			   " WHERE sku = 'B' AND qty >= 1 RETURNING qty", 0, NULL,
			   qty, sizeof(qty)) ||
		!exec4(o, o->conn, "INSERT INTO idem_demo.phase_runs (key, phase)"
			   " VALUES ($1, $2)", 2, values, NULL, 0))
		return fail4(o, phase, NULL);
	if (idem_phase_output(phase, provider_key, strlen(provider_key)) != 0 ||
		idem_phase_checkpoint(phase, o->conn) != 0)
		return fail4(o, phase, "idem_checkpoint");
	if (!exec4(o, o->conn, "COMMIT", 0, NULL, NULL, 0))
		return fail4(o, phase, NULL);
	printf("scenario 4: attempt %d: reserve: stock of B now %s,"
		   " provider key %s, checkpoint \"reserve\" in the same transaction\n",
		   o->attempt, qty, provider_key);
	fflush(stdout);
	return 0;
}

/*
 * Step "charge": ask the provider to charge, keyed by the reserve step's
 * output, which a resume gets again.  The provider records every request
 * and charges once per idempotency key.  The guard checkpoints the step
 * with the charge's id.
 */
static int
step_charge(IdemPhase *phase, void *arg)
{
	Order4	   *o = arg;
	char		provider_key[96];
	const char *values[1] = {provider_key};
	char		charge[32];

	o->ran = true;
	if (phase->input == NULL || phase->input_len >= sizeof(provider_key))
	{
		snprintf(o->error, sizeof(o->error), "no provider key from reserve");
		return 1;
	}
	memcpy(provider_key, phase->input, phase->input_len);
	provider_key[phase->input_len] = '\0';
	if (!exec4(o, o->provider, "INSERT INTO idem_demo.provider_requests"
			   " (idem_key) VALUES ($1)", 1, values, NULL, 0) ||
		!exec4(o, o->provider, "INSERT INTO idem_demo.provider_charges"
			   " (idem_key, cents) VALUES ($1, 1000) ON CONFLICT (idem_key)"
			   " DO NOTHING", 1, values, NULL, 0) ||
		!exec4(o, o->provider, "SELECT 'ch_' || id FROM"
			   " idem_demo.provider_charges WHERE idem_key = $1", 1, values,
			   charge, sizeof(charge)))
		return 1;
	printf("scenario 4: attempt %d: charge: provider charged %s as %s\n",
		   o->attempt, provider_key, charge);
	fflush(stdout);
	return idem_phase_output(phase, charge, strlen(charge));
}

/* Step "record": store the charge with the order, in one transaction. */
static int
step_record(IdemPhase *phase, void *arg)
{
	Order4	   *o = arg;
	char		charge[32];
	const char *values[2] = {phase->key, charge};
	const char *run_values[2] = {phase->key, phase->name};

	o->ran = true;
	if (phase->input == NULL || phase->input_len >= sizeof(charge))
	{
		snprintf(o->error, sizeof(o->error), "no charge id from charge");
		return 1;
	}
	memcpy(charge, phase->input, phase->input_len);
	charge[phase->input_len] = '\0';
	if (!exec4(o, o->conn, "BEGIN", 0, NULL, NULL, 0))
		return fail4(o, phase, NULL);
	if (idem_phase_hold(phase, o->conn) != 0)
		return fail4(o, phase, "idem_hold");
	if (!exec4(o, o->conn, "INSERT INTO idem_demo.records (key, charge)"
			   " VALUES ($1, $2)", 2, values, NULL, 0) ||
		!exec4(o, o->conn, "INSERT INTO idem_demo.phase_runs (key, phase)"
			   " VALUES ($1, $2)", 2, run_values, NULL, 0))
		return fail4(o, phase, NULL);
	if (idem_phase_checkpoint(phase, o->conn) != 0)
		return fail4(o, phase, "idem_checkpoint");
	if (!exec4(o, o->conn, "COMMIT", 0, NULL, NULL, 0))
		return fail4(o, phase, NULL);
	printf("scenario 4: attempt %d: record: %s recorded for %s,"
		   " checkpoint \"record\" in the same transaction\n",
		   o->attempt, charge, phase->key);
	fflush(stdout);
	return 0;
}

/* Run one step of the order; say so if it was skipped. */
static int
order_step(const IdemClaim *claim, const char *name, IdemStepFn fn,
		   Order4 *o)
{
	int			rc;

	o->ran = false;
	rc = idem_guard_step(claim, name, fn, o);
	if (rc == 0 && !o->ran)
	{
		printf("scenario 4: attempt %d: %s: skipped, checkpointed by the"
			   " killed attempt\n", o->attempt, name);
		fflush(stdout);
	}
	return rc;
}

/* The order's handler: three steps, then the response. */
static int
order_handler(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	Order4	   *o = arg;
	char		body[64];
	int			rc;

	printf("scenario 4: attempt %d (pid %d): claimed %s with token %" PRId64
		   "\n", o->attempt, (int) getpid(), claim->key, claim->token);
	fflush(stdout);
	if ((rc = order_step(claim, "reserve", step_reserve, o)) != 0 ||
		(rc = order_step(claim, "charge", step_charge, o)) != 0)
		return rc;
	if (o->stop_fd >= 0)
	{
		/* Tell the parent, which kills this process now. */
		if (write(o->stop_fd, "c", 1) != 1)
			return 1;
		for (;;)
			pause();
	}
	if ((rc = order_step(claim, "record", step_record, o)) != 0)
		return rc;
	snprintf(body, sizeof(body), "%s paid", claim->key);
	return idem_response_set(resp, 200, body, strlen(body));
}

/* Scenario 4's guard options: steps, and the clock moved by offset_s. */
static void
order_options(IdemGuardOptions *opts, int offset_s)
{
	demo_options(opts);
	opts->steps = true;
	opts->clock_offset_s = offset_s;
}

/* Scenario 4, attempt 1, in a child process: stops after the charge. */
static void
order_child(int stop_fd)
{
	Order4		o = {NULL, NULL, 1, stop_fd, false, ""};
	IdemGuardOptions opts;
	IdemResult	res;

	o.conn = connect_db(conninfo);
	o.provider = connect_db(conninfo);
	if (PQstatus(o.conn) != CONNECTION_OK ||
		PQstatus(o.provider) != CONNECTION_OK)
		_exit(1);
	order_options(&opts, 0);
	idem_guard_do_opts(o.conn, &opts, "order-5", "sku=B&qty=1",
					   order_handler, &o, &res);
	/* Only a failure gets here. */
	fprintf(stderr, "idem_demo: attempt 1 ended: %s %s %s %s\n",
			idem_outcome_name(res.outcome), idem_step_name(res.failed),
			res.message, o.error);
	_exit(1);
}

/*
 * Scenario 4: an order in three steps, its process killed with SIGKILL
 * after the charge, resumed after the lease at the record step.
 */
static bool
scenario4(PGconn *conn)
{
	const char *title = "three steps, SIGKILL after the charge, resumed";
	int			fds[2];
	pid_t		pid;
	int			status = 0;
	char		c = 0;
	const char *killed = "no";
	Order4		o = {NULL, NULL, 2, -1, false, ""};
	IdemGuardOptions opts;
	IdemResult	res;
	IdemOutcome retry,
				replay;
	char		retry_desc[160];
	char		actual[512];

	if (!setup(conn, "CREATE TABLE idem_demo.phase_runs (key text, phase text)") ||
		!setup(conn, "CREATE TABLE idem_demo.provider_requests (idem_key text, at timestamptz DEFAULT clock_timestamp())") ||
		!setup(conn, "CREATE TABLE idem_demo.provider_charges (id serial, idem_key text PRIMARY KEY, cents integer NOT NULL)") ||
		!setup(conn, "CREATE TABLE idem_demo.records (key text PRIMARY KEY, charge text NOT NULL)") ||
		!setup(conn, "INSERT INTO idem_demo.stock VALUES ('B', 10)"))
		return report(4, title, "set-up", "failed", "");

	/* Attempt 1: a child process, killed once the charge is checkpointed. */
	if (pipe(fds) != 0)
		return report(4, title, "pipe", "failed", "");
	fflush(stdout);
	pid = fork();
	if (pid < 0)
		return report(4, title, "fork", "failed", "");
	if (pid == 0)
	{
		close(fds[0]);
		order_child(fds[1]);
	}
	close(fds[1]);
	if (read(fds[0], &c, 1) == 1 && c == 'c')
	{
		kill(pid, SIGKILL);
		printf("scenario 4: attempt 1 (pid %d) killed with SIGKILL after the"
			   " charge\n", (int) pid);
	}
	close(fds[0]);
	if (waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) &&
		WTERMSIG(status) == SIGKILL)
		killed = "SIGKILL";

	/* Attempt 2, after the lease: resumes after the last checkpoint. */
	o.conn = connect_db(conninfo);
	o.provider = connect_db(conninfo);
	order_options(&opts, PAST_LEASE_S);
	retry = idem_guard_do_opts(o.conn, &opts, "order-5", "sku=B&qty=1",
							   order_handler, &o, &res);
	snprintf(retry_desc, sizeof(retry_desc),
			 "%s/failed=%s resumed-after=%s skipped=%d run=%d",
			 idem_outcome_name(retry), idem_step_name(res.failed),
			 res.resumed_after[0] ? res.resumed_after : "none",
			 res.steps_skipped, res.steps_run);
	if (res.failed != IDEM_STEP_NONE)
		fprintf(stderr, "idem_demo: attempt 2: %s %s\n", res.message, o.error);
	printf("scenario 4: attempt 2: took over after \"%s\": %d steps skipped,"
		   " %d run, response %d %.*s\n", res.resumed_after,
		   res.steps_skipped, res.steps_run, res.resp.status,
		   (int) res.resp.body_len, res.resp.body ? (char *) res.resp.body : "");
	idem_result_clear(&res);

	/* Attempt 3: the stored response. */
	o.attempt = 3;
	replay = idem_guard_do_opts(o.conn, &opts, "order-5", "sku=B&qty=1",
								order_handler, &o, &res);
	idem_result_clear(&res);
	PQfinish(o.conn);
	PQfinish(o.provider);

	snprintf(actual, sizeof(actual),
			 "killed=%s retry=%s provider-requests=%d charges=%d stock=%d"
			 " reserves=%d records=%d replay=%s",
			 killed, retry_desc,
			 query_int(conn, "SELECT count(*) FROM idem_demo.provider_requests"),
			 query_int(conn, "SELECT count(*) FROM idem_demo.provider_charges"),
			 query_int(conn, "SELECT qty FROM idem_demo.stock WHERE sku = 'B'"),
			 query_int(conn, "SELECT count(*) FROM idem_demo.phase_runs WHERE phase = 'reserve'"),
			 query_int(conn, "SELECT count(*) FROM idem_demo.records"),
			 idem_outcome_name(replay));
	return report(4, title,
				  "killed=SIGKILL retry=EXECUTED/failed=none"
				  " resumed-after=charge skipped=2 run=1 provider-requests=1"
				  " charges=1 stock=9 reserves=1 records=1 replay=REPLAYED",
				  actual, "");
}

/* Drop server notices (DROP ... IF EXISTS says it skipped). */
static void
ignore_notice(void *arg, const char *message)
{
	(void) arg;
	(void) message;
}

/* Run the four scenarios. */
int
main(int argc, char **argv)
{
	PGconn	   *conn;
	int			matched = 0;

	if (argc < 3 || argc > 4)
	{
		fprintf(stderr, "usage: %s CONNINFO DOWN_CONNINFO [SCOPE]\n", argv[0]);
		return 2;
	}
	conninfo = argv[1];
	down_conninfo = argv[2];
	if (argc == 4)
		scope = argv[3];

	conn = connect_db(conninfo);
	if (PQstatus(conn) != CONNECTION_OK)
		return 1;
	PQsetNoticeProcessor(conn, ignore_notice, NULL);

	matched += scenario1(conn);
	matched += scenario2(conn);
	matched += scenario3(conn);
	matched += scenario4(conn);
	PQfinish(conn);

	printf("%d of 4 scenarios match (1-3: the Go tests; 4: resumed steps)\n",
		   matched);
	return matched == 4 ? 0 : 1;
}
