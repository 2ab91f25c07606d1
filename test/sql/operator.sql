--
-- Operator controls: idem_evict drops the stored response of a completed
-- key, idem_force_release ends a claim in flight without its token, and
-- idem_stalled lists claims whose lease ended without a completion.  None
-- shows a body; each is the owner's until granted.  Uses try() from
-- setup.sql.
--
SELECT claimed FROM idem_begin('op-first', 'fp');  -- the database has counters
SELECT evictions AS ev0, force_releases AS fr0
  FROM idem_stats WHERE datname = current_database() \gset

-- A completed key replays until it is evicted; then its next request
-- executes, with a new token.
SELECT token AS tok_done FROM idem_begin('op-done', 'fp') \gset
SELECT idem_complete('op-done', 'fp', 201, 'first', :tok_done) IS NOT NULL AS completed;
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body FROM idem_begin('op-done', 'fp');
SELECT idem_evict('op-done') AS evicted;
SELECT count(*) AS rows_left FROM idem.keys WHERE key = 'op-done';
SELECT claimed, state, token > :tok_done AS greater_token FROM idem_begin('op-done', 'fp');
-- Nothing to evict: false.  A key in another scope is another key.
SELECT idem_evict('op-missing') AS evicted, idem_evict('op-done', 'other-scope') AS other_scope;

-- A claim in flight is not evicted (its holder is working): 55000 names
-- idem_force_release.  A completed key is not force-released: 55000 names
-- idem_evict.
SELECT try($$SELECT idem_evict('op-done')$$);
SELECT token AS tok_held FROM idem_begin('op-held', 'fp', lease => '10 minutes') \gset
SELECT idem_complete('op-held', 'fp', 200, 'x', :tok_held) IS NOT NULL AS completed;
SELECT try($$SELECT idem_force_release('op-held', '', 'drill')$$);

-- A claim in flight, force-released: the key is free at once, and the
-- holder's late complete finds no claim (ID003); after a new claim, the
-- old holder is superseded (ID002).
SELECT token AS tok_stuck FROM idem_begin('op-stuck', 'fp', lease => '10 minutes') \gset
SELECT idem_force_release('op-stuck', '', 'holder host lost (ticket OPS-1)') AS released;
SELECT try(format($$SELECT idem_complete('op-stuck', 'fp', 200, 'late', %s)$$, :tok_stuck));
SELECT claimed, state, token > :tok_stuck AS greater_token FROM idem_begin('op-stuck', 'fp');
SELECT try(format($$SELECT idem_complete('op-stuck', 'fp', 200, 'late', %s)$$, :tok_stuck));
SELECT idem_force_release('op-nothing', '', 'drill') AS released;
SELECT try($$SELECT idem_force_release('op-stuck', '', '')$$);
SELECT try($$SELECT idem_force_release('op-stuck', '', NULL)$$);
SELECT try($$SELECT idem_evict(NULL)$$);

-- Claims whose lease ended, oldest first, with how long ago; a claim still
-- leased, a completed key and an expired key are not listed.
SELECT token AS tok_s1 FROM idem_begin('op-stalled-1', 'fp', lease => '1 minute') \gset
SELECT token AS tok_s2 FROM idem_begin('op-stalled-2', 'fp', lease => '5 minutes') \gset
SELECT claimed FROM idem_begin('op-expiring', 'fp', lease => '1 minute', retention => '2 minutes');
SET idem.clock_offset = 600;
SELECT scope, key, token IN (:tok_s1, :tok_s2) AS its_token,
       stalled_for BETWEEN '4 minutes' AND '10 minutes' AS stalled_for,
       claimed_by = current_user::regrole AS claimed_by_me
  FROM idem_stalled() WHERE key LIKE 'op-stalled%' OR key = 'op-expiring';
SELECT key FROM idem_stalled(older_than => '7 minutes') WHERE key LIKE 'op-stalled%';
RESET idem.clock_offset;
SELECT count(*) AS stalled_now FROM idem_stalled() WHERE key LIKE 'op-stalled%';

-- Counted in idem_stats.
SELECT evictions - :ev0 AS evictions, force_releases - :fr0 AS force_releases
  FROM idem_stats WHERE datname = current_database();

-- Owner-only until granted; a role granted EXECUTE needs no privilege on
-- idem.keys, and sees no body.
CREATE ROLE regress_idem_operator;
SET ROLE regress_idem_operator;
SELECT try($$SELECT idem_evict('op-stalled-1')$$);
SELECT try($$SELECT idem_force_release('op-stalled-1', '', 'drill')$$);
SELECT try($$SELECT count(*) FROM idem_stalled()$$);
RESET ROLE;
GRANT EXECUTE ON FUNCTION idem_evict(text, text), idem_force_release(text, text, text),
  idem_stalled(interval) TO regress_idem_operator;
SET ROLE regress_idem_operator;
SELECT has_schema_privilege('idem', 'USAGE') AS uses_schema_idem;
SELECT count(*) AS stalled FROM idem_stalled(older_than => '-1 hour') WHERE key LIKE 'op-stalled%';
SELECT idem_force_release('op-stalled-1', '', 'drill by the operator role') AS released;
SELECT idem_evict('op-held') AS evicted;
RESET ROLE;
SELECT key FROM idem.keys WHERE key IN ('op-stalled-1', 'op-held');
REVOKE ALL ON FUNCTION idem_evict(text, text), idem_force_release(text, text, text),
  idem_stalled(interval) FROM regress_idem_operator;
DROP ROLE regress_idem_operator;
