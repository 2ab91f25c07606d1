--
-- Settings: defaults, bounds, who may set them, and their effect.  Uses
-- try(), keys_digest() from setup.sql.
--

-- Defaults.
SHOW idem.default_lease;
SHOW idem.default_retention;
SHOW idem.max_retention;
SHOW idem.max_key_length;
SHOW idem.max_body_size;
SHOW idem.clock_offset;
SELECT name, setting, unit, context, vartype, min_val, max_val
  FROM pg_settings
 WHERE name IN ('idem.default_lease', 'idem.default_retention', 'idem.max_retention',
                'idem.max_key_length', 'idem.max_body_size', 'idem.clock_offset')
 ORDER BY name;

-- Values within bounds are accepted, with units.
SET idem.default_lease = '5min';
SHOW idem.default_lease;
SET idem.default_retention = '2h';
SHOW idem.default_retention;
SET idem.max_retention = '7d';
SHOW idem.max_retention;
SET idem.max_key_length = 1024;
SHOW idem.max_key_length;
SET idem.max_body_size = '64kB';
SHOW idem.max_body_size;
SET idem.clock_offset = '-90min';
SHOW idem.clock_offset;
RESET ALL;

-- Out of bounds is rejected and the setting keeps its value.  PostgreSQL 17
-- and later give the range with units ("1 s .. 2147483647 s"): they are
-- left out so that every version reads alike.
SELECT q, regexp_replace(try(q), '\((-?\d+) \w+ \.\. (\d+) \w+\)$', '(\1 .. \2)') AS try
  FROM (VALUES
  ($$SET idem.default_lease = 0$$),
  ($$SET idem.default_retention = 0$$),
  ($$SET idem.max_retention = 0$$),
  ($$SET idem.max_key_length = 0$$),
  ($$SET idem.max_key_length = 1025$$),
  ($$SET idem.max_body_size = -1$$),
  ($$SET idem.default_lease = 'soon'$$)
) t(q);
SHOW idem.default_lease;
SHOW idem.max_key_length;

-- idem.clock_offset and the ceilings (max_retention, max_key_length,
-- max_body_size) are superuser-only; the defaults are for everybody.
CREATE ROLE regress_idem_settings;
SET ROLE regress_idem_settings;
SELECT try($$SET idem.clock_offset = '1h'$$);
SHOW idem.clock_offset;
SELECT try($$SET idem.max_key_length = 100$$);
SELECT try($$SET idem.max_retention = '100d'$$);
SELECT try($$SET idem.max_body_size = '200MB'$$);
SHOW idem.max_key_length;
SELECT try($$SET idem.default_retention = '2h'$$);
RESET ROLE;
RESET idem.max_key_length;
DROP ROLE regress_idem_settings;

-- idem.max_key_length bounds keys and scopes, in bytes.
SET idem.max_key_length = 10;
SELECT claimed FROM idem_begin('set-10-key', 'fp', scope => 'set-scope1');
SELECT keys_digest() AS digest0 \gset
SELECT try($$SELECT idem_begin('set-11-key!', 'fp')$$);
SELECT try($$SELECT idem_begin('set-key', 'fp', scope => 'set-scope-2')$$);
SELECT try($$SELECT idem_complete('set-11-key!', 'fp', 200, 'x', 1)$$);
SELECT try($$SELECT idem_release('set-11-key!', 1)$$);
SELECT try($$SELECT idem_extend('set-11-key!', 1, '1 minute')$$);
SELECT keys_digest() = :'digest0' AS unchanged;
RESET idem.max_key_length;

-- idem.max_body_size bounds the stored body.  A larger body is not an
-- error, since the work it answers is done: the fixed answer 500 "Response
-- not stored" is stored instead, with a WARNING, and counted once in
-- idem_stats.not_stored.  The key is never left claimable.
SET idem.max_body_size = 4;
SELECT not_stored AS ns0 FROM idem_stats WHERE datname = current_database() \gset
SELECT token AS tok FROM idem_begin('set-body', 'fp') \gset
SELECT idem_complete('set-body', 'fp', 200, '12345', :tok) IS NOT NULL AS completed;
SELECT claimed, state, status, convert_from(body, 'UTF8')::json->>'title' AS title
  FROM idem_begin('set-body', 'fp');
