--
-- Tombstones: idem_begin(..., remember => interval) keeps a completed key
-- past its retention, without its response, until remember is over.  A
-- retry against it answers EXPIRED (claimed false, the stored status, no
-- body) and never executes again; purge drops the body first and the row
-- later.  Uses try(), keys_digest() from setup.sql.
--
DELETE FROM idem.keys;
RESET idem.clock_offset;

-- A completed key with a 1 hour retention, remembered for 1 day; one
-- without remember; a claim remembered but never completed.
SELECT token AS tok FROM idem_begin('t-done', 'fp', retention => '1 hour', remember => '1 day') \gset
SELECT idem_complete('t-done', 'fp', 201, convert_to('{"id":1}', 'UTF8'), :tok) IS NOT NULL AS completed;
SELECT :tok AS tok_done \gset
SELECT token AS tok FROM idem_begin('t-plain', 'fp', retention => '1 hour') \gset
SELECT idem_complete('t-plain', 'fp', 200, 'plain', :tok) IS NOT NULL AS completed;
SELECT token AS tok_open FROM idem_begin('t-open', 'fp', lease => '10 minutes',
                                         retention => '1 hour', remember => '1 day') \gset
SELECT key, remember_until - expires_at AS remembered_past_retention
  FROM idem.keys ORDER BY key;

-- Inside the retention: a replay, as without remember.
SELECT claimed, state, token, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin('t-done', 'fp');
SELECT state, body_size FROM idem_lookup('t-done');

-- Two hours later the retention is over.  The remembered key answers
-- EXPIRED with its status and no body, whether or not purge has run, and
-- never claims; another fingerprint is a conflict, as inside the window.
-- The key without remember is new again; so is the claim that was never
-- completed (remember protects completed work only).
SET idem.clock_offset = '2h';
SELECT claimed, state, token, status, body, lease_until, expires_at < now() + interval '2h' AS expired,
       phase, phase_data
  FROM idem_begin('t-done', 'fp');
SELECT claimed, state, status FROM idem_begin('t-done', 'fp', remember => '1 day');
SELECT claimed, state, status FROM idem_begin('t-done', 'fp', wait => false);
SELECT claimed, state, status, body FROM idem_begin('t-done', 'other');
-- The same answer in a read-only REPEATABLE READ transaction, under
-- SERIALIZABLE, and to a role that is not a superuser, granted only
-- idem_begin.
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
SELECT claimed, state, status, body FROM idem_begin('t-done', 'fp');
COMMIT;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT claimed, state, status, body FROM idem_begin('t-done', 'fp');
COMMIT;
CREATE ROLE regress_idem_tomb;
GRANT EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  TO regress_idem_tomb;
SET ROLE regress_idem_tomb;
SELECT claimed, state, status, body FROM idem_begin('t-done', 'fp');
RESET ROLE;
REVOKE ALL ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  FROM regress_idem_tomb;
DROP ROLE regress_idem_tomb;
SELECT state, status, body_size FROM idem_lookup('t-done');
SELECT key, state, status, body_size FROM idem_keys ORDER BY key;
SELECT claimed, state FROM idem_begin('t-plain', 'fp');
SELECT claimed, state, token > :tok_open AS new_token FROM idem_begin('t-open', 'fp');

-- Writes to a tombstone with any token are refused and change nothing:
-- its last token is a completed key's (ID004), an older one superseded
-- (ID002), a greater one never issued (ID003), none not this
-- transaction's (ID003).
SELECT keys_digest() AS digest0 \gset
SELECT try(format($$SELECT idem_complete('t-done', 'fp', 201, convert_to('{"id":1}', 'UTF8'), %s)$$, :tok_done));
SELECT try(format($$SELECT idem_complete('t-done', 'fp', 201, 'x', %s)$$, :tok_done - 1));
SELECT try(format($$SELECT idem_release('t-done', %s)$$, :tok_done));
SELECT try(format($$SELECT idem_release('t-done', %s)$$, :tok_done - 1));
SELECT regexp_replace(try(format($$SELECT idem_release('t-done', %s)$$, :tok_done + 1000)),
                      'token \d+', 'token N') AS try;
SELECT try($$SELECT idem_release('t-done', NULL)$$);
SELECT try(format($$SELECT idem_extend('t-done', %s, '1 minute')$$, :tok_done));
SELECT try(format($$SELECT idem_checkpoint('t-done', %s, 'p')$$, :tok_done));
SELECT try(format($$SELECT idem_hold('t-done', %s)$$, :tok_done));
SELECT try($$SELECT idem_force_release('t-done', '', 'test')$$);
SELECT keys_digest() = :'digest0' AS nothing_changed;

-- Purge drops the body and keeps the tombstone: one rewrite, counted, the
-- row no bigger than 150 bytes with a 36-byte key, and still EXPIRED.
SELECT token AS tok FROM idem_begin('00000000-0000-4000-8000-000000000036', 'fp',
                                    retention => '1 hour', remember => '1 day') \gset
