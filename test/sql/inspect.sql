--
-- Inspection: idem_lookup(key, scope) and the idem_keys view show what is
-- stored for a key (state, token, status, times, body size), never the
-- body.  Scopes are separate key spaces: the same key and fingerprint in
-- two scopes never see each other's claim or response.  Uses try(),
-- keys_digest() and key_row() from setup.sql.
--

-- A claim in flight, a completed key, a key completed with a NULL body and
-- one with a body large enough to be stored out of line.
SELECT token AS tok_f, lease_until AS lease_f, expires_at AS exp_f
  FROM idem_begin('n-flight', 'fp', lease => '5 minutes', retention => '1 hour') \gset
SELECT token AS tok_d FROM idem_begin('n-done', 'fp') \gset
SELECT idem_complete('n-done', 'fp', 201, 'twelve bytes', :tok_d, retention => '2 hours') AS exp_d \gset
SELECT token AS tok_n FROM idem_begin('n-null', 'fp') \gset
SELECT idem_complete('n-null', 'fp', 204, NULL, :tok_n) IS NOT NULL AS completed;
SELECT token AS tok_big FROM idem_begin('n-big', 'fp') \gset
SELECT idem_complete('n-big', 'fp', 200, convert_to(repeat('x', 300000), 'UTF8'), :tok_big) IS NOT NULL AS completed;

-- The stored state, the current token, the times as stored, the body's
-- size in bytes.
SELECT state, token = :tok_f AS same_token, status, lease_until = :'lease_f' AS same_lease,
       expires_at = :'exp_f' AS same_expiry, body_size
  FROM idem_lookup('n-flight');
SELECT state, token = :tok_d AS same_token, status, lease_until,
       expires_at = :'exp_d' AS same_expiry, body_size
  FROM idem_lookup('n-done', '');
SELECT state, token = :tok_n AS same_token, status, lease_until, body_size FROM idem_lookup('n-null');
SELECT state, status, body_size FROM idem_lookup('n-big');
-- No row for a key that is not stored, or is stored in another scope.
SELECT count(*) AS unknown_key FROM idem_lookup('n-unknown');
SELECT count(*) AS other_scope FROM idem_lookup('n-done', 'tenant-x');

-- The view has the same columns for every key, plus scope and key, and no
-- body.
SELECT attname, format_type(atttypid, atttypmod)
  FROM pg_attribute WHERE attrelid = 'idem_keys'::regclass AND attnum > 0 ORDER BY attnum;
SELECT key, state, token = :tok_d AS same_token, status, lease_until,
       expires_at = :'exp_d' AS same_expiry, body_size
  FROM idem_keys WHERE scope = '' AND key = 'n-done';
-- Every row of the view is what idem_lookup says of that key, and the view
-- has every stored key.
SELECT count(*) = (SELECT count(*) FROM idem.keys) AS every_key,
       bool_and(l IS NOT DISTINCT FROM (v.state, v.token, v.status, v.lease_until,
                                        v.expires_at, v.body_size)) AS same_as_lookup
  FROM idem_keys v
  LEFT JOIN LATERAL (SELECT l FROM idem_lookup(v.key, v.scope) l) x ON true;

-- Looking changes nothing, and shows the stored state: a key whose window
-- is over is still stored (and shown) until it is claimed again or purged.
SELECT keys_digest() AS digest0 \gset
SET idem.clock_offset = '3h';
SELECT state, status, expires_at < now() + interval '3 hours' AS window_over
  FROM idem_lookup('n-done');
SELECT keys_digest() = :'digest0' AS unchanged;
SELECT claimed, state, token > :tok_d AS new_token FROM idem_begin('n-done', 'fp');
SELECT state, status, body_size FROM idem_lookup('n-done');
RESET idem.clock_offset;

