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
 * holds no lock.  complete, release and extend check the holder on the
 * version read (its token and, outside the claiming transaction, its
 * role) and write that version the same way.  A call waits at
 * most once (for the transaction that held the key, bounded by
 * lock_timeout); if the key is busy again after that, it answers in
 * flight.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "idem.h"
#include "keytable.h"
#include "stats.h"

PG_FUNCTION_INFO_V1(idem_begin);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_extend);

/* Bound on read/write rounds of one call; each round makes progress. */
#define IDEM_MAX_CLAIM_ROUNDS	100

typedef enum ClaimState
{
	CLAIM_PROCESSING,
	CLAIM_DONE,
	CLAIM_CONFLICT
} ClaimState;

static const char *const claim_state_names[] = {
	"PROCESSING", "DONE", "CONFLICT"
};

/* The one row idem_begin returns; NULL fields are flagged false. */
typedef struct ClaimResult
{
	bool		claimed;
	ClaimState	state;
	bool		has_token;
	int64		token;
	bool		has_response;
	int32		status;
	bytea	   *body;
	bool		has_lease;
	TimestampTz lease_until;
	bool		has_expiry;
	TimestampTz expires_at;
} ClaimResult;

/* What a claim needs, validated. */
typedef struct ClaimArgs
{
	bytea	   *fingerprint;
	bool		wait;
	TimestampTz now;
	TimestampTz lease_until;
	TimestampTz expires_at;
	MemoryContext result_cxt;	/* where a replayed body is copied */
} ClaimArgs;

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

/* SHA-256 of the caller's fingerprint text, as a bytea. */
static bytea *
fingerprint_digest(text *fingerprint)
{
	bytea	   *digest = palloc(VARHDRSZ + IDEM_FINGERPRINT_LEN);

	idem_sha256((uint8 *) VARDATA_ANY(fingerprint),
				VARSIZE_ANY_EXHDR(fingerprint), (uint8 *) VARDATA(digest));
	SET_VARSIZE(digest, VARHDRSZ + IDEM_FINGERPRINT_LEN);
	return digest;
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
	keytable_current_claimant(&kv->claimed_by);
}

/*
 * Answer a claim from an existing row without writing, or return false
 * if the answer is a claim of the row: its window or its lease is over.
 */
static bool
decide(ClaimArgs *args, KeyRow *row, ClaimResult *res)
{
	if (row->expires_at <= args->now)
		return false;			/* the window is over: the key is new again */
	if (!same_fingerprint(row, args->fingerprint))
	{
		/* Reveal nothing of the stored request or response. */
		res->state = CLAIM_CONFLICT;
		idem_stats_count(IDEM_STAT_CONFLICTS);
		return true;
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
		return true;
	}
	if (holds_claim(row))
	{
		set_claimed(res, row->token, row->lease_until, row->expires_at);
		return true;
	}
	if (row->has_lease && args->now < row->lease_until)
	{
		set_in_flight(res, row);
		return true;
	}
	return false;				/* the holder's lease is over: take it over */
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
	KeyValues	kv;
	KeyWrite	written;

	keytable_prepare_write(kt);
	claim_values(&kv, args, takeover ?
				 Max(row->expires_at, args->lease_until) : args->expires_at);
	kv.token = keytable_next_token();
	written = keytable_update(kt, row, &kv, wait);
	if (written == KEYWRITE_OK)
	{
		set_claimed(res, kv.token, kv.lease_until, kv.expires_at);
		idem_stats_count(takeover ? IDEM_STAT_TAKEOVERS : IDEM_STAT_CLAIMS);
	}
	return written;
}

