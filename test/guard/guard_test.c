/*-------------------------------------------------------------------------
 *
 * guard_test.c
 *	  Unit tests of the client guard against a live server.
 *
 *	  guard_test CONNINFO DOWN_CONNINFO
 *
 * CONNINFO reaches a server with the idem extension as a superuser;
 * DOWN_CONNINFO reaches no server.  Each case prints one line "name:
 * field=value ..." with what happened; test/t/050_guard.pl compares the
 * lines with what they must be.  Exits 2 on bad usage or set-up failure.
 *
 *-------------------------------------------------------------------------
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "idem_guard.h"

#define SCOPE		"gt"
#define POLL_LIMIT	2000		/* polls of 10 ms: bound on any wait */

static const char *conninfo;
static const char *down_conninfo;
static PGconn *admin;			/* checks and competing claims */

/* What the test handler does and saw. */
typedef struct Ctx
{
	int			calls;			/* atomic */
	int			fail;			/* handler's return value */
	int			status;
	const void *body;
	size_t		body_len;
	void		(*during) (struct Ctx *ctx, const IdemClaim *claim);
	PGconn	   *guard_conn;		/* the connection the guard uses */
	IdemOutcome competitor;		/* outcome of a claim made while running */
	bool		flag;			/* what "during" found */
} Ctx;

/* Sleep for ms milliseconds. */
static void
sleep_ms(int ms)
{
	struct timespec ts;

	ts.tv_sec = ms / 1000;
	ts.tv_nsec = (long) (ms % 1000) * 1000000L;
	nanosleep(&ts, NULL);
}

/* Connect or exit. */
static PGconn *
connect_or_die(const char *info)
{
	PGconn	   *conn = PQconnectdb(info);

	if (PQstatus(conn) != CONNECTION_OK)
	{
		fprintf(stderr, "guard_test: %s", PQerrorMessage(conn));
		exit(2);
	}
	return conn;
}

/* Run a query with text parameters; the caller clears the result. */
static PGresult *
query(PGconn *conn, const char *sql, int nparams, const char *const *values)
{
	PGresult   *res = PQexecParams(conn, sql, nparams, NULL, values, NULL,
								   NULL, 0);
	ExecStatusType st = PQresultStatus(res);

	if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK)
		fprintf(stderr, "guard_test: %s: %s", sql, PQresultErrorMessage(res));
	return res;
}

/* The first value of a query as a malloc'd string ("" if none). */
static char *
query_value(PGconn *conn, const char *sql, int nparams,
			const char *const *values)
{
	PGresult   *res = query(conn, sql, nparams, values);
	char	   *v;

	if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) > 0 &&
		!PQgetisnull(res, 0, 0))
		v = strdup(PQgetvalue(res, 0, 0));
	else
		v = strdup("");
	PQclear(res);
	return v;
}

/* State of a key in the test scope: NONE, PROCESSING or DONE. */
static const char *
key_state(const char *key)
{
	const char *values[2] = {SCOPE, key};
	char	   *v = query_value(admin,
								"SELECT CASE WHEN status IS NULL THEN 'PROCESSING'"
								" ELSE 'DONE' END FROM idem.keys"
								" WHERE scope = $1 AND key = $2", 2, values);
	const char *state = strcmp(v, "DONE") == 0 ? "DONE" :
		strcmp(v, "PROCESSING") == 0 ? "PROCESSING" : "NONE";

	free(v);
	return state;
}

/* Current token of a key, as text ("" if none). */
static char *
key_token(const char *key)
{
	const char *values[2] = {SCOPE, key};

	return query_value(admin, "SELECT token FROM idem.keys"
					   " WHERE scope = $1 AND key = $2", 2, values);
}

/* Terminate a backend and wait until it is gone. */
static void
terminate(int pid)
{
	char		pidtext[16];
	const char *values[1] = {pidtext};
	int			i;

	snprintf(pidtext, sizeof(pidtext), "%d", pid);
	PQclear(query(admin, "SELECT pg_terminate_backend($1::integer)", 1, values));
	for (i = 0; i < POLL_LIMIT; i++)
	{
		char	   *n = query_value(admin, "SELECT count(*) FROM pg_stat_activity"
									" WHERE pid = $1::integer", 1, values);
		bool		gone = strcmp(n, "0") == 0;

		free(n);
		if (gone)
			return;
		sleep_ms(10);
	}
}

/* The test handler: count, run the "during" step, answer. */
static int
handler(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	Ctx		   *ctx = arg;

	__atomic_add_fetch(&ctx->calls, 1, __ATOMIC_SEQ_CST);
	if (ctx->during)
		ctx->during(ctx, claim);
	idem_response_set(resp, ctx->status, ctx->body, ctx->body_len);
	return ctx->fail;
}

/* A handler context answering status 201 "created". */
static void
ctx_init(Ctx *ctx)
{
	memset(ctx, 0, sizeof(Ctx));
	ctx->status = 201;
	ctx->body = "created";
	ctx->body_len = 7;
}

/* Options of the test scope. */
static void
opts_init(IdemGuardOptions *opts)
{
	idem_guard_options_init(opts);
	opts->scope = SCOPE;
	opts->lease_ms = 20000;
	opts->retention_ms = 600000;
}

/* Body of a response as printable text. */
static const char *
body_text(const IdemResult *res, char *buf, size_t size)
{
	snprintf(buf, size, "%.*s", (int) res->resp.body_len,
			 res->resp.body ? (const char *) res->resp.body : "");
	return buf;
}

/* Run the guard once; prints nothing. */
static IdemOutcome
run(PGconn *conn, const IdemGuardOptions *opts, const char *key,
	const char *fp, Ctx *ctx, IdemResult *res)
{
	return idem_guard_do_opts(conn, opts, key, fp, handler, ctx, res);
}

