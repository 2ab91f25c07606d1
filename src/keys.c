/*-------------------------------------------------------------------------
 *
 * keys.c
 *	  The claim protocol: idem_begin, idem_complete, idem_release and
 *	  idem_extend.
 *
 * A key is a row of idem.keys (see keytable.c for how rows are read and
 * written).  Concurrency is settled by PostgreSQL's row locks: a claim is
 * an INSERT or an UPDATE of the row, so it is held by the claiming
 * transaction until that transaction ends, and another claimer waits for
 * it (or, with wait => false, reports it in flight).
 *
 * idem_begin first reads the key without a lock.  Answers that need no
 * change (replay, conflict, a live lease) come from that read and leave no
 * lock behind.  A claim of a new key is a speculative insertion; a claim
 * of a key whose window or lease is over updates exactly the version it
 * read, as UPDATE does (waiting for a transaction that is changing it).
 * If that version changed meanwhile, nothing is written and the claimer
 * decides again from the new one, so a waiter that ends up not claiming
 * holds no lock.  complete, release and extend share one loop,
 * write_held_row: they check the holder on the version read (its token
 * and, outside the claiming transaction, its role, by check_holder, which
 * works on the decoded arguments of a HeldCall) and write that version the
 * same way.  A call waits at
 * most once (for the transaction that held the key, bounded by
 * lock_timeout); if the key is busy again after that, it answers in
 * flight, unless its wait_for has time left: then it waits again.  A call
 * counts in idem_stats as one wait, with its total wait time.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "storage/proc.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "args.h"
#include "idem.h"
#include "keys.h"
#include "keytable.h"
#include "settings.h"
#include "sha256.h"
#include "stats.h"
#include "waits.h"

PG_FUNCTION_INFO_V1(idem_begin);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_extend);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_hold);

const char *const idem_claim_state_names[] = {
	"PROCESSING", "DONE", "CONFLICT", "EXPIRED", "DUPLICATE"
};

/* What decide() found out about a key's row. */
typedef enum Decision
{
	DECISION_ANSWERED,			/* the result is set: replay, conflict, own claim */
	DECISION_IN_FLIGHT,			/* a committed claim whose lease is live */
	DECISION_CLAIM				/* the window or the lease is over: claim it */
} Decision;

/*
 * Tokens of the claims this transaction made, so that "this transaction
 * holds the claim" means it made the claim, not merely wrote the row last
 * (an idem_extend does too).  Lives in TopTransactionContext.
 */
static HTAB *xact_claims = NULL;
static bool xact_callback_registered = false;

/* Forget the claims of a transaction that ended. */
static void
claims_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			xact_claims = NULL;
			break;
		default:
			break;
	}
}

