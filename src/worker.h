/*-------------------------------------------------------------------------
 *
 * worker.h
 *	  The background purge launcher and its per-database workers.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WORKER_H
#define IDEM_WORKER_H

extern void idem_worker_register(void);

#endif							/* IDEM_WORKER_H */
