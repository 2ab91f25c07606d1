/*-------------------------------------------------------------------------
 *
 * keyrows.c
 *	  The rows of idem.keys: every read, insert, update and delete of a
 *	  key, directly in the heap and its indexes, and the purge scan.
 *
 * The relation is opened, locked and checked by keyrel.c.  What the
 * executor does for each row is done here:
 *
 * - Look before you write.  A key is read (idem_keytable_read with the
 *	 statement's snapshot, or idem_keytable_look with a dirty snapshot that also
 *	 tells who is changing it) before anything is written; callers write
 *	 only when that look says the write can succeed, so an answer that
 *	 writes nothing takes no transaction ID, token or WAL.
 * - A new key is inserted with speculative insertion, as INSERT ... ON
 *	 CONFLICT does: the heap tuple carries a speculative token, the index
 *	 entries are added with UNIQUE_CHECK_PARTIAL, and if another
 *	 transaction inserted the key meanwhile the insertion is undone without
 *	 waiting for it.  Whether and how long to wait is the caller's choice
 *	 (see keys.c).
 * - An update or delete writes exactly the version read, as UPDATE and
 *	 DELETE do, checks replica identity first (CheckCmdReplicaIdentity),
 *	 and adds index entries to every maintained index when it is not HOT.
 * - Tuples are formed from the relation's descriptor; an update keeps the
 *	 stored key and scope datums, so that a toasted key does not make it
 *	 non-HOT; index entries are formed from each index's own columns.
 * - Snapshots are registered while in use.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/multixact.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/index.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "storage/predicate.h"
#include "storage/procarray.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

#include "args.h"
#include "citus.h"
#include "keyrel.h"
#include "expiry.h"
#include "waits.h"

/* Error context of a wait for another transaction. */
static void
wait_context(void *arg)
{
	KeyTable   *kt = (KeyTable *) arg;

	errcontext("waiting for the transaction that holds idempotency key \"%s\"",
			   idem_key_for_message(kt->key));
}

/* Name the key in the context of errors raised while waiting for it. */
static void
push_wait_context(KeyTable *kt, ErrorContextCallback *errcb)
{
	errcb->callback = wait_context;
	errcb->arg = kt;
	errcb->previous = error_context_stack;
	error_context_stack = errcb;
}

/*
 * Fill *row from the version in the slot.  The body is copied into
 * body_cxt, or left out if body_cxt is NULL.
 */
static void
set_row(KeyRow *row, TupleTableSlot *slot, MemoryContext body_cxt)
{
	Datum	   *values;
	bool	   *nulls;
	bytea	   *fp;

	slot_getallattrs(slot);
	values = slot->tts_values;
	nulls = slot->tts_isnull;

	memset(row, 0, sizeof(KeyRow));
	row->found = true;
	fp = DatumGetByteaPP(values[Anum_keys_fingerprint - 1]);
	if (VARSIZE_ANY_EXHDR(fp) == IDEM_FINGERPRINT_LEN)
		memcpy(row->fingerprint, VARDATA_ANY(fp), IDEM_FINGERPRINT_LEN);
	row->token = DatumGetInt64(values[Anum_keys_token - 1]);
	row->done = !nulls[Anum_keys_status - 1];
	row->status = row->done ? DatumGetInt32(values[Anum_keys_status - 1]) : 0;
	row->body_size = -1;
	if (!nulls[Anum_keys_body - 1])
	{
		row->body_size = (int32) (toast_raw_datum_size(values[Anum_keys_body - 1]) -
								  VARHDRSZ);
		if (body_cxt != NULL)
		{
			MemoryContext old = MemoryContextSwitchTo(body_cxt);

			row->body = DatumGetByteaPCopy(values[Anum_keys_body - 1]);
			MemoryContextSwitchTo(old);
		}
	}
	row->has_lease = !nulls[Anum_keys_lease_until - 1];
	row->lease_until = row->has_lease ?
		DatumGetTimestampTz(values[Anum_keys_lease_until - 1]) : 0;
	row->expires_at = DatumGetTimestampTz(values[Anum_keys_expires_at - 1]);
	if (slot->tts_tupleDescriptor->natts >= Anum_keys_claimed_by &&
		!nulls[Anum_keys_claimed_by - 1])
	{
		Datum		claimant = values[Anum_keys_claimed_by - 1];

		row->claimed_by.bound = true;
		if (TupleDescAttr(slot->tts_tupleDescriptor,
						  Anum_keys_claimed_by - 1)->atttypid == TEXTOID)
			text_to_cstring_buffer(DatumGetTextPP(claimant),
								   NameStr(row->claimed_by.rolename),
								   NAMEDATALEN);
		else
			row->claimed_by.roleid = DatumGetObjectId(claimant);
	}
	if (slot->tts_tupleDescriptor->natts >= Anum_keys_remember_until &&
		!nulls[Anum_keys_remember_until - 1])
	{
		row->has_remember = true;
		row->remember_until =
			DatumGetTimestampTz(values[Anum_keys_remember_until - 1]);
	}
	if (slot->tts_tupleDescriptor->natts >= Anum_keys_holder &&
		!nulls[Anum_keys_holder - 1])
		row->holder = DatumGetTextPCopy(values[Anum_keys_holder - 1]);
	{
		bool		should_free;
		HeapTuple	tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);

		row->xmin = HeapTupleHeaderGetXmin(tuple->t_data);
		if (should_free)
			heap_freetuple(tuple);
	}
	row->tid = slot->tts_tid;
}

/* The key's two values in the primary key's column order. */
static void
pkey_values(KeyTable *kt, Datum *values)
{
	values[kt->pkey_key_first ? 0 : 1] = PointerGetDatum(kt->key);
	values[kt->pkey_key_first ? 1 : 0] = PointerGetDatum(kt->scope);
}

/* Scan keys for an equality lookup of the key in the primary key. */
static void
set_scan_keys(KeyTable *kt, ScanKey skey)
{
	Datum		values[2];
	int			i;

	pkey_values(kt, values);
	for (i = 0; i < 2; i++)
		ScanKeyEntryInitialize(&skey[i], 0, i + 1, BTEqualStrategyNumber,
							   InvalidOid, kt->pkey->rd_indcollation[i],
							   F_TEXTEQ, values[i]);
}

