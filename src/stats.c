/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  Per-database counters in shared memory and the idem_stats() function.
 *
 * Counters exist only when idem is in shared_preload_libraries.  Each
 * database gets a slot on its first count; a backend remembers its slot,
 * so counting is one atomic add and takes no lock.  A slot's database is
 * an atomic read without a lock; only giving a slot to a database takes
 * the exclusive lock, once per database (and, while every slot is taken,
 * once per backend until a slot is freed).  The launcher frees the slots
 * of dropped databases (idem_stats_forget).
 *
 * A database's last purge error is read from every database, so it is
 * kept in one encoding, UTF-8: converted from the encoding of the database
 * it was recorded in, and to that of the database that reads it, where
 * what the reader's encoding cannot represent becomes '?'.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "fmgr.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "storage/fd.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "stats.h"

PG_FUNCTION_INFO_V1(idem_stats);
PG_FUNCTION_INFO_V1(idem_stats_1_3);
PG_FUNCTION_INFO_V1(idem_stats_1_4);
PG_FUNCTION_INFO_V1(idem_stats_reset);

/* Databases with counters at the same time; more wait for a free slot. */
#define IDEM_STATS_MAX_DATABASES	IDEM_STATS_SLOTS
#define IDEM_STATS_ERROR_LEN		256

/* Columns of idem_stats() before 1.3: dbid, the counters, last_purge, error. */
#define IDEM_STATS_COLS			(IDEM_STAT_NUM_1_3 + 3)
/* In 1.3, purge_start_failures after them. */
#define IDEM_STATS_COLS_1_3		(IDEM_STATS_COLS + 1)
/*
 * From 1.4 on, the counters after IDEM_STAT_NUM_1_3 (the times in
 * milliseconds), then stats_reset.
 */
#define IDEM_STATS_MAX_COLS		(IDEM_STATS_COLS_1_3 + (IDEM_STAT_NUM - IDEM_STAT_NUM_1_3) + 1)

/* The file the counters are kept in across a clean restart. */
#define IDEM_STATS_FILE			PGSTAT_STAT_PERMANENT_DIRECTORY "/idem.stat"
#define IDEM_STATS_FILE_TMP		IDEM_STATS_FILE ".tmp"
#define IDEM_STATS_FILE_MAGIC	0x1de50014

typedef struct IdemDbStats
{
	pg_atomic_uint32 dboid;		/* InvalidOid: slot free; changed under the
								 * exclusive lock, read without it */
	pg_atomic_uint64 counters[IDEM_STAT_NUM];
	pg_atomic_uint64 start_failures;	/* purge workers that could not start */
	TimestampTz last_purge;		/* 0: never; under lock */
	TimestampTz stats_reset;	/* slot taken or counters reset; under lock */
	char		last_error[IDEM_STATS_ERROR_LEN];	/* UTF-8; under lock */
} IdemDbStats;

/* A slot as the stats file keeps it. */
typedef struct IdemDbStatsRecord
{
	Oid			dboid;
	uint64		counters[IDEM_STAT_NUM];
	uint64		start_failures;
	TimestampTz last_purge;
	TimestampTz stats_reset;
	char		last_error[IDEM_STATS_ERROR_LEN];
} IdemDbStatsRecord;

typedef struct IdemStatsShared
{
	LWLock	   *lock;
	pg_atomic_uint32 frees;		/* bumped each time slots are freed */
	pg_atomic_uint64 start_failures;	/* all databases */
	IdemDbStats dbs[IDEM_STATS_MAX_DATABASES];
} IdemStatsShared;

static IdemStatsShared *stats = NULL;
static IdemDbStats *my_db_stats = NULL;

/* Set when this backend found no free slot, and the value of frees then. */
static bool no_slot = false;
static uint32 no_slot_frees = 0;

static void stats_load(void);
static void stats_shmem_shutdown(int code, Datum arg);

static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/*
 * The conversions between this database's encoding and UTF-8, looked up
 * once (the database's encoding is fixed for the life of a backend); NULL
 * if there is none.
 */
