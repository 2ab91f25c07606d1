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
 * batch of idem.purge_batch_size rows per transaction, until a batch finds
 * fewer rows than that.
 *
 * No process holds a database connection between passes, so DROP DATABASE,
 * ALTER DATABASE ... RENAME and CREATE DATABASE ... TEMPLATE work while the
 * launcher runs.  Those commands wait (up to five seconds) for the other
 * sessions of the database to leave, and take a lock on the database
 * object first; a purge worker checks that lock before each batch and
 * leaves as soon as such a command is waiting.
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
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_database.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lock.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "idem.h"
#include "stats.h"
#include "worker.h"

/* Seconds before the postmaster starts a failed launcher again. */
#define IDEM_LAUNCHER_RESTART_SECS	5

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

/* How one purge batch ended. */
typedef enum PurgeBatchResult
{
	BATCH_FULL,					/* deleted a full batch: there may be more */
	BATCH_LAST,					/* deleted less than a batch: done */
	BATCH_NO_EXTENSION,			/* idem is not installed here */
	BATCH_YIELD,				/* a command waits for the database */
	BATCH_STOPPED				/* purge was disabled meanwhile */
} PurgeBatchResult;

/* Work done by this purge worker, for its log line. */
static int64 purge_deleted = 0;
static int	purge_batches = 0;

/* The launcher's wait event while it sleeps between passes. */
static uint32
launcher_wait_event(void)
{
#if PG_VERSION_NUM >= 170000
	static uint32 wait_event = 0;

	if (wait_event == 0)
		wait_event = WaitEventExtensionNew("IdemLauncherMain");
	return wait_event;
#else
	return PG_WAIT_EXTENSION;
#endif
}

/* Register the launcher; called from _PG_init when preloaded. */
void
idem_worker_register(void)
{
	BackgroundWorker worker;

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

static void
worker_set_appname(const char *name)
{
	SetConfigOption("application_name", name, PGC_USERSET, PGC_S_OVERRIDE);
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
 * templates.  The list and its entries are allocated in cxt.
 */
static List *
database_list(MemoryContext cxt)
{
	List	   *result = NIL;
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tuple;

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
		result = lappend(result, db);
		MemoryContextSwitchTo(old);
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);

	CommitTransactionCommand();
	return result;
}

/*
 * Start a purge worker for one database and wait until it exits.  Returns
 * false if no worker could be started; the pass should then stop.
 */
static bool
visit_database(IdemDatabase *db)
{
	BackgroundWorker worker;
	BackgroundWorkerHandle *handle;
	BgwHandleStatus status;

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
	/* The name, for log lines only: the worker finds its database by OID. */
	strlcpy(worker.bgw_extra, db->name, BGW_EXTRALEN);
	worker.bgw_notify_pid = MyProcPid;

	if (!RegisterDynamicBackgroundWorker(&worker, &handle))
	{
		ereport(LOG,
				(errmsg("idem launcher could not start a purge worker for database \"%s\"",
						db->name),
				 errdetail("All background worker slots are in use."),
				 errhint("Raise max_worker_processes; the launcher tries again after idem.purge_naptime.")));
		return false;
	}

	status = WaitForBackgroundWorkerShutdown(handle);
	pfree(handle);
	if (status == BGWH_POSTMASTER_DIED)
		proc_exit(1);
	return true;
}

/* Reload the configuration in the launcher, logging the settings it uses. */
static void
launcher_reload_config(void)
{
	if (worker_reload_config())
		elog(DEBUG1, "idem launcher: configuration reloaded: purge_enabled %s, purge_naptime %d s, purge_batch_size %d",
			 idem_purge_enabled ? "on" : "off", idem_purge_naptime,
			 idem_purge_batch_size);
}

/* One pass: visit every database once, unless purge gets disabled. */
static void
launcher_pass(MemoryContext pass_cxt)
{
	List	   *dbs;
	ListCell   *lc;

	pgstat_report_activity(STATE_RUNNING, "idem: purge pass");
	dbs = database_list(pass_cxt);
	foreach(lc, dbs)
	{
		CHECK_FOR_INTERRUPTS();
		launcher_reload_config();
		if (!idem_purge_enabled)
			break;
		if (!visit_database((IdemDatabase *) lfirst(lc)))
			break;
	}
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

	worker_setup_signals();
	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	worker_set_appname(IDEM_LAUNCHER_TYPE);
	pgstat_report_activity(STATE_IDLE, NULL);

	pass_cxt = AllocSetContextCreate(TopMemoryContext, "idem launcher pass",
									 ALLOCSET_DEFAULT_SIZES);

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
			if (!idem_purge_enabled)
				elog(DEBUG1, "idem launcher: no purge pass, idem.purge_enabled is off");
			else if (RecoveryInProgress())
				elog(DEBUG1, "idem launcher: no purge pass, recovery is in progress");
			else
				launcher_pass(pass_cxt);
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

/* Delete one batch of expired keys in a transaction of its own. */
static PurgeBatchResult
purge_batch(int batch_size)
{
	int64		n;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (!database_lock_available())
	{
		CommitTransactionCommand();
		return BATCH_YIELD;
	}
	PushActiveSnapshot(GetTransactionSnapshot());
	if (!OidIsValid(get_extension_oid("idem", true)))
	{
		PopActiveSnapshot();
		CommitTransactionCommand();
		return BATCH_NO_EXTENSION;
	}

	pgstat_report_activity(STATE_RUNNING, "idem: deleting expired keys");
	n = idem_purge_batch(idem_now(), batch_size);
	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);

	purge_deleted += n;
	purge_batches++;
	return (n < batch_size) ? BATCH_LAST : BATCH_FULL;
}

/* Purge the current database until a batch comes back short. */
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

		result = purge_batch(idem_purge_batch_size);
		if (result != BATCH_FULL)
			return result;
	}
}