/* Remember that this transaction claimed a key with token. */
static void
remember_claim(int64 token)
{
	if (xact_claims == NULL)
	{
		HASHCTL		ctl;

		if (!xact_callback_registered)
		{
			RegisterXactCallback(claims_xact_callback, NULL);
			xact_callback_registered = true;
		}
		ctl.keysize = sizeof(int64);
		ctl.entrysize = sizeof(int64);
		ctl.hcxt = TopTransactionContext;
		xact_claims = hash_create("idem claims of this transaction", 64, &ctl,
								  HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	(void) hash_search(xact_claims, &token, HASH_ENTER, NULL);
}

/* Does this transaction hold the claim of the row (made it, not undone)? */
static bool
holds_claim(KeyRow *row)
{
	return row->found && !row->done &&
		TransactionIdIsCurrentTransactionId(row->xmin) &&
		xact_claims != NULL &&
		hash_search(xact_claims, &row->token, HASH_FIND, NULL) != NULL;
}

/*
 * The last fingerprint text digested, up to FINGERPRINT_MEMO_LEN bytes,
 * and its digest: a transaction's idem_complete passes the fingerprint its
 * idem_begin passed, and a batch often passes one fingerprint for every
 * item, so the same text is digested again and again.  SHA-256 is a
 * function of the bytes alone: the memo answers only the same bytes.
 */
#define FINGERPRINT_MEMO_LEN 256
static int	memo_len = -1;
static char memo_text[FINGERPRINT_MEMO_LEN];
static uint8 memo_digest[IDEM_FINGERPRINT_LEN];

/* SHA-256 of the caller's fingerprint text, as a bytea. */
bytea *
idem_fingerprint_digest(text *fingerprint)
{
	bytea	   *digest = palloc(VARHDRSZ + IDEM_FINGERPRINT_LEN);
	const char *data = VARDATA_ANY(fingerprint);
	int			len = VARSIZE_ANY_EXHDR(fingerprint);

	SET_VARSIZE(digest, VARHDRSZ + IDEM_FINGERPRINT_LEN);
	if (len == memo_len && memcmp(data, memo_text, len) == 0)
	{
		memcpy(VARDATA(digest), memo_digest, IDEM_FINGERPRINT_LEN);
		return digest;
	}
	idem_sha256((const uint8 *) data, len, (uint8 *) VARDATA(digest));
	if (len <= FINGERPRINT_MEMO_LEN)
	{
		memcpy(memo_text, data, len);
		memcpy(memo_digest, VARDATA(digest), IDEM_FINGERPRINT_LEN);
		memo_len = len;
	}
	return digest;
}

/* Are two fingerprint digests the same? */
bool
idem_same_digest(bytea *a, bytea *b)
{
	return memcmp(VARDATA(a), VARDATA(b), IDEM_FINGERPRINT_LEN) == 0;
}

/*
 * Was the row claimed by this holder: both given (a claim made before 1.7
 * or without holder has none), and byte for byte the same?
 */
static bool
same_holder(KeyRow *row, text *holder)
{
	return holder != NULL && row->holder != NULL &&
		VARSIZE_ANY_EXHDR(holder) == VARSIZE_ANY_EXHDR(row->holder) &&
		memcmp(VARDATA_ANY(holder), VARDATA_ANY(row->holder),
			   VARSIZE_ANY_EXHDR(holder)) == 0;
}

/* Was the row claimed with this fingerprint digest? */
static bool
same_fingerprint(KeyRow *row, bytea *fingerprint)
{
	return memcmp(row->fingerprint, VARDATA(fingerprint),
				  IDEM_FINGERPRINT_LEN) == 0;
}

/* Make *res a claim held by the caller. */
static void
set_claimed(ClaimResult *res, int64 token, TimestampTz lease_until,
			TimestampTz expires_at)
{
	res->claimed = true;
	res->state = CLAIM_PROCESSING;
	res->has_token = true;
	res->token = token;
	res->has_lease = true;
	res->lease_until = lease_until;
	res->has_expiry = true;
	res->expires_at = expires_at;
	remember_claim(token);
}

/* Report the key in flight; the lease is known if row is given. */
static void
set_in_flight(ClaimResult *res, KeyRow *row)
{
	res->state = CLAIM_PROCESSING;
	if (row != NULL)
	{
		res->has_lease = row->has_lease;
		res->lease_until = row->lease_until;
		res->has_expiry = true;
		res->expires_at = row->expires_at;
	}
	idem_stats_count(IDEM_STAT_IN_FLIGHT);
}

/* Values of a new claim of the key. */
static void
claim_values(KeyValues *kv, ClaimArgs *args, TimestampTz expires_at)
{
	memset(kv, 0, sizeof(KeyValues));
	kv->fingerprint = args->fingerprint;
	kv->has_lease = true;
	kv->lease_until = args->lease_until;
	kv->expires_at = expires_at;
	kv->has_remember = args->has_remember;
	kv->remember_until = args->remember_until;
	kv->holder = args->holder;
	idem_keytable_current_claimant(&kv->claimed_by);
}

/*
 * Answer a claim from an existing row without writing, or tell that the
 * key is in flight elsewhere, or that the answer is a claim of the row:
 * its window or its lease is over.
 */
static Decision
decide(ClaimArgs *args, KeyRow *row, ClaimResult *res)
{
	bool		tombstone = false;

	if (row->expires_at <= args->now)
	{
		/* The window is over: the key is new again, unless remembered. */
		if (!idem_keyrow_is_tombstone(row, args->now))
			return DECISION_CLAIM;
		tombstone = true;
	}
	if (!same_fingerprint(row, args->fingerprint))
	{
		/* Reveal nothing of the stored request or response. */
		res->state = CLAIM_CONFLICT;
		idem_stats_count(IDEM_STAT_CONFLICTS);
		return DECISION_ANSWERED;
	}
	if (tombstone)
	{
		/* Completed once, never to run again: the status, no body. */
		res->state = CLAIM_EXPIRED;
		res->has_response = true;
		res->status = row->status;
		res->has_expiry = true;
		res->expires_at = row->expires_at;
		return DECISION_ANSWERED;
	}
	if (row->done)
	{
		res->state = CLAIM_DONE;
		res->has_response = true;
		res->status = row->status;
		res->body = row->body;
		res->has_expiry = true;
		res->expires_at = row->expires_at;
		idem_stats_count(IDEM_STAT_REPLAYS);
		return DECISION_ANSWERED;
	}
	if (holds_claim(row))
	{
		set_claimed(res, row->token, row->lease_until, row->expires_at);
		return DECISION_ANSWERED;
	}
	if (row->has_lease && args->now < row->lease_until)
	{
		/*
		 * The same holder again, while its lease is live: the attempt that
		 * made the claim is dead (replayed or restarted), take it over.
		 */
		if (same_holder(row, args->holder))
			return DECISION_CLAIM;
		return DECISION_IN_FLIGHT;
	}
	return DECISION_CLAIM;		/* the holder's lease is over: take it over */
}

/* The lease and window of a claim made now, after a wait. */
static void
claim_args_now(ClaimArgs *args)
{
	args->now = idem_now();
	args->lease_until = idem_window_end(args->now, args->lease,
										idem_default_lease, "lease");
	args->expires_at = idem_window_end(args->now, args->retention,
									   idem_default_retention, "retention");
	if (args->has_remember)
		args->remember_until = idem_window_end(args->now, args->remember, 0,
											   "remember");
}

/*
 * Add a wait for a holder or a result, begun at started, to the call's
 * waits: idem_stats counts the call once, with its total wait time, when
 * it ends (count_waits), however many times it slept.
 */
static void
add_wait(ClaimArgs *args, instr_time *started)
{
	instr_time	now;

	args->waited = true;
	if (INSTR_TIME_IS_ZERO(*started))
		return;
	INSTR_TIME_SET_CURRENT(now);
	INSTR_TIME_ACCUM_DIFF(args->wait_time, now, *started);
}

/* Count a call that waited, and its time. */
static void
count_waits(ClaimArgs *args)
{
	if (!args->waited)
		return;
	idem_stats_count(IDEM_STAT_WAITS);
	idem_stats_add(IDEM_STAT_WAIT_USECS,
				   (uint64) INSTR_TIME_GET_MICROSEC(args->wait_time));
}

/*
 * May the call wait again for a transaction that holds the key?  A call
 * waits at most once, except with wait_for while the wait lasts.
 */
static bool
may_wait_again(ClaimArgs *args)
{
	return args->wait_until != 0 && idem_now() < args->wait_until;
}

/*
 * Claim the key by rewriting the version of its row that decide() found
 * expired or abandoned.  A takeover keeps the key's window unless the new
 * lease ends later.  The write succeeds only if that version is still the
 * latest, so no token greater than the new one can have been given to
 * this key in between.
 */
static KeyWrite
reclaim(KeyTable *kt, ClaimArgs *args, KeyRow *row, bool wait,
		ClaimResult *res)
{
	bool		takeover = row->expires_at > args->now;
	bool		reentry = takeover && row->has_lease && args->now < row->lease_until;
	KeyValues	kv;
	KeyWrite	written;

	claim_values(&kv, args, takeover ?
				 Max(row->expires_at, args->lease_until) : args->expires_at);
	kv.token = IDEM_NEW_TOKEN;
	/* A takeover keeps the recovery point of the claim it ends. */
	kv.phase_as_stored = takeover;
	/* ... and how long the key is remembered, unless asked for longer. */
	if (takeover && row->has_remember &&
		(!kv.has_remember || row->remember_until > kv.remember_until))
	{
		kv.has_remember = true;
		kv.remember_until = row->remember_until;
	}
	written = idem_keytable_update(kt, row, &kv, wait);
	if (written == KEYWRITE_OK)
	{
		set_claimed(res, kv.token, kv.lease_until, kv.expires_at);
		if (takeover)
			idem_keytable_read_phase(kt, row, args->result_cxt,
									 &res->phase, &res->phase_data);
		idem_stats_count(takeover ? IDEM_STAT_TAKEOVERS : IDEM_STAT_CLAIMS);
		if (reentry && idem_log_takeovers)
			ereport(LOG,
					(errmsg("idempotency key \"%s\" in scope \"%s\" taken over by its holder \"%s\"",
							idem_key_for_message(kt->key),
							idem_key_for_message(kt->scope),
							idem_key_for_message(args->holder)),
					 errdetail("Token %lld, whose lease ends at %s, is superseded by token %lld of the same holder.",
							   (long long) row->token,
							   timestamptz_to_str(row->lease_until),
							   (long long) kv.token)));
		else if (takeover && idem_log_takeovers)
			ereport(LOG,
					(errmsg("idempotency key \"%s\" in scope \"%s\" taken over after its lease ended",
							idem_key_for_message(kt->key),
							idem_key_for_message(kt->scope)),
					 errdetail("Token %lld of role %s, whose lease ended at %s, is superseded by token %lld of role %s.",
							   (long long) row->token,
							   idem_keytable_claimant_text(&row->claimed_by),
							   timestamptz_to_str(row->lease_until),
							   (long long) kv.token,
							   idem_keytable_claimant_text(&kv.claimed_by))));
	}
	return written;
}


/*
 * The error of a claim whose snapshot predates another claim of the key,
 * or its deletion (by a purge).
 */
static void
changed_since_snapshot(text *key, bool deleted)
{
	if (deleted)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent delete"),
				 errdetail("Idempotency key \"%s\" was purged after this transaction's snapshot.",
						   idem_key_for_message(key))));
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not serialize access due to concurrent update"),
			 errdetail("Idempotency key \"%s\" was claimed after this transaction's snapshot.",
					   idem_key_for_message(key))));
}

