/* idem--1.2--1.3.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.3'" to load this file. \quit

/*
 * 1.3: claims bound to the role that made them, and failed purge worker
 * starts in idem_stats.
 */

/*
 * The role that made a claim (current_user of the idem_begin that claimed
 * the key).  Outside the claiming transaction, only that role, its members
 * and superusers may complete, release or extend the claim: a fencing
 * token is a sequence number, which any role could guess.  Keys claimed
 * before this update have none and stay open to any holder of the token.
 * Adding a nullable column without a default does not rewrite the table.
 */
ALTER TABLE idem.keys ADD COLUMN claimed_by pg_catalog.oid;

/* idem_keys shows who made each claim (a column added at the end). */
CREATE OR REPLACE VIEW @extschema@.idem_keys AS
	SELECT k.scope, k.key,
		   CASE WHEN k.status IS NULL THEN 'PROCESSING'::pg_catalog.text
				ELSE 'DONE'::pg_catalog.text END AS state,
		   k.token, k.status, k.lease_until, k.expires_at,
		   pg_catalog.octet_length(k.body) AS body_size,
		   k.claimed_by::pg_catalog.regrole AS claimed_by
	  FROM idem.keys k;

/*
 * idem_stats() gains purge_start_failures: purge workers the launcher
 * could not start for the database (no free background worker slot).  A
 * function's result type cannot change in place, so the function and the
 * view over it are dropped and created again, and the privileges that
 * administrators granted on them are granted again.  Anything else on the
 * new objects (default privileges of the role running the update) is
 * revoked first.  Their initial privileges are then set to the owner's
 * alone, as CREATE EXTENSION records them, so that pg_dump dumps the
 * grants.  A role's regrole text is already quoted where its name needs
 * it, so it goes into the statements as it is.
 */
DO $$
DECLARE
	view_acl	pg_catalog.aclitem[];
	func_acl	pg_catalog.aclitem[];
	r			record;
BEGIN
	SELECT c.relacl INTO view_acl FROM pg_catalog.pg_class c
	 WHERE c.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats'::pg_catalog.regclass;
	SELECT p.proacl INTO func_acl FROM pg_catalog.pg_proc p
	 WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure;

	DROP VIEW @extschema@.idem_stats;
	DROP FUNCTION @extschema@.idem_stats();

	CREATE FUNCTION @extschema@.idem_stats(
		OUT dbid pg_catalog.oid, OUT claims pg_catalog.int8,
		OUT takeovers pg_catalog.int8, OUT replays pg_catalog.int8,
		OUT in_flight pg_catalog.int8, OUT conflicts pg_catalog.int8,
		OUT completes pg_catalog.int8, OUT superseded pg_catalog.int8,
		OUT releases pg_catalog.int8, OUT purged_rows pg_catalog.int8,
		OUT purge_runs pg_catalog.int8, OUT last_purge pg_catalog.timestamptz,
		OUT last_purge_error pg_catalog.text,
		OUT purge_start_failures pg_catalog.int8)
	RETURNS SETOF record
	AS 'MODULE_PATHNAME', 'idem_stats'
	LANGUAGE C VOLATILE PARALLEL RESTRICTED;

	CREATE VIEW @extschema@.idem_stats AS
		SELECT d.datname, s.*
		  FROM @extschema@.idem_stats() s
		  LEFT JOIN pg_catalog.pg_database d
				 ON d.oid OPERATOR(pg_catalog.=) s.dbid;

	FOR r IN
		SELECT o.object, a.grantee
		  FROM (SELECT 'FUNCTION @extschema@.idem_stats()' AS object,
					   p.proowner AS owner, p.proacl AS acl
				  FROM pg_catalog.pg_proc p
				 WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure
				UNION ALL
				SELECT 'TABLE @extschema@.idem_stats', c.relowner, c.relacl
				  FROM pg_catalog.pg_class c
				 WHERE c.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats'::pg_catalog.regclass) o
		 CROSS JOIN LATERAL pg_catalog.aclexplode(o.acl) a
		 WHERE a.grantee OPERATOR(pg_catalog.<>) o.owner
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM %s CASCADE', r.object,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END);
	END LOOP;
	REVOKE ALL ON FUNCTION @extschema@.idem_stats() FROM PUBLIC;
	REVOKE ALL ON @extschema@.idem_stats FROM PUBLIC;

	FOR r IN
		SELECT 'FUNCTION @extschema@.idem_stats()' AS object, a.*
		  FROM pg_catalog.aclexplode(func_acl) a
		UNION ALL
		SELECT 'TABLE @extschema@.idem_stats', a.*
		  FROM pg_catalog.aclexplode(view_acl) a
	LOOP
		CONTINUE WHEN r.grantee OPERATOR(pg_catalog.=) r.grantor;
		EXECUTE pg_catalog.format('GRANT %s ON %s TO %s%s', r.privilege_type, r.object,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END,
			CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
	END LOOP;
END
$$;

UPDATE pg_catalog.pg_init_privs i
   SET initprivs = ARRAY[pg_catalog.makeaclitem(p.proowner, p.proowner,
												'EXECUTE', false)]
  FROM pg_catalog.pg_proc p
 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND i.objoid OPERATOR(pg_catalog.=) p.oid
   AND i.objsubid OPERATOR(pg_catalog.=) 0
   AND p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure;
UPDATE pg_catalog.pg_init_privs i
   SET initprivs = pg_catalog.acldefault('r', c.relowner)
  FROM pg_catalog.pg_class c
 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
   AND i.objoid OPERATOR(pg_catalog.=) c.oid
   AND i.objsubid OPERATOR(pg_catalog.=) 0
   AND c.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats'::pg_catalog.regclass;
