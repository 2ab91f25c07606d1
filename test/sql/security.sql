--
-- search_path safety and privileges (doc/security.md).  Uses try() and
-- key_row() from setup.sql.
--

--
-- search_path: a hostile role puts look-alikes of what idem's statements
-- use (operators on text, bytea, bigint, timestamptz and tid, the clock,
-- nextval, sha256, digest, greatest, octet_length, count, a "keys" table
-- and a "token_seq" sequence) in a schema that comes before pg_catalog on
-- search_path.  Each look-alike records in regress_hostile.ran that it ran
-- and gives a wrong answer.  idem's answers stay right and nothing is
-- recorded.  Nothing before this point of the session has called idem, so
-- its statements are first prepared under the hostile search_path.
--
CREATE ROLE regress_idem_hostile;
CREATE SCHEMA regress_hostile AUTHORIZATION regress_idem_hostile;
GRANT USAGE ON SCHEMA regress_hostile TO PUBLIC;
SET ROLE regress_idem_hostile;
CREATE TABLE regress_hostile.ran (what text, by_role name DEFAULT current_user);
GRANT INSERT, SELECT ON regress_hostile.ran TO PUBLIC;
CREATE FUNCTION regress_hostile.note(what text) RETURNS void LANGUAGE sql
  AS $$ INSERT INTO regress_hostile.ran (what) VALUES (what) $$;

CREATE FUNCTION regress_hostile.eq(a text, b text) RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('text = text'); RETURN true; END $$;
CREATE OPERATOR regress_hostile.= (LEFTARG = text, RIGHTARG = text, FUNCTION = regress_hostile.eq);
CREATE FUNCTION regress_hostile.eq(a bytea, b bytea) RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('bytea = bytea'); RETURN true; END $$;
CREATE OPERATOR regress_hostile.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = regress_hostile.eq);
CREATE FUNCTION regress_hostile.eq(a bigint, b bigint) RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('bigint = bigint'); RETURN true; END $$;
CREATE OPERATOR regress_hostile.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = regress_hostile.eq);
CREATE FUNCTION regress_hostile.eq(a tid, b tid) RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('tid = tid'); RETURN true; END $$;
CREATE OPERATOR regress_hostile.= (LEFTARG = tid, RIGHTARG = tid, FUNCTION = regress_hostile.eq);
CREATE FUNCTION regress_hostile.gt(a timestamptz, b timestamptz) RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('timestamptz > timestamptz'); RETURN a <= b; END $$;
CREATE OPERATOR regress_hostile.> (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = regress_hostile.gt);
CREATE FUNCTION regress_hostile.le(a timestamptz, b timestamptz) RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('timestamptz <= timestamptz'); RETURN true; END $$;
CREATE OPERATOR regress_hostile.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = regress_hostile.le);
CREATE FUNCTION regress_hostile.clock_timestamp() RETURNS timestamptz LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('clock_timestamp'); RETURN '2000-01-01'; END $$;
CREATE FUNCTION regress_hostile.now() RETURNS timestamptz LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('now'); RETURN '2000-01-01'; END $$;
CREATE FUNCTION regress_hostile.nextval(regclass) RETURNS bigint LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('nextval(regclass)'); RETURN 1; END $$;
CREATE FUNCTION regress_hostile.nextval(text) RETURNS bigint LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('nextval(text)'); RETURN 1; END $$;
CREATE FUNCTION regress_hostile.sha256(bytea) RETURNS bytea LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('sha256'); RETURN '\x00'; END $$;
CREATE FUNCTION regress_hostile.digest(text, text) RETURNS bytea LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('digest(text, text)'); RETURN '\x00'; END $$;
CREATE FUNCTION regress_hostile.digest(bytea, text) RETURNS bytea LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('digest(bytea, text)'); RETURN '\x00'; END $$;
CREATE FUNCTION regress_hostile."greatest"(timestamptz, timestamptz) RETURNS timestamptz LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('greatest'); RETURN '2000-01-01'; END $$;
CREATE FUNCTION regress_hostile.octet_length(bytea) RETURNS integer LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('octet_length'); RETURN -1; END $$;
CREATE FUNCTION regress_hostile.count_step(bigint) RETURNS bigint LANGUAGE plpgsql
  AS $$ BEGIN PERFORM regress_hostile.note('count(*)'); RETURN -1; END $$;