/*
 * A key in flight elsewhere, its claim committed: with wait_for, sleep
 * until its holder commits a change of it, its lease ends, or the wait
 * does.  Returns true if the key is worth a new look, false if the answer
 * is in flight.  In REPEATABLE READ and SERIALIZABLE the snapshot would
 * not show what the holder committed: a key changed since is a
 * serialization failure, as a claim of it would be.
 */
static bool
wait_for_holder(KeyTable *kt, ClaimArgs *args, KeyRow *row)
{
	TimestampTz until;
	bool		slept;
	instr_time	waited;

	if (args->wait_until == 0)
		return false;
	until = Min(args->wait_until, row->lease_until);
	if (args->lock_wait_until != 0)
		until = Min(until, args->lock_wait_until);
	idem_stats_start(&waited);
	slept = idem_waits_sleep(until, row->token);
	add_wait(args, &waited);
	claim_args_now(args);
	if (args->lock_wait_until != 0 && args->now >= args->lock_wait_until &&
		args->now < row->lease_until)
		ereport(ERROR,
				(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
				 errmsg("canceling statement due to lock timeout"),
				 errcontext("waiting for the result of idempotency key \"%s\"",
							idem_key_for_message(kt->key))));
	if (IsolationUsesXactSnapshot())
	{
		KeyWaiter	waiter;
		KeyProbe	probe = idem_keytable_probe(kt, &waiter);

		if ((probe == PROBE_COMMITTED && !ItemPointerEquals(&waiter.tid, &row->tid)) ||
			probe == PROBE_NONE)
			changed_since_snapshot(kt->key, probe == PROBE_NONE);
	}
	return slept || args->now >= row->lease_until;
}

/*
 * Claim a key, or find out why not; see the file header.  Nothing is
 * written before a look at the key with a dirty snapshot shows that the
 * write can succeed, as ExecInsert's pre-check does: a key another
 * transaction is inserting or changing is waited for, or reported in
 * flight, without taking a transaction ID, a token or WAL (so also in a
 * read-only transaction), and a version committed after a REPEATABLE READ
 * or SERIALIZABLE snapshot fails before anything is written.
 */
static void
claim_key(KeyTable *kt, ClaimArgs *args, ClaimResult *res)
{
	bool		may_wait = args->wait;
	int			round;
	instr_time	waited;

	for (round = 0; round < IDEM_MAX_CLAIM_ROUNDS; round++)
	{
		KeyRow		row;
		KeyWaiter	waiter;
		KeyValues	kv;
		KeyProbe	probe;
		Decision	decision;

		CHECK_FOR_INTERRUPTS();

		/*
		 * With wait_for, get ready to sleep before each look at the key: a
		 * change committed after the look then still wakes the sleep, also
		 * after a lock wait or a wake-up took this backend off its
		 * condition variable.
		 */
		if (args->wait_until != 0)
			idem_waits_arm();
		if (IsolationUsesXactSnapshot())
		{
			/*
			 * What the transaction's snapshot shows, then (unless that
			 * answers) what is there now.
			 */
			decision = idem_keytable_read(kt, &row, args->result_cxt) ?
				decide(args, &row, res) : DECISION_CLAIM;
			probe = PROBE_NONE;
		}
		else
		{
			/* One look shows the committed row and who is changing it. */
			probe = idem_keytable_look(kt, &row, &waiter, args->result_cxt);
			decision = row.found ? decide(args, &row, res) : DECISION_CLAIM;
		}
		if (decision == DECISION_IN_FLIGHT && wait_for_holder(kt, args, &row))
		{
			round--;			/* time passed: not a round */
			continue;
		}
		if (decision == DECISION_IN_FLIGHT)
			set_in_flight(res, &row);
		if (decision != DECISION_CLAIM)
			return;
		if (IsolationUsesXactSnapshot())
		{
			probe = idem_keytable_probe(kt, &waiter);
			if ((probe == PROBE_COMMITTED &&
				 (!row.found || !ItemPointerEquals(&waiter.tid, &row.tid))) ||
				(probe == PROBE_NONE && row.found))
				changed_since_snapshot(kt->key, probe == PROBE_NONE);
		}

		/* The key is free, its window or its lease over: look before writing. */
		if (probe == PROBE_IN_PROGRESS &&
			!TransactionIdIsCurrentTransactionId(waiter.xid))
		{
			/*
			 * Only a purge deletes a version whose window is over; it never
			 * waits itself and holds the row for one short batch, so even
			 * wait => false waits for it, and then claims the key.
			 */
			bool		purge = waiter.deleting && row.found &&
				row.expires_at <= args->now;

			if (!may_wait && !purge)
			{
				set_in_flight(res, NULL);
				return;
			}
			/*
			 * Waiting for a speculative insertion to finish is not the wait
			 * for its transaction, which may still hold the key.
			 */
			idem_stats_start(&waited);
			if (idem_keytable_wait(kt, &waiter) && !purge &&
				!may_wait_again(args))
				may_wait = false;
			add_wait(args, &waited);
			continue;
		}
		if (!row.found)
		{
			/* A new key: insert it, unless another inserter came first. */
			claim_values(&kv, args, args->expires_at);
			if (idem_keytable_insert(kt, &kv))
			{
				set_claimed(res, kv.token, kv.lease_until, kv.expires_at);
				idem_stats_count(IDEM_STAT_CLAIMS);
				return;
			}
			continue;
		}
		switch (reclaim(kt, args, &row, may_wait, res))
		{
			case KEYWRITE_OK:
				return;
			case KEYWRITE_BUSY:
				set_in_flight(res, NULL);
				return;
			case KEYWRITE_CHANGED:
				/* Changed since it was read, maybe after a wait. */
				may_wait = may_wait && may_wait_again(args);
				continue;
		}
	}
	idem_too_many_rounds(kt->key);
}

