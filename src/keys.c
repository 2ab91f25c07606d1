/*-------------------------------------------------------------------------
 *
 * keys.c
 *	  idem_begin, idem_complete, idem_release and idem_extend.
 *
 * A key is a row of idem.keys.  Concurrency is settled by PostgreSQL's row
 * locks: a claim is an INSERT or an UPDATE of the row, so it is held by the
 * claiming transaction until that transaction ends, and another claimer
 * waits for it (or, with wait => false, reports it in flight).  Answers
 * that need no change (replay, conflict, a live lease) come from a plain
 * read without taking a lock.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/itemptr.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/fmgroids.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "idem.h"
#include "stats.h"
#include "store.h"

PG_FUNCTION_INFO_V1(idem_begin);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_extend);

/* Bound on read/lock/insert rounds of one claim; each round makes progress. */
#define IDEM_MAX_CLAIM_ROUNDS	100

#define KEY_COLUMNS \
	"SELECT fingerprint, token, status, body, lease_until, expires_at, xmin, ctid" \
	" FROM idem.keys" \
	" WHERE scope OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2"

/* Columns of idem.keys, as created by sql/idem--1.0.sql. */
#define Anum_keys_fingerprint	3
#define Anum_keys_token			4
#define Anum_keys_status		5
#define Anum_keys_body			6
#define Anum_keys_lease_until	7
#define Anum_keys_expires_at	8

#define NEXT_TOKEN \
	"pg_catalog.nextval('idem.token_seq'::pg_catalog.regclass)"

static IdemPlanDef plan_lock = {
	KEY_COLUMNS " FOR UPDATE", 2, {TEXTOID, TEXTOID}
};

static IdemPlanDef plan_lock_nowait = {
	KEY_COLUMNS " FOR UPDATE SKIP LOCKED", 2, {TEXTOID, TEXTOID}
};

