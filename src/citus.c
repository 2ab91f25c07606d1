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
 *	 calls that use the shard and they wait for it.  It takes them on the
 *	 coordinator first, then on the workers; idem's planner hook takes the
 *	 coordinator's (the routing node's) first too, before Citus delegates
 *	 the call (see "Calls routed by Citus" below);
 * - pg_dist_placement, read with a snapshot taken after that lock, says
 *	 which group holds the shard, and pg_dist_local_group which group this
 *	 node is.  A call on another node fails with a serialization failure
 *	 (40001), which clients retry: through the coordinator, the retry is
 *	 delegated to the shard's new node.
 *
 * Whether the table is distributed is decided once per invalidation of
 * idem.keys (Citus invalidates the table's relcache entry when it
 * distributes or undistributes it), together with keyrel.c's shape
 * check, and, for the planner hook, with the delegated functions read
 * from pg_dist_object: on a server without Citus the cost per call is
 * nil, and the hook's per statement a look at the statement's shape.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/dependency.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_namespace_d.h"
#include "catalog/pg_proc_d.h"
#include "catalog/pg_type_d.h"
#include "commands/extension.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "nodes/nodeFuncs.h"
#include "nodes/pathnodes.h"
#include "nodes/primnodes.h"
#include "optimizer/optimizer.h"
#include "optimizer/planner.h"
#include "parser/parse_func.h"
#include "parser/parsetree.h"
#include "storage/lmgr.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

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
	bool		ready;			/* the functions above are looked up */
} citus;

static MemoryContext citus_cxt = NULL;

static AttrNumber attnum_of(TupleDesc desc, const char *name);
static AttrNumber distribution_column(Oid relid, bool quiet);

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

/*
 * Find Citus's catalogs and functions; false if Citus is not installed.
 * A Citus whose catalogs or functions idem does not know is refused, or,
 * if quiet, taken as not installed.
 */
static bool
lookup_citus(bool quiet)
{
	Oid			shard_id_args[2] = {REGCLASSOID, ANYOID};
	Oid			lock_args[2] = {INT4OID, INT8ARRAYOID};
	MemoryContext old;

	citus.ready = false;
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
	{
		MemoryContextSwitchTo(old);
		if (quiet)
			return false;
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem cannot use table idem.keys: this version of Citus is not supported"),
				 errdetail("Its metadata tables or functions are not the ones idem knows.")));
	}
	citus.has_clock = lookup_citus_function("citus_get_node_clock", 0, NULL,
											&citus.clock_fn);

	/* The distribution value is passed as text ("any" needs its type). */
	citus.shard_id_fn.fn_expr = (Node *)
		makeFuncExpr(citus.shard_id_fn.fn_oid, INT8OID,
					 list_make2(makeNullConst(REGCLASSOID, -1, InvalidOid),
								makeNullConst(TEXTOID, -1, InvalidOid)),
					 InvalidOid, InvalidOid, COERCE_EXPLICIT_CALL);
	MemoryContextSwitchTo(old);
	citus.ready = true;
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
	if (!lookup_citus(false))
		return 0;
	return distribution_column(RelationGetRelid(rel), false);
}

/*
 * idem_citus_distribution_column of the table relid, Citus looked up; if
 * quiet, a Citus table of another kind is taken as not distributed.
 */
