/*-------------------------------------------------------------------------
 *
 * inspect.c
 *	  idem_lookup: what is stored for one key, for operators.
 *
 * It shows the stored state (EXPIRED for a completed key remembered past
 * its retention, a tombstone), the token, the status, the times and the
 * size of the response body, never the body itself.  EXECUTE on
 * idem_lookup is what lets a role inspect keys (PUBLIC has none); the row
 * is read through keytable.h like every other access to idem.keys.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "funcapi.h"
#include "utils/builtins.h"
#include "utils/tuplestore.h"

#include "args.h"
#include "idem.h"
#include "keytable.h"
#include "settings.h"

PG_FUNCTION_INFO_V1(idem_lookup);

/* idem_lookup(key, scope): the stored row of one key, without its body. */
Datum
idem_lookup(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = idem_arg_text(fcinfo, 0, "key");
	text	   *scope = idem_arg_text(fcinfo, 1, "scope");
	KeyTable	kt;
	KeyRow		row;

	idem_check_key(key, "key", false);
	idem_check_key(scope, "scope", true);

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);

	idem_keytable_open(&kt, "idem_lookup()", scope, key, AccessShareLock);
	if (idem_keytable_read(&kt, &row, NULL))
	{
		Datum		values[6];
		bool		nulls[6];

		memset(nulls, false, sizeof(nulls));
		values[0] = CStringGetTextDatum(!row.done ? "PROCESSING" :
										idem_keyrow_is_tombstone(&row, idem_now()) ?
										"EXPIRED" : "DONE");
		values[1] = Int64GetDatum(row.token);
		values[2] = Int32GetDatum(row.status);
		nulls[2] = !row.done;
		values[3] = TimestampTzGetDatum(row.lease_until);
		nulls[3] = !row.has_lease;
		values[4] = TimestampTzGetDatum(row.expires_at);
		values[5] = Int32GetDatum(row.body_size);
		nulls[5] = (row.body_size < 0);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc,
							 values, nulls);
	}
	idem_keytable_close(&kt);

	return (Datum) 0;
}