-- A client that repeats the complete gets the same answer, not ID004.
SELECT idem_complete('set-body', 'fp', 200, '12345', :tok) IS NOT NULL AS completed_again;
SELECT idem_complete('set-body', 'fp', 200, '1234', :tok);
SELECT token AS tok FROM idem_begin('set-body-4', 'fp') \gset
SELECT idem_complete('set-body-4', 'fp', 200, '1234', :tok) IS NOT NULL AS completed;
-- The envelope of the HTTP middleware (doc/http.md): its header line does
-- not count; one byte more in the body after it gets the fixed answer, in
-- an envelope.
SELECT token AS tok FROM idem_begin('set-body-env', 'fp') \gset
SELECT idem_complete('set-body-env', 'fp', 201,
       convert_to(E'idem-http/1\n[["etag","\\"1\\""]]\n1234', 'UTF8'), :tok) IS NOT NULL AS completed;
SELECT token AS tok FROM idem_begin('set-body-env5', 'fp') \gset
SELECT idem_complete('set-body-env5', 'fp', 201,
       convert_to(E'idem-http/1\n[["etag","\\"1\\""]]\n12345', 'UTF8'), :tok) IS NOT NULL AS completed;
-- Without its newline, a header line is body: it counts.
SELECT token AS tok FROM idem_begin('set-body-env-cut', 'fp') \gset
SELECT idem_complete('set-body-env-cut', 'fp', 201,
       convert_to(E'idem-http/1\n[]', 'UTF8'), :tok) IS NOT NULL AS completed;
SET idem.max_body_size = 0;
SELECT token AS tok FROM idem_begin('set-body-0', 'fp') \gset
SELECT idem_complete('set-body-0', 'fp', 204, '', :tok) IS NOT NULL AS completed;
SELECT key, status, length(body), convert_from(body, 'UTF8') AS body
  FROM idem.keys WHERE key LIKE 'set-body%' ORDER BY key;
SELECT not_stored - :ns0 AS not_stored
  FROM idem_stats WHERE datname = current_database();
RESET idem.max_body_size;

-- idem.default_lease and idem.default_retention apply when a call gives none.
SET idem.default_lease = '5min';
SET idem.default_retention = '2h';
SELECT clock_timestamp() AS t0 \gset
CREATE TEMP TABLE d1 AS SELECT * FROM idem_begin('set-defaults', 'fp');
SELECT clock_timestamp() AS t1 \gset
SELECT claimed, expires_at - lease_until AS retention_minus_lease,
       lease_until BETWEEN :'t0'::timestamptz + interval '5 minutes'
                       AND :'t1'::timestamptz + interval '5 minutes' AS lease_from_now
  FROM d1;
SELECT token AS tok, expires_at AS claim_exp FROM d1 \gset
SELECT :'claim_exp'::timestamptz BETWEEN :'t0'::timestamptz + interval '2 hours'
                                    AND :'t1'::timestamptz + interval '2 hours' AS window_from_now;
SELECT idem_complete('set-defaults', 'fp', 200, 'x', :tok) = :'claim_exp'::timestamptz AS claim_window_kept;
SELECT claimed FROM idem_begin('set-defaults-2', 'fp', lease => '1 minute');
SELECT token AS tok FROM idem.keys WHERE key = 'set-defaults-2' \gset
SELECT clock_timestamp() AS t0 \gset
SELECT idem_extend('set-defaults-2', :tok, NULL) AS lease2 \gset
SELECT clock_timestamp() AS t1 \gset
SELECT :'lease2'::timestamptz BETWEEN :'t0'::timestamptz + interval '5 minutes'
                                 AND :'t1'::timestamptz + interval '5 minutes' AS extend_default;
-- A default lease longer than the retention asked for is an error.
SELECT try($$SELECT idem_begin('set-defaults-3', 'fp', retention => '1 minute')$$);
RESET idem.default_lease;
RESET idem.default_retention;

-- idem.max_retention bounds retention and leases, given or default.
SET idem.max_retention = '1h';
SELECT keys_digest() AS digest0 \gset
SELECT try($$SELECT idem_begin('set-max', 'fp', retention => '61 minutes')$$);
SELECT try($$SELECT idem_begin('set-max', 'fp')$$);
SELECT try($$SELECT idem_begin('set-max', 'fp', lease => '2 hours', retention => '1 hour')$$);
SELECT keys_digest() = :'digest0' AS unchanged;
SELECT claimed FROM idem_begin('set-max', 'fp', retention => '1 hour');
SELECT token AS tok FROM idem.keys WHERE key = 'set-max' \gset
SELECT keys_digest() AS digest0 \gset
SELECT try($$SELECT idem_complete('set-max', 'fp', 200, 'x', $$ || :tok || $$, retention => '2 hours')$$);
SELECT try($$SELECT idem_extend('set-max', $$ || :tok || $$, '2 hours')$$);
SELECT keys_digest() = :'digest0' AS unchanged;
SELECT idem_complete('set-max', 'fp', 200, 'x', :tok, retention => '1 hour') IS NOT NULL AS completed;
RESET idem.max_retention;
