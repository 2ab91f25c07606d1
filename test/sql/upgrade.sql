--
-- Versions: keys stored under 1.0 survive ALTER EXTENSION idem UPDATE, and
-- CREATE EXTENSION idem gives the same objects and privileges as installing
-- 1.0 and updating; default privileges of the installing role do not leak
-- into the extension's objects.  Runs in databases of its own.
--
\set regress_db :DBNAME

-- A template with helpers, so that each database below has them.
CREATE DATABASE regress_idem_tpl;
\c regress_idem_tpl
CREATE FUNCTION try(q text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	EXECUTE q;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	RETURN SQLSTATE || ': ' || SQLERRM;
END $$;
-- Effective privileges of an object: "grantee:PRIVILEGE", * when
-- grantable, with the object's owner shown as "owner".  MAINTAIN (a table
-- privilege from PostgreSQL 17 on) is left out so that every version reads
-- alike.
CREATE FUNCTION acl_text(acl aclitem[], objtype "char", owner oid) RETURNS text
LANGUAGE sql AS $$
	SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC'
						   WHEN a.grantee = owner THEN 'owner'
						   ELSE a.grantee::regrole::text END
					  || ':' || a.privilege_type
					  || CASE WHEN a.is_grantable THEN '*' ELSE '' END,
					  ' ' ORDER BY 1)
	  FROM aclexplode(coalesce(acl, acldefault(objtype, owner))) a
	 WHERE a.privilege_type <> 'MAINTAIN'
$$;
-- A digest of the stored keys, their columns up to 1.2 (an update must
-- leave them byte for byte as they were).
CREATE FUNCTION rows_digest() RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	RETURN (SELECT md5(string_agg((scope, key, fingerprint, token, status, body,
								  lease_until, expires_at)::text, ',' ORDER BY scope, key))
			  FROM idem.keys);
END $$;
-- Every object of the extension (row types aside): its privileges, its
-- initial privileges as pg_dump compares them, and a description of its
-- definition.
CREATE FUNCTION ext_objects(OUT object text, OUT acl text, OUT init_acl text,
							OUT definition text)
RETURNS SETOF record LANGUAGE sql AS $$
	SELECT pg_describe_object(d.classid, d.objid, 0),
		   coalesce(acl_text(p.proacl, 'f', p.proowner),
					acl_text(c.relacl, CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char",
							 c.relowner),
					acl_text(n.nspacl, 'n', n.nspowner)),
		   CASE WHEN i.initprivs IS NOT NULL
				THEN acl_text(i.initprivs, 'r', coalesce(p.proowner, c.relowner, n.nspowner))
		   END,
		   concat_ws(' | ',
					 pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
					 p.provolatile, p.proparallel, p.prosecdef, p.proisstrict,
					 p.prorows, p.proconfig::text, p.prosrc, p.probin,
					 c.relkind, c.reloptions::text, pg_get_viewdef(c.oid),
					 (SELECT string_agg(format('%s %s %s %s %s', a.attname,
											   format_type(a.atttypid, a.atttypmod),
											   a.attnotnull, a.attcollation::regcollation,
											   pg_get_expr(ad.adbin, ad.adrelid)),
										', ' ORDER BY a.attnum)
						FROM pg_attribute a
						LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
					   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
					 (SELECT string_agg(pg_get_indexdef(x.indexrelid), ', ')
						FROM pg_index x WHERE x.indrelid = c.oid),
					 (SELECT format('%s %s %s %s %s', s.seqtypid::regtype, s.seqstart,
									s.seqincrement, s.seqmax, s.seqcache)
						FROM pg_sequence s WHERE s.seqrelid = c.oid))
	  FROM pg_depend d
	  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idem'
	  LEFT JOIN pg_proc p ON d.classid = 'pg_proc'::regclass AND p.oid = d.objid
	  LEFT JOIN pg_class c ON d.classid = 'pg_class'::regclass AND c.oid = d.objid
	  LEFT JOIN pg_namespace n ON d.classid = 'pg_namespace'::regclass AND n.oid = d.objid
	  LEFT JOIN pg_init_privs i ON i.classoid = d.classid AND i.objoid = d.objid AND i.objsubid = 0
	 WHERE d.deptype = 'e' AND d.classid <> 'pg_type'::regclass
	UNION ALL
	SELECT 'pg_dump filter ' || c::regclass, NULL, NULL, f
	  FROM pg_extension e, unnest(e.extconfig, e.extcondition) u(c, f)
	 WHERE e.extname = 'idem'
	ORDER BY 1
$$;
\c :regress_db
CREATE DATABASE regress_idem_v10 TEMPLATE regress_idem_tpl;
CREATE DATABASE regress_idem_v11 TEMPLATE regress_idem_tpl;
CREATE ROLE regress_idem_upgrade_app;

-- Version 1.0, with keys: a completed one, a claim in flight, a completed
-- one in another scope, and a claim given up (its token was used).
\c regress_idem_v10
CREATE EXTENSION idem VERSION '1.0';
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT to_regprocedure('idem_lookup(text,text)') AS lookup, to_regclass('idem_keys') AS keys_view;
SELECT token AS tok_done FROM idem_begin('u-done', 'fp-d', lease => '1 minute', retention => '2 hours') \gset
SELECT idem_complete('u-done', 'fp-d', 201, '\x00c3a9ff'::bytea, :tok_done) IS NOT NULL AS completed;
SELECT token AS tok_flight, lease_until AS lease_flight
  FROM idem_begin('u-flight', 'fp-f', lease => '10 minutes', retention => '2 hours') \gset
SELECT token AS tok_scoped FROM idem_begin('u-done', 'fp-d', scope => 'tenant-9') \gset
SELECT idem_complete('u-done', 'fp-d', 409, 'other tenant', :tok_scoped, scope => 'tenant-9') IS NOT NULL AS completed;
SELECT token AS tok_released FROM idem_begin('u-released', 'fp') \gset
SELECT idem_release('u-released', :tok_released) AS released;
SELECT :tok_done < :tok_flight AND :tok_flight < :tok_scoped AND :tok_scoped < :tok_released AS tokens_ascending;
SELECT rows_digest() AS rows_before \gset
-- Under 1.0 PUBLIC may call the claim functions; one application role was
-- also granted idem_begin explicitly.
GRANT EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean)
  TO regress_idem_upgrade_app;
