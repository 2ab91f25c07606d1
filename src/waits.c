/*-------------------------------------------------------------------------
 *
 * waits.c
 *	  Waiting for the result of a claim another transaction committed.
 *
 * A duplicate of a request whose claim is committed and still running
 * (work outside the database) can wait in the server for the first
 * request's answer instead of being told the key is in flight
 * (idem_begin's wait_for).  The waiter sleeps on a condition variable in
 * shared memory, chosen by a hash of the database, scope and key out of a
 * fixed array: any number of keys share IDEM_WAIT_SLOTS variables, and a
 * collision only wakes a waiter for nothing (it looks at its key again and
 * sleeps on).  A transaction that completes, releases or takes over a key
 * notes the key's variable; once the transaction has committed, so that
 * what it wrote is visible, a transaction callback broadcasts on it.  A
 * lease that runs out is noticed by a timed sleep that ends with it.  The
 * waiter gets ready to sleep (ConditionVariablePrepareToSleep) before
 * each look at its key, so a broadcast that took it off the variable's
 * list while it waited for a row lock is not lost.
 *
 * A prepared transaction's callbacks do not run at COMMIT PREPARED, and
 * the backend that prepared it may be gone by then: the backend that runs
 * COMMIT PREPARED broadcasts on every variable instead (waits_ProcessUtility),
 * once the commit is visible.  That needs no state kept between PREPARE
 * and COMMIT PREPARED, so it holds across a restart too.  ROLLBACK
 * PREPARED, like ROLLBACK, changes nothing a sleeper waits for.
 *
 * A sleep on a condition variable is invisible to the deadlock detector.
 * A waiter whose transaction holds a transaction lock (it wrote or locked
 * rows) looks every deadlock_timeout whether another transaction waits
 * for it; if one does, that one may be the holder's completion, and
 * neither would go on until wait_for ends: the wait ends with 40P01.
 *
 * Without shared_preload_libraries there is no shared memory, and on a
 * hot standby no transaction of this server commits what the waiter
 * waits for: the waiter then looks at its key again every
 * IDEM_WAIT_POLL_MS.  A standby's wait for a transaction running on the
 * primary is idem_waits_for_primary's: lock_timeout holds there too.
 *
 * Who waits for what: pg_stat_activity shows a call waiting for the
 * transaction that holds a key as Lock/transactionid, and a wait_for
 * wait as an extension's wait, neither naming the key.  With
 * shared_preload_libraries each backend has an entry in shared memory,
 * indexed by its proc number, that it fills before it waits (the
 * transaction it waits for, or the claim's token) and clears after:
 * idem_waits() reads them.  A wait that ends with an error is cleared
 * when the transaction or subtransaction the error aborts ends (the
 * callbacks below), a backend that exits on the way clears it at exit,
 * and the next wait overwrites it anyway.  Only the backend writes its
 * entry, under a change counter as pgstat writes a backend's activity
 * (PGSTAT_BEGIN_WRITE_ACTIVITY): no lock, and nothing at all for a call
 * that does not wait.  A reader copies an entry until it reads the same
 * even count before and after.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/subtrans.h"
#include "access/transam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_authid_d.h"
#include "common/hashfn.h"
#include "common/string.h"
#include "fmgr.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "storage/condition_variable.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lock.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/procarray.h"
#include "storage/shmem.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "args.h"
#include "compat.h"
#include "settings.h"
#include "waits.h"

PG_FUNCTION_INFO_V1(idem_waits);

/* Condition variables shared by all keys of all databases. */
#define IDEM_WAIT_SLOTS		1024

/* How often a waiter without a condition variable looks again. */
#define IDEM_WAIT_POLL_MS	50

/* Keys one transaction notes at most; beyond, it wakes every waiter. */
#define IDEM_WAIT_NOTES		32

/* The longest sleep between looks of a standby waiting for the primary. */
#define IDEM_WAIT_PRIMARY_MAX_MS	100

/* Room for a scope or key in idem_waits: 64 bytes, "..." and the NUL. */
#define IDEM_WAIT_TEXT_LEN	(64 + 3 + 1)

