/*-------------------------------------------------------------------------
 *
 * keytable.c
 *	  The storage of idempotency keys: the only code that touches
 *	  idem.keys and idem.token_seq.
 *
 * idem reads, inserts, locks, updates and deletes rows of idem.keys
 * directly in the heap and its primary key, as execReplication.c does for
 * logical replication, instead of running statements: no executor
 * start-up and no plan per call.  The executor's own checks are then ours
 * to make, and they are made here, at one door:
 *
 * - keytable_open finds the table by name under its lock, so a table
 *	 dropped and created again since the last call is found anew, and
 *	 checks that it still has the shape the install script gave it: the
 *	 nine columns (eight before the update to 1.3; names, types, NOT
 *	 NULL, no dropped columns), the heap access method, the primary key
 *	 as its only index, no CHECK constraint, no trigger (a foreign key
 *	 referencing the table is one), and a token sequence with CACHE 1
 *	 and NO CYCLE.  A table altered beyond that is refused with 55000,
 *	 naming what idem would not maintain, rather than written past its
 *	 indexes or constraints.  The check runs again after every
 *	 invalidation of the table, its index or the sequence.
 * - every write first refuses read-only transactions and recovery (25006,
 *	 as nextval() does) and takes RowExclusiveLock.
 * - relation locks are held until the end of the transaction.
 * - tuples are formed from the relation's descriptor, and index entries
 *	 from the primary key's own columns.
 * - snapshots are registered while in use.
 *
 * When Citus distributes idem.keys (see citus.c and idem_distribute()),
 * keytable_open acts on the shard that holds the key on this node instead
 * of the distributed table, whose own heap stays empty: it resolves and
 * locks the shard, refuses a key whose shard is placed elsewhere, and
 * checks each shard's shape as above.  Tokens then come from Citus's node
 * clock instead of the node's own idem.token_seq, and a takeover's token
 * is kept above the key's last one, so that tokens per key grow across
 * nodes too.  Whether the table is distributed is decided with the shape
 * check, once per invalidation: without Citus nothing is added per call.
 *
 * A new key is inserted with speculative insertion, as INSERT ... ON
 * CONFLICT does: the heap tuple carries a speculative token, the primary
 * key entry is added with UNIQUE_CHECK_PARTIAL, and if another transaction
 * inserted the key meanwhile the insertion is undone without waiting for
 * it.  Whether and how long to wait is the caller's choice (see keys.c).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/multixact.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/namespace.h"
#include "catalog/pg_am_d.h"
#include "catalog/pg_collation_d.h"
#include "catalog/pg_opfamily_d.h"
#include "catalog/pg_sequence.h"
#include "catalog/pg_type_d.h"
#include "commands/sequence.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "storage/procarray.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

#include "citus.h"
#include "keytable.h"

/*
 * The columns of idem.keys, as sql/idem--1.0.sql creates them, the update
 * to 1.3 adds claimed_by (a role's OID) and the update to 1.4 makes it the
 * role's name.
 */
static const struct
{
	const char *name;
	Oid			type;
	Oid			type_1_3;		/* the type before 1.4 */
	bool		notnull;
} key_columns[Natts_keys] = {
	{"scope", TEXTOID, TEXTOID, true},
	{"key", TEXTOID, TEXTOID, true},
	{"fingerprint", BYTEAOID, BYTEAOID, true},
	{"token", INT8OID, INT8OID, true},
	{"status", INT4OID, INT4OID, false},
	{"body", BYTEAOID, BYTEAOID, false},
	{"lease_until", TIMESTAMPTZOID, TIMESTAMPTZOID, false},
	{"expires_at", TIMESTAMPTZOID, TIMESTAMPTZOID, true},
	{"claimed_by", TEXTOID, OIDOID, false},
};

/* Identity of the table, cached until an invalidation touches it. */
static Oid	keys_relid = InvalidOid;
static Oid	token_seq_relid = InvalidOid;
static bool callbacks_registered = false;
/* Bumped by every invalidation of the table, its indexes or the sequence. */
static uint64 keys_inval_count = 0;
/* keys_inval_count when the shape was last found good, plus one. */
static uint64 shape_checked = 0;

/*
 * Indexes a table of the right shape may have: the primary key and the
 * copies of it that REINDEX CONCURRENTLY builds (and leaves behind when it
 * is cancelled).
 */
#define IDEM_MAX_INDEXES	4

/* An index of idem.keys on (key, scope), as the shape check found it. */
typedef struct KeyIndex
{
	Oid			relid;
	IndexInfo  *info;			/* built with the shape check */
	bool		key_first;		/* on (key, scope), not (scope, key) */
} KeyIndex;

/* What the shape check found out about a table with the right shape. */
typedef struct KeyShape
{
	Oid			relid;			/* hash key of shard_shapes */
	int			nindexes;		/* all indexes; the primary key first */
	KeyIndex	indexes[IDEM_MAX_INDEXES];
} KeyShape;