/*
 * Find the key through the primary key with snapshot; the version found
 * is left in the slot.
 */
static bool
fetch_key(KeyTable *kt, Snapshot snapshot)
{
	ScanKeyData skey[2];
	IndexScanDesc scan;
	bool		found;

	set_scan_keys(kt, skey);
	scan = idem_keyrel_begin_scan(kt, skey, snapshot);
	found = idem_keyrel_scan_next(kt, scan);
	idem_keyrel_end_scan(kt, scan);
	return found;
}

/*
 * Read the key as a plain SELECT would, without locking it: with the
 * statement's snapshot (a new one per call in READ COMMITTED, the
 * transaction's in REPEATABLE READ and SERIALIZABLE, which also takes the
 * usual SSI predicate locks).  Returns row->found.
 */
bool
idem_keytable_read(KeyTable *kt, KeyRow *row, MemoryContext body_cxt)
{
	Snapshot	snapshot;

	/* See this transaction's own earlier writes, as a new statement would. */
	CommandCounterIncrement();
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	if (fetch_key(kt, snapshot))
	{
		set_row(row, kt->slot, body_cxt);
		if (unlikely(kt->distributed))
			kt->token_floor = Max(kt->token_floor, row->token);
	}
	else
		memset(row, 0, sizeof(KeyRow));
	UnregisterSnapshot(snapshot);
	return row->found;
}

/* Note in *waiter whom a dirty look found changing the version in the slot. */
static void
set_waiter(KeyWaiter *waiter, KeyTable *kt, TransactionId xid,
		   uint32 spec_token, bool deleting)
{
	waiter->xid = xid;
	waiter->spec_token = spec_token;
	waiter->tid = kt->slot->tts_tid;
	waiter->deleting = deleting;
}

/*
 * Look at the key with a dirty snapshot: is there a version a snapshot
 * cannot see yet (committed since, or being inserted or deleted by a
 * running transaction)?  Never waits.  For PROBE_IN_PROGRESS, *waiter
 * tells whom to wait for, and whether that transaction is only deleting
 * the key (no version of its own is being inserted); for PROBE_COMMITTED,
 * waiter->tid is the committed version found.
 */
KeyProbe
idem_keytable_probe(KeyTable *kt, KeyWaiter *waiter)
{
	SnapshotData snap;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	KeyProbe	result = PROBE_NONE;

	InitDirtySnapshot(snap);
	set_scan_keys(kt, skey);
	scan = idem_keyrel_begin_scan(kt, skey, &snap);
	while (idem_keyrel_scan_next(kt, scan))
	{
		if (TransactionIdIsValid(snap.xmin))
		{
			/* Being inserted: whoever deletes an older version, wait for this. */
			set_waiter(waiter, kt, snap.xmin, snap.speculativeToken, false);
			result = PROBE_IN_PROGRESS;
			break;
		}
		if (TransactionIdIsValid(snap.xmax))
		{
			if (result != PROBE_IN_PROGRESS)
				set_waiter(waiter, kt, snap.xmax, 0, true);
			result = PROBE_IN_PROGRESS;
			continue;
		}
		if (result != PROBE_IN_PROGRESS)
		{
			waiter->tid = kt->slot->tts_tid;
			result = PROBE_COMMITTED;
		}
	}
	idem_keyrel_end_scan(kt, scan);
	return result;
}

/*
 * Read the key as it is now, for a claim in READ COMMITTED: one look with
 * a dirty snapshot finds the latest committed version of its row (or this
 * transaction's own), left in *row, and whether another transaction is
 * inserting, changing or deleting the key, as idem_keytable_probe reports it.
 * Such a transaction's new version is not in *row: until it commits, the
 * committed version is what callers answer from, as a new snapshot would
 * show it.  Without snapshot: no SSI predicate locks, which READ
 * COMMITTED does not take anyway.
 */
KeyProbe
idem_keytable_look(KeyTable *kt, KeyRow *row, KeyWaiter *waiter,
			  MemoryContext body_cxt)
{
	SnapshotData snap;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	KeyProbe	result = PROBE_NONE;

	row->found = false;
	InitDirtySnapshot(snap);
	set_scan_keys(kt, skey);
	scan = idem_keyrel_begin_scan(kt, skey, &snap);
	while (idem_keyrel_scan_next(kt, scan))
	{
		if (TransactionIdIsValid(snap.xmin))
		{
			/* Another transaction's new version: wait for it, if anything. */
			if (result != PROBE_IN_PROGRESS || waiter->deleting)
				set_waiter(waiter, kt, snap.xmin, snap.speculativeToken, false);
			result = PROBE_IN_PROGRESS;
			if (row->found)
				break;
			continue;			/* the committed version may come next */
		}
		set_row(row, kt->slot, body_cxt);
		if (unlikely(kt->distributed))
			kt->token_floor = Max(kt->token_floor, row->token);
		if (TransactionIdIsValid(snap.xmax))
		{
			/* Being changed or deleted: is there a new version too? */
			if (result != PROBE_IN_PROGRESS)
				set_waiter(waiter, kt, snap.xmax, 0, true);
			result = PROBE_IN_PROGRESS;
			continue;
		}
		/* Nobody is changing it: no other live version can exist. */
		if (result != PROBE_IN_PROGRESS)
			result = PROBE_COMMITTED;
		break;
	}
	idem_keyrel_end_scan(kt, scan);
	return result;
}

/*
 * Wait for the transaction a probe found inserting or deleting the key.
 * A version still being inserted speculatively is waited for only until
 * its insertion is confirmed or undone, which happens before its
 * transaction ends; returns true if the wait lasted until the transaction
 * ended, false if it was such a short wait.  On a hot standby the
 * transaction runs on the primary: idem_waits_for_primary waits for its
 * end.  idem_waits shows the wait while it lasts; a wait that ends with an error (a cancel, lock_timeout,
 * a deadlock) is cleared when the (sub)transaction aborts (waits.c).
 */