SELECT idem_complete('00000000-0000-4000-8000-000000000036', 'fp', 200,
                     convert_to(repeat('body ', 4000), 'UTF8'), :tok) IS NOT NULL AS completed;
SET idem.clock_offset = '4h';
SELECT ctid AS ctid_before FROM idem.keys WHERE key = 't-done' \gset
SELECT idem_purge() AS purged;
SELECT key, status, body IS NULL AS no_body, claimed_by IS NULL AS no_claimant,
       phase IS NULL AS no_phase, remember_until IS NOT NULL AS remembered
  FROM idem.keys ORDER BY key;
SELECT pg_column_size(k.*) AS tombstone_bytes, pg_column_size(k.*) <= 150 AS at_most_150
  FROM idem.keys k WHERE key = '00000000-0000-4000-8000-000000000036';
SELECT claimed, state, status, body FROM idem_begin('t-done', 'fp');
-- A second pass rewrites nothing: the tombstone is not written again.
SELECT ctid AS ctid_after FROM idem.keys WHERE key = 't-done' \gset
SELECT :'ctid_before' <> :'ctid_after' AS rewritten_once;
SELECT idem_purge() AS purged;
SELECT ctid = :'ctid_after' AS not_rewritten_again FROM idem.keys WHERE key = 't-done';
SELECT try(format($$SELECT idem_complete('t-done', 'fp', 201, 'x', %s)$$, :tok_done - 1));

-- A day later remember is over: before purge deletes the tombstone,
-- idem_lookup and idem_keys show it as they show any key whose window is
-- over (DONE), as idem_begin no longer answers EXPIRED; purge deletes it,
-- and the key is new again.
SET idem.clock_offset = '26h';
SELECT state FROM idem_lookup('t-done');
SELECT state FROM idem_keys WHERE key = 't-done';
SELECT idem_purge() AS purged;
SELECT count(*) AS left FROM idem.keys WHERE key = 't-done';
SELECT claimed, state FROM idem_begin('t-done', 'fp');

-- A tombstone not yet purged is deleted at once when remember is over.
RESET idem.clock_offset;
DELETE FROM idem.keys;
SELECT token AS tok FROM idem_begin('t-late', 'fp', retention => '1 hour', remember => '2 hours') \gset
SELECT idem_complete('t-late', 'fp', 200, 'x', :tok) IS NOT NULL AS completed;
SET idem.clock_offset = '3h';
SELECT idem_purge() AS purged;
SELECT count(*) AS left FROM idem.keys;

-- idem_evict forgets a tombstone: the key executes again.
RESET idem.clock_offset;
SELECT token AS tok FROM idem_begin('t-evict', 'fp', retention => '1 hour', remember => '1 day') \gset
SELECT idem_complete('t-evict', 'fp', 200, 'x', :tok) IS NOT NULL AS completed;
SET idem.clock_offset = '2h';
SELECT idem_evict('t-evict') AS evicted;
SELECT claimed, state FROM idem_begin('t-evict', 'fp');

-- A takeover keeps how long the key is remembered; a completion with a
-- new retention past remember leaves no tombstone phase.
RESET idem.clock_offset;
SELECT token AS tok FROM idem_begin('t-take', 'fp', lease => '1 minute', retention => '1 hour',
                                    remember => '1 day') \gset
SET idem.clock_offset = '10min';
SELECT claimed, token > :tok AS new_token FROM idem_begin('t-take', 'fp', lease => '1 minute');
SELECT remember_until - expires_at AS remembered_past_retention FROM idem.keys WHERE key = 't-take';

-- Bad remember: 22023 naming the argument, nothing written.
RESET idem.clock_offset;
SELECT keys_digest() AS digest1 \gset
SELECT try($$SELECT * FROM idem_begin('t-bad', 'fp', retention => '1 day', remember => '1 hour')$$);
SELECT try($$SELECT * FROM idem_begin('t-bad', 'fp', remember => '-1 day')$$);
SELECT try($$SELECT * FROM idem_begin('t-bad', 'fp', remember => '0')$$);
SELECT try($$SELECT * FROM idem_begin('t-bad', 'fp', remember => '31 days')$$);
SELECT keys_digest() = :'digest1' AS nothing_written;
-- remember equal to retention is accepted (no tombstone phase); NULL is
-- the default.
SELECT claimed FROM idem_begin('t-eq', 'fp', retention => '1 day', remember => '1 day');
SELECT claimed FROM idem_begin('t-null', 'fp', remember => NULL);
SELECT key, remember_until = expires_at AS same_end FROM idem.keys
 WHERE key IN ('t-eq', 't-null') ORDER BY key;
DELETE FROM idem.keys;