/* scope argument: not NULL, may be empty. */
text *
idem_scope_arg(FunctionCallInfo fcinfo, int argno)
{
	text	   *scope = idem_arg_text(fcinfo, argno, "scope");

	idem_check_key(scope, "scope", true);
	return scope;
}

/* key argument: not NULL, not empty. */
static text *
key_arg(FunctionCallInfo fcinfo, int argno)
{
	text	   *key = idem_arg_text(fcinfo, argno, "key");

	idem_check_key(key, "key", false);
	return key;
}

/* An interval argument; NULL stands for the setting's default. */
static Interval *
interval_arg(FunctionCallInfo fcinfo, int argno)
{
	return PG_ARGISNULL(argno) ? NULL : PG_GETARG_INTERVAL_P(argno);
}

/*
 * The columns of idem_begin's row, in order.  Versions 1.0 to 1.3 declare
 * the first seven as OUT parameters, 1.4 all nine, and 1.5 all nine as the
 * row type idem.begin_result.
 */
#define BEGIN_RESULT_COLUMNS_BEFORE_14 7
static const Oid begin_result_types[BEGIN_RESULT_COLUMNS] = {
	BOOLOID, TEXTOID, INT8OID, INT4OID, BYTEAOID,
	TIMESTAMPTZOID, TIMESTAMPTZOID, TEXTOID, BYTEAOID
};

/*
 * Check the row the executor expects (rsinfo->expectedDesc) against
 * idem_begin's columns, before anything is looked at or written: the row
 * type of 1.5 is an ordinary composite type, which its owner can ALTER.
 * An attribute dropped from it reads NULL; any other difference is an
 * error.  So a row with more attributes than idem's columns has dropped
 * ones (idem_result_row_put).
 */
static void
begin_result_check(TupleDesc desc)
{
	int			column = 0;

	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute attr = TupleDescAttr(desc, i);

		if (attr->attisdropped)
			continue;
		if (column >= BEGIN_RESULT_COLUMNS ||
			attr->atttypid != begin_result_types[column])
		{
			column = -1;
			break;
		}
		column++;
	}
	if (column != BEGIN_RESULT_COLUMNS &&
		!(column == BEGIN_RESULT_COLUMNS_BEFORE_14 && desc->natts == column))
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("idem_begin is declared with a result row idem does not return"),
				 errdetail("The row must have the columns claimed, state, token, status, body, lease_until, expires_at, phase and phase_data with the types idem creates them with."),
				 errhint("Restore the type idem.begin_result as the extension created it.")));
}

/*
 * A tuplestore for the one row of idem_begin, as InitMaterializedSRF
 * (MAT_SRF_USE_EXPECTED_DESC) sets it up, but without a copy of the
 * descriptor: setDesc is left NULL, so that the executor does not
 * cross-check and free a copy on every call.  The row is formed with the
 * executor's expectedDesc, the shape the SQL declaration gives.
 */
static Tuplestorestate *
begin_result_store(FunctionCallInfo fcinfo)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	MemoryContext old;
	Tuplestorestate *store;

	if (rsinfo == NULL || !IsA(rsinfo, ReturnSetInfo))
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("set-valued function called in context that cannot accept a set")));
	if (!(rsinfo->allowedModes & SFRM_Materialize) || rsinfo->expectedDesc == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("materialize mode required, but it is not allowed in this context")));
	begin_result_check(rsinfo->expectedDesc);
	old = MemoryContextSwitchTo(rsinfo->econtext->ecxt_per_query_memory);
	store = tuplestore_begin_heap((rsinfo->allowedModes & SFRM_Materialize_Random) != 0,
								  false, work_mem);
	MemoryContextSwitchTo(old);
	rsinfo->returnMode = SFRM_Materialize;
	rsinfo->setResult = store;
	rsinfo->setDesc = NULL;
	return store;
}

/*
 * Put a row of ncolumns columns into the store in the executor's shape:
 * the columns in order, NULL for attributes dropped from the row type
 * (checked beforehand, so that a row with more attributes than columns
 * has dropped ones).
 */
void
idem_result_row_put(Tuplestorestate *store, TupleDesc desc, Datum *values,
					bool *nulls, int ncolumns)
{
	Datum	   *row_values = values;
	bool	   *row_nulls = nulls;

	if (desc->natts > ncolumns)
	{
		int			column = 0;

		row_values = palloc(desc->natts * sizeof(Datum));
		row_nulls = palloc(desc->natts * sizeof(bool));
		for (int i = 0; i < desc->natts; i++)
		{
			row_values[i] = (Datum) 0;
			row_nulls[i] = true;
			if (TupleDescAttr(desc, i)->attisdropped)
				continue;
			row_values[i] = values[column];
			row_nulls[i] = nulls[column];
			column++;
		}
	}
	tuplestore_putvalues(store, desc, row_values, row_nulls);
}

/*
 * The columns of idem.begin_result for res, claimed to phase_data, into
 * values and nulls (BEGIN_RESULT_COLUMNS of each): idem_begin's row, and
 * the middle of each row of idem_begin_many.  phase and phase_data are
 * the columns 1.4 adds, put only where declared (idem_result_row_put).
 */
void
idem_claim_result_values(const ClaimResult *res, Datum *values, bool *nulls)
{
	memset(nulls, true, BEGIN_RESULT_COLUMNS * sizeof(bool));
	values[0] = BoolGetDatum(res->claimed);
	nulls[0] = false;
	values[1] = CStringGetTextDatum(idem_claim_state_names[res->state]);
	nulls[1] = false;
	if (res->has_token)
	{
		values[2] = Int64GetDatum(res->token);
		nulls[2] = false;
	}
	if (res->has_response)
	{
		values[3] = Int32GetDatum(res->status);
		nulls[3] = false;
		if (res->body != NULL)
		{
			values[4] = PointerGetDatum(res->body);
			nulls[4] = false;
		}
	}
	if (res->has_lease)
	{
		values[5] = TimestampTzGetDatum(res->lease_until);
		nulls[5] = false;
	}
	if (res->has_expiry)
	{
		values[6] = TimestampTzGetDatum(res->expires_at);
		nulls[6] = false;
	}
	if (res->phase != NULL)
	{
		values[7] = PointerGetDatum(res->phase);
		nulls[7] = false;
	}
	if (res->phase_data != NULL)
	{
		values[8] = PointerGetDatum(res->phase_data);
		nulls[8] = false;
	}
}

/*
 * The options of a claim, arguments 2 to 8 of idem_begin and of
 * idem_begin_many (lease, retention, scope, wait, wait_for, remember,
 * holder), checked: everything but the key and its fingerprint.  Older
 * versions declare fewer arguments.
 */
