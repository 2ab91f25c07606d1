/*-------------------------------------------------------------------------
 *
 * keyrel.c
 *	  The relation idem.keys and its token sequence: finding them, the
 *	  lock protocol, the shape check, and the shard of a key when Citus
 *	  distributes the table.
 *
 * idem reads and writes rows of idem.keys directly in the heap and its
 * indexes (keyrows.c), as execReplication.c does for logical replication,
 * instead of running statements.  The executor's own checks are then ours
 * to make; those about the relation are made here, when a call opens it:
 *
 * - Lock before you look.  idem_keytable_open takes the lock the call
 *	 will write with (RowExclusiveLock; AccessShareLock in a read-only
 *	 transaction, which writes nothing) before anything about the table is
 *	 looked at, as the executor and logicalrep_rel_open do: taking it
 *	 processes the invalidations of DDL committed before, and DDL that
 *	 would change what a writer maintains (CREATE INDEX, also
 *	 CONCURRENTLY) waits for this transaction.  The table is found by name
 *	 under that lock, so a table dropped and created again is found anew.
 * - The shape check, run again after every invalidation of the table, its
 *	 indexes or the sequence: the nine columns (eight before 1.3; names,
 *	 types, NOT NULL, no dropped column), a logged heap table that is no
 *	 partition, a btree primary key on (key, scope) with text_ops and the C
 *	 collation, no other index but copies of it (REINDEX CONCURRENTLY's,
 *	 maintained while ready for inserts), no CHECK constraint, no trigger
 *	 (a foreign key referencing the table is one), and a logged token
 *	 sequence with INCREMENT 1, CACHE 1 and NO CYCLE.  A table altered
 *	 beyond that is refused with 55000, naming what idem would not
 *	 maintain, rather than written past.
 * - Every write first refuses read-only transactions and recovery (25006,
 *	 as nextval() does); relation locks are held until the end of the
 *	 transaction.
 * - The token sequence is locked before a token is drawn, and checked
 *	 again if that brought invalidations.
 *
 * When Citus distributes idem.keys (see citus.c and idem_distribute()),
 * a call acts on the shard that holds the key on this node instead of the
 * distributed table, whose own heap stays empty: the shard is resolved and
 * locked, a key whose shard is placed elsewhere is refused, and each
 * shard's shape is checked as above.  Tokens then come from Citus's node
 * clock instead of the node's own idem.token_seq, and a takeover's token
 * is kept above the key's last one, so that tokens per key grow across
 * nodes too.  Whether the table is distributed is decided with the shape
 * check, once per invalidation: without Citus nothing is added per call.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
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
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/resowner.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

#include "citus.h"
#include "keyrel.h"

/*
 * The columns of idem.keys, as sql/idem--1.0.sql creates them, the update
 * to 1.3 adds claimed_by (a role's OID) and the update to 1.4 makes it the
 * role's name and adds phase and phase_data; the update to 1.6 adds
 * remember_until, the update to 1.7 holder.
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
	{"phase", TEXTOID, TEXTOID, false},
	{"phase_data", BYTEAOID, BYTEAOID, false},
	{"remember_until", TIMESTAMPTZOID, TIMESTAMPTZOID, false},
	{"holder", TEXTOID, TEXTOID, false},
};

/* Identity of the table, cached until an invalidation touches it. */
static Oid	keys_relid = InvalidOid;
static Oid	token_seq_relid = InvalidOid;
static bool callbacks_registered = false;
/* Bumped by every invalidation of the table, its indexes or the sequence. */
static uint64 keys_inval_count = 0;
/* keys_inval_count when the shape was last found good, plus one. */
static uint64 shape_checked = 0;

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
	KeyIndex	indexes[IDEM_MAX_SHAPE_INDEXES];
} KeyShape;

/* Memory of the shape checks; reset when the shape is checked anew. */
static MemoryContext keytable_cxt = NULL;
static KeyShape keys_shape;
/* The column Citus distributes idem.keys by, 0 if it does not. */
static AttrNumber keys_distcol = 0;
/*
 * Shards of a distributed idem.keys checked since the last invalidation,
 * by relation OID; their indexes are entered too, with relid as the
 * index's OID, so that the relcache callback finds them.
 */
static HTAB *shard_shapes = NULL;