/* The error of a call that could not settle in IDEM_MAX_CLAIM_ROUNDS. */
static void
too_many_rounds(text *key)
{
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not settle idempotency key \"%s\"",
					idem_key_for_message(key)),
			 errdetail("The key changed under %d consecutive attempts.",
					   IDEM_MAX_CLAIM_ROUNDS),
			 errhint("Retry the transaction.")));
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

	for (round = 0; round < IDEM_MAX_CLAIM_ROUNDS; round++)
	{
		KeyRow		row;
		KeyWaiter	waiter;
		KeyValues	kv;
		KeyProbe	probe;

		CHECK_FOR_INTERRUPTS();
		if (IsolationUsesXactSnapshot())
		{
			/* What the transaction's snapshot shows, then what is there now. */
			if (keytable_read(kt, &row, args->result_cxt) &&
				decide(args, &row, res))
				return;
			probe = keytable_probe(kt, &waiter);
			if ((probe == PROBE_COMMITTED &&
				 (!row.found || !ItemPointerEquals(&waiter.tid, &row.tid))) ||
				(probe == PROBE_NONE && row.found))
				changed_since_snapshot(kt->key, probe == PROBE_NONE);
		}
		else
		{
			/* One look shows the committed row and who is changing it. */
			probe = keytable_look(kt, &row, &waiter, args->result_cxt);
			if (row.found && decide(args, &row, res))
				return;
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
			if (keytable_wait(kt, &waiter) && !purge)
				may_wait = false;
			continue;
		}
		if (!row.found)
		{
			/* A new key: insert it, unless another inserter came first. */
			claim_values(&kv, args, args->expires_at);
			if (keytable_insert(kt, &kv))
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
				may_wait = false;
				continue;
		}
	}
	too_many_rounds(kt->key);
}

/* scope argument: not NULL, may be empty. */
static text *
scope_arg(FunctionCallInfo fcinfo, int argno)
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
 * idem_begin(key, fingerprint, lease, retention, scope, wait): claim a key,
 * replay its stored response, or report it in flight or in conflict.
 */
Datum
idem_begin(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = key_arg(fcinfo, 0);
	text	   *scope = scope_arg(fcinfo, 4);
	ClaimArgs	args;
	ClaimResult res;
	KeyTable	kt;
	Datum		values[7];
	bool		nulls[7];

	args.fingerprint = fingerprint_digest(idem_arg_text(fcinfo, 1, "fingerprint"));
	if (PG_ARGISNULL(5))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("wait must not be null")));
	args.wait = PG_GETARG_BOOL(5);
	args.now = idem_now();
	args.lease_until = idem_window_end(args.now, interval_arg(fcinfo, 2),
									   idem_default_lease, "lease");
	args.expires_at = idem_window_end(args.now, interval_arg(fcinfo, 3),
									  idem_default_retention, "retention");
	if (args.lease_until > args.expires_at)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lease must not be longer than retention")));
	args.result_cxt = CurrentMemoryContext;

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);

	memset(&res, 0, sizeof(res));
	keytable_open(&kt, "idem_begin()", scope, key, keytable_write_lockmode());
	claim_key(&kt, &args, &res);
	keytable_close(&kt);

	memset(nulls, true, sizeof(nulls));
	values[0] = BoolGetDatum(res.claimed);
	nulls[0] = false;
	values[1] = CStringGetTextDatum(claim_state_names[res.state]);
	nulls[1] = false;
	if (res.has_token)
	{
		values[2] = Int64GetDatum(res.token);
		nulls[2] = false;
	}
	if (res.has_response)
	{
		values[3] = Int32GetDatum(res.status);
		nulls[3] = false;
		if (res.body != NULL)
		{
			values[4] = PointerGetDatum(res.body);
			nulls[4] = false;
		}
	}
	if (res.has_lease)
	{
		values[5] = TimestampTzGetDatum(res.lease_until);
		nulls[5] = false;
	}
	if (res.has_expiry)
	{
		values[6] = TimestampTzGetDatum(res.expires_at);
		nulls[6] = false;
	}
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	return (Datum) 0;
}

typedef enum Holder
{
	HOLDER_NONE,				/* no live row (missing_ok only) */
	HOLDER_WRITE,				/* the holder may write the row */
	HOLDER_DONE					/* the row is completed already */
} Holder;

/*
 * Check that the holder of the token argument at argno may write the key's
 * row as read; a NULL token stands for the claim this transaction made.
 * Outside the claiming transaction the token is not proof enough, since
 * tokens are sequence numbers: the caller must also be the role that made
 * the claim (current_user then), a member of it, or a superuser.  Raises
 * the error that explains a refusal, checking who holds the key before
 * what it holds, so that a caller without the claim learns nothing of the
 * stored request, and never naming the key's current token.  Returns
 * HOLDER_DONE for a completed row of the same holder, which the caller
 * accepts or refuses, and HOLDER_NONE instead of an error for a missing
 * or expired key if missing_ok.  extend: the holder wants to extend the
 * lease.
 */
