-- A request seen once: claim, then store the response (kept 20 s, so the
-- purge has expired keys to delete during the run).
\set k random(1, 1000000000000000000)
SELECT token FROM idem_api.idem_begin('new-' || :k, 'fp', lease => '10s', retention => '20s') \gset
SELECT idem_api.idem_complete('new-' || :k, 'fp', 201, '\x6f6b'::bytea, token => :token);