-- Bad arguments: the same SQLSTATEs as the other functions.
SELECT q, try(q) FROM (VALUES
  ($$SELECT idem_lookup(NULL)$$),
  ($$SELECT idem_lookup('n-done', NULL)$$),
  ($$SELECT idem_lookup('')$$),
  ($$SELECT idem_lookup(repeat('k', 256))$$),
  ($$SELECT idem_lookup('n-done', repeat('s', 256))$$)
) t(q);

--
-- Scope isolation.
--
-- One key and one fingerprint in two scopes: two claims with their own
-- tokens.
SELECT claimed AS claimed_a, state AS state_a, token AS tok_a
  FROM idem_begin('n-shared', 'same-fp', scope => 'tenant-a') \gset
SELECT claimed AS claimed_b, state AS state_b, token AS tok_b
  FROM idem_begin('n-shared', 'same-fp', scope => 'tenant-b') \gset
SELECT :'claimed_a' AS claimed_a, :'state_a' AS state_a,
       :'claimed_b' AS claimed_b, :'state_b' AS state_b, :tok_b > :tok_a AS own_token;
-- A completes; B is still in flight, and sees nothing of A's response.
SELECT idem_complete('n-shared', 'same-fp', 200, 'response of a', :tok_a, scope => 'tenant-a') IS NOT NULL AS completed;
SELECT claimed, state, token, status, body FROM idem_begin('n-shared', 'same-fp', scope => 'tenant-b');
-- A's token does nothing to B's claim, and leaves both rows as they are.
SELECT key_row('tenant-a', 'n-shared') AS row_a, key_row('tenant-b', 'n-shared') AS row_b \gset
SELECT set_config('test.tok_a', :'tok_a', false) IS NOT NULL AS token_set;
SELECT q, try(q) FROM (VALUES
  ($$SELECT idem_complete('n-shared', 'same-fp', 200, 'response of a', current_setting('test.tok_a')::bigint, scope => 'tenant-b')$$),
  ($$SELECT idem_extend('n-shared', current_setting('test.tok_a')::bigint, '1 minute', scope => 'tenant-b')$$),
  ($$SELECT idem_release('n-shared', current_setting('test.tok_a')::bigint, scope => 'tenant-b')$$)
) t(q);
SELECT key_row('tenant-a', 'n-shared') = :'row_a' AS a_unchanged,
       key_row('tenant-b', 'n-shared') = :'row_b' AS b_unchanged;
-- B completes with its own response; each scope replays its own.
SELECT idem_complete('n-shared', 'same-fp', 202, 'response of b', :tok_b, scope => 'tenant-b') IS NOT NULL AS completed;
SELECT s.scope, claimed, state, status, convert_from(body, 'UTF8') AS body
  FROM (VALUES ('tenant-a'), ('tenant-b')) s(scope),
       LATERAL idem_begin('n-shared', 'same-fp', scope => s.scope)
 ORDER BY 1;
SELECT scope, state, status, body_size FROM idem_keys WHERE key = 'n-shared' ORDER BY scope;
-- Scopes and keys compare as whole byte strings: neither a split moved
-- between scope and key, nor case, nor a trailing space, nor the empty
-- scope reaches tenant-a's response.
SELECT format('%L', s.scope) AS scope, format('%L', s.key) AS key, claimed, state, status, body
  FROM (VALUES ('tenant-', 'an-shared'), ('tenant-an', '-shared'), ('tenant-a:', 'n-shared'),
               ('Tenant-A', 'n-shared'), ('tenant-a ', 'n-shared'), ('', 'n-shared'),
               ('tenant-a', 'N-SHARED'), ('tenant-a', 'n-shared ')) s(scope, key),
       LATERAL idem_begin(s.key, 'same-fp', scope => s.scope, wait => false)
 ORDER BY s.scope COLLATE "C", s.key COLLATE "C";
-- Those claims changed neither response.
SELECT scope, format('%L', key) AS key, state, status, body_size FROM idem_keys
 WHERE scope IN ('tenant-a', 'tenant-b') ORDER BY scope, key COLLATE "C";
