/*-------------------------------------------------------------------------
 *
 * idem.h
 *	  Shared declarations of the idem extension: settings, SQLSTATEs and
 *	  the entry points each source file offers the others.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_H
#define IDEM_H

#include "postgres.h"

#include "compat.h"
#include "datatype/timestamp.h"
#include "utils/timestamp.h"

/*
 * SQLSTATEs of idem's own errors (class ID).  Bad arguments use the
 * standard codes 22004, 22023, 22001 and 54000.
 */
#define ERRCODE_IDEM_FINGERPRINT_CONFLICT	MAKE_SQLSTATE('I','D','0','0','1')
#define ERRCODE_IDEM_TOKEN_SUPERSEDED		MAKE_SQLSTATE('I','D','0','0','2')
#define ERRCODE_IDEM_NO_CLAIM				MAKE_SQLSTATE('I','D','0','0','3')
#define ERRCODE_IDEM_ALREADY_COMPLETED		MAKE_SQLSTATE('I','D','0','0','4')

/*
 * Columns of idem.keys, as created by sql/idem--1.0.sql; claimed_by is
 * added by the update to 1.3 (a table of an older version has only the
 * first eight, and its claims are bound to no role).
 */
#define Natts_keys				9
#define Natts_keys_1_2			8
#define Anum_keys_scope			1
#define Anum_keys_key			2
#define Anum_keys_fingerprint	3
#define Anum_keys_token			4
#define Anum_keys_status		5
#define Anum_keys_body			6
#define Anum_keys_lease_until	7
#define Anum_keys_expires_at	8
#define Anum_keys_claimed_by	9

/* Length of the stored fingerprint digest (SHA-256). */
#define IDEM_FINGERPRINT_LEN	32

/* Settings (idem.c) */
extern int	idem_default_lease;
extern int	idem_default_retention;
extern int	idem_max_retention;
extern int	idem_max_key_length;
extern int	idem_max_body_size;
extern int	idem_clock_offset;
extern int	idem_purge_batch_size;
extern int	idem_purge_naptime;
extern bool idem_purge_enabled;

/* idem.c */
extern TimestampTz idem_now(void);
extern TimestampTz idem_add_interval(TimestampTz ts, Interval *span);
extern TimestampTz idem_window_end(TimestampTz now, Interval *span,
								   int default_secs, const char *argname);
extern text *idem_arg_text(FunctionCallInfo fcinfo, int argno,
						   const char *argname);
extern void idem_check_key(text *key, const char *argname,
						   bool allow_empty);

/* sha256.c */
extern void idem_sha256(const uint8 *data, size_t len, uint8 *out);

/* purge.c */
extern int64 idem_purge_batch(TimestampTz now, int limit, bool *pass_done);

#endif							/* IDEM_H */
