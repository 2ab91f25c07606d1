-- Claim, work and response in one transaction on 5 keys, each answer
-- kept 1 s: a duplicate waits for the transaction holding the key.
\set k random(1, 5)
BEGIN;
SELECT claimed::int AS claimed FROM idem_api.idem_begin('tx-' || :k, 'fp', lease => '1s', retention => '1s') \gset
\if :claimed
SELECT pg_sleep(0.2);
SELECT idem_api.idem_complete('tx-' || :k, 'fp', 200, '\x6f6b'::bytea);
\endif
COMMIT;
