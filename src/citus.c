/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  idem.keys distributed by Citus: which shard of the table holds a key,
 *	  whether it is placed on this node, and fencing tokens that grow
 *	  across nodes.
 *
 * When idem_distribute() has made idem.keys a hash-distributed Citus table
 * (by key or by scope), the rows live in shards, tables named
 * idem.keys_<shardid> on the workers, and the functions are delegated to
 * the node that holds the key's shard.  There keyrel.c acts on that
 * shard instead of the (empty) distributed table.  The resolution uses
 * Citus's own metadata and functions, looked up by name so that idem
 * neither links against Citus nor needs it:
 *
 * - get_shard_id_for_distribution_column() hashes the key (or scope) to
 *	 its shard;
 * - lock_shard_metadata(ShareLock) on that shard, held to the end of the
 *	 transaction: a shard move or split takes the conflicting lock on
 *	 every node before it switches the placement over, so it waits for the
 *	 calls that use the shard and they wait for it;
 * - pg_dist_placement, read with a snapshot taken after that lock, says
 *	 which group holds the shard, and pg_dist_local_group which group this
 *	 node is.  A call on another node fails with a serialization failure
 *	 (40001), which clients retry: through the coordinator, the retry is
 *	 delegated to the shard's new node.
 *
 * Whether the table is distributed is decided once per invalidation of
 * idem.keys (Citus invalidates the table's relcache entry when it
 * distributes or undistributes it), together with keyrel.c's shape
 * check: on a server without Citus the cost per call is nil.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/namespace.h"
#include "catalog/pg_namespace_d.h"
#include "catalog/pg_type_d.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "nodes/primnodes.h"
#include "parser/parse_func.h"
#include "storage/lmgr.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "args.h"
#include "citus.h"
#include "idem.h"

/*
 * Citus's cluster_clock: milliseconds since the Unix epoch (the node's
 * hybrid logical clock, never behind the wall clock, never going back,
 * also across restarts) and a counter within the millisecond.
 */
typedef struct IdemClusterClock
{
	uint64		logical;
	uint32		counter;
} IdemClusterClock;

/* Citus's cluster_clock counter bits. */
#define IDEM_CLOCK_COUNTER_BITS	22
/* 2000-01-01 in milliseconds since the Unix epoch: tokens count from it. */
#define IDEM_CLOCK_EPOCH_MS		INT64CONST(946684800000)

/* Citus's catalogs and functions, looked up once per invalidation of idem.keys. */
static struct
{
	Oid			dist_partition;
	Oid			dist_partition_relid_index;
	Oid			dist_shard;
	Oid			dist_shard_relid_index;
	Oid			dist_placement;
	Oid			dist_placement_shardid_index;
	Oid			dist_local_group;
	FmgrInfo	shard_id_fn;	/* get_shard_id_for_distribution_column */
	FmgrInfo	lock_fn;		/* lock_shard_metadata */
	FmgrInfo	clock_fn;		/* citus_get_node_clock */
	bool		has_clock;
} citus;

static MemoryContext citus_cxt = NULL;

static AttrNumber attnum_of(TupleDesc desc, const char *name);

/* The OID of pg_catalog.name, or InvalidOid. */
static Oid
catalog_relid(const char *name)
{
	return get_relname_relid(name, PG_CATALOG_NAMESPACE);
}

/* Look up the function pg_catalog.name(argtypes) into *finfo; false if missing. */
static bool
lookup_citus_function(const char *name, int nargs, Oid *argtypes,
					  FmgrInfo *finfo)
{
	Oid			fn;

	fn = LookupFuncName(list_make2(makeString("pg_catalog"), makeString(pstrdup(name))),
						nargs, argtypes, true);
	if (!OidIsValid(fn))
		return false;
	fmgr_info_cxt(fn, finfo, citus_cxt);
	return true;
}

