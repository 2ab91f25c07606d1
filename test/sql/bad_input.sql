--
-- Bad arguments: each is an error with its SQLSTATE and a message naming
-- the argument, and nothing stored changes.  The functions are not STRICT,
-- so a NULL is an error, never a silent NULL result.  Uses try(),
-- keys_digest(), key_row() from setup.sql.
--

-- A live claim the calls below aim at with otherwise good arguments.
SELECT token AS tok FROM idem_begin('bad-key', 'fp', lease => '10 minutes', retention => '1 hour') \gset
SELECT keys_digest() AS digest0, key_row('', 'bad-key') AS row0 \gset
-- The queries below read the token from a setting, so they print the same
-- whatever its value.
SELECT set_config('test.tok', :'tok', false) IS NOT NULL AS token_set;

-- idem_begin
SELECT q, try(q) FROM (VALUES
  ($$SELECT idem_begin(NULL, 'fp')$$),
  ($$SELECT idem_begin('bad-new', NULL)$$),
  ($$SELECT idem_begin('bad-new', 'fp', scope => NULL)$$),
  ($$SELECT idem_begin('bad-new', 'fp', wait => NULL)$$),
  ($$SELECT idem_begin('', 'fp')$$),
  ($$SELECT idem_begin(repeat('k', 256), 'fp')$$),
  ($$SELECT idem_begin(repeat('é', 128), 'fp')$$),
  ($$SELECT idem_begin('bad-new', 'fp', scope => repeat('s', 256))$$),
  ($$SELECT idem_begin('bad-new', 'fp', lease => '0')$$),
  ($$SELECT idem_begin('bad-new', 'fp', lease => '-1 second')$$),
  ($$SELECT idem_begin('bad-new', 'fp', retention => '0')$$),
  ($$SELECT idem_begin('bad-new', 'fp', retention => '-1 hour')$$),
  ($$SELECT idem_begin('bad-new', 'fp', lease => '2 hours', retention => '1 hour')$$),
  ($$SELECT idem_begin('bad-new', 'fp', lease => '61 seconds', retention => '1 minute')$$),
  ($$SELECT idem_begin('bad-new', 'fp', retention => '30 days 1 second')$$),
  ($$SELECT idem_begin('bad-new', 'fp', retention => '31 days')$$),
  ($$SELECT idem_begin('bad-new', 'fp', retention => '1000000 years')$$),
  ($$SELECT idem_begin('bad-new', 'fp', lease => '31 days')$$)
) t(q);
SELECT keys_digest() = :'digest0' AS unchanged;

-- The same calls aimed at the live claim change nothing either.
SELECT q, try(q) FROM (VALUES
  ($$SELECT idem_begin('bad-key', NULL)$$),
  ($$SELECT idem_begin('bad-key', 'fp', wait => NULL)$$),
  ($$SELECT idem_begin('bad-key', 'fp', lease => '0')$$),
  ($$SELECT idem_begin('bad-key', 'fp', lease => '2 hours', retention => '1 hour')$$),
  ($$SELECT idem_begin('bad-key', 'fp', retention => '31 days')$$)
) t(q);
SELECT key_row('', 'bad-key') = :'row0' AS unchanged;

