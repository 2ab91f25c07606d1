/*-------------------------------------------------------------------------
 *
 * purge.h
 *	  Deletion of expired keys, shared by idem_purge() and the background
 *	  worker.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_PURGE_H
#define IDEM_PURGE_H

#include "datatype/timestamp.h"

extern int64 idem_purge_batch(TimestampTz now, int limit, bool *pass_done);
extern bool idem_purge_pass_start(TimestampTz now);
extern void idem_purge_pass_save(void);
extern void idem_purge_pass_end(void);
extern void idem_purge_install_hooks(void);

#endif							/* IDEM_PURGE_H */
