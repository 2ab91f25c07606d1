/*-------------------------------------------------------------------------
 *
 * purge.c
 *	  Deletion of expired keys, shared by idem_purge() and the background
 *	  worker.
 *
 * Purge walks the table in physical order: each batch takes up to
 * idem.purge_batch_size expired rows, reading at most
 * IDEM_PURGE_BATCH_PAGES pages, from where the previous batch of the walk
 * stopped (a TID range scan), so a pass reads the table once and needs no
 * index on expires_at, which would make every complete a non-HOT update.
 * A row is deleted only if the version the scan found expired is still
 * the latest and nobody holds it: the delete does not wait, so a purge
 * never waits for a transaction that is re-claiming a key and never
 * deletes a key changed since its snapshot (the row is left for a later
 * pass).
 *
 * The background worker's pass goes on across batches and visits: its
 * position is kept in shared memory after each committed batch
 * (expiry.c), so a visit that ends at its deadline (idem.purge_rate_limit)
 * is taken up where it stopped by the next one, and every pass reaches
 * the end of the table.  A server restart, or a rewrite of the table,
 * starts the pass over.
 *
 * The worker skips a pass when nothing can have expired yet: it keeps,
 * per database in shared memory, a watermark below every key's expiry
 * (expiry.c).  Each write of a key lowers it to the key's expiry; a pass
 * of the worker that read the whole table and committed its deletions
 * raises it to the least expiry of the versions it left (live,
 * uncommitted or skipped), or of keys written while it ran, whichever is
 * less.  So a pass is skipped, without reading the table, while the
 * watermark is in the future (it still opens the table, so that a table
 * idem cannot use is reported every pass).  An INSERT, UPDATE or MERGE
 * into the table and COPY into it make the watermark unknown when they
 * end, so the next pass reads the table; a rewrite of the table (VACUUM
 * FULL, CLUSTER, ALTER TABLE, pg_repack, TRUNCATE) gives it another file,
 * which makes the watermark unknown too.  Rows that reach the table
 * otherwise (logical replication, a Citus shard move) do not: a pass reads
 * the whole table at least every IDEM_PURGE_FULL_PASS_SECS anyway (by the
 * server's clock, whatever idem.clock_offset says), after a restart, and
 * always when Citus distributes the table.  idem_purge() always reads the
 * table, in a walk of its own.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "executor/executor.h"
#include "fmgr.h"
#include "nodes/parsenodes.h"
#include "parser/parsetree.h"
#include "storage/itemptr.h"
#include "tcop/utility.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

#include "expiry.h"
#include "keytable.h"
#include "purge.h"
#include "settings.h"
#include "stats.h"

PG_FUNCTION_INFO_V1(idem_purge);

/* The background worker's pass (see idem_purge_pass_start). */
static IdemPurgePass worker_pass;

/*
 * idem_purge()'s walk in this session: every block, going on from where
 * the previous call stopped.
 */
static IdemPurgePass session_walk = {.ranges.read_all = true};

/*
 * Delete up to limit keys that expired at or before now, walking on from
 * where the previous batch of the walk stopped; a batch that reaches the
 * end of the table ends the walk (*pass_done) and the next one starts
 * over.  Returns the number of rows deleted.
 */
static int64
purge_walk(IdemPurgePass *walk, TimestampTz now, int limit, bool *pass_done)
{
	bool		at_end;
	int64		n;

	n = idem_keytable_purge_batch(now, limit, &walk->pos, &at_end,
								  &walk->ranges);
	if (at_end)
	{
		ItemPointerSet(&walk->pos.cursor, 0, 0);
		walk->pos.shardid = 0;
	}
	*pass_done = at_end;
	idem_stats_add(IDEM_STAT_PURGED_ROWS, n);
	return n;
}

/* One batch of the background worker's pass; see purge_walk. */
int64
idem_purge_batch(TimestampTz now, int limit, bool *pass_done)
{
	return purge_walk(&worker_pass, now, limit, pass_done);
}

/*
 * Start or go on with a pass of the background worker over the current
 * database's table, in its first batch's transaction of a visit.  Returns
 * false, and starts nothing, if no pass is under way and the watermark
 * says no key can have expired at or before now.
 */
bool
idem_purge_pass_start(TimestampTz now)
{
	KeyTable	kt;
	BlockNumber nblocks;
	Oid			relfilenode;

	/*
	 * Open the table with the lock a pass takes also when the pass ends
	 * here: a table idem cannot use (an index or trigger added since) fails
	 * the pass and is reported in idem_stats, as a pass that reads it is.
	 */
	idem_keytable_open(&kt, "idem_purge()", NULL, NULL,
					   idem_keytable_write_lockmode());
	nblocks = idem_keytable_nblocks(&kt);
	relfilenode = idem_keytable_relfilenode(&kt);
	idem_keytable_close(&kt);
	return idem_expiry_pass_begin(now, relfilenode, nblocks, &worker_pass);
}