/* What one backend waits for, as idem_waits() shows it. */
typedef struct WaitShown
{
	int			pid;			/* 0: not waiting */
	Oid			dboid;
	Oid			roleid;			/* the waiting session's user */
	int			encoding;		/* of its database: of scope and key */
	IdemWaitKind kind;
	TransactionId holder_xid;	/* IDEM_WAIT_TRANSACTION */
	int64		holder_token;	/* IDEM_WAIT_RESULT */
	TimestampTz since;
	char		scope[IDEM_WAIT_TEXT_LEN];	/* as idem_key_for_message */
	char		key[IDEM_WAIT_TEXT_LEN];
} WaitShown;

/* A backend's entry: written by that backend only. */
typedef struct WaitEntry
{
	pg_atomic_uint32 changecount;	/* odd while the backend writes */
	WaitShown	shown;
} WaitEntry;

static ConditionVariable *wait_slots = NULL;
static WaitEntry *wait_entries = NULL;	/* MaxBackends of them */
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;
static ProcessUtility_hook_type prev_ProcessUtility = NULL;

/* The slots this transaction changed keys of, broadcast at commit. */
static int	notes[IDEM_WAIT_NOTES];
static int	nnotes = 0;
static bool notes_overflow = false;
static bool xact_callback_registered = false;
static bool subxact_callback_registered = false;

/* The slot the current waiter sleeps on; -1 when it polls. */
static int	waiting_slot = -1;

/* The key of the current wait_for wait, and when it began (0: not yet). */
static text *waiting_scope = NULL;
static text *waiting_key = NULL;
static TimestampTz waiting_since = 0;

/* What this backend's entry shows; NULL when it shows nothing. */
static WaitShown *shown = NULL;
static bool exit_callback_registered = false;

/* Ask for the condition variables and the backends' entries. */
static void
waits_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(mul_size(IDEM_WAIT_SLOTS, sizeof(ConditionVariable)));
	RequestAddinShmemSpace(mul_size(MaxBackends, sizeof(WaitEntry)));
}

/* Create or attach to the condition variables and the backends' entries. */
static void
waits_shmem_startup(void)
{
	bool		found;
	bool		entries_found;
	int			i;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	wait_slots = ShmemInitStruct("idem waits",
								 mul_size(IDEM_WAIT_SLOTS, sizeof(ConditionVariable)),
								 &found);
	if (!found)
	{
		for (i = 0; i < IDEM_WAIT_SLOTS; i++)
			ConditionVariableInit(&wait_slots[i]);
	}
	wait_entries = ShmemInitStruct("idem wait entries",
								   mul_size(MaxBackends, sizeof(WaitEntry)),
								   &entries_found);
	if (!entries_found)
	{
		memset(wait_entries, 0, mul_size(MaxBackends, sizeof(WaitEntry)));
		for (i = 0; i < MaxBackends; i++)
			pg_atomic_init_u32(&wait_entries[i].changecount, 0);
	}
	LWLockRelease(AddinShmemInitLock);
}

/* Wake every waiter, whatever key it waits for. */
static void
broadcast_all(void)
{
	int			i;

	for (i = 0; i < IDEM_WAIT_SLOTS; i++)
		ConditionVariableBroadcast(&wait_slots[i]);
}

/*
 * After COMMIT PREPARED, wake every waiter: the prepared transaction's
 * notes were dropped at PREPARE.  standard_ProcessUtility has made the
 * commit visible when it returns.  A broadcast on a variable nobody
 * sleeps on costs a spinlock; a waiter woken for nothing looks at its key
 * once and sleeps on.
 */
static void
waits_ProcessUtility(PlannedStmt *pstmt, const char *queryString,
					 bool readOnlyTree, ProcessUtilityContext context,
					 ParamListInfo params, QueryEnvironment *queryEnv,
					 DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *parsetree = pstmt->utilityStmt;
	bool		commit_prepared = IsA(parsetree, TransactionStmt) &&
		((TransactionStmt *) parsetree)->kind == TRANS_STMT_COMMIT_PREPARED;

	if (prev_ProcessUtility)
		prev_ProcessUtility(pstmt, queryString, readOnlyTree, context,
							params, queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context,
								params, queryEnv, dest, qc);
	if (commit_prepared && wait_slots != NULL)
		broadcast_all();
}

/*
 * Install the shared memory hooks and the one that wakes waiters at
 * COMMIT PREPARED; called from _PG_init when preloaded.
 */