/* What a transaction keeps open: see the comment above idem_keytable_cache_close. */
typedef struct KeyRelCache
{
	bool		open;			/* holds the references below */
	bool		complete;		/* all of them, after a good shape check */
	bool		locked;			/* lockmode is held on all of them */
	LOCKMODE	lockmode;
	uint64		inval_count;	/* keys_inval_count when opened */
	Relation	rel;
	int			nindexes;
	Relation	indexes[IDEM_MAX_INDEXES];
	IndexInfo  *index_infos[IDEM_MAX_INDEXES];
	bool		index_key_first[IDEM_MAX_INDEXES];
	/* A scan of the primary key: see idem_keyrel_begin_scan. */
	IndexScanDesc scan;
	bool		scan_busy;		/* a call is using it; its pins are held */
	/* The slot of the calls: see kept_slot. */
	TupleTableSlot *slot;
	bool		slot_busy;		/* a call is using it */
} KeyRelCache;

static KeyRelCache keys_cache;
static bool keys_cache_enabled = false;

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
 * Open a relation already locked, its reference held by owner (the
 * transaction's, for what it keeps open; see KeyRelCache).
 */
static Relation
open_held_by(Oid relid, ResourceOwner owner)
{
	ResourceOwner save = CurrentResourceOwner;
	Relation	rel;

	CurrentResourceOwner = owner;
	rel = relation_open(relid, NoLock);
	CurrentResourceOwner = save;
	return rel;
}

/*
 * Lock idem.keys and open it.  The OID is looked up again if the lock's
 * invalidations show that the table went away since it was cached (DROP
 * and CREATE EXTENSION in another session), as RangeVarGetRelidExtended
 * does.
 */
static Relation
open_keys_relation(LOCKMODE lockmode, ResourceOwner owner)
{
	int			attempt;

	for (attempt = 0; attempt < 10; attempt++)
	{
		Oid			relid = lookup_keys_relid();

		LockRelationOid(relid, lockmode);
		if (relid == keys_relid)
			return open_held_by(relid, owner);
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
 * Too many copies of the primary key, left by cancelled REINDEX
 * CONCURRENTLY: say so, and how to drop them.  55000, as refuse_shape.
 */
#define refuse_copies(what, n, limit, pkid) \
	ereport(ERROR, \
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE), \
			 errmsg("idem cannot use table idem.keys: it has %d copies of its primary key %s, more than the %d idem allows", \
					(n), (what), (limit)), \
			 errdetail("Each REINDEX CONCURRENTLY that is cancelled or fails leaves its copy behind, not valid, named like \"%s_ccnew\".", \
					   get_rel_name(pkid)), \
			 errhint("Drop the copies that are not valid with DROP INDEX CONCURRENTLY: they are SELECT indexrelid::regclass FROM pg_index WHERE indrelid = 'idem.keys'::regclass AND NOT indisvalid.")))

/*
 * Check the indexes of idem.keys (or a shard of it) and note them in
 * *shape, the primary key first, with IndexInfos built in keytable_cxt.
 * Besides the primary key, only copies of it are accepted: REINDEX
 * CONCURRENTLY builds one beside it and leaves it behind, invalid, when it
 * is cancelled.  Copies ready for inserts are maintained as the executor
 * maintains every index, up to IDEM_MAX_INDEXES indexes in all; copies not
 * yet ready are not maintained (nor by the executor) and do not count
 * towards that, but are noted, so that their invalidation when they
 * become ready is noticed.  Any other index would not be maintained, and
 * is refused.
 */
static void
check_indexes(Relation rel, KeyShape *shape)
{
	Oid			pkid = idem_primary_key_index(rel);
	List	   *indexes;
	ListCell   *lc;
	int			ncopies;
	int			nready = 0;
	int			i;

	if (!OidIsValid(pkid))
		refuse_shape(errmsg("idem cannot use table idem.keys: it has no primary key"));
	shape->nindexes = 1;
	shape->indexes[0].relid = pkid;
	indexes = RelationGetIndexList(rel);
	ncopies = list_length(indexes) - 1;
	if (ncopies >= IDEM_MAX_SHAPE_INDEXES)
		refuse_copies("in all", ncopies, IDEM_MAX_SHAPE_INDEXES - 1, pkid);
	foreach(lc, indexes)
	{
		if (lfirst_oid(lc) != pkid)
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
		if (i > 0 && index->rd_index->indisready)
			nready++;
		old = MemoryContextSwitchTo(keytable_cxt);
		ki->info = BuildIndexInfo(index);
		MemoryContextSwitchTo(old);
		index_close(index, NoLock);
	}
	if (nready >= IDEM_MAX_INDEXES)
		refuse_copies("ready for inserts", nready, IDEM_MAX_INDEXES - 1, pkid);
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
	if (desc->natts != Natts_keys && desc->natts != Natts_keys_1_6 &&
		desc->natts != Natts_keys_1_5 &&
		desc->natts != Natts_keys_1_3 && desc->natts != Natts_keys_1_2)
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
open_indexes(KeyTable *kt, KeyShape *shape, bool keep)
{
	ResourceOwner owner = keep ? TopTransactionResourceOwner : CurrentResourceOwner;
	int			i;

	kt->nindexes = 0;
	for (i = 0; i < shape->nindexes; i++)
	{
		KeyIndex   *ki = &shape->indexes[i];

		if (i > 0 && !ki->info->ii_ReadyForInserts)
			continue;
		LockRelationOid(ki->relid, kt->lockmode);
		kt->indexes[kt->nindexes] = open_held_by(ki->relid, owner);
		if (keep)
			keys_cache.indexes[keys_cache.nindexes++] = kt->indexes[kt->nindexes];
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
	open_indexes(kt, shard_shape(kt->rel), false);
	kt->distributed = true;
	kt->token_floor = 0;
}

/*
 * idem.keys and its indexes, kept open for the rest of the transaction.
 *
 * Every call on a key would otherwise look up, lock and open the table and
 * its indexes, and close them again: a batch of calls in one statement (a
 * LATERAL join), or a claim and its completion in one transaction, pays
 * for that on every call, where the executor opens a relation once per
 * statement.  The first call of a transaction opens them with references
 * held by the transaction's resource owner, and keeps them, with a slot
 * and a scan of the primary key that the calls reuse (as a nested loop
 * rescans its inner index scan; see idem_keyrel_begin_scan); the later
 * calls use them while
 *
 * - the lock the call needs is held: locks stay until the transaction
 *	 ends, except those a subtransaction took, which go with its abort; so
 *	 after any subtransaction's abort the next call takes its locks again
 *	 (lock before you look);
 * - no invalidation touched the table, its indexes or the sequence since
 *	 they were opened (the shape check's count), checked after the lock:
 *	 DDL committed by others is seen when a lock is taken.
 *
 * The references are dropped before any utility statement, so that DDL on
 * the table in the same transaction finds it unused as without them
 * (purge.c's ProcessUtility hook calls idem_keytable_cache_close), and
 * before the transaction commits or prepares; an abort releases them with
 * the resource owner.  Only with shared_preload_libraries, where that hook
 * is installed; and not for a distributed table, whose shards differ per
 * key.
 */

/*
 * End the scan and drop the slot the transaction keeps, with
 * CurrentResourceOwner the transaction's.  A scan or slot a call was
 * using when an error interrupted it still names the buffers it had
 * pinned, which the error's cleanup releases (with the resource owner
 * that pinned them); such a scan or slot is left to TopTransactionContext,
 * and only its reference to the index or the tuple descriptor is given
 * back.
 */
static void
drop_scan_and_slot(void)
{
	IndexScanDesc scan = keys_cache.scan;
	TupleTableSlot *slot = keys_cache.slot;

	if (scan != NULL)
	{
		keys_cache.scan = NULL;
		if (keys_cache.scan_busy)
			RelationDecrementReferenceCount(scan->indexRelation);
		else
			index_endscan(scan);
		keys_cache.scan_busy = false;
	}
	if (slot != NULL)
	{
		keys_cache.slot = NULL;
		if (keys_cache.slot_busy)
			ReleaseTupleDesc(slot->tts_tupleDescriptor);
		else
			ExecDropSingleTupleTableSlot(slot);
		keys_cache.slot_busy = false;
	}
}

/* Drop the references the transaction keeps, if any. */
void
idem_keytable_cache_close(void)
{
	ResourceOwner save;
	int			i;

	if (!keys_cache.open)
		return;
	keys_cache.open = false;
	save = CurrentResourceOwner;
	CurrentResourceOwner = TopTransactionResourceOwner;
	drop_scan_and_slot();
	for (i = 0; i < keys_cache.nindexes; i++)
		index_close(keys_cache.indexes[i], NoLock);
	table_close(keys_cache.rel, NoLock);
	CurrentResourceOwner = save;
}

static void
cache_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			/*
			 * Released with TopTransactionResourceOwner, without warnings;
			 * the scan's memory goes with TopTransactionContext.
			 */
			keys_cache.open = false;
			keys_cache.scan = NULL;
			keys_cache.scan_busy = false;
			keys_cache.slot = NULL;
			keys_cache.slot_busy = false;
			break;
		default:
			/* before the commit's release, which warns of what is left */
			idem_keytable_cache_close();
			break;
	}
}

/*
 * The locks a subtransaction took go with its abort, and so do the pins
 * of a scan or slot its error interrupted.
 */
static void
cache_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					   SubTransactionId parentSubid, void *arg)
{
	if (event == SUBXACT_EVENT_ABORT_SUB)
	{
		keys_cache.locked = false;
		if (keys_cache.scan_busy || keys_cache.slot_busy)
		{
			ResourceOwner save = CurrentResourceOwner;

			CurrentResourceOwner = TopTransactionResourceOwner;
			drop_scan_and_slot();
			CurrentResourceOwner = save;
		}
	}
}

