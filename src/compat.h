/*-------------------------------------------------------------------------
 *
 * compat.h
 *	  Differences between the PostgreSQL major versions idem builds against
 *	  (15 to 18), so that the rest of the code reads the same on each.
 *
 *	  A difference that matters at one place only stays there, as an
 *	  inline #if PG_VERSION_NUM (grep for PG_VERSION_NUM under src).
 *	  The background worker entry points in src/worker.c are PGDLLEXPORT:
 *	  from 16 on, symbols are hidden unless exported.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMPAT_H
#define IDEM_COMPAT_H

#include "fmgr.h"
#if PG_VERSION_NUM >= 160000
#include "varatt.h"				/* VARDATA_ANY and friends, from 16 on */
#endif
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/tableam.h"
#include "storage/proc.h"
#include "utils/wait_event.h"

#if PG_VERSION_NUM < 150000
#error "idem needs PostgreSQL 15 or later"
#endif

/*
 * The module's magic block.  From 18 on it also carries the module's name,
 * shown by pg_get_loaded_modules().  The version is left out: the
 * extension's version is in pg_extension.
 */
#if PG_VERSION_NUM >= 180000
#define IDEM_MODULE_MAGIC	PG_MODULE_MAGIC_EXT(.name = "idem")
#else
#define IDEM_MODULE_MAGIC	PG_MODULE_MAGIC
#endif

/*
 * This backend's number among the PGPROCs (0 up to MaxBackends for
 * backends and background workers): MyProcNumber from 17 on, the PGPROC's
 * pgprocno before.
 */
#if PG_VERSION_NUM >= 170000
#define idem_my_proc_number()	((int) MyProcNumber)
#else
#define idem_my_proc_number()	(MyProc->pgprocno)
#endif

/*
 * A wait event of idem's, for pg_stat_activity.  From 17 on an extension
 * names its own (WaitEventExtensionNew, which takes a lock: the number is
 * kept in *event after the first call); before, every wait of an
 * extension is Extension/Extension.
 */
static inline uint32
idem_wait_event(uint32 *event, const char *name)
{
#if PG_VERSION_NUM >= 170000
	if (*event == 0)
		*event = WaitEventExtensionNew(name);
	return *event;
#else
	return PG_WAIT_EXTENSION;
#endif
}

/*
 * The primary key index of a relation.  From 18 on the caller says whether
 * a deferrable primary key will do; idem's key table has an immediate one.
 */
#if PG_VERSION_NUM >= 180000
#define idem_primary_key_index(rel)	RelationGetPrimaryKeyIndex((rel), false)
#else
#define idem_primary_key_index(rel)	RelationGetPrimaryKeyIndex(rel)
#endif

/*
 * index_beginscan without instrumentation.  From 18 on it takes an
 * IndexScanInstrumentation pointer after the snapshot.
 */
#if PG_VERSION_NUM >= 180000
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), NULL, (nkeys), (norderbys))
#else
#define idem_index_beginscan(heap, index, snapshot, nkeys, norderbys) \
	index_beginscan((heap), (index), (snapshot), (nkeys), (norderbys))
#endif

/*
 * heap_update, setting *index_new_version when the new version needs index
 * entries (it is not a HOT update).  From 16 on heap_update reports which
 * indexes need one.
 */
#if PG_VERSION_NUM >= 160000
static inline TM_Result
idem_heap_update(Relation rel, ItemPointer otid, HeapTuple tuple,
				 CommandId cid, bool wait, TM_FailureData *tmfd,
				 bool *index_new_version)
{
	LockTupleMode lockmode;
	TU_UpdateIndexes update_indexes = TU_None;
	TM_Result	result;

	result = heap_update(rel, otid, tuple, cid, InvalidSnapshot, wait, tmfd,
						 &lockmode, &update_indexes);
	*index_new_version = (result == TM_Ok && update_indexes != TU_None);
	return result;
}
#else
static inline TM_Result
idem_heap_update(Relation rel, ItemPointer otid, HeapTuple tuple,
				 CommandId cid, bool wait, TM_FailureData *tmfd,
				 bool *index_new_version)
{
	LockTupleMode lockmode;
	TM_Result	result;

	result = heap_update(rel, otid, tuple, cid, InvalidSnapshot, wait, tmfd,
						 &lockmode);
	*index_new_version = (result == TM_Ok && !HeapTupleIsHeapOnly(tuple));
	return result;
}
#endif

#endif							/* IDEM_COMPAT_H */
