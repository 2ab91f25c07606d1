-- 16 hot keys: claim without waiting, record the holder, release.
\set k random(1, 16)
SELECT claimed::int AS held, token FROM idem_begin('c' || :k::text, 'fp', wait => false) \gset
\if :held
INSERT INTO holders VALUES (:k, :token);
INSERT INTO claims_log VALUES (:k, :token);
DELETE FROM holders WHERE k = :k AND token = :token;
SELECT idem_release('c' || :k::text, :token);
\endif