/* Memory of the shape checks; reset when the shape is checked anew. */
static MemoryContext keytable_cxt = NULL;
static KeyShape keys_shape;
/* The column Citus distributes idem.keys by, 0 if it does not. */
static AttrNumber keys_distcol = 0;
/*
 * The greatest token read from the shard opened last (distributed only):
 * new tokens for it are drawn above it.
 */
static int64 shard_token_floor = 0;
/*
 * Shards of a distributed idem.keys checked since the last invalidation,
 * by relation OID; their indexes are entered too, with relid as the
 * index's OID, so that the relcache callback finds them.
 */
static HTAB *shard_shapes = NULL;

/* Is relid one of the indexes of the shape? */
static bool
shape_has_index(KeyShape *shape, Oid relid)
{
	int			i;

	for (i = 0; i < shape->nindexes; i++)
		if (shape->indexes[i].relid == relid)
			return true;
	return false;
}

/* Forget the table's identity and shape when it, an index or the sequence changes. */
static void
keys_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == keys_relid ||
		relid == token_seq_relid || shape_has_index(&keys_shape, relid) ||
		(shard_shapes != NULL &&
		 hash_search(shard_shapes, &relid, HASH_FIND, NULL) != NULL))
	{
		keys_relid = InvalidOid;
		keys_inval_count++;
	}
}

/* Check the shape again after ALTER SEQUENCE. */
static void
keys_syscache_callback(Datum arg, int cacheid, uint32 hashvalue)
{
	/* ALTER SEQUENCE changes pg_sequence, not the relcache entry. */
	keys_inval_count++;
}

/* Look up idem.keys and idem.token_seq by name. */
static Oid
lookup_keys_relid(void)
{
	Oid			nspid;

	if (OidIsValid(keys_relid))
		return keys_relid;

	if (!callbacks_registered)
	{
		CacheRegisterRelcacheCallback(keys_relcache_callback, (Datum) 0);
		CacheRegisterSyscacheCallback(SEQRELID, keys_syscache_callback,
									  (Datum) 0);
		callbacks_registered = true;
	}

	nspid = get_namespace_oid("idem", true);
	token_seq_relid = OidIsValid(nspid) ?
		get_relname_relid("token_seq", nspid) : InvalidOid;
	keys_relid = OidIsValid(nspid) ?
		get_relname_relid("keys", nspid) : InvalidOid;
	if (!OidIsValid(keys_relid) || !OidIsValid(token_seq_relid))
	{
		keys_relid = InvalidOid;
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("extension \"idem\" is not installed in this database"),
				 errhint("Run CREATE EXTENSION idem.")));
	}
	return keys_relid;
}

/*
 * Lock idem.keys and open it.  The OID is looked up again if the lock's
 * invalidations show that the table went away since it was cached (DROP
 * and CREATE EXTENSION in another session), as RangeVarGetRelidExtended
 * does.
 */
static Relation
open_keys_relation(LOCKMODE lockmode)
{
	int			attempt;

	for (attempt = 0; attempt < 10; attempt++)
	{
		Oid			relid = lookup_keys_relid();

		LockRelationOid(relid, lockmode);
		if (relid == keys_relid)
			return relation_open(relid, NoLock);
		UnlockRelationOid(relid, lockmode);
	}
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("table idem.keys keeps changing"),
			 errhint("Retry when no DROP or CREATE EXTENSION idem is running.")));
	pg_unreachable();
}

/*
 * Refuse a table altered beyond what idem maintains: 55000, with the
 * message and detail given, and what to do about it.
 */
#define refuse_shape(...) \
	ereport(ERROR, \
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE), \
			 __VA_ARGS__, \
			 errhint("idem reads and writes idem.keys directly and keeps only the shape " \
					 "CREATE EXTENSION gave it: undo the change, or drop and create the extension.")))

/*
 * Is index a btree on (key, scope) that finds keys as the primary key
 * does: the C collation and text_ops on both columns, no expressions, no
 * predicate, no INCLUDE columns?  Sets *key_first to its column order.
 */
static bool
is_key_index(Relation index, bool *key_first)
{
	Form_pg_index ind = index->rd_index;
	int			i;

	if (index->rd_rel->relam != BTREE_AM_OID ||
		ind->indnatts != 2 || ind->indnkeyatts != 2 ||
		!((ind->indkey.values[0] == Anum_keys_key &&
		   ind->indkey.values[1] == Anum_keys_scope) ||
		  (ind->indkey.values[0] == Anum_keys_scope &&
		   ind->indkey.values[1] == Anum_keys_key)) ||
		!ind->indimmediate ||
		RelationGetIndexExpressions(index) != NIL ||
		RelationGetIndexPredicate(index) != NIL)
		return false;
	for (i = 0; i < 2; i++)
	{
		if (index->rd_indcollation[i] != C_COLLATION_OID ||
			index->rd_opfamily[i] != TEXT_BTREE_FAM_OID)
			return false;
	}
	*key_first = (ind->indkey.values[0] == Anum_keys_key);
	return true;
}

/*
 * Check the indexes of idem.keys (or a shard of it) and note them in
 * *shape, the primary key first, with IndexInfos built in keytable_cxt.
 * Besides the primary key, only copies of it are accepted: REINDEX
 * CONCURRENTLY builds one beside it and leaves it behind, invalid, when it
 * is cancelled.  Copies ready for inserts are maintained as the executor
 * maintains every index; any other index would not be, and is refused.
 */