SELECT has_function_privilege('public', 'idem_complete(text,text,integer,bytea,bigint,interval,text)', 'EXECUTE')
  AS public_may_complete;

-- The update.
ALTER EXTENSION idem UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idem';

-- The rows are untouched.
SELECT rows_digest() = :'rows_before' AS rows_unchanged,
       (SELECT count(claimed_by) FROM idem.keys) AS bound_to_a_role;
-- The completed keys replay their own responses, byte for byte.
SELECT scope, claimed, state, token, status, body
  FROM (VALUES (''), ('tenant-9')) s(scope),
       LATERAL idem_begin('u-done', 'fp-d', scope => s.scope)
 ORDER BY scope;
SELECT claimed, state, token, status, body FROM idem_begin('u-done', 'fp-other');
-- The claim made under 1.0 is still in flight, and its holder completes it
-- with the token it got from 1.0.
SELECT claimed, state, token, lease_until = :'lease_flight' AS same_lease
  FROM idem_begin('u-flight', 'fp-f');
SELECT idem_complete('u-flight', 'fp-f', 200, 'late', :tok_flight) IS NOT NULL AS completed;
SELECT state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('u-flight', 'fp-f');
-- Tokens continue above every token 1.0 gave out, the released one too.
SELECT claimed, token > :tok_released AS above_old_tokens
  FROM idem_begin('u-new', 'fp');
-- The new inspection function sees the old keys.
SELECT state, token = :tok_done AS same_token, status, body_size
  FROM idem_lookup('u-done');

-- Privileges after the update: PUBLIC may call nothing; the explicit grant
-- is kept, so the application role may claim but not complete until it is
-- granted that too (doc/operations.md).
SELECT has_function_privilege('public', 'idem_complete(text,text,integer,bytea,bigint,interval,text)', 'EXECUTE')
  AS public_may_complete;
SET ROLE regress_idem_upgrade_app;
SELECT claimed, state FROM idem_begin('u-app', 'fp');
SELECT try($$SELECT idem_complete('u-app', 'fp', 200, 'x')$$);
RESET ROLE;
-- pg_dump dumps the difference between privileges and initial privileges:
-- the grant made before the update is not an initial one, so a dump keeps
-- it.
SELECT object, acl, init_acl FROM ext_objects() WHERE object LIKE 'function idem_begin(%';
REVOKE EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  FROM regress_idem_upgrade_app;
SELECT object, acl, init_acl FROM ext_objects() WHERE acl IS NOT NULL;

