/*-------------------------------------------------------------------------
 *
 * expiry.c
 *	  Purge's shared state per database: the expiry map of idem.keys and
 *	  the position of the background worker's pass over it.
 *
 * The map (expiry.h) keeps a watermark below the expiry of every key of
 * the table, and one per range of blocks; purge.c says how passes use
 * them.  Every write of a key lowers them to its expiry (idem_expiry_note,
 * a few atomic reads when nothing changes); a pass that read the ranges
 * it was to read and committed its deletions raises them to what it left.
 * The map describes one file of the table (its relfilenode): a rewrite
 * (VACUUM FULL, CLUSTER, ALTER TABLE ... SET LOGGED or TYPE, pg_repack,
 * TRUNCATE) moves rows to another file without a note, so a map of
 * another file is unknown, and the next pass reads the whole table.
 *
 * The worker's pass goes on across its batches and visits: a purge worker
 * exits after each visit, and a paced visit ends at its deadline, so the
 * pass's position and what it left so far are kept here after each
 * committed batch (idem_expiry_pass_save) and taken up by the next visit.
 * A pass over a file the table no longer has is dropped.
 *
 * The state lives in shared memory beside each database's counters: a
 * database has it while it has an idem_stats slot (stats.c), and a slot
 * given to another database is cleared on its first use there.  Not kept
 * across restarts: the first pass after one reads the whole table.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/timestamp.h"

#include "expiry.h"
#include "stats.h"

/* A database's map and pass. */
typedef struct ExpirySlot
{
	pg_atomic_uint32 owner;		/* the database; InvalidOid: none yet */

	/*
	 * The watermark, as expiry_key values: no key of the database expires
	 * before min_expiry (0: not known).  Every write of a key lowers
	 * pass_min and then min_expiry to its expiry; a pass starts pass_min
	 * afresh and, at its end, sets min_expiry to the least expiry it left
	 * plus pass_min, unless another pass started meanwhile or the
	 * watermark was forgotten.
	 */
	pg_atomic_uint64 min_expiry;
	pg_atomic_uint64 pass_min;
	slock_t		mutex;
	uint32		pass_gen;		/* under mutex */
	TimestampTz known_at;		/* start of the full pass that made
								 * min_expiry known, 0 if not; under mutex */
	Oid			map_relfilenode;	/* the file range_shift was sized for;
									 * under mutex */

	/*
	 * range_min[r] and range_pass_min[r] are to the blocks of range r what
	 * min_expiry and pass_min are to the table.  range_shift is set by a
	 * pass that reads the whole table, before it reads it.
	 */
	pg_atomic_uint32 range_shift;
	pg_atomic_uint64 range_min[IDEM_PURGE_RANGES];
	pg_atomic_uint64 range_pass_min[IDEM_PURGE_RANGES];

	/* The worker's pass under way (number 0: none); under the lock. */
	IdemPurgePass pass;
} ExpirySlot;

typedef struct ExpiryShared
{
	LWLock	   *lock;
	ExpirySlot	slots[IDEM_STATS_SLOTS];
} ExpiryShared;

static ExpiryShared *expiry = NULL;
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* Ask for the shared memory and the lock. */
static void
expiry_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(sizeof(ExpiryShared));
	RequestNamedLWLockTranche("idem expiry", 1);
}

/* Create or attach to the maps. */
static void
expiry_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	expiry = ShmemInitStruct("idem expiry", sizeof(ExpiryShared), &found);
	if (!found)
	{
		int			i;

		memset(expiry, 0, sizeof(ExpiryShared));
		expiry->lock = &(GetNamedLWLockTranche("idem expiry"))->lock;
		for (i = 0; i < IDEM_STATS_SLOTS; i++)
		{
			ExpirySlot *slot = &expiry->slots[i];
			int			r;

			pg_atomic_init_u32(&slot->owner, InvalidOid);
			pg_atomic_init_u64(&slot->min_expiry, 0);
			pg_atomic_init_u64(&slot->pass_min, 0);
			SpinLockInit(&slot->mutex);
			pg_atomic_init_u32(&slot->range_shift, 0);
			for (r = 0; r < IDEM_PURGE_RANGES; r++)
			{
				pg_atomic_init_u64(&slot->range_min[r], 0);
				pg_atomic_init_u64(&slot->range_pass_min[r], 0);
			}
		}
	}
	LWLockRelease(AddinShmemInitLock);
}

/* Install the shared memory hooks; called from _PG_init when preloaded. */
void
idem_expiry_shmem_init(void)
{
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = expiry_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = expiry_shmem_startup;
}

/*
 * A timestamp as an unsigned number of the same order, for the atomic
 * minimum of the watermark: DT_NOBEGIN is 0, DT_NOEND the greatest.
 */
static inline uint64
expiry_key(TimestampTz ts)
{
	return (uint64) ts ^ (UINT64CONST(1) << 63);
}