void
idem_claim_args(FunctionCallInfo fcinfo, const char *what, ClaimArgs *args)
{
	memset(args, 0, sizeof(ClaimArgs));
	args->what = what;
	if (PG_ARGISNULL(5))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("wait must not be null")));
	args->wait = PG_GETARG_BOOL(5);
	args->lease = interval_arg(fcinfo, 2);
	args->retention = interval_arg(fcinfo, 3);
	/* remember, the eighth argument from 1.6 on */
	args->has_remember = PG_NARGS() > 7 && !PG_ARGISNULL(7);
	args->remember = args->has_remember ? PG_GETARG_INTERVAL_P(7) : NULL;
	args->remember_until = 0;
	/* holder, the ninth from 1.7 on */
	args->holder = (PG_NARGS() > 8 && !PG_ARGISNULL(8)) ?
		PG_GETARG_TEXT_PP(8) : NULL;
	if (args->holder != NULL)
		idem_check_key(args->holder, "holder", false);
	claim_args_now(args);
	if (args->lease_until > args->expires_at)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lease must not be longer than retention"),
				 errdetail("The lease is %s; the retention is %s.",
						   idem_window_text(args->lease, idem_default_lease, "lease"),
						   idem_window_text(args->retention, idem_default_retention,
											"retention")),
				 errhint("Pass a shorter lease or a longer retention.")));
	if (args->has_remember && args->remember_until < args->expires_at)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("remember must not be shorter than retention"),
				 errdetail("remember is %s; the retention is %s.",
						   idem_window_text(args->remember, 0, "remember"),
						   idem_window_text(args->retention, idem_default_retention,
											"retention")),
				 errhint("Pass a longer remember, or none.")));
	/* wait_for, the seventh argument of the 1.4 overload */
	args->wait_until = 0;
	args->lock_wait_until = 0;
	if (PG_NARGS() > 6 && !PG_ARGISNULL(6))
	{
		Interval   *wait_for = PG_GETARG_INTERVAL_P(6);

		if (wait_for->month != 0 || wait_for->day != 0 || wait_for->time != 0)
		{
			if (!args->wait)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("wait_for needs wait => true")));
			args->wait_until = idem_window_end(args->now, wait_for, 0, "wait_for");
			if (LockTimeout > 0)
				args->lock_wait_until = args->now + (int64) LockTimeout * 1000;
		}
	}
	args->result_cxt = CurrentMemoryContext;
}

/*
 * Claim one key with args (its fingerprint in args->fingerprint), or find
 * out why not, into *res: idem_begin's work for a key, which
 * idem_begin_many does for each of its items.  A claim after an earlier
 * key's wait is made with the clock read again.
 */
void
idem_begin_key(ClaimArgs *args, text *scope, text *key, ClaimResult *res)
{
	KeyTable	kt;
	instr_time	started;

	idem_stats_start(&started);
	if (args->waited)
		claim_args_now(args);
	args->waited = false;
	INSTR_TIME_SET_ZERO(args->wait_time);
	memset(res, 0, sizeof(ClaimResult));
	idem_keytable_open(&kt, args->what, scope, key, idem_keytable_write_lockmode());
	/* A table without remember_until would forget the tombstone. */
	if (unlikely(args->has_remember &&
				 RelationGetDescr(kt.rel)->natts < Anum_keys_remember_until))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s cannot remember a key in table \"%s\": it has the layout of idem 1.5 or earlier",
						args->what, RelationGetRelationName(kt.rel)),
				 errdetail("The table has no remember_until column, which the update to 1.6 adds."),
				 errhint("Run ALTER EXTENSION idem UPDATE; under Citus, on the coordinator, so that every shard is updated.")));
	/* ... and one without holder, the claim's holder. */
	if (unlikely(args->holder != NULL &&
				 RelationGetDescr(kt.rel)->natts < Anum_keys_holder))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s cannot record a holder in table \"%s\": it has the layout of idem 1.6 or earlier",
						args->what, RelationGetRelationName(kt.rel)),
				 errdetail("The table has no holder column, which the update to 1.7 adds."),
				 errhint("Run ALTER EXTENSION idem UPDATE; under Citus, on the coordinator, so that every shard is updated.")));
	if (args->wait_until != 0)
		idem_waits_prepare(scope, key);
	claim_key(&kt, args, res);
	if (args->wait_until != 0)
		idem_waits_done();
	idem_keytable_close(&kt);
	count_waits(args);
	if (res->claimed)
		idem_stats_add_time(IDEM_STAT_CLAIM_USECS, &started);
	else if (res->state == CLAIM_DONE)
		idem_stats_add_time(IDEM_STAT_REPLAY_USECS, &started);
}

/*
 * idem_begin(key, fingerprint, lease, retention, scope, wait, wait_for,
 * remember, holder): claim a key, replay its stored response, or report it
 * in flight or in conflict.
 */
Datum
idem_begin(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = key_arg(fcinfo, 0);
	text	   *scope = idem_scope_arg(fcinfo, 4);
	ClaimArgs	args;
	ClaimResult res;
	Tuplestorestate *store;
	Datum		values[BEGIN_RESULT_COLUMNS];
	bool		nulls[BEGIN_RESULT_COLUMNS];
	bytea	   *fingerprint;

	fingerprint = idem_fingerprint_digest(idem_arg_text(fcinfo, 1, "fingerprint"));
	idem_claim_args(fcinfo, "idem_begin()", &args);
	args.fingerprint = fingerprint;

	store = begin_result_store(fcinfo);
	idem_begin_key(&args, scope, key, &res);

	idem_claim_result_values(&res, values, nulls);
	idem_result_row_put(store, rsinfo->expectedDesc, values, nulls,
						BEGIN_RESULT_COLUMNS);
	return (Datum) 0;
}

/* The writes a claim's holder makes. */
typedef enum HeldOp
{
	HELD_COMPLETE,
	HELD_RELEASE,
	HELD_EXTEND,
	HELD_CHECKPOINT,			/* store a recovery point */
	HELD_HOLD					/* lock the row FOR SHARE; no write */
} HeldOp;

/* A call of idem_complete, idem_release or idem_extend, its arguments checked. */
typedef struct HeldCall
{
	HeldOp		op;
	const char *what;			/* the SQL function, for error messages */
	text	   *key;
	text	   *scope;
	bool		has_token;		/* false: the claim this transaction made */
	int64		token;
	TimestampTz now;
	bytea	   *fingerprint;	/* complete: the request's digest */
	int32		status;			/* complete: the response */
	bytea	   *body;
	bool		has_expiry;		/* complete: a new window was asked for */
	TimestampTz expires_at;
	TimestampTz lease_until;	/* extend: the lease asked for */
	text	   *phase;			/* checkpoint: the recovery point */
	bytea	   *phase_data;
} HeldCall;

typedef enum Holder
{
	HOLDER_NONE,				/* no live row (release only) */
	HOLDER_WRITE,				/* the holder may write the row */
	HOLDER_DONE					/* the row is completed already */
} Holder;

