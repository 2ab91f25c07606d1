/*-------------------------------------------------------------------------
 *
 * stats.h
 *	  Per-database counters of idem in shared memory.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STATS_H
#define IDEM_STATS_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "portability/instr_time.h"

typedef enum IdemStat
{
	IDEM_STAT_CLAIMS,
	IDEM_STAT_TAKEOVERS,
	IDEM_STAT_REPLAYS,
	IDEM_STAT_IN_FLIGHT,
	IDEM_STAT_CONFLICTS,
	IDEM_STAT_COMPLETES,
	IDEM_STAT_SUPERSEDED,
	IDEM_STAT_RELEASES,
	IDEM_STAT_PURGED_ROWS,
	IDEM_STAT_PURGE_RUNS,
	IDEM_STAT_NOT_STORED,		/* responses too large: a fixed answer stored */
	IDEM_STAT_EVICTIONS,		/* idem_evict */
	IDEM_STAT_FORCE_RELEASES,	/* idem_force_release */
	IDEM_STAT_WAITS,			/* waits for a holder or a result */
	IDEM_STAT_CLAIM_USECS,		/* time of idem_begin calls that claimed */
	IDEM_STAT_REPLAY_USECS,		/* time of idem_begin calls that replayed */
	IDEM_STAT_COMPLETE_USECS,	/* time of idem_complete calls */
	IDEM_STAT_WAIT_USECS,		/* time waited */
	IDEM_STAT_NUM
} IdemStat;

/* The counters idem_stats() had up to 1.3, in its column order. */
#define IDEM_STAT_NUM_1_3	(IDEM_STAT_PURGE_RUNS + 1)

extern void idem_stats_shmem_init(void);
extern void idem_stats_add(IdemStat stat, uint64 n);
extern void idem_stats_start(instr_time *started);
extern void idem_stats_add_time(IdemStat stat, instr_time *started);
extern void idem_stats_prepare_encoding(void);
extern void idem_stats_purge_done(Oid dboid, const char *error);
extern void idem_stats_purge_skipped(Oid dboid, const char *reason);
extern uint64 idem_stats_start_failed(Oid dboid, const char *reason);

/*
 * Purge's expiry map of a database's table: the table's blocks in
 * IDEM_PURGE_RANGES ranges of 1 << shift blocks each (the last range also
 * holds every block past the others), and per range a watermark below the
 * expiry of every key in it (see purge.c).  A pass reads the ranges the
 * map marks and finds, per range, the least expiry of what it left.
 */
#define IDEM_PURGE_RANGES	512

typedef struct IdemPurgeRanges
{
	bool		read_all;		/* read every block (a full pass); read[]
								 * unused */
	bool		unknown;		/* least_left not known (Citus shards) */
	uint32		shift;			/* log2 of the blocks in a range */
	bool		read[IDEM_PURGE_RANGES];
	TimestampTz least_left[IDEM_PURGE_RANGES];
} IdemPurgeRanges;

/* The range of a block. */
static inline int
idem_purge_range_of(uint32 shift, uint32 blkno)
{
	uint32		r = blkno >> shift;

	return (r < IDEM_PURGE_RANGES) ? (int) r : IDEM_PURGE_RANGES - 1;
}

extern void idem_stats_expiry_note(TimestampTz expires_at, uint32 blkno);
extern void idem_stats_expiry_forget(void);
extern bool idem_stats_expiry_after(TimestampTz now, TimestampTz max_age);
extern uint32 idem_stats_expiry_pass_start(TimestampTz now, TimestampTz max_age,
										   uint32 nblocks,
										   IdemPurgeRanges *ranges);
extern void idem_stats_expiry_pass_end(uint32 gen,
									   const IdemPurgeRanges *ranges);
extern int	idem_stats_databases(Oid *oids);
extern void idem_stats_forget(Oid dboid);

/* Room idem_stats_databases needs. */
#define IDEM_STATS_SLOTS	256

#define idem_stats_count(stat)	idem_stats_add((stat), 1)

#endif							/* IDEM_STATS_H */
