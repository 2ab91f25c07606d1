/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  Background purge of expired keys in every database.
 *
 * With idem in shared_preload_libraries, a launcher runs for the life of
 * the server.  It connects to no database.  Every idem.purge_naptime it
 * lists the databases that accept connections and, one at a time, starts a
 * short-lived purge worker connected to each and waits for it to exit.  A
 * purge worker returns at once where the extension is not installed;
 * elsewhere it deletes expired keys with the code behind idem_purge(), one
 * batch (at most idem.purge_batch_size rows and IDEM_PURGE_BATCH_PAGES
 * pages) per transaction, until a batch reaches the end of the table.
 *
 * No database can hold the launcher up.  A purge worker overrides, with
 * the priority autovacuum uses, every setting a database or role could use
 * to stall it or make it fail: it runs READ COMMITTED, read-write, not
 * deferrable, without statement, idle or transaction timeouts, and waits
 * for a lock at most the visit deadline (idem.purge_naptime, at least 5
 * and at most 60 seconds).  A worker that hits that lock timeout logs it,
 * records it in idem_stats and exits; the launcher terminates a worker
 * that is not purging within twice the deadline.  Either way the launcher
 * goes on with the next database and visits the stuck one again next
 * pass, after the others.
 *
 * No process holds a database connection between passes, so DROP DATABASE,
 * ALTER DATABASE ... RENAME and CREATE DATABASE ... TEMPLATE work while the
 * launcher runs.  Those commands wait (up to five seconds) for the other
 * sessions of the database to leave, and take a lock on the database
 * object first; a purge worker checks that lock before each batch and
 * leaves as soon as such a command is waiting.  The launcher checks that a
 * database still exists just before starting its worker; a worker that
 * finds its database dropped while it connects exits quietly.
 *
 * When no background worker slot is free (max_worker_processes, shared
 * with parallel query), the launcher logs and counts the failure and tries
 * the same database again after 1, 2, 4 ... seconds, at most
 * idem.purge_naptime apart.  Each pass also frees the idem_stats slots of
 * dropped databases.
 *
 * A purge worker that fails records its error in idem_stats and exits; the
 * launcher visits the database again next pass.  The launcher itself exits
 * with status 1 on any error and the postmaster starts it again after
 * IDEM_LAUNCHER_RESTART_SECS.  On a hot standby the launcher runs but
 * purges nothing until the server is promoted.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/skey.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_database.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lock.h"
#include "storage/shmem.h"
#include "tcop/tcopprot.h"
#include "utils/elog.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "compat.h"
#include "purge.h"
#include "settings.h"
#include "stats.h"
#include "worker.h"

/* Seconds before the postmaster starts a failed launcher again. */
#define IDEM_LAUNCHER_RESTART_SECS	5

/* Bounds of the visit deadline, which is idem.purge_naptime. */
#define IDEM_VISIT_DEADLINE_MIN_SECS	5
#define IDEM_VISIT_DEADLINE_MAX_SECS	60

/* First wait before starting a worker again when no slot was free. */
#define IDEM_START_RETRY_MS		1000

#define IDEM_LAUNCHER_TYPE	"idem launcher"
#define IDEM_PURGE_TYPE		"idem purge"

PGDLLEXPORT void idem_launcher_main(Datum main_arg);
PGDLLEXPORT void idem_purge_main(Datum main_arg);

/* A database the launcher will visit. */
typedef struct IdemDatabase
{
	Oid			oid;
	char		name[NAMEDATALEN];
} IdemDatabase;

/* What the launcher passes a purge worker in bgw_extra. */
typedef struct PurgeWorkerArgs
{
	uint32		visit;			/* number of this visit */
	char		dbname[NAMEDATALEN];	/* for log lines only */
} PurgeWorkerArgs;

StaticAssertDecl(sizeof(PurgeWorkerArgs) <= BGW_EXTRALEN,
				 "PurgeWorkerArgs must fit in bgw_extra");