static FmgrInfo *to_utf8_proc = NULL;
static bool to_utf8_looked_up = false;
static FmgrInfo *from_utf8_proc = NULL;
static bool from_utf8_looked_up = false;

/* Ask for the shared memory and the lock. */
static void
stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(sizeof(IdemStatsShared));
	RequestNamedLWLockTranche("idem", 1);
}

/* Zero a slot's counters and purge record; the caller owns the slot. */
static void
slot_clear(IdemDbStats *slot)
{
	int			j;

	for (j = 0; j < IDEM_STAT_NUM; j++)
		pg_atomic_write_u64(&slot->counters[j], 0);
	pg_atomic_write_u64(&slot->start_failures, 0);
	slot->last_purge = 0;
	slot->stats_reset = GetCurrentTimestamp();
	slot->last_error[0] = '\0';
}

/* Create or attach to the counters. */
static void
stats_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	stats = ShmemInitStruct("idem stats", sizeof(IdemStatsShared), &found);
	if (!found)
	{
		int			i;

		memset(stats, 0, sizeof(IdemStatsShared));
		stats->lock = &(GetNamedLWLockTranche("idem"))->lock;
		pg_atomic_init_u32(&stats->frees, 0);
		pg_atomic_init_u64(&stats->start_failures, 0);
		for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
		{
			int			j;

			pg_atomic_init_u32(&stats->dbs[i].dboid, InvalidOid);
			for (j = 0; j < IDEM_STAT_NUM; j++)
				pg_atomic_init_u64(&stats->dbs[i].counters[j], 0);
			pg_atomic_init_u64(&stats->dbs[i].start_failures, 0);
		}
		stats_load();
	}
	LWLockRelease(AddinShmemInitLock);

	/* The postmaster keeps the counters at a clean shutdown. */
	if (!IsUnderPostmaster)
		on_shmem_exit(stats_shmem_shutdown, (Datum) 0);
}

/* A timestamp read from the stats file, or ifbad if it is out of range. */
static TimestampTz
valid_timestamp(TimestampTz ts, TimestampTz ifbad)
{
	return (ts != 0 && IS_VALID_TIMESTAMP(ts)) ? ts : ifbad;
}

/*
 * Put a record of the stats file into the first nloaded slots, adding its
 * counters to those of a slot of the same database if there is one (a
 * file written by hand, or by another build, may repeat a database);
 * returns how many slots are loaded now.  A time out of range is read as
 * never (last_purge) or now (stats_reset), so that idem_stats() can show
 * it.
 */
static int
load_record(IdemDbStatsRecord *rec, int nloaded)
{
	IdemDbStats *slot = NULL;
	TimestampTz last_purge = valid_timestamp(rec->last_purge, 0);
	TimestampTz stats_reset = valid_timestamp(rec->stats_reset,
											  GetCurrentTimestamp());
	int			i;

	for (i = 0; i < nloaded && slot == NULL; i++)
		if (pg_atomic_read_u32(&stats->dbs[i].dboid) == rec->dboid)
			slot = &stats->dbs[i];
	if (slot == NULL)
	{
		slot = &stats->dbs[nloaded++];
		pg_atomic_write_u32(&slot->dboid, rec->dboid);
		slot->stats_reset = stats_reset;
	}
	for (i = 0; i < IDEM_STAT_NUM; i++)
		pg_atomic_fetch_add_u64(&slot->counters[i], rec->counters[i]);
	pg_atomic_fetch_add_u64(&slot->start_failures, rec->start_failures);
	slot->stats_reset = Min(slot->stats_reset, stats_reset);
	rec->last_error[IDEM_STATS_ERROR_LEN - 1] = '\0';
	if (last_purge >= slot->last_purge)
	{
		slot->last_purge = last_purge;
		strlcpy(slot->last_error, rec->last_error, IDEM_STATS_ERROR_LEN);
	}
	return nloaded;
}

/*
 * Read the counters a clean shutdown kept, as pg_stat_statements does,
 * then remove the file: after a crash the counters start from zero.
 */
