-- idem on a completed (hot) key: the replay path.
\set k random(1, 1000)
SELECT claimed, state, status, body FROM idem_begin('hot' || :k::text, 'fp');
