/*-------------------------------------------------------------------------
 *
 * expiry.h
 *	  Purge's shared state per database: the expiry map of idem.keys and
 *	  the position of the background worker's pass over it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_EXPIRY_H
#define IDEM_EXPIRY_H

#include "postgres.h"

#include "datatype/timestamp.h"
#include "storage/block.h"
#include "storage/itemptr.h"

/*
 * The background worker reads the whole table at least this often (by
 * the server's clock, whatever idem.clock_offset says), also when the
 * watermark says nothing has expired (see purge.c).
 */
#define IDEM_PURGE_FULL_PASS_SECS	3600

/*
 * The expiry map of a database's table: the table's blocks in
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
	bool		unknown;		/* least_left not known (Citus shards, or the
								 * table was rewritten during the pass) */
	uint32		shift;			/* log2 of the blocks in a range */
	Oid			relfilenode;	/* the file whose blocks these are;
								 * InvalidOid: any */
	bool		read[IDEM_PURGE_RANGES];
	TimestampTz least_left[IDEM_PURGE_RANGES];
} IdemPurgeRanges;

/* Where a walk over the table goes on: (0,0) is before every row. */
typedef struct IdemPurgePosition
{
	ItemPointerData cursor;
	int64		shardid;		/* the shard cursor points into, under Citus */
} IdemPurgePosition;

/*
 * A pass over the table: what it reads, what it left so far, and where it
 * goes on.  The background worker's pass is kept in shared memory between
 * its batches and visits (idem_expiry_pass_save).
 */
typedef struct IdemPurgePass
{
	uint32		number;			/* as numbered by idem_expiry_pass_begin; 0:
								 * no pass (idem_purge()'s walks) */
	TimestampTz started;		/* by the server's clock */
	IdemPurgePosition pos;
	IdemPurgeRanges ranges;
} IdemPurgePass;

/* The range of a block. */
static inline int
idem_purge_range_of(uint32 shift, uint32 blkno)
{
	uint32		r = blkno >> shift;

	return (r < IDEM_PURGE_RANGES) ? (int) r : IDEM_PURGE_RANGES - 1;
}

extern void idem_expiry_shmem_init(void);
extern void idem_expiry_note(TimestampTz expires_at, uint32 blkno);
extern void idem_expiry_forget(void);
extern bool idem_expiry_pass_begin(TimestampTz now, Oid relfilenode,
								   BlockNumber nblocks, IdemPurgePass *pass);
extern void idem_expiry_pass_save(const IdemPurgePass *pass);
extern void idem_expiry_pass_end(const IdemPurgePass *pass);

#endif							/* IDEM_EXPIRY_H */
