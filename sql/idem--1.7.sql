/* idem--1.7.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idem" to load this file. \quit

/*
 * Version 1.7 in one script: what sql/idem--1.0.sql and the updates to
 * 1.7 make, for a fresh CREATE EXTENSION (test/sql/upgrade.sql checks that
 * both give the same objects, privileges and initial privileges).
 *
 * Every name below is schema-qualified (@extschema@, idem, pg_catalog), so
 * what this script creates does not depend on the search_path it runs
 * with.
 */

/*
 * The key table lives in a fixed schema owned by the extension; the SQL
 * interface lives in the schema the extension is created in.
 */
CREATE SCHEMA idem;
REVOKE ALL ON SCHEMA idem FROM PUBLIC;

/* Fencing tokens: one sequence, so a token never repeats for any key. */
CREATE SEQUENCE idem.token_seq AS pg_catalog.int8;

/*
 * One row per (scope, key).  The fingerprint is a SHA-256 digest of the
 * caller's text.  A row is DONE when status is set, PROCESSING otherwise.
 * claimed_by names the role that made the claim.  remember_until, if set,
 * keeps a completed key past expires_at as a tombstone (no body, no
 * recovery point, no claimant) that answers EXPIRED until then.  holder,
 * if set, is the caller's identity of the claim (idem_begin's holder):
 * the same holder takes a live claim over at once.  Keys compare bytewise
 * (C collation); the primary key leads with the key, so that most descent
 * steps are settled by one comparison.  The primary key is the only index,
 * and pages keep 10% free, so that storing a response (an UPDATE of
 * non-indexed columns) can be a HOT update; purge walks the table instead
 * of using an index on expires_at.
 */
CREATE TABLE idem.keys (
	scope		pg_catalog.text COLLATE pg_catalog."C" NOT NULL,
	key			pg_catalog.text COLLATE pg_catalog."C" NOT NULL,
	fingerprint	pg_catalog.bytea NOT NULL,
	token		pg_catalog.int8 NOT NULL,
	status		pg_catalog.int4,
	body		pg_catalog.bytea,
	lease_until	pg_catalog.timestamptz,
	expires_at	pg_catalog.timestamptz NOT NULL,
	claimed_by	pg_catalog.text COLLATE pg_catalog."C",
	phase		pg_catalog.text,
	phase_data	pg_catalog.bytea,
	remember_until pg_catalog.timestamptz,
	holder		pg_catalog.text,
	CONSTRAINT keys_pkey PRIMARY KEY (key, scope)
) WITH (fillfactor = 90);
REVOKE ALL ON idem.keys, idem.token_seq FROM PUBLIC;

/*
 * The row idem_begin returns.  A named row type rather than OUT
 * parameters: the executor takes a named type's descriptor from the type
 * cache, where OUT parameters are read back from the catalog row and a
 * descriptor is built column by column on every execution of a query
 * that calls the function.
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
 * Claim a key, replay its response, or report it in flight or in
 * conflict; with wait_for, a duplicate of a request whose claim is
 * committed and still running waits for its result, its release or the
 * end of its lease (at most wait_for) instead.  With remember, a completed
 * key is remembered past its retention, without its response, until
 * remember is over: a retry then answers EXPIRED.  With holder, a claim
 * records who holds it, and a later call of the same holder (same key and
 * fingerprint) takes it over at once, with a new token, instead of
 * answering it in flight.
 */
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

CREATE FUNCTION @extschema@.idem_complete(key pg_catalog.text, fingerprint pg_catalog.text,
										  status pg_catalog.int4, body pg_catalog.bytea,
										  token pg_catalog.int8 DEFAULT NULL,
										  retention pg_catalog.interval DEFAULT NULL,
										  scope pg_catalog.text DEFAULT '')
RETURNS pg_catalog.timestamptz
AS 'MODULE_PATHNAME', 'idem_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

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

CREATE FUNCTION @extschema@.idem_release(key pg_catalog.text, token pg_catalog.int8,
										 scope pg_catalog.text DEFAULT '')