-- A fresh CREATE EXTENSION, which runs 1.0 and the update in one go.
\c regress_idem_v11
CREATE EXTENSION idem;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT object, acl, init_acl FROM ext_objects() WHERE acl IS NOT NULL;
-- What pg_dump dumps of the extension's tables (doc/operations.md).
SELECT object, definition AS filter FROM ext_objects() WHERE acl IS NULL;
SELECT md5(string_agg(concat_ws(' / ', object, acl, init_acl, definition), E'\n')) AS fresh
  FROM ext_objects() \gset

-- The updated database has the very same objects, privileges, initial
-- privileges and definitions.
\c regress_idem_v10
SELECT md5(string_agg(concat_ws(' / ', object, acl, init_acl, definition), E'\n')) = :'fresh'
       AS same_as_fresh
  FROM ext_objects();

-- Default privileges of the installing role do not leak into the
-- extension's objects.  A fresh install leaves every object owner-only.
\c :regress_db
CREATE ROLE regress_idem_reporting;
CREATE DATABASE regress_idem_defpriv TEMPLATE regress_idem_tpl;
CREATE DATABASE regress_idem_defpriv11 TEMPLATE regress_idem_tpl;
\c regress_idem_defpriv
ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO regress_idem_reporting;
ALTER DEFAULT PRIVILEGES GRANT USAGE, SELECT ON SEQUENCES TO regress_idem_reporting;
ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO regress_idem_reporting;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO regress_idem_reporting;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON TYPES TO regress_idem_reporting;
CREATE EXTENSION idem;
SELECT has_schema_privilege('regress_idem_reporting', 'idem', 'USAGE') AS schema_usage,
       has_table_privilege('regress_idem_reporting', 'idem.keys', 'SELECT') AS keys_select,
       has_sequence_privilege('regress_idem_reporting', 'idem.token_seq', 'SELECT') AS seq_select,
       has_table_privilege('regress_idem_reporting', 'idem_keys', 'SELECT') AS view_select,
       has_function_privilege('regress_idem_reporting',
                              'idem_begin(text,text,interval,interval,text,boolean,interval,interval,text)', 'EXECUTE') AS may_begin,
       has_type_privilege('regress_idem_reporting', 'idem.begin_result', 'USAGE') AS result_type_usage,
       has_type_privilege('regress_idem_reporting', 'idem.begin_many_result', 'USAGE') AS many_type_usage;
SELECT md5(string_agg(concat_ws(' / ', object, acl, init_acl, definition), E'\n')) = :'fresh'
       AS same_as_fresh
  FROM ext_objects();
-- An update from 1.1 installed under such defaults: the schema, the key
-- table and the token sequence become owner-only; grants on functions and
-- views, which administrators make on purpose, stay; a view the update
-- creates (idem_waits) is owner-only.
\c regress_idem_defpriv11
ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO regress_idem_reporting;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO regress_idem_reporting;
ALTER DEFAULT PRIVILEGES GRANT USAGE ON TYPES TO regress_idem_reporting;
CREATE EXTENSION idem VERSION '1.1';
GRANT EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean)
  TO regress_idem_upgrade_app;
SELECT has_table_privilege('regress_idem_reporting', 'idem.keys', 'SELECT') AS keys_select_before;
ALTER EXTENSION idem UPDATE;
SELECT has_schema_privilege('regress_idem_reporting', 'idem', 'USAGE') AS schema_usage,
       has_table_privilege('regress_idem_reporting', 'idem.keys', 'SELECT') AS keys_select,
       has_table_privilege('regress_idem_reporting', 'idem_keys', 'SELECT') AS view_select_kept,
       has_table_privilege('regress_idem_reporting', 'idem_waits', 'SELECT') AS new_view_select,
       has_function_privilege('regress_idem_upgrade_app',
                              'idem_begin(text,text,interval,interval,text,boolean,interval,interval,text)', 'EXECUTE') AS app_grant_kept,
       has_type_privilege('regress_idem_reporting', 'idem.begin_result', 'USAGE') AS result_type_usage,
       has_type_privilege('regress_idem_reporting', 'idem.begin_many_result', 'USAGE') AS many_type_usage;
SELECT indexdef FROM pg_indexes WHERE schemaname = 'idem' AND tablename = 'keys';

