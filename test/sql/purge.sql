--
-- idem_purge deletes keys whose retention window is over, at most max_rows,
-- and returns how many it deleted.  Uses try(), keys_digest() from
-- setup.sql.
--

-- Start from an empty key table, so the counts below are this file's.
DELETE FROM idem.keys;

-- Three keys with a 1 hour window (one done, one in flight, one in another
-- scope) and two with a 5 hour window.
SELECT token AS tok FROM idem_begin('p-done', 'fp', lease => '10 seconds', retention => '1 hour') \gset
SELECT idem_complete('p-done', 'fp', 200, 'x', :tok, retention => '1 hour') IS NOT NULL AS completed;
SELECT claimed FROM idem_begin('p-processing', 'fp', lease => '10 seconds', retention => '1 hour');
SELECT claimed FROM idem_begin('p-scoped', 'fp', lease => '10 seconds', retention => '1 hour', scope => 't1');
SELECT token AS tok FROM idem_begin('p-live-done', 'fp', lease => '10 seconds', retention => '5 hours') \gset
SELECT idem_complete('p-live-done', 'fp', 200, 'y', :tok, retention => '5 hours') IS NOT NULL AS completed;
SELECT claimed FROM idem_begin('p-live', 'fp', lease => '10 seconds', retention => '5 hours');

-- Nothing has expired yet.
SELECT idem_purge() AS purged;
SELECT count(*) FROM idem.keys;

-- Two hours later three keys have expired.  max_rows limits a call;
-- 0 deletes nothing.
SET idem.clock_offset = '2h';
SELECT idem_purge(0) AS purged;
SELECT idem_purge(2) AS purged;
SELECT count(*) AS expired_left FROM idem.keys WHERE scope = 't1' OR key IN ('p-done', 'p-processing');
SELECT idem_purge(5) AS purged;
SELECT idem_purge() AS purged;
-- Only the live keys are left, unchanged.
SELECT scope, key, status FROM idem.keys ORDER BY scope, key;
SELECT state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('p-live-done', 'fp');
SELECT claimed, state FROM idem_begin('p-live', 'fp');

-- A negative max_rows is an error and deletes nothing.
SET idem.clock_offset = '6h';
SELECT keys_digest() AS digest0 \gset
SELECT try($$SELECT idem_purge(-1)$$);
SELECT keys_digest() = :'digest0' AS unchanged;
-- NULL means no limit.
SELECT idem_purge(NULL) AS purged;
SELECT count(*) FROM idem.keys;
RESET idem.clock_offset;

-- Purge skips rows locked by another transaction instead of waiting (here
-- a prepared transaction), and re-checks expiry: a key that is being
-- claimed again is not deleted.
SET statement_timeout = '20s';
SELECT claimed FROM idem_begin('p-reclaimed', 'fp', lease => '10 seconds', retention => '1 hour');
SELECT claimed FROM idem_begin('p-locked', 'fp', lease => '10 seconds', retention => '1 hour');
SELECT claimed FROM idem_begin('p-free', 'fp', lease => '10 seconds', retention => '1 hour');
SET idem.clock_offset = '2h';
BEGIN;
SELECT claimed, state FROM idem_begin('p-reclaimed', 'fp', lease => '10 minutes', retention => '1 hour');
SELECT key FROM idem.keys WHERE key = 'p-locked' FOR UPDATE;
PREPARE TRANSACTION 'idem_purge_locked';
SELECT idem_purge() AS purged;
SELECT key FROM idem.keys ORDER BY key;
COMMIT PREPARED 'idem_purge_locked';
-- The re-claimed key is live; the other, unlocked now, is purged next time.
SELECT idem_purge() AS purged;
SELECT key, status FROM idem.keys ORDER BY key;
SELECT claimed, state FROM idem_begin('p-reclaimed', 'fp');
RESET idem.clock_offset;
RESET statement_timeout;

-- Under SERIALIZABLE the purge takes the relation-level predicate lock a
-- sequential scan takes (it reads every page), also of an empty table.
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT idem_purge() AS purged;
SELECT locktype, mode FROM pg_locks
 WHERE pid = pg_backend_pid() AND relation = 'idem.keys'::regclass AND mode = 'SIReadLock';
COMMIT;
CREATE TEMP TABLE saved_keys AS SELECT * FROM idem.keys;
DELETE FROM idem.keys;
VACUUM idem.keys;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT idem_purge() AS purged;
SELECT locktype, mode FROM pg_locks
 WHERE pid = pg_backend_pid() AND relation = 'idem.keys'::regclass AND mode = 'SIReadLock';
COMMIT;
INSERT INTO idem.keys SELECT * FROM saved_keys;
DROP TABLE saved_keys;

