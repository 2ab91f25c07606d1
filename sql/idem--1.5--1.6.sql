/* idem--1.5--1.6.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.6'" to load this file. \quit

/*
 * Tombstones: idem_begin(..., remember => interval) keeps a completed key
 * past its retention, without its response, until remember_until.  A
 * retry then answers EXPIRED (the stored status, no body) and never
 * executes again; purge drops the body when the retention ends and the
 * row when remember_until does.  A nullable column at the end: adding it
 * rewrites nothing, and rows in flight and completed keep their state
 * (NULL: no tombstone, as before).
 */
ALTER TABLE idem.keys ADD COLUMN remember_until pg_catalog.timestamptz;

/*
 * idem_begin gains a last argument, remember.  A new overload would make
 * every call that leaves out wait_for ambiguous, so idem_begin is dropped
 * and created again, and the privileges granted on it are granted again
 * on the new one (as the update to 1.5 does).  Objects of the database
 * that depend on idem_begin, a view over it say, would be dropped with
 * it; the update refuses instead and names them, and nothing is changed.
 */
DO $$
DECLARE
	sig			pg_catalog.text := '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval)';
	new_sig		pg_catalog.text := '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval, pg_catalog.interval)';
	old_acl		pg_catalog.aclitem[];
	owner		pg_catalog.oid;
	dependents	pg_catalog.text;
	r			record;