bool
idem_keytable_wait(KeyTable *kt, KeyWaiter *waiter)
{
	ErrorContextCallback errcb;
	bool		speculative = waiter->spec_token != 0;

	push_wait_context(kt, &errcb);
	idem_waits_show(IDEM_WAIT_TRANSACTION, kt->scope, kt->key, waiter->xid, 0);
	if (RecoveryInProgress())
	{
		/* The primary's transaction: its end, also of an insertion. */
		idem_waits_for_primary(waiter->xid);
		speculative = false;
	}
	else if (speculative)
		SpeculativeInsertionWait(waiter->xid, waiter->spec_token);
	else
		XactLockTableWait(waiter->xid, kt->rel, &waiter->tid,
						  XLTW_InsertIndexUnique);
	idem_waits_hide();
	error_context_stack = errcb.previous;
	return !speculative;
}

/*
 * Put the stored version at tid in the slot, unless it is there already
 * (the version last read usually is).
 */
static void
fetch_version(KeyTable *kt, ItemPointer tid)
{
	if (!TTS_EMPTY(kt->slot) && ItemPointerEquals(&kt->slot->tts_tid, tid))
		return;
	if (!table_tuple_fetch_row_version(kt->rel, tid, SnapshotAny, kt->slot))
		elog(ERROR, "could not fetch version (%u,%u) of idempotency key",
			 ItemPointerGetBlockNumber(tid), ItemPointerGetOffsetNumber(tid));
}

/*
 * A heap tuple of idem.keys with the values of kv.  A new version of a
 * stored row (old is its tid) keeps that row's scope and key datums as
 * stored, so that a key long enough to have been toasted compares as
 * unchanged and the update can be HOT.
 */
static HeapTuple
form_row(KeyTable *kt, KeyValues *kv, ItemPointer old)
{
	TupleDesc	desc = RelationGetDescr(kt->rel);
	Datum		values[Natts_keys];
	bool		nulls[Natts_keys];

	memset(nulls, false, sizeof(nulls));
	if (old != NULL)
	{
		fetch_version(kt, old);
		slot_getallattrs(kt->slot);
		values[Anum_keys_scope - 1] = kt->slot->tts_values[Anum_keys_scope - 1];
		values[Anum_keys_key - 1] = kt->slot->tts_values[Anum_keys_key - 1];
	}
	else
	{
		values[Anum_keys_scope - 1] = PointerGetDatum(kt->scope);
		values[Anum_keys_key - 1] = PointerGetDatum(kt->key);
	}
	values[Anum_keys_fingerprint - 1] = PointerGetDatum(kv->fingerprint);
	values[Anum_keys_token - 1] = Int64GetDatum(kv->token);
	values[Anum_keys_status - 1] = Int32GetDatum(kv->status);
	nulls[Anum_keys_status - 1] = !kv->done;
	values[Anum_keys_body - 1] = PointerGetDatum(kv->body);
	nulls[Anum_keys_body - 1] = (kv->body == NULL);
	values[Anum_keys_lease_until - 1] = TimestampTzGetDatum(kv->lease_until);
	nulls[Anum_keys_lease_until - 1] = !kv->has_lease;
	values[Anum_keys_expires_at - 1] = TimestampTzGetDatum(kv->expires_at);
	/* Left out by heap_form_tuple from a table without the columns. */
	nulls[Anum_keys_phase - 1] = (kv->phase == NULL);
	values[Anum_keys_phase - 1] = PointerGetDatum(kv->phase);
	nulls[Anum_keys_phase_data - 1] = (kv->phase_data == NULL);
	values[Anum_keys_phase_data - 1] = PointerGetDatum(kv->phase_data);
	if (old != NULL && kv->phase_as_stored && desc->natts >= Anum_keys_phase_data)
	{
		values[Anum_keys_phase - 1] = kt->slot->tts_values[Anum_keys_phase - 1];
		nulls[Anum_keys_phase - 1] = kt->slot->tts_isnull[Anum_keys_phase - 1];
		values[Anum_keys_phase_data - 1] =
			kt->slot->tts_values[Anum_keys_phase_data - 1];
		nulls[Anum_keys_phase_data - 1] =
			kt->slot->tts_isnull[Anum_keys_phase_data - 1];
	}
	values[Anum_keys_remember_until - 1] = TimestampTzGetDatum(kv->remember_until);
	nulls[Anum_keys_remember_until - 1] = !kv->has_remember;
	values[Anum_keys_holder - 1] = PointerGetDatum(kv->holder);
	nulls[Anum_keys_holder - 1] = (kv->holder == NULL);
	if (old != NULL && kv->holder_as_stored && desc->natts >= Anum_keys_holder)
	{
		values[Anum_keys_holder - 1] = kt->slot->tts_values[Anum_keys_holder - 1];
		nulls[Anum_keys_holder - 1] = kt->slot->tts_isnull[Anum_keys_holder - 1];
	}
	nulls[Anum_keys_claimed_by - 1] = !kv->claimed_by.bound;
	if (old != NULL && kv->claimant_as_stored &&
		desc->natts >= Anum_keys_claimed_by)
	{
		values[Anum_keys_claimed_by - 1] =
			kt->slot->tts_values[Anum_keys_claimed_by - 1];
		nulls[Anum_keys_claimed_by - 1] =
			kt->slot->tts_isnull[Anum_keys_claimed_by - 1];
	}
	else if (kv->claimed_by.bound && desc->natts >= Anum_keys_claimed_by)
	{
		if (TupleDescAttr(desc, Anum_keys_claimed_by - 1)->atttypid == TEXTOID)
			values[Anum_keys_claimed_by - 1] =
				CStringGetTextDatum(NameStr(kv->claimed_by.rolename));
		else
			values[Anum_keys_claimed_by - 1] =
				ObjectIdGetDatum(OidIsValid(kv->claimed_by.roleid) ?
								 kv->claimed_by.roleid :
								 idem_keytable_claimant_role(&kv->claimed_by));
	}
	return heap_form_tuple(desc, values, nulls);
}

