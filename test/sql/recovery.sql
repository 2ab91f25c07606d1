--
-- Recovery points: idem_checkpoint stores the last finished phase of a
-- claim's work and its output, fenced as a completion is; a takeover's
-- idem_begin returns them.  idem_hold checks the holder and keeps the row
-- locked FOR SHARE until the transaction ends.  Uses try() from setup.sql.
--

-- A claim made outside this transaction: checkpoints need its token.
SELECT token AS tok FROM idem_begin('rp-1', 'fp', lease => '1 minute') \gset
SELECT idem_checkpoint('rp-1', :tok, 'reserve', convert_to('{"stock":9}', 'UTF8'));
SELECT phase, convert_from(phase_data, 'UTF8') AS data FROM idem.keys WHERE key = 'rp-1';
-- A later checkpoint replaces it; an extension keeps it.
SELECT idem_checkpoint('rp-1', :tok, 'charge', convert_to('ch_1', 'UTF8'));
SELECT idem_extend('rp-1', :tok, '2 minutes') IS NOT NULL AS extended;
SELECT phase, convert_from(phase_data, 'UTF8') AS data FROM idem.keys WHERE key = 'rp-1';
-- A checkpoint is a HOT update (no indexed column changes).  The counts
-- are read in the same transaction: between transactions the backend may
-- flush the counts pending from earlier ones, which pg_stat_xact_* shows
-- until then.
BEGIN;
SELECT n_tup_hot_upd AS hot0, n_tup_upd AS upd0
  FROM pg_stat_xact_user_tables WHERE relid = 'idem.keys'::regclass \gset
SELECT idem_checkpoint('rp-1', :tok, 'charge', convert_to('ch_1', 'UTF8'));
SELECT n_tup_hot_upd - :hot0 AS hot, n_tup_upd - :upd0 AS updates
  FROM pg_stat_xact_user_tables WHERE relid = 'idem.keys'::regclass;
COMMIT;

-- An answer in flight and a conflict show no recovery point.
SELECT claimed, state, phase, phase_data FROM idem_begin('rp-1', 'fp');
SELECT claimed, state, phase, phase_data FROM idem_begin('rp-1', 'other');

-- After the lease, the takeover claims the key with a greater token and
-- gets the last recovery point.
SET idem.clock_offset = 600;
SELECT claimed, state, token > :tok AS greater, phase, convert_from(phase_data, 'UTF8') AS data
  FROM idem_begin('rp-1', 'fp') \gset t_
SELECT :'t_claimed' AS claimed, :'t_greater' AS greater, :'t_phase' AS phase, :'t_data' AS data;
SELECT token AS tok2 FROM idem_lookup('rp-1') \gset
-- The stale holder's checkpoint and hold are refused (ID002); the new
-- holder goes on from the recovery point.
SELECT try(format($$SELECT idem_checkpoint('rp-1', %s, 'record', NULL)$$, :tok));
SELECT try(format($$SELECT idem_hold('rp-1', %s)$$, :tok));
SELECT idem_checkpoint('rp-1', :tok2, 'record', NULL);
SELECT phase, phase_data FROM idem.keys WHERE key = 'rp-1';
-- A completion keeps nothing of the recovery point; a checkpoint or hold of
-- a completed key is refused (ID004).
SELECT idem_complete('rp-1', 'fp', 201, 'done', :tok2) IS NOT NULL AS completed;
SELECT phase, phase_data FROM idem.keys WHERE key = 'rp-1';
SELECT try(format($$SELECT idem_checkpoint('rp-1', %s, 'late', NULL)$$, :tok2));
SELECT try(format($$SELECT idem_hold('rp-1', %s)$$, :tok2));
RESET idem.clock_offset;

-- A claim taken again after its window (not a takeover) starts afresh.
SELECT token AS tok3 FROM idem_begin('rp-2', 'fp', lease => '1 minute', retention => '2 minutes') \gset
SELECT idem_checkpoint('rp-2', :tok3, 'reserve', NULL);
SET idem.clock_offset = 600;
SELECT claimed, phase FROM idem_begin('rp-2', 'fp');
RESET idem.clock_offset;

-- Inside the claiming transaction the claim is the proof: no token, and
-- the phase's business writes commit with its checkpoint (or not at all).
CREATE TABLE rp_stock (sku text PRIMARY KEY, qty int);
INSERT INTO rp_stock VALUES ('A', 10);
BEGIN;
SELECT claimed FROM idem_begin('rp-3', 'fp');
UPDATE rp_stock SET qty = qty - 1 WHERE sku = 'A';
SELECT idem_checkpoint('rp-3', NULL, 'reserve', NULL);
ROLLBACK;
SELECT (SELECT qty FROM rp_stock) AS qty, (SELECT count(*) FROM idem.keys WHERE key = 'rp-3') AS keys;
-- Outside it, a NULL token is refused (ID003), as are a missing key, a
-- token never issued, an empty, NULL or too long phase and data that is
-- too large.
SELECT token AS tok4 FROM idem_begin('rp-4', 'fp') \gset
SELECT try($$SELECT idem_checkpoint('rp-4', NULL, 'reserve', NULL)$$);
SELECT try($$SELECT idem_checkpoint('rp-missing', 1, 'reserve', NULL)$$);
SELECT try($$SELECT idem_checkpoint('rp-4', 9223372036854775807, 'reserve', NULL)$$);
SELECT try(format($$SELECT idem_checkpoint('rp-4', %s, '', NULL)$$, :tok4));
SELECT try(format($$SELECT idem_checkpoint('rp-4', %s, NULL, NULL)$$, :tok4));
SELECT try(format($$SELECT idem_checkpoint('rp-4', %s, repeat('p', 256), NULL)$$, :tok4));
SET idem.max_body_size = 4;
SELECT try(format($$SELECT idem_checkpoint('rp-4', %s, 'reserve', '12345')$$, :tok4));
RESET idem.max_body_size;
SELECT phase FROM idem.keys WHERE key = 'rp-4';

-- idem_hold by the current holder (what it makes a takeover wait for is
-- in the isolation spec recovery_points).
BEGIN;
SELECT idem_hold('rp-4', :tok4);
COMMIT;

-- Another role, even with the token, is refused (42501); a read-only
-- transaction cannot hold (25006).
CREATE ROLE regress_idem_rp_other;
GRANT EXECUTE ON FUNCTION idem_checkpoint(text, bigint, text, bytea, text),
  idem_hold(text, bigint, text) TO regress_idem_rp_other;
SET ROLE regress_idem_rp_other;
SELECT try(format($$SELECT idem_checkpoint('rp-4', %s, 'reserve', NULL)$$, :tok4));
SELECT try(format($$SELECT idem_hold('rp-4', %s)$$, :tok4));
RESET ROLE;
BEGIN READ ONLY;
SELECT try(format($$SELECT idem_hold('rp-4', %s)$$, :tok4));
COMMIT;
REVOKE ALL ON FUNCTION idem_checkpoint(text, bigint, text, bytea, text),
  idem_hold(text, bigint, text) FROM regress_idem_rp_other;
DROP ROLE regress_idem_rp_other;

-- idem_stalled shows the phase of stuck work.
SELECT idem_checkpoint('rp-4', :tok4, 'charge', NULL);
SET idem.clock_offset = 600;
SELECT key, phase FROM idem_stalled() WHERE key LIKE 'rp-%' ORDER BY key;
RESET idem.clock_offset;
DROP TABLE rp_stock;
