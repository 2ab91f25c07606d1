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
			   ELSE pg_catalog.pg_get_userbyid(claimed_by)::pg_catalog.text END,
	/* recovery points (idem_checkpoint): not indexed, so a checkpoint is HOT */
	ADD COLUMN phase pg_catalog.text,
	ADD COLUMN phase_data pg_catalog.bytea;

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
 * idem_stats() gains not_stored (responses larger than idem.max_body_size,
 * for which idem_complete stored the fixed "Response not stored" answer),
 * evictions, force_releases, waits, the time of claims, replays,
 * completions and waits, and stats_reset.
 * It is bound to the C function of its result type, as pg_stat_statements
 * binds one per API version; the symbols idem_stats and idem_stats_1_3
 * stay for databases not yet updated.  As in the update to 1.3, the
 * function and its view are created again, the privileges administrators
 * granted on them are granted again, and their initial privileges are
 * the owner's alone.
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

/*
 * idem_begin gains wait_for: a duplicate of a request whose claim is
 * committed and still running waits for its result (a replay), its
 * release or the end of its lease (a claim), at most wait_for, instead of
 * being told the key is in flight.  A trailing parameter with a default,
 * so every call of idem_begin stays as it is; its signature changes, so
 * the function is dropped and created again, and the privileges
 * administrators granted on it are granted again on the new one, after
 * anything the default privileges of the role running the update gave
 * it is revoked.  Its initial privileges are set to the owner's alone, as
 * CREATE EXTENSION records them, so that pg_dump dumps the grants.  A
 * role's name is its regrole text, already quoted where it needs to be.
 */
DO $$
DECLARE
	func_acl	pg_catalog.aclitem[];
	r			record;
BEGIN
	SELECT p.proacl INTO func_acl FROM pg_catalog.pg_proc p
	 WHERE p.oid OPERATOR(pg_catalog.=)
		   '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool)'::pg_catalog.regprocedure;

	DROP FUNCTION @extschema@.idem_begin(pg_catalog.text, pg_catalog.text,
		pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool);

	CREATE FUNCTION @extschema@.idem_begin(key pg_catalog.text, fingerprint pg_catalog.text,
										   lease pg_catalog.interval DEFAULT NULL,
										   retention pg_catalog.interval DEFAULT NULL,
										   scope pg_catalog.text DEFAULT '',
										   wait pg_catalog.bool DEFAULT true,
										   wait_for pg_catalog.interval DEFAULT NULL)
	RETURNS TABLE (claimed pg_catalog.bool, state pg_catalog.text, token pg_catalog.int8,
				   status pg_catalog.int4, body pg_catalog.bytea,
				   lease_until pg_catalog.timestamptz, expires_at pg_catalog.timestamptz,
				   phase pg_catalog.text, phase_data pg_catalog.bytea)
	AS 'MODULE_PATHNAME', 'idem_begin'
	LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

	FOR r IN
		SELECT a.grantee
		  FROM pg_catalog.pg_proc p
		 CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) a
		 WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval)'::pg_catalog.regprocedure
		   AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
		   AND a.grantee OPERATOR(pg_catalog.<>) 0
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM %s CASCADE',
			'@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval)'::pg_catalog.regprocedure,
			r.grantee::pg_catalog.regrole::pg_catalog.text);
	END LOOP;
	REVOKE ALL ON FUNCTION @extschema@.idem_begin(pg_catalog.text, pg_catalog.text,
		pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool,
		pg_catalog.interval) FROM PUBLIC;

	FOR r IN SELECT a.* FROM pg_catalog.aclexplode(func_acl) a
	LOOP
		CONTINUE WHEN r.grantee OPERATOR(pg_catalog.=) r.grantor;
		EXECUTE pg_catalog.format('GRANT %s ON FUNCTION %s TO %s%s', r.privilege_type,
			'@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval)'::pg_catalog.regprocedure,
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
   AND p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_begin(pg_catalog.text, pg_catalog.text, pg_catalog.interval, pg_catalog.interval, pg_catalog.text, pg_catalog.bool, pg_catalog.interval)'::pg_catalog.regprocedure;

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
		('@extschema@.idem_begin(text, text, interval, interval, text, boolean, interval)', 1, 5),
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

/* Who waits for what: idem_waits() and its view. */
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
 * The new functions and view are owner-only, as in a fresh install:
 * PUBLIC's EXECUTE, and whatever the default privileges of the role
 * running the update gave them, is revoked.
 */
REVOKE ALL ON FUNCTION
	@extschema@.idem_checkpoint(pg_catalog.text, pg_catalog.int8, pg_catalog.text,
								pg_catalog.bytea, pg_catalog.text),
	@extschema@.idem_hold(pg_catalog.text, pg_catalog.int8, pg_catalog.text),
	@extschema@.idem_evict(pg_catalog.text, pg_catalog.text),
	@extschema@.idem_force_release(pg_catalog.text, pg_catalog.text, pg_catalog.text),
	@extschema@.idem_stalled(pg_catalog.interval),
	@extschema@.idem_waits()
FROM PUBLIC;
REVOKE ALL ON @extschema@.idem_waits FROM PUBLIC;

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
						'@extschema@.idem_checkpoint(pg_catalog.text, pg_catalog.int8, pg_catalog.text, pg_catalog.bytea, pg_catalog.text)'::pg_catalog.regprocedure,
						'@extschema@.idem_hold(pg_catalog.text, pg_catalog.int8, pg_catalog.text)'::pg_catalog.regprocedure,
						'@extschema@.idem_evict(pg_catalog.text, pg_catalog.text)'::pg_catalog.regprocedure,
						'@extschema@.idem_force_release(pg_catalog.text, pg_catalog.text, pg_catalog.text)'::pg_catalog.regprocedure,
						'@extschema@.idem_stalled(pg_catalog.interval)'::pg_catalog.regprocedure,
						'@extschema@.idem_waits()'::pg_catalog.regprocedure]::pg_catalog.oid[])
				UNION ALL
				SELECT 'TABLE @extschema@.idem_waits', c.relowner, c.relacl
				  FROM pg_catalog.pg_class c
				 WHERE c.oid OPERATOR(pg_catalog.=) '@extschema@.idem_waits'::pg_catalog.regclass) o
		 CROSS JOIN LATERAL pg_catalog.aclexplode(o.acl) a
		 WHERE a.grantee OPERATOR(pg_catalog.<>) o.owner
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM %s CASCADE', r.object,
			CASE WHEN r.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
				 ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END);
	END LOOP;
END
$$;