/* A new key: executed, response stored; then replayed; then conflict. */
static void
test_basic(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	char		body[64];
	char	   *stored;
	const char *values[2] = {SCOPE, "basic"};

	opts_init(&opts);
	ctx_init(&ctx);
	run(conn, &opts, "basic", "fp-1", &ctx, &res);
	stored = query_value(admin, "SELECT status || '/' || convert_from(body, 'UTF8')"
						 " FROM idem.keys WHERE scope = $1 AND key = $2",
						 2, values);
	printf("executed: outcome=%s failed=%s calls=%d status=%d body=%s token=%s stored=%s/%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, res.resp.status, body_text(&res, body, sizeof(body)),
		   res.token > 0 ? "set" : "unset", key_state("basic"), stored);
	free(stored);
	idem_result_clear(&res);

	run(conn, &opts, "basic", "fp-1", &ctx, &res);
	printf("replayed: outcome=%s failed=%s calls=%d status=%d body=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, res.resp.status, body_text(&res, body, sizeof(body)));
	idem_result_clear(&res);

	run(conn, &opts, "basic", "fp-2", &ctx, &res);
	printf("conflict: outcome=%s failed=%s calls=%d status=%d body_len=%zu\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, res.resp.status, res.resp.body_len);
	idem_result_clear(&res);

	/* Default options: default scope, server lease and retention. */
	ctx_init(&ctx);
	idem_guard_do(conn, "basic", "fp-3", handler, &ctx, &res);
	printf("defaults: outcome=%s failed=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls);
	idem_result_clear(&res);
}

/* The batch handler: answer "key:item", fail the item named by arg. */
typedef struct ManyCtx
{
	int			fail_item;		/* -1: none */
	char		order[128];		/* items run, in order */
} ManyCtx;

static int
many_handler(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	ManyCtx    *mc = arg;
	char		body[128];
	size_t		len = strlen(mc->order);

	snprintf(mc->order + len, sizeof(mc->order) - len, "%s%zu",
			 len ? "," : "", claim->item);
	snprintf(body, sizeof(body), "%s:%zu", claim->key, claim->item);
	idem_response_set(resp, 200, body, strlen(body));
	return (int) claim->item == mc->fail_item ? 7 : 0;
}

/* Print a batch's results on one line named name. */
static void
print_many(const char *name, size_t n, IdemResult *results, const int *dups,
		   const ManyCtx *mc)
{
	char		line[1024] = "";
	size_t		i;
	size_t		len;

	for (i = 0; i < n; i++)
	{
		len = strlen(line);
		snprintf(line + len, sizeof(line) - len, "%s%s", i ? "," : "",
				 idem_outcome_name(results[i].outcome));
	}
	len = strlen(line);
	snprintf(line + len, sizeof(line) - len, " dups=");
	for (i = 0; i < n; i++)
	{
		len = strlen(line);
		snprintf(line + len, sizeof(line) - len, "%s%d", i ? "," : "", dups[i]);
	}
	len = strlen(line);
	snprintf(line + len, sizeof(line) - len, " bodies=");
	for (i = 0; i < n; i++)
	{
		len = strlen(line);
		snprintf(line + len, sizeof(line) - len, "%s%.*s", i ? "|" : "",
				 (int) results[i].resp.body_len,
				 results[i].resp.body ? (const char *) results[i].resp.body : "");
	}
	len = strlen(line);
	snprintf(line + len, sizeof(line) - len, " failed=");
	for (i = 0; i < n; i++)
	{
		len = strlen(line);
		snprintf(line + len, sizeof(line) - len, "%s%s", i ? "," : "",
				 idem_step_name(results[i].failed));
	}
	printf("%s: outcomes=%s order=%s\n", name, line, mc->order);
}

/*
 * Batches: order, a stored key replayed, a key repeated (same and other
 * fingerprint), a handler error on one item (released, run again by the
 * retry), keys that need quoting in an array.
 */
static void
test_many(PGconn *conn)
{
	const char *keys[] = {"many-a", "many-b", "many-a", "many-c", "many-a",
	"many-\"q\\{,}"};
	const char *fps[] = {"fp", "fp", "fp", "fp", "other", "fp"};
	IdemResult	results[6];
	int			dups[6];
	IdemGuardOptions opts;
	IdemResult	res;
	ManyCtx		mc;
	Ctx			ctx;
	size_t		i;
	int			rc;

	opts_init(&opts);
	ctx_init(&ctx);
	run(conn, &opts, "many-b", "fp", &ctx, &res);
	idem_result_clear(&res);

	memset(&mc, 0, sizeof(mc));
	mc.fail_item = 3;
	rc = idem_guard_do_many(conn, &opts, 6, keys, fps, many_handler, &mc,
							results, dups);
	print_many("many", 6, results, dups, &mc);
	printf("many_states: rc=%d a=%s b=%s c=%s q=%s released=%s\n", rc,
		   key_state("many-a"), key_state("many-b"), key_state("many-c"),
		   key_state(keys[5]), results[3].released ? "yes" : "no");
	for (i = 0; i < 6; i++)
		idem_result_clear(&results[i]);

	/* The retry runs the failed item alone; the rest replays in order. */
	memset(&mc, 0, sizeof(mc));
	mc.fail_item = -1;
	idem_guard_do_many(conn, &opts, 6, keys, fps, many_handler, &mc,
					   results, dups);
	print_many("many_retry", 6, results, dups, &mc);
	for (i = 0; i < 6; i++)
		idem_result_clear(&results[i]);

	/* No claim can be made: every item UNAVAILABLE, nothing run. */
	memset(&mc, 0, sizeof(mc));
	mc.fail_item = -1;
	{
		IdemFaultCounter fc = {"begin", 1};

		opts.fault = idem_fault_fail_n;
		opts.fault_arg = &fc;
		rc = idem_guard_do_many(conn, &opts, 2, keys, fps, many_handler, &mc,
								results, NULL);
		printf("many_unavailable: rc=%d outcomes=%s,%s failed=%s order=%s\n", rc,
			   idem_outcome_name(results[0].outcome),
			   idem_outcome_name(results[1].outcome),
			   idem_step_name(results[0].failed), mc.order);
		for (i = 0; i < 2; i++)
			idem_result_clear(&results[i]);
	}
}

/* A body with zero bytes replays byte for byte. */
static void
test_binary(PGconn *conn)
{
	static const unsigned char bytes[] = {0x00, 0xff, 0x0a, 0x00, 0x27, 0x5c};
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	IdemOutcome first;
	size_t		i;

	opts_init(&opts);
	ctx_init(&ctx);
	ctx.body = bytes;
	ctx.body_len = sizeof(bytes);
	first = run(conn, &opts, "binary", "fp", &ctx, &res);
	idem_result_clear(&res);
	run(conn, &opts, "binary", "fp", &ctx, &res);
	printf("binary: first=%s replay=%s len=%zu hex=", idem_outcome_name(first),
		   idem_outcome_name(res.outcome), res.resp.body_len);
	for (i = 0; i < res.resp.body_len; i++)
		printf("%02x", res.resp.body[i]);
	printf("\n");
	idem_result_clear(&res);

	/* An empty body is stored as empty, no body as NULL. */
	ctx.body = "";
	ctx.body_len = 0;
	run(conn, &opts, "empty-body", "fp", &ctx, &res);
	idem_result_clear(&res);
	run(conn, &opts, "empty-body", "fp", &ctx, &res);
	printf("empty_body: outcome=%s body=%s len=%zu\n",
		   idem_outcome_name(res.outcome), res.resp.body ? "empty" : "null",
		   res.resp.body_len);
	idem_result_clear(&res);
	ctx.body = NULL;
	run(conn, &opts, "null-body", "fp", &ctx, &res);
	idem_result_clear(&res);
	run(conn, &opts, "null-body", "fp", &ctx, &res);
	printf("null_body: outcome=%s body=%s len=%zu\n",
		   idem_outcome_name(res.outcome), res.resp.body ? "empty" : "null",
		   res.resp.body_len);
	idem_result_clear(&res);
}

/* Claims held by others: committed, and uncommitted with wait off. */
static void
test_in_flight(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	PGconn	   *other = connect_or_die(conninfo);
	const char *held[2] = {"held", SCOPE};
	const char *open_claim[2] = {"open", SCOPE};

	opts_init(&opts);
	ctx_init(&ctx);
	PQclear(query(other, "SELECT * FROM idem_begin($1, 'fp', scope => $2)",
				  2, held));
	run(conn, &opts, "held", "fp", &ctx, &res);
	printf("in_flight: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("held"));
	idem_result_clear(&res);

	/* An uncommitted claim: wait => false answers at once. */
	PQclear(query(other, "BEGIN", 0, NULL));
	PQclear(query(other, "SELECT * FROM idem_begin($1, 'fp', scope => $2)",
				  2, open_claim));
	opts.wait = false;
	run(conn, &opts, "open", "fp", &ctx, &res);
	printf("in_flight_nowait: outcome=%s failed=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls);
	idem_result_clear(&res);

	/* wait => true blocks on it: the client timeout cancels the claim. */
	opts.wait = true;
	opts.timeout_ms = 300;
	run(conn, &opts, "open", "fp", &ctx, &res);
	printf("timeout: outcome=%s failed=%s message=%s calls=%d conn=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, ctx.calls,
		   PQstatus(conn) == CONNECTION_OK ? "ok" : "bad");
	idem_result_clear(&res);

	/* The holder rolls back: the key is free and the same connection works. */
	PQclear(query(other, "ROLLBACK", 0, NULL));
	opts.timeout_ms = 0;
	run(conn, &opts, "open", "fp", &ctx, &res);
	printf("after_timeout: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("open"));
	idem_result_clear(&res);
	PQfinish(other);
}

/* The claim cannot be made: refused, lost, read-only, in a transaction. */
static void
test_unavailable(void)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	PGconn	   *conn;
	const char *keys[] = {"dbname", "options", NULL};
	const char *vals[] = {conninfo, "-c default_transaction_read_only=on", NULL};

	opts_init(&opts);
	ctx_init(&ctx);

	conn = PQconnectdb(down_conninfo);
	run(conn, &opts, "down", "fp", &ctx, &res);
	printf("unavailable_refused: outcome=%s failed=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls);
	idem_result_clear(&res);
	PQfinish(conn);

	run(NULL, &opts, "down", "fp", &ctx, &res);
	printf("unavailable_no_conn: outcome=%s failed=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls);
	idem_result_clear(&res);

	conn = connect_or_die(conninfo);
	terminate(PQbackendPID(conn));
	run(conn, &opts, "lost", "fp", &ctx, &res);
	printf("unavailable_lost: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("lost"));
	idem_result_clear(&res);
	PQfinish(conn);

	conn = PQconnectdbParams(keys, vals, 1);
	run(conn, &opts, "read-only", "fp", &ctx, &res);
	printf("unavailable_read_only: outcome=%s failed=%s sqlstate=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, ctx.calls, key_state("read-only"));
	idem_result_clear(&res);
	PQfinish(conn);

	conn = connect_or_die(conninfo);
	PQclear(query(conn, "BEGIN", 0, NULL));
	run(conn, &opts, "in-tx", "fp", &ctx, &res);
	printf("unavailable_in_transaction: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("in-tx"));
	idem_result_clear(&res);
	PQfinish(conn);
}

/* The fault hook at begin, then at complete; the handler failing. */
static void
test_faults(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	IdemFaultCounter begin_fault = {"begin", 2};
	IdemFaultCounter complete_fault = {"complete", 1};
	IdemFaultCounter release_fault = {"release", 1};
	IdemOutcome o1,
				o2,
				o3;

	/* begin fails twice, then works. */
	opts_init(&opts);
	ctx_init(&ctx);
	opts.fault = idem_fault_fail_n;
	opts.fault_arg = &begin_fault;
	o1 = run(conn, &opts, "fault-begin", "fp", &ctx, &res);
	printf("fault_begin: outcome=%s failed=%s message=%s calls=%d state=%s\n",
		   idem_outcome_name(o1), idem_step_name(res.failed), res.message,
		   ctx.calls, key_state("fault-begin"));
	idem_result_clear(&res);
	o2 = run(conn, &opts, "fault-begin", "fp", &ctx, &res);
	idem_result_clear(&res);
	o3 = run(conn, &opts, "fault-begin", "fp", &ctx, &res);
	idem_result_clear(&res);
	printf("fault_begin_n: outcomes=%s,%s,%s calls=%d state=%s\n",
		   idem_outcome_name(o1), idem_outcome_name(o2), idem_outcome_name(o3),
		   ctx.calls, key_state("fault-begin"));

	/* complete fails once: in flight, then taken over after the lease. */
	opts_init(&opts);
	ctx_init(&ctx);
	opts.fault = idem_fault_fail_n;
	opts.fault_arg = &complete_fault;
	run(conn, &opts, "fault-complete", "fp", &ctx, &res);
	printf("fault_complete: outcome=%s failed=%s message=%s status=%d calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, res.resp.status, ctx.calls,
		   key_state("fault-complete"));
	idem_result_clear(&res);
	run(conn, &opts, "fault-complete", "fp", &ctx, &res);
	printf("fault_complete_retry: outcome=%s calls=%d\n",
		   idem_outcome_name(res.outcome), ctx.calls);
	idem_result_clear(&res);
	opts.clock_offset_s = 30;
	run(conn, &opts, "fault-complete", "fp", &ctx, &res);
	printf("fault_complete_takeover: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("fault-complete"));
	idem_result_clear(&res);

	/* Handler error: released by default, a retry runs at once. */
	opts_init(&opts);
	ctx_init(&ctx);
	ctx.fail = 7;
	run(conn, &opts, "handler-error", "fp", &ctx, &res);
	printf("handler_error: outcome=%s failed=%s message=%s released=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, res.released ? "yes" : "no", ctx.calls,
		   key_state("handler-error"));
	idem_result_clear(&res);
	ctx.fail = 0;
	run(conn, &opts, "handler-error", "fp", &ctx, &res);
	printf("handler_error_retry: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("handler-error"));
	idem_result_clear(&res);

	/* The Go behaviour: the key is left to its lease. */
	ctx_init(&ctx);
	ctx.fail = 7;
	opts.keep_claim_on_error = true;
	run(conn, &opts, "handler-keep", "fp", &ctx, &res);
	printf("handler_error_keep: outcome=%s failed=%s released=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.released ? "yes" : "no", ctx.calls, key_state("handler-keep"));
	idem_result_clear(&res);
	ctx.fail = 0;
	run(conn, &opts, "handler-keep", "fp", &ctx, &res);
	printf("handler_error_keep_retry: outcome=%s calls=%d\n",
		   idem_outcome_name(res.outcome), ctx.calls);
	idem_result_clear(&res);
	opts.clock_offset_s = 30;
	run(conn, &opts, "handler-keep", "fp", &ctx, &res);
	printf("handler_error_keep_takeover: outcome=%s failed=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, key_state("handler-keep"));
	idem_result_clear(&res);

	/* The release itself fails: reported, the key waits for its lease. */
	opts_init(&opts);
	ctx_init(&ctx);
	ctx.fail = 7;
	opts.fault = idem_fault_fail_n;
	opts.fault_arg = &release_fault;
	run(conn, &opts, "release-fault", "fp", &ctx, &res);
	printf("release_fault: outcome=%s failed=%s message=%s released=%s state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, res.released ? "yes" : "no",
		   key_state("release-fault"));
	idem_result_clear(&res);
}

/* "during" step: terminate the guard's own backend. */
static void
during_terminate(Ctx *ctx, const IdemClaim *claim)
{
	(void) claim;
	terminate(PQbackendPID(ctx->guard_conn));
}

/* "during" step: another caller takes the key over after the lease. */
static void
during_takeover(Ctx *ctx, const IdemClaim *claim)
{
	const char *values[2] = {claim->key, claim->scope};
	PGconn	   *other = connect_or_die(conninfo);
	char	   *claimed;

	PQclear(query(other, "SET idem.clock_offset = 60", 0, NULL));
	claimed = query_value(other, "SELECT claimed FROM idem_begin($1, 'fp',"
						  " lease => '5 s', scope => $2)", 2, values);
	ctx->flag = strcmp(claimed, "t") == 0;
	free(claimed);
	PQfinish(other);
}

/* Complete fails after the handler: connection lost, token superseded. */
static void
test_complete_failures(void)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	PGconn	   *conn = connect_or_die(conninfo);
	char	   *token_after;

	opts_init(&opts);
	ctx_init(&ctx);
	ctx.during = during_terminate;
	ctx.guard_conn = conn;
	run(conn, &opts, "complete-lost", "fp", &ctx, &res);
	printf("complete_lost: outcome=%s failed=%s status=%d calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.resp.status, ctx.calls, key_state("complete-lost"));
	idem_result_clear(&res);
	PQfinish(conn);

	conn = connect_or_die(conninfo);
	ctx_init(&ctx);
	ctx.during = during_takeover;
	run(conn, &opts, "superseded", "fp", &ctx, &res);
	token_after = key_token("superseded");
	printf("superseded: outcome=%s failed=%s sqlstate=%s taken_over=%s token_changed=%s state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, ctx.flag ? "yes" : "no",
		   strtoll(token_after, NULL, 10) != res.token ? "yes" : "no",
		   key_state("superseded"));
	free(token_after);
	idem_result_clear(&res);
	PQfinish(conn);
}

/*
 * The server refuses the handler's response for good (a negative status,
 * 22023): the fixed 500 is stored in its place, the result says so with
 * the key, and a retry replays the 500 without running the handler.
 */
static void
test_not_stored(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	const char *values[3] = {SCOPE, "not-stored", IDEM_NOT_STORED_BODY};
	char	   *stored;
	int			i;

	opts_init(&opts);
	opts.timeout_ms = 10000;
	ctx_init(&ctx);
	ctx.status = -1;
	run(conn, &opts, "not-stored", "fp", &ctx, &res);
	stored = query_value(admin, "SELECT status || '/' ||"
						 " (convert_from(body, 'UTF8') = $3)::text"
						 " FROM idem.keys WHERE scope = $1 AND key = $2",
						 3, values);
	printf("not_stored: outcome=%s failed=%s sqlstate=%s not_stored=%s names_key=%s status=%d calls=%d stored=%s/%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, res.not_stored ? "yes" : "no",
		   strstr(res.message, "\"not-stored\"") ? "yes" : "no",
		   res.resp.status, ctx.calls, key_state("not-stored"), stored);
	free(stored);
	idem_result_clear(&res);

	for (i = 0; i < 2; i++)
	{
		run(conn, &opts, "not-stored", "fp", &ctx, &res);
		printf("not_stored_retry%d: outcome=%s failed=%s calls=%d status=%d body=%s\n",
			   i + 1, idem_outcome_name(res.outcome),
			   idem_step_name(res.failed), ctx.calls, res.resp.status,
			   res.resp.body_len == strlen(IDEM_NOT_STORED_BODY) &&
			   memcmp(res.resp.body, IDEM_NOT_STORED_BODY,
					  res.resp.body_len) == 0 ? "fixed" : "other");
		idem_result_clear(&res);
	}
}

/*
 * "during" step: wait until the first lease is over by the server's
 * clock, check that the heartbeat has moved the lease beyond now, then at
 * once let another caller try the key.
 */
static void
during_outlive_lease(Ctx *ctx, const IdemClaim *claim)
{
	const char *values[2] = {claim->key, claim->scope};
	char	   *first = query_value(admin, "SELECT lease_until FROM idem.keys"
									" WHERE key = $1 AND scope = $2", 2, values);
	const char *cmp[3] = {first, claim->key, claim->scope};
	PGconn	   *other = connect_or_die(conninfo);
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			octx;
	int			i;

	for (i = 0; i < POLL_LIMIT; i++)
	{
		char	   *v = query_value(admin,
									"SELECT clock_timestamp() > $1::timestamptz",
									1, cmp);
		bool		done = strcmp(v, "t") == 0;

		free(v);
		if (done)
			break;
		sleep_ms(10);
	}
	/* The first lease is over: it must have been extended by now. */
	{
		char	   *v = query_value(admin,
									"SELECT lease_until > clock_timestamp()"
									" FROM idem.keys WHERE key = $1 AND scope = $2",
									2, values);

		ctx->flag = strcmp(v, "t") == 0;
		free(v);
	}
	opts_init(&opts);
	ctx_init(&octx);
	ctx->competitor = run(other, &opts, claim->key, "fp", &octx, &res);
	idem_result_clear(&res);
	PQfinish(other);
	free(first);
}

/* "during" step: lose the key to a takeover, wait for the heartbeat to see it. */
static void
during_lose_key(Ctx *ctx, const IdemClaim *claim)
{
	int			i;

	during_takeover(ctx, claim);
	for (i = 0; i < POLL_LIMIT && !idem_claim_lost(claim); i++)
		sleep_ms(10);
	ctx->competitor = idem_claim_lost(claim) ? IDEM_EXECUTED : IDEM_IN_FLIGHT;
}

/* The heartbeat extends the lease; a superseded token stops it. */
static void
test_heartbeat(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;

	opts_init(&opts);
	opts.lease_ms = 6000;
	opts.heartbeat_conninfo = conninfo;
	ctx_init(&ctx);
	ctx.during = during_outlive_lease;
	run(conn, &opts, "heartbeat", "fp", &ctx, &res);
	printf("heartbeat: outcome=%s failed=%s lease_outlived=%s competitor=%s extends=%s superseded=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.flag ? "yes" : "no", idem_outcome_name(ctx.competitor),
		   res.extends > 0 ? "some" : "none",
		   res.superseded ? "yes" : "no", ctx.calls, key_state("heartbeat"));
	idem_result_clear(&res);

	ctx_init(&ctx);
	ctx.during = during_lose_key;
	run(conn, &opts, "heartbeat-lost", "fp", &ctx, &res);
	printf("heartbeat_superseded: outcome=%s failed=%s sqlstate=%s taken_over=%s lost_seen=%s superseded=%s state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, ctx.flag ? "yes" : "no",
		   ctx.competitor == IDEM_EXECUTED ? "yes" : "no",
		   res.superseded ? "yes" : "no", key_state("heartbeat-lost"));
	idem_result_clear(&res);

	/* No heartbeat connection: the claim is given up, the handler not run. */
	ctx_init(&ctx);
	opts.heartbeat_conninfo = down_conninfo;
	run(conn, &opts, "heartbeat-down", "fp", &ctx, &res);
	printf("heartbeat_unavailable: outcome=%s failed=%s released=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.released ? "yes" : "no", ctx.calls,
		   key_state("heartbeat-down"));
	idem_result_clear(&res);
}

/* Scopes, the window, and the test clock. */
static void
test_scope_and_window(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	IdemOutcome a,
				b,
				again;

	opts_init(&opts);
	ctx_init(&ctx);
	opts.scope = "tenant-a";
	a = run(conn, &opts, "scoped", "fp", &ctx, &res);
	idem_result_clear(&res);
	opts.scope = "tenant-b";
	b = run(conn, &opts, "scoped", "fp", &ctx, &res);
	idem_result_clear(&res);
	again = run(conn, &opts, "scoped", "fp", &ctx, &res);
	idem_result_clear(&res);
	printf("scopes: a=%s b=%s b_again=%s calls=%d\n", idem_outcome_name(a),
		   idem_outcome_name(b), idem_outcome_name(again), ctx.calls);

	opts_init(&opts);
	ctx_init(&ctx);
	opts.retention_ms = 30000;
	a = run(conn, &opts, "window", "fp", &ctx, &res);
	idem_result_clear(&res);
	b = run(conn, &opts, "window", "fp", &ctx, &res);
	idem_result_clear(&res);
	opts.clock_offset_s = 60;
	again = run(conn, &opts, "window", "fp", &ctx, &res);
	idem_result_clear(&res);
	printf("window: first=%s inside=%s after=%s calls=%d\n",
		   idem_outcome_name(a), idem_outcome_name(b),
		   idem_outcome_name(again), ctx.calls);
}

/* One thread of the concurrency test. */
typedef struct Worker
{
	pthread_t	thread;
	pthread_barrier_t *start;
	Ctx		   *ctx;
	IdemOutcome outcome;
	IdemStep	failed;
} Worker;

/* Thread body: one guarded call on its own connection. */
static void *
worker_main(void *arg)
{
	Worker	   *w = arg;
	PGconn	   *conn = connect_or_die(conninfo);
	IdemGuardOptions opts;
	IdemResult	res;

	opts_init(&opts);
	pthread_barrier_wait(w->start);
	w->outcome = run(conn, &opts, "threads", "fp", w->ctx, &res);
	w->failed = res.failed;
	idem_result_clear(&res);
	PQfinish(conn);
	return NULL;
}

/* "during" step: a short handler. */
static void
during_sleep(Ctx *ctx, const IdemClaim *claim)
{
	(void) ctx;
	(void) claim;
	sleep_ms(20);
}

/* Eight threads, one connection each, one key: one execution. */
static void
test_threads(void)
{
	Worker		workers[8];
	pthread_barrier_t start;
	Ctx			ctx;
	int			executed = 0,
				others = 0,
				errors = 0;
	int			i;

	ctx_init(&ctx);
	ctx.during = during_sleep;
	pthread_barrier_init(&start, NULL, 8);
	for (i = 0; i < 8; i++)
	{
		workers[i].start = &start;
		workers[i].ctx = &ctx;
		pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]);
	}
	for (i = 0; i < 8; i++)
	{
		pthread_join(workers[i].thread, NULL);
		if (workers[i].outcome == IDEM_EXECUTED)
			executed++;
		else if (workers[i].outcome == IDEM_IN_FLIGHT ||
				 workers[i].outcome == IDEM_REPLAYED)
			others++;
		if (workers[i].failed != IDEM_STEP_NONE)
			errors++;
	}
	pthread_barrier_destroy(&start);
	printf("threads: executed=%d others=%d errors=%d calls=%d state=%s\n",
		   executed, others, errors, ctx.calls, key_state("threads"));
}

/* conninfo with more keywords appended (malloc'd). */
static char *
conninfo_with(const char *extra)
{
	size_t		n = strlen(conninfo) + strlen(extra) + 2;
	char	   *s = malloc(n);

	snprintf(s, n, "%s %s", conninfo, extra);
	return s;
}

/*
 * The heartbeat follows the lease the claim returned: with lease_ms 0 and
 * a server default lease of 6 s, it keeps the claim past its first end.
 */
static void
test_heartbeat_default_lease(void)
{
	char	   *short_lease = conninfo_with("options='-c idem.default_lease=6'");
	PGconn	   *conn = connect_or_die(short_lease);
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;

	opts_init(&opts);
	opts.lease_ms = 0;
	opts.heartbeat_conninfo = short_lease;
	ctx_init(&ctx);
	ctx.during = during_outlive_lease;
	run(conn, &opts, "heartbeat-default", "fp", &ctx, &res);
	printf("heartbeat_default_lease: outcome=%s failed=%s lease_outlived=%s competitor=%s extends=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.flag ? "yes" : "no", idem_outcome_name(ctx.competitor),
		   res.extends > 0 ? "some" : "none", ctx.calls,
		   key_state("heartbeat-default"));
	idem_result_clear(&res);
	PQfinish(conn);
	free(short_lease);
}

/* A socket bound to a local port, not listening yet: connections refused. */
static int	hang_fd = -1;

/*
 * "during" step: lose the heartbeat's connection while its first host
 * accepts connections and never answers, and wait until the heartbeat is
 * re-connecting to it.
 */
static void
during_hang_heartbeat(Ctx *ctx, const IdemClaim *claim)
{
	char	   *pid;
	struct pollfd pfd;

	(void) claim;
	listen(hang_fd, 8);
	pid = query_value(admin, "SELECT pid FROM pg_stat_activity"
					  " WHERE application_name = 'guard_hb'", 0, NULL);
	if (*pid != '\0')
		terminate(atoi(pid));
	free(pid);
	pfd.fd = hang_fd;
	pfd.events = POLLIN;
	pfd.revents = 0;
	ctx->flag = poll(&pfd, 1, POLL_LIMIT * 10) > 0;
}

/*
 * The heartbeat's lost connection is re-made without blocking the stop:
 * its first host takes the connection and never answers (no
 * connect_timeout), and the guard still returns.
 */
static void
test_heartbeat_reset(PGconn *conn)
{
	struct sockaddr_in addr;
	socklen_t	len = sizeof(addr);
	char		hb_conninfo[1024];
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;

	hang_fd = socket(AF_INET, SOCK_STREAM, 0);
	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	addr.sin_port = 0;
	if (hang_fd < 0 || bind(hang_fd, (struct sockaddr *) &addr, sizeof(addr)) != 0 ||
		getsockname(hang_fd, (struct sockaddr *) &addr, &len) != 0)
	{
		fprintf(stderr, "guard_test: cannot bind a local socket\n");
		exit(2);
	}
	snprintf(hb_conninfo, sizeof(hb_conninfo),
			 "host=127.0.0.1,%s port=%d,%s dbname=%s application_name=guard_hb",
			 PQhost(admin), ntohs(addr.sin_port), PQport(admin), PQdb(admin));

	opts_init(&opts);
	opts.lease_ms = 1500;
	opts.heartbeat_conninfo = hb_conninfo;
	ctx_init(&ctx);
	ctx.during = during_hang_heartbeat;
	run(conn, &opts, "heartbeat-reset", "fp", &ctx, &res);
	printf("heartbeat_reset: outcome=%s failed=%s reconnecting=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.flag ? "yes" : "no", ctx.calls, key_state("heartbeat-reset"));
	idem_result_clear(&res);
	close(hang_fd);
}

/* A stored response that cannot be copied is a failure, not an empty replay. */
static void
test_replay_failure(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	IdemFaultCounter replay_fault = {"replay", 1};
	char		body[64];

	opts_init(&opts);
	ctx_init(&ctx);
	run(conn, &opts, "replay-fault", "fp", &ctx, &res);
	idem_result_clear(&res);
	opts.fault = idem_fault_fail_n;
	opts.fault_arg = &replay_fault;
	run(conn, &opts, "replay-fault", "fp", &ctx, &res);
	printf("replay_out_of_memory: outcome=%s failed=%s message=%s calls=%d body=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, ctx.calls, res.resp.body ? "set" : "none");
	idem_result_clear(&res);
	run(conn, &opts, "replay-fault", "fp", &ctx, &res);
	printf("replay_after_failure: outcome=%s failed=%s status=%d body=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.resp.status, body_text(&res, body, sizeof(body)));
	idem_result_clear(&res);
}

/*
 * Every call names the schema and casts its arguments: a look-alike
 * idem_begin in the "$user" schema, first on the default search_path, is
 * not called; a missing schema makes the claim fail.
 */
static void
test_schema(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	char	   *user = query_value(admin, "SELECT pg_catalog.quote_ident(current_user)",
								   0, NULL);
	char		sql[1024];

	snprintf(sql, sizeof(sql), "CREATE SCHEMA %s", user);
	PQclear(query(admin, sql, 0, NULL));
	snprintf(sql, sizeof(sql),
			 "CREATE FUNCTION %s.idem_begin(key text, fingerprint text,"
			 " lease interval, retention interval, scope text, wait boolean)"
			 " RETURNS TABLE (claimed boolean, state text, token bigint,"
			 " status integer, body bytea, lease_until timestamptz,"
			 " expires_at timestamptz) LANGUAGE sql AS"
			 " $$SELECT true, 'PROCESSING', 666::bigint, NULL::integer,"
			 " NULL::bytea, now() + interval '1 hour', now() + interval '1 day'$$",
			 user);
	PQclear(query(admin, sql, 0, NULL));

	opts_init(&opts);
	ctx_init(&ctx);
	run(conn, &opts, "user-schema", "fp", &ctx, &res);
	printf("user_schema: outcome=%s failed=%s fake_token=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.token == 666 ? "yes" : "no", ctx.calls,
		   key_state("user-schema"));
	idem_result_clear(&res);

	opts.schema = "nosuch";
	run(conn, &opts, "no-schema", "fp", &ctx, &res);
	printf("schema_missing: outcome=%s failed=%s sqlstate=%s message=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, res.message, ctx.calls, key_state("no-schema"));
	idem_result_clear(&res);

	/* A schema without idem: the function is missing, named with wait_for. */
	opts.schema = "pg_catalog";
	opts.wait_for_ms = 1000;
	run(conn, &opts, "no-function", "fp", &ctx, &res);
	printf("function_missing: outcome=%s failed=%s sqlstate=%s message=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, res.message, ctx.calls, key_state("no-function"));
	idem_result_clear(&res);

	/*
	 * A state the guard does not know (a newer server, played by a
	 * look-alike): the claim fails, the handler does not run.
	 */
	PQclear(query(admin, "CREATE SCHEMA idem_future", 0, NULL));
	PQclear(query(admin,
				  "CREATE FUNCTION idem_future.idem_begin(key text, fingerprint text,"
				  " lease interval, retention interval, scope text, wait boolean)"
				  " RETURNS TABLE (claimed boolean, state text, token bigint,"
				  " status integer, body bytea, lease_until timestamptz,"
				  " expires_at timestamptz) LANGUAGE sql AS"
				  " $$SELECT false, 'TOMBSTONED', NULL::bigint, 200, pg_catalog.decode('6f6b', 'hex'),"
				  " NULL::timestamptz, now() + interval '1 day'$$", 0, NULL));
	opts_init(&opts);
	opts.schema = "idem_future";
	ctx_init(&ctx);
	run(conn, &opts, "future-state", "fp", &ctx, &res);
	printf("unknown_state: outcome=%s failed=%s message=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, ctx.calls);
	idem_result_clear(&res);

	/*
	 * remember is sent only when set: against this idem_begin without it,
	 * a guard with remember_ms names an argument it lacks (42883).
	 */
	opts.remember_ms = 1000;
	ctx_init(&ctx);
	run(conn, &opts, "future-remember", "fp", &ctx, &res);
	printf("remember_unknown: outcome=%s failed=%s sqlstate=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, ctx.calls);
	idem_result_clear(&res);
	PQclear(query(admin, "DROP SCHEMA idem_future CASCADE", 0, NULL));

	/*
	 * EXPIRED (a server with tombstones, played by a look-alike that
	 * records each call's remember): the handler does not run, the
	 * result carries the first response's status and no body.
	 */
	PQclear(query(admin, "CREATE SCHEMA idem_tomb", 0, NULL));
	PQclear(query(admin, "CREATE TABLE idem_tomb.calls (id bigserial, key text, remember interval)",
				  0, NULL));
	PQclear(query(admin,
				  "CREATE FUNCTION idem_tomb.idem_begin(key text, fingerprint text,"
				  " lease interval DEFAULT NULL, retention interval DEFAULT NULL,"
				  " scope text DEFAULT '', wait boolean DEFAULT true,"
				  " wait_for interval DEFAULT NULL, remember interval DEFAULT NULL)"
				  " RETURNS SETOF idem.begin_result LANGUAGE plpgsql AS $$ BEGIN"
				  " INSERT INTO idem_tomb.calls (key, remember)"
				  " VALUES (idem_begin.key, idem_begin.remember);"
				  " RETURN QUERY SELECT false, 'EXPIRED'::text, NULL::bigint, 201, NULL::bytea,"
				  " NULL::timestamptz, now() + interval '1 day', NULL::text, NULL::bytea;"
				  " END $$", 0, NULL));
	{
		static const char *const keys[] = {"tomb-plain", "tomb-remember", "tomb-wait"};
		static const int remember_ms[] = {0, 90000, 5000};
		static const int wait_for_ms[] = {0, 0, 1000};

		for (int i = 0; i < 3; i++)
		{
			PGresult   *r;
			const char *p[1] = {keys[i]};

			opts_init(&opts);
			opts.schema = "idem_tomb";
			opts.remember_ms = remember_ms[i];
			opts.wait_for_ms = wait_for_ms[i];
			ctx_init(&ctx);
			run(conn, &opts, keys[i], "fp", &ctx, &res);
			r = query(admin, "SELECT coalesce((extract(epoch FROM remember) * 1000)::int8::text, 'none')"
					  " FROM idem_tomb.calls WHERE key = $1", 1, p);
			printf("expired_%d: outcome=%s failed=%s status=%d body=%s calls=%d remember=%s\n",
				   i, idem_outcome_name(res.outcome), idem_step_name(res.failed),
				   res.resp.status, res.resp.body == NULL ? "none" : "some", ctx.calls,
				   PQntuples(r) == 1 ? PQgetvalue(r, 0, 0) : "?");
			PQclear(r);
			idem_result_clear(&res);
		}
	}
	PQclear(query(admin, "DROP SCHEMA idem_tomb CASCADE", 0, NULL));

	snprintf(sql, sizeof(sql), "DROP SCHEMA %s CASCADE", user);
	PQclear(query(admin, sql, 0, NULL));
	free(user);
}

/*
 * The server's own tombstones (extension 1.6), not a look-alike: keys
 * completed with a retention of 1 s, one with remember_ms of an hour, one
 * without.  Once their retention is over (expires_at < now(), polled),
 * the remembered key's retry is EXPIRED with the stored status and no body
 * and the handler does not run; the other one's retry runs it again.
 */
static void
test_server_tombstone(PGconn *conn)
{
	static const char *const keys[] = {"tomb-server", "tomb-server-plain"};
	const char *values[3] = {SCOPE, keys[0], keys[1]};
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx[2];
	char	   *over = NULL;
	char	   *state;

	for (int i = 0; i < 2; i++)
	{
		opts_init(&opts);
		opts.lease_ms = 1000;
		opts.retention_ms = 1000;
		opts.remember_ms = i == 0 ? 3600000 : 0;
		ctx_init(&ctx[i]);
		run(conn, &opts, keys[i], "fp", &ctx[i], &res);
		idem_result_clear(&res);
	}
	for (int n = 0; n < 600; n++)
	{
		free(over);
		over = query_value(admin, "SELECT coalesce(bool_and(expires_at < now()), false)"
						   " FROM idem.keys WHERE scope = $1 AND key IN ($2, $3)",
						   3, values);
		if (strcmp(over, "t") == 0)
			break;
		sleep_ms(50);
	}
	for (int i = 0; i < 2; i++)
	{
		opts_init(&opts);
		opts.lease_ms = 1000;
		opts.retention_ms = 1000;
		opts.remember_ms = i == 0 ? 3600000 : 0;
		run(conn, &opts, keys[i], "fp", &ctx[i], &res);
		if (i == 0)
		{
			state = query_value(admin, "SELECT state || '/' || coalesce(status::text, '')"
								" FROM idem_lookup($2, $1)", 2, values);
			printf("server_tombstone: retention_over=%s outcome=%s failed=%s status=%d body=%s"
				   " calls=%d lookup=%s\n",
				   over, idem_outcome_name(res.outcome), idem_step_name(res.failed),
				   res.resp.status, res.resp.body == NULL ? "none" : "some",
				   ctx[i].calls, state);
			free(state);
		}
		else
			printf("server_tombstone_plain: outcome=%s failed=%s calls=%d\n",
				   idem_outcome_name(res.outcome), idem_step_name(res.failed),
				   ctx[i].calls);
		idem_result_clear(&res);
	}
	free(over);
}

/* Milliseconds since start on the monotonic clock. */
static long
elapsed_ms(const struct timespec *start)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - start->tv_sec) * 1000L +
		(now.tv_nsec - start->tv_nsec) / 1000000L;
}

/*
 * How long the proxy holds a cancel request, and the lock test a row: the
 * bound the cases below must return well within.
 */
#define HOLD_MS				30000

#define PROXY_SLOTS			8
#define CANCEL_REQUEST_CODE	80877102

/* One connection through the proxy. */
typedef struct ProxySlot
{
	int			client;			/* -1: slot free */
	int			server;			/* -1: a held cancel request */
	struct timespec held_since;
} ProxySlot;

/*
 * A proxy in front of the server that holds cancel requests, as some
 * poolers and proxies do: it relays every other connection to the server,
 * and reads a cancel request and whatever follows without ever answering,
 * until HOLD_MS have passed or the proxy stops.  libpq sends a cancel
 * request to the host and port of the connection, so a connection made
 * through the proxy has its cancels held.
 */
typedef struct Proxy
{
	int			listen_fd;
	int			port;
	int			wake[2];		/* a byte on wake[1] stops the proxy */
	char		server_host[256];	/* where connections are relayed */
	char		server_port[16];
	pthread_t	thread;
	ProxySlot	slots[PROXY_SLOTS];
	atomic_int	cancels;		/* cancel requests received */
	atomic_int	let_go;			/* held requests closed after HOLD_MS */
} Proxy;

/* A socket connected to the server that admin reaches, or -1. */
static int
proxy_server_socket(const Proxy *px)
{
	struct addrinfo hints;
	struct addrinfo *ai;
	int			fd;

	if (px->server_host[0] == '/')
	{
		struct sockaddr_un un;

		int			len;

		memset(&un, 0, sizeof(un));
		un.sun_family = AF_UNIX;
		len = snprintf(un.sun_path, sizeof(un.sun_path), "%s/.s.PGSQL.%s",
					   px->server_host, px->server_port);
		if (len < 0 || len >= (int) sizeof(un.sun_path))
			return -1;
		fd = socket(AF_UNIX, SOCK_STREAM, 0);
		if (fd >= 0 && connect(fd, (struct sockaddr *) &un, sizeof(un)) != 0)
		{
			close(fd);
			fd = -1;
		}
		return fd;
	}
	memset(&hints, 0, sizeof(hints));
	hints.ai_socktype = SOCK_STREAM;
	if (getaddrinfo(px->server_host, px->server_port, &hints, &ai) != 0)
		return -1;
	fd = socket(ai->ai_family, SOCK_STREAM, 0);
	if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0)
	{
		close(fd);
		fd = -1;
	}
	freeaddrinfo(ai);
	return fd;
}

/* Write all of buf to a socket; false if the peer is gone. */
static bool
send_all(int fd, const char *buf, size_t len)
{
	while (len > 0)
	{
		ssize_t		n = send(fd, buf, len, MSG_NOSIGNAL);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return false;
		buf += n;
		len -= (size_t) n;
	}
	return true;
}

/* Close a slot's sockets and free it. */
static void
proxy_close(ProxySlot *slot)
{
	close(slot->client);
	if (slot->server >= 0)
		close(slot->server);
	slot->client = -1;
	slot->server = -1;
}

/*
 * Take a new connection: its first 8 bytes tell a cancel request (held)
 * from a startup packet (relayed, those bytes first).
 */
static void
proxy_accept(Proxy *px)
{
	struct timeval tv = {5, 0};
	unsigned char head[8];
	uint32_t	code;
	ProxySlot  *slot = NULL;
	int			fd = accept(px->listen_fd, NULL, NULL);
	int			i;

	if (fd < 0)
		return;
	for (i = 0; i < PROXY_SLOTS && slot == NULL; i++)
		if (px->slots[i].client < 0)
			slot = &px->slots[i];
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	if (slot == NULL || recv(fd, head, sizeof(head), MSG_WAITALL) != 8)
	{
		close(fd);
		return;
	}
	memcpy(&code, head + 4, sizeof(code));
	slot->client = fd;
	if (ntohl(code) == CANCEL_REQUEST_CODE)
	{
		slot->server = -1;
		clock_gettime(CLOCK_MONOTONIC, &slot->held_since);
		atomic_fetch_add(&px->cancels, 1);
		return;
	}
	slot->server = proxy_server_socket(px);
	if (slot->server < 0 || !send_all(slot->server, (char *) head, 8))
		proxy_close(slot);
}

/* Data on one side of a slot: relay it, or drop it if the slot is held. */
static void
proxy_pass(ProxySlot *slot, int fd)
{
	char		buf[8192];
	ssize_t		n = recv(fd, buf, sizeof(buf), 0);

	if (n < 0 && errno == EINTR)
		return;
	if (n <= 0)
		proxy_close(slot);
	else if (slot->server >= 0 &&
			 !send_all(fd == slot->client ? slot->server : slot->client,
					   buf, (size_t) n))
		proxy_close(slot);
}

/* Proxy thread: relay and hold until woken to stop. */
static void *
proxy_main(void *arg)
{
	Proxy	   *px = arg;
	int			i;

	for (;;)
	{
		struct pollfd pfds[2 + 2 * PROXY_SLOTS];
		ProxySlot  *owner[2 + 2 * PROXY_SLOTS];
		int			n = 2;
		int			timeout = -1;
		int			k;

		pfds[0].fd = px->wake[0];
		pfds[1].fd = px->listen_fd;
		pfds[0].events = pfds[1].events = POLLIN;
		for (i = 0; i < PROXY_SLOTS; i++)
		{
			ProxySlot  *slot = &px->slots[i];

			if (slot->client < 0)
				continue;
			if (slot->server < 0)
			{
				long		left = HOLD_MS - elapsed_ms(&slot->held_since);

				if (left <= 0)
				{
					proxy_close(slot);
					atomic_fetch_add(&px->let_go, 1);
					continue;
				}
				if (timeout < 0 || left < timeout)
					timeout = (int) left;
			}
			else
			{
				pfds[n].fd = slot->server;
				pfds[n].events = POLLIN;
				owner[n++] = slot;
			}
			pfds[n].fd = slot->client;
			pfds[n].events = POLLIN;
			owner[n++] = slot;
		}
		for (k = 0; k < n; k++)
			pfds[k].revents = 0;
		if (poll(pfds, n, timeout) < 0 && errno != EINTR)
			break;
		if (pfds[0].revents != 0)
			break;
		if (pfds[1].revents & POLLIN)
			proxy_accept(px);
		for (k = 2; k < n; k++)
		{
			/* Skip a side whose slot an earlier pass closed. */
			if (pfds[k].revents != 0 &&
				(pfds[k].fd == owner[k]->client ||
				 pfds[k].fd == owner[k]->server))
				proxy_pass(owner[k], pfds[k].fd);
		}
	}
	for (i = 0; i < PROXY_SLOTS; i++)
		if (px->slots[i].client >= 0)
			proxy_close(&px->slots[i]);
	return NULL;
}

/* Start the proxy on a free local port, relaying to admin's server. */
static void
proxy_start(Proxy *px)
{
	struct sockaddr_in addr;
	socklen_t	len = sizeof(addr);
	int			i;

	memset(px, 0, sizeof(Proxy));
	for (i = 0; i < PROXY_SLOTS; i++)
		px->slots[i].client = px->slots[i].server = -1;
	atomic_init(&px->cancels, 0);
	atomic_init(&px->let_go, 0);
	snprintf(px->server_host, sizeof(px->server_host), "%s", PQhost(admin));
	snprintf(px->server_port, sizeof(px->server_port), "%s", PQport(admin));
	px->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
	memset(&addr, 0, sizeof(addr));
	addr.sin_family = AF_INET;
	addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (px->listen_fd < 0 ||
		bind(px->listen_fd, (struct sockaddr *) &addr, sizeof(addr)) != 0 ||
		getsockname(px->listen_fd, (struct sockaddr *) &addr, &len) != 0 ||
		listen(px->listen_fd, 8) != 0 || pipe(px->wake) != 0 ||
		pthread_create(&px->thread, NULL, proxy_main, px) != 0)
	{
		fprintf(stderr, "guard_test: cannot start the proxy\n");
		exit(2);
	}
	px->port = ntohs(addr.sin_port);
}

/* Stop the proxy: every connection through it, held or not, is closed. */
static void
proxy_stop(Proxy *px)
{
	if (write(px->wake[1], "x", 1) != 1)
		fprintf(stderr, "guard_test: cannot wake the proxy\n");
	pthread_join(px->thread, NULL);
	close(px->wake[0]);
	close(px->wake[1]);
	close(px->listen_fd);
}

/*
 * A cancel is bounded by the deadline: the guard's connection goes through
 * the proxy, which holds cancel requests, and its claim waits for another
 * session's uncommitted claim.  The client timeout cancels it; the guard
 * returns while the request is still held (libpq's PQcancel would block
 * until the proxy lets it go).  The server ends the claim's wait by
 * itself, before the guard would give the connection up: the backend no
 * longer waits while the holder still holds the key, and once the holder
 * rolls back, the next claimant gets the key at once.
 */
static void
test_cancel_held(void)
{
	Proxy		px;
	char		proxied[1024];
	const char *open_claim[2] = {"cancel-held", SCOPE};
	PGconn	   *conn;
	PGconn	   *other;
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	char		pidtext[16];
	const char *pid_value[1] = {pidtext};
	char	   *next;
	int			let_go;
	bool		conn_ok;
	bool		wait_ended = false;
	int			i;

	proxy_start(&px);
	snprintf(proxied, sizeof(proxied),
			 "host=127.0.0.1 port=%d dbname=%s user=%s sslmode=disable"
			 " gssencmode=disable", px.port, PQdb(admin), PQuser(admin));
	conn = connect_or_die(proxied);
	snprintf(pidtext, sizeof(pidtext), "%d", PQbackendPID(conn));
	other = connect_or_die(conninfo);
	PQclear(query(other, "BEGIN", 0, NULL));
	PQclear(query(other, "SELECT * FROM idem_begin($1, 'fp', scope => $2)",
				  2, open_claim));

	opts_init(&opts);
	opts.timeout_ms = 300;
	ctx_init(&ctx);
	run(conn, &opts, "cancel-held", "fp", &ctx, &res);
	let_go = atomic_load(&px.let_go);
	conn_ok = PQstatus(conn) == CONNECTION_OK;
	/* The request may reach the proxy after the guard gave up waiting. */
	for (i = 0; i < POLL_LIMIT && atomic_load(&px.cancels) == 0; i++)
		sleep_ms(10);

	/* Nothing but the server's own timeout can end the claim's wait. */
	for (i = 0; i < POLL_LIMIT && !wait_ended; i++)
	{
		char	   *n = query_value(admin, "SELECT count(*) FROM pg_stat_activity"
									" WHERE pid = $1::integer AND state = 'active'",
									1, pid_value);

		wait_ended = strcmp(n, "0") == 0;
		free(n);
		if (!wait_ended)
			sleep_ms(10);
	}
	PQclear(query(other, "ROLLBACK", 0, NULL));
	/* The next claimant gets the key at once (and gives it back). */
	PQclear(query(admin, "BEGIN", 0, NULL));
	next = query_value(admin, "SELECT claimed FROM idem_begin($1, 'fp',"
					   " scope => $2, wait => false)", 2, open_claim);
	PQclear(query(admin, "ROLLBACK", 0, NULL));
	printf("cancel_held: outcome=%s failed=%s message=%s calls=%d cancel_sent=%s returned_while_held=%s conn=%s wait_ended=%s next_claimed=%s state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.message, ctx.calls,
		   atomic_load(&px.cancels) > 0 ? "yes" : "no",
		   let_go == 0 ? "yes" : "no", conn_ok ? "ok" : "bad",
		   wait_ended ? "yes" : "no", next, key_state("cancel-held"));
	free(next);
	idem_result_clear(&res);
	PQfinish(other);
	PQfinish(conn);
	proxy_stop(&px);
}

/*
 * The session's own lock_timeout, shorter than the call's timeout, still
 * ends the claim's wait for another session's uncommitted claim.
 */
static void
test_session_timeout(void)
{
	char	   *short_lock = conninfo_with("options='-c lock_timeout=200ms'");
	const char *open_claim[2] = {"session-timeout", SCOPE};
	PGconn	   *conn = connect_or_die(short_lock);
	PGconn	   *other = connect_or_die(conninfo);
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;

	PQclear(query(other, "BEGIN", 0, NULL));
	PQclear(query(other, "SELECT * FROM idem_begin($1, 'fp', scope => $2)",
				  2, open_claim));
	opts_init(&opts);
	opts.timeout_ms = 600000;
	ctx_init(&ctx);
	run(conn, &opts, "session-timeout", "fp", &ctx, &res);
	printf("session_timeout: outcome=%s failed=%s sqlstate=%s calls=%d conn=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, ctx.calls,
		   PQstatus(conn) == CONNECTION_OK ? "ok" : "bad");
	idem_result_clear(&res);
	PQclear(query(other, "ROLLBACK", 0, NULL));
	PQfinish(other);
	PQfinish(conn);
	free(short_lock);
}

/*
 * Run the guard once as run does, with conn traced, and return the Syncs
 * it sent (-1 if the trace could not be kept).  Every request of the
 * extended protocol ends in one Sync, so Syncs count round trips.
 */
static int
run_counting_syncs(PGconn *conn, const IdemGuardOptions *opts,
				   const char *key, Ctx *ctx, IdemResult *res)
{
	FILE	   *trace = tmpfile();
	char		line[1024];
	int			n = 0;

	if (trace != NULL)
	{
		PQtrace(conn, trace);
		PQsetTraceFlags(conn, PQTRACE_SUPPRESS_TIMESTAMPS);
	}
	run(conn, opts, key, "fp", ctx, res);
	if (trace == NULL)
		return -1;
	PQuntrace(conn);
	rewind(trace);
	while (fgets(line, sizeof(line), trace) != NULL)
		if (line[0] == 'F' && strstr(line, "\tSync") != NULL)
			n++;
	fclose(trace);
	return n;
}

/*
 * Under a timeout each call is one round trip: the statement setting its
 * timeouts goes in one pipeline with it, no BEGIN or COMMIT.  A new key
 * (claim and complete) is two, a replay one; the connection is left
 * outside a transaction and out of pipeline mode.
 */
static void
test_round_trips(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	char		body[64];
	int			syncs;

	opts_init(&opts);
	opts.timeout_ms = 60000;
	ctx_init(&ctx);
	syncs = run_counting_syncs(conn, &opts, "round-trips", &ctx, &res);
	printf("round_trips_new: outcome=%s calls=%d syncs=%d state=%s idle=%s\n",
		   idem_outcome_name(res.outcome), ctx.calls, syncs,
		   key_state("round-trips"),
		   PQtransactionStatus(conn) == PQTRANS_IDLE &&
		   PQpipelineStatus(conn) == PQ_PIPELINE_OFF ? "yes" : "no");
	idem_result_clear(&res);

	syncs = run_counting_syncs(conn, &opts, "round-trips", &ctx, &res);
	printf("round_trips_replay: outcome=%s calls=%d syncs=%d body=%s\n",
		   idem_outcome_name(res.outcome), ctx.calls, syncs,
		   body_text(&res, body, sizeof(body)));
	idem_result_clear(&res);
}

/*
 * The statement before the call fails (idem.clock_offset is for
 * superusers): the call is skipped in the pipeline, the claim is not made,
 * the handler does not run, and the connection is left usable, outside a
 * transaction and out of pipeline mode.
 */
static void
test_settings_refused(void)
{
	char	   *plain_info = conninfo_with("user=guard_plain");
	PGconn	   *conn;
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	char	   *one;

	PQclear(query(admin, "DROP ROLE IF EXISTS guard_plain", 0, NULL));
	PQclear(query(admin, "CREATE ROLE guard_plain LOGIN", 0, NULL));
	conn = connect_or_die(plain_info);
	opts_init(&opts);
	opts.timeout_ms = 60000;
	opts.clock_offset_s = 30;
	ctx_init(&ctx);
	run(conn, &opts, "settings-refused", "fp", &ctx, &res);
	one = query_value(conn, "SELECT 1", 0, NULL);
	printf("settings_refused: outcome=%s failed=%s sqlstate=%s calls=%d state=%s idle=%s next=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   res.sqlstate, ctx.calls, key_state("settings-refused"),
		   PQtransactionStatus(conn) == PQTRANS_IDLE &&
		   PQpipelineStatus(conn) == PQ_PIPELINE_OFF ? "yes" : "no", one);
	free(one);
	idem_result_clear(&res);
	PQfinish(conn);
	PQclear(query(admin, "DROP ROLE guard_plain", 0, NULL));
	free(plain_info);
}

/* The lock test's watcher: what it needs and what it found. */
typedef struct LockWatch
{
	pthread_t	thread;
	bool		started;
	PGconn	   *holder;			/* holds the key's row FOR UPDATE */
	int			guard_pid;		/* backend of the guard's connection */
	atomic_bool returned;		/* the guard call has returned */
	bool		prompt;			/* the guard went on before HOLD_MS */
} LockWatch;

static LockWatch lock_watch;

/*
 * Watcher thread: wait until the guard has gone past stopping its
 * heartbeat (its idem_complete waits for the row, or the call returned),
 * for at most HOLD_MS, then let the row go.
 */
static void *
lock_watch_main(void *arg)
{
	LockWatch  *lw = arg;
	PGconn	   *watch = connect_or_die(conninfo);
	struct timespec start;
	char		pid[16];
	const char *values[1] = {pid};

	clock_gettime(CLOCK_MONOTONIC, &start);
	snprintf(pid, sizeof(pid), "%d", lw->guard_pid);
	while (!lw->prompt && elapsed_ms(&start) < HOLD_MS)
	{
		char	   *v = query_value(watch,
									"SELECT wait_event_type = 'Lock'"
									" AND query LIKE '%idem_complete%'"
									" FROM pg_stat_activity"
									" WHERE pid = $1::integer", 1, values);

		lw->prompt = strcmp(v, "t") == 0 || atomic_load(&lw->returned);
		free(v);
		if (!lw->prompt)
			sleep_ms(10);
	}
	PQclear(query(lw->holder, "COMMIT", 0, NULL));
	PQfinish(watch);
	return NULL;
}

/*
 * "during" step: hold the key's row FOR UPDATE in another session until
 * the heartbeat's idem_extend waits for it, then leave the row to the
 * watcher and return.
 */
static void
during_lock_row(Ctx *ctx, const IdemClaim *claim)
{
	const char *values[2] = {claim->scope, claim->key};
	int			i;

	lock_watch.holder = connect_or_die(conninfo);
	lock_watch.guard_pid = PQbackendPID(ctx->guard_conn);
	PQclear(query(lock_watch.holder, "BEGIN", 0, NULL));
	PQclear(query(lock_watch.holder, "SELECT 1 FROM idem.keys"
				  " WHERE scope = $1 AND key = $2 FOR UPDATE", 2, values));
	for (i = 0; i < POLL_LIMIT && !ctx->flag; i++)
	{
		char	   *n = query_value(admin, "SELECT count(*) FROM pg_stat_activity"
									" WHERE application_name = 'guard_hb_lock'"
									" AND wait_event_type = 'Lock'", 0, NULL);

		ctx->flag = strcmp(n, "1") == 0;
		free(n);
		if (!ctx->flag)
			sleep_ms(10);
	}
	lock_watch.started = pthread_create(&lock_watch.thread, NULL,
										lock_watch_main, &lock_watch) == 0;
}

/*
 * Stopping the heartbeat does not wait for its idem_extend, which waits
 * (no client timeout) for a row another session holds for up to HOLD_MS:
 * the extend is cancelled, the guard goes on to complete, and the
 * response is stored once the row is let go.
 */
static void
test_heartbeat_stop_lock(PGconn *conn)
{
	char	   *hb_conninfo = conninfo_with("application_name=guard_hb_lock");
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;

	memset(&lock_watch, 0, sizeof(lock_watch));
	atomic_init(&lock_watch.returned, false);
	opts_init(&opts);
	opts.lease_ms = 3000;
	opts.heartbeat_conninfo = hb_conninfo;
	ctx_init(&ctx);
	ctx.during = during_lock_row;
	ctx.guard_conn = conn;
	run(conn, &opts, "heartbeat-lock", "fp", &ctx, &res);
	atomic_store(&lock_watch.returned, true);
	if (lock_watch.started)
		pthread_join(lock_watch.thread, NULL);
	PQfinish(lock_watch.holder);
	printf("heartbeat_stop_lock: outcome=%s failed=%s extend_waited=%s stop_prompt=%s superseded=%s calls=%d state=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.flag ? "yes" : "no", lock_watch.prompt ? "yes" : "no",
		   res.superseded ? "yes" : "no", ctx.calls,
		   key_state("heartbeat-lock"));
	idem_result_clear(&res);
	free(hb_conninfo);
}

/*
 * True if a commit on conn waits (for a synchronous standby): a claim of
 * a key in the scope "probe" does not answer within 200 ms.  It is then
 * cancelled (and committed locally).
 */
static bool
commit_waits(PGconn *conn)
{
	struct pollfd pfd;
	PGresult   *res;
	bool		waits;

	if (!PQsendQuery(conn, "SELECT claimed FROM public.idem_begin('probe-'"
					 " || pg_catalog.clock_timestamp(), 'fp', scope => 'probe')"))
		return false;
	pfd.fd = PQsocket(conn);
	pfd.events = POLLIN;
	pfd.revents = 0;
	waits = poll(&pfd, 1, 200) == 0;
	if (waits)
	{
		PGcancel   *cancel = PQgetCancel(conn);
		char		buf[256];

		PQcancel(cancel, buf, sizeof(buf));
		PQfreeCancel(cancel);
	}
	while ((res = PQgetResult(conn)) != NULL)
		PQclear(res);
	return waits;
}

/*
 * The client timeout fires after the claim committed: every commit of the
 * guard's session waits for a synchronous standby that does not exist, so
 * each statement is cancelled after it committed locally.  The claim is
 * used, not thrown away.  Runs last: it changes the server's settings.
 */
static void
test_timeout_after_commit(void)
{
	char	   *sync_on = conninfo_with("options='-c synchronous_commit=on'");
	PGconn	   *conn;
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	bool		ready = false;
	int			i;

	PQclear(query(admin, "ALTER SYSTEM SET synchronous_commit = 'local'", 0, NULL));
	PQclear(query(admin, "ALTER SYSTEM SET synchronous_standby_names = 'nobody'",
				  0, NULL));
	PQclear(query(admin, "SELECT pg_reload_conf()", 0, NULL));
	conn = connect_or_die(sync_on);
	/* The setting reaches the server's processes a little later. */
	for (i = 0; i < POLL_LIMIT && !(ready = commit_waits(conn)); i++)
	{
		PQfinish(conn);
		sleep_ms(10);
		conn = connect_or_die(sync_on);
	}
	if (!ready)
		printf("timeout_after_commit: commits do not wait for a standby\n");

	else
	{
		opts_init(&opts);
		opts.timeout_ms = 2000;
		ctx_init(&ctx);
		run(conn, &opts, "sync-timeout", "fp", &ctx, &res);
		printf("timeout_after_commit: outcome=%s failed=%s calls=%d state=%s\n",
			   idem_outcome_name(res.outcome), idem_step_name(res.failed),
			   ctx.calls, key_state("sync-timeout"));
		idem_result_clear(&res);
	}
	PQfinish(conn);

	PQclear(query(admin, "ALTER SYSTEM RESET synchronous_standby_names", 0, NULL));
	PQclear(query(admin, "ALTER SYSTEM RESET synchronous_commit", 0, NULL));
	PQclear(query(admin, "SELECT pg_reload_conf()", 0, NULL));
	free(sync_on);
}

/* Run every case. */
/* Completes a key once a guard's idem_begin waits in the server for it. */
typedef struct WaitCompleter
{
	pthread_t	thread;
	const char *key;
	const char *token;
	bool		saw_wait;
} WaitCompleter;

static void *
wait_completer_main(void *arg)
{
	WaitCompleter *wc = arg;
	PGconn	   *c = connect_or_die(conninfo);
	const char *values[3] = {wc->key, SCOPE, wc->token};
	int			i;

	/* At most 30 s: the guard's wait_for is 60 s, the test fails before. */
	for (i = 0; i < 3000 && !wc->saw_wait; i++)
	{
		char	   *n = query_value(c,
									"SELECT count(*) FROM pg_stat_activity"
									" WHERE wait_event_type = 'Extension'"
									" AND query LIKE '%idem_begin%'",
									0, NULL);

		wc->saw_wait = strcmp(n, "0") != 0;
		free(n);
		if (!wc->saw_wait)
			sleep_ms(10);
	}
	PQclear(query(c, "SELECT idem_complete($1, 'fp', 200, convert_to('first', 'UTF8'),"
				  " $3::bigint, scope => $2)", 3, values));
	PQfinish(c);
	return NULL;
}

/*
 * wait_for: a key held by a committed claim is waited for in the server;
 * the holder completes while the guard waits, and the guard replays its
 * response without running the handler.  A wait that runs out is in
 * flight.
 */
static void
test_wait_for(PGconn *conn)
{
	IdemGuardOptions opts;
	IdemResult	res;
	Ctx			ctx;
	WaitCompleter wc = {0};
	const char *values[2] = {"waited", SCOPE};
	const char *held[2] = {"waited-held", SCOPE};
	char	   *token = query_value(admin,
									"SELECT token FROM idem_begin($1, 'fp', lease => '1 hour', scope => $2)",
									2, values);

	opts_init(&opts);
	ctx_init(&ctx);
	opts.wait_for_ms = 60000;
	opts.timeout_ms = 10000;	/* the wait is not cut by the call's timeout */
	wc.key = "waited";
	wc.token = token;
	pthread_create(&wc.thread, NULL, wait_completer_main, &wc);
	run(conn, &opts, "waited", "fp", &ctx, &res);
	pthread_join(wc.thread, NULL);
	printf("wait_for: outcome=%s failed=%s calls=%d status=%d body=%.*s seen_waiting=%s\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls, res.resp.status, (int) res.resp.body_len,
		   res.resp.body ? (const char *) res.resp.body : "",
		   wc.saw_wait ? "yes" : "no");
	idem_result_clear(&res);
	free(token);

	PQclear(query(admin, "SELECT * FROM idem_begin($1, 'fp', lease => '1 hour', scope => $2)",
				  2, held));
	opts.wait_for_ms = 300;
	run(conn, &opts, "waited-held", "fp", &ctx, &res);
	printf("wait_for_runs_out: outcome=%s failed=%s calls=%d\n",
		   idem_outcome_name(res.outcome), idem_step_name(res.failed),
		   ctx.calls);
	idem_result_clear(&res);
}

int
main(int argc, char **argv)
{
	PGconn	   *conn;

	if (argc != 3)
	{
		fprintf(stderr, "usage: %s CONNINFO DOWN_CONNINFO\n", argv[0]);
		return 2;
	}
	conninfo = argv[1];
	down_conninfo = argv[2];
	setvbuf(stdout, NULL, _IOLBF, 0);
	admin = connect_or_die(conninfo);
	conn = connect_or_die(conninfo);

	test_basic(conn);
	test_binary(conn);
	test_in_flight(conn);
	test_unavailable();
	test_faults(conn);
	test_complete_failures();
	test_not_stored(conn);
	test_heartbeat(conn);
	test_scope_and_window(conn);
	test_threads();
	test_heartbeat_default_lease();
	test_heartbeat_reset(conn);
	test_replay_failure(conn);
	test_schema(conn);
	test_cancel_held();
	test_session_timeout();
	test_round_trips(conn);
	test_settings_refused();
	test_heartbeat_stop_lock(conn);
	test_timeout_after_commit();
	test_wait_for(conn);
	test_server_tombstone(conn);
	test_many(conn);

	PQfinish(conn);
	PQfinish(admin);
	printf("done\n");
	return 0;
}
