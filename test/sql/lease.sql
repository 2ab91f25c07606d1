--
-- Lease takeover and the end of the retention window, with time moved by
-- idem.clock_offset.  Uses try(), key_row() from setup.sql.
--

-- A claim that is never completed (the holder crashed).
CREATE TEMP TABLE l1 AS
  SELECT * FROM idem_begin('l-crash', 'fp', lease => '1 minute', retention => '1 hour');
SELECT token AS tok1, expires_at AS exp1 FROM l1 \gset

-- Inside the lease it is in flight.
SET idem.clock_offset = '30s';
SELECT claimed, state, token FROM idem_begin('l-crash', 'fp');
SELECT token = :tok1 AS unchanged_token FROM idem.keys WHERE key = 'l-crash';

-- After the lease another caller takes it over: claimed, with a token
-- greater than the old one and a fresh lease from now.  The retention
-- window still counts from the first claim.
SET idem.clock_offset = '61s';
SELECT clock_timestamp() AS t0 \gset
CREATE TEMP TABLE l2 AS
  SELECT * FROM idem_begin('l-crash', 'fp', lease => '2 minutes', retention => '5 hours');
SELECT clock_timestamp() AS t1 \gset
SELECT claimed, state, token > :tok1 AS greater_token, status, body,
       lease_until BETWEEN :'t0'::timestamptz + interval '181 seconds'
                       AND :'t1'::timestamptz + interval '181 seconds' AS lease_from_now,
       expires_at = :'exp1' AS same_window
  FROM l2;
SELECT token AS tok2 FROM l2 \gset
SELECT token = :tok2 AS stored_token, lease_until = (SELECT lease_until FROM l2) AS stored_lease,
       expires_at = :'exp1' AS same_window
  FROM idem.keys WHERE key = 'l-crash';

-- The new holder's lease protects it in turn ...
SET idem.clock_offset = '150s';
SELECT claimed, state, token FROM idem_begin('l-crash', 'fp');
-- ... the old holder's token is no longer good ...
SELECT try($$SELECT idem_complete('l-crash', 'fp', 200, 'x', $$ || :tok1 || $$)$$);
-- ... and after the new lease, a third caller takes over with a greater token.
SET idem.clock_offset = '182s';
SELECT claimed, state, token > :tok2 AS greater_token FROM idem_begin('l-crash', 'fp');

-- An expired lease does not free the key for another fingerprint: the
-- window is still open, so it is a conflict.
SET idem.clock_offset = '5 min';
SELECT key_row('', 'l-crash') AS row0 \gset
SELECT claimed, state, token, status, body FROM idem_begin('l-crash', 'other-fp');
SELECT key_row('', 'l-crash') = :'row0' AS unchanged;

-- A takeover near the end of the window keeps the whole lease: expires_at
-- moves to the end of the lease.
SET idem.clock_offset = '59min';
SELECT claimed, state, expires_at = lease_until AS window_covers_lease,
       expires_at > :'exp1'::timestamptz AS window_extended
  FROM idem_begin('l-crash', 'fp', lease => '5 minutes');

-- Retention over, never completed: the key is new again.
SET idem.clock_offset = '2h';
SELECT max(token) AS tok_max FROM idem.keys \gset
SELECT claimed, state, token > :tok_max AS greater_token,
       expires_at - lease_until AS retention_minus_lease
  FROM idem_begin('l-crash', 'fp', lease => '10 seconds', retention => '1 hour');
RESET idem.clock_offset;

-- Retention over after completion: a new claim, the old response is gone,
-- and any fingerprint may claim it.
SELECT token AS tok FROM idem_begin('l-window', 'fp', lease => '10 seconds', retention => '1 hour') \gset
SELECT idem_complete('l-window', 'fp', 200, 'first', :tok, retention => '1 hour') IS NOT NULL AS completed;
SET idem.clock_offset = '59 min';
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('l-window', 'fp');
SET idem.clock_offset = '61 min';
SELECT clock_timestamp() AS t0 \gset
CREATE TEMP TABLE l3 AS
  SELECT * FROM idem_begin('l-window', 'new-fp', lease => '15 seconds', retention => '2 hours');
SELECT clock_timestamp() AS t1 \gset
SELECT claimed, state, token > :tok AS greater_token, status, body,
       expires_at BETWEEN :'t0'::timestamptz + interval '2 hours 61 minutes'
                      AND :'t1'::timestamptz + interval '2 hours 61 minutes' AS window_from_now,
       expires_at - lease_until AS retention_minus_lease
  FROM l3;
SELECT status, body, fingerprint = sha256('new-fp'::bytea) AS new_fp,
       token = (SELECT token FROM l3) AS new_token
  FROM idem.keys WHERE key = 'l-window';
-- The old fingerprint now conflicts with the new claim.
SELECT claimed, state FROM idem_begin('l-window', 'fp');
RESET idem.clock_offset;

-- Tokens stay greater across purge and re-creation of the key.
SELECT token AS tok FROM idem_begin('l-purged', 'fp', lease => '10 seconds', retention => '1 hour') \gset
SELECT idem_complete('l-purged', 'fp', 200, 'x', :tok, retention => '1 hour') IS NOT NULL AS completed;
SET idem.clock_offset = '2h';
SELECT idem_purge() > 0 AS purged;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 'l-purged';
SELECT claimed, state, token > :tok AS greater_token FROM idem_begin('l-purged', 'fp');
RESET idem.clock_offset;