/* Find Citus's catalogs and functions; false if Citus is not installed. */
static bool
lookup_citus(void)
{
	Oid			shard_id_args[2] = {REGCLASSOID, ANYOID};
	Oid			lock_args[2] = {INT4OID, INT8ARRAYOID};
	MemoryContext old;

	citus.dist_partition = catalog_relid("pg_dist_partition");
	if (!OidIsValid(citus.dist_partition))
		return false;
	citus.dist_partition_relid_index = catalog_relid("pg_dist_partition_logical_relid_index");
	citus.dist_shard = catalog_relid("pg_dist_shard");
	citus.dist_shard_relid_index = catalog_relid("pg_dist_shard_logical_relid_index");
	citus.dist_placement = catalog_relid("pg_dist_placement");
	citus.dist_placement_shardid_index = catalog_relid("pg_dist_placement_shardid_index");
	citus.dist_local_group = catalog_relid("pg_dist_local_group");

	if (citus_cxt == NULL)
		citus_cxt = AllocSetContextCreate(TopMemoryContext, "idem citus",
										  ALLOCSET_SMALL_SIZES);
	else
		MemoryContextReset(citus_cxt);
	old = MemoryContextSwitchTo(citus_cxt);
	if (!OidIsValid(citus.dist_partition_relid_index) ||
		!OidIsValid(citus.dist_shard) ||
		!OidIsValid(citus.dist_shard_relid_index) ||
		!OidIsValid(citus.dist_placement) ||
		!OidIsValid(citus.dist_placement_shardid_index) ||
		!OidIsValid(citus.dist_local_group) ||
		!lookup_citus_function("get_shard_id_for_distribution_column", 2,
							   shard_id_args, &citus.shard_id_fn) ||
		!lookup_citus_function("lock_shard_metadata", 2, lock_args,
							   &citus.lock_fn))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem cannot use table idem.keys: this version of Citus is not supported"),
				 errdetail("Its metadata tables or functions are not the ones idem knows.")));
	citus.has_clock = lookup_citus_function("citus_get_node_clock", 0, NULL,
											&citus.clock_fn);

	/* The distribution value is passed as text ("any" needs its type). */
	citus.shard_id_fn.fn_expr = (Node *)
		makeFuncExpr(citus.shard_id_fn.fn_oid, INT8OID,
					 list_make2(makeNullConst(REGCLASSOID, -1, InvalidOid),
								makeNullConst(TEXTOID, -1, InvalidOid)),
					 InvalidOid, InvalidOid, COERCE_EXPLICIT_CALL);
	MemoryContextSwitchTo(old);
	return true;
}

/*
 * The column idem.keys is distributed by (Anum_keys_key or
 * Anum_keys_scope), or 0 if it is not a Citus table or Citus is not
 * installed.  A Citus table of another kind (reference, or distributed by
 * another column) is refused.  Called once per invalidation of the table.
 */
AttrNumber
idem_citus_distribution_column(Relation rel)
{
	Relation	partition;
	SysScanDesc scan;
	ScanKeyData skey;
	HeapTuple	tuple;
	AttrNumber	distcol = 0;

	if (!lookup_citus())
		return 0;

	partition = table_open(citus.dist_partition, AccessShareLock);
	ScanKeyInit(&skey, 1, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(RelationGetRelid(rel)));
	scan = systable_beginscan(partition, citus.dist_partition_relid_index,
							  true, NULL, 1, &skey);
	tuple = systable_getnext(scan);
	if (HeapTupleIsValid(tuple))
	{
		TupleDesc	desc = RelationGetDescr(partition);
		bool		isnull;
		Datum		method;
		Datum		partkey;
		Node	   *column = NULL;

		method = heap_getattr(tuple, attnum_of(desc, "partmethod"), desc, &isnull);
		if (!isnull && DatumGetChar(method) == 'h')
		{
			partkey = heap_getattr(tuple, attnum_of(desc, "partkey"), desc, &isnull);
			if (!isnull)
				column = stringToNode(TextDatumGetCString(partkey));
		}
		if (column != NULL && IsA(column, Var) &&
			(((Var *) column)->varattno == Anum_keys_key ||
			 ((Var *) column)->varattno == Anum_keys_scope))
			distcol = ((Var *) column)->varattno;
		else
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("idem cannot use table idem.keys: it is a Citus table not distributed by key or scope"),
					 errhint("Distribute it with idem_distribute().")));
	}
	systable_endscan(scan);
	table_close(partition, AccessShareLock);
	return distcol;
}

