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
 * Reads, row locks, updates and deletes go straight to the heap and the
 * primary key, as execReplication.c does for logical replication: a key
 * is found through its primary key with the statement's snapshot, locked
 * as SELECT ... FOR UPDATE locks it (the latest version in READ COMMITTED,
 * a serialization failure in REPEATABLE READ and SERIALIZABLE), and
 * changed by heap_update, which keeps storing a response a HOT update.
 * This needs no executor start-up per call and no plan, so no plan made
 * while the table was empty can turn a key lookup into a sequential scan.
 * Only the INSERT of a new key goes through SPI, for ON CONFLICT's
 * speculative insertion.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/pg_type.h"
#include "commands/sequence.h"
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

static IdemPlanDef plan_insert = {
	"INSERT INTO idem.keys"
	" (scope, key, fingerprint, token, lease_until, expires_at)"
	" VALUES ($1, $2, $3,"
	" pg_catalog.nextval('idem.token_seq'::pg_catalog.regclass), $4, $5)"
	" ON CONFLICT DO NOTHING RETURNING token",
	5, {TEXTOID, TEXTOID, BYTEAOID, TIMESTAMPTZOID, TIMESTAMPTZOID}
};

/* One row of idem.keys as read, with the identity of its version. */
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
 * Fill *row from a slot holding a version of the key's row.  A body is
 * copied into body_cxt when given, else left pointing into the slot.
 */
static void
set_row(KeyRow *row, TupleTableSlot *slot, MemoryContext body_cxt)
{
	bool		should_free;
	HeapTuple	tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
	Datum	   *values;
	bool	   *nulls;
	bytea	   *fp;

	slot_getallattrs(slot);
	values = slot->tts_values;
	nulls = slot->tts_isnull;

	row->found = true;
	fp = DatumGetByteaPP(values[Anum_keys_fingerprint - 1]);
	if (VARSIZE_ANY_EXHDR(fp) == IDEM_FINGERPRINT_LEN)
		memcpy(row->fingerprint, VARDATA_ANY(fp), IDEM_FINGERPRINT_LEN);
	row->token = DatumGetInt64(values[Anum_keys_token - 1]);
	row->done = !nulls[Anum_keys_status - 1];
	row->status = row->done ? DatumGetInt32(values[Anum_keys_status - 1]) : 0;
	if (nulls[Anum_keys_body - 1])
		row->body = NULL;
	else if (body_cxt != NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(body_cxt);

		row->body = DatumGetByteaPCopy(values[Anum_keys_body - 1]);
		MemoryContextSwitchTo(old);
	}
	else
		row->body = DatumGetByteaPP(values[Anum_keys_body - 1]);
	row->has_lease = !nulls[Anum_keys_lease_until - 1];
	row->lease_until = row->has_lease ?
		DatumGetTimestampTz(values[Anum_keys_lease_until - 1]) : 0;
	row->expires_at = DatumGetTimestampTz(values[Anum_keys_expires_at - 1]);
	row->xmin = HeapTupleHeaderGetXmin(tuple->t_data);
	row->ctid = tuple->t_self;
	if (should_free)
		heap_freetuple(tuple);
}

/* An index scan of idem.keys' primary key for one (scope, key). */
typedef struct KeyScan
{
	LOCKMODE	lockmode;
	Relation	rel;
	Relation	idx;
	IndexScanDesc scan;
	TupleTableSlot *slot;
} KeyScan;

static void
key_scan_begin(KeyScan *ks, text *scope, text *key, Snapshot snapshot,
			   LOCKMODE lockmode)
{
	ScanKeyData skey[2];

	ks->lockmode = lockmode;
	ks->rel = table_open(idem_keys_relid(), lockmode);
	ks->idx = index_open(idem_primary_key_index(ks->rel), lockmode);
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
	index_close(ks->idx, ks->lockmode);
	table_close(ks->rel, ks->lockmode);
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
	key_scan_begin(&ks, scope, key, GetTransactionSnapshot(), AccessShareLock);
	if (index_getnext_slot(ks.scan, ForwardScanDirection, ks.slot))
		set_row(row, ks.slot, body_cxt);
	key_scan_end(&ks);
}

