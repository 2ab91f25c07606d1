/*-------------------------------------------------------------------------
 *
 * recovery_driver.c
 *	  One attempt at an order in three steps with the C guard's steps, for
 *	  test/t/026_recovery.pl: killed with SIGKILL at a chosen point, or by
 *	  the test at a random moment.
 *
 *	  recovery_driver CONNINFO KEY OFFSET_S KILL_AT MODE [DELAY_US]
 *
 * The steps: "reserve" (one transaction: idem_hold, one item of stock, a
 * reservation row, and the checkpoint with the provider key it chose,
 * "KEY:token"), "charge" (the provider, a table on a connection of its own
 * that charges once per idempotency key, asked with the reserve step's
 * provider key; the guard checkpoints the charge id) and "record" (one
 * transaction: idem_hold, a record row, the checkpoint).  OFFSET_S moves
 * the guard's clock (idem.clock_offset), so that an attempt takes over
 * the one before it.  The lease is 10 s.
 *
 * KILL_AT, where the process kills itself with SIGKILL (0: nowhere):
 *	 1 reserve: after its writes, before its transaction commits
 *	 2 reserve: after its transaction (and checkpoint) committed
 *	 3 charge: after the provider charged, before the guard's checkpoint
 *	 4 between charge (checkpointed) and record
 *	 5 record: after its writes, before its transaction commits
 *	 6 after record committed, before the response is stored
 *	 7 record: after its transaction committed, before the step returns
 *
 * MODE "fenced" is the above; the mistakes the test must catch: "naive"
 * keys the provider by "KEY:token" of this attempt instead of the reserve
 * step's output; "late" leaves the reserve and record checkpoints to the
 * guard, after the step's transaction.  Both take stock of sku B instead
 * of A.  "refuse": the provider refuses the charge (the step fails after
 * reserve was checkpointed).  DELAY_US sleeps that long before each step, so that
 * a kill from outside lands between or inside steps.
 *
 * Prints one line: outcome=... failed=... resumed=... skipped=N run=N
 * token=N, and exits 0 if the order was executed or replayed.
 *
 *-------------------------------------------------------------------------
 */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "idem_guard.h"

typedef struct Driver
{
	PGconn	   *conn;
	PGconn	   *provider;
	int			kill_at;
	bool		naive;
	bool		late;
	bool		refuse;
	int			delay_us;
	char		error[256];
} Driver;

/* Die here if this is the chosen point. */
static void
maybe_die(Driver *d, int point)
{
	if (d->kill_at == point)
		raise(SIGKILL);
}

/* Run a statement; false with d->error set.  out: first value. */
static bool
run(Driver *d, PGconn *conn, const char *sql, int nparams,
	const char *const *values, char *out, size_t outlen)
{
	PGresult   *res = PQexecParams(conn, sql, nparams, NULL, values, NULL,
								   NULL, 0);
	ExecStatusType st = PQresultStatus(res);

	if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK)
	{
		snprintf(d->error, sizeof(d->error), "%s",
				 PQresultErrorMessage(res));
		PQclear(res);
		return false;
	}
	if (out != NULL)
		snprintf(out, outlen, "%s", PQntuples(res) == 1 ?
				 PQgetvalue(res, 0, 0) : "");
	PQclear(res);
	return true;
}

/* Roll back a failed step's transaction. */
static int
fail(Driver *d, IdemPhase *phase, const char *what)
{
	PGresult   *res;

	if (what != NULL)
		snprintf(d->error, sizeof(d->error), "%s: %s (%s)", what,
				 idem_phase_error(phase), idem_phase_sqlstate(phase));
	res = PQexec(d->conn, "ROLLBACK");
	PQclear(res);
	return 1;
}

static int
step_reserve(IdemPhase *phase, void *arg)
{
	Driver	   *d = arg;
	char		token[24];
	char		provider_key[128];
	const char *values[2] = {phase->key, token};

	snprintf(token, sizeof(token), "%" PRId64, phase->token);
	snprintf(provider_key, sizeof(provider_key), "%s:%s", phase->key, token);
	if (!run(d, d->conn, "BEGIN", 0, NULL, NULL, 0))
		return fail(d, phase, NULL);
	if (idem_phase_hold(phase, d->conn) != 0)
		return fail(d, phase, "idem_hold");
	if (!run(d, d->conn, d->naive || d->late ?
			 "UPDATE stock SET qty = qty - 1 WHERE sku = 'B'" :
			 "UPDATE stock SET qty = qty - 1 WHERE sku = 'A'",
			 0, NULL, NULL, 0) ||
		!run(d, d->conn, "INSERT INTO reservations (key, token)"
			 " VALUES ($1, $2)", 2, values, NULL, 0))
		return fail(d, phase, NULL);
	maybe_die(d, 1);
	if (idem_phase_output(phase, provider_key, strlen(provider_key)) != 0 ||
		(!d->late && idem_phase_checkpoint(phase, d->conn) != 0))
		return fail(d, phase, "idem_checkpoint");
	if (!run(d, d->conn, "COMMIT", 0, NULL, NULL, 0))
		return fail(d, phase, NULL);
	maybe_die(d, 2);
	return 0;
}