CREATE AGGREGATE regress_hostile.count(*) (SFUNC = regress_hostile.count_step, STYPE = bigint, INITCOND = '0');
-- A keys table and a token sequence, in the schema and as temporary
-- objects (pg_temp comes first for tables).
CREATE TABLE regress_hostile.keys (scope text, key text, fingerprint bytea, token bigint,
  status integer, body bytea, lease_until timestamptz, expires_at timestamptz);
CREATE SEQUENCE regress_hostile.token_seq START 1000000000000;
GRANT ALL ON regress_hostile.keys, regress_hostile.token_seq TO PUBLIC;
RESET ROLE;
CREATE TEMP TABLE keys (LIKE idem.keys);
CREATE TEMP SEQUENCE token_seq START 2000000000000;

-- The look-alikes work: unqualified SQL under this search_path runs them.
SET search_path = regress_hostile, pg_catalog, public;
SELECT 'a'::text = 'b'::text AS text_eq, '\x01'::bytea = '\x02'::bytea AS bytea_eq,
       clock_timestamp() AS clock, nextval('token_seq') AS nextval,
       sha256('x') AS sha256, octet_length('\x0102'::bytea) AS octet_length;
SELECT what FROM ran ORDER BY what COLLATE "C";
RESET search_path;
TRUNCATE regress_hostile.ran;

-- The key table's last token, and the clock, before the calls.
SELECT last_value AS tok0 FROM idem.token_seq \gset
SELECT clock_timestamp() AS t0 \gset

-- idem under the hostile search_path: a claim, the same key in another
-- scope, in flight, a conflict, extend, complete, replay, lookup, the
-- views, release, and purge of a key whose window is over.
SET search_path = regress_hostile, pg_catalog, public;
SELECT claimed AS h_claimed, state AS h_state, token AS h_tok, lease_until AS h_lease,
       expires_at AS h_exp
  FROM idem_begin('h-key', 'fp', lease => '1 minute', retention => '1 hour', scope => 'h') \gset
SELECT claimed AS h2_claimed, token AS h2_tok
  FROM idem_begin('h-key', 'fp', lease => '1 minute', retention => '1 hour', scope => 'h2') \gset
SELECT claimed AS fl_claimed, state AS fl_state, token IS NULL AS fl_no_token
  FROM idem_begin('h-key', 'fp', scope => 'h') \gset
SELECT claimed AS cf_claimed, state AS cf_state
  FROM idem_begin('h-key', 'other-fp', scope => 'h') \gset
SELECT idem_extend('h-key', :h_tok, '2 minutes', scope => 'h') AS h_extended \gset
SELECT idem_complete('h-key', 'fp', 201, 'right answer', :h_tok, scope => 'h') AS h_done_exp \gset
SELECT claimed AS rp_claimed, state AS rp_state, status AS rp_status, body AS rp_body
  FROM idem_begin('h-key', 'fp', scope => 'h') \gset
SELECT state AS lk_state, token AS lk_token, body_size AS lk_size FROM idem_lookup('h-key', 'h') \gset
SELECT state AS vw_state, body_size AS vw_size
  FROM idem_keys WHERE scope OPERATOR(pg_catalog.=) 'h' AND key OPERATOR(pg_catalog.=) 'h-key' \gset
SELECT datname IS NOT NULL AS stats_named
  FROM idem_stats WHERE dbid OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database
                                                     WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) \gset
SELECT idem_release('h-key', :h2_tok, scope => 'h2') AS h2_released \gset
SET idem.clock_offset = '-2h';
SELECT claimed AS old_claimed FROM idem_begin('h-old', 'fp', lease => '1 minute', retention => '1 hour', scope => 'h') \gset
RESET idem.clock_offset;
SELECT idem_purge() AS purged \gset
RESET search_path;
SELECT clock_timestamp() AS t1 \gset

-- Nothing hostile ran, and every answer is the right one.
SELECT count(*) AS hostile_calls FROM regress_hostile.ran;
SELECT :'h_claimed' AS claimed, :'h_state' AS state, :h_tok > :tok0 AS token_from_idem_seq,
       :'h_lease'::timestamptz BETWEEN :'t0'::timestamptz + interval '1 minute'
                                   AND :'t1'::timestamptz + interval '1 minute' AS lease_from_clock,
       :'h_exp'::timestamptz - :'h_lease'::timestamptz AS retention_minus_lease;
SELECT :'h2_claimed' AS other_scope_claimed, :h2_tok > :h_tok AS other_scope_token,
       :'fl_claimed' AS in_flight_claimed, :'fl_state' AS in_flight_state,
       :'fl_no_token' AS in_flight_no_token, :'cf_claimed' AS conflict_claimed,
       :'cf_state' AS conflict_state;
