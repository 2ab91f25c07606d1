--
-- idem_release gives up a claim; idem_extend moves the lease of a live
-- claim.  Uses try(), key_row() from setup.sql.
--

-- Release frees the key at once: the next caller claims it with a greater
-- token, no need to wait for the lease.
SELECT token AS tok FROM idem_begin('r-free', 'fp', lease => '10 minutes') \gset
SELECT claimed, state FROM idem_begin('r-free', 'fp');
SELECT idem_release('r-free', :tok) AS released;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 'r-free';
SELECT claimed, state, token > :tok AS greater_token, token AS tok2
  FROM idem_begin('r-free', 'other-fp') \gset
\echo :claimed :state :greater_token

-- Nothing to release: a missing key, a key already released, a key in
-- another scope.
SELECT idem_release('r-missing', :tok) AS released;
SELECT idem_release('r-free', :tok2, scope => 'elsewhere') AS released;
SELECT idem_release('r-free', :tok2) AS released;
SELECT idem_release('r-free', :tok2) AS released;

-- Inside the claiming transaction the token may be NULL; the key is free
-- for a new claim in the same transaction.
BEGIN;
SELECT claimed FROM idem_begin('r-txn', 'fp');
SELECT idem_release('r-txn', NULL) AS released;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 'r-txn';
SELECT claimed, state FROM idem_begin('r-txn', 'fp-2');
COMMIT;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 'r-txn';
-- Outside it, a NULL token does not release another's claim: ID003.
SELECT key_row('', 'r-txn') AS row0 \gset
SELECT try($$SELECT idem_release('r-txn', NULL)$$);
SELECT key_row('', 'r-txn') = :'row0' AS unchanged;

-- A superseded token is refused: ID002, and the new claim stays.
SELECT token AS tok FROM idem_begin('r-stale', 'fp', lease => '10 seconds') \gset
SET idem.clock_offset = '11s';
SELECT claimed, token AS tok2 FROM idem_begin('r-stale', 'fp', lease => '10 seconds') \gset
SELECT key_row('', 'r-stale') AS row0 \gset
SELECT try($$SELECT idem_release('r-stale', $$ || :tok || $$)$$);
SELECT key_row('', 'r-stale') = :'row0' AS unchanged;
SELECT try($$SELECT idem_extend('r-stale', $$ || :tok || $$, '1 minute')$$);
SELECT key_row('', 'r-stale') = :'row0' AS unchanged;

-- A completed key cannot be released or extended, even by its holder: ID004.
SELECT idem_complete('r-stale', 'fp', 200, 'done', :tok2) IS NOT NULL AS completed;
SELECT key_row('', 'r-stale') AS row0 \gset
SELECT try($$SELECT idem_release('r-stale', $$ || :tok2 || $$)$$);
SELECT try($$SELECT idem_extend('r-stale', $$ || :tok2 || $$, '1 minute')$$);
SELECT key_row('', 'r-stale') = :'row0' AS unchanged;
SELECT state, status FROM idem_begin('r-stale', 'fp');
RESET idem.clock_offset;

-- A key whose window is over has nothing to release.
SELECT token AS tok FROM idem_begin('r-expired', 'fp', lease => '10 seconds', retention => '1 hour') \gset
SET idem.clock_offset = '1h';
SELECT idem_release('r-expired', :tok) AS released;
SELECT try($$SELECT idem_extend('r-expired', $$ || :tok || $$, '1 minute')$$);
RESET idem.clock_offset;

-- Extend moves lease_until to now + lease and returns it; the window
-- stays.
CREATE TEMP TABLE e1 AS
  SELECT * FROM idem_begin('e-long', 'fp', lease => '10 seconds', retention => '1 hour');
SELECT token AS tok, expires_at AS exp1 FROM e1 \gset
SET idem.clock_offset = '5s';
SELECT clock_timestamp() AS t0 \gset
SELECT idem_extend('e-long', :tok, '2 minutes') AS lease2 \gset
SELECT clock_timestamp() AS t1 \gset
SELECT :'lease2'::timestamptz BETWEEN :'t0'::timestamptz + interval '2 minutes 5 seconds'
                                 AND :'t1'::timestamptz + interval '2 minutes 5 seconds' AS lease_from_now;
SELECT token = :tok AS same_token, lease_until = :'lease2' AS stored_lease,
       expires_at = :'exp1' AS same_window
  FROM idem.keys WHERE key = 'e-long';
-- Past the old lease it is still in flight; past the new one it is taken over.
SET idem.clock_offset = '1 min';
SELECT claimed, state, token FROM idem_begin('e-long', 'fp');
-- A late heartbeat (lease over, nobody took over yet) still works; without
-- a lease, idem.default_lease (60 s) applies.
SET idem.clock_offset = '3 min';
SELECT clock_timestamp() AS t0 \gset
SELECT idem_extend('e-long', :tok, NULL) AS lease3 \gset
SELECT clock_timestamp() AS t1 \gset
SELECT :'lease3'::timestamptz BETWEEN :'t0'::timestamptz + interval '4 minutes'
                                 AND :'t1'::timestamptz + interval '4 minutes' AS default_lease;
SET idem.clock_offset = '5 min';
SELECT claimed, state, token > :tok AS greater_token FROM idem_begin('e-long', 'fp');

-- A lease extended past the end of the window moves the window with it.
SELECT token AS tok FROM idem_begin('e-window', 'fp', lease => '10 seconds', retention => '1 minute') \gset
SELECT idem_extend('e-window', :tok, '5 minutes') AS lease2 \gset
SELECT expires_at = :'lease2' AS window_covers_lease FROM idem.keys WHERE key = 'e-window';
SET idem.clock_offset = '4 min';
SELECT claimed, state FROM idem_begin('e-window', 'fp');
RESET idem.clock_offset;

-- Inside the claiming transaction the token may be NULL.
BEGIN;
SELECT claimed FROM idem_begin('e-txn', 'fp', lease => '10 seconds');
SELECT idem_extend('e-txn', NULL, '10 minutes') AS lease2 \gset
SELECT lease_until = :'lease2' AS stored_lease FROM idem.keys WHERE key = 'e-txn';
COMMIT;
SELECT key_row('', 'e-txn') AS row0 \gset
-- Outside it, a NULL token is refused: ID003.
SELECT try($$SELECT idem_extend('e-txn', NULL, '1 hour')$$);
-- A missing key has no claim to extend: ID003.
SELECT try($$SELECT idem_extend('e-missing', 1, '1 minute')$$);
SELECT try($$SELECT idem_extend('e-txn', 1, '1 minute', scope => 'elsewhere')$$);
SELECT count(*) FROM idem.keys WHERE key = 'e-missing' OR scope = 'elsewhere';
SELECT key_row('', 'e-txn') = :'row0' AS unchanged;