/*
 * A write with a token older than the key's last one: ID002, counted.
 * The row keeps only its current token, and tokens come from one sequence
 * for all keys: an older token may be one the key had before it was taken
 * over, or another key's.  The detail says which when the token tells
 * (none below 1 was ever issued), and both otherwise.  A token newer than
 * the key's is never the key's: check_holder answers it with ID003.
 */
static void
superseded(text *key, int64 token)
{
	idem_stats_count(IDEM_STAT_SUPERSEDED);
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_TOKEN_SUPERSEDED),
			 errmsg("idempotency key \"%s\" is held by a newer claim",
					idem_key_for_message(key)),
			 token < 1 ?
			 errdetail("Token %lld was never this key's: no token below 1 is ever issued.",
					   (long long) token) :
			 errdetail("Token %lld is older than the key's current claim: the key was taken over since "
					   "(its lease ran out, or it was released and claimed again), or the token is another key's.",
					   (long long) token)));
}

/*
 * Refuse any write of a tombstone, which keeps no claimant and no
 * response: nothing is changed, whatever the token.  The errors are those
 * of a completed key: ID003 without a token (or with one the key never
 * had), ID002 for a superseded token, ID004 for the key's last token.
 */
static void
tombstone_refused(const HeldCall *hc, KeyRow *row)
{
	if (!hc->has_token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" is not claimed by this transaction",
						idem_key_for_message(hc->key)),
				 errdetail("The key is completed and its retention window is over; it is remembered without its response.")));
	if (hc->token < row->token)
		superseded(hc->key, hc->token);
	if (hc->token != row->token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no claim with token %lld",
						idem_key_for_message(hc->key), (long long) hc->token),
				 errdetail("Token %lld is newer than the key's current claim: it was never this key's.",
						   (long long) hc->token)));
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_ALREADY_COMPLETED),
			 errmsg("idempotency key \"%s\" is already completed",
					idem_key_for_message(hc->key)),
			 errdetail("Its retention window is over; it is remembered without its response until %s.",
					   timestamptz_to_str(row->remember_until))));
}

/*
 * The holder rules: may the caller of hc write the key's row as read?  A
 * call without a token stands for the claim this transaction made.
 * Outside the claiming transaction the token is not proof enough, since
 * tokens are sequence numbers: the caller must also be the role that made
 * the claim (current_user then), a member of it, or a superuser.  Raises
 * the error that explains a refusal, checking who holds the key before
 * what it holds, so that a caller without the claim learns nothing of the
 * stored request, and never naming the key's current token.  Returns
 * HOLDER_DONE for a completed row of the same holder, which the caller
 * accepts or refuses, and HOLDER_NONE instead of an error for a missing or
 * expired key to be released.  binds_roles: the table stores who made a
 * claim (1.3 on).
 */
static Holder
check_holder(const HeldCall *hc, KeyRow *row, bool binds_roles)
{
	int64		token;
	bool		outside;
	bool		unbound;

	if (unlikely(idem_keyrow_is_tombstone(row, hc->now)))
		tombstone_refused(hc, row);
	if (!row->found || row->expires_at <= hc->now)
	{
		if (hc->op == HELD_RELEASE)
			return HOLDER_NONE;
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no live claim",
						idem_key_for_message(hc->key)),
				 errdetail("The key does not exist or its retention window is over."),
				 errhint("Claim it again with idem_begin.")));
	}
	if (!hc->has_token)
	{
		if (!holds_claim(row) && !(row->done &&
								   TransactionIdIsCurrentTransactionId(row->xmin)))
			ereport(ERROR,
					(errcode(ERRCODE_IDEM_NO_CLAIM),
					 errmsg("idempotency key \"%s\" is not claimed by this transaction",
							idem_key_for_message(hc->key)),
					 errhint("Pass the token of the claim. idem_begin returns one only when it claims (claimed = true): a replay, a conflict or a key in flight has none.")));
		token = row->token;
	}
	else
		token = hc->token;

	/*
	 * A claim made before the update to 1.3 is bound to no role.  Outside
	 * its claiming transaction, a wrong token for it does not tell whether
	 * the right one is smaller or greater (which would let any role find
	 * it in a few calls), and only a superuser may extend it, so that it
	 * ends with its lease.
	 */
	outside = hc->has_token && !holds_claim(row);
	unbound = outside && !row->claimed_by.bound && binds_roles;
	if (token < row->token && !unbound)
		superseded(hc->key, token);
	if (token != row->token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no claim with token %lld",
						idem_key_for_message(hc->key), (long long) token),
				 unbound ?
				 errdetail("Token %lld is not the token of the key's current claim.",
						   (long long) token) :
				 errdetail("Token %lld is newer than the key's current claim: it was never this key's.",
						   (long long) token)));
	if (outside &&
		(row->claimed_by.bound ?
		 !has_privs_of_role(GetUserId(), idem_keytable_claimant_role(&row->claimed_by)) :
		 unbound && hc->op == HELD_EXTEND && !superuser()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied for idempotency key \"%s\"",
						idem_key_for_message(hc->key)),
				 row->claimed_by.bound ?
				 errdetail("Its claim was made by another role.") :
				 errdetail("Its claim was made before idem 1.3 and is bound to no role."),
				 row->claimed_by.bound ?
				 errhint("Only the role that made a claim, its members and superusers can complete, release or extend it.") :
				 errhint("Only superusers can extend it; complete or release it, or let its lease end.")));
	if (hc->fingerprint != NULL && !same_fingerprint(row, hc->fingerprint))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_FINGERPRINT_CONFLICT),
				 errmsg("idempotency key \"%s\" was claimed with a different fingerprint",
						idem_key_for_message(hc->key))));
	return row->done ? HOLDER_DONE : HOLDER_WRITE;
}

/* Refuse a write to a completed key (ID004). */
static void
already_completed(text *key, bool other_response)
{
	if (other_response)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_ALREADY_COMPLETED),
				 errmsg("idempotency key \"%s\" is already completed with a different response",
						idem_key_for_message(key))));
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_ALREADY_COMPLETED),
			 errmsg("idempotency key \"%s\" is already completed",
					idem_key_for_message(key))));
}