/* The attribute number of column name in desc; errors if missing. */
static AttrNumber
attnum_of(TupleDesc desc, const char *name)
{
	int			i;

	for (i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (!att->attisdropped && strcmp(NameStr(att->attname), name) == 0)
			return att->attnum;
	}
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("idem cannot use table idem.keys: this version of Citus is not supported"),
			 errdetail("A Citus metadata table has no column \"%s\".", name)));
	pg_unreachable();
}

/* The group id of this node, as Citus numbers it (the coordinator is 0). */
static int32
local_group(Snapshot snapshot)
{
	Relation	rel = table_open(citus.dist_local_group, AccessShareLock);
	TableScanDesc scan = table_beginscan(rel, snapshot, 0, NULL);
	TupleTableSlot *slot = table_slot_create(rel, NULL);
	int32		group = -1;

	if (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		bool		isnull;
		Datum		d = slot_getattr(slot,
									 attnum_of(RelationGetDescr(rel), "groupid"),
									 &isnull);

		if (!isnull)
			group = DatumGetInt32(d);
	}
	ExecDropSingleTupleTableSlot(slot);
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	return group;
}

/*
 * The group that holds shardid's placement, or -1 if none.  A shard with
 * more than one placement (citus.shard_replication_factor > 1) is refused:
 * idem writes one placement only.
 */
static int32
placement_group(int64 shardid, Snapshot snapshot)
{
	Relation	rel = table_open(citus.dist_placement, AccessShareLock);
	TupleDesc	desc = RelationGetDescr(rel);
	AttrNumber	groupcol = attnum_of(desc, "groupid");
	ScanKeyData skey;
	SysScanDesc scan;
	HeapTuple	tuple;
	int32		group = -1;
	int			n = 0;

	ScanKeyInit(&skey, attnum_of(desc, "shardid"), BTEqualStrategyNumber,
				F_INT8EQ, Int64GetDatum(shardid));
	scan = systable_beginscan(rel, citus.dist_placement_shardid_index, true,
							  snapshot, 1, &skey);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		bool		isnull;
		Datum		d = heap_getattr(tuple, groupcol, desc, &isnull);

		if (!isnull)
			group = DatumGetInt32(d);
		n++;
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	if (n > 1)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem cannot use shard %lld of idem.keys: it has %d placements",
						(long long) shardid, n),
				 errdetail("idem writes one placement per shard."),
				 errhint("Distribute idem.keys with citus.shard_replication_factor = 1.")));
	return group;
}

/* Take lock_shard_metadata(ShareLock) on shardid (as the table's owner). */
static void
lock_shard(int64 shardid)
{
	Datum		id = Int64GetDatum(shardid);
	ArrayType  *ids = construct_array(&id, 1, INT8OID, sizeof(int64),
									  FLOAT8PASSBYVAL, TYPALIGN_DOUBLE);

	FunctionCall2(&citus.lock_fn, Int32GetDatum(ShareLock),
				  PointerGetDatum(ids));
}

/* The relation of shard shardid of rel on this node, or InvalidOid. */
static Oid
shard_relid(Relation rel, int64 shardid)
{
	char	   *name = psprintf("%s_" INT64_FORMAT, RelationGetRelationName(rel),
								shardid);

	return get_relname_relid(name, RelationGetNamespace(rel));
}

/*
 * The shard of the distributed table rel that holds the key whose
 * distribution value (key or scope) is value, after locking its metadata
 * for the rest of the transaction.  Fails with ERRCODE_IDEM_SHARD_NOT_LOCAL
 * if that shard is not placed on this node.
 */
Oid
idem_citus_local_shard(Relation rel, Datum value, const char *what, text *key)
{
	Oid			save_userid;
	int			save_sec_context;
	int64		shardid;
	Snapshot	snapshot;
	int32		here;
	int32		there;
	Oid			relid;

	/* Citus checks that the caller may read and owns the table. */
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(rel->rd_rel->relowner,
						   save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	shardid = DatumGetInt64(FunctionCall2(&citus.shard_id_fn,
										  ObjectIdGetDatum(RelationGetRelid(rel)),
										  value));
	lock_shard(shardid);
	SetUserIdAndSecContext(save_userid, save_sec_context);

	/* What a shard move committed before the lock was granted. */
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	here = local_group(snapshot);
	there = placement_group(shardid, snapshot);
	UnregisterSnapshot(snapshot);

	relid = (here == there && there >= 0) ? shard_relid(rel, shardid) : InvalidOid;
	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_SHARD_NOT_LOCAL),
				 errmsg("idempotency key \"%s\" is not stored on this node",
						idem_key_for_message(key)),
				 errdetail("%s: its shard %lld of idem.keys is placed in node group %d, this node is group %d.",
						   what, (long long) shardid, there, here),
				 errhint("Retry. Through the Citus coordinator, call the idem function "
						 "as a statement of its own so that Citus delegates it to the "
						 "key's node (the shard may just have moved).")));
	return relid;
}