/*
 * Add the index entries of a new version of the key's row to every index
 * that is maintained (see open_indexes), as ExecInsertIndexTuples does:
 * unique indexes are checked with unique_check, others not at all.
 * Returns false if a unique index found the key taken (with
 * UNIQUE_CHECK_PARTIAL only).
 */
static bool
insert_index_entries(KeyTable *kt, ItemPointer tid, IndexUniqueCheck unique_check)
{
	bool		nulls[2] = {false, false};
	bool		unique = true;
	int			i;

	for (i = 0; i < kt->nindexes; i++)
	{
		Relation	index = kt->indexes[i];
		IndexUniqueCheck check = index->rd_index->indisunique ?
			unique_check : UNIQUE_CHECK_NO;
		Datum		values[2];

		values[kt->index_key_first[i] ? 0 : 1] = PointerGetDatum(kt->key);
		values[kt->index_key_first[i] ? 1 : 0] = PointerGetDatum(kt->scope);
		if (!index_insert(index, values, nulls, tid, kt->rel, check,
						  check == UNIQUE_CHECK_YES, kt->index_infos[i]))
			unique = false;
	}
	return unique;
}

/* The current user's name, cached until a role is renamed or dropped. */
static Oid	current_roleid = InvalidOid;
static NameData current_rolename;

/* Forget the cached name of the current user after ALTER or DROP ROLE. */
static void
roles_syscache_callback(Datum arg, int cacheid, uint32 hashvalue)
{
	current_roleid = InvalidOid;
}

/* Make current_roleid and current_rolename the current user's. */
static void
cache_current_role(void)
{
	static bool callback_registered = false;
	Oid			roleid = GetUserId();

	if (roleid != current_roleid)
	{
		char	   *name = GetUserNameFromId(roleid, false);

		if (!callback_registered)
		{
			CacheRegisterSyscacheCallback(AUTHOID, roles_syscache_callback,
										  (Datum) 0);
			callback_registered = true;
		}
		namestrcpy(&current_rolename, name);
		pfree(name);
		current_roleid = roleid;
	}
}

/* A claimant for a claim the current user makes. */
void
idem_keytable_current_claimant(KeyClaimant *claimant)
{
	cache_current_role();
	claimant->bound = true;
	claimant->roleid = current_roleid;
	claimant->rolename = current_rolename;
}

/*
 * The role a claimant stands for, InvalidOid if it no longer exists (a
 * role dropped, or renamed, since it made the claim).  The current user,
 * the usual case, is known without a catalog lookup.
 */
Oid
idem_keytable_claimant_role(KeyClaimant *claimant)
{
	if (OidIsValid(claimant->roleid))
		return claimant->roleid;
	if (NameStr(claimant->rolename)[0] == '\0')
		return InvalidOid;
	cache_current_role();
	if (strcmp(NameStr(claimant->rolename), NameStr(current_rolename)) == 0)
		return current_roleid;
	return get_role_oid(NameStr(claimant->rolename), true);
}

/*
 * The role of a claim for a log message: its name, "(a dropped role)",
 * or "(none)" for a claim made before 1.3.
 */
char *
idem_keytable_claimant_text(KeyClaimant *claimant)
{
	char	   *name;

	if (!claimant->bound)
		return "(none)";
	if (OidIsValid(claimant->roleid))
	{
		name = GetUserNameFromId(claimant->roleid, true);
		return name ? name : "(a dropped role)";
	}
	if (NameStr(claimant->rolename)[0] == '\0')
		return "(a dropped role)";
	return NameStr(claimant->rolename);
}

/*
 * Insert the key as a new row with the values of kv, drawing its token.
 * Returns false, having inserted nothing and without waiting, if another
 * transaction inserted the key first; idem_keytable_probe then tells who.
 *
 * The token is drawn before the insertion, but kept only if no other
 * token was drawn until the row was ours: otherwise another claim of this
 * key could have got a greater token, committed and released the key in
 * between, and the row gets a token drawn now, greater than that one.
 */
bool
idem_keytable_insert(KeyTable *kt, KeyValues *kv)
{
	TransactionId xid;
	uint32		spec_token;
	HeapTuple	tuple;
	bool		unique;

	idem_keyrel_prepare_write(kt);
	xid = GetCurrentTransactionId();
	kv->token = idem_keyrel_next_token(kt);
	tuple = form_row(kt, kv, NULL);

	spec_token = SpeculativeInsertionLockAcquire(xid);
	HeapTupleHeaderSetSpeculativeToken(tuple->t_data, spec_token);
	heap_insert(kt->rel, tuple, GetCurrentCommandId(true),
				HEAP_INSERT_SPECULATIVE, NULL);
	idem_expiry_note(kv->expires_at,
					 ItemPointerGetBlockNumber(&tuple->t_self));
	unique = insert_index_entries(kt, &tuple->t_self, UNIQUE_CHECK_PARTIAL);
	if (unique)
		heap_finish_speculative(kt->rel, &tuple->t_self);
	else
		heap_abort_speculative(kt->rel, &tuple->t_self);
	SpeculativeInsertionLockRelease(xid);

	if (unique)
	{
		int64		next = idem_keyrel_next_token(kt);

		if (next != kv->token + 1)
		{
			HeapTuple	newtuple;
			TM_FailureData tmfd;
			bool		index_new_version;

			kv->token = next;
			CheckCmdReplicaIdentity(kt->rel, CMD_UPDATE);
			newtuple = form_row(kt, kv, &tuple->t_self);
			CommandCounterIncrement();
			if (idem_heap_update(kt->rel, &tuple->t_self, newtuple,
								 GetCurrentCommandId(true), true, &tmfd,
								 &index_new_version) != TM_Ok)
				elog(ERROR, "could not give idempotency key a new token");
			/* The new version may be on another page: note it there too. */
			idem_expiry_note(kv->expires_at,
							 ItemPointerGetBlockNumber(&newtuple->t_self));
			if (index_new_version)
				insert_index_entries(kt, &newtuple->t_self, UNIQUE_CHECK_YES);
			heap_freetuple(newtuple);
		}
	}
	heap_freetuple(tuple);
	return unique;
}