static AttrNumber
distribution_column(Oid relid, bool quiet)
{
	Relation	partition;
	SysScanDesc scan;
	ScanKeyData skey;
	HeapTuple	tuple;
	AttrNumber	distcol = 0;

	partition = table_open(citus.dist_partition, AccessShareLock);
	ScanKeyInit(&skey, 1, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(relid));
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
		else if (!quiet)
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

/*
 * The shard of the distributed table relid (owned by owner) that holds the
 * distribution value (key or scope) value, its metadata locked
 * (ShareLock) to the end of the transaction.  Both as the owner: Citus
 * checks that the caller may read and owns the table.
 */
static int64
lock_key_shard(Oid relid, Oid owner, Datum value)
{
	Oid			save_userid;
	int			save_sec_context;
	int64		shardid;

	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	shardid = DatumGetInt64(FunctionCall2(&citus.shard_id_fn,
										  ObjectIdGetDatum(relid), value));
	lock_shard(shardid);
	SetUserIdAndSecContext(save_userid, save_sec_context);
	return shardid;
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
	int64		shardid;
	Snapshot	snapshot;
	int32		here;
	int32		there;
	Oid			relid;

	shardid = lock_key_shard(RelationGetRelid(rel), rel->rd_rel->relowner, value);

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

/*
 * Calls routed by Citus: the coordinator's lock.
 *
 * A call that Citus delegates runs on the node that holds the key's shard
 * and takes the shard's metadata lock there only (idem_citus_local_shard);
 * Citus plans it as read-only and takes no lock on the node the statement
 * was sent to.  The writes of the same transaction (INSERT INTO orders
 * ...) take that node's lock at execution (Citus's
 * CitusBeginModifyScan, AcquireMetadataLocks), after the call took the
 * worker's.  A shard move takes the two in the other order
 * (BlockWritesToShardList: ExclusiveLock on the coordinator, then
 * lock_shard_metadata on every worker with metadata), so a move that
 * started between a claim and the transaction's first write deadlocked
 * with it.  The planner hook below takes the coordinator's lock first:
 * before Citus plans (and routes) a statement that calls one of idem's
 * delegated functions, it locks the shard of the call's distribution
 * argument on this node, in the move's order.  A move then waits for the
 * transaction, or the call waits for the move and is routed to the
 * shard's new node.  Both locks are the same for colocated tables (Citus
 * locks a colocation group's shard index), so the transaction's writes to
 * a colocated table find it held.
 *
 * Citus plans a delegated call with a parameter as its distribution
 * argument anew at every execution (it makes generic plans with
 * parameters too costly to be chosen), so the lock is taken per
 * execution.  A generic plan whose distribution argument is a literal,
 * run again in a later transaction, is not planned again: that form (a
 * named prepared statement without parameters, a literal key in PL/pgSQL)
 * is not covered.
 *
 * Which functions are delegated, and by which argument, is read from
 * Citus's pg_dist_object (the functions of extension idem), once per
 * invalidation of idem.keys or pg_dist_object: on a server without Citus,
 * or with idem.keys not distributed, the hook only looks at the shape of a
 * SELECT.
 */

/* A function of idem that Citus delegates, and the argument it routes by. */
typedef struct RoutedFunction
{
	Oid			funcid;
	int			argindex;
} RoutedFunction;

#define IDEM_MAX_ROUTED	32

static struct
{
	uint64		valid;			/* inval_count + 1 when computed */
	uint64		inval_count;
	bool		callback;
	Oid			keys_relid;		/* idem.keys, or InvalidOid */
	Oid			keys_owner;
	Oid			dist_object;	/* pg_dist_object, or InvalidOid */
	int			nfunctions;
	RoutedFunction functions[IDEM_MAX_ROUTED];
} routes;

static planner_hook_type prev_planner_hook = NULL;

/* Forget the routed functions when idem.keys or pg_dist_object changes. */
static void
routes_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || !OidIsValid(routes.keys_relid) ||
		relid == routes.keys_relid || relid == routes.dist_object)
		routes.inval_count++;
}

/*
 * Find the functions of idem that Citus delegates, and the argument each
 * is routed by, if idem.keys is distributed in this database.
 */
static void
compute_routes(void)
{
	uint64		inval_count = routes.inval_count;
	Oid			nspid;
	Oid			ext;
	HeapTuple	tuple;
	Relation	rel;
	TupleDesc	desc;
	SysScanDesc scan;
	ScanKeyData skey;
	AttrNumber	argcol;

	if (!routes.callback)
	{
		CacheRegisterRelcacheCallback(routes_relcache_callback, (Datum) 0);
		routes.callback = true;
	}
	routes.nfunctions = 0;
	routes.dist_object = InvalidOid;
	nspid = get_namespace_oid("idem", true);
	routes.keys_relid = OidIsValid(nspid) ?
		get_relname_relid("keys", nspid) : InvalidOid;
	ext = OidIsValid(routes.keys_relid) ? get_extension_oid("idem", true) : InvalidOid;
	if (OidIsValid(ext) && lookup_citus(true) &&
		OidIsValid(catalog_relid("pg_dist_object")) &&
		distribution_column(routes.keys_relid, true) != 0)
	{
		tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(routes.keys_relid));
		if (!HeapTupleIsValid(tuple))
			elog(ERROR, "cache lookup failed for relation %u", routes.keys_relid);
		routes.keys_owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
		ReleaseSysCache(tuple);

		routes.dist_object = catalog_relid("pg_dist_object");
		rel = table_open(routes.dist_object, AccessShareLock);
		desc = RelationGetDescr(rel);
		argcol = attnum_of(desc, "distribution_argument_index");
		ScanKeyInit(&skey, attnum_of(desc, "classid"), BTEqualStrategyNumber,
					F_OIDEQ, ObjectIdGetDatum(ProcedureRelationId));
		scan = systable_beginscan(rel, InvalidOid, false, NULL, 1, &skey);
		while (HeapTupleIsValid(tuple = systable_getnext(scan)) &&
			   routes.nfunctions < IDEM_MAX_ROUTED)
		{
			bool		isnull;
			Datum		objid = heap_getattr(tuple, attnum_of(desc, "objid"),
											 desc, &isnull);
			Datum		argindex = heap_getattr(tuple, argcol, desc, &isnull);

			if (isnull || DatumGetInt32(argindex) < 0 ||
				getExtensionOfObject(ProcedureRelationId,
									 DatumGetObjectId(objid)) != ext)
				continue;
			routes.functions[routes.nfunctions].funcid = DatumGetObjectId(objid);
			routes.functions[routes.nfunctions].argindex = DatumGetInt32(argindex);
			routes.nfunctions++;
		}
		systable_endscan(scan);
		table_close(rel, AccessShareLock);
	}
	/* An invalidation that came meanwhile has it computed again next time. */
	if (inval_count == routes.inval_count)
		routes.valid = inval_count + 1;
}

