/*
 * Citus: idem_distribute() (doc/citus.md).
 *
 * To be appended to the 1.1--1.2 update script.  Plain SQL; every name is
 * schema-qualified, and everything Citus provides is called through
 * dynamic SQL, so these functions are created on a server without Citus
 * too (where they refuse to run).
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
