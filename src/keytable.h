/*-------------------------------------------------------------------------
 *
 * keytable.h
 *	  The storage of idempotency keys: every read and write of idem.keys,
 *	  the only way the rest of idem touches the table.  The relation is
 *	  opened, locked and checked in keyrel.c, its rows are read and
 *	  written in keyrows.c.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_KEYTABLE_H
#define IDEM_KEYTABLE_H

#include "postgres.h"

#include "access/tableam.h"
#include "executor/tuptable.h"
#include "storage/itemptr.h"
#include "utils/rel.h"

#include "expiry.h"
#include "idem.h"

/*
 * The role that made a claim, as idem.keys stores it: by name from 1.4 on
 * (an empty name stands for a role dropped before the update to 1.4), by
 * OID in 1.3, not at all before (claims made before 1.3 are bound to no
 * role).
 */
typedef struct KeyClaimant
{
	bool		bound;			/* the claim is bound to a role */
	Oid			roleid;			/* as stored in a 1.3 table, else InvalidOid */
	NameData	rolename;		/* as stored from 1.4 on */
} KeyClaimant;

/* One version of a key's row, as read. */
typedef struct KeyRow
{
	bool		found;
	uint8		fingerprint[IDEM_FINGERPRINT_LEN];
	int64		token;
	bool		done;
	int32		status;
	bytea	   *body;			/* NULL if none, or not asked for */
	int32		body_size;		/* -1 if no body */
	bool		has_lease;
	TimestampTz lease_until;
	TimestampTz expires_at;
	KeyClaimant claimed_by;		/* the role that made the claim */
	bool		has_remember;	/* remember_until is set (1.6 on) */
	TimestampTz remember_until; /* a completed key is remembered until then */
	text	   *holder;			/* the claim's holder identity (1.7 on), or NULL */
	TransactionId xmin;
	ItemPointerData tid;
} KeyRow;

/*
 * Indexes a table of the right shape may have that are ready for inserts:
 * the primary key and the copies of it that REINDEX CONCURRENTLY builds
 * (and leaves behind when it is cancelled).  Copies not ready for inserts
 * are not maintained; up to IDEM_MAX_SHAPE_INDEXES indexes in all.
 */
#define IDEM_MAX_INDEXES	4
#define IDEM_MAX_SHAPE_INDEXES	16

/* An open idem.keys and its indexes, for one call. */
typedef struct KeyTable
{
	Relation	rel;			/* idem.keys, or its shard holding the key */
	LOCKMODE	lockmode;		/* held on rel and its indexes */
	Relation	pkey;			/* the primary key; indexes[0] */
	bool		pkey_key_first; /* (key, scope) from 1.2 on, else (scope, key) */
	int			nindexes;		/* the primary key, then copies ready for inserts */
	Relation	indexes[IDEM_MAX_INDEXES];
	struct IndexInfo *index_infos[IDEM_MAX_INDEXES];
	bool		index_key_first[IDEM_MAX_INDEXES];
	bool		distributed;	/* rel is a Citus shard */
	int64		token_floor;	/* distributed: greatest token read from it */
	bool		writable;		/* keytable_prepare_write done */
	TupleTableSlot *slot;		/* the version last read */
	const char *what;			/* the SQL function, for error messages */
	text	   *scope;			/* the key being worked on */
	text	   *key;
	bool		cached;			/* rel and indexes are the transaction's */
} KeyTable;

/* What a dirty probe of the primary key found for a key. */
typedef enum KeyProbe
{
	PROBE_NONE,					/* no live version */
	PROBE_COMMITTED,			/* a committed version */
	PROBE_IN_PROGRESS			/* inserted or deleted by a running xact */
} KeyProbe;

/* Who a PROBE_IN_PROGRESS waits for. */
typedef struct KeyWaiter
{
	TransactionId xid;
	uint32		spec_token;
	ItemPointerData tid;
	bool		deleting;		/* only deleting the key: no new version */
} KeyWaiter;

