--
-- idem_begin: claim a new key, replay a stored response, report a key in
-- flight or in conflict.  Uses the helpers of setup.sql.
--
-- A new key is claimed: PROCESSING, a token, no response yet.  lease_until
-- and expires_at are now + lease and now + retention from one clock reading.
SELECT clock_timestamp() AS t0 \gset
CREATE TEMP TABLE first_claim AS
  SELECT * FROM idem_begin('b-new', 'fp-1', lease => '30 seconds', retention => '2 hours');
SELECT clock_timestamp() AS t1 \gset
SELECT claimed, state, token IS NOT NULL AS has_token, status, body,
       expires_at - lease_until AS retention_minus_lease,
       lease_until BETWEEN :'t0'::timestamptz + interval '30 seconds'
                       AND :'t1'::timestamptz + interval '30 seconds' AS lease_from_now
  FROM first_claim;
SELECT token AS tok_a FROM first_claim \gset

-- The row as stored: the fingerprint is a SHA-256 digest, not the caller's text.
SELECT scope, key, fingerprint = sha256('fp-1'::bytea) AS digest_of_fp,
       length(fingerprint) AS fp_len, token = :tok_a AS same_token,
       status, body, expires_at - lease_until AS retention_minus_lease
  FROM idem.keys WHERE key = 'b-new';

-- Without lease and retention the defaults apply (60 s and 24 h).
SELECT clock_timestamp() AS t0 \gset
SELECT claimed, state, expires_at - lease_until AS retention_minus_lease,
       lease_until >= :'t0'::timestamptz + interval '60 seconds' AND
       lease_until <= clock_timestamp() + interval '60 seconds' AS lease_from_now
  FROM idem_begin('b-defaults', 'fp');

-- "now" includes idem.clock_offset.
SET idem.clock_offset = '3h';
SELECT clock_timestamp() AS t0 \gset
SELECT claimed, expires_at - lease_until AS retention_minus_lease,
       lease_until >= :'t0'::timestamptz + interval '3 hours 10 seconds' AND
       lease_until <= clock_timestamp() + interval '3 hours 10 seconds' AS lease_from_offset_now
  FROM idem_begin('b-offset', 'fp', lease => '10 seconds', retention => '1 hour');
RESET idem.clock_offset;

-- Every claim gets a new token, greater than all before it.
SELECT claimed, token > :tok_a AS greater_token
  FROM idem_begin('b-other', 'fp-1', lease => '30 seconds', retention => '2 hours');

-- In flight: the claim above was committed by an earlier transaction and its
-- lease runs.  Not claimed, PROCESSING, and the token is not revealed.
SELECT claimed, state, token, status, body,
       expires_at - lease_until AS retention_minus_lease
  FROM idem_begin('b-new', 'fp-1');
SELECT claimed, state, token, status, body
  FROM idem_begin('b-new', 'fp-1', wait => false);
-- The asking call's own lease and retention do not change the stored claim.
SELECT key_row('', 'b-new') AS row_before \gset
SELECT claimed, state FROM idem_begin('b-new', 'fp-1', lease => '5 minutes', retention => '20 hours');
SELECT key_row('', 'b-new') = :'row_before' AS unchanged;

-- Another fingerprint while in flight: CONFLICT, nothing stored revealed.
SELECT claimed, state, token, status, body, lease_until, expires_at
  FROM idem_begin('b-new', 'fp-2');
SELECT key_row('', 'b-new') = :'row_before' AS unchanged;

-- Calling idem_begin again inside the claiming transaction returns the same
-- claim with the same token, lease and expiry.
BEGIN;
SELECT token AS tok_t, lease_until AS lease_t, expires_at AS exp_t
  FROM idem_begin('b-txn', 'fp', lease => '30 seconds', retention => '2 hours') \gset
SELECT claimed, state, token = :tok_t AS same_token,
       lease_until = :'lease_t' AS same_lease, expires_at = :'exp_t' AS same_expiry
  FROM idem_begin('b-txn', 'fp', lease => '10 minutes', retention => '5 hours');
-- Even after the lease ran out on the clock, the holder still holds it.
SET LOCAL idem.clock_offset = '1 min';
SELECT claimed, state, token = :tok_t AS same_token
  FROM idem_begin('b-txn', 'fp');
-- A different fingerprint is a conflict even for the holder.
SELECT claimed, state, token FROM idem_begin('b-txn', 'fp-other');
COMMIT;
-- After commit the same session is just another caller: in flight.
SELECT claimed, state, token FROM idem_begin('b-txn', 'fp');