/*
 * Read the key for a write by its holder: as idem_keytable_read, but in
 * REPEATABLE READ and SERIALIZABLE a version the transaction's snapshot
 * cannot see (claimed since) is a serialization failure, not "no key".
 */
bool
idem_keytable_read_for_write(KeyTable *kt, KeyRow *row, MemoryContext body_cxt)
{
	KeyWaiter	waiter;

	if (idem_keytable_read(kt, row, body_cxt) || !IsolationUsesXactSnapshot())
		return row->found;
	for (;;)
	{
		switch (idem_keytable_probe(kt, &waiter))
		{
			case PROBE_NONE:
				return false;
			case PROBE_IN_PROGRESS:
				if (!TransactionIdIsCurrentTransactionId(waiter.xid))
				{
					idem_keytable_wait(kt, &waiter);
					continue;
				}
				/* fall through */
			case PROBE_COMMITTED:
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 errmsg("could not serialize access due to concurrent update"),
						 errdetail("Idempotency key \"%s\" was claimed after this transaction's snapshot.",
								   idem_key_for_message(kt->key))));
		}
	}
}

/*
 * What a write of the version read found: written, changed since (a
 * serialization failure in REPEATABLE READ and SERIALIZABLE, else the
 * caller reads again and decides anew), or busy (no wait).
 */
static KeyWrite
write_result(KeyTable *kt, TM_Result result)
{
	switch (result)
	{
		case TM_Ok:
			return KEYWRITE_OK;
		case TM_BeingModified:
		case TM_WouldBlock:
			return KEYWRITE_BUSY;
		case TM_Updated:
		case TM_Deleted:
			if (IsolationUsesXactSnapshot())
				ereport(ERROR,
						(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
						 result == TM_Updated ?
						 errmsg("could not serialize access due to concurrent update") :
						 errmsg("could not serialize access due to concurrent delete")));
			return KEYWRITE_CHANGED;
		case TM_SelfModified:
			return KEYWRITE_CHANGED;
		default:
			elog(ERROR, "unexpected status %u writing idem.keys", result);
	}
	pg_unreachable();
}

/*
 * Is the row version at tid, which another write found locked or being
 * changed, held by this transaction alone?  Its xmax may be this
 * transaction's (or subtransaction's) XID, or a MultiXactId whose members
 * still running are all this transaction's: lockers that ended no longer
 * count, as heap_lock_tuple's callers treat them.
 */
static bool
held_only_by_me(KeyTable *kt, ItemPointer tid)
{
	Buffer		buffer;
	Page		page;
	ItemId		lp;
	HeapTupleHeader htup;
	TransactionId xmax;
	uint16		infomask;
	bool		mine = true;

	buffer = ReadBuffer(kt->rel, ItemPointerGetBlockNumber(tid));
	LockBuffer(buffer, BUFFER_LOCK_SHARE);
	page = BufferGetPage(buffer);
	lp = PageGetItemId(page, ItemPointerGetOffsetNumber(tid));
	if (!ItemIdIsNormal(lp))
	{
		UnlockReleaseBuffer(buffer);
		return false;
	}
	htup = (HeapTupleHeader) PageGetItem(page, lp);
	xmax = HeapTupleHeaderGetRawXmax(htup);
	infomask = htup->t_infomask;
	UnlockReleaseBuffer(buffer);

	if (infomask & HEAP_XMAX_INVALID)
		return false;
	if (infomask & HEAP_XMAX_IS_MULTI)
	{
		MultiXactMember *members;
		int			n;
		int			i;

		n = GetMultiXactIdMembers(xmax, &members, false,
								  HEAP_XMAX_IS_LOCKED_ONLY(infomask));
		for (i = 0; i < n; i++)
		{
			if (!TransactionIdIsCurrentTransactionId(members[i].xid) &&
				TransactionIdIsInProgress(members[i].xid))
				mine = false;
		}
		if (n > 0)
			pfree(members);
		return mine;
	}
	return TransactionIdIsCurrentTransactionId(xmax);
}

/*
 * Replace the version of the key's row in *row, as idem_keytable_read found it,
 * with the values of kv, as UPDATE does: if another transaction is
 * changing or locking that version, wait for it (or return KEYWRITE_BUSY
 * if !wait); if it was changed since, write nothing.  A row locked only by
 * this transaction itself is written without waiting.  kv->token
 * IDEM_NEW_TOKEN is replaced with a new token.
 */
KeyWrite
idem_keytable_update(KeyTable *kt, KeyRow *row, KeyValues *kv, bool wait)
{
	HeapTuple	tuple;
	TM_FailureData tmfd;
	TM_Result	result;
	bool		index_new_version;
	ErrorContextCallback errcb;

	idem_keyrel_prepare_write(kt);
	CheckCmdReplicaIdentity(kt->rel, CMD_UPDATE);
	push_wait_context(kt, &errcb);
	if (!wait)
	{
		/*
		 * heap_update waits for whoever changes or locks the version; not
		 * to wait, lock it first without waiting, as SELECT ... FOR NO KEY
		 * UPDATE SKIP LOCKED does.  A version locked only by this
		 * transaction (also through a MultiXactId) is locked at once.
		 */
		result = table_tuple_lock(kt->rel, &row->tid, GetLatestSnapshot(),
								  kt->slot, GetCurrentCommandId(false),
								  LockTupleNoKeyExclusive, LockWaitSkip, 0,
								  &tmfd);
		if (result != TM_Ok)
		{
			error_context_stack = errcb.previous;
			return write_result(kt, result);
		}
	}
	if (kv->token == IDEM_NEW_TOKEN)
		kv->token = idem_keyrel_next_token(kt);
	tuple = form_row(kt, kv, &row->tid);
	result = idem_heap_update(kt->rel, &row->tid, tuple,
							  GetCurrentCommandId(true), true, &tmfd,
							  &index_new_version);
	error_context_stack = errcb.previous;
	if (result == TM_Ok)
		idem_expiry_note(kv->expires_at,
						 ItemPointerGetBlockNumber(&tuple->t_self));
	if (index_new_version)
		insert_index_entries(kt, &tuple->t_self, UNIQUE_CHECK_YES);
	heap_freetuple(tuple);
	return write_result(kt, result);
}