typedef enum LockResult
{
	LOCK_NONE,					/* no live row */
	LOCK_OK,					/* locked; *row is the locked version */
	LOCK_BUSY					/* skip: locked by another transaction */
} LockResult;

/*
 * Lock the key's row as SELECT ... FOR UPDATE [SKIP LOCKED] would, and read
 * the locked version into *row.  Waits respect lock_timeout and take part
 * in deadlock detection.  The slot (and the locked version's buffer) is
 * kept in *ks for a following update_row or delete_row; the caller ends
 * the scan.
 */
static LockResult
lock_key(KeyScan *ks, text *scope, text *key, bool skip, KeyRow *row,
		 MemoryContext body_cxt)
{
	Snapshot	snapshot;
	ItemPointerData tid;
	TM_FailureData tmfd;
	TM_Result	result;

	memset(row, 0, sizeof(KeyRow));
	CommandCounterIncrement();
	snapshot = GetTransactionSnapshot();
	key_scan_begin(ks, scope, key, snapshot, RowExclusiveLock);
	if (!index_getnext_slot(ks->scan, ForwardScanDirection, ks->slot))
		return LOCK_NONE;

	tid = ks->slot->tts_tid;
	ExecClearTuple(ks->slot);
	result = table_tuple_lock(ks->rel, &tid, snapshot, ks->slot,
							  GetCurrentCommandId(true), LockTupleExclusive,
							  skip ? LockWaitSkip : LockWaitBlock,
							  IsolationUsesXactSnapshot() ? 0 :
							  TUPLE_LOCK_FLAG_FIND_LAST_VERSION,
							  &tmfd);
	switch (result)
	{
		case TM_Ok:
			set_row(row, ks->slot, body_cxt);
			return LOCK_OK;
		case TM_WouldBlock:
			return LOCK_BUSY;
		case TM_Updated:
			if (IsolationUsesXactSnapshot())
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 errmsg("could not serialize access due to concurrent update")));
			break;
		case TM_Deleted:
			if (IsolationUsesXactSnapshot())
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 errmsg("could not serialize access due to concurrent delete")));
			return LOCK_NONE;
		default:
			break;
	}
	elog(ERROR, "unexpected table_tuple_lock status: %u", result);
	pg_unreachable();
}

/*
 * Replace the version of the key's row locked by lock_key with values:
 * the row's columns, with the changes the caller made.
 */
static void
update_row(KeyScan *ks, Datum *values, bool *nulls)
{
	HeapTuple	tuple = heap_form_tuple(RelationGetDescr(ks->rel), values, nulls);
	ItemPointerData otid = ks->slot->tts_tid;
	bool		index_new_version;

#if PG_VERSION_NUM >= 160000
	TU_UpdateIndexes update_indexes;

	simple_heap_update(ks->rel, &otid, tuple, &update_indexes);
	index_new_version = (update_indexes != TU_None);
#else
	simple_heap_update(ks->rel, &otid, tuple);
	index_new_version = !HeapTupleIsHeapOnly(tuple);
#endif

	/* Not a HOT update: the primary key needs an entry for the new version. */
	if (index_new_version)
		index_insert(ks->idx, &values[Anum_keys_scope - 1],
					 &nulls[Anum_keys_scope - 1], &tuple->t_self, ks->rel,
					 UNIQUE_CHECK_YES, true, BuildIndexInfo(ks->idx));
	heap_freetuple(tuple);
}

