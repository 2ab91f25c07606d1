/*-------------------------------------------------------------------------
 *
 * keyrel.h
 *	  What the row operations (keyrows.c) need of the relation module
 *	  (keyrel.c) beyond the storage's public interface (keytable.h).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_KEYREL_H
#define IDEM_KEYREL_H

#include "access/genam.h"
#include "nodes/pg_list.h"

#include "keytable.h"

extern IndexScanDesc idem_keyrel_begin_scan(KeyTable *kt, ScanKey skey,
											Snapshot snapshot);
extern bool idem_keyrel_scan_next(KeyTable *kt, IndexScanDesc scan);
extern void idem_keyrel_end_scan(KeyTable *kt, IndexScanDesc scan);
extern void idem_keyrel_prepare_write(KeyTable *kt);
extern int64 idem_keyrel_next_token(KeyTable *kt);
extern bool idem_keyrel_distributed(void);
extern List *idem_keyrel_local_shards(KeyTable *kt);
extern void idem_keyrel_switch_shard(KeyTable *kt, Oid relid);

#endif							/* IDEM_KEYREL_H */