/* Keep relations open per transaction (with shared_preload_libraries). */
void
idem_keytable_cache_enable(void)
{
	RegisterXactCallback(cache_xact_callback, NULL);
	RegisterSubXactCallback(cache_subxact_callback, NULL);
	keys_cache_enabled = true;
}

/*
 * Keep the relations kt opened, held by the transaction's resource owner:
 * noted in keys_cache as they were opened (so that an error on the way,
 * caught by a subtransaction, leaves nothing behind that would not be
 * closed), now usable.
 */
static void
cache_keep(KeyTable *kt, uint64 inval_count)
{
	int			i;

	Assert(keys_cache.open && keys_cache.rel == kt->rel &&
		   keys_cache.nindexes == kt->nindexes);
	for (i = 0; i < kt->nindexes; i++)
	{
		keys_cache.index_infos[i] = kt->index_infos[i];
		keys_cache.index_key_first[i] = kt->index_key_first[i];
	}
	keys_cache.complete = true;
	keys_cache.lockmode = kt->lockmode;
	keys_cache.locked = true;
	keys_cache.inval_count = inval_count;
	keys_cache.open = true;
	kt->cached = true;
}

/*
 * The slot for a call on the relations the transaction keeps open: kept
 * with them, emptied by idem_keytable_close (which releases the pin of the
 * version it holds), instead of made and dropped per call.  A call made
 * while another is using it (none does now) gets one of its own.
 */
