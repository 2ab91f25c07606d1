/*-------------------------------------------------------------------------
 *
 * purge.c
 *	  Deletion of expired keys, shared by idem_purge() and the background
 *	  worker.
 *
 * Purge walks the table in physical order: each batch takes up to
 * idem.purge_batch_size expired rows from where the previous batch of this
 * backend stopped (a TID range scan), so a pass reads the table once and
 * needs no index on expires_at, which would make every complete a non-HOT
 * update.  A batch locks its rows with SKIP LOCKED, so it never waits for
 * a transaction that is re-claiming a key, and the DELETE re-checks expiry
 * on the locked row version.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "storage/itemptr.h"
#include "utils/timestamp.h"

#include "idem.h"
#include "stats.h"
#include "store.h"

PG_FUNCTION_INFO_V1(idem_purge);

static IdemPlanDef plan_purge = {
	"WITH deleted AS ("
	" DELETE FROM idem.keys WHERE ctid OPERATOR(pg_catalog.=) ANY (ARRAY("
	"  SELECT ctid FROM idem.keys"
	"  WHERE ctid OPERATOR(pg_catalog.>) $3"
	"  AND expires_at OPERATOR(pg_catalog.<=) $1"
	"  LIMIT $2 FOR UPDATE SKIP LOCKED))"
	" AND expires_at OPERATOR(pg_catalog.<=) $1 RETURNING ctid)"
	" SELECT pg_catalog.count(*), pg_catalog.max(ctid) FROM deleted",
	3, {TIMESTAMPTZOID, INT4OID, TIDOID}
};

/* Where this backend's next batch starts; (0,0) is before every row. */
static ItemPointerData purge_cursor = {{0, 0}, 0};

/*
 * Delete up to limit keys that expired at or before now, walking on from
 * the previous batch; a batch that finds fewer rows ends the pass and the
 * next one starts over.  The caller has called idem_spi_begin.  Returns
 * the number of rows deleted.
 */
int64
idem_purge_batch(TimestampTz now, int limit)
{
	Datum		values[3];
	bool		isnull;
	int64		n;
	Datum		last;

	values[0] = TimestampTzGetDatum(now);
	values[1] = Int32GetDatum(limit);
	values[2] = PointerGetDatum(&purge_cursor);
	if (idem_spi_run(&plan_purge, values, NULL) != 1)
		elog(ERROR, "purge statement returned no row");
	n = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0],
									SPI_tuptable->tupdesc, 1, &isnull));
	last = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2,
						 &isnull);
	if (n < limit || isnull)
		ItemPointerSet(&purge_cursor, 0, 0);
	else
		ItemPointerCopy((ItemPointer) DatumGetPointer(last), &purge_cursor);
	idem_stats_add(IDEM_STAT_PURGED_ROWS, n);
	return n;
}

/*
 * idem_purge(max_rows): delete expired keys in batches of
 * idem.purge_batch_size, at most max_rows (NULL: all) in this transaction.
 */
Datum
idem_purge(PG_FUNCTION_ARGS)
{
	int64		max_rows = PG_ARGISNULL(0) ? PG_INT64_MAX : PG_GETARG_INT32(0);
	TimestampTz now = idem_now();
	int64		total = 0;
	IdemSpi		spi;

	if (max_rows < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max_rows must not be negative")));

	idem_spi_begin(&spi);
	ItemPointerSet(&purge_cursor, 0, 0);
	while (total < max_rows)
	{
		int			limit = (int) Min((int64) idem_purge_batch_size,
									  max_rows - total);
		int64		n = idem_purge_batch(now, limit);

		total += n;
		if (n < limit)
			break;
	}
	idem_spi_end(&spi);

	PG_RETURN_INT64(total);
}
