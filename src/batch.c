/*-------------------------------------------------------------------------
 *
 * batch.c
 *	  Batches: idem_begin_many and idem_complete_many.
 *
 * A batch takes arrays of keys (and their fingerprints, responses and
 * tokens) of one scope and does, for each item, what idem_begin or
 * idem_complete does for one key, through the same functions of keys.c.
 * Two batches with overlapping keys would deadlock if each took its row
 * locks in the order of its input; so the items are worked on in one
 * order whatever the input's, the keys sorted bytewise (the order of the
 * primary key, whose key column has the C collation), and the answers
 * returned in input order, one row per item with its 1-based ordinality.
 *
 * Every argument is checked, item by item, before the first key is
 * looked at: a bad batch claims nothing.  A key repeated in one
 * idem_begin_many is claimed once, for its first occurrence; the later
 * ones answer DUPLICATE (CONFLICT if their fingerprint differs) and name
 * the first one in duplicate_of.  An error for one item fails the
 * statement, with a context line naming the item and its key.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/pg_type.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

#include "args.h"
#include "keys.h"
#include "settings.h"
#include "stats.h"

PG_FUNCTION_INFO_V1(idem_begin_many);
PG_FUNCTION_INFO_V1(idem_complete_many);

/* One argument array of a batch, deconstructed. */
typedef struct BatchArray
{
	const char *name;			/* the argument, for messages */
	int			nitems;
	Datum	   *values;
	bool	   *nulls;
} BatchArray;

/* One item of a batch, in input order. */
typedef struct BatchItem
{
	text	   *key;
	bytea	   *fingerprint;	/* the digest */
	int			duplicate_of;	/* 0, or the first occurrence's ordinality */
	ClaimResult res;
} BatchItem;

/* The item an error's context names. */
typedef struct BatchErrorItem
{
	const char *what;
	int			ordinality;
	text	   *key;
} BatchErrorItem;

/*
 * Deconstruct argument argno, an array of elemtype: not NULL, of at most
 * one dimension, at most idem.max_batch items, and, unless nulls_allowed,
 * without NULL elements (22004, naming the argument and the item's 1-based
 * position).  An SQL NULL for an optional array stands for "none":
 * optional arrays give nitems -1 then.
 */
static void
batch_array(FunctionCallInfo fcinfo, int argno, const char *name,
			Oid elemtype, bool optional, bool nulls_allowed, BatchArray *arr)
{
	ArrayType  *array;
	int16		elmlen;
	bool		elmbyval;
	char		elmalign;

	arr->name = name;
	arr->nitems = -1;
	arr->values = NULL;
	arr->nulls = NULL;
	if (PG_ARGISNULL(argno))
	{
		if (optional)
			return;
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
	}
	array = PG_GETARG_ARRAYTYPE_P(argno);
	if (ARR_NDIM(array) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be a one-dimensional array", name),
				 errdetail("It has %d dimensions.", ARR_NDIM(array))));
	arr->nitems = ArrayGetNItems(ARR_NDIM(array), ARR_DIMS(array));
	if (arr->nitems > idem_max_batch)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s has %d items, more than idem.max_batch (%d)",
						name, arr->nitems, idem_max_batch),
				 errhint("Split the batch, or raise idem.max_batch (a superuser setting).")));
	get_typlenbyvalalign(elemtype, &elmlen, &elmbyval, &elmalign);
	deconstruct_array(array, elemtype, elmlen, elmbyval, elmalign,
					  &arr->values, &arr->nulls, &arr->nitems);
	if (!nulls_allowed && ARR_HASNULL(array))
	{
		for (int i = 0; i < arr->nitems; i++)
			if (arr->nulls[i])
				ereport(ERROR,
						(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
						 errmsg("%s[%d] must not be null", name, i + 1),
						 errdetail("Items are numbered from 1, in input order.")));
	}
}

/* Refuse arrays of different lengths (22023, naming both). */
static void
batch_same_length(BatchArray *a, BatchArray *b)
{
	if (b->nitems >= 0 && a->nitems != b->nitems)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s and %s must have the same number of items", a->name,
						b->name),
				 errdetail("%s has %d items; %s has %d.", a->name, a->nitems,
						   b->name, b->nitems)));
}