-- An update from 1.2: idem_stats() gains purge_start_failures, so it and
-- its view are created again; the grants made on them are kept and stay
-- out of the initial privileges (pg_dump keeps them).  A claim made under
-- 1.2 is bound to no role: another role with its token may still complete
-- it.  Claims made after the update are bound.
\c :regress_db
CREATE DATABASE regress_idem_v12 TEMPLATE regress_idem_tpl;
CREATE ROLE regress_idem_upgrade_ops;
\c regress_idem_v12
CREATE EXTENSION idem VERSION '1.2';
GRANT EXECUTE ON FUNCTION idem_stats() TO regress_idem_upgrade_ops WITH GRANT OPTION;
GRANT SELECT ON idem_stats, idem_keys TO regress_idem_upgrade_ops;
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean),
  idem_complete(text, text, integer, bytea, bigint, interval, text)
  TO regress_idem_upgrade_app;
SELECT token AS tok12 FROM idem_begin('u12-flight', 'fp', lease => '10 minutes') \gset
SELECT rows_digest() AS rows12 \gset
ALTER EXTENSION idem UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT rows_digest() = :'rows12' AS rows_unchanged,
       (SELECT count(claimed_by) FROM idem.keys) AS bound_to_a_role;
SELECT object, acl, init_acl FROM ext_objects()
 WHERE object LIKE '%idem_stats%' OR object LIKE '%idem_keys%';
SET ROLE regress_idem_upgrade_ops;
SELECT count(*) >= 0 AS ops_reads_stats, count(purge_start_failures) = count(*) AS has_start_failures
  FROM idem_stats;
SELECT key, state, claimed_by FROM idem_keys ORDER BY key;
RESET ROLE;
SET ROLE regress_idem_upgrade_app;
SELECT idem_complete('u12-flight', 'fp', 200, 'done', :tok12) IS NOT NULL AS unbound_claim_completed;
RESET ROLE;
SELECT token AS tok13 FROM idem_begin('u13-flight', 'fp', lease => '10 minutes') \gset
SET ROLE regress_idem_upgrade_app;
SELECT try(format($$SELECT idem_complete('u13-flight', 'fp', 200, 'x', %s)$$, :tok13));
RESET ROLE;
SELECT key, state, claimed_by = current_user::regrole AS bound_to_claimer FROM idem_keys ORDER BY key;
-- The same objects as a fresh install, grants aside.
SELECT md5(string_agg(concat_ws(' / ', object, definition), E'\n')) AS v12_defs FROM ext_objects() \gset
\c regress_idem_v11
SELECT md5(string_agg(concat_ws(' / ', object, definition), E'\n')) = :'v12_defs' AS same_as_fresh
  FROM ext_objects();

-- An update from 1.3: a claim names the role that made it instead of its
-- OID, also a role whose name needs quoting; a claim of a role dropped
-- before the update names none, so only a superuser can act on it.  A
-- claim made before 1.3 is bound to no role: a wrong token for it gets
-- ID003 whether it is smaller or greater than the right one, only a
-- superuser may extend it, and its token still completes it.
\c :regress_db
CREATE DATABASE regress_idem_v13 TEMPLATE regress_idem_tpl;
CREATE ROLE regress_idem_gone;
CREATE ROLE "Regress Idem Quoted";
\c regress_idem_v13
CREATE EXTENSION idem VERSION '1.2';
SELECT token AS tok_unbound FROM idem_begin('u-unbound', 'fp', lease => '10 minutes') \gset
ALTER EXTENSION idem UPDATE TO '1.3';
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean),
  idem_complete(text, text, integer, bytea, bigint, interval, text),
  idem_release(text, bigint, text), idem_extend(text, bigint, interval, text)
  TO regress_idem_gone, "Regress Idem Quoted", regress_idem_upgrade_app;
SET ROLE regress_idem_gone;
SELECT token AS tok_gone FROM idem_begin('u-gone', 'fp', lease => '10 minutes') \gset
SET ROLE "Regress Idem Quoted";
SELECT token AS tok_quoted FROM idem_begin('u-quoted', 'fp', lease => '10 minutes') \gset
RESET ROLE;
REVOKE ALL ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean),
  idem_complete(text, text, integer, bytea, bigint, interval, text),
  idem_release(text, bigint, text), idem_extend(text, bigint, interval, text)
  FROM regress_idem_gone;