SELECT :'h_extended'::timestamptz BETWEEN :'t0'::timestamptz + interval '2 minutes'
                                      AND :'t1'::timestamptz + interval '2 minutes' AS extended,
       :'h_done_exp'::timestamptz = :'h_exp'::timestamptz AS completed_window;
SELECT :'rp_claimed' AS replay_claimed, :'rp_state' AS replay_state, :rp_status AS replay_status,
       convert_from(:'rp_body'::bytea, 'UTF8') AS replay_body,
       :'lk_state' AS lookup_state, :lk_token = :h_tok AS lookup_token, :lk_size AS lookup_size,
       :'vw_state' AS view_state, :vw_size AS view_size, :'stats_named' AS stats_named;
SELECT :'h2_released' AS released, :'old_claimed' AS old_claimed, :purged >= 1 AS purged;
-- The rows as stored: the real fingerprint digest, the real token; the
-- expired key is purged, the released one gone; the hostile tables are
-- untouched.
SELECT scope, key, fingerprint = sha256('fp'::bytea) AS digest_of_fp, token = :h_tok AS same_token,
       status, convert_from(body, 'UTF8') AS body
  FROM idem.keys WHERE scope IN ('h', 'h2') ORDER BY scope, key;
SELECT (SELECT count(*) FROM regress_hostile.keys) AS hostile_keys,
       (SELECT count(*) FROM pg_temp.keys) AS temp_keys,
       (SELECT is_called FROM regress_hostile.token_seq) AS hostile_seq_used,
       (SELECT is_called FROM pg_temp.token_seq) AS temp_seq_used;

-- The hostile role itself, with EXECUTE granted and its schema first on
-- its own search_path: the same.
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean, interval, interval, text),
  idem_complete(text, text, integer, bytea, bigint, interval, text)
  TO regress_idem_hostile;
SET ROLE regress_idem_hostile;
SET search_path = regress_hostile, pg_catalog, public;
SELECT claimed AS hr_claimed, token AS hr_tok FROM idem_begin('h-role', 'fp', scope => 'h') \gset
SELECT idem_complete('h-role', 'fp', 200, 'role answer', :hr_tok, scope => 'h') IS NOT NULL AS hr_completed \gset
SELECT state AS hr_state, status AS hr_status, body AS hr_body FROM idem_begin('h-role', 'fp', scope => 'h') \gset
SELECT state AS hr_cf_state FROM idem_begin('h-role', 'other', scope => 'h') \gset
RESET search_path;
RESET ROLE;
SELECT count(*) AS hostile_calls FROM regress_hostile.ran;
SELECT :'hr_claimed' AS claimed, :hr_tok > :h2_tok AS token_from_idem_seq, :'hr_completed' AS completed,
       :'hr_state' AS state, :hr_status AS status, convert_from(:'hr_body'::bytea, 'UTF8') AS body,
       :'hr_cf_state' AS other_fingerprint;
SELECT key, fingerprint = sha256('fp'::bytea) AS digest_of_fp, status FROM idem.keys
 WHERE scope = 'h' AND key = 'h-role';

DROP TABLE pg_temp.keys;
DROP SEQUENCE pg_temp.token_seq;
DROP SCHEMA regress_hostile CASCADE;
DROP OWNED BY regress_idem_hostile;
DROP ROLE regress_idem_hostile;

--
-- Privileges.  PUBLIC has none on any object of the extension.
--
SELECT pg_describe_object(d.classid, d.objid, 0) AS object,
       CASE d.classid
         WHEN 'pg_proc'::regclass THEN has_function_privilege('public', d.objid, 'EXECUTE')
         WHEN 'pg_namespace'::regclass THEN has_schema_privilege('public', d.objid, 'USAGE')
                                            OR has_schema_privilege('public', d.objid, 'CREATE')
         WHEN 'pg_class'::regclass THEN
           CASE WHEN (SELECT relkind FROM pg_class WHERE oid = d.objid) = 'S'
                THEN has_sequence_privilege('public', d.objid, 'USAGE, SELECT, UPDATE')
                ELSE has_table_privilege('public', d.objid,
                       'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')
           END
       END AS public_has_any
  FROM pg_depend d
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idem'
 WHERE d.deptype = 'e' AND d.classid <> 'pg_type'::regclass
 ORDER BY 1;

