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
 * lease that runs out is noticed by a timed sleep that ends with it.
 *
 * Without shared_preload_libraries there is no shared memory, and on a
 * hot standby no transaction of this server commits what the waiter
 * waits for: the waiter then looks at its key again every
 * IDEM_WAIT_POLL_MS.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "access/xlog.h"
#include "common/hashfn.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/condition_variable.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/wait_event.h"

#include "compat.h"
#include "settings.h"
#include "waits.h"

/* Condition variables shared by all keys of all databases. */
#define IDEM_WAIT_SLOTS		1024

/* How often a waiter without a condition variable looks again. */
#define IDEM_WAIT_POLL_MS	50

/* Keys one transaction notes at most; beyond, it wakes every waiter. */
#define IDEM_WAIT_NOTES		32

static ConditionVariable *wait_slots = NULL;
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* The slots this transaction changed keys of, broadcast at commit. */
static int	notes[IDEM_WAIT_NOTES];
static int	nnotes = 0;
static bool notes_overflow = false;
static bool xact_callback_registered = false;

/* The slot the current waiter sleeps on; -1 when it polls. */
static int	waiting_slot = -1;

/* Ask for the condition variables. */
static void
waits_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(mul_size(IDEM_WAIT_SLOTS, sizeof(ConditionVariable)));
}

/* Create or attach to the condition variables. */
static void
waits_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	wait_slots = ShmemInitStruct("idem waits",
								 mul_size(IDEM_WAIT_SLOTS, sizeof(ConditionVariable)),
								 &found);
	if (!found)
	{
		int			i;

		for (i = 0; i < IDEM_WAIT_SLOTS; i++)
			ConditionVariableInit(&wait_slots[i]);
	}
	LWLockRelease(AddinShmemInitLock);
}

/* Install the shared memory hooks; called from _PG_init when preloaded. */
void
idem_waits_shmem_init(void)
{
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = waits_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = waits_shmem_startup;
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

/* Wake the waiters of the keys a committed transaction changed. */
static void
waits_xact_callback(XactEvent event, void *arg)
{
	int			i;

	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			if (notes_overflow)
			{
				for (i = 0; i < IDEM_WAIT_SLOTS; i++)
					ConditionVariableBroadcast(&wait_slots[i]);
			}
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
			break;
		default:
			break;
	}
}

/*
 * Note that this transaction changed the key in a way a waiter waits for
 * (completed, released or took it over): its waiters are woken once the
 * transaction commits.  A prepared transaction's waiters notice at their
 * next look (at the latest when their wait ends).
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
#if PG_VERSION_NUM >= 170000
	static uint32 event = 0;

	if (event == 0)
		event = WaitEventExtensionNew("IdemWaitForResult");
	return event;
#else
	return PG_WAIT_EXTENSION;
#endif
}

/*
 * Get ready to wait for a change of the key, before looking at it: a
 * change committed between the look and the sleep then still wakes the
 * sleep.
 */
void
idem_waits_prepare(text *scope, text *key)
{
	if (wait_slots == NULL || RecoveryInProgress())
	{
		waiting_slot = -1;
		return;
	}
	waiting_slot = key_slot(scope, key);
	ConditionVariablePrepareToSleep(&wait_slots[waiting_slot]);
}

/*
 * Sleep until a change of the key is committed, or until (idem's clock),
 * whichever comes first; without a condition variable, for at most
 * IDEM_WAIT_POLL_MS.  Interrupts (cancel, statement_timeout) end it with
 * an error.  Returns false once until has passed.
 */
bool
idem_waits_sleep(TimestampTz until)
{
	TimestampTz now = idem_now();
	long		ms;

	if (now >= until)
		return false;
	ms = (long) ((until - now + 999) / 1000);
	if (waiting_slot < 0)
	{
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 Min(ms, IDEM_WAIT_POLL_MS), wait_event());
		ResetLatch(MyLatch);
		CHECK_FOR_INTERRUPTS();
	}
	else
		(void) ConditionVariableTimedSleep(&wait_slots[waiting_slot], ms,
										   wait_event());
	return true;
}

/* The wait is over. */
void
idem_waits_done(void)
{
	if (waiting_slot >= 0)
		ConditionVariableCancelSleep();
	waiting_slot = -1;
}