/* The key of item i, checked as idem_begin checks its key. */
static text *
batch_key(BatchArray *keys, int i)
{
	text	   *key = DatumGetTextPP(keys->values[i]);
	int			len = VARSIZE_ANY_EXHDR(key);

	if (len == 0 || len > idem_max_key_length)
		idem_check_key(key, psprintf("%s[%d]", keys->name, i + 1), false);
	return key;
}

/* Name the item being worked on in an error's context. */
static void
batch_error_context(void *arg)
{
	BatchErrorItem *item = (BatchErrorItem *) arg;

	errcontext("%s item %d, key \"%s\"", item->what, item->ordinality,
			   idem_key_for_message(item->key));
}

/* Bytewise order of two keys: the order of the primary key's key column. */
static int
key_cmp(text *a, text *b)
{
	int			alen = VARSIZE_ANY_EXHDR(a);
	int			blen = VARSIZE_ANY_EXHDR(b);
	int			cmp = memcmp(VARDATA_ANY(a), VARDATA_ANY(b), Min(alen, blen));

	if (cmp != 0)
		return cmp;
	return (alen > blen) - (alen < blen);
}

/*
 * A key's place in lock_order's sort: its first eight bytes as a
 * big-endian number (zero-padded; text holds no zero byte, so a key that
 * is a prefix of another still sorts first), which settles most
 * comparisons without following the key, and its input position.
 */
typedef struct SortItem
{
	uint64		prefix;
	int			pos;
} SortItem;

/* The keys lock_order sorts positions of. */
static text **sort_keys;

/* qsort comparator: by key, then by input position (a total order). */
static int
item_cmp(const void *a, const void *b)
{
	const SortItem *sa = (const SortItem *) a;
	const SortItem *sb = (const SortItem *) b;
	int			cmp;

	if (sa->prefix != sb->prefix)
		return sa->prefix < sb->prefix ? -1 : 1;
	cmp = key_cmp(sort_keys[sa->pos], sort_keys[sb->pos]);
	if (cmp != 0)
		return cmp;
	return (sa->pos > sb->pos) - (sa->pos < sb->pos);
}

/* The first eight bytes of a key, big-endian, zero-padded. */
static uint64
key_prefix(text *key)
{
	const uint8 *data = (const uint8 *) VARDATA_ANY(key);
	int			len = Min(VARSIZE_ANY_EXHDR(key), 8);
	uint64		prefix = 0;

	for (int i = 0; i < 8; i++)
		prefix = (prefix << 8) | (i < len ? data[i] : 0);
	return prefix;
}

/* The positions of n keys in the order their rows are locked in. */
static int *
lock_order(text **keys, int n)
{
	int		   *order = palloc(sizeof(int) * Max(n, 1));
	SortItem   *items = palloc(sizeof(SortItem) * Max(n, 1));

	for (int i = 0; i < n; i++)
	{
		items[i].prefix = key_prefix(keys[i]);
		items[i].pos = i;
	}
	sort_keys = keys;
	qsort(items, n, sizeof(SortItem), item_cmp);
	sort_keys = NULL;
	for (int i = 0; i < n; i++)
		order[i] = items[i].pos;
	pfree(items);
	return order;
}

/* The columns of idem.begin_many_result. */
#define BEGIN_MANY_COLUMNS 11
static const Oid begin_many_types[BEGIN_MANY_COLUMNS] = {
	INT4OID, BOOLOID, TEXTOID, INT8OID, INT4OID, BYTEAOID,
	TIMESTAMPTZOID, TIMESTAMPTZOID, TEXTOID, BYTEAOID, INT4OID
};

/*
 * Check the row the executor expects against idem.begin_many_result's
 * columns, before anything is looked at or written: an ordinary composite
 * type, which its owner can ALTER.  Dropped attributes read NULL.
 */
static void
begin_many_check(TupleDesc desc)
{
	int			column = 0;

	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute attr = TupleDescAttr(desc, i);

		if (attr->attisdropped)
			continue;
		if (column >= BEGIN_MANY_COLUMNS || attr->atttypid != begin_many_types[column])
		{
			column = -1;
			break;
		}
		column++;
	}
	if (column != BEGIN_MANY_COLUMNS)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("idem_begin_many is declared with a result row idem does not return"),
				 errdetail("The row must have the columns ordinality, claimed, state, token, status, body, lease_until, expires_at, phase, phase_data and duplicate_of with the types idem creates them with."),
				 errhint("Restore the type idem.begin_many_result as the extension created it.")));
}