-- Roles: an application role the owner granted the four claim functions
-- with grant option; a role that application role passed two of them on
-- to; an operator granted purge, lookup and the views as README
-- "Security" describes; a role with no grant.
CREATE ROLE regress_idem_sec_app;
CREATE ROLE regress_idem_sec_sub;
CREATE ROLE regress_idem_sec_ops;
CREATE ROLE regress_idem_sec_none;
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean, interval, interval, text),
  idem_complete(text, text, integer, bytea, bigint, interval, text),
  idem_release(text, bigint, text),
  idem_extend(text, bigint, interval, text)
  TO regress_idem_sec_app WITH GRANT OPTION;
SET ROLE regress_idem_sec_app;
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean, interval, interval, text),
  idem_complete(text, text, integer, bytea, bigint, interval, text)
  TO regress_idem_sec_sub;
-- It cannot pass on what it was not granted.
SELECT try($$GRANT EXECUTE ON FUNCTION idem_purge(integer) TO regress_idem_sec_sub$$);
RESET ROLE;
GRANT EXECUTE ON FUNCTION idem_purge(integer), idem_lookup(text, text), idem_stats(),
  idem_waits()
  TO regress_idem_sec_ops;
GRANT SELECT ON idem_keys, idem_stats, idem_waits TO regress_idem_sec_ops;

-- Who may do what: 'ok' or the SQLSTATE.  Each call runs as the role in a
-- subtransaction that is rolled back, so nothing it stores stays (the
-- owner's idem_stats_reset does reset the counters: they are not
-- transactional).
CREATE FUNCTION try_as(r name, q text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	result text;
BEGIN
	BEGIN
		PERFORM set_config('role', r, true);
		EXECUTE q;
		result := 'ok';
		RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = 'undo';
	EXCEPTION WHEN OTHERS THEN
		IF result IS NULL THEN
			result := SQLSTATE;
		END IF;
	END;
	RETURN result;
END $$;
-- The live claim is the application role's.  Claims belong to the role
-- that made them (see below), so the other roles are refused completing it
-- even with EXECUTE; the role the grants were passed on to completes a
-- claim of its own after the table.
SET ROLE regress_idem_sec_app;
SELECT token AS tok FROM idem_begin('s-live', 'fp', lease => '10 minutes') \gset
RESET ROLE;
SELECT set_config('test.tok', :'tok', false) IS NOT NULL AS token_set;
SELECT key_row('', 's-live') AS row0 \gset
SELECT q AS call,
       try_as(current_user, q) AS owner,
       try_as('regress_idem_sec_app', q) AS app,
       try_as('regress_idem_sec_sub', q) AS sub,
       try_as('regress_idem_sec_ops', q) AS ops,
       try_as('regress_idem_sec_none', q) AS "none"
  FROM (VALUES
    ($$SELECT idem_begin('s-new', 'fp')$$),
    ($$SELECT idem_complete('s-live', 'fp', 200, 'x', current_setting('test.tok')::bigint)$$),
    ($$SELECT idem_extend('s-live', current_setting('test.tok')::bigint, '1 minute')$$),
    ($$SELECT idem_release('s-live', current_setting('test.tok')::bigint)$$),
    ($$SELECT idem_lookup('s-live')$$),
    ($$SELECT * FROM idem_keys$$),
    ($$SELECT idem_purge(0)$$),
    ($$SELECT * FROM idem_stats$$),
    ($$SELECT idem_stats()$$),
    ($$SELECT idem_stats_reset()$$),
    ($$SELECT * FROM idem_waits$$),
    ($$SELECT idem_waits()$$),
    ($$SELECT * FROM idem.keys$$),
    ($$SELECT nextval('idem.token_seq')$$),
    ($$SET idem.clock_offset = '1h'$$),
    ($$SET idem.max_body_size = '200MB'$$),
    ($$SET idem.max_retention = '100d'$$),
    ($$SET idem.max_key_length = 1024$$)
  ) t(q);
SELECT key_row('', 's-live') = :'row0' AS unchanged;
SET ROLE regress_idem_sec_sub;
SELECT token AS sub_tok FROM idem_begin('s-sub', 'fp') \gset
SELECT idem_complete('s-sub', 'fp', 200, 'sub', :sub_tok) IS NOT NULL AS sub_completed_own_claim;
RESET ROLE;
DELETE FROM idem.keys WHERE key = 's-sub';
-- A role without the grant gets 42501 and a message naming the function.
SET ROLE regress_idem_sec_none;
SELECT try($$SELECT idem_begin('s-none', 'fp')$$);
SELECT try($$SELECT idem_lookup('s-live')$$);
SELECT try($$SELECT * FROM idem_keys$$);
SELECT try($$SELECT * FROM idem_waits$$);
RESET ROLE;
SELECT count(*) AS none_stored FROM idem.keys WHERE key = 's-none';
-- The grants as catalogued.
SELECT r AS role, f AS function,
       has_function_privilege(r, f, 'EXECUTE') AS execute,
       has_function_privilege(r, f, 'EXECUTE WITH GRANT OPTION') AS grantable
  FROM unnest(ARRAY['regress_idem_sec_app', 'regress_idem_sec_sub']) r,
       unnest(ARRAY['idem_begin(text,text,interval,interval,text,boolean,interval,interval,text)',
                    'idem_release(text,bigint,text)',
                    'idem_purge(integer)']) f
 ORDER BY 1, 2;

-- An overload with varchar parameters in the extension's own schema (here
-- created by a superuser; any role with CREATE on that schema could) wins
-- over idem_begin(text, ...) for a call whose arguments are varchar, even
-- schema-qualified, so clients cast every argument to its exact type.
CREATE FUNCTION public.idem_begin(key varchar, fingerprint varchar,
                                  lease interval DEFAULT NULL, retention interval DEFAULT NULL,
                                  scope text DEFAULT '', wait boolean DEFAULT true)