static void
stats_load(void)
{
	FILE	   *file;
	uint32		header[3];
	int			nloaded = 0;
	int			i;

	file = AllocateFile(IDEM_STATS_FILE, PG_BINARY_R);
	if (file == NULL)
	{
		if (errno != ENOENT)
			ereport(LOG,
					(errcode_for_file_access(),
					 errmsg("could not read idem statistics file \"%s\": %m",
							IDEM_STATS_FILE)));
		return;
	}
	if (fread(header, sizeof(header), 1, file) != 1 ||
		header[0] != IDEM_STATS_FILE_MAGIC || header[1] != IDEM_STAT_NUM ||
		header[2] > IDEM_STATS_MAX_DATABASES)
	{
		ereport(LOG,
				(errmsg("ignoring idem statistics file \"%s\": it was written by another version",
						IDEM_STATS_FILE)));
		header[2] = 0;
	}
	for (i = 0; i < (int) header[2]; i++)
	{
		IdemDbStatsRecord rec;

		if (fread(&rec, sizeof(rec), 1, file) != 1)
		{
			ereport(LOG,
					(errmsg("idem statistics file \"%s\" is cut short", IDEM_STATS_FILE)));
			break;
		}
		if (rec.dboid != InvalidOid)
			nloaded = load_record(&rec, nloaded);
	}
	FreeFile(file);
	unlink(IDEM_STATS_FILE);
}

/*
 * At a clean shutdown, write the counters of every database that has a
 * slot to a temporary file and rename it into place.
 */
static void
stats_shmem_shutdown(int code, Datum arg)
{
	FILE	   *file;
	uint32		header[3];
	int			i;

	/* Not after a crash, nor where the counters never existed. */
	if (code != 0 || stats == NULL)
		return;

	file = AllocateFile(IDEM_STATS_FILE_TMP, PG_BINARY_W);
	if (file == NULL)
		goto error;
	header[0] = IDEM_STATS_FILE_MAGIC;
	header[1] = IDEM_STAT_NUM;
	header[2] = 0;
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
		if (pg_atomic_read_u32(&stats->dbs[i].dboid) != InvalidOid)
			header[2]++;
	if (fwrite(header, sizeof(header), 1, file) != 1)
		goto error;
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		IdemDbStats *slot = &stats->dbs[i];
		IdemDbStatsRecord rec;
		int			j;

		memset(&rec, 0, sizeof(rec));
		rec.dboid = pg_atomic_read_u32(&slot->dboid);
		if (rec.dboid == InvalidOid)
			continue;
		for (j = 0; j < IDEM_STAT_NUM; j++)
			rec.counters[j] = pg_atomic_read_u64(&slot->counters[j]);
		rec.start_failures = pg_atomic_read_u64(&slot->start_failures);
		rec.last_purge = slot->last_purge;
		rec.stats_reset = slot->stats_reset;
		strlcpy(rec.last_error, slot->last_error, IDEM_STATS_ERROR_LEN);
		if (fwrite(&rec, sizeof(rec), 1, file) != 1)
			goto error;
	}
	if (FreeFile(file))
	{
		file = NULL;
		goto error;
	}
	(void) durable_rename(IDEM_STATS_FILE_TMP, IDEM_STATS_FILE, LOG);
	return;

error:
	ereport(LOG,
			(errcode_for_file_access(),
			 errmsg("could not write idem statistics file \"%s\": %m",
					IDEM_STATS_FILE_TMP)));
	if (file)
		FreeFile(file);
	unlink(IDEM_STATS_FILE_TMP);
}

/* Install the shared memory hooks; called from _PG_init when preloaded. */
void
idem_stats_shmem_init(void)
{
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = stats_shmem_startup;
}

/* The slot of a database, or NULL if it has none; takes no lock. */
static IdemDbStats *
find_slot(Oid dboid)
{
	int			i;

	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		if (pg_atomic_read_u32(&stats->dbs[i].dboid) == dboid)
			return &stats->dbs[i];
	}
	return NULL;
}

/*
 * The slot of a database, given one if it has none; NULL when every slot
 * is taken.  Giving a slot takes the exclusive lock, so that two backends
 * of a new database cannot take two slots.
 */