/* Order IdemShards by shard id. */
static int
shard_cmp(const ListCell *a, const ListCell *b)
{
	const IdemShard *sa = lfirst(a);
	const IdemShard *sb = lfirst(b);

	return (sa->shardid > sb->shardid) - (sa->shardid < sb->shardid);
}

/*
 * The shards of the distributed table rel placed on this node, in shard id
 * order, each with its metadata locked (ShareLock) for the rest of the
 * transaction so that none moves away while purge deletes from it.
 */
List *
idem_citus_local_shards(Relation rel)
{
	Relation	shards;
	TupleDesc	desc;
	ScanKeyData skey;
	SysScanDesc scan;
	HeapTuple	tuple;
	List	   *ids = NIL;
	List	   *result = NIL;
	ListCell   *lc;
	Snapshot	snapshot;
	int32		here;
	Oid			save_userid;
	int			save_sec_context;

	shards = table_open(citus.dist_shard, AccessShareLock);
	desc = RelationGetDescr(shards);
	ScanKeyInit(&skey, 1, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(RelationGetRelid(rel)));
	scan = systable_beginscan(shards, citus.dist_shard_relid_index, true,
							  NULL, 1, &skey);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		bool		isnull;
		Datum		d = heap_getattr(tuple, attnum_of(desc, "shardid"),
									 desc, &isnull);
		IdemShard  *shard = palloc0(sizeof(IdemShard));

		shard->shardid = DatumGetInt64(d);
		ids = lappend(ids, shard);
	}
	systable_endscan(scan);
	table_close(shards, AccessShareLock);
	list_sort(ids, shard_cmp);

	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(rel->rd_rel->relowner,
						   save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	here = local_group(snapshot);
	foreach(lc, ids)
	{
		IdemShard  *shard = lfirst(lc);

		/* Only shards placed here are locked (purge waits for no move elsewhere). */
		if (placement_group(shard->shardid, snapshot) != here)
			continue;
		lock_shard(shard->shardid);
		UnregisterSnapshot(snapshot);
		snapshot = RegisterSnapshot(GetLatestSnapshot());
		if (placement_group(shard->shardid, snapshot) != here)
			continue;
		shard->relid = shard_relid(rel, shard->shardid);
		if (OidIsValid(shard->relid))
			result = lappend(result, shard);
	}
	UnregisterSnapshot(snapshot);
	SetUserIdAndSecContext(save_userid, save_sec_context);
	return result;
}

/*
 * A fencing token for a distributed idem.keys: the node's Citus clock
 * (citus_get_node_clock()) as one number, milliseconds since 2000 shifted
 * past the 22-bit counter.  It grows with every call on a node, also
 * across restarts (Citus persists the clock), and it is ordered across
 * nodes by their wall clocks; keyrel.c keeps a takeover's token above
 * the key's last one too.
 */
int64
idem_citus_next_token(void)
{
	IdemClusterClock *clock;

	if (!citus.has_clock)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem needs citus_get_node_clock() (Citus 12 or later) for a distributed idem.keys")));
	clock = (IdemClusterClock *) DatumGetPointer(FunctionCall0Coll(&citus.clock_fn, InvalidOid));
	if (clock->logical < (uint64) IDEM_CLOCK_EPOCH_MS ||
		clock->logical - IDEM_CLOCK_EPOCH_MS >=
		(UINT64CONST(1) << (63 - IDEM_CLOCK_COUNTER_BITS)))
		ereport(ERROR,
				(errcode(ERRCODE_DATA_EXCEPTION),
				 errmsg("Citus clock value %llu is out of idem's token range",
						(unsigned long long) clock->logical)));
	return (int64) (((clock->logical - IDEM_CLOCK_EPOCH_MS) << IDEM_CLOCK_COUNTER_BITS) |
					clock->counter);
}