/* Are two bodies (or their absence) byte for byte the same? */
static bool
same_body(bytea *a, bytea *b)
{
	if (a == NULL || b == NULL)
		return a == b;
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

/*
 * The row as read, changed as hc asks: a completion stores the response
 * (and keeps the claim's window unless a new one was asked for), an
 * extension makes the lease last at least as long as asked (never
 * shorter) and the window at least as long as the lease.
 */
static void
held_values(const HeldCall *hc, KeyRow *row, KeyValues *kv)
{
	bytea	   *fingerprint = hc->fingerprint;

	if (fingerprint == NULL)
	{
		fingerprint = palloc(VARHDRSZ + IDEM_FINGERPRINT_LEN);
		SET_VARSIZE(fingerprint, VARHDRSZ + IDEM_FINGERPRINT_LEN);
		memcpy(VARDATA(fingerprint), row->fingerprint, IDEM_FINGERPRINT_LEN);
	}
	kv->fingerprint = fingerprint;
	kv->token = row->token;
	kv->done = row->done;
	kv->status = row->status;
	kv->body = row->body;
	kv->has_lease = row->has_lease;
	kv->lease_until = row->lease_until;
	kv->expires_at = row->expires_at;
	kv->claimed_by = row->claimed_by;
	kv->claimant_as_stored = true;
	kv->has_remember = row->has_remember;
	kv->remember_until = row->remember_until;
	kv->holder_as_stored = true;
	/* A completion drops the recovery point; a checkpoint replaces it. */
	kv->phase_as_stored = (hc->op == HELD_EXTEND);
	if (hc->op == HELD_CHECKPOINT)
	{
		kv->phase = hc->phase;
		kv->phase_data = hc->phase_data;
	}
	if (hc->op == HELD_COMPLETE)
	{
		kv->done = true;
		kv->status = hc->status;
		kv->body = hc->body;
		kv->has_lease = false;
		if (hc->has_expiry)
			kv->expires_at = hc->expires_at;
	}
	else if (hc->op == HELD_EXTEND)
	{
		kv->has_lease = true;
		kv->lease_until = (row->has_lease && row->lease_until > hc->lease_until) ?
			row->lease_until : hc->lease_until;
		kv->expires_at = Max(row->expires_at, kv->lease_until);
	}
}

/*
 * Make the write hc asks of the key's holder: read the row for the
 * write, check the holder, and write exactly the version read, as UPDATE
 * and DELETE do, reading again if it changed meanwhile.  Returns false if
 * a release found no live row.  *kv is left with the values written (done
 * only if a completion was stored now), or, for a repeated completion,
 * the stored expires_at.
 */
static bool
write_held_row(const HeldCall *hc, KeyValues *kv)
{
	KeyTable	kt;
	KeyRow		row;
	bool		written = false;
	int			round;

	memset(kv, 0, sizeof(KeyValues));
	idem_keytable_open(&kt, hc->what, hc->scope, hc->key,
					   idem_keytable_write_lockmode());
	/* A table without the recovery point's columns would drop it. */
	if (hc->op == HELD_CHECKPOINT &&
		RelationGetDescr(kt.rel)->natts < Anum_keys_phase_data)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem_checkpoint() cannot store a recovery point in table \"%s\": it has the layout of idem 1.3 or earlier",
						RelationGetRelationName(kt.rel)),
				 errdetail("The table has no phase and phase_data columns, which the update to 1.4 adds."),
				 errhint("Run ALTER EXTENSION idem UPDATE; under Citus, on the coordinator, so that every shard is updated.")));
	for (round = 0;; round++)
	{
		KeyWrite	result;

		if (round == IDEM_MAX_CLAIM_ROUNDS)
			idem_too_many_rounds(hc->key);
		idem_keytable_read_for_write(&kt, &row, hc->op == HELD_COMPLETE ?
									 CurrentMemoryContext : NULL);
		switch (check_holder(hc, &row,
							 RelationGetDescr(kt.rel)->natts >= Anum_keys_claimed_by))
		{
			case HOLDER_NONE:
				break;
			case HOLDER_DONE:
				/* Only a repeat of the stored response is accepted. */
				if (hc->op != HELD_COMPLETE)
					already_completed(hc->key, false);
				if (row.status != hc->status || !same_body(hc->body, row.body))
					already_completed(hc->key, true);
				kv->expires_at = row.expires_at;
				written = true;
				break;
			case HOLDER_WRITE:
				if (hc->op == HELD_RELEASE)
					result = idem_keytable_delete(&kt, &row, true);
				else if (hc->op == HELD_HOLD)
					result = idem_keytable_lock_share(&kt, &row);
				else
				{
					held_values(hc, &row, kv);
					result = idem_keytable_update(&kt, &row, kv, true);
				}
				if (result != KEYWRITE_OK)
					continue;	/* changed since it was read */
				written = true;
				break;
		}
		break;
	}
	idem_keytable_close(&kt);
	return written;
}

/* The key, scope and token arguments of a holder's call. */
static void
held_call_init(HeldCall *hc, HeldOp op, const char *what,
			   FunctionCallInfo fcinfo, int tokenarg, int scopearg)
{
	memset(hc, 0, sizeof(HeldCall));
	hc->op = op;
	hc->what = what;
	hc->key = key_arg(fcinfo, 0);
	hc->scope = idem_scope_arg(fcinfo, scopearg);
	hc->has_token = !PG_ARGISNULL(tokenarg);
	if (hc->has_token)
		hc->token = PG_GETARG_INT64(tokenarg);
	hc->now = idem_now();
}

/*
 * The HTTP middleware's envelope (doc/http.md): a marker line, the kept
 * headers as JSON on one line of at most ENVELOPE_MAX_HEAD bytes, then the
 * body.
 */
#define ENVELOPE_MARKER		"idem-http/1\n"
#define ENVELOPE_MAX_HEAD	65536

/*
 * The size of a response body that counts against idem.max_body_size: the
 * bytes after an envelope's header line, or all of them.
 */
static Size
response_size(bytea *body, bool *envelope)
{
	const char *data = VARDATA_ANY(body);
	Size		len = VARSIZE_ANY_EXHDR(body);
	Size		marker = strlen(ENVELOPE_MARKER);
	const char *nl;

	*envelope = false;
	if (len < marker || memcmp(data, ENVELOPE_MARKER, marker) != 0)
		return len;
	nl = memchr(data + marker, '\n', Min(len - marker, ENVELOPE_MAX_HEAD));
	if (nl == NULL)
		return len;
	*envelope = true;
	return len - (Size) (nl + 1 - data);
}

/*
 * What is stored instead of a response too large to keep (doc/http.md):
 * a problem+json body, in an envelope if the response was given in one.
 */
static bytea *
not_stored_body(bool envelope)
{
	static const char head[] = ENVELOPE_MARKER
		"[[\"content-type\",\"application/problem+json\"]]\n";
	static const char problem[] =
		"{\"type\":\"about:blank\",\"title\":\"Response not stored\",\"status\":500,"
		"\"detail\":\"The response to the first request with this key was larger than "
		"idem.max_body_size; it was sent then and is not replayed.\"}";
	Size		headlen = envelope ? strlen(head) : 0;
	Size		len = headlen + strlen(problem);
	bytea	   *result = (bytea *) palloc(VARHDRSZ + len);

	SET_VARSIZE(result, VARHDRSZ + len);
	memcpy(VARDATA(result), head, headlen);
	memcpy(VARDATA(result) + headlen, problem, strlen(problem));
	return result;
}