static IdemDbStats *
find_or_take_slot(Oid dboid)
{
	IdemDbStats *slot = find_slot(dboid);
	int			i;

	if (slot != NULL)
		return slot;

	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		Oid			owner = pg_atomic_read_u32(&stats->dbs[i].dboid);

		if (owner == dboid)
		{
			slot = &stats->dbs[i];
			break;
		}
		if (slot == NULL && owner == InvalidOid)
			slot = &stats->dbs[i];
	}
	/* A free slot was cleared when it was freed. */
	if (slot != NULL && pg_atomic_read_u32(&slot->dboid) != dboid)
	{
		slot->stats_reset = GetCurrentTimestamp();
		pg_atomic_write_u32(&slot->dboid, dboid);
	}
	LWLockRelease(stats->lock);
	return slot;
}

/*
 * The current database's slot for this backend.  After finding every slot
 * taken, the backend looks again only once a slot has been freed, so a
 * database without a slot costs one atomic read per count.
 */
static IdemDbStats *
my_slot(void)
{
	uint32		frees = pg_atomic_read_u32(&stats->frees);
	IdemDbStats *slot;

	if (no_slot && frees == no_slot_frees)
		return NULL;
	slot = find_or_take_slot(MyDatabaseId);
	no_slot = (slot == NULL);
	no_slot_frees = frees;
	return slot;
}

/* The current database's slot, looked up once; NULL without one. */
static IdemDbStats *
current_slot(void)
{
	if (stats == NULL)
		return NULL;
	if (my_db_stats == NULL ||
		pg_atomic_read_u32(&my_db_stats->dboid) != MyDatabaseId)
		my_db_stats = my_slot();
	return my_db_stats;
}

/*
 * The default conversion function from one encoding to another, kept in
 * TopMemoryContext; NULL if there is none.  Needs a transaction.
 */
static FmgrInfo *
lookup_conversion(int src_encoding, int dest_encoding)
{
	Oid			proc = FindDefaultConversionProc(src_encoding, dest_encoding);
	FmgrInfo   *finfo;

	if (!OidIsValid(proc))
		return NULL;
	finfo = MemoryContextAlloc(TopMemoryContext, sizeof(FmgrInfo));
	fmgr_info_cxt(proc, finfo, TopMemoryContext);
	return finfo;
}

/*
 * Look up the conversion of this database's encoding to UTF-8, which
 * recording a purge error needs and cannot look up itself: it runs after
 * the failed transaction has been aborted.  Call in a transaction once
 * connected; without it, non-ASCII characters of errors are stored as '?'.
 */
void
idem_stats_prepare_encoding(void)
{
	int			encoding = GetDatabaseEncoding();

	if (to_utf8_looked_up)
		return;
	if (encoding != PG_UTF8 && encoding != PG_SQL_ASCII)
		to_utf8_proc = lookup_conversion(encoding, PG_UTF8);
	to_utf8_looked_up = true;
}

/*
 * Append src, len bytes in src_encoding, to out in dest_encoding, through
 * the conversion function proc, or without one if the two encodings are the
 * same (then src is only checked) or none is known (then only ASCII
 * passes).  Never fails: a character that dest_encoding cannot represent
 * becomes '?', and so does each byte that is not valid in src_encoding.
 */