RETURNS TABLE (claimed boolean, state text) LANGUAGE sql AS $$ SELECT true, 'CAPTURED' $$;
SELECT state AS varchar_call FROM public.idem_begin('s-ovl'::varchar, 'fp'::varchar);
SELECT state AS exact_call
  FROM public.idem_begin('s-ovl'::text, 'fp'::text, NULL::interval, NULL::interval, ''::text, true::boolean);
DROP FUNCTION public.idem_begin(varchar, varchar, interval, interval, text, boolean);

--
-- Claims belong to the role that made them.  Tokens come from one
-- sequence, so a role with EXECUTE can guess the token of another role's
-- claim in flight: here tenant B tries every token from five below to five
-- above tenant A's, with each call, and gets no further than 42501 with
-- the right one.  A's claim is untouched, and the following retry of A's
-- request is still in flight (not executed twice).  A itself, a member of
-- A and a superuser may complete, extend or release it.
--
CREATE ROLE regress_idem_tenant_a;
CREATE ROLE regress_idem_tenant_b;
CREATE ROLE regress_idem_tenant_a_worker IN ROLE regress_idem_tenant_a;
CREATE ROLE regress_idem_tenant_a_noinherit NOINHERIT IN ROLE regress_idem_tenant_a;
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean, interval, interval, text),
  idem_complete(text, text, integer, bytea, bigint, interval, text),
  idem_release(text, bigint, text),
  idem_extend(text, bigint, interval, text)
  TO regress_idem_tenant_a, regress_idem_tenant_b, regress_idem_tenant_a_worker,
     regress_idem_tenant_a_noinherit;
SET ROLE regress_idem_tenant_a;
SELECT token AS a_tok FROM idem_begin('pay-1', 'fp-a', lease => '10 minutes', scope => 'tenant-a') \gset
RESET ROLE;
SELECT key_row('tenant-a', 'pay-1') AS a_row0 \gset
SELECT claimed_by AS a_claimed_by FROM idem_keys WHERE scope = 'tenant-a' AND key = 'pay-1';
SET ROLE regress_idem_tenant_b;
SELECT t - :a_tok AS guess,
       left(try(format($$SELECT idem_release('pay-1', %s, scope => 'tenant-a')$$, t)), 5) AS release,
       left(try(format($$SELECT idem_extend('pay-1', %s, '1 hour', scope => 'tenant-a')$$, t)), 5) AS extend,
       left(try(format($$SELECT idem_complete('pay-1', 'fp-a', 200, 'forged', %s, scope => 'tenant-a')$$, t)), 5) AS complete
  FROM generate_series(:a_tok - 5, :a_tok + 5) t
 ORDER BY t;
-- The message for the right token.
SELECT try(format($$SELECT idem_release('pay-1', %s, scope => 'tenant-a')$$, :a_tok));
-- B's retry of A's request is in flight, not a new claim.
SELECT claimed, state FROM idem_begin('pay-1', 'fp-a', scope => 'tenant-a');
RESET ROLE;
SELECT key_row('tenant-a', 'pay-1') = :'a_row0' AS a_claim_untouched;
-- A role that is a member of A but does not inherit its privileges is
-- refused as well; a member that inherits them may act for A.
SET ROLE regress_idem_tenant_a_noinherit;
SELECT left(try(format($$SELECT idem_extend('pay-1', %s, '1 minute', scope => 'tenant-a')$$, :a_tok)), 5)
  AS noinherit_extend;
