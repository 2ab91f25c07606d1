/*-------------------------------------------------------------------------
 *
 * keys.h
 *	  The claim protocol of one key (keys.c), as the batch functions
 *	  (batch.c) call it for each of their items.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_KEYS_H
#define IDEM_KEYS_H

#include "fmgr.h"
#include "datatype/timestamp.h"
#include "portability/instr_time.h"
#include "utils/tuplestore.h"

typedef enum ClaimState
{
	CLAIM_PROCESSING,
	CLAIM_DONE,
	CLAIM_CONFLICT,
	CLAIM_EXPIRED,				/* a tombstone: completed, response gone */
	CLAIM_DUPLICATE				/* a batch's repeat of an earlier item's key */
} ClaimState;

extern const char *const idem_claim_state_names[];

/* The columns of idem.begin_result: claimed to phase_data. */
#define BEGIN_RESULT_COLUMNS 9

/* The row idem_begin returns for a key; NULL fields are flagged false. */
typedef struct ClaimResult
{
	bool		claimed;
	ClaimState	state;
	bool		has_token;
	int64		token;
	bool		has_response;
	int32		status;
	bytea	   *body;
	bool		has_lease;
	TimestampTz lease_until;
	bool		has_expiry;
	TimestampTz expires_at;
	text	   *phase;			/* a takeover: the last recovery point */
	bytea	   *phase_data;
} ClaimResult;

/* What a claim needs, validated; the same for every key of a batch. */
typedef struct ClaimArgs
{
	const char *what;			/* the SQL function, for error messages */
	bytea	   *fingerprint;	/* of the key being claimed */
	bool		wait;
	Interval   *lease;			/* as given; NULL for the default */
	Interval   *retention;
	bool		has_remember;	/* remember was given (1.6 on) */
	TimestampTz remember_until; /* of a claim made now */
	Interval   *remember;
	text	   *holder;			/* holder was given (1.7 on), else NULL */
	TimestampTz now;
	TimestampTz lease_until;	/* of a claim made now */
	TimestampTz expires_at;
	TimestampTz wait_until;		/* wait_for: 0, or when the wait ends */
	TimestampTz lock_wait_until;	/* lock_timeout: 0, or when it ends */
	MemoryContext result_cxt;	/* where a replayed body is copied */
	bool		waited;			/* the key's claim waited, once or more */
	instr_time	wait_time;		/* for how long in all */
} ClaimArgs;

extern text *idem_scope_arg(FunctionCallInfo fcinfo, int argno);
extern bytea *idem_fingerprint_digest(text *fingerprint);
extern bool idem_same_digest(bytea *a, bytea *b);
extern void idem_claim_args(FunctionCallInfo fcinfo, const char *what,
							ClaimArgs *args);
extern void idem_begin_key(ClaimArgs *args, text *scope, text *key,
						   ClaimResult *res);
extern TimestampTz idem_complete_key(text *key, text *scope,
									 bytea *fingerprint, int32 status,
									 bytea *body, bool has_token, int64 token,
									 bool has_expiry, TimestampTz expires_at);
extern void idem_claim_result_values(const ClaimResult *res, Datum *values,
									 bool *nulls);
extern void idem_result_row_put(Tuplestorestate *store, TupleDesc desc,
								Datum *values, bool *nulls, int ncolumns);

#endif							/* IDEM_KEYS_H */
