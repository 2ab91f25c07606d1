--
-- Batches: idem_begin_many and idem_complete_many answer one row per item,
-- in input order, each as idem_begin or idem_complete would for its key;
-- a key repeated in a batch is claimed once.  Re-entrant holders:
-- idem_begin(..., holder => text).  Uses try(), keys_digest() from
-- setup.sql.
--
DELETE FROM idem.keys;
RESET idem.clock_offset;
\set VERBOSITY default

-- Bad input claims nothing, and says which argument and item is wrong.
SELECT keys_digest() AS before \gset
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a', 'b', 'c'], ARRAY['f', 'f'])$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a', NULL, 'c'], ARRAY['f', 'f', 'f'])$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a', 'b', 'c'], ARRAY['f', 'f', NULL])$$);
SELECT try($$SELECT * FROM idem_begin_many(NULL, ARRAY['f'])$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a'], NULL)$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a', ''], ARRAY['f', 'f'])$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a', repeat('k', 300)], ARRAY['f', 'f'])$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY[['a', 'b'], ['c', 'd']], ARRAY[['f', 'f'], ['f', 'f']])$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a'], ARRAY['f'], lease => '2 days')$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a'], ARRAY['f'], holder => '')$$);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a'], ARRAY['f'], scope => NULL)$$);
-- More than idem.max_batch items: the limit is named, nothing claimed.
SET idem.max_batch = 3;
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['a', 'b', 'c', 'd'], ARRAY['f', 'f', 'f', 'f'])$$);
SELECT count(*) AS items FROM idem_begin_many(ARRAY['m1', 'm2', 'm3'], ARRAY['f', 'f', 'f']);
RESET idem.max_batch;
DELETE FROM idem.keys WHERE key IN ('m1', 'm2', 'm3');
SELECT keys_digest() = :'before' AS nothing_claimed;
-- The error as a client sees it (errors below show the same way).
SELECT * FROM idem_begin_many(ARRAY['a', 'b'], ARRAY['f', 'f', 'f']);
SELECT * FROM idem_begin_many(ARRAY['a', NULL], ARRAY['f', 'f']);
-- Empty arrays: no rows.
SELECT count(*) AS rows FROM idem_begin_many('{}'::text[], '{}'::text[]);
SELECT count(*) AS rows FROM idem_complete_many('{}', '{}', '{}', '{}');
-- idem_complete_many checks the same way.
SELECT try($$SELECT * FROM idem_complete_many(ARRAY['a'], ARRAY['f'], ARRAY[200, 201], ARRAY['x']::bytea[])$$);
SELECT try($$SELECT * FROM idem_complete_many(ARRAY['a'], ARRAY['f'], ARRAY[200], ARRAY['x']::bytea[], ARRAY[1, 2]::bigint[])$$);
SELECT try($$SELECT * FROM idem_complete_many(ARRAY['a', 'b'], ARRAY['f', 'f'], ARRAY[200, NULL], ARRAY['x', 'y']::bytea[])$$);
SELECT try($$SELECT * FROM idem_complete_many(ARRAY['a', 'b'], ARRAY['f', 'f'], ARRAY[200, -1], ARRAY['x', 'y']::bytea[])$$);
SELECT try($$SELECT * FROM idem_complete_many(ARRAY['a'], ARRAY['f'], ARRAY[200], NULL)$$);
SELECT keys_digest() = :'before' AS nothing_claimed;

-- Per-item states, in input order.  Set up: a completed key, a claim in
-- flight (committed, live lease), a key stored with another fingerprint,
-- an abandoned claim (lease over) with a recovery point.
SELECT token AS tok FROM idem_begin('b-done', 'fp') \gset
SELECT idem_complete('b-done', 'fp', 201, convert_to('made', 'UTF8'), :tok) IS NOT NULL AS completed;
SELECT token AS tok_flight FROM idem_begin('b-flight', 'fp', lease => '10 minutes') \gset
SELECT claimed FROM idem_begin('b-other', 'other');
SELECT token AS tok_stale FROM idem_begin('b-stale', 'fp', lease => '1 second') \gset
SELECT idem_checkpoint('b-stale', :tok_stale, 'step-1', convert_to('half', 'UTF8'));
SET idem.clock_offset = '2s';
-- b-new twice (the second a DUPLICATE of item 1), b-new-2 twice with
-- another fingerprint (CONFLICT, naming item 2).
SELECT ordinality, claimed, state, token > :tok_stale AS new_token, status,
       convert_from(body, 'UTF8') AS body, lease_until IS NOT NULL AS leased,
       expires_at IS NOT NULL AS expires, phase, convert_from(phase_data, 'UTF8') AS phase_data,
       duplicate_of
  FROM idem_begin_many(ARRAY['b-new', 'b-new-2', 'b-done', 'b-flight', 'b-other', 'b-stale', 'b-new', 'b-new-2'],
                       ARRAY['fp', 'fp', 'fp', 'fp', 'fp', 'fp', 'fp', 'x'], wait => false);