DROP ROLE regress_idem_gone;
SELECT rows_digest() AS rows13 \gset
-- A checkpoint that reaches a table still in the 1.3 layout (a Citus shard
-- the update left unaltered) would store nothing: it is refused, naming
-- the update, and the key is left as it was.
CREATE FUNCTION pg_temp.checkpoint_13(text, bigint, text, bytea, text) RETURNS void
  AS 'idem', 'idem_checkpoint' LANGUAGE C;
SELECT pg_temp.checkpoint_13('u-unbound', :tok_unbound, 'reserved', 'x', '');
SELECT rows_digest() = :'rows13' AS checkpoint_wrote_nothing;
ALTER EXTENSION idem UPDATE TO '1.4';
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT rows_digest() = :'rows13' AS rows_unchanged;
SELECT k.key, quote_nullable(k.claimed_by) AS stored, v.claimed_by AS shown
  FROM idem.keys k JOIN idem_keys v USING (scope, key) ORDER BY key;
SET ROLE "Regress Idem Quoted";
SELECT idem_extend('u-quoted', :tok_quoted, '20 minutes') IS NOT NULL AS quoted_role_extends;
RESET ROLE;
SET ROLE regress_idem_upgrade_app;
SELECT try(format($$SELECT idem_complete('u-quoted', 'fp', 200, 'x', %s)$$, :tok_quoted));
SELECT try(format($$SELECT idem_complete('u-gone', 'fp', 200, 'x', %s)$$, :tok_gone));
SELECT try(format($$SELECT idem_release('u-unbound', %s)$$, :tok_unbound - 1));
SELECT try(format($$SELECT idem_release('u-unbound', %s)$$, :tok_unbound + 1));
SELECT try(format($$SELECT idem_extend('u-unbound', %s, '1 hour')$$, :tok_unbound));
SELECT idem_complete('u-unbound', 'fp', 200, 'done', :tok_unbound) IS NOT NULL AS unbound_claim_completed;
RESET ROLE;
SELECT idem_release('u-gone', :tok_gone) AS superuser_releases_gone;
-- New claims name their role.
SET ROLE regress_idem_upgrade_app;
SELECT claimed FROM idem_begin('u14', 'fp');
RESET ROLE;
SELECT claimed_by FROM idem.keys WHERE key = 'u14';

-- The update to 1.5: idem_begin returns the row type idem.begin_result,
-- with the same columns.  A view over idem_begin would be dropped with
-- it, so the update refuses, names the view and changes nothing.
CREATE VIEW begin_probe AS SELECT claimed, state FROM idem_begin('probe', 'fp');
SELECT rows_digest() AS rows14 \gset
\set SHOW_CONTEXT never
ALTER EXTENSION idem UPDATE TO '1.5';
\set SHOW_CONTEXT errors
SELECT extversion, pg_get_function_result('idem_begin(text,text,interval,interval,text,boolean,interval)'::regprocedure)
  FROM pg_extension WHERE extname = 'idem';
DROP VIEW begin_probe;
-- A statement prepared before the update runs after it, planned again
-- against the new function (the same result columns).
PREPARE begin_prepared(text) AS SELECT claimed, state, status, body FROM idem_begin($1, 'fp');
ALTER EXTENSION idem UPDATE TO '1.5';
EXECUTE begin_prepared('u-unbound');
DEALLOCATE begin_prepared;
SELECT extversion, pg_get_function_result('idem_begin(text,text,interval,interval,text,boolean,interval)'::regprocedure)
  FROM pg_extension WHERE extname = 'idem';
SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
 WHERE attrelid = 'idem.begin_result'::regclass AND attnum > 0 ORDER BY attnum;
-- The row type is the owner's alone, as after a fresh install (below):
-- calling idem_begin needs no privilege on it, and no other role can
-- make a column of it.
SELECT acl_text(t.typacl, 'T', t.typowner) AS acl, acl_text(i.initprivs, 'T', t.typowner) AS init_acl
  FROM pg_type t LEFT JOIN pg_init_privs i ON i.classoid = 'pg_type'::regclass AND i.objoid = t.oid
 WHERE t.oid = 'idem.begin_result'::regtype \gset type14_
