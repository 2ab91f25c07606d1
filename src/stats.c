/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  Per-database counters in shared memory and the idem_stats() function.
 *
 * Counters exist only when idem is in shared_preload_libraries.  Each
 * database gets a slot on its first count; a backend remembers its slot,
 * so counting is one atomic add.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "stats.h"

PG_FUNCTION_INFO_V1(idem_stats);
PG_FUNCTION_INFO_V1(idem_stats_reset);

/* Databases with counters; more are not counted (see README). */
#define IDEM_STATS_MAX_DATABASES	256
#define IDEM_STATS_ERROR_LEN		256

typedef struct IdemDbStats
{
	Oid			dboid;			/* InvalidOid: slot free */
	pg_atomic_uint64 counters[IDEM_STAT_NUM];
	TimestampTz last_purge;		/* 0: never; under lock */
	char		last_error[IDEM_STATS_ERROR_LEN];	/* under lock */
} IdemDbStats;

typedef struct IdemStatsShared
{
	LWLock	   *lock;
	IdemDbStats dbs[IDEM_STATS_MAX_DATABASES];
} IdemStatsShared;

static IdemStatsShared *stats = NULL;
static IdemDbStats *my_db_stats = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Ask for the shared memory and the lock. */
static void
stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(sizeof(IdemStatsShared));
	RequestNamedLWLockTranche("idem", 1);
}

/* Create or attach to the counters. */
static void
stats_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	stats = ShmemInitStruct("idem stats", sizeof(IdemStatsShared), &found);
	if (!found)
	{
		int			i;

		memset(stats, 0, sizeof(IdemStatsShared));
		stats->lock = &(GetNamedLWLockTranche("idem"))->lock;
		for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
		{
			int			j;

			for (j = 0; j < IDEM_STAT_NUM; j++)
				pg_atomic_init_u64(&stats->dbs[i].counters[j], 0);
		}
	}
	LWLockRelease(AddinShmemInitLock);
}

/* Install the shared memory hooks; called from _PG_init when preloaded. */
void
idem_stats_shmem_init(void)
{
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = stats_shmem_startup;
}

/* The slot of a database, taken if it has none; NULL when all are taken. */
static IdemDbStats *
db_stats(Oid dboid)
{
	IdemDbStats *slot = NULL;
	int			i;

	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		if (stats->dbs[i].dboid == dboid)
		{
			slot = &stats->dbs[i];
			break;
		}
		if (slot == NULL && stats->dbs[i].dboid == InvalidOid)
			slot = &stats->dbs[i];
	}
	if (slot != NULL && slot->dboid != dboid)
		slot->dboid = dboid;
	LWLockRelease(stats->lock);
	return slot;
}

/* Add n to a counter of the current database. */
void
idem_stats_add(IdemStat stat, uint64 n)
{
	if (stats == NULL)
		return;
	if (my_db_stats == NULL || my_db_stats->dboid != MyDatabaseId)
		my_db_stats = db_stats(MyDatabaseId);
	if (my_db_stats != NULL)
		pg_atomic_fetch_add_u64(&my_db_stats->counters[stat], n);
}

/* Record the end of a purge run in a database: when, and its error if any. */
void
idem_stats_purge_done(Oid dboid, const char *error)
{
	IdemDbStats *slot;

	if (stats == NULL || (slot = db_stats(dboid)) == NULL)
		return;
	pg_atomic_fetch_add_u64(&slot->counters[IDEM_STAT_PURGE_RUNS], 1);
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	slot->last_purge = GetCurrentTimestamp();
	strlcpy(slot->last_error, error ? error : "", IDEM_STATS_ERROR_LEN);
	LWLockRelease(stats->lock);
}

/* Error out unless the counters exist. */
static void
require_stats(void)
{
	if (stats == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem statistics are not collected: the library is not preloaded"),
				 errhint("Add idem to shared_preload_libraries and restart the server.")));
}

/* idem_stats(): one row per database with counters. */
Datum
idem_stats(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	int			i;

	require_stats();
	InitMaterializedSRF(fcinfo, 0);

	LWLockAcquire(stats->lock, LW_SHARED);
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		IdemDbStats *slot = &stats->dbs[i];
		Datum		values[IDEM_STAT_NUM + 3];
		bool		nulls[IDEM_STAT_NUM + 3];
		int			j;

		if (slot->dboid == InvalidOid)
			continue;
		memset(nulls, false, sizeof(nulls));
		values[0] = ObjectIdGetDatum(slot->dboid);
		for (j = 0; j < IDEM_STAT_NUM; j++)
			values[j + 1] = Int64GetDatum((int64) pg_atomic_read_u64(&slot->counters[j]));
		values[IDEM_STAT_NUM + 1] = TimestampTzGetDatum(slot->last_purge);
		nulls[IDEM_STAT_NUM + 1] = (slot->last_purge == 0);
		values[IDEM_STAT_NUM + 2] = CStringGetTextDatum(slot->last_error);
		nulls[IDEM_STAT_NUM + 2] = (slot->last_error[0] == '\0');
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	LWLockRelease(stats->lock);

	return (Datum) 0;
}

/* idem_stats_reset(): zero every counter of every database. */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	int			i;

	require_stats();
	if (!superuser())
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("only superusers may reset idem statistics")));

	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		int			j;

		for (j = 0; j < IDEM_STAT_NUM; j++)
			pg_atomic_write_u64(&stats->dbs[i].counters[j], 0);
		stats->dbs[i].last_purge = 0;
		stats->dbs[i].last_error[0] = '\0';
	}
	LWLockRelease(stats->lock);
	PG_RETURN_VOID();
}
