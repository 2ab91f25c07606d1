/*-------------------------------------------------------------------------
 *
 * citus.h
 *	  idem.keys distributed by Citus: the shard of a key on this node.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CITUS_H
#define IDEM_CITUS_H

#include "postgres.h"

#include "nodes/pg_list.h"
#include "utils/relcache.h"

/*
 * The error of a call that reached a node which does not hold the key's
 * shard (the call was not delegated, or the shard moved meanwhile): a
 * serialization failure, which clients retry.
 */
#define ERRCODE_IDEM_SHARD_NOT_LOCAL	ERRCODE_T_R_SERIALIZATION_FAILURE

/* A shard of idem.keys placed on this node. */
typedef struct IdemShard
{
	int64		shardid;
	Oid			relid;
} IdemShard;

extern AttrNumber idem_citus_distribution_column(Relation rel);
extern Oid	idem_citus_local_shard(Relation rel, Datum value,
								   const char *what, text *key);
extern List *idem_citus_local_shards(Relation rel);
extern int64 idem_citus_next_token(void);
extern void idem_citus_init(void);

#endif							/* IDEM_CITUS_H */
