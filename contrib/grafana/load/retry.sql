-- Retries of 200 popular requests: the first executes, later ones replay
-- (each response kept 30 s, then the request executes again).
\set k random(1, 200)
SELECT claimed::int AS claimed, token FROM idem_api.idem_begin('hot-' || :k, 'fp', lease => '10s', retention => '30s') \gset
\if :claimed
SELECT idem_api.idem_complete('hot-' || :k, 'fp', 200, '\x6f6b'::bytea, token => :token);
\endif
