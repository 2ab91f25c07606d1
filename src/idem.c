/*-------------------------------------------------------------------------
 *
 * idem.c
 *	  Module entry point, settings and argument checks of the idem
 *	  extension.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>
#include <stdlib.h>

#include "fmgr.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/memutils.h"

#include "idem.h"
#include "stats.h"
#include "worker.h"

IDEM_MODULE_MAGIC;

#define SECS_PER_30_DAYS	(30 * SECS_PER_DAY)

int			idem_default_lease = 60;
int			idem_default_retention = SECS_PER_DAY;
int			idem_max_retention = SECS_PER_30_DAYS;
int			idem_max_key_length = 255;
int			idem_max_body_size = 1024 * 1024;
int			idem_clock_offset = 0;
int			idem_purge_batch_size = 10000;
int			idem_purge_naptime = 10;
bool		idem_purge_enabled = true;

void		_PG_init(void);

/*
 * Module load: define the settings.  The background worker and shared
 * memory are set up only when loaded through shared_preload_libraries.
 */
void
_PG_init(void)
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
	DefineCustomBoolVariable("idem.purge_enabled",
							 "Whether the background worker purges expired keys.",
							 "Needs idem in shared_preload_libraries.",
							 &idem_purge_enabled,
							 true,
							 PGC_SIGHUP, 0,
							 NULL, NULL, NULL);

	MarkGUCPrefixReserved("idem");

	if (!process_shared_preload_libraries_in_progress)
		return;

	idem_stats_shmem_init();
	idem_worker_register();
}

/* The clock every lease and retention decision uses. */
TimestampTz
idem_now(void)
{
	return GetCurrentTimestamp() + (int64) idem_clock_offset * USECS_PER_SEC;
}

/* ts + span, with the calendar arithmetic of timestamptz + interval. */
TimestampTz
idem_add_interval(TimestampTz ts, Interval *span)
{
	return DatumGetTimestampTz(DirectFunctionCall2(timestamptz_pl_interval,
												   TimestampTzGetDatum(ts),
												   PointerGetDatum(span)));
}

/*
 * End of a lease or retention window starting at now.  A NULL span takes
 * default_secs.  The window must be positive and no longer than
 * idem.max_retention.  Its length is measured with days of 24 hours, so
 * that whether '30 days' is allowed does not depend on the time zone's
 * daylight-saving changes, and months as long as the calendar months they
 * span (UTC), so that '1 mon' is 31 days from 5 January.  The end itself
 * is now + span with the calendar arithmetic of timestamptz + interval.
 */
TimestampTz
idem_window_end(TimestampTz now, Interval *span, int default_secs,
				const char *argname)
{
	int64		max_usecs = (int64) idem_max_retention * USECS_PER_SEC;
	int64		length;
	TimestampTz end;

	if (span == NULL)
		length = (int64) default_secs * USECS_PER_SEC;
	else if (abs(span->month) > idem_max_retention / (28 * SECS_PER_DAY) + 1 ||
			 abs(span->day) > idem_max_retention / SECS_PER_DAY + 1 ||
			 span->time > 2 * max_usecs || span->time < -2 * max_usecs)
	{
		/* Far out of range either way: do not compute with it. */
		length = (span->month > 0 || span->day > 0 || span->time > 0) ?
			max_usecs + 1 : 0;
	}
	else
	{
		Interval	months;

		memset(&months, 0, sizeof(months));
		months.month = span->month;
		length = DatumGetTimestamp(DirectFunctionCall2(timestamp_pl_interval,
													   TimestampGetDatum(now),
													   PointerGetDatum(&months))) - now;
		length += (int64) span->day * USECS_PER_DAY + span->time;
	}

	if (length <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", argname)));
	if (length > max_usecs)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not exceed idem.max_retention", argname),
				 errdetail("idem.max_retention is %d seconds.",
						   idem_max_retention)));

	end = (span == NULL) ? now + length : idem_add_interval(now, span);
	if (end <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", argname)));
	return end;
}

/* A text argument that must not be NULL. */
text *
idem_arg_text(FunctionCallInfo fcinfo, int argno, const char *argname)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", argname)));
	return PG_GETARG_TEXT_PP(argno);
}

/* Keys and scopes are bounded by idem.max_key_length; keys are not empty. */
void
idem_check_key(text *key, const char *argname, bool allow_empty)
{
	int			len = VARSIZE_ANY_EXHDR(key);

	if (len == 0 && !allow_empty)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", argname)));
	if (len > idem_max_key_length)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("%s is too long", argname),
				 errdetail("It is %d bytes; idem.max_key_length is %d.",
						   len, idem_max_key_length)));
}
