-- A client reusing a key for another request: 422 once the first is
-- stored, in flight while it runs, or a claim of its own if it is first.
\set k random(1, 200)
SELECT claimed::int AS claimed, token FROM idem_api.idem_begin('hot-' || :k, 'other-fp', lease => '10s', retention => '30s') \gset
\if :claimed
SELECT idem_api.idem_complete('hot-' || :k, 'other-fp', 200, '\x6f6b'::bytea, token => :token);
\endif