static Holder
check_holder(FunctionCallInfo fcinfo, int argno, KeyTable *kt, KeyRow *row,
			 bytea *fingerprint, TimestampTz now, bool missing_ok, bool extend)
{
	int64		token;
	bool		outside;
	bool		unbound;

	if ((!row->found || row->expires_at <= now) && missing_ok)
		return HOLDER_NONE;
	if (!row->found || row->expires_at <= now)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no live claim",
						idem_key_for_message(kt->key)),
				 errdetail("The key does not exist or its retention window is over."),
				 errhint("Claim it again with idem_begin.")));
	if (PG_ARGISNULL(argno))
	{
		if (!holds_claim(row) && !(row->done &&
								   TransactionIdIsCurrentTransactionId(row->xmin)))
			ereport(ERROR,
					(errcode(ERRCODE_IDEM_NO_CLAIM),
					 errmsg("idempotency key \"%s\" is not claimed by this transaction",
							idem_key_for_message(kt->key)),
					 errhint("Pass the token idem_begin returned.")));
		token = row->token;
	}
	else
		token = PG_GETARG_INT64(argno);
	/*
	 * A claim made before the update to 1.3 is bound to no role.  Outside
	 * its claiming transaction, a wrong token for it does not tell whether
	 * the right one is smaller or greater (which would let any role find
	 * it in a few calls), and only a superuser may extend it, so that it
	 * ends with its lease.
	 */
	outside = !PG_ARGISNULL(argno) && !holds_claim(row);
	unbound = outside && !row->claimed_by.bound &&
		RelationGetDescr(kt->rel)->natts >= Anum_keys_claimed_by;
	if (token < row->token && !unbound)
	{
		idem_stats_count(IDEM_STAT_SUPERSEDED);
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_TOKEN_SUPERSEDED),
				 errmsg("idempotency key \"%s\" is held by a newer claim",
						idem_key_for_message(kt->key)),
				 errdetail("Token %lld was superseded: the key was taken over "
						   "after the lease ran out, or released and claimed again.",
						   (long long) token)));
	}
	if (token != row->token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no claim with token %lld",
						idem_key_for_message(kt->key), (long long) token),
				 unbound ?
				 errdetail("Token %lld is not the token of the key's current claim.",
						   (long long) token) :
				 errdetail("Token %lld was never issued for this key.",
						   (long long) token)));
	if (outside &&
		(row->claimed_by.bound ?
		 !has_privs_of_role(GetUserId(), keytable_claimant_role(&row->claimed_by)) :
		 unbound && extend && !superuser()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied for idempotency key \"%s\"",
						idem_key_for_message(kt->key)),
				 row->claimed_by.bound ?
				 errdetail("Its claim was made by another role.") :
				 errdetail("Its claim was made before idem 1.3 and is bound to no role."),
				 row->claimed_by.bound ?
				 errhint("Only the role that made a claim, its members and superusers can complete, release or extend it.") :
				 errhint("Only superusers can extend it; complete or release it, or let its lease end.")));
	if (fingerprint != NULL && !same_fingerprint(row, fingerprint))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_FINGERPRINT_CONFLICT),
				 errmsg("idempotency key \"%s\" was claimed with a different fingerprint",
						idem_key_for_message(kt->key))));
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

/* The values of the row as read, to change and write back. */
static void
row_values(KeyValues *kv, KeyRow *row, bytea *fingerprint)
{
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
}

/*
 * idem_complete(key, fingerprint, status, body, token, retention, scope):
 * store the response of a claim.  Without retention the key keeps the
 * window its claim was given.  Returns the new expires_at.
 */