static IdemPlanDef plan_insert = {
	"INSERT INTO idem.keys"
	" (scope, key, fingerprint, token, lease_until, expires_at)"
	" VALUES ($1, $2, $3, " NEXT_TOKEN ", $4, $5)"
	" ON CONFLICT DO NOTHING RETURNING token",
	5, {TEXTOID, TEXTOID, BYTEAOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
};

static IdemPlanDef plan_reclaim = {
	"UPDATE idem.keys SET fingerprint = $2, token = " NEXT_TOKEN ","
	" status = NULL, body = NULL, lease_until = $3, expires_at = $4"
	" WHERE ctid OPERATOR(pg_catalog.=) $1 RETURNING token",
	4, {TIDOID, BYTEAOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
};

#define HOLDER_MATCH \
	" WHERE scope OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2" \
	" AND token OPERATOR(pg_catalog.=) $3 AND status IS NULL"

static IdemPlanDef plan_complete = {
	"UPDATE idem.keys SET status = $5, body = $6, lease_until = NULL,"
	" expires_at = $7" HOLDER_MATCH
	" AND expires_at OPERATOR(pg_catalog.>) $8"
	" AND fingerprint OPERATOR(pg_catalog.=) $4 RETURNING expires_at",
	8, {TEXTOID, TEXTOID, INT8OID, BYTEAOID, INT4OID, BYTEAOID,
		TIMESTAMPTZOID, TIMESTAMPTZOID}
};

static IdemPlanDef plan_release = {
	"DELETE FROM idem.keys" HOLDER_MATCH
	" AND expires_at OPERATOR(pg_catalog.>) $4",
	4, {TEXTOID, TEXTOID, INT8OID, TIMESTAMPTZOID}
};

static IdemPlanDef plan_extend = {
	"UPDATE idem.keys SET lease_until = $4,"
	" expires_at = GREATEST(expires_at, $4)" HOLDER_MATCH
	" AND expires_at OPERATOR(pg_catalog.>) $5 RETURNING lease_until",
	5, {TEXTOID, TEXTOID, INT8OID, TIMESTAMPTZOID, TIMESTAMPTZOID}
};

/* One row of idem.keys as read by the KEY_COLUMNS statements. */
typedef struct KeyRow
{
	bool		found;
	uint8		fingerprint[IDEM_FINGERPRINT_LEN];
	int64		token;
	bool		done;
	int32		status;
	bytea	   *body;			/* NULL if none */
	bool		has_lease;
	TimestampTz lease_until;
	TimestampTz expires_at;
	TransactionId xmin;
	ItemPointerData ctid;
} KeyRow;

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
	text	   *scope;
	text	   *key;
	bytea	   *fingerprint;
	bool		wait;
	TimestampTz now;
	TimestampTz lease_until;
	TimestampTz expires_at;
	MemoryContext result_cxt;	/* where a replayed body is copied */
} ClaimArgs;

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

/*
 * Fill *row from the columns fingerprint .. expires_at.  A body is copied
 * into body_cxt when given, else left pointing at the source.
 */
static void
set_row(KeyRow *row, Datum *values, bool *nulls, MemoryContext body_cxt)
{
	bytea	   *fp = DatumGetByteaPP(values[0]);

	row->found = true;
	if (VARSIZE_ANY_EXHDR(fp) == IDEM_FINGERPRINT_LEN)
		memcpy(row->fingerprint, VARDATA_ANY(fp), IDEM_FINGERPRINT_LEN);
	row->token = DatumGetInt64(values[1]);
	row->done = !nulls[2];
	row->status = nulls[2] ? 0 : DatumGetInt32(values[2]);
	if (nulls[3])
		row->body = NULL;
	else if (body_cxt != NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(body_cxt);

		row->body = DatumGetByteaPCopy(values[3]);
		MemoryContextSwitchTo(old);
	}
	else
		row->body = DatumGetByteaPP(values[3]);
	row->has_lease = !nulls[4];
	row->lease_until = nulls[4] ? 0 : DatumGetTimestampTz(values[4]);
	row->expires_at = DatumGetTimestampTz(values[5]);
}

/* Read the first row a KEY_COLUMNS statement returned into *row. */
static void
fetch_row(uint64 nrows, KeyRow *row, MemoryContext body_cxt)
{
	HeapTuple	tuple;
	TupleDesc	desc;
	Datum		values[8];
	bool		nulls[8];

	memset(row, 0, sizeof(KeyRow));
	if (nrows == 0)
		return;

	tuple = SPI_tuptable->vals[0];
	desc = SPI_tuptable->tupdesc;
	heap_deform_tuple(tuple, desc, values, nulls);
	set_row(row, values, nulls, body_cxt);
	row->xmin = DatumGetTransactionId(values[6]);
	row->ctid = *(ItemPointer) DatumGetPointer(values[7]);
}

/* Read the key's row locked (FOR UPDATE, waiting or skipping) into *row. */
static void
read_key(IdemPlanDef *def, text *scope, text *key, KeyRow *row,
		 MemoryContext body_cxt)
{
	Datum		values[2];

	values[0] = PointerGetDatum(scope);
	values[1] = PointerGetDatum(key);
	fetch_row(idem_spi_run(def, values, NULL), row, body_cxt);
}

/* An index scan of idem.keys' primary key for one (scope, key). */
typedef struct KeyScan
{
	Relation	rel;
	Relation	idx;
	IndexScanDesc scan;
	TupleTableSlot *slot;
} KeyScan;

static void
key_scan_begin(KeyScan *ks, text *scope, text *key, Snapshot snapshot)
{
	ScanKeyData skey[2];

	ks->rel = table_open(idem_keys_relid(), AccessShareLock);
	ks->idx = index_open(idem_primary_key_index(ks->rel), AccessShareLock);
	ScanKeyEntryInitialize(&skey[0], 0, 1, BTEqualStrategyNumber, InvalidOid,
						   ks->idx->rd_indcollation[0], F_TEXTEQ,
						   PointerGetDatum(scope));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   ks->idx->rd_indcollation[1], F_TEXTEQ,
						   PointerGetDatum(key));
	ks->scan = idem_index_beginscan(ks->rel, ks->idx, snapshot, 2, 0);
	index_rescan(ks->scan, skey, 2, NULL, 0);
	ks->slot = table_slot_create(ks->rel, NULL);
}

