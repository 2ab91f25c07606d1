-- idem, multi-step: claim in one transaction, complete in another.
\set k random(1, 1000000000000000000)
SELECT token FROM idem_begin(:client_id::text || '-' || :k::text, 'fp') \gset
SELECT idem_complete(:client_id::text || '-' || :k::text, 'fp', 200, '\x6f6b'::bytea, :token);