/*
 * Run purge_database, and on error record it in idem_stats, log it and
 * exit with status 1.
 */
static PurgeBatchResult
purge_database_or_exit(Oid dboid, MemoryContext error_cxt)
{
	PurgeBatchResult result = BATCH_STOPPED;

	PG_TRY();
	{
		result = purge_database();
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		HOLD_INTERRUPTS();
		MemoryContextSwitchTo(error_cxt);
		edata = CopyErrorData();
		EmitErrorReport();
		FlushErrorState();
		AbortCurrentTransaction();
		pgstat_report_activity(STATE_IDLE, NULL);
		idem_stats_purge_done(dboid, edata->message);
		RESUME_INTERRUPTS();
		proc_exit(1);
	}
	PG_END_TRY();

	return result;
}

/* Entry point of a purge worker; main_arg is the database's OID. */
void
idem_purge_main(Datum main_arg)
{
	Oid			dboid = DatumGetObjectId(main_arg);
	const char *dbname = MyBgworkerEntry->bgw_extra;
	MemoryContext error_cxt;

	worker_setup_signals();
	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);
	worker_set_appname(IDEM_PURGE_TYPE);

	/*
	 * A purge lost in a crash is redone by the next pass, so its batches
	 * need not wait for their commit records to reach disk.
	 */
	SetConfigOption("synchronous_commit", "off", PGC_USERSET, PGC_S_OVERRIDE);

	error_cxt = AllocSetContextCreate(TopMemoryContext, "idem purge error",
									  ALLOCSET_DEFAULT_SIZES);

	switch (purge_database_or_exit(dboid, error_cxt))
	{
		case BATCH_NO_EXTENSION:
			break;
		case BATCH_YIELD:
			elog(DEBUG1, "idem purge: leaving database \"%s\" to a command that waits for it, after %lld keys",
				 dbname, (long long) purge_deleted);
			break;
		case BATCH_STOPPED:
			elog(DEBUG1, "idem purge: stopped in database \"%s\" after %lld keys",
				 dbname, (long long) purge_deleted);
			break;
		case BATCH_FULL:
		case BATCH_LAST:
			idem_stats_purge_done(dboid, NULL);
			elog(DEBUG1, "idem purge: deleted %lld expired keys from database \"%s\" in %d transaction(s)",
				 (long long) purge_deleted, dbname, purge_batches);
			break;
	}
	proc_exit(0);
}
