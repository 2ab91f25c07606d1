-- Callers that claim one of 15 keys with a 3 s lease and never complete
-- (they crashed): the claim is stuck until a retry takes it over.
\set k random(1, 15)
SELECT claimed FROM idem_api.idem_begin('lost-' || :k, 'fp', lease => '3s', retention => '60s');