SET ROLE regress_idem_tenant_a_worker;
SELECT idem_extend('pay-1', :a_tok, '20 minutes', scope => 'tenant-a') > now() + interval '19 minutes'
  AS member_extended;
SET ROLE regress_idem_tenant_a;
SELECT idem_complete('pay-1', 'fp-a', 201, 'paid', :a_tok, scope => 'tenant-a') IS NOT NULL AS a_completed;
SELECT state, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin('pay-1', 'fp-a', scope => 'tenant-a');
RESET ROLE;
-- A takeover after the lease binds the key to the role that took it over:
-- the earlier holder's token is superseded (ID002, not 42501) and B holds
-- the new claim.
SET idem.clock_offset = '-1h';
SET ROLE regress_idem_tenant_a;
SELECT token AS a2_tok FROM idem_begin('pay-2', 'fp', lease => '1 minute', scope => 'tenant-a') \gset
RESET ROLE;
RESET idem.clock_offset;
SET ROLE regress_idem_tenant_b;
SELECT claimed, token AS b2_tok FROM idem_begin('pay-2', 'fp', scope => 'tenant-a') \gset
SELECT :'claimed' AS b_took_over;
SET ROLE regress_idem_tenant_a;
SELECT left(try(format($$SELECT idem_complete('pay-2', 'fp', 200, 'late', %s, scope => 'tenant-a')$$, :a2_tok)), 5)
  AS old_holder_complete,
       left(try(format($$SELECT idem_complete('pay-2', 'fp', 200, 'late', %s, scope => 'tenant-a')$$, :b2_tok)), 5)
  AS new_token_complete;
SET ROLE regress_idem_tenant_b;
SELECT idem_release('pay-2', :b2_tok, scope => 'tenant-a') AS b_released;
RESET ROLE;
-- Inside the claiming transaction the claim is proof enough, whatever the
-- current role: a claim made in a SECURITY DEFINER function owned by A is
-- A's, and completed by the caller later in the same transaction.
CREATE FUNCTION regress_claim_as_a(k text) RETURNS bigint LANGUAGE sql SECURITY DEFINER
  AS $$ SELECT token FROM public.idem_begin(k, 'fp', scope => 'tenant-a') $$;
ALTER FUNCTION regress_claim_as_a(text) OWNER TO regress_idem_tenant_a;
GRANT EXECUTE ON FUNCTION regress_claim_as_a(text) TO regress_idem_tenant_b;
SET ROLE regress_idem_tenant_b;
BEGIN;
SELECT regress_claim_as_a('pay-3') AS a3_tok \gset
SELECT idem_complete('pay-3', 'fp', 200, 'same transaction', scope => 'tenant-a') IS NOT NULL AS completed_in_claiming_xact;
COMMIT;
RESET ROLE;
-- (The superuser's own claims show as "superuser": the suite runs as any
-- superuser's name.)
SELECT key, status,
       CASE WHEN claimed_by = current_user::regrole THEN 'superuser' ELSE claimed_by::text END AS claimed_by
  FROM idem_keys WHERE scope = 'tenant-a' ORDER BY key;
-- The superuser may release any claim.
SET ROLE regress_idem_tenant_a;
SELECT token AS a4_tok FROM idem_begin('pay-4', 'fp', scope => 'tenant-a') \gset
RESET ROLE;
SELECT idem_release('pay-4', :a4_tok, scope => 'tenant-a') AS superuser_released;
DELETE FROM idem.keys WHERE scope = 'tenant-a';
DROP FUNCTION regress_claim_as_a(text);
DROP OWNED BY regress_idem_tenant_a, regress_idem_tenant_b, regress_idem_tenant_a_worker,
  regress_idem_tenant_a_noinherit;
DROP ROLE regress_idem_tenant_a_worker, regress_idem_tenant_a_noinherit, regress_idem_tenant_a,
  regress_idem_tenant_b;

DROP FUNCTION try_as(name, text);
DROP OWNED BY regress_idem_sec_sub, regress_idem_sec_app, regress_idem_sec_ops;
DROP ROLE regress_idem_sec_app, regress_idem_sec_sub, regress_idem_sec_ops, regress_idem_sec_none;
