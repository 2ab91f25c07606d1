/*-------------------------------------------------------------------------
 *
 * control.c
 *	  Operator controls: idem_evict and idem_force_release.
 *
 * An operator drops the stored response of a key (the next request with
 * it executes) or ends a claim whose holder is stuck, without its token.
 * Both delete the key's row through keytable.h, as idem_release does, and
 * wake the duplicates waiting for the key.  EXECUTE on them is what lets
 * a role use them (PUBLIC has none); neither shows a body.  Each is
 * logged (idem.log_takeovers) and counted in idem_stats.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "args.h"
#include "idem.h"
#include "keytable.h"
#include "settings.h"
#include "stats.h"
#include "waits.h"

PG_FUNCTION_INFO_V1(idem_evict);
PG_FUNCTION_INFO_V1(idem_force_release);

/* Which live rows an operator's delete takes. */
typedef enum ControlOp
{
	CONTROL_EVICT,				/* a completed key */
	CONTROL_FORCE_RELEASE		/* a key in flight */
} ControlOp;

/*
 * Delete the live row of the key if it is in the state op takes, reading
 * again if it changed meanwhile, as write_held_row does.  Returns false
 * if the key has no live row; a row in the other state is an error that
 * names the other control.  *deleted is the row deleted.
 */
static bool
delete_live_row(ControlOp op, const char *what, text *scope, text *key,
				KeyRow *deleted)
{
	KeyTable	kt;
	bool		found = false;
	int			round;
	TimestampTz now = idem_now();

	idem_keytable_open(&kt, what, scope, key, idem_keytable_write_lockmode());
	for (round = 0;; round++)
	{
		if (round == IDEM_MAX_CLAIM_ROUNDS)
			idem_too_many_rounds(key);
		/* A tombstone is live: evict forgets it, the key executes again. */
		if (!idem_keytable_read_for_write(&kt, deleted, NULL) ||
			(deleted->expires_at <= now &&
			 !idem_keyrow_is_tombstone(deleted, now)))
			break;
		if (op == CONTROL_EVICT && !deleted->done)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("idempotency key \"%s\" is in flight, not completed",
							idem_key_for_message(key)),
					 errhint("End its claim with idem_force_release.")));
		if (op == CONTROL_FORCE_RELEASE && deleted->done)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("idempotency key \"%s\" is completed, not in flight",
							idem_key_for_message(key)),
					 errhint("Drop its stored response with idem_evict.")));
		if (idem_keytable_delete(&kt, deleted, true) != KEYWRITE_OK)
			continue;			/* changed since it was read */
		found = true;
		break;
	}
	idem_keytable_close(&kt);
	if (found)
		idem_waits_note_change(scope, key);
	return found;
}

/*
 * idem_evict(key, scope): drop the stored response of a completed key, so
 * that the next request with the key executes.  Returns false if the key
 * has no live row.
 */
Datum
idem_evict(PG_FUNCTION_ARGS)
{
	text	   *key = idem_arg_text(fcinfo, 0, "key");
	text	   *scope = idem_arg_text(fcinfo, 1, "scope");
	KeyRow		row;

	idem_check_key(key, "key", false);
	idem_check_key(scope, "scope", true);
	if (!delete_live_row(CONTROL_EVICT, "idem_evict()", scope, key, &row))
		PG_RETURN_BOOL(false);

	idem_stats_count(IDEM_STAT_EVICTIONS);
	if (idem_log_takeovers)
		ereport(LOG,
				(errmsg("idempotency key \"%s\" in scope \"%s\" evicted by role %s",
						idem_key_for_message(key), idem_key_for_message(scope),
						GetUserNameFromId(GetUserId(), false)),
				 errdetail("Its stored response (status %d) is dropped; the next request with the key executes.",
						   row.status)));
	PG_RETURN_BOOL(true);
}

/*
 * idem_force_release(key, scope, reason): end the claim of a key in
 * flight without its token, so that the next request with the key claims
 * it at once.  The holder's later complete, extend or release fails (no
 * live claim, or superseded once the key is claimed again).  Returns
 * false if the key has no live row.
 */
Datum
idem_force_release(PG_FUNCTION_ARGS)
{
	text	   *key = idem_arg_text(fcinfo, 0, "key");
	text	   *scope = idem_arg_text(fcinfo, 1, "scope");
	text	   *reason = idem_arg_text(fcinfo, 2, "reason");
	KeyRow		row;

	idem_check_key(key, "key", false);
	idem_check_key(scope, "scope", true);
	if (VARSIZE_ANY_EXHDR(reason) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("reason must not be empty"),
				 errhint("Say why the claim is ended; the reason is logged.")));
	if (!delete_live_row(CONTROL_FORCE_RELEASE, "idem_force_release()",
						 scope, key, &row))
		PG_RETURN_BOOL(false);

	idem_stats_count(IDEM_STAT_FORCE_RELEASES);
	ereport(LOG,
			(errmsg("idempotency key \"%s\" in scope \"%s\" force-released by role %s: %s",
					idem_key_for_message(key), idem_key_for_message(scope),
					GetUserNameFromId(GetUserId(), false),
					idem_key_for_message(reason)),
			 errdetail("The claim with token %lld of role %s, leased until %s, is ended.",
					   (long long) row.token,
					   idem_keytable_claimant_text(&row.claimed_by),
					   row.has_lease ? timestamptz_to_str(row.lease_until) : "(none)")));
	PG_RETURN_BOOL(true);
}