/*
 * A batch of the worker's pass committed without ending the pass: keep
 * where it goes on, for the next batch or visit.
 */
void
idem_purge_pass_save(void)
{
	idem_expiry_pass_save(&worker_pass);
}

/*
 * The worker's pass reached the end of the table and every batch of it
 * committed: raise the watermark to what the pass left.
 */
void
idem_purge_pass_end(void)
{
	idem_expiry_pass_end(&worker_pass);
}

/*
 * idem_purge(max_rows): delete expired keys in batches of
 * idem.purge_batch_size.  Without max_rows, one whole pass over the table.
 * With it, at most max_rows, going on from where this session's previous
 * call stopped (and round to the start once), so that a loop of bounded
 * calls, each in its own transaction, walks the table once instead of
 * re-reading its start every time.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	int64		max_rows = PG_ARGISNULL(0) ? PG_INT64_MAX : PG_GETARG_INT32(0);
	TimestampTz now = idem_now();
	int64		total = 0;
	int			laps;

	if (max_rows < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_rows must not be negative")));

	if (PG_ARGISNULL(0))
	{
		ItemPointerSet(&session_walk.pos.cursor, 0, 0);
		session_walk.pos.shardid = 0;
	}
	/* Started mid-table: the end of the table starts one more lap. */
	laps = (ItemPointerGetBlockNumberNoCheck(&session_walk.pos.cursor) == 0 &&
			ItemPointerGetOffsetNumberNoCheck(&session_walk.pos.cursor) == 0 &&
			session_walk.pos.shardid == 0) ? 1 : 2;
	while (total < max_rows)
	{
		int			limit = (int) Min((int64) idem_purge_batch_size,
									  max_rows - total);
		bool		pass_done;

		total += purge_walk(&session_walk, now, limit, &pass_done);
		if (pass_done && --laps == 0)
			break;
	}
	PG_RETURN_INT64(total);
}

/* idem.keys of the current database, if idem is installed; no lock taken. */
static Oid
keys_relid(void)
{
	Oid			nsp = get_namespace_oid("idem", true);

	return OidIsValid(nsp) ? get_relname_relid("keys", nsp) : InvalidOid;
}

static ExecutorEnd_hook_type prev_ExecutorEnd = NULL;
static ProcessUtility_hook_type prev_ProcessUtility = NULL;

/*
 * At the end of a statement that inserted into or updated idem.keys
 * through the executor (a plain DELETE cannot lower the watermark), make
 * the watermark unknown.  After the writes, as idem's own writes note
 * their expiry after writing: a pass that starts later reads the rows.
 */
static void
purge_ExecutorEnd(QueryDesc *queryDesc)
{
	PlannedStmt *stmt = queryDesc->plannedstmt;
	List	   *results = stmt->resultRelations;

	if (prev_ExecutorEnd)
		prev_ExecutorEnd(queryDesc);
	else
		standard_ExecutorEnd(queryDesc);

	if (results != NIL && (stmt->commandType != CMD_DELETE || stmt->hasModifyingCTE))
	{
		Oid			keys = keys_relid();
		ListCell   *lc;

		foreach(lc, results)
		{
			if (OidIsValid(keys) &&
				rt_fetch(lfirst_int(lc), stmt->rtable)->relid == keys)
			{
				idem_expiry_forget();
				break;
			}
		}
	}
}

/*
 * Before a utility statement, drop the references to idem.keys the
 * transaction keeps (keyrel.c).  After COPY into idem.keys, make the
 * watermark unknown.  (A rewrite of the table gives it another file, which
 * the expiry map notices by itself.)
 */
static void
purge_ProcessUtility(PlannedStmt *pstmt, const char *queryString,
					 bool readOnlyTree, ProcessUtilityContext context,
					 ParamListInfo params, QueryEnvironment *queryEnv,
					 DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *parsetree = pstmt->utilityStmt;

	/* DDL on idem.keys in this transaction finds it unused by idem. */
	idem_keytable_cache_close();
	if (prev_ProcessUtility)
		prev_ProcessUtility(pstmt, queryString, readOnlyTree, context,
							params, queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context,
								params, queryEnv, dest, qc);

	if (IsA(parsetree, CopyStmt) && ((CopyStmt *) parsetree)->is_from &&
		((CopyStmt *) parsetree)->relation != NULL)
	{
		Oid			relid = RangeVarGetRelid(((CopyStmt *) parsetree)->relation,
											 NoLock, true);

		if (OidIsValid(relid) && relid == keys_relid())
			idem_expiry_forget();
	}
}

/* Watch for writes to idem.keys past idem's functions (shared_preload_libraries). */
void
idem_purge_install_hooks(void)
{
	prev_ExecutorEnd = ExecutorEnd_hook;
	ExecutorEnd_hook = purge_ExecutorEnd;
	prev_ProcessUtility = ProcessUtility_hook;
	ProcessUtility_hook = purge_ProcessUtility;
}