static TupleTableSlot *
kept_slot(KeyTable *kt)
{
	if (keys_cache.slot_busy)
		return table_slot_create(kt->rel, NULL);
	if (keys_cache.slot == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopTransactionContext);
		ResourceOwner save = CurrentResourceOwner;

		CurrentResourceOwner = TopTransactionResourceOwner;
		keys_cache.slot = table_slot_create(kt->rel, NULL);
		CurrentResourceOwner = save;
		MemoryContextSwitchTo(old);
	}
	keys_cache.slot_busy = true;
	return keys_cache.slot;
}

/*
 * Open kt on the relations the transaction keeps open, if they can be
 * used (see KeyRelCache); false, having dropped them if they cannot, to
 * open the table anew.
 */
static bool
open_cached(KeyTable *kt, LOCKMODE lockmode)
{
	int			i;

	if (!keys_cache.open)
		return false;
	if (!keys_cache.complete)
	{
		/* an error stopped the call that was opening them */
		idem_keytable_cache_close();
		return false;
	}
	if (!keys_cache.locked || keys_cache.lockmode < lockmode)
	{
		LockRelationOid(RelationGetRelid(keys_cache.rel), lockmode);
		for (i = 0; i < keys_cache.nindexes; i++)
			LockRelationOid(RelationGetRelid(keys_cache.indexes[i]), lockmode);
		keys_cache.lockmode = lockmode;
		keys_cache.locked = true;
	}
	if (keys_cache.inval_count != keys_inval_count ||
		shape_checked != keys_inval_count + 1 || keys_distcol != 0)
	{
		idem_keytable_cache_close();
		return false;
	}
	kt->rel = keys_cache.rel;
	kt->lockmode = keys_cache.lockmode;
	kt->nindexes = keys_cache.nindexes;
	for (i = 0; i < keys_cache.nindexes; i++)
	{
		kt->indexes[i] = keys_cache.indexes[i];
		kt->index_infos[i] = keys_cache.index_infos[i];
		kt->index_key_first[i] = keys_cache.index_key_first[i];
	}
	kt->pkey = kt->indexes[0];
	kt->pkey_key_first = kt->index_key_first[0];
	kt->cached = true;
	kt->slot = kept_slot(kt);
	return true;
}