static int
step_charge(IdemPhase *phase, void *arg)
{
	Driver	   *d = arg;
	char		provider_key[128];
	char		charge[32];
	const char *values[2] = {provider_key, phase->key};

	if (d->refuse)
	{
		snprintf(d->error, sizeof(d->error), "the provider refused");
		return 1;
	}
	if (d->naive)
		snprintf(provider_key, sizeof(provider_key), "%s:%" PRId64,
				 phase->key, phase->token);
	else
	{
		if (phase->input == NULL || phase->input_len >= sizeof(provider_key))
		{
			snprintf(d->error, sizeof(d->error), "no provider key");
			return 1;
		}
		memcpy(provider_key, phase->input, phase->input_len);
		provider_key[phase->input_len] = '\0';
	}
	if (!run(d, d->provider, "INSERT INTO provider_requests (idem_key, key)"
			 " VALUES ($1, $2)", 2, values, NULL, 0) ||
		!run(d, d->provider, "INSERT INTO provider_charges (idem_key, key)"
			 " VALUES ($1, $2) ON CONFLICT (idem_key) DO NOTHING", 2, values,
			 NULL, 0) ||
		!run(d, d->provider, "SELECT 'ch_' || id FROM provider_charges"
			 " WHERE idem_key = $1", 1, values, charge, sizeof(charge)))
		return 1;
	maybe_die(d, 3);
	return idem_phase_output(phase, charge, strlen(charge));
}

static int
step_record(IdemPhase *phase, void *arg)
{
	Driver	   *d = arg;
	char		charge[32];
	char		token[24];
	const char *values[3] = {phase->key, charge, token};

	if (phase->input == NULL || phase->input_len >= sizeof(charge))
	{
		snprintf(d->error, sizeof(d->error), "no charge id");
		return 1;
	}
	memcpy(charge, phase->input, phase->input_len);
	charge[phase->input_len] = '\0';
	snprintf(token, sizeof(token), "%" PRId64, phase->token);
	if (!run(d, d->conn, "BEGIN", 0, NULL, NULL, 0))
		return fail(d, phase, NULL);
	if (idem_phase_hold(phase, d->conn) != 0)
		return fail(d, phase, "idem_hold");
	if (!run(d, d->conn, "INSERT INTO records (key, charge, token)"
			 " VALUES ($1, $2, $3)", 3, values, NULL, 0))
		return fail(d, phase, NULL);
	maybe_die(d, 5);
	if (!d->late && idem_phase_checkpoint(phase, d->conn) != 0)
		return fail(d, phase, "idem_checkpoint");
	if (!run(d, d->conn, "COMMIT", 0, NULL, NULL, 0))
		return fail(d, phase, NULL);
	maybe_die(d, 7);
	return 0;
}

static int
handler(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	Driver	   *d = arg;
	int			rc;

	if (d->delay_us > 0)
		usleep(d->delay_us);
	if ((rc = idem_guard_step(claim, "reserve", step_reserve, d)) != 0)
		return rc;
	if (d->delay_us > 0)
		usleep(d->delay_us);
	if ((rc = idem_guard_step(claim, "charge", step_charge, d)) != 0)
		return rc;
	maybe_die(d, 4);
	if (d->delay_us > 0)
		usleep(d->delay_us);
	if ((rc = idem_guard_step(claim, "record", step_record, d)) != 0)
		return rc;
	maybe_die(d, 6);
	return idem_response_set(resp, 200, "paid", 4);
}

int
main(int argc, char **argv)
{
	Driver		d;
	IdemGuardOptions opts;
	IdemResult	res;
	IdemOutcome outcome;

	if (argc < 6 || argc > 7)
	{
		fprintf(stderr, "usage: %s CONNINFO KEY OFFSET_S KILL_AT MODE [DELAY_US]\n",
				argv[0]);
		return 2;
	}
	memset(&d, 0, sizeof(d));
	d.kill_at = atoi(argv[4]);
	d.naive = strcmp(argv[5], "naive") == 0;
	d.late = strcmp(argv[5], "late") == 0;
	d.refuse = strcmp(argv[5], "refuse") == 0;
	d.delay_us = argc == 7 ? atoi(argv[6]) : 0;
	d.conn = PQconnectdb(argv[1]);
	d.provider = PQconnectdb(argv[1]);
	if (PQstatus(d.conn) != CONNECTION_OK || PQstatus(d.provider) != CONNECTION_OK)
	{
		fprintf(stderr, "recovery_driver: %s%s", PQerrorMessage(d.conn),
				PQerrorMessage(d.provider));
		return 1;
	}

	idem_guard_options_init(&opts);
	opts.lease_ms = 10000;
	opts.steps = true;
	opts.clock_offset_s = atoi(argv[3]);
	outcome = idem_guard_do_opts(d.conn, &opts, argv[2], "order", handler, &d,
								 &res);
	printf("outcome=%s failed=%s resumed=%s skipped=%d run=%d token=%" PRId64
		   " status=%d\n",
		   idem_outcome_name(outcome), idem_step_name(res.failed),
		   res.resumed_after[0] ? res.resumed_after : "none",
		   res.steps_skipped, res.steps_run, res.token, res.resp.status);
	if (res.failed != IDEM_STEP_NONE)
		fprintf(stderr, "recovery_driver: %s; %s\n", res.message, d.error);
	idem_result_clear(&res);
	PQfinish(d.conn);
	PQfinish(d.provider);
	return (outcome == IDEM_EXECUTED || outcome == IDEM_REPLAYED) &&
		res.failed == IDEM_STEP_NONE ? 0 : 1;
}
