-- PL/pgSQL functions, one transaction.
\set k random(1, 1000000000000000000)
\set aid random(1, 100000)
BEGIN;
SELECT token FROM plpg_begin(:client_id::text || '-' || :k::text, 'fp') \gset
UPDATE accounts SET balance = balance + 1 WHERE id = :aid;
SELECT plpg_complete(:client_id::text || '-' || :k::text, 'fp', 200, '\x6f6b'::bytea, :token);
COMMIT;