/*
 * The lock a call that may write takes on idem.keys: RowExclusiveLock, as
 * INSERT, UPDATE and DELETE do, unless the transaction is read-only (also
 * on a hot standby), where nothing will be written.
 */
LOCKMODE
idem_keytable_write_lockmode(void)
{
	return XactReadOnly ? AccessShareLock : RowExclusiveLock;
}

/*
 * Open idem.keys for a call of the SQL function "what" on (scope, key),
 * with lockmode (AccessShareLock to read, idem_keytable_write_lockmode() for a
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
idem_keytable_open(KeyTable *kt, const char *what, text *scope, text *key,
				   LOCKMODE lockmode)
{
	uint64		inval_count;
	bool		keep;
	ResourceOwner owner;

	kt->writable = false;
	kt->what = what;
	kt->scope = scope;
	kt->key = key;
	kt->distributed = false;
	kt->token_floor = 0;
	kt->cached = false;
	if (key != NULL && open_cached(kt, lockmode))
		return;

	/* A call on a key opens the relations for the transaction to keep. */
	keep = key != NULL && keys_cache_enabled && TopTransactionResourceOwner != NULL;
	owner = keep ? TopTransactionResourceOwner : CurrentResourceOwner;
	kt->rel = open_keys_relation(lockmode, owner);
	if (keep)
	{
		keys_cache.rel = kt->rel;
		keys_cache.nindexes = 0;
		keys_cache.complete = false;
		keys_cache.open = true;
	}
	kt->lockmode = lockmode;
	inval_count = keys_inval_count;
	if (shape_checked != inval_count + 1)
	{
		check_keys(kt->rel);
		if (inval_count == keys_inval_count)
			shape_checked = inval_count + 1;
	}
	kt->nindexes = 0;
	kt->pkey = NULL;
	if (unlikely(keys_distcol != 0))
	{
		if (keep)
		{
			/* shards differ per key: nothing is kept, rel is the call's */
			Relation	rel = open_held_by(RelationGetRelid(kt->rel),
										   CurrentResourceOwner);

			idem_keytable_cache_close();
			kt->rel = rel;
			keep = false;
		}
		if (key != NULL)
			open_shard(kt, idem_citus_local_shard(kt->rel,
												  PointerGetDatum(keys_distcol == Anum_keys_key ? key : scope),
												  what, key));
	}
	else
		open_indexes(kt, &keys_shape, keep);
	if (keep)
	{
		cache_keep(kt, inval_count);
		kt->slot = kept_slot(kt);
	}
	else
		kt->slot = table_slot_create(kt->rel, NULL);
}

/*
 * Close what idem_keytable_open opened; the locks stay until the
 * transaction ends, and so does what the transaction keeps open.
 */
void
idem_keytable_close(KeyTable *kt)
{
	if (kt->slot == keys_cache.slot)
	{
		/* release the version's buffer pin; keep the slot */
		ExecClearTuple(kt->slot);
		keys_cache.slot_busy = false;
	}
	else
		ExecDropSingleTupleTableSlot(kt->slot);
	if (kt->cached)
		return;
	close_indexes(kt);
	table_close(kt->rel, NoLock);
}

/*
 * A scan of the primary key for kt's key (skey) with snapshot, which must
 * stay valid until the scan ends; read it with idem_keyrel_scan_next, end
 * it with idem_keyrel_end_scan before the call returns.
 *
 * On the relations the transaction keeps open, the scan is kept too, and
 * a later call rescans it, as a nested loop rescans its inner index scan,
 * instead of beginning and ending one per call.  Each rescan gives it the
 * call's snapshot (btree and heap read it from the scan at every rescan
 * and fetch; no state derived from it outlives a rescan).  Between calls
 * it holds no buffer pin and no snapshot: idem_keyrel_end_scan releases
 * the pins, as a rescan does.  Its memory is the transaction's, and so is
 * its reference to the index; idem_keytable_cache_close ends it with the
 * relations.
 */
