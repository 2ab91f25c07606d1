--
-- idem_begin's wait_for: arguments, and the answers that need no other
-- session (the waits another session ends are in
-- test/isolation/specs/wait_for.spec and test/t/023_wait_for.pl).
--
SELECT token AS tok FROM idem_begin('wf-held', 'fp', lease => '1 hour') \gset

-- NULL and zero do not wait: in flight at once.
SELECT claimed, state, token FROM idem_begin('wf-held', 'fp', wait_for => NULL);
SELECT claimed, state, token FROM idem_begin('wf-held', 'fp', wait_for => '0');
-- A replay, a conflict and a new key are answered at once, as without it.
SELECT idem_complete('wf-done', 'fp', 200, 'x', (SELECT token FROM idem_begin('wf-done', 'fp'))) IS NOT NULL AS completed;
SELECT claimed, state, status FROM idem_begin('wf-done', 'fp', wait_for => '1 hour');
SELECT claimed, state FROM idem_begin('wf-done', 'other', wait_for => '1 hour');
SELECT claimed, state FROM idem_begin('wf-new', 'fp', wait_for => '1 hour');
-- This transaction's own claim: no wait.
BEGIN;
SELECT claimed, state FROM idem_begin('wf-own', 'fp');
SELECT claimed, state FROM idem_begin('wf-own', 'fp', wait_for => '1 hour');
ROLLBACK;

-- Bad values: 22023, nothing stored.
SELECT keys_digest() AS digest0 \gset
SELECT try($$SELECT idem_begin('wf-held', 'fp', wait_for => '-1s')$$);
SELECT try($$SELECT idem_begin('wf-held', 'fp', wait_for => '400 days')$$);
SELECT try($$SELECT idem_begin('wf-held', 'fp', wait => false, wait_for => '1s')$$);
SELECT claimed, state FROM idem_begin('wf-held', 'fp', wait => false, wait_for => '0');
SELECT keys_digest() = :'digest0' AS unchanged;

-- lock_timeout ends a wait with 55P03.
SET lock_timeout = '100ms';
SELECT try($$SELECT idem_begin('wf-held', 'fp', wait_for => '1 hour')$$);
RESET lock_timeout;
-- In a read-only transaction the wait ends the same way: in flight.
BEGIN READ ONLY;
SELECT claimed, state FROM idem_begin('wf-held', 'fp', wait_for => '100 milliseconds');
COMMIT;

-- An application role with EXECUTE only waits as the owner does.
CREATE ROLE regress_idem_wf_app;
GRANT EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  TO regress_idem_wf_app;
SET ROLE regress_idem_wf_app;
SELECT claimed, state, lease_until IS NOT NULL AS has_lease
  FROM idem_begin('wf-held', 'fp', wait_for => '100 milliseconds');
SELECT claimed, state FROM idem_begin('wf-app', 'fp', wait_for => '1 hour');
RESET ROLE;
DELETE FROM idem.keys WHERE key = 'wf-app';
REVOKE ALL ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  FROM regress_idem_wf_app;
DROP ROLE regress_idem_wf_app;
