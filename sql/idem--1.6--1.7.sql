/* idem--1.6--1.7.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.7'" to load this file. \quit

/*
 * Re-entrant holders: idem_begin(..., holder => text) records an opaque
 * identity of the claim's holder (an execution id), and a later call with
 * the same key, fingerprint and holder takes a live claim over at once.
 * A nullable column at the end: adding it rewrites nothing, and stored
 * rows read NULL (a claim without a holder, as before).
 */
ALTER TABLE idem.keys ADD COLUMN holder pg_catalog.text;

/*
 * idem_begin gains a last argument, holder.  As in the update to 1.6, it
 * is dropped and created again with the privileges granted on it, and the
 * update refuses, naming them, if objects of the database depend on it.
 */
DO $$
DECLARE
	sig			pg_catalog.text := '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval, pg_catalog.interval)';
	new_sig		pg_catalog.text := '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval, pg_catalog.interval, pg_catalog.text)';
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
			MESSAGE = 'cannot update idem to 1.7: other objects depend on function idem_begin',
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
										   remember pg_catalog.interval DEFAULT NULL,
										   holder pg_catalog.text DEFAULT NULL)
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
 * Batches.  idem_begin_many claims many keys of one scope in one call, in
 * one order whatever the order of its input (the keys sorted bytewise), so
 * that two batches never deadlock; each item answers as idem_begin would,
 * a key repeated in the batch answers DUPLICATE (or CONFLICT for another
 * fingerprint) and names its first occurrence.  idem_complete_many stores
 * many responses in the same order, each as idem_complete would.
 */
CREATE TYPE idem.begin_many_result AS (
	ordinality	pg_catalog.int4,
	claimed		pg_catalog.bool,
	state		pg_catalog.text,
	token		pg_catalog.int8,
	status		pg_catalog.int4,
	body		pg_catalog.bytea,
	lease_until	pg_catalog.timestamptz,
	expires_at	pg_catalog.timestamptz,
	phase		pg_catalog.text,
	phase_data	pg_catalog.bytea,
	duplicate_of pg_catalog.int4
);

CREATE FUNCTION @extschema@.idem_begin_many(keys pg_catalog.text[],
											fingerprints pg_catalog.text[],
											lease pg_catalog.interval DEFAULT NULL,
											retention pg_catalog.interval DEFAULT NULL,
											scope pg_catalog.text DEFAULT '',
											wait pg_catalog.bool DEFAULT true,
											wait_for pg_catalog.interval DEFAULT NULL,
											remember pg_catalog.interval DEFAULT NULL,
											holder pg_catalog.text DEFAULT NULL)
RETURNS SETOF idem.begin_many_result
AS 'MODULE_PATHNAME', 'idem_begin_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

CREATE FUNCTION @extschema@.idem_complete_many(keys pg_catalog.text[],
											   fingerprints pg_catalog.text[],
											   statuses pg_catalog.int4[],
											   bodies pg_catalog.bytea[],
											   tokens pg_catalog.int8[] DEFAULT NULL,
											   retention pg_catalog.interval DEFAULT NULL,
											   scope pg_catalog.text DEFAULT '')
RETURNS TABLE (ordinality pg_catalog.int4, expires_at pg_catalog.timestamptz)
AS 'MODULE_PATHNAME', 'idem_complete_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 100;

/*
 * The new functions and type are owner-only, as in a fresh install:
 * PUBLIC's privileges, and whatever the default privileges of the role
 * running the update gave them, are revoked.  The extension owner grants
 * EXECUTE on the batch functions to the roles that call idem_begin.
 */
REVOKE ALL ON FUNCTION
	@extschema@.idem_begin_many(pg_catalog.text[], pg_catalog.text[],
								pg_catalog.interval, pg_catalog.interval,
								pg_catalog.text, pg_catalog.bool, pg_catalog.interval,
								pg_catalog.interval, pg_catalog.text),
	@extschema@.idem_complete_many(pg_catalog.text[], pg_catalog.text[],
								   pg_catalog.int4[], pg_catalog.bytea[],
								   pg_catalog.int8[], pg_catalog.interval,
								   pg_catalog.text)
FROM PUBLIC;
REVOKE ALL ON TYPE idem.begin_many_result FROM PUBLIC;

DO $$
DECLARE
	r			record;
BEGIN
	FOR r IN
		SELECT o.object, a.grantee
		  FROM (SELECT 'FUNCTION ' OPERATOR(pg_catalog.||) p.oid::pg_catalog.regprocedure::pg_catalog.text AS object,
					   p.proowner AS owner, p.proacl AS acl
				  FROM pg_catalog.pg_proc p
				 WHERE p.oid OPERATOR(pg_catalog.=) ANY (ARRAY[
						'@extschema@.idem_begin_many(pg_catalog.text[], pg_catalog.text[], pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval, pg_catalog.interval, pg_catalog.text)'::pg_catalog.regprocedure,
						'@extschema@.idem_complete_many(pg_catalog.text[], pg_catalog.text[], pg_catalog.int4[], pg_catalog.bytea[], pg_catalog.int8[], pg_catalog.interval, pg_catalog.text)'::pg_catalog.regprocedure]::pg_catalog.oid[])
				UNION ALL
				SELECT 'TYPE idem.begin_many_result', t.typowner, t.typacl
				  FROM pg_catalog.pg_type t
				 WHERE t.oid OPERATOR(pg_catalog.=) 'idem.begin_many_result'::pg_catalog.regtype) o
		 CROSS JOIN LATERAL pg_catalog.aclexplode(o.acl) a
		 WHERE a.grantee OPERATOR(pg_catalog.<>) o.owner
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM %s CASCADE', r.object,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END);
	END LOOP;
END
$$;

/*
 * The functions Citus delegates, with idem_begin's new signature (run
 * idem_distribute() again on a distributed idem.keys to register it).
 * The batch functions take many keys and are not delegated.
 */
CREATE OR REPLACE FUNCTION @extschema@.idem_distributed_functions(
	OUT signature pg_catalog.regprocedure, OUT key_arg integer, OUT scope_arg integer)
RETURNS SETOF record
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog
AS $$
	SELECT f.signature::pg_catalog.regprocedure, f.key_arg, f.scope_arg
	  FROM (VALUES
		('@extschema@.idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)', 1, 5),
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