void
idem_waits_shmem_init(void)
{
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = waits_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = waits_shmem_startup;
	prev_ProcessUtility = ProcessUtility_hook;
	ProcessUtility_hook = waits_ProcessUtility;
}

/* The slot of a key of this database. */
static int
key_slot(text *scope, text *key)
{
	uint32		h = hash_uint32((uint32) MyDatabaseId);

	h = hash_combine(h, hash_bytes((const unsigned char *) VARDATA_ANY(scope),
								   VARSIZE_ANY_EXHDR(scope)));
	h = hash_combine(h, hash_bytes((const unsigned char *) VARDATA_ANY(key),
								   VARSIZE_ANY_EXHDR(key)));
	return (int) (h % IDEM_WAIT_SLOTS);
}

/*
 * Wake the waiters of the keys a committed transaction changed.  At the
 * end of a transaction no wait of this backend goes on: a wait that ended
 * with the error that aborts it is cleared.
 */
static void
waits_xact_callback(XactEvent event, void *arg)
{
	int			i;

	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			if (notes_overflow)
				broadcast_all();
			else
			{
				for (i = 0; i < nnotes; i++)
					ConditionVariableBroadcast(&wait_slots[notes[i]]);
			}
			/* fall through */
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			nnotes = 0;
			notes_overflow = false;
			idem_waits_hide();
			break;
		default:
			break;
	}
}

/*
 * A wait that ended with the error that aborts a subtransaction (a
 * PL/pgSQL block that catches it) is over.
 */
static void
waits_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					   SubTransactionId parentSubid, void *arg)
{
	if (event == SUBXACT_EVENT_ABORT_SUB)
		idem_waits_hide();
}

/*
 * Note that this transaction changed the key in a way a waiter waits for
 * (completed, released or took it over): its waiters are woken once the
 * transaction commits.  The notes of a transaction that is prepared are
 * dropped: COMMIT PREPARED wakes every waiter.
 */
void
idem_waits_note_change(text *scope, text *key)
{
	int			slot;
	int			i;

	/* Past IDEM_WAIT_NOTES keys the commit wakes every waiter anyway. */
	if (wait_slots == NULL || notes_overflow)
		return;
	slot = key_slot(scope, key);
	for (i = 0; i < nnotes; i++)
		if (notes[i] == slot)
			return;
	if (!xact_callback_registered)
	{
		RegisterXactCallback(waits_xact_callback, NULL);
		xact_callback_registered = true;
	}
	if (nnotes < IDEM_WAIT_NOTES)
		notes[nnotes++] = slot;
	else
		notes_overflow = true;
}

/* The wait event a waiter shows in pg_stat_activity. */
static uint32
wait_event(void)
{
	static uint32 event = 0;

	return idem_wait_event(&event, "IdemWaitForResult");
}

/* The wait event of a standby waiting for a transaction of the primary. */
static uint32
primary_wait_event(void)
{
	static uint32 event = 0;

	return idem_wait_event(&event, "IdemWaitForPrimary");
}

/* This backend's entry, or NULL if there are none or it has none. */
static WaitEntry *
my_entry(void)
{
	int			procno;

	if (wait_entries == NULL || MyProc == NULL)
		return NULL;
	procno = idem_my_proc_number();
	if (procno < 0 || procno >= MaxBackends)
		return NULL;
	return &wait_entries[procno];
}

/*
 * Write this backend's entry: a copy of *what, or nothing if what is NULL.
 * Readers see the old or the new entry, never half of each.  Nothing in
 * between can fail.
 */
static void
write_entry(WaitEntry *entry, const WaitShown *what)
{
	uint32		count = pg_atomic_read_u32(&entry->changecount);

	START_CRIT_SECTION();
	pg_atomic_write_u32(&entry->changecount, count + 1);
	pg_write_barrier();
	if (what != NULL)
		memcpy(&entry->shown, what, sizeof(WaitShown));
	else
		entry->shown.pid = 0;
	pg_write_barrier();
	pg_atomic_write_u32(&entry->changecount, count + 2);
	END_CRIT_SECTION();
}

/* Clear this backend's entry when it exits, also on FATAL. */
static void
waits_backend_exit(int code, Datum arg)
{
	idem_waits_hide();
}

/* A scope or key as shown: clipped as in error messages. */
static void
set_shown_text(char *dst, text *src)
{
	char	   *s = idem_key_for_message(src);

	strlcpy(dst, s, IDEM_WAIT_TEXT_LEN);
	pfree(s);
}