/*
 * Store the response of a key's claim, as idem_complete does (see there),
 * and return the key's new expires_at: idem_complete's work for a key,
 * which idem_complete_many does for each of its items.  status is checked
 * by the caller.
 */
TimestampTz
idem_complete_key(text *key, text *scope, bytea *fingerprint, int32 status,
				  bytea *body, bool has_token, int64 token, bool has_expiry,
				  TimestampTz expires_at)
{
	HeldCall	hc;
	KeyValues	kv;
	Size		size = 0;
	bool		envelope = false;
	bool		not_stored = false;
	instr_time	started;

	idem_stats_start(&started);
	memset(&hc, 0, sizeof(HeldCall));
	hc.op = HELD_COMPLETE;
	hc.what = "idem_complete()";
	hc.key = key;
	hc.scope = scope;
	hc.has_token = has_token;
	hc.token = token;
	hc.now = idem_now();
	hc.fingerprint = fingerprint;
	hc.status = status;
	hc.body = body;
	hc.has_expiry = has_expiry;
	hc.expires_at = expires_at;
	if (hc.body != NULL)
	{
		size = response_size(hc.body, &envelope);
		if (size > (Size) idem_max_body_size)
		{
			hc.status = 500;
			hc.body = not_stored_body(envelope);
			not_stored = true;
		}
	}

	write_held_row(&hc, &kv);
	if (kv.done)
	{
		idem_stats_count(IDEM_STAT_COMPLETES);
		idem_stats_add_time(IDEM_STAT_COMPLETE_USECS, &started);
		idem_waits_note_change(hc.scope, hc.key);
	}
	if (not_stored && kv.done)
	{
		idem_stats_count(IDEM_STAT_NOT_STORED);
		ereport(WARNING,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("response to idempotency key \"%s\" not stored: its body is too large",
						idem_key_for_message(hc.key)),
				 errdetail("The body is %zu bytes; idem.max_body_size is %d.",
						   size, idem_max_body_size),
				 errhint("Status 500 \"Response not stored\" is stored instead and replayed to retries.")));
	}
	return kv.expires_at;
}

/*
 * idem_complete(key, fingerprint, status, body, token, retention, scope):
 * store the response of a claim.  Without retention the key keeps the
 * window its claim was given.  Returns the new expires_at.
 *
 * A body larger than idem.max_body_size is not an error: the work it
 * answers has been done, and a retry must not do it again.  The fixed
 * answer of not_stored_body() is stored instead, with a WARNING.
 */
Datum
idem_complete(PG_FUNCTION_ARGS)
{
	text	   *key = key_arg(fcinfo, 0);
	text	   *scope = idem_scope_arg(fcinfo, 6);
	bool		has_token = !PG_ARGISNULL(4);
	int64		token = has_token ? PG_GETARG_INT64(4) : 0;
	bytea	   *fingerprint;
	bytea	   *body;
	int32		status;
	Interval   *retention;
	bool		has_expiry = false;
	TimestampTz expires_at = 0;

	fingerprint = idem_fingerprint_digest(idem_arg_text(fcinfo, 1, "fingerprint"));
	body = PG_ARGISNULL(3) ? NULL : PG_GETARG_BYTEA_PP(3);
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("status must not be null")));
	status = PG_GETARG_INT32(2);
	if (status < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("status must not be negative")));
	retention = interval_arg(fcinfo, 5);
	if (retention != NULL)
	{
		has_expiry = true;
		expires_at = idem_window_end(idem_now(), retention, 0, "retention");
	}
	PG_RETURN_TIMESTAMPTZ(idem_complete_key(key, scope, fingerprint, status,
											body, has_token, token,
											has_expiry, expires_at));
}

/*
 * idem_release(key, token, scope): give up a claim so the key is free at
 * once.  Returns false if the key has no live row to release.
 */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	HeldCall	hc;
	KeyValues	kv;
	bool		released;

	held_call_init(&hc, HELD_RELEASE, "idem_release()", fcinfo, 1, 2);
	released = write_held_row(&hc, &kv);
	if (released)
	{
		idem_stats_count(IDEM_STAT_RELEASES);
		idem_waits_note_change(hc.scope, hc.key);
	}
	PG_RETURN_BOOL(released);
}

/*
 * idem_extend(key, token, lease, scope): make the lease of a live claim
 * last at least until now + lease; a lease is never shortened.  Returns
 * the lease's end.
 */
Datum
idem_extend(PG_FUNCTION_ARGS)
{
	HeldCall	hc;
	KeyValues	kv;

	held_call_init(&hc, HELD_EXTEND, "idem_extend()", fcinfo, 1, 3);
	hc.lease_until = idem_window_end(hc.now, interval_arg(fcinfo, 2),
									 idem_default_lease, "lease");
	write_held_row(&hc, &kv);
	PG_RETURN_TIMESTAMPTZ(kv.lease_until);
}

/*
 * idem_checkpoint(key, token, phase, data, scope): store the last finished
 * phase of a claim's work and its output (a recovery point), fenced as a
 * completion is.  A takeover's idem_begin returns them, so that the work
 * resumes after that phase.  Inside the claiming transaction the token may
 * be NULL, and the phase's business writes commit with its checkpoint.
 */
Datum
idem_checkpoint(PG_FUNCTION_ARGS)
{
	HeldCall	hc;
	KeyValues	kv;

	held_call_init(&hc, HELD_CHECKPOINT, "idem_checkpoint()", fcinfo, 1, 4);
	hc.phase = idem_arg_text(fcinfo, 2, "phase");
	idem_check_key(hc.phase, "phase", false);
	hc.phase_data = PG_ARGISNULL(3) ? NULL : PG_GETARG_BYTEA_PP(3);
	if (hc.phase_data != NULL &&
		VARSIZE_ANY_EXHDR(hc.phase_data) > (Size) idem_max_body_size)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("phase data is too large"),
				 errdetail("It is %zu bytes; idem.max_body_size is %d.",
						   (size_t) VARSIZE_ANY_EXHDR(hc.phase_data),
						   idem_max_body_size)));
	write_held_row(&hc, &kv);
	PG_RETURN_VOID();
}

/*
 * idem_hold(key, token, scope): check that the caller holds the key's
 * current claim and keep its row locked FOR SHARE until the transaction
 * ends, so that a takeover waits for the transaction and a superseded
 * holder is refused (ID002) before it touches business rows.
 */
Datum
idem_hold(PG_FUNCTION_ARGS)
{
	HeldCall	hc;
	KeyValues	kv;

	held_call_init(&hc, HELD_HOLD, "idem_hold()", fcinfo, 1, 2);
	write_held_row(&hc, &kv);
	PG_RETURN_VOID();
}