-- idem_complete, with the holder's token
SELECT q, try(q) FROM (VALUES
  ($$SELECT idem_complete(NULL, 'fp', 200, 'x', current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_complete('bad-key', NULL, 200, 'x', current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_complete('bad-key', 'fp', NULL, 'x', current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_complete('bad-key', 'fp', 200, 'x', current_setting('test.tok')::bigint, scope => NULL)$$),
  ($$SELECT idem_complete('', 'fp', 200, 'x', current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_complete(repeat('k', 256), 'fp', 200, 'x', current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_complete('bad-key', 'fp', 200, 'x', current_setting('test.tok')::bigint, scope => repeat('s', 256))$$),
  ($$SELECT idem_complete('bad-key', 'fp', 200, 'x', current_setting('test.tok')::bigint, retention => '0')$$),
  ($$SELECT idem_complete('bad-key', 'fp', 200, 'x', current_setting('test.tok')::bigint, retention => '-5 minutes')$$),
  ($$SELECT idem_complete('bad-key', 'fp', 200, 'x', current_setting('test.tok')::bigint, retention => '30 days 1 second')$$)
) t(q);
SELECT key_row('', 'bad-key') = :'row0' AS unchanged;

-- idem_release and idem_extend
SELECT q, try(q) FROM (VALUES
  ($$SELECT idem_release(NULL, current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_release('bad-key', current_setting('test.tok')::bigint, scope => NULL)$$),
  ($$SELECT idem_release('', current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_release(repeat('k', 256), current_setting('test.tok')::bigint)$$),
  ($$SELECT idem_release('bad-key', current_setting('test.tok')::bigint, scope => repeat('s', 256))$$),
  ($$SELECT idem_extend(NULL, current_setting('test.tok')::bigint, '1 minute')$$),
  ($$SELECT idem_extend('bad-key', current_setting('test.tok')::bigint, '1 minute', scope => NULL)$$),
  ($$SELECT idem_extend('', current_setting('test.tok')::bigint, '1 minute')$$),
  ($$SELECT idem_extend(repeat('k', 256), current_setting('test.tok')::bigint, '1 minute')$$),
  ($$SELECT idem_extend('bad-key', current_setting('test.tok')::bigint, '1 minute', scope => repeat('s', 256))$$),
  ($$SELECT idem_extend('bad-key', current_setting('test.tok')::bigint, '0')$$),
  ($$SELECT idem_extend('bad-key', current_setting('test.tok')::bigint, '-1 minute')$$),
  ($$SELECT idem_extend('bad-key', current_setting('test.tok')::bigint, '31 days')$$)
) t(q);
SELECT keys_digest() = :'digest0' AS unchanged;

-- The limits themselves are allowed: a 255-byte key and scope, a lease as
-- long as the retention, a retention of exactly idem.max_retention (however
-- it is written in days or hours), a body of exactly idem.max_body_size.
SELECT claimed, state FROM idem_begin(repeat('k', 255), 'fp', scope => repeat('s', 255));
SELECT claimed, state FROM idem_begin('bad-limits-1', 'fp', lease => '1 hour', retention => '1 hour');
SELECT claimed, state FROM idem_begin('bad-limits-2', 'fp', retention => '30 days');
SELECT claimed, state FROM idem_begin('bad-limits-3', 'fp', retention => '720 hours');
SELECT idem_complete('bad-key', 'fp', 200, convert_to(repeat('b', 1024 * 1024), 'UTF8'), :tok) IS NOT NULL AS completed;
SELECT state, status, length(body) FROM idem_begin('bad-key', 'fp');

-- Whether '30 days' is within idem.max_retention does not depend on the
-- time zone: here "now" is a few days before a daylight-saving change, so
-- 30 calendar days are 30 days and 1 hour.
SET timezone = 'America/New_York';
SELECT set_config('idem.clock_offset',
       round(extract(epoch FROM timestamptz '2030-10-20 12:00 America/New_York'
                                - clock_timestamp()))::bigint::text, false) IS NOT NULL AS clock_moved;
SELECT claimed, state, expires_at - lease_until AS retention_minus_lease
  FROM idem_begin('bad-dst', 'fp', retention => '30 days');
SELECT try($$SELECT idem_begin('bad-dst-2', 'fp', retention => '30 days 1 second')$$);
RESET idem.clock_offset;
RESET timezone;

-- A month is as long as the calendar month it starts in: '1 mon' from
-- 5 January is 31 days, beyond the 30-day idem.max_retention; from
-- 5 February 2030 it is 28 days, within it.
SELECT set_config('idem.clock_offset',
       round(extract(epoch FROM timestamptz '2030-01-05 12:00 UTC'
                                - clock_timestamp()))::bigint::text, false) IS NOT NULL AS clock_moved;
SELECT try($$SELECT idem_begin('bad-month', 'fp', retention => '1 mon')$$);
SELECT try($$SELECT idem_begin('bad-month', 'fp', lease => '1 mon')$$);
-- The error says how long it counted the month.
SELECT * FROM idem_begin('bad-month', 'fp', retention => '1 mon');
SELECT count(*) AS stored FROM idem.keys WHERE key = 'bad-month';
SELECT set_config('idem.clock_offset',
       round(extract(epoch FROM timestamptz '2030-02-05 12:00 UTC'
                                - clock_timestamp()))::bigint::text, false) IS NOT NULL AS clock_moved;
SELECT claimed, state, expires_at - lease_until AS retention_minus_lease
  FROM idem_begin('bad-month', 'fp', retention => '1 mon');
RESET idem.clock_offset;

-- Errors about a lease or retention name the values compared, and the
-- setting a value came from when the call gave none.
SELECT * FROM idem_begin('bad-lease', 'fp', lease => '2 hours', retention => '1 hour');
SET idem.default_lease = '2d';
SELECT * FROM idem_begin('bad-lease', 'fp');
SET idem.default_retention = '40d';
SELECT * FROM idem_begin('bad-lease', 'fp', lease => '1 minute');
RESET idem.default_lease;
RESET idem.default_retention;
SELECT count(*) AS stored FROM idem.keys WHERE key = 'bad-lease';