static void
check_indexes(Relation rel, KeyShape *shape)
{
	Oid			pkid = idem_primary_key_index(rel);
	List	   *indexes;
	ListCell   *lc;
	int			i;

	if (!OidIsValid(pkid))
		refuse_shape(errmsg("idem cannot use table idem.keys: it has no primary key"));
	shape->nindexes = 1;
	shape->indexes[0].relid = pkid;
	indexes = RelationGetIndexList(rel);
	foreach(lc, indexes)
	{
		if (lfirst_oid(lc) == pkid)
			continue;
		if (shape->nindexes == IDEM_MAX_INDEXES)
			refuse_shape(errmsg("idem cannot use table idem.keys: it has index \"%s\", which idem does not maintain",
								get_rel_name(lfirst_oid(lc))));
		shape->indexes[shape->nindexes++].relid = lfirst_oid(lc);
	}
	list_free(indexes);

	for (i = 0; i < shape->nindexes; i++)
	{
		KeyIndex   *ki = &shape->indexes[i];
		Relation	index = index_open(ki->relid, AccessShareLock);
		MemoryContext old;

		if (i == 0 && (!is_key_index(index, &ki->key_first) ||
					   !index->rd_index->indisvalid))
			refuse_shape(errmsg("idem cannot use table idem.keys: its primary key was changed"),
						 errdetail("It should be a btree on (key, scope) with text_ops and the C collation."));
		if (i > 0 && !is_key_index(index, &ki->key_first))
			refuse_shape(errmsg("idem cannot use table idem.keys: it has index \"%s\", which idem does not maintain",
								RelationGetRelationName(index)),
						 errdetail("idem maintains only its primary key and copies of it, as REINDEX CONCURRENTLY builds them."));
		old = MemoryContextSwitchTo(keytable_cxt);
		ki->info = BuildIndexInfo(index);
		MemoryContextSwitchTo(old);
		index_close(index, NoLock);
	}
}

/*
 * Check that idem.keys (or a shard of it) is as the install script made
 * it, and note its indexes in *shape.
 */
static void
check_shape(Relation rel, KeyShape *shape)
{
	TupleDesc	desc = RelationGetDescr(rel);
	int			i;

	if (rel->rd_rel->relkind != RELKIND_RELATION ||
		rel->rd_rel->relam != HEAP_TABLE_AM_OID)
		refuse_shape(errmsg("idem cannot use table idem.keys: it is not a heap table"));
	if (rel->rd_rel->relpersistence != RELPERSISTENCE_PERMANENT)
		refuse_shape(errmsg("idem cannot use table idem.keys: it is not a logged table"),
					 errdetail("An unlogged table is emptied by a crash, and keys already completed would run again."));
	if (rel->rd_rel->relispartition)
		refuse_shape(errmsg("idem cannot use table idem.keys: it is a partition of another table"),
					 errdetail("idem does not check partition constraints."));
	if (desc->natts != Natts_keys && desc->natts != Natts_keys_1_2)
		refuse_shape(errmsg("idem cannot use table idem.keys: its columns were changed"),
					 errdetail("It has %d columns; idem expects %d.",
							   desc->natts, Natts_keys));
	for (i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (att->attisdropped ||
			strcmp(NameStr(att->attname), key_columns[i].name) != 0 ||
			(att->atttypid != key_columns[i].type &&
			 att->atttypid != key_columns[i].type_1_3) ||
			att->attnotnull != key_columns[i].notnull ||
			att->attgenerated != '\0' ||
			(i < 2 && att->attcollation != C_COLLATION_OID))
			refuse_shape(errmsg("idem cannot use table idem.keys: its columns were changed"),
						 key_columns[i].notnull ?
						 errdetail("Column %d should be \"%s\" of type %s NOT NULL.",
								   i + 1, key_columns[i].name,
								   format_type_be(key_columns[i].type)) :
						 errdetail("Column %d should be \"%s\" of type %s.",
								   i + 1, key_columns[i].name,
								   format_type_be(key_columns[i].type)));
	}
	if (desc->constr != NULL && desc->constr->num_check > 0)
		refuse_shape(errmsg("idem cannot use table idem.keys: it has CHECK constraint \"%s\", which idem does not check",
							desc->constr->check[0].ccname));
	if (rel->trigdesc != NULL && rel->trigdesc->numtriggers > 0)
	{
		Trigger    *trigger = &rel->trigdesc->triggers[0];

		if (OidIsValid(trigger->tgconstraint))
			refuse_shape(errmsg("idem cannot use table idem.keys: it is referenced by foreign key \"%s\", which idem does not check",
								get_constraint_name(trigger->tgconstraint)));
		refuse_shape(errmsg("idem cannot use table idem.keys: it has trigger \"%s\", which idem does not fire",
							trigger->tgname));
	}
	check_indexes(rel, shape);
	shape->relid = RelationGetRelid(rel);
}

