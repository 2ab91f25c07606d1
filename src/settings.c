/*-------------------------------------------------------------------------
 *
 * settings.c
 *	  The idem.* settings, and the clock they shift.
 *
 * Every module reads its settings from here; _PG_init (init.c) defines
 * them once per backend.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "settings.h"

#define SECS_PER_30_DAYS	(30 * SECS_PER_DAY)

int			idem_default_lease = 60;
int			idem_default_retention = SECS_PER_DAY;
int			idem_max_retention = SECS_PER_30_DAYS;
int			idem_max_key_length = 255;
int			idem_max_body_size = 1024 * 1024;
int			idem_max_batch = 10000;
int			idem_clock_offset = 0;
int			idem_purge_batch_size = 10000;
int			idem_purge_naptime = 10;
int			idem_purge_rate_limit = 10000;
bool		idem_purge_enabled = true;
bool		idem_log_purge = true;
bool		idem_log_takeovers = true;

/* Define the idem.* settings. */
void
idem_define_settings(void)
{
	DefineCustomIntVariable("idem.default_lease",
							"Lease of a claim when idem_begin is given none.",
							NULL,
							&idem_default_lease,
							60, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.default_retention",
							"Dedup window of a key when none is given.",
							NULL,
							&idem_default_retention,
							SECS_PER_DAY, 1, INT_MAX,
							PGC_USERSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.max_retention",
							"Longest dedup window a call may ask for.",
							NULL,
							&idem_max_retention,
							SECS_PER_30_DAYS, 1, INT_MAX,
							PGC_SUSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.max_key_length",
							"Longest key or scope accepted, in bytes.",
							NULL,
							&idem_max_key_length,
							255, 1, 1024,
							PGC_SUSET, GUC_UNIT_BYTE,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.max_body_size",
							"Largest response body idem_complete stores.",
							NULL,
							&idem_max_body_size,
							1024 * 1024, 0, MaxAllocSize,
							PGC_SUSET, GUC_UNIT_BYTE,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.max_batch",
							"Most items idem_begin_many and idem_complete_many take in one call.",
							NULL,
							&idem_max_batch,
							10000, 1, 1000000,
							PGC_SUSET, 0,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.clock_offset",
							"Added to the server clock for every lease and retention decision.",
							"For tests and drills that move time; leave at 0 in production.",
							&idem_clock_offset,
							0, INT_MIN + 1, INT_MAX,
							PGC_SUSET, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.purge_batch_size",
							"Rows deleted per purge transaction.",
							NULL,
							&idem_purge_batch_size,
							10000, 1, 1000000,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.purge_naptime",
							"Time between two purge passes over all databases.",
							"Used by the background worker; needs idem in shared_preload_libraries.",
							&idem_purge_naptime,
							10, 1, INT_MAX / 1000,
							PGC_SIGHUP, GUC_UNIT_S,
							NULL, NULL, NULL);
	DefineCustomIntVariable("idem.purge_rate_limit",
							"Most expired keys the background worker deletes per second; 0 for no limit.",
							"The worker waits after each batch so that its deletions, and the WAL they write, are spread out; SELECT idem_purge() is not limited.",
							&idem_purge_rate_limit,
							10000, 0, INT_MAX,
							PGC_SIGHUP, 0,
							NULL, NULL, NULL);
	DefineCustomBoolVariable("idem.purge_enabled",
							 "Whether the background worker purges expired keys.",
							 "Needs idem in shared_preload_libraries.",
							 &idem_purge_enabled,
							 true,
							 PGC_SIGHUP, 0,
							 NULL, NULL, NULL);

	DefineCustomBoolVariable("idem.log_purge",
							 "Logs each purge of a database that deleted keys.",
							 NULL,
							 &idem_log_purge,
							 true,
							 PGC_SIGHUP, 0,
							 NULL, NULL, NULL);
	DefineCustomBoolVariable("idem.log_takeovers",
							 "Logs each claim taken over after its lease ended, and each forced release or eviction.",
							 NULL,
							 &idem_log_takeovers,
							 true,
							 PGC_SUSET, 0,
							 NULL, NULL, NULL);

	MarkGUCPrefixReserved("idem");
}

/* The clock every lease and retention decision uses. */
TimestampTz
idem_now(void)
{
	return GetCurrentTimestamp() + (int64) idem_clock_offset * USECS_PER_SEC;
}