/*
 * Delete the row version at tid without waiting for another transaction
 * unless wait; a version locked only by this transaction itself (it
 * changed the key earlier) is deleted without waiting either way.
 */
static TM_Result
delete_version(KeyTable *kt, ItemPointer tid, bool wait)
{
	TM_FailureData tmfd;
	TM_Result	result;

	result = heap_delete(kt->rel, tid, GetCurrentCommandId(true),
						 InvalidSnapshot, wait, &tmfd, false);
	if (result == TM_BeingModified && !wait && held_only_by_me(kt, tid))
		result = heap_delete(kt->rel, tid, GetCurrentCommandId(true),
							 InvalidSnapshot, true, &tmfd, false);
	return result;
}

/* Delete the version of the key's row in *row, as idem_keytable_update writes. */
KeyWrite
idem_keytable_delete(KeyTable *kt, KeyRow *row, bool wait)
{
	TM_Result	result;
	ErrorContextCallback errcb;

	idem_keyrel_prepare_write(kt);
	CheckCmdReplicaIdentity(kt->rel, CMD_DELETE);
	push_wait_context(kt, &errcb);
	result = delete_version(kt, &row->tid, wait);
	error_context_stack = errcb.previous;
	return write_result(kt, result);
}

/*
 * Lock the version read FOR SHARE until the end of the transaction, as
 * SELECT ... FOR SHARE does, waiting for a transaction that changes it: a
 * claim's holder keeps a takeover (an update) waiting until it commits.
 * KEYWRITE_CHANGED if the version was changed or deleted meanwhile.
 */
KeyWrite
idem_keytable_lock_share(KeyTable *kt, KeyRow *row)
{
	TM_Result	result;
	TM_FailureData tmfd;
	ErrorContextCallback errcb;

	idem_keyrel_prepare_write(kt);
	push_wait_context(kt, &errcb);
	result = table_tuple_lock(kt->rel, &row->tid, GetLatestSnapshot(),
							  kt->slot, GetCurrentCommandId(false),
							  LockTupleShare, LockWaitBlock, 0, &tmfd);
	error_context_stack = errcb.previous;
	return write_result(kt, result);
}

/*
 * The recovery point of the version read (its phase and phase_data),
 * copied into cxt; NULL where there is none, or the table has no such
 * columns (before 1.4).
 */
void
idem_keytable_read_phase(KeyTable *kt, KeyRow *row, MemoryContext cxt,
						 text **phase, bytea **phase_data)
{
	MemoryContext old;

	*phase = NULL;
	*phase_data = NULL;
	if (RelationGetDescr(kt->rel)->natts < Anum_keys_phase_data)
		return;
	fetch_version(kt, &row->tid);
	slot_getallattrs(kt->slot);
	old = MemoryContextSwitchTo(cxt);
	if (!kt->slot->tts_isnull[Anum_keys_phase - 1])
		*phase = DatumGetTextPCopy(kt->slot->tts_values[Anum_keys_phase - 1]);
	if (!kt->slot->tts_isnull[Anum_keys_phase_data - 1])
		*phase_data = DatumGetByteaPCopy(kt->slot->tts_values[Anum_keys_phase_data - 1]);
	MemoryContextSwitchTo(old);
}

/*
 * Does the version hold nothing a tombstone drops (body, recovery point,
 * claimant)?  Then purge has made it a tombstone already.
 */
static bool
is_bare_tombstone(HeapTuple tuple, TupleDesc desc)
{
	return heap_attisnull(tuple, Anum_keys_body, desc) &&
		heap_attisnull(tuple, Anum_keys_claimed_by, desc) &&
		heap_attisnull(tuple, Anum_keys_phase, desc) &&
		heap_attisnull(tuple, Anum_keys_phase_data, desc) &&
		heap_attisnull(tuple, Anum_keys_holder, desc);
}

/*
 * Rewrite the completed version at tid, whose retention is over and which
 * is remembered still, as its tombstone: the key, scope, fingerprint,
 * token, status and times, without the body, the recovery point and the
 * claimant.  Like delete_version without wait: a version another
 * transaction changes or locks is left alone (TM_BeingModified), one
 * changed since is not written (TM_Updated).  *blkno is the new
 * version's block.
 */
static TM_Result
tombstone_version(KeyTable *kt, ItemPointer tid, BlockNumber *blkno)
{
	KeyRow		row;
	KeyValues	kv;
	HeapTuple	tuple;
	TM_FailureData tmfd;
	TM_Result	result;
	bool		index_new_version;
	bytea	   *fingerprint;

	CheckCmdReplicaIdentity(kt->rel, CMD_UPDATE);
	fetch_version(kt, tid);
	set_row(&row, kt->slot, NULL);
	fingerprint = palloc(VARHDRSZ + IDEM_FINGERPRINT_LEN);
	SET_VARSIZE(fingerprint, VARHDRSZ + IDEM_FINGERPRINT_LEN);
	memcpy(VARDATA(fingerprint), row.fingerprint, IDEM_FINGERPRINT_LEN);
	memset(&kv, 0, sizeof(KeyValues));
	kv.fingerprint = fingerprint;
	kv.token = row.token;
	kv.done = true;
	kv.status = row.status;
	kv.expires_at = row.expires_at;
	kv.has_remember = true;
	kv.remember_until = row.remember_until;
	/* The index entries of a new version that is not HOT name the key. */
	kt->scope = DatumGetTextPCopy(kt->slot->tts_values[Anum_keys_scope - 1]);
	kt->key = DatumGetTextPCopy(kt->slot->tts_values[Anum_keys_key - 1]);
	tuple = form_row(kt, &kv, tid);
	result = idem_heap_update(kt->rel, tid, tuple, GetCurrentCommandId(true),
							  false, &tmfd, &index_new_version);
	if (result == TM_BeingModified && held_only_by_me(kt, tid))
		result = idem_heap_update(kt->rel, tid, tuple,
								  GetCurrentCommandId(true), true, &tmfd,
								  &index_new_version);
	if (result == TM_Ok)
	{
		*blkno = ItemPointerGetBlockNumber(&tuple->t_self);
		idem_expiry_note(kv.remember_until, *blkno);
		if (index_new_version)
			insert_index_entries(kt, &tuple->t_self, UNIQUE_CHECK_YES);
	}
	heap_freetuple(tuple);
	pfree(kt->scope);
	pfree(kt->key);
	kt->scope = NULL;
	kt->key = NULL;
	pfree(fingerprint);
	return result;
}

