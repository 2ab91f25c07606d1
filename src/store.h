/*-------------------------------------------------------------------------
 *
 * store.h
 *	  Kept SPI plans over idem.keys, run as the table's owner.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STORE_H
#define IDEM_STORE_H

#include "postgres.h"

#include "executor/spi.h"

#define IDEM_MAX_PLAN_ARGS	8

/* A statement over the key table; its plan is prepared on first use. */
typedef struct IdemPlanDef
{
	const char *sql;
	int			nargs;
	Oid			argtypes[IDEM_MAX_PLAN_ARGS];
	SPIPlanPtr	plan;
} IdemPlanDef;

/* Saved identity while statements run as the table's owner. */
typedef struct IdemSpi
{
	Oid			save_userid;
	int			save_sec_context;
} IdemSpi;

extern Oid	idem_keys_relid(void);
extern Oid	idem_token_seq_relid(void);
extern void idem_spi_begin(IdemSpi *spi);
extern void idem_spi_end(IdemSpi *spi);
extern uint64 idem_spi_run(IdemPlanDef *def, Datum *values, const char *nulls);

#endif							/* IDEM_STORE_H */
