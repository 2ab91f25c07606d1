/* idem--1.3--1.4.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.4'" to load this file. \quit

/*
 * 1.4: a claim names the role that made it instead of holding its OID.
 * An OID is reused by a role created after the claiming role was dropped
 * (once the OID counter wraps around, or after pg_resetwal), and a dump
 * restored into a cluster whose roles were created in another order
 * gives each OID to another role; a name stays with the role through
 * both.  A claim of a role dropped before this update keeps an empty
 * name, which no role can have: only superusers can act on it.  The
 * table is rewritten, under an ACCESS EXCLUSIVE lock.
 *
 * idem_keys reads the column, so it first stops reading it; CREATE OR
 * REPLACE VIEW keeps the view, its privileges and its initial privileges.
 */
CREATE OR REPLACE VIEW @extschema@.idem_keys AS
	SELECT k.scope, k.key,
		   CASE WHEN k.status IS NULL THEN 'PROCESSING'::pg_catalog.text
				ELSE 'DONE'::pg_catalog.text END AS state,
		   k.token, k.status, k.lease_until, k.expires_at,
		   pg_catalog.octet_length(k.body) AS body_size,
		   NULL::pg_catalog.regrole AS claimed_by
	  FROM idem.keys k;

ALTER TABLE idem.keys ALTER COLUMN claimed_by TYPE pg_catalog.text COLLATE pg_catalog."C"
	USING CASE WHEN pg_catalog.pg_get_userbyid(claimed_by) OPERATOR(pg_catalog.=)
				   pg_catalog.format('unknown (OID=%s)', claimed_by) THEN ''
			   ELSE pg_catalog.pg_get_userbyid(claimed_by)::pg_catalog.text END;

/* claimed_by is shown as the role, NULL once the role no longer exists. */
CREATE OR REPLACE VIEW @extschema@.idem_keys AS
	SELECT k.scope, k.key,
		   CASE WHEN k.status IS NULL THEN 'PROCESSING'::pg_catalog.text
				ELSE 'DONE'::pg_catalog.text END AS state,
		   k.token, k.status, k.lease_until, k.expires_at,
		   pg_catalog.octet_length(k.body) AS body_size,
		   (SELECT r.oid FROM pg_catalog.pg_roles r
			 WHERE r.rolname OPERATOR(pg_catalog.=) k.claimed_by)::pg_catalog.regrole AS claimed_by
	  FROM idem.keys k;

/*
 * idem_stats() is bound to the C function of its own result type, as
 * pg_stat_statements binds one per API version; the symbol idem_stats
 * stays for databases not yet updated.  The same signature and result
 * type: the function keeps its privileges.
 */
CREATE OR REPLACE FUNCTION @extschema@.idem_stats(
	OUT dbid pg_catalog.oid, OUT claims pg_catalog.int8,
	OUT takeovers pg_catalog.int8, OUT replays pg_catalog.int8,
	OUT in_flight pg_catalog.int8, OUT conflicts pg_catalog.int8,
	OUT completes pg_catalog.int8, OUT superseded pg_catalog.int8,
	OUT releases pg_catalog.int8, OUT purged_rows pg_catalog.int8,
	OUT purge_runs pg_catalog.int8, OUT last_purge pg_catalog.timestamptz,
	OUT last_purge_error pg_catalog.text,
	OUT purge_start_failures pg_catalog.int8)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_1_3'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;