/* Check that idem.token_seq is as the install script made it. */
static void
check_token_seq(void)
{
	HeapTuple	seqtup;
	Form_pg_sequence seq;

	seqtup = SearchSysCache1(SEQRELID, ObjectIdGetDatum(token_seq_relid));
	if (!HeapTupleIsValid(seqtup))
		elog(ERROR, "cache lookup failed for sequence %u", token_seq_relid);
	seq = (Form_pg_sequence) GETSTRUCT(seqtup);
	if (seq->seqcache != 1 || seq->seqcycle || seq->seqincrement != 1 ||
		get_rel_persistence(token_seq_relid) != RELPERSISTENCE_PERMANENT)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem cannot use sequence idem.token_seq: it must be logged, with INCREMENT 1, CACHE 1 and NO CYCLE"),
				 errdetail("Fencing tokens must grow across all sessions and crashes.")));
	ReleaseSysCache(seqtup);
}

/*
 * Check idem.keys anew after an invalidation: forget the shapes found
 * before, find out whether Citus distributes the table, and check the
 * table itself unless it is (then its shards are checked as they are
 * used: the distributed table is only Citus's front, and has Citus's
 * truncate trigger).
 */
static void
check_keys(Relation rel)
{
	shard_shapes = NULL;
	keys_shape.nindexes = 0;
	if (keytable_cxt == NULL)
		keytable_cxt = AllocSetContextCreate(CacheMemoryContext,
											 "idem key table",
											 ALLOCSET_SMALL_SIZES);
	else
		MemoryContextReset(keytable_cxt);
	keys_distcol = idem_citus_distribution_column(rel);
	if (keys_distcol == 0)
		check_shape(rel, &keys_shape);
	check_token_seq();
}