IndexScanDesc
idem_keyrel_begin_scan(KeyTable *kt, ScanKey skey, Snapshot snapshot)
{
	IndexScanDesc scan;
	MemoryContext old;

	if (!kt->cached || keys_cache.scan_busy)
	{
		scan = idem_index_beginscan(kt->rel, kt->pkey, snapshot, 2, 0);
		index_rescan(scan, skey, 2, NULL, 0);
		return scan;
	}
	Assert(kt->pkey == keys_cache.indexes[0]);
	old = MemoryContextSwitchTo(TopTransactionContext);
	if (keys_cache.scan == NULL)
	{
		ResourceOwner save = CurrentResourceOwner;

		CurrentResourceOwner = TopTransactionResourceOwner;
		keys_cache.scan = idem_index_beginscan(kt->rel, kt->pkey, snapshot, 2, 0);
		CurrentResourceOwner = save;
	}
	scan = keys_cache.scan;
	scan->xs_snapshot = snapshot;
	keys_cache.scan_busy = true;
	index_rescan(scan, skey, 2, NULL, 0);
	MemoryContextSwitchTo(old);
	return scan;
}

/*
 * The next version of the key a scan of idem_keyrel_begin_scan finds, in
 * kt->slot; false if there is none.  A kept scan allocates in the
 * transaction's memory, which lasts as long as it (btree keeps the array
 * of dead entries it allocates on its first use).
 */
bool
idem_keyrel_scan_next(KeyTable *kt, IndexScanDesc scan)
{
	MemoryContext old;
	bool		found;

	if (scan != keys_cache.scan)
		return index_getnext_slot(scan, ForwardScanDirection, kt->slot);
	old = MemoryContextSwitchTo(TopTransactionContext);
	found = index_getnext_slot(scan, ForwardScanDirection, kt->slot);
	MemoryContextSwitchTo(old);
	return found;
}

/*
 * End a scan of idem_keyrel_begin_scan; a kept scan releases its buffer
 * pins (the version found stays pinned in kt->slot) and forgets the
 * snapshot.
 */
void
idem_keyrel_end_scan(KeyTable *kt, IndexScanDesc scan)
{
	MemoryContext old;

	if (scan != keys_cache.scan)
	{
		index_endscan(scan);
		return;
	}
	old = MemoryContextSwitchTo(TopTransactionContext);
	index_rescan(scan, NULL, 2, NULL, 0);	/* keeps the keys it has */
	MemoryContextSwitchTo(old);
	scan->xs_snapshot = InvalidSnapshot;
	keys_cache.scan_busy = false;
}

/*
 * Every write goes through here first: refuse read-only transactions and
 * recovery, as nextval() does.  The table was opened with the writer's
 * lock (see idem_keytable_write_lockmode), so the shape was checked under it.
 */
void
idem_keyrel_prepare_write(KeyTable *kt)
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

/*
 * The next fencing token for the key kt is open for: from idem.token_seq,
 * or, when Citus distributes idem.keys, from Citus's node clock, and above
 * every token read from the key's row (kt->token_floor): that
 * row may have been written on another node, whose clock was ahead,
 * before its shard moved here.
 */
int64
idem_keyrel_next_token(KeyTable *kt)
{
	if (unlikely(kt->distributed))
	{
		int64		token = idem_citus_next_token();

		return token > kt->token_floor ? token : kt->token_floor + 1;
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

/* Does Citus distribute idem.keys (as found by the last shape check)? */
bool
idem_keyrel_distributed(void)
{
	return keys_distcol != 0;
}

/* The shards of the distributed idem.keys placed on this node. */
List *
idem_keyrel_local_shards(KeyTable *kt)
{
	return idem_citus_local_shards(kt->rel);
}

/*
 * Make kt, opened for purge, act on the shard relid of the distributed
 * idem.keys instead.
 */
void
idem_keyrel_switch_shard(KeyTable *kt, Oid relid)
{
	ExecDropSingleTupleTableSlot(kt->slot);
	close_indexes(kt);
	open_shard(kt, relid);
	kt->slot = table_slot_create(kt->rel, NULL);
	kt->writable = false;
}