/* Where a visit stands, as its purge worker reports it. */
typedef enum VisitState
{
	VISIT_STARTING,				/* not yet purging */
	VISIT_PURGING,				/* connected, idem found, deleting */
	VISIT_LOCKED,				/* gave up waiting for a lock */
	VISIT_FINISHED				/* any other end */
} VisitState;

/* How a visit ended, for the launcher. */
typedef enum VisitResult
{
	VISIT_DONE,					/* the worker ran and exited */
	VISIT_STUCK,				/* lock timeout, or terminated when overdue */
	VISIT_NO_SLOT				/* no background worker slot was free */
} VisitResult;

/*
 * Shared between the launcher and its purge worker: the visit number in
 * the high 32 bits, its VisitState in the low ones, so that a worker left
 * from an earlier launcher cannot report for a later visit.
 */
typedef struct IdemPurgeShared
{
	pg_atomic_uint64 visit_state;
} IdemPurgeShared;

/* How one purge batch ended. */
typedef enum PurgeBatchResult
{
	BATCH_MORE,					/* the pass over the table goes on */
	BATCH_LAST,					/* the pass reached the end of the table */
	BATCH_PAUSED,				/* paced, the visit used its time: the pass
								 * goes on at the next visit */
	BATCH_NO_EXTENSION,			/* idem is not installed here */
	BATCH_YIELD,				/* a command waits for the database */
	BATCH_STOPPED				/* purge was disabled meanwhile */
} PurgeBatchResult;

static IdemPurgeShared *purge_shared = NULL;

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Databases whose visit was stuck last pass; visited last.  Launcher only. */
static List *deferred_dbs = NIL;

/* This purge worker's visit, for its reports to the launcher. */
static uint32 purge_visit = 0;

/* Work done by this purge worker, for its log line. */
static int64 purge_deleted = 0;
static int	purge_batches = 0;
static TimestampTz purge_started = 0;
static int64 purge_paced_us = 0;	/* waited for idem.purge_rate_limit */

/* True while this purge worker connects to its database. */
static bool purge_connecting = false;
static emit_log_hook_type prev_emit_log_hook = NULL;

/* A purge worker's wait event while idem.purge_rate_limit paces it. */
static uint32
purge_pace_wait_event(void)
{
	static uint32 wait_event = 0;

	return idem_wait_event(&wait_event, "IdemPurgeRateLimit");
}

/* The launcher's wait event while it sleeps between passes. */
static uint32
launcher_wait_event(void)
{
	static uint32 wait_event = 0;

	return idem_wait_event(&wait_event, "IdemLauncherMain");
}

/*
 * How long a purge worker waits for a lock, and half of how long the
 * launcher lets it take to start purging: idem.purge_naptime, within
 * bounds.
 */
static int
visit_deadline_ms(void)
{
	int			secs = Min(Max(idem_purge_naptime, IDEM_VISIT_DEADLINE_MIN_SECS),
						   IDEM_VISIT_DEADLINE_MAX_SECS);

	return secs * 1000;
}

/* Ask for the launcher's shared state. */
static void
worker_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(sizeof(IdemPurgeShared));
}

/* Create or attach to the launcher's shared state. */
static void
worker_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	purge_shared = ShmemInitStruct("idem purge", sizeof(IdemPurgeShared),
								   &found);
	if (!found)
		pg_atomic_init_u64(&purge_shared->visit_state, 0);
	LWLockRelease(AddinShmemInitLock);
}

/* Report this purge worker's state to the launcher, if its visit is current. */
static void
purge_report(VisitState state)
{
	uint64		cur = pg_atomic_read_u64(&purge_shared->visit_state);

	while ((uint32) (cur >> 32) == purge_visit)
	{
		if (pg_atomic_compare_exchange_u64(&purge_shared->visit_state, &cur,
										   ((uint64) purge_visit << 32) | state))
			break;
	}
}

/* The state the worker of a visit reported. */
static VisitState
visit_state(uint32 visit)
{
	uint64		cur = pg_atomic_read_u64(&purge_shared->visit_state);

	if ((uint32) (cur >> 32) != visit)
		return VISIT_FINISHED;
	return (VisitState) (cur & 0xFFFFFFFF);
}

