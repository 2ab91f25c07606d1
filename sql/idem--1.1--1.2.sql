/* idem--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.2'" to load this file. \quit

/*
 * 1.2: the primary key leads with the key, idem_distribute() for Citus,
 * and the extension's objects are owner-only whatever default privileges
 * the installing role has.
 *
 * Every name below is schema-qualified, so what this script does does not
 * depend on the search_path it runs with.
 */

/*
 * The idem functions that take a key, with the position of their key and
 * of their scope argument: the arguments Citus delegates calls by.
 */
CREATE FUNCTION @extschema@.idem_distributed_functions(
	OUT signature pg_catalog.regprocedure, OUT key_arg integer, OUT scope_arg integer)
RETURNS SETOF record
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog
AS $$
	SELECT f.signature::pg_catalog.regprocedure, f.key_arg, f.scope_arg
	  FROM (VALUES
		('@extschema@.idem_begin(text, text, interval, interval, text, boolean)', 1, 5),
		('@extschema@.idem_complete(text, text, integer, bytea, bigint, interval, text)', 1, 7),
		('@extschema@.idem_release(text, bigint, text)', 1, 3),
		('@extschema@.idem_extend(text, bigint, interval, text)', 1, 4),
		('@extschema@.idem_lookup(text, text)', 1, 2)
	  ) AS f(signature, key_arg, scope_arg)
$$;

/*
 * Distribute idem.keys with Citus, on the coordinator: by the key (the
 * default), or by the scope, to colocate keys with tables distributed by
 * tenant.  colocate_with and shard_count are passed to
 * create_distributed_table().  Then every idem function that takes a key
 * is registered for delegation by that argument, colocated with
 * idem.keys, so that a call made as a statement of its own runs on the
 * node that holds the key's shard, also inside a transaction block.
 * Running it again with the same column does nothing more than register
 * the functions again.
 */