/*
 * Show in idem_waits that this backend is about to wait for the key:
 * kind IDEM_WAIT_TRANSACTION for the transaction holder_xid,
 * IDEM_WAIT_RESULT for the result of the claim with holder_token.  Only
 * called before a wait; idem_waits_hide clears it after.
 */
void
idem_waits_show(IdemWaitKind kind, text *scope, text *key,
				TransactionId holder_xid, int64 holder_token)
{
	static WaitShown what;
	WaitEntry  *entry = my_entry();

	if (entry == NULL || scope == NULL || key == NULL)
		return;
	if (!exit_callback_registered)
	{
		before_shmem_exit(waits_backend_exit, (Datum) 0);
		exit_callback_registered = true;
	}
	if (!xact_callback_registered)
	{
		RegisterXactCallback(waits_xact_callback, NULL);
		xact_callback_registered = true;
	}
	if (!subxact_callback_registered)
	{
		RegisterSubXactCallback(waits_subxact_callback, NULL);
		subxact_callback_registered = true;
	}
	what.pid = MyProcPid;
	what.dboid = MyDatabaseId;
	what.roleid = GetSessionUserId();
	what.encoding = GetDatabaseEncoding();
	what.kind = kind;
	what.holder_xid = holder_xid;
	what.holder_token = holder_token;
	what.since = (kind == IDEM_WAIT_RESULT && waiting_since != 0) ?
		waiting_since : GetCurrentTimestamp();
	set_shown_text(what.scope, scope);
	set_shown_text(what.key, key);
	write_entry(entry, &what);
	shown = &what;
}

/* Clear what idem_waits_show showed, if anything. */
void
idem_waits_hide(void)
{
	WaitEntry  *entry;

	if (shown == NULL)
		return;
	shown = NULL;
	if ((entry = my_entry()) != NULL)
		write_entry(entry, NULL);
}

/*
 * Start a call that may wait for a change of the key (wait_for): choose
 * its variable.  idem_waits_arm gets ready to sleep on it.
 */
void
idem_waits_prepare(text *scope, text *key)
{
	waiting_scope = scope;
	waiting_key = key;
	waiting_since = 0;
	if (wait_slots == NULL || RecoveryInProgress())
	{
		waiting_slot = -1;
		return;
	}
	waiting_slot = key_slot(scope, key);
}

/*
 * Get ready to sleep, before each look at the key (condition_variable.c's
 * contract: prepare, check the condition, sleep), so that a change
 * committed after the look still wakes the sleep.  Before every look, not
 * only the first: a broadcast takes this backend off the variable's list,
 * and one that comes while it waits for a row lock (whose latch wait
 * swallows the wake-up) or a sleep on another variable would otherwise
 * leave it sleeping until its lease or wait ends.
 */
void
idem_waits_arm(void)
{
	if (waiting_slot >= 0)
		ConditionVariablePrepareToSleep(&wait_slots[waiting_slot]);
}

/*
 * Does another transaction wait for this one (for a row it wrote or
 * locked, or a key it holds)?  Checks the top transaction's lock and the
 * current subtransaction's.
 */
static bool
xact_has_waiters(void)
{
	TransactionId top = GetTopTransactionIdIfAny();
	TransactionId sub = GetCurrentTransactionIdIfAny();
	LOCKTAG		tag;

	if (TransactionIdIsValid(top))
	{
		SET_LOCKTAG_TRANSACTION(tag, top);
		if (LockHasWaiters(&tag, ExclusiveLock, false))
			return true;
	}
	if (TransactionIdIsValid(sub) && sub != top)
	{
		SET_LOCKTAG_TRANSACTION(tag, sub);
		if (LockHasWaiters(&tag, ExclusiveLock, false))
			return true;
	}
	return false;
}

/*
 * Sleep on the key's variable for up to ms.  A transaction that holds
 * transaction locks sleeps deadlock_timeout at a time, and ends the wait
 * with 40P01 if another transaction waits for it: the sleep is invisible
 * to the deadlock detector, and the holder's completion may be that
 * transaction.  Returns when woken or when ms have passed.
 */
