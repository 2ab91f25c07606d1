--
-- A transaction keeps idem.keys open from its first call on: the calls of
-- a batch (LATERAL), of a cursor, of a loop, use what the first opened.
-- What it keeps is dropped before any utility statement and at the end of
-- the transaction, also through an error, a subtransaction's rollback, a
-- cursor held over COMMIT and PREPARE TRANSACTION.  A reference left open
-- would show here as a WARNING (relcache reference leak), or as TRUNCATE
-- refusing a table "being used by active queries".
--

-- A batch of claims and completions in one statement, then its replays.
SELECT count(*) FILTER (WHERE b.claimed) AS claimed,
       count(*) FILTER (WHERE c IS NOT NULL) AS completed
  FROM generate_series(1, 200) g,
       LATERAL idem_begin('st-' || g, 'fp') b,
       LATERAL idem_complete('st-' || g, 'fp', 200, convert_to('body ' || g, 'UTF8'), b.token) c;
SELECT b.state, count(*), count(DISTINCT b.body) AS bodies
  FROM generate_series(1, 200) g, LATERAL idem_begin('st-' || g, 'fp') b
 GROUP BY b.state;
SELECT count(*) AS conflicts
  FROM generate_series(1, 200) g, LATERAL idem_begin('st-' || g, 'other') b
 WHERE b.state = 'CONFLICT';

-- The same in a read-only transaction, which opens the table to read.
BEGIN READ ONLY;
SELECT b.state, count(*)
  FROM generate_series(1, 200) g, LATERAL idem_begin('st-' || g, 'fp') b
 GROUP BY b.state;
SELECT count(*) AS found
  FROM generate_series(1, 200) g, LATERAL idem_lookup('st-' || g) l;
COMMIT;

-- DDL later in the same transaction finds the table unused.
BEGIN;
SELECT count(*) FILTER (WHERE b.claimed) AS claimed
  FROM generate_series(1, 20) g, LATERAL idem_begin('st-tr-' || g, 'fp') b;
SELECT count(*) AS rows_before FROM idem.keys WHERE key LIKE 'st-%';
TRUNCATE idem.keys;
SELECT count(*) AS rows_after FROM idem.keys;
ROLLBACK;
SELECT count(*) AS rows_kept FROM idem.keys WHERE key LIKE 'st-%';

-- An error in the middle of a statement, inside a savepoint: the calls
-- before it are rolled back with it; the next statement opens the table
-- anew.
BEGIN;
SAVEPOINT a;
SELECT g, b.claimed, 1 / (3 - g) AS boom
  FROM generate_series(1, 5) g, LATERAL idem_begin('st-err-' || g, 'fp') b;
ROLLBACK TO SAVEPOINT a;
SELECT count(*) AS rolled_back FROM idem.keys WHERE key LIKE 'st-err-%';
SELECT count(*) FILTER (WHERE b.claimed) AS claimed
  FROM generate_series(1, 5) g, LATERAL idem_begin('st-err-' || g, 'fp') b;
COMMIT;
SELECT count(*) AS kept FROM idem.keys WHERE key LIKE 'st-err-%';

-- A cursor: the calls run as rows are fetched.  COMMIT closes the cursor
-- and the table; a cursor WITH HOLD is run to its end at COMMIT.
BEGIN;
DECLARE c CURSOR FOR
  SELECT g, b.state FROM generate_series(1, 4) g, LATERAL idem_begin('st-cur-' || g, 'fp') b;
FETCH 2 FROM c;
COMMIT;
SELECT count(*) AS fetched_claims FROM idem.keys WHERE key LIKE 'st-cur-%';
BEGIN;
DECLARE h CURSOR WITH HOLD FOR
  SELECT g, b.state FROM generate_series(1, 3) g, LATERAL idem_begin('st-hold-' || g, 'fp') b;
FETCH 1 FROM h;
COMMIT;
FETCH ALL FROM h;
CLOSE h;
SELECT count(*) AS held_claims FROM idem.keys WHERE key LIKE 'st-hold-%';

-- A cursor declared before a savepoint and fetched inside it survives its
-- rollback, as PostgreSQL keeps such a portal: the claims made inside are
-- rolled back, the cursor goes on, and COMMIT closes it.  First when the
-- cursor's first call was before the savepoint, then when it was inside.
BEGIN;
DECLARE r CURSOR FOR
  SELECT g, b.state FROM generate_series(1, 4) g, LATERAL idem_begin('st-rb-' || g, 'fp') b;