-- Done: the stored response is replayed with the same fingerprint.
SELECT idem_complete('b-new', 'fp-1', 201, 'created', :tok_a) IS NOT NULL AS completed;
SELECT expires_at AS done_exp FROM idem.keys WHERE key = 'b-new' \gset
SELECT claimed, state, token, status, convert_from(body, 'UTF8') AS body,
       lease_until, expires_at = :'done_exp' AS stored_expiry
  FROM idem_begin('b-new', 'fp-1');
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin('b-new', 'fp-1', wait => false);
-- A replay changes nothing.
SELECT key_row('', 'b-new') AS row_before \gset
SELECT claimed, state FROM idem_begin('b-new', 'fp-1', lease => '5 minutes', retention => '20 hours');
SELECT key_row('', 'b-new') = :'row_before' AS unchanged;

-- Another fingerprint after done: CONFLICT, neither status nor body nor token.
SELECT claimed, state, token, status, body, lease_until, expires_at
  FROM idem_begin('b-new', 'fp-2');
SELECT key_row('', 'b-new') = :'row_before' AS unchanged;

-- A stored NULL body replays as NULL with its status.
SELECT token AS tok_n FROM idem_begin('b-nullbody', 'fp') \gset
SELECT idem_complete('b-nullbody', 'fp', 204, NULL, :tok_n) IS NOT NULL AS completed;
SELECT claimed, state, status, body IS NULL AS null_body FROM idem_begin('b-nullbody', 'fp');

-- Binary bodies come back byte for byte.
SELECT token AS tok_bin FROM idem_begin('b-binary', 'fp') \gset
SELECT idem_complete('b-binary', 'fp', 200, '\x00ff00fe'::bytea, :tok_bin) IS NOT NULL AS completed;
SELECT state, status, body FROM idem_begin('b-binary', 'fp');

-- Keys are unique per (scope, key): the same key in two scopes is two keys.
SELECT claimed, state, token AS tok_s1 FROM idem_begin('b-scoped', 'fp', scope => 'tenant-1') \gset
\echo :claimed :state
SELECT claimed, state, token > :tok_s1 AS own_token
  FROM idem_begin('b-scoped', 'other-fp', scope => 'tenant-2');
SELECT claimed, state FROM idem_begin('b-scoped', 'fp');
SELECT idem_complete('b-scoped', 'fp', 200, 'one', :tok_s1, scope => 'tenant-1') IS NOT NULL AS completed;
SELECT scope, state, status, convert_from(body, 'UTF8') AS body
  FROM (VALUES ('tenant-1'), ('tenant-2'), ('')) s(scope),
       LATERAL idem_begin('b-scoped', 'fp', scope => s.scope)
  ORDER BY scope;
SELECT scope, key, status FROM idem.keys WHERE key = 'b-scoped' ORDER BY scope;

-- A claim held by another, uncommitted transaction (here a prepared one):
-- wait => false answers at once as in flight; wait => true waits for it,
-- bounded by lock_timeout.
SET statement_timeout = '20s';
BEGIN;
SELECT claimed, state FROM idem_begin('b-prepared', 'fp');
PREPARE TRANSACTION 'idem_begin_held';
SELECT claimed, state, token FROM idem_begin('b-prepared', 'fp', wait => false);
SELECT claimed, state, token FROM idem_begin('b-prepared', 'fp-other', wait => false);
SET lock_timeout = '100ms';
SELECT try($$SELECT idem_begin('b-prepared', 'fp')$$);
RESET lock_timeout;
-- Its rollback leaves the key free.
ROLLBACK PREPARED 'idem_begin_held';
SELECT count(*) FROM idem.keys WHERE key = 'b-prepared';
SELECT claimed, state, token AS tok_p FROM idem_begin('b-prepared', 'fp', wait => false) \gset
\echo :claimed :state
-- A completion held by an uncommitted transaction is not visible yet: the
-- committed claim is still in flight, with or without wait; once the
-- completion commits, it replays.
BEGIN;
SELECT idem_complete('b-prepared', 'fp', 200, 'paid', :tok_p) IS NOT NULL AS completed;
PREPARE TRANSACTION 'idem_complete_held';
SELECT claimed, state, token, status FROM idem_begin('b-prepared', 'fp', wait => false);
SET lock_timeout = '100ms';
SELECT claimed, state, token, status FROM idem_begin('b-prepared', 'fp');
RESET lock_timeout;
COMMIT PREPARED 'idem_complete_held';
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin('b-prepared', 'fp', wait => false);
RESET statement_timeout;
