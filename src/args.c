/*-------------------------------------------------------------------------
 *
 * args.c
 *	  Checks of the SQL functions' arguments, and keys in messages.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <stdlib.h>

#include "fmgr.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/timestamp.h"

#include "args.h"
#include "compat.h"
#include "idem.h"
#include "settings.h"

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
				 (span != NULL && span->month != 0 && length <= 2 * max_usecs) ?
				 errdetail("The %s is %s, %lld seconds from now (a month counts the days of the calendar month it spans); idem.max_retention is %d seconds.",
						   argname, idem_window_text(span, default_secs, argname),
						   (long long) (length / USECS_PER_SEC), idem_max_retention) :
				 errdetail("The %s is %s; idem.max_retention is %d seconds.",
						   argname, idem_window_text(span, default_secs, argname),
						   idem_max_retention)));

	end = (span == NULL) ? now + length : idem_add_interval(now, span);
	if (end <= now)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", argname)));
	return end;
}

/*
 * A lease or retention for a message: the interval given, or the setting
 * it came from with its value in seconds.
 */
char *
idem_window_text(Interval *span, int default_secs, const char *argname)
{
	if (span == NULL)
		return psprintf("idem.default_%s = %d seconds", argname, default_secs);
	return psprintf("'%s'", DatumGetCString(DirectFunctionCall1(interval_out,
																 PointerGetDatum(span))));
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

/* A key for an error message: at most 64 bytes, cut at a character. */
char *
idem_key_for_message(text *key)
{
	const char *s;
	int			len;
	int			cut;

	if (key == NULL)
		return pstrdup("");
	s = VARDATA_ANY(key);
	len = VARSIZE_ANY_EXHDR(key);
	if (len <= 64)
		return text_to_cstring(key);
	cut = pg_mbcliplen(s, len, 64);
	return psprintf("%.*s...", cut, s);
}

/* The error of a call that could not settle in IDEM_MAX_CLAIM_ROUNDS. */
void
idem_too_many_rounds(text *key)
{
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not settle idempotency key \"%s\"",
					idem_key_for_message(key)),
			 errdetail("The key changed under %d consecutive attempts.",
					   IDEM_MAX_CLAIM_ROUNDS),
			 errhint("Retry the transaction.")));
}
