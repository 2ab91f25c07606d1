/* idem--1.4--1.5.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.5'" to load this file. \quit

/*
 * idem_begin returns a named row type, idem.begin_result, instead of
 * declaring its columns as OUT parameters: the executor then takes the
 * result's descriptor from the type cache instead of building it from the
 * catalog on every execution.  The columns, their names, order and types,
 * and the arguments stay as they were, so every call reads the same.
 *
 * A function's result type cannot be changed in place, so idem_begin is
 * dropped and created again, and the privileges granted on it are granted
 * again on the new one (as the update to 1.4 does).  Objects of the
 * database that depend on idem_begin, a view over it say, would be
 * dropped with it; the update refuses instead and names them, and nothing
 * is changed.
 */
CREATE TYPE idem.begin_result AS (
	claimed		pg_catalog.bool,
	state		pg_catalog.text,
	token		pg_catalog.int8,
	status		pg_catalog.int4,
	body		pg_catalog.bytea,
	lease_until	pg_catalog.timestamptz,
	expires_at	pg_catalog.timestamptz,
	phase		pg_catalog.text,
	phase_data	pg_catalog.bytea
);

/*
 * Calling idem_begin needs no privilege on its row type; USAGE would let
 * a role store values of it in tables of its own, which later updates
 * would then have to drop.  The grants the defaults of the role running
 * the update made go too.
 */
REVOKE ALL ON TYPE idem.begin_result FROM PUBLIC;
DO $$
DECLARE
	r	record;
BEGIN
	FOR r IN
		SELECT a.grantee FROM pg_catalog.pg_type t
		 CROSS JOIN LATERAL pg_catalog.aclexplode(t.typacl) a
		 WHERE t.oid OPERATOR(pg_catalog.=) 'idem.begin_result'::pg_catalog.regtype
		   AND a.grantee OPERATOR(pg_catalog.<>) t.typowner
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON TYPE idem.begin_result FROM %s CASCADE',
			r.grantee::pg_catalog.regrole::pg_catalog.text);
	END LOOP;
END
$$;

DO $$
DECLARE
	sig			pg_catalog.text := '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval)';
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
			MESSAGE = 'cannot update idem to 1.5: other objects depend on function idem_begin',
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
										   wait_for pg_catalog.interval DEFAULT NULL)
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
		 WHERE p.oid OPERATOR(pg_catalog.=) sig::pg_catalog.regprocedure
		   AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM %s CASCADE',
			sig::pg_catalog.regprocedure,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END);
	END LOOP;
	FOR r IN SELECT a.*
			   FROM pg_catalog.aclexplode(COALESCE(old_acl, pg_catalog.acldefault('f', owner))) a
	LOOP
		CONTINUE WHEN r.grantee OPERATOR(pg_catalog.=) r.grantor;
		EXECUTE pg_catalog.format('GRANT %s ON FUNCTION %s TO %s%s', r.privilege_type,
			sig::pg_catalog.regprocedure,
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
	   AND p.oid OPERATOR(pg_catalog.=) sig::pg_catalog.regprocedure;
END
$$;
