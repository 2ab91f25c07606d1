-- Slow requests on 5 keys, each answer kept 2 s: a duplicate arriving
-- while the first runs waits up to 1 s for its answer (wait_for), or is
-- told it is in flight.
\set k random(1, 5)
SELECT claimed::int AS claimed, token FROM idem_api.idem_begin('slow-' || :k, 'fp', lease => '2s', retention => '2s', wait_for => '1s') \gset
\if :claimed
\sleep 400 ms
SELECT idem_api.idem_complete('slow-' || :k, 'fp', 200, '\x6f6b'::bytea, token => :token);
\endif