RETURNS pg_catalog.bool
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_extend(key pg_catalog.text, token pg_catalog.int8,
										lease pg_catalog.interval,
										scope pg_catalog.text DEFAULT '')
RETURNS pg_catalog.timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * Recovery points and fenced business writes: a claim's holder stores the
 * last finished phase of its work and its output (idem_checkpoint), which
 * a takeover's idem_begin returns; idem_hold checks that the caller holds
 * the current claim and keeps the key's row locked FOR SHARE until the
 * transaction ends, so that a takeover waits and a superseded holder is
 * refused before its business writes.  Granted like idem_complete.
 */
CREATE FUNCTION @extschema@.idem_checkpoint(key pg_catalog.text, token pg_catalog.int8,
											phase pg_catalog.text,
											data pg_catalog.bytea DEFAULT NULL,
											scope pg_catalog.text DEFAULT '')
RETURNS void
AS 'MODULE_PATHNAME', 'idem_checkpoint'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_hold(key pg_catalog.text, token pg_catalog.int8,
									  scope pg_catalog.text DEFAULT '')
RETURNS void
AS 'MODULE_PATHNAME', 'idem_hold'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_purge(max_rows pg_catalog.int4 DEFAULT NULL)
RETURNS pg_catalog.int8
AS 'MODULE_PATHNAME', 'idem_purge'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/* Counters per database; needs shared_preload_libraries = 'idem'. */
CREATE FUNCTION @extschema@.idem_stats(
	OUT dbid pg_catalog.oid, OUT claims pg_catalog.int8,
	OUT takeovers pg_catalog.int8, OUT replays pg_catalog.int8,
	OUT in_flight pg_catalog.int8, OUT conflicts pg_catalog.int8,
	OUT completes pg_catalog.int8, OUT superseded pg_catalog.int8,
	OUT releases pg_catalog.int8, OUT purged_rows pg_catalog.int8,
	OUT purge_runs pg_catalog.int8, OUT last_purge pg_catalog.timestamptz,
	OUT last_purge_error pg_catalog.text,
	OUT purge_start_failures pg_catalog.int8,
	OUT not_stored pg_catalog.int8, OUT evictions pg_catalog.int8,
	OUT force_releases pg_catalog.int8, OUT waits pg_catalog.int8,
	OUT claim_time pg_catalog.float8, OUT replay_time pg_catalog.float8,
	OUT complete_time pg_catalog.float8, OUT wait_time pg_catalog.float8,
	OUT stats_reset pg_catalog.timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats_1_4'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE VIEW @extschema@.idem_stats AS
	SELECT d.datname, s.*
	  FROM @extschema@.idem_stats() s
	  LEFT JOIN pg_catalog.pg_database d
			 ON d.oid OPERATOR(pg_catalog.=) s.dbid;

CREATE FUNCTION @extschema@.idem_stats_reset()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_stats_reset'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

/*
 * The calls waiting for a key now, one row per waiting backend; needs
 * shared_preload_libraries = 'idem'.  kind 'transaction': waiting for the
 * transaction that is inserting, changing or deleting the key's row
 * (holder_xid, and holder_pid while it runs); kind 'result': waiting with
 * wait_for for the result of a committed claim (holder_token).  scope and
 * key are clipped to 64 bytes as in error messages.  scope, key and
 * holder_token are shown, as pg_stat_activity shows a query, to members
 * of pg_read_all_stats and to roles with the privileges of the waiting
 * session's user; to others they are NULL.
 */
CREATE FUNCTION @extschema@.idem_waits(
	OUT pid pg_catalog.int4, OUT dbid pg_catalog.oid,
	OUT scope pg_catalog.text, OUT key pg_catalog.text,
	OUT kind pg_catalog.text, OUT holder_pid pg_catalog.int4,
	OUT holder_xid pg_catalog.xid, OUT holder_token pg_catalog.int8,
	OUT waiting_since pg_catalog.timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_waits'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE VIEW @extschema@.idem_waits AS
	SELECT w.pid, d.datname, w.scope, w.key, w.kind, w.holder_pid,
		   w.holder_xid, w.holder_token, w.waiting_since
	  FROM @extschema@.idem_waits() w
	  LEFT JOIN pg_catalog.pg_database d
			 ON d.oid OPERATOR(pg_catalog.=) w.dbid;

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

/*
 * Every stored key with the columns of idem_lookup, the role that made the
 * claim (NULL once that role no longer exists) and when a tombstone is
 * forgotten; never the body.  A tombstone's state is EXPIRED.
 */
CREATE VIEW @extschema@.idem_keys AS
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

/*
 * Operator controls: drop the stored response of a completed key (its next
 * request executes), end a claim in flight without its token (logged with
 * the reason), and list the claims whose lease ended without a completion.
 * None shows a body; the owner grants them.
 */
CREATE FUNCTION @extschema@.idem_evict(key pg_catalog.text,
									   scope pg_catalog.text DEFAULT ''::pg_catalog.text)
RETURNS pg_catalog.bool
AS 'MODULE_PATHNAME', 'idem_evict'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_force_release(key pg_catalog.text,
											   scope pg_catalog.text,
											   reason pg_catalog.text)
RETURNS pg_catalog.bool
AS 'MODULE_PATHNAME', 'idem_force_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

/*
 * Runs as its owner, who may read idem.keys, so that a role granted
 * EXECUTE needs nothing else; "now" is idem's clock (idem.clock_offset).
 */
CREATE FUNCTION @extschema@.idem_stalled(
	older_than pg_catalog.interval DEFAULT '0'::pg_catalog.interval)
RETURNS TABLE (scope pg_catalog.text, key pg_catalog.text, token pg_catalog.int8,
			   lease_until pg_catalog.timestamptz, expires_at pg_catalog.timestamptz,
			   claimed_by pg_catalog.regrole, phase pg_catalog.text,
			   stalled_for pg_catalog.interval)
LANGUAGE sql VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog
AS $$
	SELECT k.scope, k.key, k.token, k.lease_until, k.expires_at,
		   (SELECT r.oid FROM pg_catalog.pg_roles r
			 WHERE r.rolname OPERATOR(pg_catalog.=) k.claimed_by)::pg_catalog.regrole,
		   k.phase, c.now OPERATOR(pg_catalog.-) k.lease_until
	  FROM idem.keys k,
		   (SELECT pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
				   COALESCE(pg_catalog.current_setting('idem.clock_offset', true),
							'0')::pg_catalog.interval AS now) c
	 WHERE k.status IS NULL
	   AND k.lease_until OPERATOR(pg_catalog.<=) (c.now OPERATOR(pg_catalog.-) older_than)
	   AND k.expires_at OPERATOR(pg_catalog.>) c.now
	 ORDER BY k.lease_until
$$;

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

/*
 * Privileges.  PUBLIC may call no function and read no view.  The
 * extension owner grants EXECUTE on idem_begin, idem_complete,
 * idem_release, idem_extend and the batch functions to application roles (doc/security.md);
 * purge, lookup, statistics, waits and the views are for the owner and
 * the roles it grants them to.
 */
REVOKE ALL ON FUNCTION
	@extschema@.idem_begin(pg_catalog.text, pg_catalog.text,
						   pg_catalog.interval, pg_catalog.interval,
						   pg_catalog.text, pg_catalog.bool, pg_catalog.interval,
						   pg_catalog.interval, pg_catalog.text),
	@extschema@.idem_begin_many(pg_catalog.text[], pg_catalog.text[],
								pg_catalog.interval, pg_catalog.interval,
								pg_catalog.text, pg_catalog.bool, pg_catalog.interval,
								pg_catalog.interval, pg_catalog.text),
	@extschema@.idem_complete_many(pg_catalog.text[], pg_catalog.text[],
								   pg_catalog.int4[], pg_catalog.bytea[],
								   pg_catalog.int8[], pg_catalog.interval,
								   pg_catalog.text),
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
	@extschema@.idem_stats_reset(),
	@extschema@.idem_waits(),
	@extschema@.idem_lookup(pg_catalog.text, pg_catalog.text),
	@extschema@.idem_checkpoint(pg_catalog.text, pg_catalog.int8, pg_catalog.text,
								pg_catalog.bytea, pg_catalog.text),
	@extschema@.idem_hold(pg_catalog.text, pg_catalog.int8, pg_catalog.text),
	@extschema@.idem_evict(pg_catalog.text, pg_catalog.text),
	@extschema@.idem_force_release(pg_catalog.text, pg_catalog.text, pg_catalog.text),
	@extschema@.idem_stalled(pg_catalog.interval),
	@extschema@.idem_distributed_functions(),
	@extschema@.idem_distribute(text, pg_catalog.regclass, integer)
FROM PUBLIC;
REVOKE ALL ON @extschema@.idem_stats, @extschema@.idem_waits,
	@extschema@.idem_keys FROM PUBLIC;
/*
 * Calling idem_begin needs no privilege on its row type; USAGE would let
 * a role store values of it in tables of its own, which the extension's
 * updates would then have to drop.
 */
REVOKE ALL ON TYPE idem.begin_result, idem.begin_many_result FROM PUBLIC;

/*
 * ALTER DEFAULT PRIVILEGES of the role that runs CREATE EXTENSION apply to
 * the objects this script creates (a GRANT SELECT ON TABLES to a
 * reporting role would let it read stored bodies).  Nobody but the owner
 * is meant to have a privilege on any of them: revoke whatever is there.
 * A role's name is its regrole text, which is already quoted where it
 * needs to be ("Reporting"): quoting it again would name another role, or
 * none.
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
				   WHEN d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass
				   THEN pg_catalog.format('TYPE %s', d.objid::pg_catalog.regtype)
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
		  LEFT JOIN pg_catalog.pg_type t
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass
				AND t.oid OPERATOR(pg_catalog.=) d.objid
		 CROSS JOIN LATERAL pg_catalog.aclexplode(
				COALESCE(n.nspacl, c.relacl, p.proacl, t.typacl)) a
		 WHERE e.extname OPERATOR(pg_catalog.=) 'idem'
		   AND d.deptype OPERATOR(pg_catalog.=) 'e'
		   AND a.grantee OPERATOR(pg_catalog.<>)
			   COALESCE(n.nspowner, c.relowner, p.proowner, t.typowner)
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
 * Without idem in shared_preload_libraries no background worker purges
 * expired keys: say so, and how to purge them on a schedule instead.  The
 * library knows whether it was preloaded (idem_stats() refuses with 55000
 * when it was not), which a parse of the setting's text would only guess.
 * A WARNING, not a NOTICE: CREATE EXTENSION runs its script with
 * client_min_messages at least WARNING, which would hide a NOTICE.
 */
DO $$
DECLARE
	purge_call pg_catalog.text;
BEGIN
	PERFORM pg_catalog.count(*) FROM @extschema@.idem_stats();
EXCEPTION WHEN object_not_in_prerequisite_state THEN
	SELECT pg_catalog.format('SELECT %I.idem_purge()', n.nspname) INTO purge_call
	  FROM pg_catalog.pg_extension e
	  JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) e.extnamespace
	 WHERE e.extname OPERATOR(pg_catalog.=) 'idem';
	RAISE WARNING 'idem is not in shared_preload_libraries: no background worker will purge expired keys'
		USING DETAIL = 'Expired keys stay in idem.keys until idem_purge() deletes them.',
			  HINT = pg_catalog.format('Add idem to shared_preload_libraries and restart the server, '
									   'or run %s every minute, from cron (psql -c) '
									   'or with pg_cron: SELECT cron.schedule(%L, %L, %L);',
									   purge_call, 'idem-purge', '* * * * *', purge_call);
END
$$;

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
	'WHERE expires_at OPERATOR(pg_catalog.>) pg_catalog.now() OR remember_until OPERATOR(pg_catalog.>) pg_catalog.now()');
SELECT pg_catalog.pg_extension_config_dump('idem.token_seq', '');