FETCH 1 FROM r;
SAVEPOINT s;
FETCH 1 FROM r;
ROLLBACK TO SAVEPOINT s;
FETCH 1 FROM r;
DECLARE r2 CURSOR FOR
  SELECT g, b.state FROM generate_series(1, 4) g, LATERAL idem_begin('st-rb2-' || g, 'fp') b;
SAVEPOINT s2;
FETCH 2 FROM r2;
ROLLBACK TO SAVEPOINT s2;
FETCH 1 FROM r2;
COMMIT;
SELECT key FROM idem.keys WHERE key LIKE 'st-rb%' ORDER BY key;

-- A loop over one statement's rows whose body rolls back subtransactions
-- (BEGIN ... EXCEPTION): the statement's calls outlive those rollbacks and
-- keep the table open; the claims made inside the rolled-back blocks are
-- gone, the statement's own stay.
CREATE FUNCTION st_loop() RETURNS TABLE (claimed bigint, failed bigint) LANGUAGE plpgsql AS $$
DECLARE
	r record;
BEGIN
	claimed := 0;
	failed := 0;
	FOR r IN SELECT g, b.claimed AS c
			   FROM generate_series(1, 120) g, LATERAL idem_begin('st-loop-' || g, 'fp') b
	LOOP
		BEGIN
			PERFORM idem_begin('st-inner-' || r.g, 'fp');
			IF r.g % 2 = 0 THEN
				RAISE EXCEPTION 'even';
			END IF;
		EXCEPTION WHEN raise_exception THEN
			failed := failed + 1;
		END;
		IF r.c THEN
			claimed := claimed + 1;
		END IF;
	END LOOP;
	RETURN NEXT;
END $$;
SELECT * FROM st_loop();
SELECT count(*) FILTER (WHERE key LIKE 'st-loop-%') AS loop_keys,
       count(*) FILTER (WHERE key LIKE 'st-inner-%') AS inner_keys
  FROM idem.keys;

-- An invalidation of idem.keys between two calls of one statement (ANALYZE
-- updates its pg_class row): the next call opens the table again.
CREATE FUNCTION st_analyze() RETURNS int LANGUAGE plpgsql AS $$
BEGIN
	ANALYZE idem.keys;
	RETURN 1;
END $$;
SELECT count(*) FILTER (WHERE b.claimed) AS claimed, sum(a) AS analyzed
  FROM generate_series(1, 4) g, LATERAL idem_begin('st-inv-' || g, 'fp') b,
       LATERAL st_analyze() a;

-- A lock taken in a subtransaction goes with its rollback; the next call
-- takes it again before it uses the table (both locks shown after it).
BEGIN;
SAVEPOINT a;
SELECT claimed FROM idem_begin('st-lock', 'fp');
ROLLBACK TO SAVEPOINT a;
SELECT count(*) AS locks_after_rollback FROM pg_locks
 WHERE pid = pg_backend_pid() AND relation IN ('idem.keys'::regclass, 'idem.keys_pkey'::regclass);
SELECT claimed FROM idem_begin('st-lock', 'fp');
SELECT relation::regclass, mode FROM pg_locks
 WHERE pid = pg_backend_pid() AND relation IN ('idem.keys'::regclass, 'idem.keys_pkey'::regclass)
 ORDER BY relation::regclass::text COLLATE "C", mode;
COMMIT;
-- The same without a utility statement between the calls: a rolled-back
-- BEGIN ... EXCEPTION block.
CREATE FUNCTION st_relock() RETURNS TABLE (relation regclass, mode text) LANGUAGE plpgsql AS $$
BEGIN
	BEGIN
		PERFORM idem_begin('st-lock2', 'fp');
		RAISE EXCEPTION 'undo';
	EXCEPTION WHEN raise_exception THEN
		NULL;
	END;
	RETURN QUERY SELECT l.relation::regclass, l.mode FROM pg_locks l
	  WHERE l.pid = pg_backend_pid() AND l.relation IN ('idem.keys'::regclass, 'idem.keys_pkey'::regclass);
	PERFORM idem_begin('st-lock2', 'fp');
	RETURN QUERY SELECT l.relation::regclass, l.mode FROM pg_locks l
	  WHERE l.pid = pg_backend_pid() AND l.relation IN ('idem.keys'::regclass, 'idem.keys_pkey'::regclass)
	  ORDER BY l.relation::regclass::text COLLATE "C", l.mode;
END $$;
SELECT * FROM st_relock();

-- A call that the shape check refuses, inside a rolled-back block, leaves
-- nothing open: the ALTER TABLE after it finds the table unused.
BEGIN;
ALTER TABLE idem.keys ADD CONSTRAINT st_check CHECK (true);
SELECT try($$SELECT idem_begin('st-shape', 'fp')$$);
ALTER TABLE idem.keys DROP CONSTRAINT st_check;
SELECT claimed FROM idem_begin('st-shape', 'fp');
ROLLBACK;