/*
 * Register the launcher and ask for its shared state; called from _PG_init
 * when preloaded.
 */
void
idem_worker_register(void)
{
	BackgroundWorker worker;

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = worker_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = worker_shmem_startup;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker.bgw_start_time = BgWorkerStart_ConsistentState;
	worker.bgw_restart_time = IDEM_LAUNCHER_RESTART_SECS;
	strlcpy(worker.bgw_library_name, "idem", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_launcher_main", BGW_MAXLEN);
	strlcpy(worker.bgw_name, IDEM_LAUNCHER_TYPE, BGW_MAXLEN);
	strlcpy(worker.bgw_type, IDEM_LAUNCHER_TYPE, BGW_MAXLEN);
	worker.bgw_main_arg = (Datum) 0;
	worker.bgw_notify_pid = 0;
	RegisterBackgroundWorker(&worker);
}

/* Signal handlers and pg_stat_activity identity common to both workers. */
static void
worker_setup_signals(void)
{
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
}

/* Show the process under name in pg_stat_activity. */
static void
worker_set_appname(const char *name)
{
	SetConfigOption("application_name", name, PGC_USERSET, PGC_S_OVERRIDE);
}

/* Set a setting over whatever the database, role or file says. */
static void
force_setting(const char *name, const char *value)
{
	SetConfigOption(name, value, PGC_SUSET, PGC_S_OVERRIDE);
}

/*
 * Override the settings that ALTER DATABASE/ROLE ... SET or the
 * configuration file could use to stall or fail this process's
 * transactions: SERIALIZABLE READ ONLY DEFERRABLE waits in
 * GetSafeSnapshot for every serializable transaction in the cluster,
 * read-only refuses the deletes, and timeouts would cancel them.  Lock
 * waits are bounded by lock_timeout_ms (0: no bound).
 */
static void
worker_force_settings(int lock_timeout_ms)
{
	char		buf[32];

	force_setting("default_transaction_isolation", "read committed");
	force_setting("default_transaction_read_only", "off");
	force_setting("default_transaction_deferrable", "off");
	force_setting("statement_timeout", "0");
	force_setting("idle_in_transaction_session_timeout", "0");
#if PG_VERSION_NUM >= 170000
	force_setting("transaction_timeout", "0");
#endif
	snprintf(buf, sizeof(buf), "%d", lock_timeout_ms);
	force_setting("lock_timeout", buf);
}

/* Re-read the configuration file if a SIGHUP came in; true if it did. */
static bool
worker_reload_config(void)
{
	if (!ConfigReloadPending)
		return false;
	ConfigReloadPending = false;
	ProcessConfigFile(PGC_SIGHUP);
	return true;
}

/*
 * The databases to visit: those that accept connections and are not
 * templates, the ones whose visit was stuck last pass at the end.  The
 * list and its entries are allocated in cxt.  Also frees the idem_stats
 * slots of databases that no longer exist.
 */
static List *
database_list(MemoryContext cxt)
{
	List	   *result = NIL;
	List	   *later = NIL;
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tuple;
	Oid			counted[IDEM_STATS_SLOTS];
	bool		exists[IDEM_STATS_SLOTS];
	int			ncounted;
	int			i;

	/*
	 * Databases with counters, read before the catalog snapshot: a database
	 * that has a slot by now was created before it, so the scan sees it
	 * unless it has been dropped.
	 */
	ncounted = idem_stats_databases(counted);
	memset(exists, false, sizeof(exists));

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	(void) GetTransactionSnapshot();

	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while (HeapTupleIsValid(tuple = heap_getnext(scan, ForwardScanDirection)))
	{
		Form_pg_database form = (Form_pg_database) GETSTRUCT(tuple);
		MemoryContext old;
		IdemDatabase *db;

		for (i = 0; i < ncounted; i++)
		{
			if (counted[i] == form->oid)
				exists[i] = true;
		}

		if (!form->datallowconn || form->datistemplate)
			continue;
#ifdef DATCONNLIMIT_INVALID_DB
		/* Left behind by an interrupted DROP DATABASE. */
		if (form->datconnlimit == DATCONNLIMIT_INVALID_DB)
			continue;
#endif

		old = MemoryContextSwitchTo(cxt);
		db = palloc(sizeof(IdemDatabase));
		db->oid = form->oid;
		strlcpy(db->name, NameStr(form->datname), NAMEDATALEN);
		if (list_member_oid(deferred_dbs, db->oid))
			later = lappend(later, db);
		else
			result = lappend(result, db);
		MemoryContextSwitchTo(old);
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);

	CommitTransactionCommand();

	for (i = 0; i < ncounted; i++)
	{
		if (!exists[i])
		{
			idem_stats_forget(counted[i]);
			elog(DEBUG1, "idem launcher: freed the statistics of dropped database %u",
				 counted[i]);
		}
	}

	return list_concat(result, later);
}

/*
 * Whether a database still exists and accepts connections, checked just
 * before starting its worker so that a database dropped since the list
 * was made is skipped instead of failing the worker's connection.
 */
static bool
database_still_open(Oid dboid)
{
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tuple;
	ScanKeyData key;
	bool		open = false;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	(void) GetTransactionSnapshot();

	ScanKeyInit(&key, Anum_pg_database_oid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(dboid));
	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 1, &key);
	tuple = heap_getnext(scan, ForwardScanDirection);
	if (HeapTupleIsValid(tuple))
	{
		Form_pg_database form = (Form_pg_database) GETSTRUCT(tuple);

		open = form->datallowconn && !form->datistemplate;
#ifdef DATCONNLIMIT_INVALID_DB
		if (form->datconnlimit == DATCONNLIMIT_INVALID_DB)
			open = false;
#endif
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);

	CommitTransactionCommand();
	return open;
}

