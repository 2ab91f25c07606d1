--
-- What the storage door checks besides the columns: replica identity,
-- the token sequence's increment and persistence, an unlogged or
-- partitioned table, the primary key's collation and operator class,
-- copies of the primary key; that an update of a toasted key stays
-- HOT; and the row type idem_begin returns.  Each change is rolled back
-- afterwards.
--
SELECT token AS tok FROM idem_begin('sh-held', 'fp', lease => '1 hour') \gset
SELECT token AS tok_exp FROM idem_begin('sh-exp', 'fp', lease => '1s', retention => '1 min') \gset
SELECT keys_digest() AS digest0 \gset

-- 1. Replica identity: a table whose deletes and updates are published
-- needs one, as the executor's CheckCmdReplicaIdentity demands of a
-- plain DELETE or UPDATE.  Release, purge, complete and extend are
-- refused (55000); a new key is an insert, which needs none.
BEGIN;
SET LOCAL client_min_messages = error;
ALTER TABLE idem.keys REPLICA IDENTITY NOTHING;
CREATE PUBLICATION idem_shape_pub FOR TABLE idem.keys;
SELECT try($$DELETE FROM idem.keys WHERE key = 'sh-held'$$);
SELECT try($$SELECT idem_release('sh-held', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_extend('sh-held', $$ || :tok || $$, '2 hours')$$);
SELECT try($$SELECT idem_complete('sh-held', 'fp', 200, 'x', $$ || :tok || $$)$$);
SET LOCAL idem.clock_offset = '1h';
SELECT try($$SELECT idem_purge()$$);
SELECT try($$SELECT claimed FROM idem_begin('sh-exp', 'fp')$$);
SELECT claimed, state FROM idem_begin('sh-new', 'fp');
ROLLBACK;
-- Publishing inserts only, or with REPLICA IDENTITY FULL, all work.
BEGIN;
SET LOCAL client_min_messages = error;
ALTER TABLE idem.keys REPLICA IDENTITY NOTHING;
CREATE PUBLICATION idem_shape_pub FOR TABLE idem.keys WITH (publish = 'insert');
SELECT idem_release('sh-held', :tok) AS released;
ROLLBACK;
BEGIN;
SET LOCAL client_min_messages = error;
ALTER TABLE idem.keys REPLICA IDENTITY FULL;
CREATE PUBLICATION idem_shape_pub FOR TABLE idem.keys;
SELECT idem_extend('sh-held', :tok, '2 hours') IS NOT NULL AS extended;
SELECT idem_release('sh-held', :tok) AS released;
ROLLBACK;

-- 2. The token sequence: an increment other than 1 (tokens would be
-- drawn twice for every new key) and an unlogged sequence (reset by a
-- crash, so tokens would go backwards) are refused.
BEGIN;
ALTER SEQUENCE idem.token_seq INCREMENT BY 2;
SELECT try($$SELECT idem_begin('sh-new', 'fp')$$);
ROLLBACK;
BEGIN;
ALTER SEQUENCE idem.token_seq SET UNLOGGED;
SELECT try($$SELECT idem_begin('sh-new', 'fp')$$);
ROLLBACK;

-- 3. An unlogged table (emptied by a crash) and a table made a partition
-- of another (idem does not check partition constraints) are refused.
BEGIN;
ALTER TABLE idem.keys SET UNLOGGED;
SELECT try($$SELECT idem_begin('sh-new', 'fp')$$);
SELECT try($$SELECT * FROM idem_lookup('sh-held')$$);
ROLLBACK;
BEGIN;
CREATE TABLE idem_shape_parent (LIKE idem.keys) PARTITION BY LIST (scope);
CREATE TABLE idem_shape_x PARTITION OF idem_shape_parent FOR VALUES IN ('x');
ALTER TABLE idem_shape_parent ATTACH PARTITION idem.keys DEFAULT;
SELECT try($$SELECT idem_begin('sh-new', 'fp', scope => 'x')$$);
SELECT try($$SELECT idem_begin('sh-new', 'fp')$$);
ROLLBACK;

-- 4. The primary key must find keys as text_ops with the C collation do:
-- another collation (a nondeterministic one would hold 'Order-42' and
-- 'ORDER-42' equal) or operator class is refused.
CREATE COLLATION idem_shape_ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
-- PostgreSQL makes no such primary key itself (it has no default sorting
-- behavior), but a superuser can change the catalog.
BEGIN;
UPDATE pg_index SET indcollation = (SELECT oid::text || ' 950' FROM pg_collation WHERE collname = 'idem_shape_ci')::oidvector
 WHERE indexrelid = 'idem.keys_pkey'::regclass;
SELECT try($$SELECT idem_begin('SH-HELD', 'fp')$$);
ROLLBACK;
-- A unique index beside the primary key with another operator class is
-- not a copy of it.
BEGIN;
CREATE UNIQUE INDEX keys_pkey_ccnew ON idem.keys (key text_pattern_ops, scope);
SELECT try($$SELECT idem_begin('sh-new', 'fp')$$);
ROLLBACK;
DROP COLLATION idem_shape_ci;

-- 5. Copies of the primary key, as REINDEX CONCURRENTLY builds them, are
-- maintained: a claim and a takeover are in both indexes.  Another index
-- on the same columns but with an INCLUDE column is not a copy.
BEGIN;
CREATE UNIQUE INDEX keys_pkey_ccnew ON idem.keys (key, scope);
SELECT claimed FROM idem_begin('sh-new', 'fp');
SET LOCAL idem.clock_offset = '1h';
SELECT claimed FROM idem_begin('sh-exp', 'fp2');
SELECT count(*) AS rows, count(*) FILTER (WHERE key = 'sh-new') AS new_key
  FROM idem.keys WHERE key LIKE 'sh-%';
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT token FROM idem.keys WHERE key = 'sh-new' AND scope = '';
SELECT token > 0 AS found_in_copy FROM idem.keys WHERE key = 'sh-new' AND scope = '';
ROLLBACK;
BEGIN;
CREATE INDEX keys_covering ON idem.keys (key, scope) INCLUDE (token);
SELECT try($$SELECT idem_begin('sh-new', 'fp')$$);
ROLLBACK;
SELECT keys_digest() = :'digest0' AS unchanged;

-- 6. Keys long enough to be toasted: extend and complete are HOT updates
-- (the stored key and scope are kept, not compared against new copies).
-- On an emptied table, every version of the two keys fits on one page.
BEGIN;
SET LOCAL idem.max_key_length = 1024;
TRUNCATE idem.keys;
CREATE TEMP TABLE long_keys ON COMMIT DROP AS
  SELECT i, repeat('k', 1020) || i AS k FROM generate_series(1000, 1001) i;
SELECT count(*) AS claimed FROM long_keys, LATERAL idem_begin(k, 'fp', scope => k) b WHERE b.claimed;
-- (counts not yet flushed from earlier transactions are in the view too)
SELECT n_tup_upd AS upd0, n_tup_hot_upd AS hot0
  FROM pg_stat_xact_user_tables WHERE relid = 'idem.keys'::regclass \gset
SELECT count(idem_extend(k, (SELECT token FROM idem.keys WHERE key = l.k), '1 hour', scope => k)) AS extended
  FROM long_keys l;
SELECT count(idem_complete(k, 'fp', 200, 'x', (SELECT token FROM idem.keys WHERE key = l.k), scope => k)) AS completed
  FROM long_keys l;
SELECT n_tup_upd - :upd0 AS updates, n_tup_hot_upd - :hot0 AS hot_updates
  FROM pg_stat_xact_user_tables WHERE relid = 'idem.keys'::regclass;
SELECT pg_column_size(k.scope) < octet_length(k.scope) AS scope_compressed, count(*)
  FROM idem.keys k JOIN long_keys l ON k.key = l.k GROUP BY 1;
SELECT count(*) AS replayed FROM long_keys, LATERAL idem_begin(k, 'fp', scope => k) b
 WHERE b.state = 'DONE' AND b.body = 'x';
ROLLBACK;

-- 7. The row type idem_begin returns (idem.begin_result) can be altered
-- by its owner.  A column added or changed is refused (42804) before the
-- key is looked at; a column dropped and added back at the end reads
-- NULL where it was, and the row keeps its values in their columns.
BEGIN;
ALTER TYPE idem.begin_result ADD ATTRIBUTE extra int4;
SELECT try($$SELECT claimed FROM idem_begin('sh-type', 'fp')$$);
SELECT try($$SELECT claimed FROM idem_begin('sh-held', 'fp')$$);
ALTER TYPE idem.begin_result DROP ATTRIBUTE extra;
ALTER TYPE idem.begin_result ALTER ATTRIBUTE status TYPE int8;
SELECT try($$SELECT claimed FROM idem_begin('sh-type', 'fp')$$);
ALTER TYPE idem.begin_result ALTER ATTRIBUTE status TYPE int4;
ALTER TYPE idem.begin_result DROP ATTRIBUTE phase;
SELECT try($$SELECT claimed FROM idem_begin('sh-type', 'fp')$$);
SELECT count(*) AS stored FROM idem.keys WHERE key = 'sh-type';
ALTER TYPE idem.begin_result DROP ATTRIBUTE phase_data;
ALTER TYPE idem.begin_result ADD ATTRIBUTE phase text;
ALTER TYPE idem.begin_result ADD ATTRIBUTE phase_data bytea;
SELECT claimed, state FROM idem_begin('sh-type', 'fp');
SELECT idem_complete('sh-type', 'fp', 201, 'typed') IS NOT NULL AS completed;
SELECT claimed, state, token, status, body, phase FROM idem_begin('sh-type', 'fp');
SELECT idem_checkpoint('sh-held', :tok, 'charged', '\x0102');
SET LOCAL idem.clock_offset = '2h';
SELECT claimed, state, token > :tok AS new_token, status, body, phase, phase_data
  FROM idem_begin('sh-held', 'fp');
ROLLBACK;
SELECT keys_digest() = :'digest0' AS keys_unchanged;
