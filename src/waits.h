/*-------------------------------------------------------------------------
 *
 * waits.h
 *	  Waiting for the result of a claim another transaction committed.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WAITS_H
#define IDEM_WAITS_H

#include "datatype/timestamp.h"

extern void idem_waits_shmem_init(void);
extern void idem_waits_note_change(text *scope, text *key);
extern void idem_waits_prepare(text *scope, text *key);
extern bool idem_waits_sleep(TimestampTz until);
extern void idem_waits_done(void);

#endif							/* IDEM_WAITS_H */