/*
 * Start a purge worker for one database and wait until it exits.  A worker
 * that has not started purging within twice the visit deadline is
 * terminated (its own lock_timeout normally ends a lock wait before that).
 */
static VisitResult
visit_database(IdemDatabase *db, uint32 visit)
{
	BackgroundWorker worker;
	BackgroundWorkerHandle *handle;
	PurgeWorkerArgs args;
	TimestampTz started;
	int			limit_ms = 2 * visit_deadline_ms();
	bool		terminated = false;
	VisitResult result = VISIT_DONE;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
#ifdef BGWORKER_INTERRUPTIBLE
	/* Let DROP/ALTER/CREATE DATABASE end the worker instead of waiting. */
	worker.bgw_flags |= BGWORKER_INTERRUPTIBLE;
#endif
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker.bgw_restart_time = BGW_NEVER_RESTART;
	strlcpy(worker.bgw_library_name, "idem", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_purge_main", BGW_MAXLEN);
	snprintf(worker.bgw_name, BGW_MAXLEN, "idem purge of database \"%s\"",
			 db->name);
	strlcpy(worker.bgw_type, IDEM_PURGE_TYPE, BGW_MAXLEN);
	worker.bgw_main_arg = ObjectIdGetDatum(db->oid);
	memset(&args, 0, sizeof(args));
	args.visit = visit;
	strlcpy(args.dbname, db->name, NAMEDATALEN);
	memcpy(worker.bgw_extra, &args, sizeof(args));
	worker.bgw_notify_pid = MyProcPid;

	pg_atomic_write_u64(&purge_shared->visit_state,
						((uint64) visit << 32) | VISIT_STARTING);
	if (!RegisterDynamicBackgroundWorker(&worker, &handle))
		return VISIT_NO_SLOT;

	/* The postmaster sets our latch when the worker starts and stops. */
	started = GetCurrentTimestamp();
	for (;;)
	{
		pid_t		pid;
		BgwHandleStatus status = GetBackgroundWorkerPid(handle, &pid);
		long		wait_ms = 1000;

		if (status == BGWH_STOPPED)
			break;
		if (status == BGWH_POSTMASTER_DIED)
			proc_exit(1);

		if (!terminated && visit_state(visit) == VISIT_STARTING)
		{
			TimestampTz now = GetCurrentTimestamp();
			long		elapsed_ms = (long) ((now - started) / 1000);

			if (elapsed_ms >= limit_ms)
			{
				ereport(LOG,
						(errmsg("idem launcher: purge worker for database \"%s\" did not start purging within %d ms; terminating it",
								db->name, limit_ms),
						 errdetail("The database is visited again next pass, after the others.")));
				TerminateBackgroundWorker(handle);
				terminated = true;
				result = VISIT_STUCK;
			}
			else
				wait_ms = Min(wait_ms, limit_ms - elapsed_ms);
		}

		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 wait_ms, WAIT_EVENT_BGWORKER_SHUTDOWN);
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
	pfree(handle);

	if (visit_state(visit) == VISIT_LOCKED)
		result = VISIT_STUCK;
	return result;
}

/* Reload the configuration in the launcher, logging the settings it uses. */
static void
launcher_reload_config(void)
{
	if (worker_reload_config())
		elog(DEBUG1, "idem launcher: configuration reloaded: purge_enabled %s, purge_naptime %d s, purge_batch_size %d, purge_rate_limit %d",
			 idem_purge_enabled ? "on" : "off", idem_purge_naptime,
			 idem_purge_batch_size, idem_purge_rate_limit);
}

/* Sleep ms milliseconds in the launcher, or less if its latch is set. */
static void
launcher_sleep(long ms)
{
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, launcher_wait_event());
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}