/*
 * The function call of a statement of the forms Citus delegates, SELECT
 * f(...) and SELECT ... FROM f(...), or NULL.  Other clauses (WHERE, a
 * cast of the column) may keep Citus from delegating it; the lock is taken
 * all the same, as the call's own would be.
 */
static FuncExpr *
single_call(Query *parse)
{
	FromExpr   *jointree = parse->jointree;
	RangeTblEntry *rte;
	RangeTblFunction *rtfunc;
	Node	   *node;

	if (parse->commandType != CMD_SELECT || jointree == NULL)
		return NULL;
	if (jointree->fromlist == NIL)
	{
		if (list_length(parse->targetList) != 1)
			return NULL;
		node = (Node *) ((TargetEntry *) linitial(parse->targetList))->expr;
	}
	else
	{
		if (list_length(jointree->fromlist) != 1 ||
			!IsA(linitial(jointree->fromlist), RangeTblRef))
			return NULL;
		rte = rt_fetch(((RangeTblRef *) linitial(jointree->fromlist))->rtindex,
					   parse->rtable);
		if (rte->rtekind != RTE_FUNCTION || list_length(rte->functions) != 1)
			return NULL;
		rtfunc = (RangeTblFunction *) linitial(rte->functions);
		node = rtfunc->funcexpr;
	}
	return IsA(node, FuncExpr) ? (FuncExpr *) node : NULL;
}

/*
 * If call is a call of a function of idem that Citus delegates, lock the
 * shard of its distribution argument here, as the planner will see the
 * argument: with the defaults and named arguments in place, constants
 * folded and the bound parameters' values.
 */
static void
lock_routed_call(FuncExpr *call, ParamListInfo boundParams)
{
	int			argindex = -1;
	int			i;
	PlannerInfo *root;
	Node	   *expanded;
	Node	   *arg;
	Const	   *value;

	if (routes.valid != routes.inval_count + 1)
		compute_routes();
	for (i = 0; i < routes.nfunctions; i++)
		if (routes.functions[i].funcid == call->funcid)
			argindex = routes.functions[i].argindex;
	if (argindex < 0 || !citus.ready)
		return;

	root = makeNode(PlannerInfo);
	root->glob = makeNode(PlannerGlobal);
	root->glob->boundParams = boundParams;
	expanded = eval_const_expressions(root, copyObject((Node *) call));
	if (!IsA(expanded, FuncExpr) ||
		argindex >= list_length(((FuncExpr *) expanded)->args))
		return;
	arg = strip_implicit_coercions(list_nth(((FuncExpr *) expanded)->args, argindex));
	if (!IsA(arg, Const))
		return;
	value = (Const *) arg;
	if (value->constisnull || value->consttype != TEXTOID)
		return;
	(void) lock_key_shard(routes.keys_relid, routes.keys_owner, value->constvalue);
}

/* idem's planner hook: the coordinator's lock, then Citus's planner. */
static PlannedStmt *
idem_planner(Query *parse, const char *query_string, int cursorOptions,
			 ParamListInfo boundParams)
{
	FuncExpr   *call = single_call(parse);

	if (unlikely(call != NULL))
		lock_routed_call(call, boundParams);
	if (prev_planner_hook)
		return prev_planner_hook(parse, query_string, cursorOptions, boundParams);
	return standard_planner(parse, query_string, cursorOptions, boundParams);
}

/*
 * Install the planner hook; called from _PG_init.  Loaded after Citus (in
 * shared_preload_libraries, where Citus must come first), idem's hook
 * runs before Citus's planner, which it calls.
 */
void
idem_citus_init(void)
{
	prev_planner_hook = planner_hook;
	planner_hook = idem_planner;
}
