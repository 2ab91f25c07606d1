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