SELECT :'type14_acl' AS acl, :'type14_init_acl' AS init_acl;
SELECT rows_digest() = :'rows14' AS rows_unchanged;
-- The grants on idem_begin are kept, also to a role whose name needs
-- quoting, and stay out of the initial privileges (pg_dump keeps them).
SELECT object, acl, init_acl FROM ext_objects() WHERE object LIKE 'function idem_begin(%';
-- Every call reads as before: the completed key replays, the claim in
-- flight is reported with its lease, a new key is claimed.
SET ROLE "Regress Idem Quoted";
SELECT claimed, state, token, status, body, lease_until IS NULL AS no_lease, phase, phase_data
  FROM idem_begin('u-unbound', 'fp');
SELECT claimed, state, token, lease_until > now() AS leased FROM idem_begin('u-quoted', 'fp', wait => false);
SELECT (idem_begin('u15', 'fp')).claimed;
RESET ROLE;

-- The update to 1.6, with rows in flight: idem.keys gains remember_until
-- and idem_begin a last argument, remember.  Before it, a call that
-- reaches a table still in the 1.5 layout (a Citus shard the update left
-- unaltered) with remember is refused, naming the update, and writes
-- nothing; without remember it works as before.
SELECT token AS tok_flight15 FROM idem_begin('u-flight15', 'fp', lease => '10 minutes') \gset
SELECT token AS tok_done15 FROM idem_begin('u-done15', 'fp') \gset
SELECT idem_complete('u-done15', 'fp', 201, 'made', :tok_done15) IS NOT NULL AS completed;
SELECT state, status, body FROM idem_begin('u-done15', 'fp') \gset done15_
SELECT rows_digest() AS rows15 \gset
CREATE FUNCTION pg_temp.begin_16(text, text, interval, interval, text, boolean, interval, interval)
  RETURNS SETOF idem.begin_result AS 'idem', 'idem_begin' LANGUAGE C;
SELECT * FROM pg_temp.begin_16('u-rem15', 'fp', NULL, '1 hour', '', true, NULL, '2 days');
SELECT claimed, state, token AS tok_plain15
  FROM pg_temp.begin_16('u-plain15', 'fp', NULL, NULL, '', true, NULL, NULL) \gset
SELECT :'claimed' AS claimed, :'state' AS state;
SELECT count(*) AS remembered FROM idem.keys WHERE key = 'u-rem15';
SELECT idem_release('u-plain15', :tok_plain15) AS released;
SELECT rows_digest() = :'rows15' AS rows_as_before;
-- A view over idem_begin is named and nothing changes, as for 1.5.
CREATE VIEW begin_probe AS SELECT claimed, state FROM idem_begin('probe', 'fp');
\set SHOW_CONTEXT never
ALTER EXTENSION idem UPDATE TO '1.6';
\set SHOW_CONTEXT errors
DROP VIEW begin_probe;
ALTER EXTENSION idem UPDATE TO '1.6';
SELECT extversion, pg_get_function_identity_arguments('idem_begin'::regproc)
  FROM pg_extension WHERE extname = 'idem';
SELECT rows_digest() = :'rows15' AS rows_unchanged,
       count(*) FILTER (WHERE remember_until IS NOT NULL) AS remembered
  FROM idem.keys;
-- The grants on idem_begin are kept, on the new signature.
SELECT object, acl, init_acl FROM ext_objects() WHERE object LIKE 'function idem_begin(%';
-- The completed row reads as before (a replay, not EXPIRED); the claim in
-- flight is still in flight and its holder completes it with its token.
SET ROLE "Regress Idem Quoted";
SELECT (state, status, body) = (:'done15_state', :'done15_status', :'done15_body'::bytea) AS same_replay
  FROM idem_begin('u-done15', 'fp');
SELECT state, claimed FROM idem_begin('u-done15', 'fp', remember => '2 days');
RESET ROLE;
SELECT claimed, state, token IS NULL AS no_token FROM idem_begin('u-flight15', 'fp', wait => false);
SELECT idem_complete('u-flight15', 'fp', 200, 'late', :tok_flight15) IS NOT NULL AS completed;
SELECT state, status, remember_until FROM idem_keys WHERE key IN ('u-flight15', 'u-done15') ORDER BY key;
-- New claims may be remembered.
SELECT claimed FROM idem_begin('u16', 'fp', retention => '1 hour', remember => '2 days');
SELECT remember_until - expires_at AS remembered_past_retention FROM idem.keys WHERE key = 'u16';

