/*-------------------------------------------------------------------------
 *
 * store.c
 *	  The key table's identity, and kept SPI plans run as its owner (the
 *	  INSERT of a new key and idem_lookup; everything else reads and
 *	  writes the table directly).
 *
 * Every statement names its objects with their schema (idem.keys,
 * pg_catalog operators), so the caller's search_path cannot change what a
 * plan does.  Callers need EXECUTE on idem's functions, not privileges on
 * the table: statements run as the table's owner, as ri_triggers.c runs
 * its checks.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"
#include "access/htup_details.h"
#include "catalog/pg_class.h"

#include "store.h"

static Oid	keys_relid = InvalidOid;
static Oid	keys_owner = InvalidOid;
static Oid	token_seq_relid = InvalidOid;
static bool keys_callback_registered = false;

/* Forget the cached table identity when the table changes or goes. */
static void
keys_relcache_callback(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == keys_relid || relid == token_seq_relid)
		keys_relid = InvalidOid;
}

/* OID of idem.keys; an error if the extension is not installed here. */
Oid
idem_keys_relid(void)
{
	Oid			nspid;
	HeapTuple	tuple;

	if (OidIsValid(keys_relid))
		return keys_relid;

	if (!keys_callback_registered)
	{
		CacheRegisterRelcacheCallback(keys_relcache_callback, (Datum) 0);
		keys_callback_registered = true;
	}

	nspid = get_namespace_oid("idem", true);
	keys_relid = OidIsValid(nspid) ? get_relname_relid("keys", nspid) : InvalidOid;
	token_seq_relid = OidIsValid(nspid) ?
		get_relname_relid("token_seq", nspid) : InvalidOid;
	if (!OidIsValid(keys_relid) || !OidIsValid(token_seq_relid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("extension \"idem\" is not installed in this database"),
				 errhint("Run CREATE EXTENSION idem.")));

	tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(keys_relid));
	if (!HeapTupleIsValid(tuple))
		elog(ERROR, "cache lookup failed for relation %u", keys_relid);
	keys_owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
	ReleaseSysCache(tuple);

	return keys_relid;
}

/* OID of idem.token_seq, the sequence of fencing tokens. */
Oid
idem_token_seq_relid(void)
{
	(void) idem_keys_relid();
	return token_seq_relid;
}

/* Connect to SPI and act as the key table's owner until idem_spi_end. */
void
idem_spi_begin(IdemSpi *spi)
{
	Oid			relid = idem_keys_relid();

	(void) relid;
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	GetUserIdAndSecContext(&spi->save_userid, &spi->save_sec_context);
	SetUserIdAndSecContext(keys_owner,
						   spi->save_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_NOFORCE_RLS);
}

/* Undo idem_spi_begin. */
void
idem_spi_end(IdemSpi *spi)
{
	SetUserIdAndSecContext(spi->save_userid, spi->save_sec_context);
	if (SPI_finish() != SPI_OK_FINISH)
		elog(ERROR, "SPI_finish failed");
}

/*
 * Run a statement, preparing and keeping its plan on first use.  Returns
 * the number of rows processed; the rows are in SPI_tuptable.
 */
uint64
idem_spi_run(IdemPlanDef *def, Datum *values, const char *nulls)
{
	int			rc;

	if (def->plan == NULL)
	{
		SPIPlanPtr	plan = SPI_prepare(def->sql, def->nargs, def->argtypes);

		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed for \"%s\": %s",
				 def->sql, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "SPI_keepplan failed");
		def->plan = plan;
	}

	rc = SPI_execute_plan(def->plan, values, nulls, false, 0);
	if (rc < 0)
		elog(ERROR, "SPI_execute_plan failed for \"%s\": %s",
			 def->sql, SPI_result_code_string(rc));
	return SPI_processed;
}
