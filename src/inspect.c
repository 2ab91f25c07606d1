/*-------------------------------------------------------------------------
 *
 * inspect.c
 *	  idem_lookup: what is stored for one key, for operators.
 *
 * It shows the stored state, the token, the status, the times and the
 * size of the response body, never the body itself.  Like the other
 * functions it runs its statement as the key table's owner, so EXECUTE on
 * idem_lookup is what lets a role inspect keys (PUBLIC has none).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "access/htup_details.h"
#include "fmgr.h"
#include "funcapi.h"
#include "utils/tuplestore.h"

#include "idem.h"
#include "store.h"

PG_FUNCTION_INFO_V1(idem_lookup);

/* The columns of idem_lookup, as the idem_keys view has them too. */
static IdemPlanDef plan_lookup = {
	"SELECT CASE WHEN status IS NULL THEN 'PROCESSING'::pg_catalog.text"
	" ELSE 'DONE'::pg_catalog.text END,"
	" token, status, lease_until, expires_at,"
	" pg_catalog.octet_length(body)"
	" FROM idem.keys"
	" WHERE scope OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2",
	2, {TEXTOID, TEXTOID}
};

/* idem_lookup(key, scope): the stored row of one key, without its body. */
Datum
idem_lookup(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key = idem_arg_text(fcinfo, 0, "key");
	text	   *scope = idem_arg_text(fcinfo, 1, "scope");
	IdemSpi		spi;
	Datum		args[2];
	uint64		i;
	uint64		n;

	idem_check_key(key, "key", false);
	idem_check_key(scope, "scope", true);

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);

	args[0] = PointerGetDatum(scope);
	args[1] = PointerGetDatum(key);
	idem_spi_begin(&spi);
	n = idem_spi_run(&plan_lookup, args, NULL);
	for (i = 0; i < n; i++)
	{
		Datum		values[6];
		bool		nulls[6];

		heap_deform_tuple(SPI_tuptable->vals[i], SPI_tuptable->tupdesc,
						  values, nulls);
		/* The tuplestore copies the values into its own memory. */
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc,
							 values, nulls);
	}
	idem_spi_end(&spi);

	return (Datum) 0;
}