BEGIN
	SELECT p.proacl, p.proowner INTO old_acl, owner FROM pg_catalog.pg_proc p
	 WHERE p.oid OPERATOR(pg_catalog.=) sig::pg_catalog.regprocedure;

	SELECT pg_catalog.string_agg(DISTINCT COALESCE(
				pg_catalog.pg_describe_object('pg_catalog.pg_class'::pg_catalog.regclass, w.ev_class, 0),
				pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid)), ', ')
	  INTO dependents
	  FROM pg_catalog.pg_depend d
	  LEFT JOIN pg_catalog.pg_rewrite w
			 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
			AND w.oid OPERATOR(pg_catalog.=) d.objid
	 WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
	   AND d.refobjid OPERATOR(pg_catalog.=) sig::pg_catalog.regprocedure
	   AND d.deptype OPERATOR(pg_catalog.=) 'n';
	IF dependents IS NOT NULL THEN
		RAISE EXCEPTION USING
			ERRCODE = 'dependent_objects_still_exist',
			MESSAGE = 'cannot update idem to 1.6: other objects depend on function idem_begin',
			DETAIL = 'The update drops idem_begin and creates it again; it would drop: '
					 OPERATOR(pg_catalog.||) dependents OPERATOR(pg_catalog.||) '.',
			HINT = 'Drop them, run ALTER EXTENSION idem UPDATE, and create them again.';
	END IF;

	EXECUTE pg_catalog.format('DROP FUNCTION %s', sig::pg_catalog.regprocedure);
	CREATE FUNCTION @extschema@.idem_begin(key pg_catalog.text, fingerprint pg_catalog.text,
										   lease pg_catalog.interval DEFAULT NULL,
										   retention pg_catalog.interval DEFAULT NULL,
										   scope pg_catalog.text DEFAULT '',
										   wait pg_catalog.bool DEFAULT true,
										   wait_for pg_catalog.interval DEFAULT NULL,
										   remember pg_catalog.interval DEFAULT NULL)
	RETURNS SETOF idem.begin_result
	AS 'MODULE_PATHNAME', 'idem_begin'
	LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

	/*
	 * The new function has the privileges the defaults of the role running
	 * the update give it: revoke them, then grant what the old one had.
	 */
	FOR r IN
		SELECT DISTINCT a.grantee
		  FROM pg_catalog.pg_proc p
		 CROSS JOIN LATERAL pg_catalog.aclexplode(
				COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) a
		 WHERE p.oid OPERATOR(pg_catalog.=) new_sig::pg_catalog.regprocedure
		   AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM %s CASCADE',
			new_sig::pg_catalog.regprocedure,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END);
	END LOOP;
	FOR r IN SELECT a.*
			   FROM pg_catalog.aclexplode(COALESCE(old_acl, pg_catalog.acldefault('f', owner))) a
	LOOP
		CONTINUE WHEN r.grantee OPERATOR(pg_catalog.=) r.grantor;
		EXECUTE pg_catalog.format('GRANT %s ON FUNCTION %s TO %s%s', r.privilege_type,
			new_sig::pg_catalog.regprocedure,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END,
			CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
	END LOOP;

	/* The initial privileges: the owner's alone, as CREATE EXTENSION records them. */
	UPDATE pg_catalog.pg_init_privs i
	   SET initprivs = ARRAY[pg_catalog.makeaclitem(p.proowner, p.proowner, 'EXECUTE', false)]
	  FROM pg_catalog.pg_proc p
	 WHERE i.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
	   AND i.objoid OPERATOR(pg_catalog.=) p.oid
	   AND i.objsubid OPERATOR(pg_catalog.=) 0
	   AND p.oid OPERATOR(pg_catalog.=) new_sig::pg_catalog.regprocedure;
END
$$;

/*
 * The functions Citus delegates, with idem_begin's new signature (run
 * idem_distribute() again on a distributed idem.keys to register it).
 */
CREATE OR REPLACE FUNCTION @extschema@.idem_distributed_functions(
	OUT signature pg_catalog.regprocedure, OUT key_arg integer, OUT scope_arg integer)
RETURNS SETOF record
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog
AS $$
	SELECT f.signature::pg_catalog.regprocedure, f.key_arg, f.scope_arg
	  FROM (VALUES
		('@extschema@.idem_begin(text, text, interval, interval, text, boolean, interval, interval)', 1, 5),
		('@extschema@.idem_complete(text, text, integer, bytea, bigint, interval, text)', 1, 7),
		('@extschema@.idem_release(text, bigint, text)', 1, 3),
		('@extschema@.idem_extend(text, bigint, interval, text)', 1, 4),
		('@extschema@.idem_lookup(text, text)', 1, 2),
		('@extschema@.idem_evict(text, text)', 1, 2),
		('@extschema@.idem_force_release(text, text, text)', 1, 2),
		('@extschema@.idem_checkpoint(text, bigint, text, bytea, text)', 1, 5),
		('@extschema@.idem_hold(text, bigint, text)', 1, 3)
	  ) AS f(signature, key_arg, scope_arg)
$$;

/*
 * idem_keys shows a tombstone as EXPIRED (by idem's clock, from expires_at
 * until remember_until, as idem_begin answers it), and when it is
 * forgotten (remember_until, the last column).
 */
CREATE OR REPLACE VIEW @extschema@.idem_keys AS
	SELECT k.scope, k.key,
		   CASE WHEN k.status IS NULL THEN 'PROCESSING'::pg_catalog.text
				WHEN k.expires_at OPERATOR(pg_catalog.<=) c.now
				 AND c.now OPERATOR(pg_catalog.<) k.remember_until
				THEN 'EXPIRED'::pg_catalog.text
				ELSE 'DONE'::pg_catalog.text END AS state,
		   k.token, k.status, k.lease_until, k.expires_at,
		   pg_catalog.octet_length(k.body) AS body_size,
		   (SELECT r.oid FROM pg_catalog.pg_roles r
			 WHERE r.rolname OPERATOR(pg_catalog.=) k.claimed_by)::pg_catalog.regrole AS claimed_by,
		   k.remember_until
	  FROM idem.keys k,
		   LATERAL (SELECT pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
						   COALESCE(pg_catalog.current_setting('idem.clock_offset', true),
									'0')::pg_catalog.interval AS now) c;

/* pg_dump keeps the tombstones too. */
SELECT pg_catalog.pg_extension_config_dump('idem.keys',
	'WHERE expires_at OPERATOR(pg_catalog.>) pg_catalog.now() OR remember_until OPERATOR(pg_catalog.>) pg_catalog.now()');