/*
 * Visit one database, starting its worker again while no background worker
 * slot is free.  Each failure is counted and logged; the waits between
 * tries double from IDEM_START_RETRY_MS up to idem.purge_naptime.  Gives
 * up when purge is disabled or the database is gone.
 */
static VisitResult
visit_database_retrying(IdemDatabase *db, uint32 *visit)
{
	long		delay_ms = IDEM_START_RETRY_MS;

	for (;;)
	{
		VisitResult result;
		uint64		failures;
		char		reason[128];

		CHECK_FOR_INTERRUPTS();
		launcher_reload_config();
		if (!idem_purge_enabled || !database_still_open(db->oid))
			return VISIT_DONE;

		result = visit_database(db, ++(*visit));
		if (result != VISIT_NO_SLOT)
			return result;

		snprintf(reason, sizeof(reason),
				 "purge worker not started: all %d background worker slots (max_worker_processes) were in use",
				 max_worker_processes);
		failures = idem_stats_start_failed(db->oid, reason);
		ereport(LOG,
				(errmsg("idem launcher could not start a purge worker for database \"%s\"",
						db->name),
				 errdetail("All %d background worker slots are in use; %llu purge worker starts have failed since the server started.",
						   max_worker_processes, (unsigned long long) failures),
				 errhint("Raise max_worker_processes or lower max_parallel_workers; the launcher tries again in %ld ms.",
						 delay_ms)));
		launcher_sleep(delay_ms);
		delay_ms = Min(delay_ms * 2, (long) idem_purge_naptime * 1000);
	}
}

/*
 * One pass: free the statistics of dropped databases and, unless purge is
 * disabled or the server is a standby, visit every database once.
 */
static void
launcher_pass(MemoryContext pass_cxt, uint32 *visit)
{
	List	   *dbs;
	List	   *stuck = NIL;
	ListCell   *lc;
	MemoryContext old;

	dbs = database_list(pass_cxt);
	if (!idem_purge_enabled)
	{
		elog(DEBUG1, "idem launcher: no purge pass, idem.purge_enabled is off");
		MemoryContextReset(pass_cxt);
		return;
	}
	if (RecoveryInProgress())
	{
		elog(DEBUG1, "idem launcher: no purge pass, recovery is in progress");
		MemoryContextReset(pass_cxt);
		return;
	}

	pgstat_report_activity(STATE_RUNNING, "idem: purge pass");
	foreach(lc, dbs)
	{
		IdemDatabase *db = (IdemDatabase *) lfirst(lc);

		if (!idem_purge_enabled)
			break;
		if (visit_database_retrying(db, visit) == VISIT_STUCK)
		{
			old = MemoryContextSwitchTo(TopMemoryContext);
			stuck = lappend_oid(stuck, db->oid);
			MemoryContextSwitchTo(old);
		}
	}
	list_free(deferred_dbs);
	deferred_dbs = stuck;
	MemoryContextReset(pass_cxt);
	pgstat_report_activity(STATE_IDLE, NULL);
}

