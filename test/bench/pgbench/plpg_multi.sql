-- PL/pgSQL functions, multi-step.
\set k random(1, 1000000000000000000)
SELECT token FROM plpg_begin(:client_id::text || '-' || :k::text, 'fp') \gset
SELECT plpg_complete(:client_id::text || '-' || :k::text, 'fp', 200, '\x6f6b'::bytea, :token);