/* Put one item's row, in the executor's shape (dropped attributes NULL). */
static void
begin_many_put(ReturnSetInfo *rsinfo, int ordinality, BatchItem *item)
{
	Datum		v[BEGIN_MANY_COLUMNS];
	bool		n[BEGIN_MANY_COLUMNS];

	v[0] = Int32GetDatum(ordinality);
	n[0] = false;
	idem_claim_result_values(&item->res, v + 1, n + 1);
	v[10] = Int32GetDatum(item->duplicate_of);
	n[10] = item->duplicate_of <= 0;
	idem_result_row_put(rsinfo->setResult, rsinfo->setDesc, v, n,
						BEGIN_MANY_COLUMNS);
	pfree(DatumGetPointer(v[2]));
}

/*
 * idem_begin_many(keys, fingerprints, lease, retention, scope, wait,
 * wait_for, remember, holder): idem_begin for each item, the keys' rows
 * locked in bytewise order of the keys.  wait_for is one deadline for the
 * whole batch.
 */
Datum
idem_begin_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	BatchArray	keys;
	BatchArray	fingerprints;
	text	   *scope;
	ClaimArgs	args;
	BatchItem  *items;
	text	  **keytexts;
	int		   *order;
	int			n;
	MemoryContext item_cxt;
	MemoryContext old;
	BatchErrorItem current;
	ErrorContextCallback errcallback;

	/* Every argument first: a bad batch claims nothing. */
	batch_array(fcinfo, 0, "keys", TEXTOID, false, false, &keys);
	batch_array(fcinfo, 1, "fingerprints", TEXTOID, false, false, &fingerprints);
	batch_same_length(&keys, &fingerprints);
	scope = idem_scope_arg(fcinfo, 4);
	idem_claim_args(fcinfo, "idem_begin_many()", &args);
	n = keys.nitems;
	items = palloc0(sizeof(BatchItem) * Max(n, 1));
	keytexts = palloc(sizeof(text *) * Max(n, 1));
	for (int i = 0; i < n; i++)
	{
		items[i].key = keytexts[i] = batch_key(&keys, i);
		items[i].fingerprint =
			idem_fingerprint_digest(DatumGetTextPP(fingerprints.values[i]));
	}

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	begin_many_check(rsinfo->setDesc);

	order = lock_order(keytexts, n);
	item_cxt = AllocSetContextCreate(CurrentMemoryContext,
									 "idem_begin_many item",
									 ALLOCSET_DEFAULT_SIZES);
	current.what = "idem_begin_many()";
	errcallback.callback = batch_error_context;
	errcallback.arg = &current;
	errcallback.previous = error_context_stack;
	error_context_stack = &errcallback;
	for (int s = 0; s < n; s++)
	{
		BatchItem  *item = &items[order[s]];

		CHECK_FOR_INTERRUPTS();
		if (s > 0 && key_cmp(items[order[s - 1]].key, item->key) == 0)
		{
			/* A repeat: the first occurrence sorts first. */
			BatchItem  *first = &items[order[s - 1]];

			item->duplicate_of = first->duplicate_of > 0 ?
				first->duplicate_of : order[s - 1] + 1;
			first = &items[item->duplicate_of - 1];
			if (idem_same_digest(item->fingerprint, first->fingerprint))
				item->res.state = CLAIM_DUPLICATE;
			else
			{
				item->res.state = CLAIM_CONFLICT;
				idem_stats_count(IDEM_STAT_CONFLICTS);
			}
			continue;
		}
		current.ordinality = order[s] + 1;
		current.key = item->key;
		args.fingerprint = item->fingerprint;
		old = MemoryContextSwitchTo(item_cxt);
		idem_begin_key(&args, scope, item->key, &item->res);
		MemoryContextSwitchTo(old);
		MemoryContextReset(item_cxt);
	}
	error_context_stack = errcallback.previous;
	MemoryContextDelete(item_cxt);

	for (int i = 0; i < n; i++)
		begin_many_put(rsinfo, i + 1, &items[i]);
	return (Datum) 0;
}

