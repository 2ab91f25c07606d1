/*-------------------------------------------------------------------------
 *
 * idem.h
 *	  Definitions every module of the idem extension shares: its own
 *	  SQLSTATEs and the columns of idem.keys.  Each module declares its
 *	  functions in a header of its own.
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

/* Bound on read/write rounds of one call; each round makes progress. */
#define IDEM_MAX_CLAIM_ROUNDS	100

/*
 * Columns of idem.keys, as created by sql/idem--1.0.sql; claimed_by is
 * added by the update to 1.3 (a table of an older version has only the
 * first eight, and its claims are bound to no role), phase and phase_data
 * by the update to 1.4 (a table of 1.3 has nine, and no recovery points),
 * remember_until by the update to 1.6 (a table of 1.5 has eleven, and no
 * tombstones), holder by the update to 1.7 (a table of 1.6 has twelve, and
 * no re-entrant holders).
 */
#define Natts_keys				13
#define Natts_keys_1_6			12
#define Natts_keys_1_5			11
#define Natts_keys_1_3			9
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
#define Anum_keys_phase			10
#define Anum_keys_phase_data	11
#define Anum_keys_remember_until 12
#define Anum_keys_holder		13

/* Length of the stored fingerprint digest (SHA-256). */
#define IDEM_FINGERPRINT_LEN	32

#endif							/* IDEM_H */
