/* idem--1.0--1.1.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.1'" to load this file. \quit

/*
 * 1.1: privileges, inspection and pg_dump support.
 *
 * Every name below is schema-qualified (@extschema@, idem, pg_catalog), so
 * what this script creates does not depend on the search_path it runs
 * with.  The functions are C functions that run their statements with
 * qualified names; the view is bound to its objects when it is created.
 */

/*
 * Privileges.  PUBLIC may call no function.  The extension owner grants
 * EXECUTE on idem_begin, idem_complete, idem_release and idem_extend to
 * application roles (README, "Security"); purge, lookup, statistics and the
 * idem_keys view are for the owner and the roles it grants them to.
 * idem_purge and idem_stats_reset were already closed in 1.0.
 */
REVOKE ALL ON FUNCTION
	@extschema@.idem_begin(pg_catalog.text, pg_catalog.text,
						   pg_catalog.interval, pg_catalog.interval,
						   pg_catalog.text, pg_catalog.bool),
	@extschema@.idem_complete(pg_catalog.text, pg_catalog.text,
							  pg_catalog.int4, pg_catalog.bytea,
							  pg_catalog.int8, pg_catalog.interval,
							  pg_catalog.text),
	@extschema@.idem_release(pg_catalog.text, pg_catalog.int8,
							 pg_catalog.text),
	@extschema@.idem_extend(pg_catalog.text, pg_catalog.int8,
							pg_catalog.interval, pg_catalog.text),
	@extschema@.idem_purge(pg_catalog.int4),
	@extschema@.idem_stats(),
	@extschema@.idem_stats_reset()
FROM PUBLIC;
REVOKE ALL ON @extschema@.idem_stats FROM PUBLIC;

/*
 * pg_dump dumps the difference between an object's privileges and its
 * initial ones (pg_init_privs).  A GRANT or REVOKE in an update script
 * records the object's whole ACL as initial, grants made by the database's
 * administrators before the update included, and pg_dump would then leave
 * those out.  Set the initial privileges of the objects changed above to
 * what CREATE EXTENSION records for them: the owner's alone.
 */
UPDATE pg_catalog.pg_init_privs i
   SET initprivs = ARRAY[pg_catalog.makeaclitem(p.proowner, p.proowner,
												'EXECUTE', false)]
  FROM pg_catalog.pg_proc p, pg_catalog.pg_depend d
 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND i.objoid OPERATOR(pg_catalog.=) p.oid
   AND i.objsubid OPERATOR(pg_catalog.=) 0
   AND d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
   AND d.objid OPERATOR(pg_catalog.=) p.oid
   AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
   AND d.refobjid OPERATOR(pg_catalog.=)
	   (SELECT e.oid FROM pg_catalog.pg_extension e
		 WHERE e.extname OPERATOR(pg_catalog.=) 'idem')
   AND d.deptype OPERATOR(pg_catalog.=) 'e';
UPDATE pg_catalog.pg_init_privs i
   SET initprivs = pg_catalog.acldefault('r', c.relowner)
  FROM pg_catalog.pg_class c
 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
   AND i.objoid OPERATOR(pg_catalog.=) c.oid
   AND i.objsubid OPERATOR(pg_catalog.=) 0
   AND c.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats'::pg_catalog.regclass;

/*
 * What is stored for one key, without the response body: the stored state
 * (PROCESSING or DONE), the current token, the status, the times and the
 * body's size in bytes.  No row if the key is not stored.
 */
CREATE FUNCTION @extschema@.idem_lookup(key pg_catalog.text,
										scope pg_catalog.text DEFAULT ''::pg_catalog.text)
RETURNS TABLE (state pg_catalog.text, token pg_catalog.int8,
			   status pg_catalog.int4, lease_until pg_catalog.timestamptz,
			   expires_at pg_catalog.timestamptz, body_size pg_catalog.int4)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;
REVOKE ALL ON FUNCTION
	@extschema@.idem_lookup(pg_catalog.text, pg_catalog.text) FROM PUBLIC;

/* Every stored key with the columns of idem_lookup; never the body. */
CREATE VIEW @extschema@.idem_keys AS
	SELECT k.scope, k.key,
		   CASE WHEN k.status IS NULL THEN 'PROCESSING'::pg_catalog.text
				ELSE 'DONE'::pg_catalog.text END AS state,
		   k.token, k.status, k.lease_until, k.expires_at,
		   pg_catalog.octet_length(k.body) AS body_size
	  FROM idem.keys k;
REVOKE ALL ON @extschema@.idem_keys FROM PUBLIC;

/*
 * pg_dump: the keys whose retention window is not over when the dump
 * starts (DONE and committed PROCESSING ones), and the token sequence, so
 * that tokens after a restore stay greater than every restored one.
 * Expired rows are left out: they are dead (idem_begin treats their keys
 * as new, purge deletes them) and their bodies are past the retention
 * they were stored for.  pg_dump runs with an empty search_path, hence
 * the qualified operator and function.
 */
SELECT pg_catalog.pg_extension_config_dump('idem.keys',
	'WHERE expires_at OPERATOR(pg_catalog.>) pg_catalog.now()');
SELECT pg_catalog.pg_extension_config_dump('idem.token_seq', '');
