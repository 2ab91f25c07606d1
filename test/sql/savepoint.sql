--
-- Claims, completions and releases inside savepoints follow the
-- savepoint: rolled back, they are gone.  Uses try() from setup.sql.
--

-- A claim in a savepoint that rolls back is gone; the key is free at once,
-- within the same transaction and after it.
BEGIN;
SAVEPOINT s;
SELECT claimed, state, token AS tok1 FROM idem_begin('s-key', 'fp', lease => '10 minutes') \gset
\echo :claimed :state
ROLLBACK TO SAVEPOINT s;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 's-key';
SELECT claimed, state, token > :tok1 AS greater_token FROM idem_begin('s-key', 'other-fp');
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 's-key';
SELECT claimed, state, token > :tok1 AS greater_token, token AS tok2
  FROM idem_begin('s-key', 'fp', lease => '1 minute') \gset
\echo :claimed :state :greater_token

-- A claim in a released savepoint is kept, and the transaction holds it:
-- idem_complete without token works after the savepoint.
BEGIN;
SAVEPOINT s;
SELECT claimed FROM idem_begin('s-kept', 'fp');
RELEASE SAVEPOINT s;
SELECT claimed, state FROM idem_begin('s-kept', 'fp');
SELECT idem_complete('s-kept', 'fp', 200, 'kept') IS NOT NULL AS completed;
COMMIT;
SELECT state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('s-kept', 'fp');

-- A takeover in a savepoint that rolls back restores the earlier claim:
-- its holder's token is current again.
SET idem.clock_offset = '61s';
BEGIN;
SAVEPOINT s;
SELECT claimed, token > :tok2 AS greater_token FROM idem_begin('s-key', 'fp');
ROLLBACK TO SAVEPOINT s;
SELECT token = :tok2 AS old_token_back FROM idem.keys WHERE key = 's-key';
COMMIT;
RESET idem.clock_offset;

-- A completion in a savepoint that rolls back leaves the key PROCESSING.
BEGIN;
SAVEPOINT s;
SELECT idem_complete('s-key', 'fp', 500, 'undone', :tok2) IS NOT NULL AS completed;
ROLLBACK TO SAVEPOINT s;
SELECT status, body FROM idem.keys WHERE key = 's-key';
COMMIT;
SELECT claimed, state, status FROM idem_begin('s-key', 'fp');

-- A release in a savepoint that rolls back leaves the claim in place.
BEGIN;
SAVEPOINT s;
SELECT idem_release('s-key', :tok2) AS released;
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT token = :tok2 AS same_token, status FROM idem.keys WHERE key = 's-key';
SELECT idem_complete('s-key', 'fp', 200, 'final', :tok2) IS NOT NULL AS completed;
SELECT state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('s-key', 'fp');

-- A failed statement after a claim rolls the whole transaction back with it.
BEGIN;
SELECT claimed FROM idem_begin('s-failed', 'fp');
SELECT 1 / 0;
ROLLBACK;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 's-failed';
SELECT claimed, state FROM idem_begin('s-failed', 'fp');