/*
 * Entry point of the launcher.  A pass starts every idem.purge_naptime
 * seconds, counted from the start of the previous one; a pass longer than
 * that is followed by the next at once.
 */
void
idem_launcher_main(Datum main_arg)
{
	MemoryContext pass_cxt;
	TimestampTz last_pass = 0;
	uint32		visit;

	worker_setup_signals();
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	worker_set_appname(IDEM_LAUNCHER_TYPE);
	worker_force_settings(0);
	pgstat_report_activity(STATE_IDLE, NULL);

	pass_cxt = AllocSetContextCreate(TopMemoryContext, "idem launcher pass",
									 ALLOCSET_DEFAULT_SIZES);
	/* Go on from the visits of an earlier launcher. */
	visit = (uint32) (pg_atomic_read_u64(&purge_shared->visit_state) >> 32);

	ereport(LOG, (errmsg("idem launcher started")));

	for (;;)
	{
		TimestampTz now;
		TimestampTz next_pass;
		long		delay_ms;

		CHECK_FOR_INTERRUPTS();
		launcher_reload_config();

		now = GetCurrentTimestamp();
		next_pass = last_pass + (int64) idem_purge_naptime * USECS_PER_SEC;
		if (last_pass == 0 || now >= next_pass)
		{
			last_pass = now;
			launcher_pass(pass_cxt, &visit);
			continue;
		}

		/* At most one naptime, even if the clock was set back. */
		delay_ms = (long) Min((next_pass - now + 999) / 1000,
							  (int64) idem_purge_naptime * 1000);
		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 delay_ms, launcher_wait_event());
		ResetLatch(MyLatch);
	}
}

/*
 * Take, for this transaction, the lock a new session takes on its
 * database while connecting.  DROP DATABASE, ALTER DATABASE ... RENAME and
 * CREATE DATABASE ... TEMPLATE hold a conflicting lock while they wait for
 * the database's sessions to leave; false means one of them is waiting.
 */
static bool
database_lock_available(void)
{
	LOCKTAG		tag;

	SET_LOCKTAG_OBJECT(tag, InvalidOid, DatabaseRelationId, MyDatabaseId, 0);
	return LockAcquire(&tag, RowExclusiveLock, false, true) != LOCKACQUIRE_NOT_AVAIL;
}

/*
 * Wait, after a batch that started at batch_start and deleted n keys,
 * until the batch and the wait together took n / idem.purge_rate_limit
 * seconds.  A limit changed by a reload applies at once, counted from the
 * same start; 0 ends the wait.  Each wait is at most about a second (a
 * batch is at most a second's worth of keys), so SIGTERM, a reload and a
 * command waiting for the database are answered as soon as between
 * batches.
 */
static void
purge_pace(int64 n, TimestampTz batch_start)
{
	TimestampTz waited_from = GetCurrentTimestamp();
	TimestampTz now = waited_from;

	while (idem_purge_rate_limit > 0)
	{
		TimestampTz due = batch_start +
			n * USECS_PER_SEC / idem_purge_rate_limit;

		if (now >= due)
			break;
		(void) WaitLatch(MyLatch,
						 WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 (long) ((due - now + 999) / 1000),
						 purge_pace_wait_event());
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
		(void) worker_reload_config();
		now = GetCurrentTimestamp();
	}
	purge_paced_us += now - waited_from;
}

/*
 * Rows per batch: idem.purge_batch_size, and with idem.purge_rate_limit
 * at most one second's worth.
 */