/* The shape of a shard of the distributed idem.keys, checked once. */
static KeyShape *
shard_shape(Relation shard)
{
	Oid			relid = RelationGetRelid(shard);
	KeyShape   *shape;
	KeyShape	checked;
	bool		found;
	int			i;

	if (shard_shapes == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(Oid);
		ctl.entrysize = sizeof(KeyShape);
		ctl.hcxt = keytable_cxt;
		shard_shapes = hash_create("idem shard shapes", 64, &ctl,
								   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	shape = hash_search(shard_shapes, &relid, HASH_FIND, NULL);
	if (shape != NULL)
		return shape;
	check_shape(shard, &checked);
	/* The indexes, so that their invalidations are noticed too. */
	for (i = 0; i < checked.nindexes; i++)
	{
		shape = hash_search(shard_shapes, &checked.indexes[i].relid,
							HASH_ENTER, &found);
		*shape = checked;
		shape->relid = checked.indexes[i].relid;
	}
	shape = hash_search(shard_shapes, &relid, HASH_ENTER, &found);
	*shape = checked;
	return shape;
}

/*
 * Open the indexes of shape with the lock kt holds on the table: the
 * primary key, and the copies of it that are ready for inserts (those
 * that are not yet are not maintained, as the executor does).
 */
static void
open_indexes(KeyTable *kt, KeyShape *shape)
{
	int			i;

	kt->nindexes = 0;
	for (i = 0; i < shape->nindexes; i++)
	{
		KeyIndex   *ki = &shape->indexes[i];

		if (i > 0 && !ki->info->ii_ReadyForInserts)
			continue;
		kt->indexes[kt->nindexes] = index_open(ki->relid, kt->lockmode);
		kt->index_infos[kt->nindexes] = ki->info;
		kt->index_key_first[kt->nindexes] = ki->key_first;
		kt->nindexes++;
	}
	kt->pkey = kt->indexes[0];
	kt->pkey_key_first = kt->index_key_first[0];
}

/* Close the indexes open_indexes opened; their locks stay. */
static void
close_indexes(KeyTable *kt)
{
	int			i;

	for (i = 0; i < kt->nindexes; i++)
		index_close(kt->indexes[i], NoLock);
	kt->nindexes = 0;
	kt->pkey = NULL;
}

/*
 * Make kt act on the shard relid of the distributed idem.keys instead of
 * the table itself, whose lock stays.
 */
static void
open_shard(KeyTable *kt, Oid relid)
{
	table_close(kt->rel, NoLock);
	kt->rel = table_open(relid, kt->lockmode);
	open_indexes(kt, shard_shape(kt->rel));
	kt->distributed = true;
	shard_token_floor = 0;
}

/*
 * The lock a call that may write takes on idem.keys: RowExclusiveLock, as
 * INSERT, UPDATE and DELETE do, unless the transaction is read-only (also
 * on a hot standby), where nothing will be written.
 */
LOCKMODE
keytable_write_lockmode(void)
{
	return XactReadOnly ? AccessShareLock : RowExclusiveLock;
}

/*
 * Open idem.keys for a call of the SQL function "what" on (scope, key),
 * with lockmode (AccessShareLock to read, keytable_write_lockmode() for a
 * call that may write) on the table and its indexes until the end of the
 * transaction.  The lock is taken before anything about the table is
 * looked at: taking it processes the invalidations of DDL committed
 * before, so the shape check sees what the write will see, and DDL that
 * would change what a writer must maintain waits for this transaction.
 * scope and key may be NULL (purge, which opens the shards of a
 * distributed table itself).  If Citus distributes the table, the shard
 * that holds the key is opened instead, or the call fails if that shard
 * is on another node.
 */
void
keytable_open(KeyTable *kt, const char *what, text *scope, text *key,
			  LOCKMODE lockmode)
{
	uint64		inval_count;

	kt->rel = open_keys_relation(lockmode);
	kt->lockmode = lockmode;
	inval_count = keys_inval_count;
	if (shape_checked != inval_count + 1)
	{
		check_keys(kt->rel);
		if (inval_count == keys_inval_count)
			shape_checked = inval_count + 1;
	}
	kt->writable = false;
	kt->what = what;
	kt->scope = scope;
	kt->key = key;
	kt->nindexes = 0;
	kt->pkey = NULL;
	kt->distributed = false;
	if (unlikely(keys_distcol != 0))
	{
		if (key != NULL)
			open_shard(kt, idem_citus_local_shard(kt->rel,
												  PointerGetDatum(keys_distcol == Anum_keys_key ? key : scope),
												  what, key));
	}
	else
		open_indexes(kt, &keys_shape);
	kt->slot = table_slot_create(kt->rel, NULL);
}

/* Close what keytable_open opened; the locks stay until the transaction ends. */
void
keytable_close(KeyTable *kt)
{
	ExecDropSingleTupleTableSlot(kt->slot);
	close_indexes(kt);
	table_close(kt->rel, NoLock);
}

/*
 * Every write goes through here first: refuse read-only transactions and
 * recovery, as nextval() does.  The table was opened with the writer's
 * lock (see keytable_write_lockmode), so the shape was checked under it.
 */
void
keytable_prepare_write(KeyTable *kt)
{
	if (kt->writable)
		return;
	PreventCommandIfReadOnly(kt->what);
	PreventCommandIfParallelMode(kt->what);
	PreventCommandDuringRecovery(kt->what);
	if (kt->lockmode < RowExclusiveLock)
		elog(ERROR, "idem.keys was opened for reading only");
	kt->writable = true;
}

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
	scan = idem_index_beginscan(kt->rel, kt->pkey, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	found = index_getnext_slot(scan, ForwardScanDirection, kt->slot);
	index_endscan(scan);
	return found;
}

/*
 * Read the key as a plain SELECT would, without locking it: with the
 * statement's snapshot (a new one per call in READ COMMITTED, the
 * transaction's in REPEATABLE READ and SERIALIZABLE, which also takes the
 * usual SSI predicate locks).  Returns row->found.
 */
bool
keytable_read(KeyTable *kt, KeyRow *row, MemoryContext body_cxt)
{
	Snapshot	snapshot;

	/* See this transaction's own earlier writes, as a new statement would. */
	CommandCounterIncrement();
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	if (fetch_key(kt, snapshot))
	{
		set_row(row, kt->slot, body_cxt);
		if (unlikely(kt->distributed))
			shard_token_floor = Max(shard_token_floor, row->token);
	}
	else
		memset(row, 0, sizeof(KeyRow));
	UnregisterSnapshot(snapshot);
	return row->found;
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
keytable_probe(KeyTable *kt, KeyWaiter *waiter)
{
	SnapshotData snap;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	KeyProbe	result = PROBE_NONE;

	InitDirtySnapshot(snap);
	set_scan_keys(kt, skey);
	scan = idem_index_beginscan(kt->rel, kt->pkey, &snap, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	while (index_getnext_slot(scan, ForwardScanDirection, kt->slot))
	{
		if (TransactionIdIsValid(snap.xmin))
		{
			/* Being inserted: whoever deletes an older version, wait for this. */
			waiter->xid = snap.xmin;
			waiter->spec_token = snap.speculativeToken;
			waiter->tid = kt->slot->tts_tid;
			waiter->deleting = false;
			result = PROBE_IN_PROGRESS;
			break;
		}
		if (TransactionIdIsValid(snap.xmax))
		{
			if (result != PROBE_IN_PROGRESS)
			{
				waiter->xid = snap.xmax;
				waiter->spec_token = 0;
				waiter->tid = kt->slot->tts_tid;
				waiter->deleting = true;
			}
			result = PROBE_IN_PROGRESS;
			continue;
		}
		if (result != PROBE_IN_PROGRESS)
		{
			waiter->tid = kt->slot->tts_tid;
			result = PROBE_COMMITTED;
		}
	}
	index_endscan(scan);
	return result;
}

/*
 * Read the key as it is now, for a claim in READ COMMITTED: one look with
 * a dirty snapshot finds the latest committed version of its row (or this
 * transaction's own), left in *row, and whether another transaction is
 * inserting, changing or deleting the key, as keytable_probe reports it.
 * Such a transaction's new version is not in *row: until it commits, the
 * committed version is what callers answer from, as a new snapshot would
 * show it.  Without snapshot: no SSI predicate locks, which READ
 * COMMITTED does not take anyway.
 */
KeyProbe
keytable_look(KeyTable *kt, KeyRow *row, KeyWaiter *waiter,
			  MemoryContext body_cxt)
{
	SnapshotData snap;
	ScanKeyData skey[2];
	IndexScanDesc scan;
	KeyProbe	result = PROBE_NONE;

	row->found = false;
	InitDirtySnapshot(snap);
	set_scan_keys(kt, skey);
	scan = idem_index_beginscan(kt->rel, kt->pkey, &snap, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	while (index_getnext_slot(scan, ForwardScanDirection, kt->slot))
	{
		if (TransactionIdIsValid(snap.xmin))
		{
			/* Another transaction's new version: wait for it, if anything. */
			if (result != PROBE_IN_PROGRESS || waiter->deleting)
			{
				waiter->xid = snap.xmin;
				waiter->spec_token = snap.speculativeToken;
				waiter->tid = kt->slot->tts_tid;
				waiter->deleting = false;
			}
			result = PROBE_IN_PROGRESS;
			if (row->found)
				break;
			continue;			/* the committed version may come next */
		}
		set_row(row, kt->slot, body_cxt);
		if (unlikely(kt->distributed))
			shard_token_floor = Max(shard_token_floor, row->token);
		if (TransactionIdIsValid(snap.xmax))
		{
			/* Being changed or deleted: is there a new version too? */
			if (result != PROBE_IN_PROGRESS)
			{
				waiter->xid = snap.xmax;
				waiter->spec_token = 0;
				waiter->tid = row->tid;
				waiter->deleting = true;
			}
			result = PROBE_IN_PROGRESS;
			continue;
		}
		/* Nobody is changing it: no other live version can exist. */
		if (result != PROBE_IN_PROGRESS)
			result = PROBE_COMMITTED;
		break;
	}
	index_endscan(scan);
	return result;
}

/*
 * Wait for the transaction a probe found inserting or deleting the key.
 * A version still being inserted speculatively is waited for only until
 * its insertion is confirmed or undone, which happens before its
 * transaction ends; returns true if the wait lasted until the transaction
 * ended, false if it was such a short wait.
 */
bool
keytable_wait(KeyTable *kt, KeyWaiter *waiter)
{
	ErrorContextCallback errcb;
	bool		speculative = waiter->spec_token != 0;

	push_wait_context(kt, &errcb);
	if (speculative)
		SpeculativeInsertionWait(waiter->xid, waiter->spec_token);
	else
		XactLockTableWait(waiter->xid, kt->rel, &waiter->tid,
						  XLTW_InsertIndexUnique);
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
		slot_getsomeattrs(kt->slot, Anum_keys_key);
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
	/* Left out by heap_form_tuple from a table without the column. */
	nulls[Anum_keys_claimed_by - 1] = !kv->claimed_by.bound;
	if (kv->claimed_by.bound && desc->natts >= Anum_keys_claimed_by)
	{
		if (TupleDescAttr(desc, Anum_keys_claimed_by - 1)->atttypid == TEXTOID)
			values[Anum_keys_claimed_by - 1] =
				CStringGetTextDatum(NameStr(kv->claimed_by.rolename));
		else
			values[Anum_keys_claimed_by - 1] =
				ObjectIdGetDatum(OidIsValid(kv->claimed_by.roleid) ?
								 kv->claimed_by.roleid :
								 keytable_claimant_role(&kv->claimed_by));
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

/*
 * The next fencing token: from idem.token_seq, or, when Citus distributes
 * idem.keys (as found by the keytable_open this token is drawn for), from
 * Citus's node clock, and above every token read from the key's row: that
 * row may have been written on another node, whose clock was ahead,
 * before its shard moved here.
 */
int64
keytable_next_token(void)
{
	if (unlikely(keys_distcol != 0))
	{
		int64		token = idem_citus_next_token();

		return token > shard_token_floor ? token : shard_token_floor + 1;
	}
	/*
	 * Lock the sequence before looking at it, as nextval does: an ALTER
	 * SEQUENCE committed since the shape check is seen, and checked.
	 */
	LockRelationOid(token_seq_relid, RowExclusiveLock);
	if (shape_checked != keys_inval_count + 1)
		check_token_seq();
	return nextval_internal(token_seq_relid, false);
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

/* A claimant for a claim the current user makes. */
void
keytable_current_claimant(KeyClaimant *claimant)
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
	claimant->bound = true;
	claimant->roleid = roleid;
	claimant->rolename = current_rolename;
}

/*
 * The role a claimant stands for, InvalidOid if it no longer exists (a
 * role dropped, or renamed, since it made the claim).
 */
Oid
keytable_claimant_role(KeyClaimant *claimant)
{
	if (OidIsValid(claimant->roleid))
		return claimant->roleid;
	if (NameStr(claimant->rolename)[0] == '\0')
		return InvalidOid;
	return get_role_oid(NameStr(claimant->rolename), true);
}

/*
 * Insert the key as a new row with the values of kv, drawing its token.
 * Returns false, having inserted nothing and without waiting, if another
 * transaction inserted the key first; keytable_probe then tells who.
 *
 * The token is drawn before the insertion, but kept only if no other
 * token was drawn until the row was ours: otherwise another claim of this
 * key could have got a greater token, committed and released the key in
 * between, and the row gets a token drawn now, greater than that one.
 */
bool
keytable_insert(KeyTable *kt, KeyValues *kv)
{
	TransactionId xid;
	uint32		spec_token;
	HeapTuple	tuple;
	bool		unique;

	keytable_prepare_write(kt);
	xid = GetCurrentTransactionId();
	kv->token = keytable_next_token();
	tuple = form_row(kt, kv, NULL);

	spec_token = SpeculativeInsertionLockAcquire(xid);
	HeapTupleHeaderSetSpeculativeToken(tuple->t_data, spec_token);
	heap_insert(kt->rel, tuple, GetCurrentCommandId(true),
				HEAP_INSERT_SPECULATIVE, NULL);
	unique = insert_index_entries(kt, &tuple->t_self, UNIQUE_CHECK_PARTIAL);
	if (unique)
		heap_finish_speculative(kt->rel, &tuple->t_self);
	else
		heap_abort_speculative(kt->rel, &tuple->t_self);
	SpeculativeInsertionLockRelease(xid);

	if (unique)
	{
		int64		next = keytable_next_token();

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
			if (index_new_version)
				insert_index_entries(kt, &newtuple->t_self, UNIQUE_CHECK_YES);
			heap_freetuple(newtuple);
		}
	}
	heap_freetuple(tuple);
	return unique;
}

/*
 * Read the key for a write by its holder: as keytable_read, but in
 * REPEATABLE READ and SERIALIZABLE a version the transaction's snapshot
 * cannot see (claimed since) is a serialization failure, not "no key".
 */
bool
keytable_read_for_write(KeyTable *kt, KeyRow *row, MemoryContext body_cxt)
{
	KeyWaiter	waiter;

	if (keytable_read(kt, row, body_cxt) || !IsolationUsesXactSnapshot())
		return row->found;
	for (;;)
	{
		switch (keytable_probe(kt, &waiter))
		{
			case PROBE_NONE:
				return false;
			case PROBE_IN_PROGRESS:
				if (!TransactionIdIsCurrentTransactionId(waiter.xid))
				{
					keytable_wait(kt, &waiter);
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
 * Replace the version of the key's row in *row, as keytable_read found it,
 * with the values of kv, as UPDATE does: if another transaction is
 * changing that version, wait for it (or return KEYWRITE_BUSY if !wait);
 * if it was changed since, write nothing.  A row locked only by this
 * transaction itself is written without waiting.
 */
KeyWrite
keytable_update(KeyTable *kt, KeyRow *row, KeyValues *kv, bool wait)
{
	HeapTuple	tuple;
	TM_FailureData tmfd;
	TM_Result	result;
	bool		index_new_version;
	ErrorContextCallback errcb;

	keytable_prepare_write(kt);
	CheckCmdReplicaIdentity(kt->rel, CMD_UPDATE);
	tuple = form_row(kt, kv, &row->tid);
	push_wait_context(kt, &errcb);
	result = idem_heap_update(kt->rel, &row->tid, tuple,
							  GetCurrentCommandId(true), wait, &tmfd,
							  &index_new_version);
	if (result == TM_BeingModified && !wait &&
		held_only_by_me(kt, &row->tid))
		result = idem_heap_update(kt->rel, &row->tid, tuple,
								  GetCurrentCommandId(true), true, &tmfd,
								  &index_new_version);
	error_context_stack = errcb.previous;
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

/* Delete the version of the key's row in *row, as keytable_update writes. */
KeyWrite
keytable_delete(KeyTable *kt, KeyRow *row, bool wait)
{
	TM_Result	result;
	ErrorContextCallback errcb;

	keytable_prepare_write(kt);
	CheckCmdReplicaIdentity(kt->rel, CMD_DELETE);
	push_wait_context(kt, &errcb);
	result = delete_version(kt, &row->tid, wait);
	error_context_stack = errcb.previous;
	return write_result(kt, result);
}

/*
 * Delete up to limit rows of kt->rel that expired at or before now, walking
 * it in physical order from *cursor, which is moved past the last row
 * looked at, and reading at most *pages pages (which is decreased by the
 * pages read), so that a table with few expired rows is walked in many
 * short transactions rather than one long one.  *at_end is set if the scan
 * reached the end of the table.  A row is deleted only if the version
 * found expired is still the latest and no transaction holds it: the
 * delete never waits.
 *
 * The scan reads through a ring of buffers (the bulk-read strategy, as a
 * sequential scan of a table larger than a quarter of shared_buffers
 * does), so a pass over a large table does not evict the rest of the
 * cache.
 */
static int64
purge_relation(KeyTable *kt, TimestampTz now, int64 limit, ItemPointer cursor,
			   BlockNumber *pages, bool *at_end)
{
	BlockNumber first = ItemPointerGetBlockNumberNoCheck(cursor);
	BlockNumber nblocks;
	BlockNumber end;
	ItemPointerData last;
	Snapshot	snapshot;
	TableScanDesc scan;
	int64		n = 0;

	keytable_prepare_write(kt);
	CheckCmdReplicaIdentity(kt->rel, CMD_DELETE);

	nblocks = RelationGetNumberOfBlocks(kt->rel);
	if (first >= nblocks)
	{
		*at_end = true;
		return 0;
	}
	end = (nblocks - first > *pages) ? first + *pages : nblocks;

	/* See this transaction's earlier writes; delete with a later command id. */
	CommandCounterIncrement();
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	ItemPointerSet(&last, end - 1, MaxOffsetNumber);
	/* table_beginscan_tidrange, with the strategy a sequential scan may use */
	scan = kt->rel->rd_tableam->scan_begin(kt->rel, snapshot, 0, NULL, NULL,
										   SO_TYPE_TIDRANGESCAN |
										   SO_ALLOW_PAGEMODE |
										   SO_ALLOW_STRAT);
	kt->rel->rd_tableam->scan_set_tidrange(scan, cursor, &last);
	*at_end = (end == nblocks);
	while (table_scan_getnextslot_tidrange(scan, ForwardScanDirection, kt->slot))
	{
		ItemPointerData tid = kt->slot->tts_tid;
		bool		isnull;

		if (DatumGetTimestampTz(slot_getattr(kt->slot, Anum_keys_expires_at,
											 &isnull)) > now)
			continue;
		if (delete_version(kt, &tid, false) == TM_Ok)
			n++;
		if (n >= limit)
		{
			/* The next batch starts after this row. */
			ItemPointerSet(cursor, ItemPointerGetBlockNumber(&tid),
						   ItemPointerGetOffsetNumber(&tid) + 1);
			*at_end = false;
			end = ItemPointerGetBlockNumber(&tid) + 1;
			break;
		}
	}
	table_endscan(scan);
	UnregisterSnapshot(snapshot);
	/* The next batch starts after the last page read. */
	if (n < limit)
		ItemPointerSet(cursor, end, 0);
	*pages -= end - first;
	elog(DEBUG1, "idem purge batch of \"%s\": blocks %u to %u of %u, %lld rows deleted",
		 RelationGetRelationName(kt->rel), first, end - 1, nblocks,
		 (long long) n);
	return n;
}

/*
 * The shard whose rows *cursor points into, when Citus distributes
 * idem.keys: purge walks this node's shards in shard id order, and the
 * cursor (0,0) starts over at the first.
 */
static int64 purge_shardid = 0;

/*
 * Delete up to limit rows that expired at or before now, walking the table
 * in physical order from *cursor, which is moved past the last row looked
 * at, and reading at most IDEM_PURGE_BATCH_PAGES pages (over all the
 * shards it walks, if Citus distributes the table).  *at_end is set if the
 * scan reached the end of the table (of the last shard placed on this
 * node, if Citus distributes it).
 */
int64
keytable_purge_batch(TimestampTz now, int limit, ItemPointer cursor,
					 bool *at_end)
{
	KeyTable	kt;
	int64		n = 0;
	BlockNumber pages = IDEM_PURGE_BATCH_PAGES;
	List	   *shards;
	ListCell   *lc;

	keytable_open(&kt, "idem_purge()", NULL, NULL, keytable_write_lockmode());
	if (likely(keys_distcol == 0))
	{
		n = purge_relation(&kt, now, limit, cursor, &pages, at_end);
		keytable_close(&kt);
		return n;
	}

	/* Distributed: the shards placed here; the table itself stays empty. */
	if (ItemPointerGetBlockNumberNoCheck(cursor) == 0 &&
		ItemPointerGetOffsetNumberNoCheck(cursor) == 0)
		purge_shardid = 0;
	shards = idem_citus_local_shards(kt.rel);
	*at_end = true;
	foreach(lc, shards)
	{
		IdemShard  *shard = lfirst(lc);
		bool		shard_at_end;

		if (shard->shardid < purge_shardid)
			continue;
		if (shard->shardid > purge_shardid)
		{
			ItemPointerSet(cursor, 0, 0);
			purge_shardid = shard->shardid;
		}
		ExecDropSingleTupleTableSlot(kt.slot);
		close_indexes(&kt);
		open_shard(&kt, shard->relid);
		kt.slot = table_slot_create(kt.rel, NULL);
		kt.writable = false;
		n += purge_relation(&kt, now, limit - n, cursor, &pages, &shard_at_end);
		if (!shard_at_end || n >= limit || pages == 0)
		{
			*at_end = false;
			break;
		}
	}
	if (*at_end)
		purge_shardid = 0;
	keytable_close(&kt);
	return n;
}

/* A key for an error message: at most 64 bytes, cut at a character. */
char *
idem_key_for_message(text *key)
{
	const char *s;
	int			len;
	int			cut;

	if (key == NULL)
		return pstrdup("");
	s = VARDATA_ANY(key);
	len = VARSIZE_ANY_EXHDR(key);
	if (len <= 64)
		return text_to_cstring(key);
	cut = pg_mbcliplen(s, len, 64);
	return psprintf("%.*s...", cut, s);
}
