-- Plain primary-key lookup of a stored response.
\set k random(1, 1000)
SELECT status, body FROM plain_keys WHERE scope = '' AND key = 'hot' || :k::text;