-- The repeated key was claimed once.
SELECT key, count(*) FROM idem.keys WHERE key LIKE 'b-new%' GROUP BY key ORDER BY key;
-- A batch run again in the same transaction: this transaction's claims.
BEGIN;
SELECT ordinality, claimed, state, duplicate_of FROM idem_begin_many(ARRAY['b-tx', 'b-tx'], ARRAY['fp', 'fp']);
SELECT ordinality, claimed, state FROM idem_begin_many(ARRAY['b-tx'], ARRAY['fp']);
-- complete_many without tokens completes this transaction's claims.
SELECT ordinality, expires_at > now() AS expires_later
  FROM idem_complete_many(ARRAY['b-tx'], ARRAY['fp'], ARRAY[204], ARRAY[NULL]::bytea[]);
COMMIT;
SELECT ordinality, state, status, body FROM idem_begin_many(ARRAY['b-tx'], ARRAY['fp']);
RESET idem.clock_offset;

-- idem_complete_many with tokens, from another transaction; rows in
-- input order, each key completed as idem_complete would.
SELECT array_agg(token ORDER BY ordinality) AS toks
  FROM idem_begin_many(ARRAY['c-2', 'c-1', 'c-3'], ARRAY['f2', 'f1', 'f3']) \gset
SELECT ordinality, expires_at > now() + interval '1 hour' AS retention_applied
  FROM idem_complete_many(ARRAY['c-2', 'c-1', 'c-3'], ARRAY['f2', 'f1', 'f3'], ARRAY[200, 201, 202],
                          ARRAY[convert_to('two', 'UTF8'), convert_to('one', 'UTF8'), NULL],
                          tokens => :'toks', retention => '2 hours');
SELECT ordinality, state, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin_many(ARRAY['c-1', 'c-2', 'c-3'], ARRAY['f1', 'f2', 'f3']);
-- The same responses again are accepted (as idem_complete again is).
SELECT count(*) AS again FROM idem_complete_many(ARRAY['c-2'], ARRAY['f2'], ARRAY[200],
                                                 ARRAY[convert_to('two', 'UTF8')], ARRAY[(:'toks'::bigint[])[1]]);

