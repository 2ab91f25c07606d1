/*-------------------------------------------------------------------------
 *
 * settings.h
 *	  The idem.* settings, and the clock they shift.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SETTINGS_H
#define IDEM_SETTINGS_H

#include "datatype/timestamp.h"

extern int	idem_default_lease;
extern int	idem_default_retention;
extern int	idem_max_retention;
extern int	idem_max_key_length;
extern int	idem_max_body_size;
extern int	idem_max_batch;
extern int	idem_clock_offset;
extern int	idem_purge_batch_size;
extern int	idem_purge_naptime;
extern int	idem_purge_rate_limit;
extern bool idem_purge_enabled;
extern bool idem_log_purge;
extern bool idem_log_takeovers;

extern void idem_define_settings(void);
extern TimestampTz idem_now(void);

#endif							/* IDEM_SETTINGS_H */
