/*-------------------------------------------------------------------------
 *
 * purge.c
 *	  Deletion of expired keys, shared by idem_purge() and the background
 *	  worker.
 *
 * Purge walks the table in physical order: each batch takes up to
 * idem.purge_batch_size expired rows, reading at most
 * IDEM_PURGE_BATCH_PAGES pages, from where the previous batch of this
 * backend stopped (a TID range scan), so a pass reads the table once and
 * needs no index on expires_at, which would make every complete a non-HOT
 * update.  A row is deleted only if the version the scan found expired is
 * still the latest and nobody holds it: the delete does not wait, so a
 * purge never waits for a transaction that is re-claiming a key and never
 * deletes a key changed since its snapshot (the row is left for a later
 * pass).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "storage/itemptr.h"

#include "keytable.h"
#include "purge.h"
#include "settings.h"
#include "stats.h"

PG_FUNCTION_INFO_V1(idem_purge);

/* Where this backend's next batch starts; (0,0) is before every row. */
static ItemPointerData purge_cursor = {{0, 0}, 0};

/*
 * Delete up to limit keys that expired at or before now, walking on from
 * the previous batch; a batch that reaches the end of the table ends the
 * pass (*pass_done) and the next one starts over.  Returns the number of
 * rows deleted.
 */
int64
idem_purge_batch(TimestampTz now, int limit, bool *pass_done)
{
	bool		at_end;
	int64		n = idem_keytable_purge_batch(now, limit, &purge_cursor, &at_end);

	if (at_end)
		ItemPointerSet(&purge_cursor, 0, 0);
	*pass_done = at_end;
	idem_stats_add(IDEM_STAT_PURGED_ROWS, n);
	return n;
}

/*
 * idem_purge(max_rows): delete expired keys in batches of
 * idem.purge_batch_size.  Without max_rows, one whole pass over the table.
 * With it, at most max_rows, going on from where this session's previous
 * call stopped (and round to the start once), so that a loop of bounded
 * calls, each in its own transaction, walks the table once instead of
 * re-reading its start every time.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	int64		max_rows = PG_ARGISNULL(0) ? PG_INT64_MAX : PG_GETARG_INT32(0);
	TimestampTz now = idem_now();
	int64		total = 0;
	int			laps;

	if (max_rows < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_rows must not be negative")));

	if (PG_ARGISNULL(0))
		ItemPointerSet(&purge_cursor, 0, 0);
	/* Started mid-table: the end of the table starts one more lap. */
	laps = (ItemPointerGetBlockNumberNoCheck(&purge_cursor) == 0 &&
			ItemPointerGetOffsetNumberNoCheck(&purge_cursor) == 0) ? 1 : 2;
	while (total < max_rows)
	{
		int			limit = (int) Min((int64) idem_purge_batch_size,
									  max_rows - total);
		bool		pass_done;

		total += idem_purge_batch(now, limit, &pass_done);
		if (pass_done && --laps == 0)
			break;
	}
	PG_RETURN_INT64(total);
}