-- An error for one item fails the statement, names the item and its key,
-- and stores nothing of the batch.
SELECT token AS tok_d1 FROM idem_begin('d-1', 'fp') \gset
SELECT token AS tok_d2 FROM idem_begin('d-2', 'fp', lease => '1 second') \gset
SET idem.clock_offset = '2s';
SELECT token AS tok_d2_new FROM idem_begin('d-2', 'fp') \gset
RESET idem.clock_offset;
SELECT keys_digest() AS before_errors \gset
-- ID002: item 2's token was superseded by a takeover (the detail names
-- the token, left out here).
CREATE FUNCTION pg_temp.try_context(q text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	ctx text;
BEGIN
	EXECUTE q;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS ctx = PG_EXCEPTION_CONTEXT;
	RETURN SQLSTATE || ': ' || SQLERRM || E'\nCONTEXT: ' || split_part(ctx, E'\n', 1);
END $$;
SELECT pg_temp.try_context(format($$SELECT * FROM idem_complete_many(ARRAY['d-1', 'd-2'], ARRAY['fp', 'fp'],
       ARRAY[200, 200], ARRAY['x', 'y']::bytea[], ARRAY[%s, %s])$$, :tok_d1, :tok_d2));
-- ID003: item 3 was never claimed.
SELECT * FROM idem_complete_many(ARRAY['d-1', 'd-2', 'd-none'], ARRAY['fp', 'fp', 'fp'],
                                 ARRAY[200, 200, 200], ARRAY['x', 'y', 'z']::bytea[],
                                 ARRAY[:tok_d1, :tok_d2_new, 1]);
-- ID001: item 1 has another fingerprint.
SELECT * FROM idem_complete_many(ARRAY['d-1'], ARRAY['other'], ARRAY[200], ARRAY['x']::bytea[],
                                 ARRAY[:tok_d1]);
SELECT keys_digest() = :'before_errors' AS nothing_stored;
SELECT count(*) AS completed FROM idem_complete_many(ARRAY['d-2', 'd-1'], ARRAY['fp', 'fp'], ARRAY[200, 200],
                                 ARRAY['y', 'x']::bytea[], ARRAY[:tok_d2_new, :tok_d1]);
SELECT key, status, convert_from(body, 'UTF8') AS body FROM idem.keys WHERE key LIKE 'd-%' ORDER BY key;

-- REPEATABLE READ and SERIALIZABLE: each item as idem_begin answers there.
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT ordinality, claimed, state, status, duplicate_of
  FROM idem_begin_many(ARRAY['r-new', 'c-1', 'r-new'], ARRAY['fp', 'f1', 'fp']);
SELECT ordinality FROM idem_complete_many(ARRAY['r-new'], ARRAY['fp'], ARRAY[200], ARRAY['rr']::bytea[]);
COMMIT;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT ordinality, claimed, state, status
  FROM idem_begin_many(ARRAY['s-new', 'r-new'], ARRAY['fp', 'fp']);
SELECT ordinality FROM idem_complete_many(ARRAY['s-new'], ARRAY['fp'], ARRAY[200], ARRAY['ss']::bytea[]);
COMMIT;
-- Read-only: replays are answered, claims refused.
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
SELECT ordinality, state FROM idem_begin_many(ARRAY['s-new', 'r-new'], ARRAY['fp', 'fp']);
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['ro-new'], ARRAY['fp'])$$);
COMMIT;

-- A role that is not a superuser, granted only the batch functions.
CREATE ROLE regress_idem_batch;
GRANT EXECUTE ON FUNCTION
  idem_begin_many(text[], text[], interval, interval, text, boolean, interval, interval, text),
  idem_complete_many(text[], text[], integer[], bytea[], bigint[], interval, text)
  TO regress_idem_batch;
SET ROLE regress_idem_batch;
SELECT try($$SELECT * FROM idem_begin('x', 'fp')$$);
SELECT ordinality, claimed, state FROM idem_begin_many(ARRAY['p-2', 'p-1'], ARRAY['fp', 'fp']);
SELECT array_agg(token ORDER BY ordinality) AS ptoks
  FROM idem_begin_many(ARRAY['p-3', 'p-4'], ARRAY['fp', 'fp']) \gset
SELECT ordinality FROM idem_complete_many(ARRAY['p-4', 'p-3'], ARRAY['fp', 'fp'], ARRAY[200, 200],
                                          ARRAY['4', '3']::bytea[],
                                          ARRAY[(:'ptoks'::bigint[])[2], (:'ptoks'::bigint[])[1]]);
SELECT ordinality, state, convert_from(body, 'UTF8') AS body
  FROM idem_begin_many(ARRAY['p-3', 'p-4'], ARRAY['fp', 'fp']);
RESET ROLE;
-- Its claims are bound to it: another role may not complete them.
CREATE ROLE regress_idem_batch_other;
GRANT EXECUTE ON FUNCTION
  idem_complete_many(text[], text[], integer[], bytea[], bigint[], interval, text)
  TO regress_idem_batch_other;
SELECT token AS tok_p1 FROM idem.keys WHERE key = 'p-1' \gset
SET ROLE regress_idem_batch_other;
SELECT * FROM idem_complete_many(ARRAY['p-1'], ARRAY['fp'], ARRAY[200], ARRAY['x']::bytea[], ARRAY[:tok_p1]);
RESET ROLE;
REVOKE ALL ON FUNCTION
  idem_begin_many(text[], text[], interval, interval, text, boolean, interval, interval, text),
  idem_complete_many(text[], text[], integer[], bytea[], bigint[], interval, text)
  FROM regress_idem_batch, regress_idem_batch_other;