/*
 * idem_complete_many(keys, fingerprints, statuses, bodies, tokens,
 * retention, scope): idem_complete for each item, in the order
 * idem_begin_many locks the keys.  bodies and tokens may hold NULLs (no
 * body; the claim this transaction made), tokens may be NULL as a whole.
 * Returns each item's new expires_at, in input order.
 */
Datum
idem_complete_many(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	BatchArray	keys;
	BatchArray	fingerprints;
	BatchArray	statuses;
	BatchArray	bodies;
	BatchArray	tokens;
	text	   *scope;
	bool		has_expiry = false;
	TimestampTz expires_at = 0;
	text	  **keytexts;
	bytea	  **digests;
	TimestampTz *stored;
	int		   *order;
	int			n;
	MemoryContext item_cxt;
	MemoryContext old;
	BatchErrorItem current;
	ErrorContextCallback errcallback;

	batch_array(fcinfo, 0, "keys", TEXTOID, false, false, &keys);
	batch_array(fcinfo, 1, "fingerprints", TEXTOID, false, false, &fingerprints);
	batch_array(fcinfo, 2, "statuses", INT4OID, false, false, &statuses);
	batch_array(fcinfo, 3, "bodies", BYTEAOID, false, true, &bodies);
	batch_array(fcinfo, 4, "tokens", INT8OID, true, true, &tokens);
	batch_same_length(&keys, &fingerprints);
	batch_same_length(&keys, &statuses);
	batch_same_length(&keys, &bodies);
	batch_same_length(&keys, &tokens);
	scope = idem_scope_arg(fcinfo, 6);
	if (!PG_ARGISNULL(5))
	{
		has_expiry = true;
		expires_at = idem_window_end(idem_now(), PG_GETARG_INTERVAL_P(5), 0,
									 "retention");
	}
	n = keys.nitems;
	keytexts = palloc(sizeof(text *) * Max(n, 1));
	digests = palloc(sizeof(bytea *) * Max(n, 1));
	stored = palloc(sizeof(TimestampTz) * Max(n, 1));
	for (int i = 0; i < n; i++)
	{
		keytexts[i] = batch_key(&keys, i);
		if (DatumGetInt32(statuses.values[i]) < 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("statuses[%d] must not be negative", i + 1),
					 errdetail("Items are numbered from 1, in input order.")));
		digests[i] = idem_fingerprint_digest(DatumGetTextPP(fingerprints.values[i]));
	}

	InitMaterializedSRF(fcinfo, 0);

	order = lock_order(keytexts, n);
	item_cxt = AllocSetContextCreate(CurrentMemoryContext,
									 "idem_complete_many item",
									 ALLOCSET_DEFAULT_SIZES);
	current.what = "idem_complete_many()";
	errcallback.callback = batch_error_context;
	errcallback.arg = &current;
	errcallback.previous = error_context_stack;
	error_context_stack = &errcallback;
	for (int s = 0; s < n; s++)
	{
		int			i = order[s];
		bool		has_token = tokens.nitems >= 0 && !tokens.nulls[i];

		CHECK_FOR_INTERRUPTS();
		current.ordinality = i + 1;
		current.key = keytexts[i];
		old = MemoryContextSwitchTo(item_cxt);
		stored[i] = idem_complete_key(keytexts[i], scope, digests[i],
									  DatumGetInt32(statuses.values[i]),
									  bodies.nulls[i] ? NULL :
									  DatumGetByteaPP(bodies.values[i]),
									  has_token,
									  has_token ? DatumGetInt64(tokens.values[i]) : 0,
									  has_expiry, expires_at);
		MemoryContextSwitchTo(old);
		MemoryContextReset(item_cxt);
	}
	error_context_stack = errcallback.previous;
	MemoryContextDelete(item_cxt);

	for (int i = 0; i < n; i++)
	{
		Datum		values[2];
		bool		nulls[2] = {false, false};

		values[0] = Int32GetDatum(i + 1);
		values[1] = TimestampTzGetDatum(stored[i]);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}