-- The extension dropped and created again in one transaction: the calls
-- after it use the new table.
BEGIN;
SELECT claimed FROM idem_begin('st-again', 'fp');
DROP EXTENSION idem;
CREATE EXTENSION idem;
SELECT claimed, state FROM idem_begin('st-again', 'fp');
SELECT key FROM idem.keys;
ROLLBACK;
SELECT count(*) AS kept FROM idem.keys WHERE key LIKE 'st-%';

-- PREPARE TRANSACTION after a batch.
BEGIN;
SELECT count(*) FILTER (WHERE b.claimed) AS claimed
  FROM generate_series(1, 10) g, LATERAL idem_begin('st-2pc-' || g, 'fp') b;
PREPARE TRANSACTION 'idem_statement';
COMMIT PREPARED 'idem_statement';
SELECT count(*) AS prepared_claims FROM idem.keys WHERE key LIKE 'st-2pc-%';

-- An error inside a call's scan of the primary key (here the replayed
-- body's TOAST chunks are gone, as corruption would leave them), caught
-- by a BEGIN ... EXCEPTION block: the calls after it in the same
-- statement go on, and the transaction commits without a WARNING.  A
-- transaction keeps its scan of the primary key between calls; the
-- buffers it had pinned when the error came are released with the
-- subtransaction, and a call that used them again would fail ("buffer is
-- not owned by resource owner").
CREATE EXTENSION pg_surgery;
SELECT count(idem_complete('st-ok-' || g, 'fp', 200, 'small', b.token)) AS completed
  FROM generate_series(1, 3) g, LATERAL idem_begin('st-ok-' || g, 'fp') b;
SELECT token AS big_token FROM idem_begin('st-big', 'fp') \gset
SELECT idem_complete('st-big', 'fp', 200,
         (SELECT decode(string_agg(md5(g::text), ''), 'hex') FROM generate_series(1, 200) g),
         :big_token) IS NOT NULL AS completed;
SELECT reltoastrelid::regclass AS keys_toast FROM pg_class WHERE oid = 'idem.keys'::regclass \gset
SELECT count(*) AS chunks_killed FROM (
  SELECT heap_force_kill(:'keys_toast'::regclass, array_agg(ctid)) FROM :keys_toast) k;
CREATE FUNCTION st_corrupt() RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
	r text[];
BEGIN
	r := r || (SELECT state FROM idem_begin('st-ok-1', 'fp'));
	BEGIN
		r := r || (SELECT state FROM idem_begin('st-big', 'fp'));
	EXCEPTION WHEN data_corrupted THEN
		r := r || 'data_corrupted'::text;
	END;
	r := r || (SELECT state FROM idem_begin('st-ok-2', 'fp'));
	r := r || (SELECT state || ' ' || claimed FROM idem_begin('st-new', 'fp'));
	r := r || (SELECT state FROM idem_begin('st-ok-3', 'fp'));
	RETURN r;
END $$;
SELECT st_corrupt();
-- The same error at the top of a transaction, then a new one.
BEGIN;
SELECT state FROM idem_begin('st-ok-1', 'fp');
\set VERBOSITY sqlstate
SELECT state FROM idem_begin('st-big', 'fp');
\set VERBOSITY default
ROLLBACK;
SELECT state, claimed FROM idem_begin('st-ok-2', 'fp');
-- SERIALIZABLE: each call's read gives the kept scan the transaction's
-- snapshot, and so takes the predicate locks a SELECT would.  After a
-- new key's claim (a read, then a dirty probe), a replay in the same
-- transaction leaves an SIReadLock on the replayed row.
SELECT (ctid::text::point)[0]::int AS ok_page, (ctid::text::point)[1]::int AS ok_tuple
  FROM idem.keys WHERE key = 'st-ok-1' \gset
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT claimed FROM idem_begin('st-ser-new', 'fp');
SELECT state FROM idem_begin('st-ok-1', 'fp');
SELECT count(*) AS replayed_row_siread FROM pg_locks
 WHERE pid = pg_backend_pid() AND mode = 'SIReadLock' AND locktype = 'tuple'
   AND relation = 'idem.keys'::regclass AND page = :ok_page AND tuple = :ok_tuple;
COMMIT;
DELETE FROM idem.keys WHERE key = 'st-big';
DROP FUNCTION st_corrupt();
DROP EXTENSION pg_surgery;

DROP FUNCTION st_loop(), st_analyze(), st_relock();
DELETE FROM idem.keys WHERE key LIKE 'st-%';
