--
-- The SQL interface as installed, and who may touch what.  Uses try()
-- from setup.sql.
--

-- Functions are created unqualified, in the extension's schema; none is
-- STRICT (a NULL argument is an error, see bad_input).
\df idem_*
SELECT p.oid::regprocedure AS function, p.proisstrict AS strict, p.provolatile AS volatility
  FROM pg_proc p
  JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idem'
 ORDER BY p.proname;

-- The key table, in the extension's own schema.
\d idem.keys

-- The table, its token sequence and the two views belong to the extension.
-- (From PostgreSQL 17 on their row types do too; types are left out here.)
SELECT pg_describe_object(d.classid, d.objid, d.objsubid) AS member
  FROM pg_depend d
  JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'idem'
 WHERE d.deptype = 'e'
   AND d.classid NOT IN ('pg_proc'::regclass, 'pg_type'::regclass)
 ORDER BY 1;

-- PUBLIC has no privilege on the schema, the table, the sequence, the
-- views or any function (doc/security.md; more in security.sql).
CREATE ROLE regress_idem_app;
SELECT has_schema_privilege('regress_idem_app', 'idem', 'USAGE') AS schema_usage,
       has_schema_privilege('regress_idem_app', 'idem', 'CREATE') AS schema_create;
SELECT p AS privilege, has_table_privilege('regress_idem_app', 'idem.keys', p) AS granted
  FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',
                    'REFERENCES', 'TRIGGER']) p;
SELECT p AS privilege, has_sequence_privilege('regress_idem_app', 'idem.token_seq', p) AS granted
  FROM unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) p;
SELECT f AS function, has_function_privilege('regress_idem_app', f, 'EXECUTE') AS execute
  FROM unnest(ARRAY['idem_begin(text,text,interval,interval,text,boolean,interval,interval,text)',
                    'idem_complete(text,text,integer,bytea,bigint,interval,text)',
                    'idem_begin_many(text[],text[],interval,interval,text,boolean,interval,interval,text)',
                    'idem_complete_many(text[],text[],integer[],bytea[],bigint[],interval,text)',
                    'idem_release(text,bigint,text)',
                    'idem_extend(text,bigint,interval,text)',
                    'idem_purge(integer)',
                    'idem_lookup(text,text)',
                    'idem_stats()',
                    'idem_stats_reset()',
                    'idem_waits()']) f;
SELECT v AS view, has_table_privilege('regress_idem_app', v, 'SELECT') AS "select"
  FROM unnest(ARRAY['idem_keys', 'idem_stats', 'idem_waits']) v;

-- An application role granted EXECUTE on the four claim functions, with
-- no grant on idem.keys, claims and completes keys through the functions,
-- but cannot read or write the table itself.
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean, interval, interval, text),
  idem_complete(text, text, integer, bytea, bigint, interval, text),
  idem_release(text, bigint, text),
  idem_extend(text, bigint, interval, text)
  TO regress_idem_app;
SET ROLE regress_idem_app;
SELECT claimed, state, token AS tok FROM idem_begin('i-app', 'fp') \gset
\echo :claimed :state
SELECT idem_extend('i-app', :tok, '2 minutes') IS NOT NULL AS extended;
SELECT idem_complete('i-app', 'fp', 200, 'ok', :tok) IS NOT NULL AS completed;
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('i-app', 'fp');
SELECT try($$SELECT * FROM idem.keys$$);
SELECT try($$DELETE FROM idem.keys$$);
SELECT try($$SELECT nextval('idem.token_seq')$$);
SELECT try($$SELECT idem_purge()$$);
RESET ROLE;
SELECT key, status FROM idem.keys WHERE key = 'i-app';
DROP OWNED BY regress_idem_app;
DROP ROLE regress_idem_app;

-- The caller's search_path does not change what the functions do.
SET search_path = pg_catalog;
SELECT claimed, state FROM public.idem_begin('i-path', 'fp');
SELECT claimed, state FROM public.idem_begin('i-path', 'fp');
RESET search_path;
