/*-------------------------------------------------------------------------
 *
 * args.h
 *	  Checks of the SQL functions' arguments, and keys in messages.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_ARGS_H
#define IDEM_ARGS_H

#include "fmgr.h"
#include "datatype/timestamp.h"

extern TimestampTz idem_add_interval(TimestampTz ts, Interval *span);
extern char *idem_window_text(Interval *span, int default_secs,
							  const char *argname);
extern TimestampTz idem_window_end(TimestampTz now, Interval *span,
								   int default_secs, const char *argname);
extern text *idem_arg_text(FunctionCallInfo fcinfo, int argno,
						   const char *argname);
extern void idem_check_key(text *key, const char *argname,
						   bool allow_empty);
extern char *idem_key_for_message(text *key);

/* PostgreSQL 18 spells "does not return" as a prefix, older releases as a suffix. */
#ifdef pg_noreturn
extern pg_noreturn void idem_too_many_rounds(text *key);
#else
extern void idem_too_many_rounds(text *key) pg_attribute_noreturn();
#endif

#endif							/* IDEM_ARGS_H */