static void
sleep_on_slot(long ms)
{
	ConditionVariable *cv = &wait_slots[waiting_slot];

	while (ms > 0)
	{
		long		chunk = ms;
		bool		check = TransactionIdIsValid(GetTopTransactionIdIfAny()) &&
			DeadlockTimeout > 0 && DeadlockTimeout < ms;
		TimestampTz started = GetCurrentTimestamp();

		if (check)
			chunk = DeadlockTimeout;
		if (!ConditionVariableTimedSleep(cv, chunk, wait_event()))
			return;				/* woken: look at the key */
		if (!check)
			return;
		if (xact_has_waiters())
			ereport(ERROR,
					(errcode(ERRCODE_T_R_DEADLOCK_DETECTED),
					 errmsg("deadlock detected while waiting for the result of idempotency key \"%s\"",
							idem_key_for_message(waiting_key)),
					 errdetail("Another transaction waits for a lock this transaction holds; if it is the one to complete or release the key, neither can go on until wait_for ends."),
					 errhint("Retry the transaction. Call idem_begin with wait_for before taking row locks that other transactions need.")));
		ms -= (long) ((GetCurrentTimestamp() - started) / 1000);
	}
}

/*
 * Sleep until a change of the key is committed, or until (idem's clock),
 * whichever comes first; without a condition variable, for at most
 * IDEM_WAIT_POLL_MS.  Interrupts (cancel, statement_timeout) end it with
 * an error.  Returns false once until has passed.  idem_waits shows the
 * wait, for the claim with holder_token, from the first sleep of the
 * wait on.
 */
bool
idem_waits_sleep(TimestampTz until, int64 holder_token)
{
	TimestampTz now = idem_now();
	long		ms;

	if (now >= until)
		return false;
	ms = (long) ((until - now + 999) / 1000);
	if (shown == NULL || shown->kind != IDEM_WAIT_RESULT ||
		shown->holder_token != holder_token)
	{
		idem_waits_show(IDEM_WAIT_RESULT, waiting_scope, waiting_key,
						InvalidTransactionId, holder_token);
		if (shown != NULL)
			waiting_since = shown->since;
	}
	if (waiting_slot < 0)
	{
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Min(ms, IDEM_WAIT_POLL_MS), wait_event());
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
	else
		sleep_on_slot(ms);
	return true;
}

/*
 * On a hot standby, wait until the primary's transaction xid (or the
 * subtransaction, or its top transaction) ends, as XactLockTableWait
 * does on the primary: there, that is a 1 ms polling loop without a wait
 * event that lock_timeout does not end.  Here the backend sleeps on its
 * latch (interrupts and statement_timeout end it), shows a wait event,
 * backs off from 1 ms to IDEM_WAIT_PRIMARY_MAX_MS, and ends with 55P03
 * once lock_timeout has passed, as the lock wait on the primary would.
 * TransactionIdIsInProgress answers for subtransactions too: one that
 * committed into a running parent is in progress until the parent ends.
 */
void
idem_waits_for_primary(TransactionId xid)
{
	TimestampTz deadline = 0;
	long		delay = 1;

	if (LockTimeout > 0)
		deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), LockTimeout);
	for (;;)
	{
		long		timeout = delay;

		CHECK_FOR_INTERRUPTS();
		if (!TransactionIdIsInProgress(xid))
			break;
		if (deadline != 0)
		{
			TimestampTz now = GetCurrentTimestamp();

			if (now >= deadline)
				ereport(ERROR,
						(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
						 errmsg("canceling statement due to lock timeout")));
			timeout = Min(timeout, (long) ((deadline - now + 999) / 1000));
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 timeout, primary_wait_event());
		ResetLatch(MyLatch);
		delay = Min(delay * 2, IDEM_WAIT_PRIMARY_MAX_MS);
	}
}

/* The wait is over. */
void
idem_waits_done(void)
{
	if (waiting_slot >= 0)
		ConditionVariableCancelSleep();
	waiting_slot = -1;
	idem_waits_hide();
	waiting_scope = NULL;
	waiting_key = NULL;
	waiting_since = 0;
}

/* Error out unless the backends' entries exist. */
static void
require_entries(void)
{
	if (wait_entries == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem waits are not tracked: the library is not preloaded"),
				 errhint("Add idem to shared_preload_libraries and restart the server.")));
}

/*
 * The backend running transaction xid (its top-level transaction, if xid
 * is a subtransaction's), or 0 if none does (it ended, or it is prepared).
 */