static void
append_converted(StringInfo out, const char *src, int len,
				 int src_encoding, int dest_encoding, FmgrInfo *proc)
{
	char	   *chunk = NULL;

	if (proc != NULL)
		chunk = palloc((Size) len * MAX_CONVERSION_GROWTH + 1);
	while (len > 0)
	{
		int			done;
		int			skip;

		if (proc != NULL)
		{
			/* With noError, the number of bytes of src converted. */
			done = DatumGetInt32(FunctionCall6(proc,
											   Int32GetDatum(src_encoding),
											   Int32GetDatum(dest_encoding),
											   CStringGetDatum(src),
											   CStringGetDatum(chunk),
											   Int32GetDatum(len),
											   BoolGetDatum(true)));
			appendStringInfoString(out, chunk);
		}
		else
		{
			if (src_encoding == dest_encoding)
				done = pg_encoding_verifymbstr(src_encoding, src, len);
			else
			{
				for (done = 0; done < len; done++)
				{
					if (IS_HIGHBIT_SET(src[done]))
						break;
				}
			}
			appendBinaryStringInfo(out, src, done);
		}
		if (done >= len)
			break;

		/* One '?' for the character (or invalid byte) that stopped it. */
		appendStringInfoChar(out, '?');
		skip = pg_encoding_verifymbchar(src_encoding, src + done, len - done);
		if (skip < 1)
			skip = 1;
		src += done + skip;
		len -= done + skip;
	}
	if (chunk != NULL)
		pfree(chunk);
}

/*
 * Copy msg, in the current database's encoding, into buf (of
 * IDEM_STATS_ERROR_LEN bytes) as UTF-8, cut at a character boundary if it
 * is longer.  Outside a database (the launcher) the encoding is SQL_ASCII:
 * bytes that are not ASCII, whose meaning is unknown, become '?', as they
 * do from a SQL_ASCII database.
 */
static void
error_to_utf8(const char *msg, char *buf)
{
	int			encoding = GetDatabaseEncoding();
	int			len = strlen(msg);
	FmgrInfo   *proc = NULL;
	StringInfoData out;
	int			clip;

	/* Each character takes a byte at least in UTF-8: the rest cannot fit. */
	len = Min(len, pg_encoding_mbcliplen(encoding, msg, len,
										 IDEM_STATS_ERROR_LEN - 1));
	if (encoding != PG_UTF8 && encoding != PG_SQL_ASCII)
		proc = to_utf8_proc;
	initStringInfo(&out);
	append_converted(&out, msg, len, encoding, PG_UTF8, proc);
	clip = pg_encoding_mbcliplen(PG_UTF8, out.data, out.len,
								 IDEM_STATS_ERROR_LEN - 1);
	memcpy(buf, out.data, clip);
	buf[clip] = '\0';
	pfree(out.data);
}

/*
 * A stored error (UTF-8) as text in the current database's encoding, with
 * '?' for what that encoding cannot represent.  A SQL_ASCII database gets
 * the UTF-8 bytes.
 */
static Datum
error_to_text(const char *error)
{
	int			encoding = GetDatabaseEncoding();
	StringInfoData out;
	Datum		result;

	if (encoding == PG_UTF8 || encoding == PG_SQL_ASCII)
		return CStringGetTextDatum(error);
	initStringInfo(&out);
	append_converted(&out, error, strlen(error), PG_UTF8, encoding,
					 from_utf8_proc);
	result = CStringGetTextDatum(out.data);
	pfree(out.data);
	return result;
}

/* Add n to a counter of the current database. */
void
idem_stats_add(IdemStat stat, uint64 n)
{
	IdemDbStats *slot = current_slot();

	if (slot != NULL)
		pg_atomic_fetch_add_u64(&slot->counters[stat], n);
}

/*
 * The number of the current database's slot, from 0 to
 * IDEM_STATS_SLOTS - 1, or -1 if it has none: other per-database state
 * (expiry.c) is kept beside the counters, at the same number.
 */
int
idem_stats_slot_index(void)
{
	IdemDbStats *slot = current_slot();

	return (slot == NULL) ? -1 : (int) (slot - stats->dbs);
}

/* Start timing a call, if the counters are collected. */
void
idem_stats_start(instr_time *started)
{
	if (stats == NULL)
		INSTR_TIME_SET_ZERO(*started);
	else
		INSTR_TIME_SET_CURRENT(*started);
}

/* Add the microseconds since idem_stats_start to a time counter. */
void
idem_stats_add_time(IdemStat stat, instr_time *started)
{
	instr_time	elapsed;

	if (stats == NULL || INSTR_TIME_IS_ZERO(*started))
		return;
	INSTR_TIME_SET_CURRENT(elapsed);
	INSTR_TIME_SUBTRACT(elapsed, *started);
	idem_stats_add(stat, (uint64) INSTR_TIME_GET_MICROSEC(elapsed));
}