static void
key_scan_end(KeyScan *ks)
{
	index_endscan(ks->scan);
	ExecDropSingleTupleTableSlot(ks->slot);
	index_close(ks->idx, AccessShareLock);
	table_close(ks->rel, AccessShareLock);
}

/*
 * Read the key's row as a plain SELECT would, without locking it: straight
 * from the primary key with the statement's snapshot (a new one per call
 * in READ COMMITTED, the transaction's in REPEATABLE READ and SERIALIZABLE,
 * with SSI predicate locks as usual).  The body is copied into body_cxt.
 */
static void
read_key_unlocked(text *scope, text *key, KeyRow *row, MemoryContext body_cxt)
{
	KeyScan		ks;

	memset(row, 0, sizeof(KeyRow));

	/* See this transaction's own earlier writes, as SPI would. */
	CommandCounterIncrement();
	key_scan_begin(&ks, scope, key, GetTransactionSnapshot());
	if (index_getnext_slot(ks.scan, ForwardScanDirection, ks.slot))
	{
		bool		should_free;
		HeapTuple	tuple = ExecFetchSlotHeapTuple(ks.slot, false, &should_free);

		slot_getallattrs(ks.slot);
		set_row(row, &ks.slot->tts_values[Anum_keys_fingerprint - 1],
				&ks.slot->tts_isnull[Anum_keys_fingerprint - 1], body_cxt);
		row->xmin = HeapTupleHeaderGetXmin(tuple->t_data);
		row->ctid = tuple->t_self;
		if (should_free)
			heap_freetuple(tuple);
	}
	key_scan_end(&ks);
}

static bool
same_fingerprint(KeyRow *row, bytea *fingerprint)
{
	return memcmp(row->fingerprint, VARDATA(fingerprint),
				  IDEM_FINGERPRINT_LEN) == 0;
}

/*
 * True if another transaction is inserting or deleting the key right now.
 * A dirty-snapshot probe of the primary key, as execReplication.c does, so
 * that wait => false never waits on an uncommitted insert.
 */
static bool
key_write_in_progress(text *scope, text *key)
{
	SnapshotData snap;
	KeyScan		ks;
	bool		busy = false;

	InitDirtySnapshot(snap);
	key_scan_begin(&ks, scope, key, &snap);
	while (index_getnext_slot(ks.scan, ForwardScanDirection, ks.slot))
	{
		if (TransactionIdIsValid(snap.xmin) || TransactionIdIsValid(snap.xmax))
		{
			busy = true;
			break;
		}
	}
	key_scan_end(&ks);
	return busy;
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
}

/* Give the locked row at ctid a new claim; returns the new token. */
static int64
reclaim_row(ItemPointer ctid, bytea *fingerprint, TimestampTz lease_until,
			TimestampTz expires_at)
{
	Datum		values[4];
	bool		isnull;

	values[0] = PointerGetDatum(ctid);
	values[1] = PointerGetDatum(fingerprint);
	values[2] = TimestampTzGetDatum(lease_until);
	values[3] = TimestampTzGetDatum(expires_at);
	if (idem_spi_run(&plan_reclaim, values, NULL) != 1)
		elog(ERROR, "locked idem key row vanished");
	return DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
									   SPI_tuptable->tupdesc, 1, &isnull));
}

/*
 * Answer a claim from an existing row.  Returns false if the answer needs
 * the row locked and it is not (locked == false).
 */
