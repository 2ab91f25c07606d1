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

extern int	idem_stats_slot_index(void);
extern int	idem_stats_databases(Oid *oids);
extern void idem_stats_forget(Oid dboid);

/*
 * Databases with counters at the same time: the room idem_stats_databases
 * needs, and the range of idem_stats_slot_index.
 */
#define IDEM_STATS_SLOTS	256

#define idem_stats_count(stat)	idem_stats_add((stat), 1)

#endif							/* IDEM_STATS_H */