/* Record the end of a purge run in a database: when, and its error if any. */
void
idem_stats_purge_done(Oid dboid, const char *error)
{
	IdemDbStats *slot;
	char		utf8[IDEM_STATS_ERROR_LEN];

	if (stats == NULL || (slot = find_or_take_slot(dboid)) == NULL)
		return;
	error_to_utf8(error ? error : "", utf8);
	pg_atomic_fetch_add_u64(&slot->counters[IDEM_STAT_PURGE_RUNS], 1);
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	slot->last_purge = GetCurrentTimestamp();
	strlcpy(slot->last_error, utf8, IDEM_STATS_ERROR_LEN);
	LWLockRelease(stats->lock);
}

/*
 * Record why a purge run in a database with idem was skipped, in its
 * last_purge_error, without counting a run.
 */
void
idem_stats_purge_skipped(Oid dboid, const char *reason)
{
	IdemDbStats *slot;
	char		utf8[IDEM_STATS_ERROR_LEN];

	if (stats == NULL || (slot = find_or_take_slot(dboid)) == NULL)
		return;
	error_to_utf8(reason, utf8);
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	strlcpy(slot->last_error, utf8, IDEM_STATS_ERROR_LEN);
	LWLockRelease(stats->lock);
}

/*
 * Count a purge worker that could not start for a database.  The database
 * may not have idem, so it gets no slot here; if it has one, the failure
 * is counted there too and reason becomes its last_purge_error.  Returns
 * the number of such failures in all databases since the server started.
 */
uint64
idem_stats_start_failed(Oid dboid, const char *reason)
{
	IdemDbStats *slot;
	uint64		total;
	char		utf8[IDEM_STATS_ERROR_LEN];

	if (stats == NULL)
		return 0;
	total = pg_atomic_add_fetch_u64(&stats->start_failures, 1);
	if ((slot = find_slot(dboid)) == NULL)
		return total;
	error_to_utf8(reason, utf8);
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&slot->dboid) == dboid)
	{
		pg_atomic_fetch_add_u64(&slot->start_failures, 1);
		strlcpy(slot->last_error, utf8, IDEM_STATS_ERROR_LEN);
	}
	LWLockRelease(stats->lock);
	return total;
}

/*
 * The databases that have a slot now, into oids (room for
 * IDEM_STATS_MAX_DATABASES); returns how many.
 */
int
idem_stats_databases(Oid *oids)
{
	int			n = 0;
	int			i;

	if (stats == NULL)
		return 0;
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		Oid			dboid = pg_atomic_read_u32(&stats->dbs[i].dboid);

		if (dboid != InvalidOid)
			oids[n++] = dboid;
	}
	return n;
}

/*
 * Free the slot of a dropped database, clearing its counters.  Only for a
 * database that no longer exists: no backend can be counting in it.
 */
void
idem_stats_forget(Oid dboid)
{
	IdemDbStats *slot;

	if (stats == NULL || dboid == InvalidOid)
		return;
	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	if ((slot = find_slot(dboid)) != NULL)
	{
		slot_clear(slot);
		pg_atomic_write_u32(&slot->dboid, InvalidOid);
		pg_atomic_fetch_add_u32(&stats->frees, 1);
	}
	LWLockRelease(stats->lock);
}

/* Error out unless the counters exist. */
static void
require_stats(void)
{
	if (stats == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem statistics are not collected: the library is not preloaded"),
				 errhint("Add idem to shared_preload_libraries and restart the server.")));
}

/*
 * One row per database with counters into the SRF result of fcinfo, with
 * natts columns: IDEM_STATS_COLS up to 1.2, IDEM_STATS_COLS_1_3 in 1.3
 * (purge_start_failures), IDEM_STATS_MAX_COLS from 1.4 on (not_stored).
 */