static bool
decide(ClaimArgs *args, KeyRow *row, bool locked, ClaimResult *res)
{
	if (row->expires_at <= args->now)
	{
		/* The window is over: the key is new again. */
		if (!locked)
			return false;
		set_claimed(res, reclaim_row(&row->ctid, args->fingerprint,
									 args->lease_until, args->expires_at),
					args->lease_until, args->expires_at);
		idem_stats_count(IDEM_STAT_CLAIMS);
		return true;
	}

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

	if (TransactionIdIsCurrentTransactionId(row->xmin))
	{
		/* This transaction holds the claim already. */
		set_claimed(res, row->token, row->lease_until, row->expires_at);
		return true;
	}

	if (row->has_lease && args->now < row->lease_until)
	{
		res->state = CLAIM_PROCESSING;
		res->has_lease = true;
		res->lease_until = row->lease_until;
		res->has_expiry = true;
		res->expires_at = row->expires_at;
		idem_stats_count(IDEM_STAT_IN_FLIGHT);
		return true;
	}

	/* The holder's lease is over: take the key over with a new token. */
	if (!locked)
		return false;
	{
		TimestampTz expires_at = Max(row->expires_at, args->lease_until);

		set_claimed(res, reclaim_row(&row->ctid, args->fingerprint,
									 args->lease_until, expires_at),
					args->lease_until, expires_at);
	}
	idem_stats_count(IDEM_STAT_TAKEOVERS);
	return true;
}

/* Report the key in flight without knowing its lease. */
static void
set_in_flight(ClaimResult *res)
{
	res->state = CLAIM_PROCESSING;
	idem_stats_count(IDEM_STAT_IN_FLIGHT);
}

/* Claim a key, or find out why not; see the file header. */
static void
claim_key(ClaimArgs *args, ClaimResult *res)
{
	KeyRow		row;
	int			round;

	for (round = 0; round < IDEM_MAX_CLAIM_ROUNDS; round++)
	{
		read_key_unlocked(args->scope, args->key, &row, args->result_cxt);
		if (row.found)
		{
			if (decide(args, &row, false, res))
				return;
		}
		else
		{
			Datum		values[5];
			bool		isnull;

			if (!args->wait && key_write_in_progress(args->scope, args->key))
			{
				set_in_flight(res);
				return;
			}
			values[0] = PointerGetDatum(args->scope);
			values[1] = PointerGetDatum(args->key);
			values[2] = PointerGetDatum(args->fingerprint);
			values[3] = TimestampTzGetDatum(args->lease_until);
			values[4] = TimestampTzGetDatum(args->expires_at);
			if (idem_spi_run(&plan_insert, values, NULL) == 1)
			{
				set_claimed(res,
							DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
														SPI_tuptable->tupdesc,
														1, &isnull)),
							args->lease_until, args->expires_at);
				idem_stats_count(IDEM_STAT_CLAIMS);
				return;
			}
			/* Another transaction inserted the key and committed: re-read. */
			continue;
		}

		read_key(args->wait ? &plan_lock : &plan_lock_nowait,
				 args->scope, args->key, &row, args->result_cxt);
		if (row.found)
		{
			decide(args, &row, true, res);
			return;
		}
		if (!args->wait)
		{
			/* Locked by another transaction. */
			set_in_flight(res);
			return;
		}
		/* Deleted while we waited for it (purge or release): start over. */
	}

	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not settle the claim of key \"%s\"",
					text_to_cstring(args->key)),
			 errdetail("The key changed under %d consecutive attempts.",
					   IDEM_MAX_CLAIM_ROUNDS),
			 errhint("Retry the transaction.")));
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
	ClaimArgs	args;
	ClaimResult res;
	IdemSpi		spi;
	Datum		values[7];
	bool		nulls[7];

	args.key = key_arg(fcinfo, 0);
	args.fingerprint = fingerprint_digest(idem_arg_text(fcinfo, 1, "fingerprint"));
	args.scope = scope_arg(fcinfo, 4);
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
	idem_spi_begin(&spi);
	claim_key(&args, &res);
	idem_spi_end(&spi);

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

/*
 * Raise the error that says why a write by the holder of token (if
 * has_token) was refused, given the key's locked row.
 */
