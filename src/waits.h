/*-------------------------------------------------------------------------
 *
 * waits.h
 *	  Waiting for the result of a claim another transaction committed, and
 *	  who waits for what (idem_waits).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WAITS_H
#define IDEM_WAITS_H

#include "datatype/timestamp.h"

/* What a backend shown in idem_waits waits for. */
typedef enum IdemWaitKind
{
	IDEM_WAIT_TRANSACTION,		/* the transaction changing the key's row */
	IDEM_WAIT_RESULT			/* wait_for: the result of a committed claim */
} IdemWaitKind;

extern void idem_waits_shmem_init(void);
extern void idem_waits_note_change(text *scope, text *key);
extern void idem_waits_prepare(text *scope, text *key);
extern void idem_waits_arm(void);
extern bool idem_waits_sleep(TimestampTz until, int64 holder_token);
extern void idem_waits_done(void);
extern void idem_waits_for_primary(TransactionId xid);
extern void idem_waits_show(IdemWaitKind kind, text *scope, text *key,
							TransactionId holder_xid, int64 holder_token);
extern void idem_waits_hide(void);

#endif							/* IDEM_WAITS_H */