static int
purge_batch_limit(void)
{
	if (idem_purge_rate_limit > 0)
		return Min(idem_purge_batch_size, idem_purge_rate_limit);
	return idem_purge_batch_size;
}

/*
 * Delete one batch of expired keys in a transaction of its own.  Whether
 * idem is installed is checked before the transaction takes a snapshot.
 * A batch that deleted keys and did not end the pass is paced.
 */
static PurgeBatchResult
purge_batch(int batch_size)
{
	int64		n;
	bool		pass_done;
	TimestampTz batch_start = GetCurrentTimestamp();

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (!database_lock_available())
	{
		CommitTransactionCommand();
		return BATCH_YIELD;
	}
	if (!OidIsValid(get_extension_oid("idem", true)))
	{
		CommitTransactionCommand();
		return BATCH_NO_EXTENSION;
	}
	if (purge_batches == 0)
	{
		purge_report(VISIT_PURGING);
		/* Errors are recorded after their transaction aborted. */
		idem_stats_prepare_encoding();
	}
	PushActiveSnapshot(GetTransactionSnapshot());
	/* Nothing expired yet: the pass ends without reading the table. */
	if (purge_batches == 0 && !idem_purge_pass_start(idem_now()))
	{
		PopActiveSnapshot();
		CommitTransactionCommand();
		purge_batches++;
		return BATCH_LAST;
	}

	pgstat_report_activity(STATE_RUNNING, "idem: deleting expired keys");
	n = idem_purge_batch(idem_now(), batch_size, &pass_done);
	PopActiveSnapshot();
	CommitTransactionCommand();
	if (pass_done)
		idem_purge_pass_end();
	else
		idem_purge_pass_save();
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);

	purge_deleted += n;
	purge_batches++;
	if (pass_done)
		return BATCH_LAST;
	if (n > 0)
		purge_pace(n, batch_start);
	return BATCH_MORE;
}

/*
 * Purge the current database until a batch ends the pass.  A pass paced
 * by idem.purge_rate_limit ends the visit after the visit deadline, so
 * that a backlog in one database does not hold up the others: the
 * launcher's next pass goes on with it (at once, as this pass took the
 * deadline, which is the naptime unless that is over 60 s).
 */
static PurgeBatchResult
purge_database(void)
{
	for (;;)
	{
		PurgeBatchResult result;

		CHECK_FOR_INTERRUPTS();
		worker_reload_config();
		if (!idem_purge_enabled || RecoveryInProgress())
			return BATCH_STOPPED;

		if (idem_purge_rate_limit > 0 && purge_batches > 0 &&
			TimestampDifferenceExceeds(purge_started, GetCurrentTimestamp(),
									   visit_deadline_ms()))
			return BATCH_PAUSED;

		result = purge_batch(purge_batch_limit());
		if (result != BATCH_MORE)
			return result;
	}
}

/*
 * Run purge_database.  A lock wait that ran out (another session holds a
 * lock on idem.keys) is logged as such, recorded in idem_stats, and ends
 * the worker normally: the launcher visits the database again next pass.
 * On any other error, record it in idem_stats, log it and exit with
 * status 1.
 */
static PurgeBatchResult
purge_database_or_exit(Oid dboid, const char *dbname,
					   MemoryContext error_cxt)
{
	PurgeBatchResult result = BATCH_STOPPED;

	PG_TRY();
	{
		result = purge_database();
	}
	PG_CATCH();
	{
		ErrorData  *edata;
		bool		locked;

		HOLD_INTERRUPTS();
		MemoryContextSwitchTo(error_cxt);
		edata = CopyErrorData();
		locked = (edata->sqlerrcode == ERRCODE_LOCK_NOT_AVAILABLE);
		if (!locked)
			EmitErrorReport();
		FlushErrorState();
		AbortCurrentTransaction();
		pgstat_report_activity(STATE_IDLE, NULL);
		if (locked)
		{
			char		reason[128];

			snprintf(reason, sizeof(reason),
					 "purge skipped: a lock was held by another session for more than %d ms",
					 visit_deadline_ms());
			idem_stats_purge_skipped(dboid, reason);
			purge_report(VISIT_LOCKED);
			ereport(LOG,
					(errmsg("idem purge: skipped database \"%s\": a lock was held by another session for more than %d ms",
							dbname, visit_deadline_ms()),
					 errdetail("A session holds a lock on idem.keys (LOCK TABLE, VACUUM FULL, REINDEX) or a catalog the purge needs; %lld keys were deleted before.",
							   (long long) purge_deleted),
					 errhint("The launcher visits the database again next pass, after the others.")));
			RESUME_INTERRUPTS();
			proc_exit(0);
		}
		idem_stats_purge_done(dboid, edata->message);
		purge_report(VISIT_FINISHED);
		RESUME_INTERRUPTS();
		proc_exit(1);
	}
	PG_END_TRY();

	return result;
}