static void
refuse_write(KeyRow *row, text *key, bytea *fingerprint, bool has_token,
			 int64 token, TimestampTz now)
{
	char	   *keystr = text_to_cstring(key);

	if (!row->found || row->expires_at <= now)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no live claim", keystr),
				 errdetail("The key does not exist or its retention window is over."),
				 errhint("Claim it again with idem_begin.")));
	if (fingerprint != NULL && !same_fingerprint(row, fingerprint))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_FINGERPRINT_CONFLICT),
				 errmsg("idempotency key \"%s\" was claimed with a different fingerprint",
						keystr)));
	if (!has_token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" is not claimed by this transaction",
						keystr),
				 errhint("Pass the token idem_begin returned.")));
	if (row->token != token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_TOKEN_SUPERSEDED),
				 errmsg("idempotency key \"%s\" is held by a newer claim", keystr),
				 errdetail("Token %lld was superseded after its lease ran out.",
						   (long long) token)));
	if (row->done)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_ALREADY_COMPLETED),
				 errmsg("idempotency key \"%s\" is already completed", keystr)));
	elog(ERROR, "idempotency key \"%s\" refused a write in an unexpected state",
		 keystr);
}

/*
 * Resolve the token argument: given, or the claim this transaction holds.
 * Reads the key's row locked into *row when the token is not given.
 */
static int64
holder_token(FunctionCallInfo fcinfo, int argno, text *scope, text *key,
			 bytea *fingerprint, TimestampTz now, KeyRow *row)
{
	if (!PG_ARGISNULL(argno))
		return PG_GETARG_INT64(argno);

	read_key(&plan_lock, scope, key, row, NULL);
	if (row->found && row->expires_at > now &&
		TransactionIdIsCurrentTransactionId(row->xmin) &&
		(fingerprint == NULL || same_fingerprint(row, fingerprint)))
		return row->token;
	refuse_write(row, key, fingerprint, false, 0, now);
	pg_unreachable();
}

/*
 * idem_complete(key, fingerprint, status, body, token, retention, scope):
 * store the response of a claim.  Returns the new expires_at.
 */
