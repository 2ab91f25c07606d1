/*-------------------------------------------------------------------------
 *
 * init.c
 *	  Module entry point of the idem extension.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"

#include "citus.h"
#include "compat.h"
#include "expiry.h"
#include "keytable.h"
#include "purge.h"
#include "settings.h"
#include "stats.h"
#include "waits.h"
#include "worker.h"

IDEM_MODULE_MAGIC;

void		_PG_init(void);

/*
 * Module load: define the settings.  The background worker and shared
 * memory are set up only when loaded through shared_preload_libraries.
 */
void
_PG_init(void)
{
	idem_define_settings();
	idem_citus_init();

	if (!process_shared_preload_libraries_in_progress)
		return;

	idem_stats_shmem_init();
	idem_expiry_shmem_init();
	idem_purge_install_hooks();
	idem_keytable_cache_enable();
	idem_waits_shmem_init();
	idem_worker_register();
}