/*
 * While the worker connects, its database may be dropped (or closed to
 * connections) after the launcher checked it: the connection then fails
 * with FATAL.  That is a race, not a problem, so log it only at DEBUG1.
 */
static void
purge_connect_log_hook(ErrorData *edata)
{
	if (purge_connecting && edata->elevel == FATAL &&
		(edata->sqlerrcode == ERRCODE_UNDEFINED_DATABASE ||
		 edata->sqlerrcode == ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE))
	{
		edata->elevel = DEBUG1;
		edata->output_to_server = message_level_is_interesting(DEBUG1);
	}
	if (prev_emit_log_hook)
		prev_emit_log_hook(edata);
}

/* Entry point of a purge worker; main_arg is the database's OID. */
void
idem_purge_main(Datum main_arg)
{
	Oid			dboid = DatumGetObjectId(main_arg);
	PurgeWorkerArgs args;
	MemoryContext error_cxt;
	PurgeBatchResult result;

	memcpy(&args, MyBgworkerEntry->bgw_extra, sizeof(args));
	purge_visit = args.visit;

	worker_setup_signals();
	prev_emit_log_hook = emit_log_hook;
	emit_log_hook = purge_connect_log_hook;
	purge_connecting = true;
	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);
	purge_connecting = false;
	worker_set_appname(IDEM_PURGE_TYPE);
	worker_force_settings(visit_deadline_ms());

	/*
	 * A purge lost in a crash is redone by the next pass, so its batches
	 * need not wait for their commit records to reach disk.
	 */
	force_setting("synchronous_commit", "off");

	error_cxt = AllocSetContextCreate(TopMemoryContext, "idem purge error",
									  ALLOCSET_DEFAULT_SIZES);
	purge_started = GetCurrentTimestamp();

	result = purge_database_or_exit(dboid, args.dbname, error_cxt);
	switch (result)
	{
		case BATCH_NO_EXTENSION:
			break;
		case BATCH_YIELD:
			elog(DEBUG1, "idem purge: leaving database \"%s\" to a command that waits for it, after %lld keys",
				 args.dbname, (long long) purge_deleted);
			break;
		case BATCH_STOPPED:
			elog(DEBUG1, "idem purge: stopped in database \"%s\" after %lld keys",
				 args.dbname, (long long) purge_deleted);
			break;
		case BATCH_MORE:
		case BATCH_LAST:
		case BATCH_PAUSED:
			idem_stats_purge_done(dboid, NULL);
			ereport((purge_deleted > 0 && idem_log_purge) ? LOG : DEBUG1,
					(errmsg("idem purge: deleted %lld expired keys from database \"%s\" in %d transaction(s), %ld ms, %lld ms of it paced by idem.purge_rate_limit",
							(long long) purge_deleted, args.dbname, purge_batches,
							TimestampDifferenceMilliseconds(purge_started, GetCurrentTimestamp()),
							(long long) (purge_paced_us / 1000)),
					 result == BATCH_PAUSED ?
					 errdetail("The visit reached its deadline of %d ms; the pass goes on at the next visit.",
							   visit_deadline_ms()) : 0));
			break;
	}
	purge_report(VISIT_FINISHED);
	proc_exit(0);
}