-- The update to 1.7, with a claim in flight: idem.keys gains holder and
-- idem_begin a last argument, holder.  Before it, a call with a holder
-- that reaches a table still in the 1.6 layout (a Citus shard the update
-- left unaltered) is refused, naming the update, and writes nothing.
SELECT token AS tok_flight16 FROM idem_begin('u-flight16', 'fp', lease => '10 minutes') \gset
SELECT rows_digest() AS rows16 \gset
CREATE FUNCTION pg_temp.begin_17(text, text, interval, interval, text, boolean, interval, interval, text)
  RETURNS SETOF idem.begin_result AS 'idem', 'idem_begin' LANGUAGE C;
SELECT * FROM pg_temp.begin_17('u-holder16', 'fp', NULL, NULL, '', true, NULL, NULL, 'run-1');
SELECT rows_digest() = :'rows16' AS rows_as_before;
-- A view over idem_begin is named and nothing changes, as for 1.6.
CREATE VIEW begin_probe AS SELECT claimed, state FROM idem_begin('probe', 'fp');
\set SHOW_CONTEXT never
ALTER EXTENSION idem UPDATE TO '1.7';
\set SHOW_CONTEXT errors
SELECT extversion FROM pg_extension WHERE extname = 'idem';
DROP VIEW begin_probe;
ALTER EXTENSION idem UPDATE TO '1.7';
SELECT extversion, pg_get_function_identity_arguments('idem_begin'::regproc)
  FROM pg_extension WHERE extname = 'idem';
SELECT rows_digest() = :'rows16' AS rows_unchanged, count(holder) AS with_holder
  FROM idem.keys;
-- The grants on idem_begin are kept, on the new signature; the batch
-- functions are the owner's alone, as in a fresh install.
SELECT object, acl, init_acl FROM ext_objects()
 WHERE object LIKE 'function idem_begin%' OR object LIKE 'function idem_complete_many%'
 ORDER BY object;
SELECT has_type_privilege('public', 'idem.begin_many_result', 'USAGE') AS public_may_use_type;
-- The claim made under 1.6 has no holder: a caller with one finds it in
-- flight, and its holder completes it with its token.
SELECT claimed, state FROM idem_begin('u-flight16', 'fp', wait => false, holder => 'run-1');
SELECT idem_complete('u-flight16', 'fp', 200, 'late', :tok_flight16) IS NOT NULL AS completed;
-- New claims record their holder; batches work on the updated table.
SELECT ordinality, claimed, state FROM idem_begin_many(ARRAY['u17-b', 'u17-a'], ARRAY['fp', 'fp'],
                                                       holder => 'run-2');
SELECT key, holder FROM idem.keys WHERE key LIKE 'u17-%' ORDER BY key;
-- The same objects as a fresh install, grants aside.
SELECT md5(string_agg(concat_ws(' / ', object, definition), E'\n')) AS v13_defs FROM ext_objects() \gset
\c regress_idem_v11
SELECT md5(string_agg(concat_ws(' / ', object, definition), E'\n')) = :'v13_defs' AS same_as_fresh
  FROM ext_objects();
SELECT acl_text(t.typacl, 'T', t.typowner) = :'type14_acl' AS same_type_acl,
       acl_text(i.initprivs, 'T', t.typowner) = :'type14_init_acl' AS same_type_init_acl
  FROM pg_type t LEFT JOIN pg_init_privs i ON i.classoid = 'pg_type'::regclass AND i.objoid = t.oid
 WHERE t.oid = 'idem.begin_result'::regtype;
\c regress_idem_v13
CREATE EXTENSION amcheck;
SELECT bt_index_check('idem.keys_pkey', true);
\c :regress_db
DROP DATABASE regress_idem_v13;
DROP ROLE "Regress Idem Quoted";

-- The keys written through idem's direct heap path into the 1.0 and 1.2
-- table shapes and after their updates each have their primary key entry
-- (amcheck, with the heap check).
\c regress_idem_v10
CREATE EXTENSION amcheck;
SELECT bt_index_check('idem.keys_pkey', true);
\c regress_idem_v12
CREATE EXTENSION amcheck;
SELECT bt_index_check('idem.keys_pkey', true);

\c :regress_db
DROP DATABASE regress_idem_v12;
DROP ROLE regress_idem_upgrade_ops;
DROP DATABASE regress_idem_v10;
DROP DATABASE regress_idem_v11;
DROP DATABASE regress_idem_defpriv;
DROP DATABASE regress_idem_defpriv11;
DROP DATABASE regress_idem_tpl;
DROP ROLE regress_idem_upgrade_app;
DROP ROLE regress_idem_reporting;