CREATE FUNCTION @extschema@.idem_distribute(
	"by" text DEFAULT 'key',
	colocate_with pg_catalog.regclass DEFAULT NULL,
	shard_count integer DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog
AS $$
DECLARE
	current text;
	f record;
BEGIN
	IF "by" IS NULL OR "by" NOT IN ('key', 'scope') THEN
		RAISE EXCEPTION 'by must be ''key'' or ''scope'', not %', coalesce(quote_literal("by"), 'NULL')
			USING ERRCODE = '22023';
	END IF;
	IF NOT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus') THEN
		RAISE EXCEPTION 'idem_distribute() needs the Citus extension'
			USING ERRCODE = '55000',
				  HINT = 'Run CREATE EXTENSION citus on the coordinator first.';
	END IF;
	EXECUTE $q$SELECT column_to_column_name(logicalrelid, partkey)
				 FROM pg_dist_partition WHERE logicalrelid = 'idem.keys'::regclass$q$
		INTO current;
	IF current IS NOT NULL AND current <> "by" THEN
		RAISE EXCEPTION 'idem.keys is already distributed by %', current
			USING ERRCODE = '55000',
				  HINT = 'idem cannot undistribute idem.keys yet (doc/citus.md).';
	END IF;
	IF current IS NULL THEN
		/*
		 * First, so that a purge starting meanwhile waits instead of
		 * deadlocking with the truncation below.
		 */
		LOCK TABLE idem.keys IN ACCESS EXCLUSIVE MODE;
		EXECUTE format('SELECT create_distributed_table(%L, %L, colocate_with => %L%s)',
					   'idem.keys', "by",
					   coalesce(colocate_with::text, 'default'),
					   CASE WHEN shard_count IS NULL THEN ''
							ELSE format(', shard_count => %s', shard_count) END);
		/* Keys stored before were copied into the shards: keep the table itself empty. */
		IF EXISTS (SELECT 1 FROM ONLY idem.keys) THEN
			EXECUTE $q$SELECT truncate_local_data_after_distributing_table('idem.keys')$q$;
		END IF;
	END IF;
	FOR f IN SELECT * FROM @extschema@.idem_distributed_functions() LOOP
		EXECUTE format('SELECT create_distributed_function(%L, %L, colocate_with => %L, force_delegation => true)',
					   f.signature::text,
					   '$' || CASE WHEN "by" = 'key' THEN f.key_arg ELSE f.scope_arg END,
					   'idem.keys');
	END LOOP;
END
$$;

REVOKE ALL ON FUNCTION @extschema@.idem_distributed_functions(),
	@extschema@.idem_distribute(text, pg_catalog.regclass, integer) FROM PUBLIC;

/*
 * Privileges.  ALTER DEFAULT PRIVILEGES of the role that runs CREATE
 * EXTENSION or ALTER EXTENSION UPDATE apply to the objects the scripts
 * create (a GRANT SELECT ON TABLES to a reporting role would let it read
 * stored bodies).  Nobody but the owner is ever meant to have a privilege
 * on the schema idem, its key table or its token sequence: revoke
 * whatever is there.  Objects that became members of the extension in
 * this transaction (all of them in a fresh install, the new functions in
 * an update; told by their pg_depend row, which a GRANT or REVOKE leaves
 * alone) cannot have been granted by an administrator yet: reset them to
 * the owner alone as well.
 * Grants that administrators made on older functions and views stay
 * (README, "Security").  A role's name is its regrole text, which is
 * already quoted where it needs to be ("Reporting"): quoting it again
 * would name another role, or none.
 */
DO $$
DECLARE
	r record;
BEGIN
	FOR r IN
		SELECT CASE
				   WHEN d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass
				   THEN pg_catalog.format('SCHEMA %I', n.nspname)
				   WHEN d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
				   THEN pg_catalog.format('FUNCTION %s', d.objid::pg_catalog.regprocedure)
				   WHEN c.relkind OPERATOR(pg_catalog.=) 'S'
				   THEN pg_catalog.format('SEQUENCE %s', d.objid::pg_catalog.regclass)
				   ELSE pg_catalog.format('TABLE %s', d.objid::pg_catalog.regclass)
			   END AS object,
			   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
					ELSE a.grantee::pg_catalog.regrole::pg_catalog.text
			   END AS grantee
		  FROM pg_catalog.pg_depend d
		  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid
		  LEFT JOIN pg_catalog.pg_namespace n
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass
				AND n.oid OPERATOR(pg_catalog.=) d.objid
		  LEFT JOIN pg_catalog.pg_class c
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
				AND c.oid OPERATOR(pg_catalog.=) d.objid
		  LEFT JOIN pg_catalog.pg_proc p
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
				AND p.oid OPERATOR(pg_catalog.=) d.objid
		 CROSS JOIN LATERAL pg_catalog.aclexplode(
				COALESCE(n.nspacl, c.relacl, p.proacl)) a
		 WHERE e.extname OPERATOR(pg_catalog.=) 'idem'
		   AND d.deptype OPERATOR(pg_catalog.=) 'e'
		   AND a.grantee OPERATOR(pg_catalog.<>)
			   COALESCE(n.nspowner, c.relowner, p.proowner)
		   AND (pg_catalog.age(d.xmin) OPERATOR(pg_catalog.=) 0
				OR n.nspname OPERATOR(pg_catalog.=) 'idem'
				OR d.objid OPERATOR(pg_catalog.=) 'idem.keys'::pg_catalog.regclass
				OR d.objid OPERATOR(pg_catalog.=) 'idem.token_seq'::pg_catalog.regclass)
		 GROUP BY 1, 2
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM %s CASCADE', r.object, r.grantee);
	END LOOP;
END
$$;

/*
 * The primary key on (key, scope) instead of (scope, key).  Most
 * applications use one scope, so a lookup compared two equal scopes at
 * every step of the descent before reaching the key; leading with the key
 * settles most steps with one comparison.  Rebuilding the index takes an
 * exclusive lock on idem.keys for as long as the build takes.
 */
ALTER TABLE idem.keys DROP CONSTRAINT keys_pkey;
ALTER TABLE idem.keys ADD CONSTRAINT keys_pkey PRIMARY KEY (key, scope);