static inline TimestampTz
expiry_of_key(uint64 key)
{
	return (TimestampTz) (key ^ (UINT64CONST(1) << 63));
}

/* Lower *v to key unless it is lower already. */
static void
atomic_lower(pg_atomic_uint64 *v, uint64 key)
{
	uint64		cur = pg_atomic_read_u64(v);

	while (key < cur)
	{
		if (pg_atomic_compare_exchange_u64(v, &cur, key))
			break;
	}
}

/* Make a slot's watermark unknown: the next pass reads the whole table. */
static void
forget(ExpirySlot *slot)
{
	SpinLockAcquire(&slot->mutex);
	slot->pass_gen++;
	pg_atomic_write_u64(&slot->min_expiry, 0);
	pg_atomic_write_u64(&slot->pass_min, 0);
	slot->known_at = 0;
	SpinLockRelease(&slot->mutex);
}

/*
 * The current database's slot, NULL without shared memory or an
 * idem_stats slot.  A slot last used by another database (dropped since)
 * is cleared first, under the lock, once.
 */
static ExpirySlot *
my_slot(void)
{
	ExpirySlot *slot;
	int			i;

	if (expiry == NULL || (i = idem_stats_slot_index()) < 0)
		return NULL;
	slot = &expiry->slots[i];
	if (likely(pg_atomic_read_u32(&slot->owner) == MyDatabaseId))
		return slot;

	LWLockAcquire(expiry->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&slot->owner) != MyDatabaseId)
	{
		forget(slot);
		SpinLockAcquire(&slot->mutex);
		slot->map_relfilenode = InvalidOid;
		SpinLockRelease(&slot->mutex);
		slot->pass.number = 0;
		pg_atomic_write_u32(&slot->owner, MyDatabaseId);
	}
	LWLockRelease(expiry->lock);
	return slot;
}

/*
 * A key of the current database was written (inserted or updated) with
 * this expiry on block blkno: lower the watermark, and that of the
 * block's range, to it.  Called after the heap write, so that a pass
 * either reads the row or finds the expiry in pass_min and
 * range_pass_min.  A writer that reads the range size from before a pass
 * that reads the whole table changed it wrote its row before that pass
 * started, so the pass reads the row.  Costs a few atomic reads when the
 * expiry is later than the watermarks, as almost every new expiry is.
 */
void
idem_expiry_note(TimestampTz expires_at, uint32 blkno)
{
	uint64		key = expiry_key(expires_at);
	ExpirySlot *slot = my_slot();
	int			r;

	if (slot == NULL)
		return;
	/* The row is on its page before the watermark is read (see above). */
	pg_memory_barrier();
	atomic_lower(&slot->pass_min, key);
	atomic_lower(&slot->min_expiry, key);
	r = idem_purge_range_of(pg_atomic_read_u32(&slot->range_shift), blkno);
	atomic_lower(&slot->range_pass_min[r], key);
	atomic_lower(&slot->range_min[r], key);
}

/*
 * Keys of the current database were written other than through idem's
 * functions (see purge.c): the watermark is not known until a pass has
 * read the table, and a pass under way does not set it.
 */
void
idem_expiry_forget(void)
{
	ExpirySlot *slot = my_slot();

	if (slot != NULL)
		forget(slot);
}

/* A pass that reads every block, as a walk without shared memory does. */
static void
pass_init(IdemPurgePass *pass, Oid relfilenode)
{
	int			r;

	memset(pass, 0, sizeof(IdemPurgePass));
	pass->started = GetCurrentTimestamp();
	pass->ranges.read_all = true;
	pass->ranges.relfilenode = relfilenode;
	for (r = 0; r < IDEM_PURGE_RANGES; r++)
		pass->ranges.least_left[r] = DT_NOEND;
}

/*
 * The background worker's pass over the current database's table, whose
 * file is relfilenode, of nblocks blocks, at now (idem's clock), into
 * *pass.  The pass under way goes on where its last committed batch
 * stopped, unless the table was rewritten since it started.  Otherwise a
 * new pass starts and is kept: it reads the whole table if the watermark
 * is not known, describes another file, or was made known by a pass that
 * started IDEM_PURGE_FULL_PASS_SECS or more ago by the server's clock
 * (then the ranges are sized anew for nblocks); else it reads the ranges
 * whose watermark is at or before now.  Returns false, and starts
 * nothing, if the watermark says no key expires at or before now.
 *
 * A range's pass_min is started afresh after the pass is numbered and
 * before the pass reads the range: a write whose note it drops wrote its
 * row before that, and the pass reads it.
 */