DELETE FROM idem.keys WHERE key LIKE 'p-%';
DROP ROLE regress_idem_batch, regress_idem_batch_other;

-- Scopes: the same key in two scopes is two keys.
SELECT ordinality, claimed, state FROM idem_begin_many(ARRAY['sc'], ARRAY['fp'], scope => 'tenant-1');
SELECT ordinality, claimed, state FROM idem_begin_many(ARRAY['sc'], ARRAY['fp'], scope => 'tenant-2');

-- The row type idem.begin_many_result altered: refused before anything
-- is read or written.
ALTER TYPE idem.begin_many_result ADD ATTRIBUTE extra int;
SELECT try($$SELECT * FROM idem_begin_many(ARRAY['t-1'], ARRAY['fp'])$$);
ALTER TYPE idem.begin_many_result DROP ATTRIBUTE extra;
SELECT ordinality, claimed FROM idem_begin_many(ARRAY['t-1'], ARRAY['fp']);

-- Re-entrant holders.  A claim made with a holder; the same holder, key
-- and fingerprint take it over at once, with a new, greater token and the
-- stored recovery point; the old token is fenced.
SELECT token AS h_tok1 FROM idem_begin('h-1', 'fp', lease => '10 minutes', holder => 'run-7') \gset
SELECT idem_checkpoint('h-1', :h_tok1, 'charged', convert_to('ch_1', 'UTF8'));
SELECT holder FROM idem.keys WHERE key = 'h-1';
SELECT claimed, state, token > :h_tok1 AS greater, phase, convert_from(phase_data, 'UTF8') AS phase_data
  FROM idem_begin('h-1', 'fp', lease => '10 minutes', holder => 'run-7');
SELECT token AS h_tok2 FROM idem.keys WHERE key = 'h-1' \gset
SELECT try(format('SELECT idem_complete(%L, %L, 200, %L, %s)', 'h-1', 'fp', 'old', :h_tok1));
SELECT try(format('SELECT idem_checkpoint(%L, %s, %L)', 'h-1', :h_tok1, 'x'));
-- Another holder, no holder, or the same holder with another fingerprint:
-- in flight, or a conflict, as before.
SELECT claimed, state, token FROM idem_begin('h-1', 'fp', holder => 'run-8', wait => false);
SELECT claimed, state, token FROM idem_begin('h-1', 'fp', wait => false);
SELECT claimed, state, token FROM idem_begin('h-1', 'other', holder => 'run-7');
-- A claim made without a holder is not taken over by one.
SELECT claimed FROM idem_begin('h-plain', 'fp', lease => '10 minutes');
SELECT claimed, state FROM idem_begin('h-plain', 'fp', holder => 'run-7', wait => false);
-- The new token completes; a replay answers every holder.
SELECT idem_complete('h-1', 'fp', 200, convert_to('done', 'UTF8'), :h_tok2) IS NOT NULL AS completed;
SELECT claimed, state, convert_from(body, 'UTF8') AS body FROM idem_begin('h-1', 'fp', holder => 'run-7');
SELECT claimed, state FROM idem_begin('h-1', 'fp', holder => 'run-8');
-- Through a batch: its items are taken over by the same holder.
SELECT array_agg(token ORDER BY ordinality) AS hb FROM idem_begin_many(ARRAY['h-b1', 'h-b2'], ARRAY['fp', 'fp'],
                                                                      holder => 'run-9') \gset
SELECT ordinality, claimed, state, token > (:'hb'::bigint[])[ordinality] AS greater
  FROM idem_begin_many(ARRAY['h-b2', 'h-b1'], ARRAY['fp', 'fp'], holder => 'run-9');
SELECT ordinality, claimed, state FROM idem_begin_many(ARRAY['h-b2', 'h-b1'], ARRAY['fp', 'fp'],
                                                       holder => 'run-10', wait => false);
-- Bad holders.
SELECT try($$SELECT * FROM idem_begin('h-x', 'fp', holder => '')$$);
SELECT try(format('SELECT * FROM idem_begin(%L, %L, holder => %L)', 'h-x', 'fp', repeat('h', 300)));
SELECT count(*) AS stored FROM idem.keys WHERE key = 'h-x';

DELETE FROM idem.keys;