/*
 * Delete up to limit rows of kt->rel that expired at or before now, walking
 * it in physical order from *cursor, which is moved past the last row
 * looked at, and reading at most *pages pages (which is decreased by the
 * pages read), so that a table with few expired rows is walked in many
 * short transactions rather than one long one.  A completed row that is
 * remembered past its retention (remember_until, 1.6 on) is not deleted
 * then but rewritten once as its tombstone (tombstone_version), which
 * counts towards limit as a deletion does; the tombstone is deleted when
 * remember_until is over.  So each row is rewritten at most once and
 * deleted once, and its next due time is expires_at until it is a
 * tombstone, remember_until after.  *at_end is set if the walk
 * reached the end of the table.  Blocks of ranges that ranges does not
 * mark are passed over without being read or counted, unless it says to
 * read all.  A row is deleted only if the version
 * found expired is visible to the transaction's snapshot, is still the
 * latest, and no transaction holds it: the delete never waits.
 *
 * The least_left of a block's range is lowered to the next due time
 * (expires_at, or remember_until of a tombstone) of every version read
 * and left in
 * place that a transaction may still see or make visible: live ones, those
 * not yet committed (inserted or deleted), and those the delete skipped,
 * but not those a committed transaction deleted or replaced.  Reading
 * every version on the page, not only those the snapshot sees, makes that
 * a bound also for rows being written while the pass runs (purge.c).
 *
 * Pages are read through a ring of buffers (the bulk-read strategy, as a
 * sequential scan of a table larger than a quarter of shared_buffers
 * does), so a pass over a large table does not evict the rest of the
 * cache; each is pruned first, as a scan does.  Under SERIALIZABLE the
 * walk takes the relation-level predicate lock a sequential scan takes
 * and checks each version it reads for conflicts.
 */
static int64
purge_relation(KeyTable *kt, TimestampTz now, int64 limit, ItemPointer cursor,
			   BlockNumber *pages, bool *at_end, IdemPurgeRanges *ranges)
{
	BlockNumber first = ItemPointerGetBlockNumberNoCheck(cursor);
	OffsetNumber first_offset = ItemPointerGetOffsetNumberNoCheck(cursor);
	TupleDesc	desc = RelationGetDescr(kt->rel);
	bool		remembers = desc->natts >= Anum_keys_remember_until;
	BlockNumber nblocks;
	BlockNumber blkno;
	BlockNumber nread = 0;
	BufferAccessStrategy strategy;
	Snapshot	snapshot;
	int64		n = 0;
	bool		stopped = false;

	idem_keyrel_prepare_write(kt);
	CheckCmdReplicaIdentity(kt->rel, CMD_DELETE);

	/* See this transaction's earlier writes; delete with a later command id. */
	CommandCounterIncrement();
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	PredicateLockRelation(kt->rel, snapshot);

	nblocks = RelationGetNumberOfBlocks(kt->rel);
	if (first >= nblocks)
	{
		UnregisterSnapshot(snapshot);
		*at_end = true;
		return 0;
	}
	strategy = GetAccessStrategy(BAS_BULKREAD);
	for (blkno = first; blkno < nblocks && nread < *pages && !stopped; blkno++)
	{
		OffsetNumber expired[MaxHeapTuplesPerPage];
		TimestampTz expired_at[MaxHeapTuplesPerPage];
		bool		to_tombstone[MaxHeapTuplesPerPage];
		TimestampTz remembered_until[MaxHeapTuplesPerPage];
		int			nexpired = 0;
		int			range = idem_purge_range_of(ranges->shift, blkno);
		TimestampTz *least_left = &ranges->least_left[range];
		Buffer		buf;
		Page		page;
		OffsetNumber off;
		OffsetNumber maxoff;
		int			i;

		CHECK_FOR_INTERRUPTS();
		if (!ranges->read_all && !ranges->read[range])
		{
			/* On to the last block of the range; the last range has no end. */
			if (range == IDEM_PURGE_RANGES - 1)
				blkno = nblocks - 1;
			else
				blkno = (BlockNumber) Min((uint64) nblocks,
										  (uint64) (range + 1) << ranges->shift) - 1;
			continue;
		}
		nread++;
		buf = ReadBufferExtended(kt->rel, MAIN_FORKNUM, blkno, RBM_NORMAL,
								 strategy);
		heap_page_prune_opt(kt->rel, buf);
		LockBuffer(buf, BUFFER_LOCK_SHARE);
		page = BufferGetPage(buf);
		maxoff = PageGetMaxOffsetNumber(page);
		off = (blkno == first && first_offset > FirstOffsetNumber) ?
			first_offset : FirstOffsetNumber;
		for (; off <= maxoff; off++)
		{
			ItemId		lp = PageGetItemId(page, off);
			HeapTupleData tuple;
			TransactionId dead_after;
			TimestampTz expires_at;
			TimestampTz due;
			TimestampTz remember_until = 0;
			bool		tombstone = false;
			bool		isnull;
			bool		visible;

			if (!ItemIdIsNormal(lp))
				continue;
			tuple.t_data = (HeapTupleHeader) PageGetItem(page, lp);
			tuple.t_len = ItemIdGetLength(lp);
			tuple.t_tableOid = RelationGetRelid(kt->rel);
			ItemPointerSet(&tuple.t_self, blkno, off);

			switch (HeapTupleSatisfiesVacuumHorizon(&tuple, buf, &dead_after))
			{
				case HEAPTUPLE_DEAD:
				case HEAPTUPLE_RECENTLY_DEAD:
					/* deleted or replaced for good: not a key any more */
					continue;
				default:
					break;
			}
			expires_at = DatumGetTimestampTz(heap_getattr(&tuple,
														  Anum_keys_expires_at,
														  desc, &isnull));
			due = expires_at;
			if (remembers && !isnull && expires_at <= now &&
				!heap_attisnull(&tuple, Anum_keys_status, desc))
			{
				bool		rnull;

				remember_until = DatumGetTimestampTz(heap_getattr(&tuple,
																  Anum_keys_remember_until,
																  desc, &rnull));
				if (!rnull && remember_until > now)
				{
					/* Remembered: a tombstone already is due only then. */
					tombstone = true;
					if (is_bare_tombstone(&tuple, desc))
						due = remember_until;
				}
			}
			visible = HeapTupleSatisfiesVisibility(&tuple, snapshot, buf);
			HeapCheckForSerializableConflictOut(visible, kt->rel, &tuple,
												buf, snapshot);
			if (!visible || isnull || due > now)
			{
				*least_left = Min(*least_left, due);
				continue;
			}
			expired_at[nexpired] = expires_at;
			to_tombstone[nexpired] = tombstone;
			remembered_until[nexpired] = remember_until;
			expired[nexpired++] = off;
		}
		LockBuffer(buf, BUFFER_LOCK_UNLOCK);
		ReleaseBuffer(buf);

		for (i = 0; i < nexpired; i++)
		{
			ItemPointerData tid;

			ItemPointerSet(&tid, blkno, expired[i]);
			if (to_tombstone[i])
			{
				BlockNumber newblk;

				if (tombstone_version(kt, &tid, &newblk) == TM_Ok)
				{
					TimestampTz *left = &ranges->least_left[idem_purge_range_of(ranges->shift, newblk)];

					*left = Min(*left, remembered_until[i]);
					n++;
				}
				else
					*least_left = Min(*least_left, expired_at[i]);
			}
			else if (delete_version(kt, &tid, false) == TM_Ok)
				n++;
			else
				*least_left = Min(*least_left, expired_at[i]);
			if (n >= limit)
			{
				/* The next batch starts after this row. */
				ItemPointerSet(cursor, blkno, expired[i] + 1);
				stopped = true;
				break;
			}
		}
	}
	FreeAccessStrategy(strategy);
	UnregisterSnapshot(snapshot);
	*at_end = (!stopped && blkno >= nblocks);
	/* The next batch starts after the last page read. */
	if (!stopped)
		ItemPointerSet(cursor, blkno, 0);
	*pages -= nread;
	elog(DEBUG1, "idem purge batch of \"%s\": blocks %u to %u of %u, %u read, %lld rows deleted or made tombstones",
		 RelationGetRelationName(kt->rel), first, blkno - 1, nblocks, nread,
		 (long long) n);
	return n;
}

