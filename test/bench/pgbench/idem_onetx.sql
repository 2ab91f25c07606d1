-- idem, one transaction: claim, business write, response.
\set k random(1, 1000000000000000000)
\set aid random(1, 100000)
BEGIN;
SELECT claimed FROM idem_begin(:client_id::text || '-' || :k::text, 'fp');
UPDATE accounts SET balance = balance + 1 WHERE id = :aid;
SELECT idem_complete(:client_id::text || '-' || :k::text, 'fp', 200, '\x6f6b'::bytea);
COMMIT;