/* The locked row's columns, to change and pass to update_row. */
static void
row_values(KeyScan *ks, Datum *values, bool *nulls)
{
	slot_getallattrs(ks->slot);
	memcpy(values, ks->slot->tts_values, sizeof(Datum) * Natts_keys);
	memcpy(nulls, ks->slot->tts_isnull, sizeof(bool) * Natts_keys);
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
	key_scan_begin(&ks, scope, key, &snap, AccessShareLock);
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

/* Give the locked row a new claim; returns the new token. */
static int64
reclaim_row(KeyScan *ks, bytea *fingerprint, TimestampTz lease_until,
			TimestampTz expires_at)
{
	Datum		values[Natts_keys];
	bool		nulls[Natts_keys];
	int64		token = nextval_internal(idem_token_seq_relid(), false);

	row_values(ks, values, nulls);
	values[Anum_keys_fingerprint - 1] = PointerGetDatum(fingerprint);
	values[Anum_keys_token - 1] = Int64GetDatum(token);
	nulls[Anum_keys_status - 1] = true;
	nulls[Anum_keys_body - 1] = true;
	values[Anum_keys_lease_until - 1] = TimestampTzGetDatum(lease_until);
	nulls[Anum_keys_lease_until - 1] = false;
	values[Anum_keys_expires_at - 1] = TimestampTzGetDatum(expires_at);
	update_row(ks, values, nulls);
	return token;
}

/*
 * Answer a claim from an existing row.  ks holds the row locked, or is
 * NULL for an unlocked read; returns false if the answer needs the lock.
 */
static bool
decide(ClaimArgs *args, KeyRow *row, KeyScan *ks, ClaimResult *res)
{
	if (row->expires_at <= args->now)
	{
		/* The window is over: the key is new again. */
		if (ks == NULL)
			return false;
		set_claimed(res, reclaim_row(ks, args->fingerprint,
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
	if (ks == NULL)
		return false;
	{
		TimestampTz expires_at = Max(row->expires_at, args->lease_until);

		set_claimed(res, reclaim_row(ks, args->fingerprint,
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

/*
 * Insert the key as a new claim; returns false if another transaction
 * inserted it first and committed.  The only statement run through SPI.
 */
static bool
insert_key(ClaimArgs *args, int64 *token)
{
	IdemSpi		spi;
	Datum		values[5];
	bool		isnull;
	bool		inserted;

	values[0] = PointerGetDatum(args->scope);
	values[1] = PointerGetDatum(args->key);
	values[2] = PointerGetDatum(args->fingerprint);
	values[3] = TimestampTzGetDatum(args->lease_until);
	values[4] = TimestampTzGetDatum(args->expires_at);
	idem_spi_begin(&spi);
	inserted = (idem_spi_run(&plan_insert, values, NULL) == 1);
	if (inserted)
		*token = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
											 SPI_tuptable->tupdesc, 1, &isnull));
	idem_spi_end(&spi);
	return inserted;
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
			if (decide(args, &row, NULL, res))
				return;
		}
		else
		{
			int64		token;

			if (!args->wait && key_write_in_progress(args->scope, args->key))
			{
				set_in_flight(res);
				return;
			}
			if (insert_key(args, &token))
			{
				set_claimed(res, token, args->lease_until, args->expires_at);
				idem_stats_count(IDEM_STAT_CLAIMS);
				return;
			}
			/* Another transaction inserted the key and committed: re-read. */
			continue;
		}

		{
			KeyScan		ks;
			LockResult	locked = lock_key(&ks, args->scope, args->key,
										  !args->wait, &row, args->result_cxt);

			if (locked == LOCK_OK)
				decide(args, &row, &ks, res);
			else if (locked == LOCK_BUSY)
				set_in_flight(res);
			key_scan_end(&ks);
			if (locked != LOCK_NONE)
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
	claim_key(&args, &res);

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
 * Check that the holder of token may write the key's locked row; has_token
 * is false when no token was given and this transaction does not hold the
 * claim.  Raises the error that explains a refusal.  Returns false for a
 * completed row of the same holder, which the caller accepts or refuses.
 */
static bool
holder_may_write(KeyRow *row, text *key, bytea *fingerprint, bool has_token,
				 int64 token, TimestampTz now)
{
	if (!row->found || row->expires_at <= now)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" has no live claim",
						text_to_cstring(key)),
				 errdetail("The key does not exist or its retention window is over."),
				 errhint("Claim it again with idem_begin.")));
	if (fingerprint != NULL && !same_fingerprint(row, fingerprint))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_FINGERPRINT_CONFLICT),
				 errmsg("idempotency key \"%s\" was claimed with a different fingerprint",
						text_to_cstring(key))));
	if (!has_token)
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_NO_CLAIM),
				 errmsg("idempotency key \"%s\" is not claimed by this transaction",
						text_to_cstring(key)),
				 errhint("Pass the token idem_begin returned.")));
	if (row->token != token)
	{
		idem_stats_count(IDEM_STAT_SUPERSEDED);
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_TOKEN_SUPERSEDED),
				 errmsg("idempotency key \"%s\" is held by a newer claim",
						text_to_cstring(key)),
				 errdetail("Token %lld was superseded after its lease ran out.",
						   (long long) token)));
	}
	return !row->done;
}