bool
idem_expiry_pass_begin(TimestampTz now, Oid relfilenode, BlockNumber nblocks,
					   IdemPurgePass *pass)
{
	TimestampTz max_age = (TimestampTz) IDEM_PURGE_FULL_PASS_SECS * USECS_PER_SEC;
	ExpirySlot *slot;
	uint32		gen;
	uint32		shift;
	bool		full;
	int			r;

	pass_init(pass, relfilenode);
	if ((slot = my_slot()) == NULL)
		return true;

	LWLockAcquire(expiry->lock, LW_SHARED);
	if (slot->pass.number != 0 && slot->pass.ranges.relfilenode == relfilenode)
	{
		memcpy(pass, &slot->pass, sizeof(IdemPurgePass));
		LWLockRelease(expiry->lock);
		return true;
	}
	LWLockRelease(expiry->lock);

	SpinLockAcquire(&slot->mutex);
	full = slot->map_relfilenode != relfilenode || slot->known_at == 0 ||
		pass->started - slot->known_at >= max_age;
	if (!full && expiry_of_key(pg_atomic_read_u64(&slot->min_expiry)) > now)
	{
		SpinLockRelease(&slot->mutex);
		return false;
	}
	if (++slot->pass_gen == 0)
		slot->pass_gen = 1;
	gen = slot->pass_gen;
	pg_atomic_exchange_u64(&slot->pass_min, PG_UINT64_MAX);
	if (full)
		slot->map_relfilenode = relfilenode;
	SpinLockRelease(&slot->mutex);

	if (full)
	{
		/* Ranges for a table up to twice this size. */
		for (shift = 0; shift < 22 &&
			 ((uint64) nblocks * 2) >> shift > IDEM_PURGE_RANGES; shift++)
			;
		pg_atomic_write_u32(&slot->range_shift, shift);
	}
	else
		shift = pg_atomic_read_u32(&slot->range_shift);
	pass->number = gen;
	pass->ranges.shift = shift;
	pass->ranges.read_all = full;
	for (r = 0; r < IDEM_PURGE_RANGES; r++)
	{
		pass->ranges.read[r] = full ||
			expiry_of_key(pg_atomic_read_u64(&slot->range_min[r])) <= now;
		if (pass->ranges.read[r])
			pg_atomic_write_u64(&slot->range_pass_min[r], PG_UINT64_MAX);
	}
	/* The resets are seen before the pass reads a page. */
	pg_memory_barrier();
	idem_expiry_pass_save(pass);
	return true;
}

/*
 * Keep the worker's pass after a batch of it committed, so that the next
 * batch or visit goes on from there.
 */
void
idem_expiry_pass_save(const IdemPurgePass *pass)
{
	ExpirySlot *slot;

	if (pass->number == 0 || (slot = my_slot()) == NULL)
		return;
	LWLockAcquire(expiry->lock, LW_EXCLUSIVE);
	memcpy(&slot->pass, pass, sizeof(IdemPurgePass));
	LWLockRelease(expiry->lock);
}

/*
 * The worker's pass read what it was to read, committed its deletions,
 * and left in each range it read no key that expires before
 * ranges.least_left.  Keys written since it started are in the range's
 * pass_min: set each range's watermark to the lesser, then the table's to
 * the least of the ranges', unless another pass started meanwhile, the
 * watermark was forgotten, or the table was rewritten.  A write that
 * lowered a watermark before this sets it had lowered the pass_min before
 * that: the second look at pass_min lowers the watermark again.  Only a
 * pass that read the whole table makes the watermark known for another
 * IDEM_PURGE_FULL_PASS_SECS from its start.  The pass is over either way.
 */
void
idem_expiry_pass_end(const IdemPurgePass *pass)
{
	const IdemPurgeRanges *ranges = &pass->ranges;
	bool		full = ranges->read_all;
	ExpirySlot *slot;
	uint64		least = PG_UINT64_MAX;
	int			r;

	if (pass->number == 0 || (slot = my_slot()) == NULL)
		return;
	LWLockAcquire(expiry->lock, LW_EXCLUSIVE);
	if (slot->pass.number == pass->number)
		slot->pass.number = 0;
	LWLockRelease(expiry->lock);
	if (ranges->unknown)
		return;

	SpinLockAcquire(&slot->mutex);
	if (slot->pass_gen == pass->number &&
		slot->map_relfilenode == ranges->relfilenode &&
		(full || slot->known_at != 0))
	{
		for (r = 0; r < IDEM_PURGE_RANGES; r++)
		{
			uint64		key;

			if (ranges->read[r] || full)
			{
				key = Min(expiry_key(ranges->least_left[r]),
						  pg_atomic_read_u64(&slot->range_pass_min[r]));
				pg_atomic_exchange_u64(&slot->range_min[r], key);
				atomic_lower(&slot->range_min[r],
							 pg_atomic_read_u64(&slot->range_pass_min[r]));
			}
			least = Min(least, pg_atomic_read_u64(&slot->range_min[r]));
		}
		pg_atomic_exchange_u64(&slot->min_expiry,
							   Min(least, pg_atomic_read_u64(&slot->pass_min)));
		atomic_lower(&slot->min_expiry, pg_atomic_read_u64(&slot->pass_min));
		if (full)
			slot->known_at = pass->started;
	}
	SpinLockRelease(&slot->mutex);
}