static int
holder_pid(TransactionId xid)
{
	int			pid = BackendXidGetPid(xid);

	/* pg_subtrans can be read for transactions this snapshot may see running. */
	if (pid == 0 && TransactionIdIsNormal(xid) &&
		TransactionIdFollowsOrEquals(xid, TransactionXmin))
	{
		TransactionId top = SubTransGetTopmostTransaction(xid);

		if (top != xid)
			pid = BackendXidGetPid(top);
	}
	return pid;
}

/*
 * A scope or key of a database of the given encoding, as text of this
 * one: if the encodings differ, each character beyond ASCII becomes '?'.
 */
static Datum
shown_text(const char *s, int encoding)
{
	StringInfoData buf;
	const char *end;

	if (encoding == GetDatabaseEncoding() || pg_is_ascii(s))
		return CStringGetTextDatum(s);
	initStringInfo(&buf);
	end = s + strlen(s);
	while (s < end)
	{
		if (IS_HIGHBIT_SET(*s))
		{
			appendStringInfoChar(&buf, '?');
			s += Min(pg_encoding_mblen(encoding, s), end - s);
		}
		else
			appendStringInfoChar(&buf, *s++);
	}
	return PointerGetDatum(cstring_to_text_with_len(buf.data, buf.len));
}

/* The columns of idem_waits(). */
#define IDEM_WAITS_COLS		9

/*
 * idem_waits(): one row per backend waiting for a key.  The scope, the
 * key and the claim's token are shown, as pg_stat_activity shows a
 * query, to members of pg_read_all_stats and to roles with the privileges
 * of the waiting session's user; to others they are NULL.
 */
Datum
idem_waits(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	bool		read_all = has_privs_of_role(GetUserId(), ROLE_PG_READ_ALL_STATS);
	int			i;

	require_entries();
	InitMaterializedSRF(fcinfo, 0);
	if (rsinfo->setDesc->natts != IDEM_WAITS_COLS)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("idem_waits() is declared with %d columns, expected %d",
						rsinfo->setDesc->natts, IDEM_WAITS_COLS),
				 errhint("Run ALTER EXTENSION idem UPDATE.")));

	for (i = 0; i < MaxBackends; i++)
	{
		WaitEntry  *entry = &wait_entries[i];
		WaitShown	w;
		Datum		values[IDEM_WAITS_COLS];
		bool		nulls[IDEM_WAITS_COLS];
		bool		visible;

		/* A copy the backend did not change while it was taken. */
		for (;;)
		{
			uint32		before = pg_atomic_read_u32(&entry->changecount);
			uint32		after;

			pg_read_barrier();
			memcpy(&w, &entry->shown, sizeof(WaitShown));
			pg_read_barrier();
			after = pg_atomic_read_u32(&entry->changecount);
			if (before == after && (before & 1) == 0)
				break;
			CHECK_FOR_INTERRUPTS();
		}
		if (w.pid == 0)
			continue;
		w.scope[IDEM_WAIT_TEXT_LEN - 1] = '\0';
		w.key[IDEM_WAIT_TEXT_LEN - 1] = '\0';
		visible = read_all || has_privs_of_role(GetUserId(), w.roleid);

		memset(nulls, false, sizeof(nulls));
		values[0] = Int32GetDatum(w.pid);
		values[1] = ObjectIdGetDatum(w.dboid);
		if (visible)
		{
			values[2] = shown_text(w.scope, w.encoding);
			values[3] = shown_text(w.key, w.encoding);
		}
		else
			nulls[2] = nulls[3] = true;
		values[4] = CStringGetTextDatum(w.kind == IDEM_WAIT_TRANSACTION ?
										"transaction" : "result");
		nulls[5] = nulls[6] = nulls[7] = true;
		if (w.kind == IDEM_WAIT_TRANSACTION)
		{
			int			pid = holder_pid(w.holder_xid);

			values[5] = Int32GetDatum(pid);
			nulls[5] = (pid == 0);
			values[6] = TransactionIdGetDatum(w.holder_xid);
			nulls[6] = false;
		}
		else if (visible)
		{
			values[7] = Int64GetDatum(w.holder_token);
			nulls[7] = false;
		}
		values[8] = TimestampTzGetDatum(w.since);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}