/* Outcome of keytable_update and keytable_delete. */
typedef enum KeyWrite
{
	KEYWRITE_OK,				/* written */
	KEYWRITE_CHANGED,			/* the version read was changed or deleted since */
	KEYWRITE_BUSY				/* no wait: another transaction is changing it */
} KeyWrite;

/*
 * The columns of a new or changed row.  An update with token
 * IDEM_NEW_TOKEN gives the row a new token, drawn once the write is sure
 * to be tried.
 */
#define IDEM_NEW_TOKEN	0

typedef struct KeyValues
{
	bytea	   *fingerprint;
	int64		token;
	bool		done;
	int32		status;
	bytea	   *body;			/* NULL for none */
	bool		has_lease;
	TimestampTz lease_until;
	TimestampTz expires_at;
	KeyClaimant claimed_by;
	bool		claimant_as_stored; /* an update keeps the stored claimed_by */
	bool		phase_as_stored;	/* an update keeps the stored recovery point */
	text	   *phase;			/* else this one; NULL for none */
	bytea	   *phase_data;
	bool		has_remember;	/* remember_until is set */
	TimestampTz remember_until;
	text	   *holder;			/* NULL for none */
	bool		holder_as_stored;	/* an update keeps the stored holder */
} KeyValues;

/*
 * Is the row a tombstone at now: completed, its retention over, and still
 * remembered (remember_until, 1.6 on)?  A retry of it answers EXPIRED and
 * never executes again; purge drops its body and keeps the rest of the row
 * until remember_until.
 */
static inline bool
idem_keyrow_is_tombstone(const KeyRow *row, TimestampTz now)
{
	return row->found && row->done && row->has_remember &&
		row->expires_at <= now && now < row->remember_until;
}

/* Pages one purge batch reads at most (8 MB with 8 kB pages). */
#define IDEM_PURGE_BATCH_PAGES	1024

/* The relation (keyrel.c) */
extern LOCKMODE idem_keytable_write_lockmode(void);
extern void idem_keytable_open(KeyTable *kt, const char *what, text *scope,
							   text *key, LOCKMODE lockmode);
extern void idem_keytable_close(KeyTable *kt);
extern void idem_keytable_cache_enable(void);
extern void idem_keytable_cache_close(void);

/* The rows (keyrows.c) */
extern bool idem_keytable_read(KeyTable *kt, KeyRow *row,
							   MemoryContext body_cxt);
extern KeyProbe idem_keytable_probe(KeyTable *kt, KeyWaiter *waiter);
extern KeyProbe idem_keytable_look(KeyTable *kt, KeyRow *row,
								   KeyWaiter *waiter, MemoryContext body_cxt);
extern bool idem_keytable_wait(KeyTable *kt, KeyWaiter *waiter);
extern bool idem_keytable_insert(KeyTable *kt, KeyValues *kv);
extern bool idem_keytable_read_for_write(KeyTable *kt, KeyRow *row,
										 MemoryContext body_cxt);
extern KeyWrite idem_keytable_update(KeyTable *kt, KeyRow *row,
									 KeyValues *kv, bool wait);
extern KeyWrite idem_keytable_delete(KeyTable *kt, KeyRow *row, bool wait);
extern KeyWrite idem_keytable_lock_share(KeyTable *kt, KeyRow *row);
extern void idem_keytable_read_phase(KeyTable *kt, KeyRow *row,
									 MemoryContext cxt, text **phase,
									 bytea **phase_data);
extern void idem_keytable_current_claimant(KeyClaimant *claimant);
extern Oid	idem_keytable_claimant_role(KeyClaimant *claimant);
extern char *idem_keytable_claimant_text(KeyClaimant *claimant);
extern BlockNumber idem_keytable_nblocks(KeyTable *kt);
extern Oid	idem_keytable_relfilenode(KeyTable *kt);
extern int64 idem_keytable_purge_batch(TimestampTz now, int limit,
										IdemPurgePosition *pos, bool *at_end,
										IdemPurgeRanges *ranges);

#endif							/* IDEM_KEYTABLE_H */