Datum
idem_complete(PG_FUNCTION_ARGS)
{
	text	   *key = key_arg(fcinfo, 0);
	bytea	   *fingerprint = fingerprint_digest(idem_arg_text(fcinfo, 1, "fingerprint"));
	bytea	   *body = PG_ARGISNULL(3) ? NULL : PG_GETARG_BYTEA_PP(3);
	text	   *scope = scope_arg(fcinfo, 6);
	int32		status;
	int64		token;
	TimestampTz now;
	TimestampTz expires_at;
	TimestampTz result = 0;
	IdemSpi		spi;
	KeyRow		row;
	Datum		values[8];
	char		nulls[8];
	bool		isnull;

	memset(nulls, ' ', sizeof(nulls));
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("status must not be null")));
	status = PG_GETARG_INT32(2);
	if (body != NULL && VARSIZE_ANY_EXHDR(body) > (Size) idem_max_body_size)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("body is too large"),
				 errdetail("It is %zu bytes; idem.max_body_size is %d.",
						   (size_t) VARSIZE_ANY_EXHDR(body), idem_max_body_size)));
	now = idem_now();
	expires_at = idem_window_end(now, interval_arg(fcinfo, 5),
								 idem_default_retention, "retention");

	idem_spi_begin(&spi);
	token = holder_token(fcinfo, 4, scope, key, fingerprint, now, &row);

	values[0] = PointerGetDatum(scope);
	values[1] = PointerGetDatum(key);
	values[2] = Int64GetDatum(token);
	values[3] = PointerGetDatum(fingerprint);
	values[4] = Int32GetDatum(status);
	values[5] = PointerGetDatum(body);
	if (body == NULL)
		nulls[5] = 'n';
	values[6] = TimestampTzGetDatum(expires_at);
	values[7] = TimestampTzGetDatum(now);
	if (idem_spi_run(&plan_complete, values, nulls) == 1)
	{
		result = DatumGetTimestampTz(SPI_getbinval(SPI_tuptable->vals[0],
												   SPI_tuptable->tupdesc,
												   1, &isnull));
		idem_stats_count(IDEM_STAT_COMPLETES);
	}
	else
	{
		/* Refused; a repeat of the stored response is accepted as is. */
		read_key(&plan_lock, scope, key, &row, NULL);
		if (row.found && row.expires_at > now && row.done &&
			row.token == token && same_fingerprint(&row, fingerprint) &&
			row.status == status &&
			((body == NULL && row.body == NULL) ||
			 (body != NULL && row.body != NULL &&
			  VARSIZE_ANY_EXHDR(body) == VARSIZE_ANY_EXHDR(row.body) &&
			  memcmp(VARDATA_ANY(body), VARDATA_ANY(row.body),
					 VARSIZE_ANY_EXHDR(body)) == 0)))
			result = row.expires_at;
		else
		{
			if (row.found && row.token != token)
				idem_stats_count(IDEM_STAT_SUPERSEDED);
			if (row.found && row.done && row.token == token &&
				row.expires_at > now && same_fingerprint(&row, fingerprint))
				ereport(ERROR,
						(errcode(ERRCODE_IDEM_ALREADY_COMPLETED),
						 errmsg("idempotency key \"%s\" is already completed with a different response",
								text_to_cstring(key))));
			refuse_write(&row, key, fingerprint, true, token, now);
		}
	}
	idem_spi_end(&spi);

	PG_RETURN_TIMESTAMPTZ(result);
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
	IdemSpi		spi;
	KeyRow		row;
	int64		token;
	Datum		values[4];
	bool		released;

	idem_spi_begin(&spi);
	if (PG_ARGISNULL(1))
	{
		read_key(&plan_lock, scope, key, &row, NULL);
		if (!row.found || row.expires_at <= now)
		{
			idem_spi_end(&spi);
			PG_RETURN_BOOL(false);
		}
	}
	token = holder_token(fcinfo, 1, scope, key, NULL, now, &row);

	values[0] = PointerGetDatum(scope);
	values[1] = PointerGetDatum(key);
	values[2] = Int64GetDatum(token);
	values[3] = TimestampTzGetDatum(now);
	released = idem_spi_run(&plan_release, values, NULL) == 1;
	if (released)
		idem_stats_count(IDEM_STAT_RELEASES);
	else
	{
		read_key(&plan_lock, scope, key, &row, NULL);
		if (row.found && row.expires_at > now)
		{
			if (row.token != token)
				idem_stats_count(IDEM_STAT_SUPERSEDED);
			refuse_write(&row, key, NULL, true, token, now);
		}
	}
	idem_spi_end(&spi);

	PG_RETURN_BOOL(released);
}

/*
 * idem_extend(key, token, lease, scope): move the lease of a live claim to
 * now + lease.  Returns the new lease_until.
 */
Datum
idem_extend(PG_FUNCTION_ARGS)
{
	text	   *key = key_arg(fcinfo, 0);
	text	   *scope = scope_arg(fcinfo, 3);
	TimestampTz now = idem_now();
	TimestampTz lease_until = idem_window_end(now, interval_arg(fcinfo, 2),
											  idem_default_lease, "lease");
	IdemSpi		spi;
	KeyRow		row;
	int64		token;
	Datum		values[5];

	idem_spi_begin(&spi);
	token = holder_token(fcinfo, 1, scope, key, NULL, now, &row);

	values[0] = PointerGetDatum(scope);
	values[1] = PointerGetDatum(key);
	values[2] = Int64GetDatum(token);
	values[3] = TimestampTzGetDatum(lease_until);
	values[4] = TimestampTzGetDatum(now);
	if (idem_spi_run(&plan_extend, values, NULL) != 1)
	{
		read_key(&plan_lock, scope, key, &row, NULL);
		if (row.found && row.token != token)
			idem_stats_count(IDEM_STAT_SUPERSEDED);
		refuse_write(&row, key, NULL, true, token, now);
	}
	idem_spi_end(&spi);

	PG_RETURN_TIMESTAMPTZ(lease_until);
}
