-- Plain SQL, multi-step: insert-or-lock the key, then store the response.
\set k random(1, 1000000000000000000)
BEGIN;
INSERT INTO plain_keys (scope, key, fingerprint, token, lease_until, expires_at) VALUES ('', :client_id::text || '-' || :k::text, sha256('fp'::bytea), nextval('plain_token_seq'), clock_timestamp() + '60s', clock_timestamp() + '1 day') ON CONFLICT DO NOTHING;
SELECT token, status FROM plain_keys WHERE scope = '' AND key = :client_id::text || '-' || :k::text FOR UPDATE \gset
COMMIT;
UPDATE plain_keys SET status = 200, body = '\x6f6b', lease_until = NULL, expires_at = clock_timestamp() + '1 day' WHERE scope = '' AND key = :client_id::text || '-' || :k::text AND token = :token AND status IS NULL;