Datum
idem_complete(PG_FUNCTION_ARGS)
{
	text	   *key = key_arg(fcinfo, 0);
	bytea	   *fingerprint = fingerprint_digest(idem_arg_text(fcinfo, 1, "fingerprint"));
	bytea	   *body = PG_ARGISNULL(3) ? NULL : PG_GETARG_BYTEA_PP(3);
	text	   *scope = scope_arg(fcinfo, 6);
	Interval   *retention = interval_arg(fcinfo, 5);
	int32		status;
	TimestampTz now;
	TimestampTz expires_at = 0;
	KeyTable	kt;
	KeyRow		row;
	int			round;

	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("status must not be null")));
	status = PG_GETARG_INT32(2);
	if (status < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("status must not be negative")));
	if (body != NULL && VARSIZE_ANY_EXHDR(body) > (Size) idem_max_body_size)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("body is too large"),
				 errdetail("It is %zu bytes; idem.max_body_size is %d.",
						   (size_t) VARSIZE_ANY_EXHDR(body), idem_max_body_size)));
	now = idem_now();
	if (retention != NULL)
		expires_at = idem_window_end(now, retention, 0, "retention");

	keytable_open(&kt, "idem_complete()", scope, key, keytable_write_lockmode());
	for (round = 0;; round++)
	{
		KeyValues	kv;

		if (round == IDEM_MAX_CLAIM_ROUNDS)
			too_many_rounds(key);
		keytable_read_for_write(&kt, &row, CurrentMemoryContext);
		if (check_holder(fcinfo, 4, &kt, &row, fingerprint, now,
						 false, false) == HOLDER_DONE)
		{
			if (row.status != status || !same_body(body, row.body))
				already_completed(key, true);
			expires_at = row.expires_at;	/* a repeat of the stored response */
			break;
		}
		row_values(&kv, &row, fingerprint);
		kv.done = true;
		kv.status = status;
		kv.body = body;
		kv.has_lease = false;
		if (retention != NULL)
			kv.expires_at = expires_at;
		if (keytable_update(&kt, &row, &kv, true) == KEYWRITE_OK)
		{
			expires_at = kv.expires_at;
			idem_stats_count(IDEM_STAT_COMPLETES);
			break;
		}
		/* Changed since it was read: read it again and check again. */
	}
	keytable_close(&kt);

	PG_RETURN_TIMESTAMPTZ(expires_at);
}

/*
 * idem_release(key, token, scope): give up a claim so the key is free at
 * once.  Returns false if the key has no live row to release.
 */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	text	   *key = key_arg(fcinfo, 0);
	text	   *scope = scope_arg(fcinfo, 2);
	TimestampTz now = idem_now();
	KeyTable	kt;
	KeyRow		row;
	bool		released = false;
	int			round;

	keytable_open(&kt, "idem_release()", scope, key, keytable_write_lockmode());
	for (round = 0;; round++)
	{
		if (round == IDEM_MAX_CLAIM_ROUNDS)
			too_many_rounds(key);
		keytable_read_for_write(&kt, &row, NULL);
		switch (check_holder(fcinfo, 1, &kt, &row, NULL, now, true, false))
		{
			case HOLDER_NONE:
				break;
			case HOLDER_DONE:
				already_completed(key, false);
				break;
			case HOLDER_WRITE:
				if (keytable_delete(&kt, &row, true) != KEYWRITE_OK)
					continue;	/* changed since it was read */
				idem_stats_count(IDEM_STAT_RELEASES);
				released = true;
				break;
		}
		break;
	}
	keytable_close(&kt);

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
	text	   *key = key_arg(fcinfo, 0);
	text	   *scope = scope_arg(fcinfo, 3);
	TimestampTz now = idem_now();
	TimestampTz lease_until = idem_window_end(now, interval_arg(fcinfo, 2),
											  idem_default_lease, "lease");
	KeyTable	kt;
	KeyRow		row;
	KeyValues	kv;
	int			round;

	keytable_open(&kt, "idem_extend()", scope, key, keytable_write_lockmode());
	for (round = 0;; round++)
	{
		TimestampTz until = lease_until;

		if (round == IDEM_MAX_CLAIM_ROUNDS)
			too_many_rounds(key);
		keytable_read_for_write(&kt, &row, NULL);
		if (check_holder(fcinfo, 1, &kt, &row, NULL, now, false, true) == HOLDER_DONE)
			already_completed(key, false);
		row_values(&kv, &row, NULL);
		if (row.has_lease && row.lease_until > until)
			until = row.lease_until;
		kv.has_lease = true;
		kv.lease_until = until;
		kv.expires_at = Max(row.expires_at, until);
		if (keytable_update(&kt, &row, &kv, true) == KEYWRITE_OK)
		{
			lease_until = until;
			break;
		}
	}
	keytable_close(&kt);

	PG_RETURN_TIMESTAMPTZ(lease_until);
}