/*
 * Lock the key's row for a write by the holder of the token argument at
 * argno; a NULL token stands for the claim this transaction holds.  Sets
 * *has_token and *token for holder_may_write.
 */
static void
lock_for_holder(FunctionCallInfo fcinfo, int argno, KeyScan *ks, text *scope,
				text *key, KeyRow *row, bool *has_token, int64 *token)
{
	lock_key(ks, scope, key, false, row, NULL);
	*has_token = !PG_ARGISNULL(argno);
	*token = *has_token ? PG_GETARG_INT64(argno) : 0;
	if (!*has_token && row->found &&
		TransactionIdIsCurrentTransactionId(row->xmin))
	{
		*has_token = true;
		*token = row->token;
	}
}

static void
already_completed(text *key, const char *how)
{
	ereport(ERROR,
			(errcode(ERRCODE_IDEM_ALREADY_COMPLETED),
			 errmsg("idempotency key \"%s\" is already completed%s",
					text_to_cstring(key), how)));
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
	bool		has_token;
	int64		token;
	TimestampTz now;
	TimestampTz expires_at;
	KeyScan		ks;
	KeyRow		row;

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

	lock_for_holder(fcinfo, 4, &ks, scope, key, &row, &has_token, &token);
	if (holder_may_write(&row, key, fingerprint, has_token, token, now))
	{
		Datum		values[Natts_keys];
		bool		nulls[Natts_keys];

		row_values(&ks, values, nulls);
		values[Anum_keys_status - 1] = Int32GetDatum(status);
		nulls[Anum_keys_status - 1] = false;
		values[Anum_keys_body - 1] = PointerGetDatum(body);
		nulls[Anum_keys_body - 1] = (body == NULL);
		nulls[Anum_keys_lease_until - 1] = true;
		values[Anum_keys_expires_at - 1] = TimestampTzGetDatum(expires_at);
		update_row(&ks, values, nulls);
		idem_stats_count(IDEM_STAT_COMPLETES);
	}
	else if (row.status == status &&
			 ((body == NULL && row.body == NULL) ||
			  (body != NULL && row.body != NULL &&
			   VARSIZE_ANY_EXHDR(body) == VARSIZE_ANY_EXHDR(row.body) &&
			   memcmp(VARDATA_ANY(body), VARDATA_ANY(row.body),
					  VARSIZE_ANY_EXHDR(body)) == 0)))
	{
		/* A repeat of the stored response: accepted as is. */
		expires_at = row.expires_at;
	}
	else
		already_completed(key, " with a different response");
	key_scan_end(&ks);

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
	bool		has_token;
	int64		token;
	KeyScan		ks;
	KeyRow		row;
	bool		released = false;

	lock_for_holder(fcinfo, 1, &ks, scope, key, &row, &has_token, &token);
	if (row.found && row.expires_at > now)
	{
		ItemPointerData tid = ks.slot->tts_tid;

		if (!holder_may_write(&row, key, NULL, has_token, token, now))
			already_completed(key, "");
		simple_heap_delete(ks.rel, &tid);
		idem_stats_count(IDEM_STAT_RELEASES);
		released = true;
	}
	key_scan_end(&ks);

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
	bool		has_token;
	int64		token;
	KeyScan		ks;
	KeyRow		row;
	Datum		values[Natts_keys];
	bool		nulls[Natts_keys];

	lock_for_holder(fcinfo, 1, &ks, scope, key, &row, &has_token, &token);
	if (!holder_may_write(&row, key, NULL, has_token, token, now))
		already_completed(key, "");
	row_values(&ks, values, nulls);
	values[Anum_keys_lease_until - 1] = TimestampTzGetDatum(lease_until);
	nulls[Anum_keys_lease_until - 1] = false;
	values[Anum_keys_expires_at - 1] =
		TimestampTzGetDatum(Max(row.expires_at, lease_until));
	update_row(&ks, values, nulls);
	key_scan_end(&ks);

	PG_RETURN_TIMESTAMPTZ(lease_until);
}
