--
-- The storage boundary: read-only transactions, the table's shape, locks,
-- command ids, and the holder checks of complete, release and extend.
--

-- A claim to work with, committed.
SELECT token AS tok FROM idem_begin('st-held', 'fp', lease => '1 minute') \gset
SELECT token AS tok_done FROM idem_begin('st-done', 'fp') \gset
SELECT idem_complete('st-done', 'fp', 200, convert_to('{"ok":1}', 'UTF8'), :tok_done) IS NOT NULL AS completed;
SELECT keys_digest() AS digest0 \gset

-- 1. Every writing path refuses a read-only transaction with 25006, as
-- nextval() does, and changes nothing; answers that write nothing (a
-- replay, a conflict, a claim in flight) still work.
BEGIN READ ONLY;
SELECT try($$SELECT idem_complete('st-held', 'fp', 200, 'x', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
SELECT try($$SELECT idem_release('st-held', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_purge()$$);
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('st-done', 'fp');
SELECT claimed, state FROM idem_begin('st-done', 'other');
SELECT claimed, state FROM idem_begin('st-held', 'fp');
COMMIT;
SET default_transaction_read_only = on;
SELECT try($$SELECT idem_complete('st-held', 'fp', 200, 'x', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
SELECT try($$SELECT idem_release('st-held', $$ || :tok || $$)$$);
RESET default_transaction_read_only;
-- A SERIALIZABLE READ ONLY transaction cannot write either (no write skew).
BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY;
SELECT try($$SELECT idem_release('st-held', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
COMMIT;
-- An expired key needs a write to be claimed again.
SET idem.clock_offset = '2d';
BEGIN READ ONLY;
SELECT try($$SELECT idem_begin('st-done', 'fp')$$);
COMMIT;
RESET idem.clock_offset;
SELECT keys_digest() = :'digest0' AS unchanged;

-- 2. A table altered beyond what idem maintains is refused with 55000 and
-- a message naming what is in the way; nothing is written past it.  Each
-- change is rolled back afterwards.
BEGIN;
CREATE INDEX keys_expires_at ON idem.keys (expires_at);
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
SELECT try($$SELECT * FROM idem_lookup('st-held')$$);
ROLLBACK;
BEGIN;
ALTER TABLE idem.keys ADD COLUMN note text;
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
ALTER TABLE idem.keys DROP COLUMN note;
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
ROLLBACK;
-- claimed_by cannot be dropped or retyped (the extension and the
-- idem_keys view depend on it), and a changed one is refused.
SELECT try($$ALTER TABLE idem.keys DROP COLUMN claimed_by$$);
SELECT try($$ALTER TABLE idem.keys ALTER COLUMN claimed_by TYPE varchar$$);
BEGIN;
ALTER TABLE idem.keys ALTER COLUMN claimed_by SET NOT NULL;
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
ROLLBACK;
BEGIN;
ALTER TABLE idem.keys ADD CONSTRAINT http_status CHECK (status BETWEEN 100 AND 599);
SELECT try($$SELECT idem_complete('st-held', 'fp', 700, 'x', $$ || :tok || $$)$$);
ROLLBACK;
BEGIN;
ALTER TABLE idem.keys ALTER COLUMN expires_at DROP NOT NULL;
SELECT try($$SELECT idem_complete('st-held', 'fp', 200, 'x', $$ || :tok || $$)$$);
ROLLBACK;
BEGIN;
CREATE FUNCTION st_note() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$;
CREATE TRIGGER st_note BEFORE UPDATE ON idem.keys FOR EACH ROW EXECUTE FUNCTION st_note();
SELECT try($$SELECT idem_extend('st-held', $$ || :tok || $$, '5 minutes')$$);
ROLLBACK;
BEGIN;
CREATE TABLE st_orders (scope text COLLATE "C", key text COLLATE "C",
                        FOREIGN KEY (scope, key) REFERENCES idem.keys);
SELECT try($$SELECT idem_release('st-held', $$ || :tok || $$)$$);
ROLLBACK;
BEGIN;
ALTER SEQUENCE idem.token_seq CACHE 50;
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
ROLLBACK;
BEGIN;
ALTER SEQUENCE idem.token_seq CYCLE;
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
ROLLBACK;
BEGIN;
ALTER TABLE idem.keys DROP CONSTRAINT keys_pkey;
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
ROLLBACK;
BEGIN;
ALTER TABLE idem.keys DROP CONSTRAINT keys_pkey,
  ADD CONSTRAINT keys_pkey PRIMARY KEY (key, scope, token);
SELECT try($$SELECT idem_begin('st-new', 'fp')$$);
ROLLBACK;
-- After the rollbacks, the table is usable again.
SELECT idem_extend('st-held', :tok, '1 minute') IS NOT NULL AS extended;

-- 4. Command ids: a key completed with a short retention in the same
-- statement as the purge that deletes it.
SELECT token AS tok_cid FROM idem_begin('st-cid', 'fp') \gset
SELECT idem_complete('st-cid', 'fp', 200, 'x', :tok_cid, retention => '1 second') IS NOT NULL AS completed,
       set_config('idem.clock_offset', '10', false) IS NOT NULL AS clock_moved,
       idem_purge() >= 1 AS purged;
RESET idem.clock_offset;
SELECT count(*) AS left_behind FROM idem.keys WHERE key = 'st-cid';

-- 5. Relation locks are held until the transaction ends, as after any
-- statement that writes.
BEGIN;
SELECT claimed FROM idem_begin('st-locks', 'fp');
SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
 WHERE l.pid = pg_backend_pid() AND c.relnamespace = 'idem'::regnamespace
 ORDER BY c.relname, l.mode;
COMMIT;

-- 8. A token the key never had is not "superseded"; status must not be
-- negative.
SELECT regexp_replace(try($$SELECT idem_complete('st-held', 'fp', 200, 'x', $$ || :tok + 1000000 || $$)$$),
                      'token \d+', 'token N') AS never_issued;
SELECT try($$SELECT idem_complete('st-held', 'fp', -1, 'x', $$ || :tok || $$)$$);
SELECT idem_complete('st-held', 'fp', 0, 'x', :tok) IS NOT NULL AS status_zero_stored;

-- 14. idem_extend never shortens a lease.
SELECT token AS tok_ext, lease_until AS lease0
  FROM idem_begin('st-extend', 'fp', lease => '10 minutes') \gset
SELECT idem_extend('st-extend', :tok_ext, '1 minute') = :'lease0'::timestamptz AS not_shortened;
SELECT lease_until = :'lease0'::timestamptz AS stored_lease_kept FROM idem.keys WHERE key = 'st-extend';
SELECT idem_extend('st-extend', :tok_ext, '20 minutes') > :'lease0'::timestamptz AS lengthened;

-- 14. A superseded holder gets ID002 even if the key was claimed again
-- with another request; a caller without a token learns nothing of the
-- stored fingerprint (ID003 first).
SELECT token AS tok_old FROM idem_begin('st-reused', 'fp-a') \gset
SELECT idem_release('st-reused', :tok_old) AS released;
SELECT token AS tok_new FROM idem_begin('st-reused', 'fp-b') \gset
SELECT try($$SELECT idem_complete('st-reused', 'fp-a', 200, 'x', $$ || :tok_old || $$)$$);
SELECT try($$SELECT idem_complete('st-reused', 'fp-a', 200, 'x')$$);
SELECT try($$SELECT idem_complete('st-reused', 'fp-a', 200, 'x', $$ || :tok_new || $$)$$);

-- 14. A transaction that only extended a key does not hold its claim.
SELECT token AS tok_x FROM idem_begin('st-extender', 'fp', lease => '1 minute') \gset
BEGIN;
SELECT idem_extend('st-extender', :tok_x, '2 minutes') IS NOT NULL AS extended;
SELECT claimed, state, token FROM idem_begin('st-extender', 'fp');
SELECT try($$SELECT idem_complete('st-extender', 'fp', 200, 'x')$$);
SELECT try($$SELECT idem_release('st-extender', NULL)$$);
COMMIT;

-- 14. Keys in error messages are cut at 64 bytes.
SELECT try($$SELECT idem_complete(repeat('long-', 40), 'fp', 200, 'x', 1)$$);

-- 10. Bodies as bytes: JSON with backslashes and newlines replays as stored.
SELECT token AS tok_json FROM idem_begin('st-json', 'fp') \gset
SELECT idem_complete('st-json', 'fp', 200, convert_to(E'{"path":"C:\\\\tmp","text":"a\\nb"}', 'UTF8'), :tok_json) IS NOT NULL AS completed;
SELECT convert_from(body, 'UTF8') AS body FROM idem_begin('st-json', 'fp');