static void
stats_rows(FunctionCallInfo fcinfo, int natts)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	int			encoding = GetDatabaseEncoding();
	int			i;

	if (rsinfo->setDesc->natts != natts)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("idem_stats() is declared with %d columns, expected %d",
						rsinfo->setDesc->natts, natts),
				 errhint("Run ALTER EXTENSION idem UPDATE.")));

	/* Errors are stored in UTF-8: look up their conversion before the lock. */
	if (!from_utf8_looked_up && encoding != PG_UTF8 && encoding != PG_SQL_ASCII)
	{
		from_utf8_proc = lookup_conversion(PG_UTF8, encoding);
		from_utf8_looked_up = true;
	}

	LWLockAcquire(stats->lock, LW_SHARED);
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
	{
		IdemDbStats *slot = &stats->dbs[i];
		Oid			dboid = pg_atomic_read_u32(&slot->dboid);
		Datum		values[IDEM_STATS_MAX_COLS];
		bool		nulls[IDEM_STATS_MAX_COLS];
		int			j;

		if (dboid == InvalidOid)
			continue;
		memset(nulls, false, sizeof(nulls));
		values[0] = ObjectIdGetDatum(dboid);
		for (j = 0; j < IDEM_STAT_NUM_1_3; j++)
			values[j + 1] = Int64GetDatum((int64) pg_atomic_read_u64(&slot->counters[j]));
		values[IDEM_STAT_NUM_1_3 + 1] = TimestampTzGetDatum(slot->last_purge);
		nulls[IDEM_STAT_NUM_1_3 + 1] = (slot->last_purge == 0);
		values[IDEM_STAT_NUM_1_3 + 2] = error_to_text(slot->last_error);
		nulls[IDEM_STAT_NUM_1_3 + 2] = (slot->last_error[0] == '\0');
		values[IDEM_STAT_NUM_1_3 + 3] =
			Int64GetDatum((int64) pg_atomic_read_u64(&slot->start_failures));
		for (j = IDEM_STAT_NUM_1_3; j < IDEM_STAT_NUM; j++)
		{
			uint64		n = pg_atomic_read_u64(&slot->counters[j]);

			values[j + 4] = (j >= IDEM_STAT_CLAIM_USECS) ?
				Float8GetDatum((double) n / 1000.0) : Int64GetDatum((int64) n);
		}
		values[IDEM_STAT_NUM + 4] = TimestampTzGetDatum(slot->stats_reset);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	LWLockRelease(stats->lock);
}

/*
 * idem_stats() as the scripts up to 1.3 declare it (the C symbol
 * idem_stats): 13 columns up to 1.2, 14 in 1.3, told by the declared
 * result type.
 */
Datum
idem_stats(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	require_stats();
	InitMaterializedSRF(fcinfo, 0);
	stats_rows(fcinfo, rsinfo->setDesc->natts == IDEM_STATS_COLS ?
			   IDEM_STATS_COLS : IDEM_STATS_COLS_1_3);
	return (Datum) 0;
}

/* idem_stats() of 1.3 databases bound to it: 14 columns. */
Datum
idem_stats_1_3(PG_FUNCTION_ARGS)
{
	require_stats();
	InitMaterializedSRF(fcinfo, 0);
	stats_rows(fcinfo, IDEM_STATS_COLS_1_3);
	return (Datum) 0;
}

/*
 * idem_stats() from 1.4 on: the 1.3 columns, then not_stored, evictions,
 * force_releases, waits, the times and stats_reset.
 */
Datum
idem_stats_1_4(PG_FUNCTION_ARGS)
{
	require_stats();
	InitMaterializedSRF(fcinfo, 0);
	stats_rows(fcinfo, IDEM_STATS_MAX_COLS);
	return (Datum) 0;
}

/* idem_stats_reset(): zero every counter of every database. */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	int			i;

	require_stats();
	if (!superuser())
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("only superusers may reset idem statistics")));

	LWLockAcquire(stats->lock, LW_EXCLUSIVE);
	for (i = 0; i < IDEM_STATS_MAX_DATABASES; i++)
		slot_clear(&stats->dbs[i]);
	pg_atomic_write_u64(&stats->start_failures, 0);
	LWLockRelease(stats->lock);
	PG_RETURN_VOID();
}