/* The number of blocks of the open table (of the table itself under Citus). */
BlockNumber
idem_keytable_nblocks(KeyTable *kt)
{
	return RelationGetNumberOfBlocks(kt->rel);
}

/* The file of the open table: a rewrite gives it another. */
Oid
idem_keytable_relfilenode(KeyTable *kt)
{
#if PG_VERSION_NUM >= 160000
	return kt->rel->rd_locator.relNumber;
#else
	return kt->rel->rd_node.relNode;
#endif
}

/*
 * Delete up to limit rows that expired at or before now, walking the table
 * in physical order from pos, which is moved past the last row looked at,
 * and reading at most IDEM_PURGE_BATCH_PAGES pages (over all the shards it
 * walks, if Citus distributes the table).  *at_end is set if the scan
 * reached the end of the table (of the last shard placed on this node, if
 * Citus distributes it).  ranges says which blocks to read and gets the
 * least expiry left in each range read (see purge_relation); if the table
 * no longer has the file ranges describes (it was rewritten since the
 * walk started), or Citus distributes the table, every block of every
 * shard is read and ranges is marked unknown.
 */
int64
idem_keytable_purge_batch(TimestampTz now, int limit, IdemPurgePosition *pos,
						  bool *at_end, IdemPurgeRanges *ranges)
{
	KeyTable	kt;
	int64		n = 0;
	BlockNumber pages = IDEM_PURGE_BATCH_PAGES;
	List	   *shards;
	ListCell   *lc;

	idem_keytable_open(&kt, "idem_purge()", NULL, NULL,
					   idem_keytable_write_lockmode());
	if (likely(!idem_keyrel_distributed()))
	{
		if (OidIsValid(ranges->relfilenode) &&
			ranges->relfilenode != idem_keytable_relfilenode(&kt))
		{
			/* Rewritten: the map and the position are of another file. */
			ranges->read_all = true;
			ranges->unknown = true;
		}
		n = purge_relation(&kt, now, limit, &pos->cursor, &pages, at_end,
						   ranges);
		idem_keytable_close(&kt);
		return n;
	}

	/*
	 * Distributed: the shards placed here; the table itself stays empty.
	 * Their blocks share the ranges, so every block is read.
	 */
	ranges->read_all = true;
	if (ItemPointerGetBlockNumberNoCheck(&pos->cursor) == 0 &&
		ItemPointerGetOffsetNumberNoCheck(&pos->cursor) == 0)
		pos->shardid = 0;
	shards = idem_keyrel_local_shards(&kt);
	*at_end = true;
	foreach(lc, shards)
	{
		IdemShard  *shard = lfirst(lc);
		bool		shard_at_end;

		if (shard->shardid < pos->shardid)
			continue;
		if (shard->shardid > pos->shardid)
		{
			ItemPointerSet(&pos->cursor, 0, 0);
			pos->shardid = shard->shardid;
		}
		idem_keyrel_switch_shard(&kt, shard->relid);
		n += purge_relation(&kt, now, limit - n, &pos->cursor, &pages,
							&shard_at_end, ranges);
		if (!shard_at_end || n >= limit || pages == 0)
		{
			*at_end = false;
			break;
		}
	}
	if (*at_end)
		pos->shardid = 0;
	/* Shards moved here bring rows whose expiry no write noted. */
	ranges->unknown = true;
	idem_keytable_close(&kt);
	return n;
}
