--
-- idem_complete: store the response of a claim.  Uses try(), key_row()
-- from setup.sql.
--

-- With the token: DONE, the response stored, the lease cleared and
-- expires_at = now + retention, returned.
CREATE TEMP TABLE c1 AS SELECT * FROM idem_begin('c-token', 'fp', lease => '30 seconds');
SELECT token AS tok FROM c1 \gset
SELECT clock_timestamp() AS t0 \gset
SELECT idem_complete('c-token', 'fp', 200, 'ok', :tok, retention => '3 hours') AS exp \gset
SELECT clock_timestamp() AS t1 \gset
SELECT :'exp'::timestamptz BETWEEN :'t0'::timestamptz + interval '3 hours'
                              AND :'t1'::timestamptz + interval '3 hours' AS exp_from_now;
SELECT token = :tok AS same_token, status, convert_from(body, 'UTF8') AS body,
       lease_until, expires_at = :'exp' AS returned_expiry
  FROM idem.keys WHERE key = 'c-token';
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body,
       expires_at = :'exp' AS same_expiry
  FROM idem_begin('c-token', 'fp');

-- Without retention, completing keeps the window the claim was given (here
-- 1 hour, not idem.default_retention's 24 hours).  A retention given to
-- idem_complete counts from the completion and takes idem.clock_offset
-- into account.
SELECT token AS tok, expires_at AS claim_exp
  FROM idem_begin('c-later', 'fp', lease => '30 seconds', retention => '1 hour') \gset
SELECT idem_complete('c-later', 'fp', 200, 'ok', :tok) = :'claim_exp'::timestamptz AS claim_window_kept;
SELECT expires_at = :'claim_exp'::timestamptz AS stored_window_kept
  FROM idem.keys WHERE key = 'c-later';
SELECT token AS tok FROM idem_begin('c-later-2', 'fp', lease => '30 seconds', retention => '1 hour') \gset
SET idem.clock_offset = '20s';
SELECT clock_timestamp() AS t0 \gset
SELECT idem_complete('c-later-2', 'fp', 200, 'ok', :tok, retention => '2 hours') AS exp \gset
SELECT clock_timestamp() AS t1 \gset
RESET idem.clock_offset;
SELECT :'exp'::timestamptz BETWEEN :'t0'::timestamptz + interval '2 hours 20 seconds'
                              AND :'t1'::timestamptz + interval '2 hours 20 seconds' AS exp_from_offset_now;

-- Inside the claiming transaction the token may be NULL.
BEGIN;
SELECT claimed, state FROM idem_begin('c-nulltoken', 'fp');
SELECT idem_complete('c-nulltoken', 'fp', 201, 'made') IS NOT NULL AS completed;
-- Repeating it there (a retry) returns the same expiry.
SELECT expires_at AS exp FROM idem.keys WHERE key = 'c-nulltoken' \gset
SELECT idem_complete('c-nulltoken', 'fp', 201, 'made') = :'exp' AS same_expiry;
COMMIT;
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin('c-nulltoken', 'fp');

-- Also in a later transaction that took the key over after its lease.
SELECT claimed FROM idem_begin('c-nulltoken-2', 'fp', lease => '10 seconds');
BEGIN;
SET LOCAL idem.clock_offset = '11s';
SELECT claimed, state FROM idem_begin('c-nulltoken-2', 'fp');
SELECT idem_complete('c-nulltoken-2', 'fp', 200, 'ok') IS NOT NULL AS completed;
COMMIT;
SELECT state, status FROM idem_begin('c-nulltoken-2', 'fp');

-- A NULL body is a response too.
SELECT token AS tok FROM idem_begin('c-nullbody', 'fp') \gset
SELECT idem_complete('c-nullbody', 'fp', 204, NULL, :tok) IS NOT NULL AS completed;
SELECT status, body IS NULL AS null_body FROM idem.keys WHERE key = 'c-nullbody';

-- A holder whose lease ran out but whom nobody took over still holds the
-- key and may complete it.
SELECT token AS tok FROM idem_begin('c-late', 'fp', lease => '10 seconds') \gset
SET idem.clock_offset = '1 min';
SELECT idem_complete('c-late', 'fp', 200, 'late', :tok) IS NOT NULL AS completed;
SELECT state, status FROM idem_begin('c-late', 'fp');
RESET idem.clock_offset;

--
-- Errors.  After each the stored row is unchanged.
--
SELECT token AS tok FROM idem_begin('c-err', 'fp', lease => '10 seconds', retention => '1 hour') \gset
SELECT key_row('', 'c-err') AS row0 \gset

-- Wrong fingerprint: ID001.
SELECT try($$SELECT idem_complete('c-err', 'other', 200, 'x', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_complete('c-err', 'other', 200, 'x')$$);
SELECT key_row('', 'c-err') = :'row0' AS unchanged;

-- NULL token outside the claiming transaction: ID003.
SELECT try($$SELECT idem_complete('c-err', 'fp', 200, 'x')$$);
SELECT key_row('', 'c-err') = :'row0' AS unchanged;

-- A token older than the key's, which never held it (another key's): ID002.
-- The row keeps only its current token, so the detail names both causes;
-- a token below 1 was never issued, and the detail says so alone.
SELECT try($$SELECT idem_complete('c-err', 'fp', 200, 'x', $$ || (:tok - 1) || $$)$$);
SELECT key_row('', 'c-err') = :'row0' AS unchanged;
CREATE FUNCTION try_detail(q text, tok bigint) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	detail text;
BEGIN
	EXECUTE q;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
	RETURN SQLSTATE || ': ' || replace(detail, tok::text, 'N');
END $$;
SELECT try_detail(format($$SELECT idem_complete('c-err', 'fp', 200, 'x', %s)$$, :tok - 1), :tok - 1);
SELECT try_detail($$SELECT idem_complete('c-err', 'fp', 200, 'x', 0)$$, 0);
SELECT try_detail($$SELECT idem_complete('c-err', 'fp', 200, 'x', -5)$$, -5);
-- A token newer than the key's was never this key's: ID003.
SELECT try_detail(format($$SELECT idem_complete('c-err', 'fp', 200, 'x', %s)$$, :tok + 1000), :tok + 1000);
SELECT key_row('', 'c-err') = :'row0' AS unchanged;

-- Missing key, or the right key in another scope: ID003.
SELECT try($$SELECT idem_complete('c-missing', 'fp', 200, 'x', $$ || :tok || $$)$$);
SELECT try($$SELECT idem_complete('c-err', 'fp', 200, 'x', $$ || :tok || $$, scope => 'elsewhere')$$);
SELECT count(*) FROM idem.keys WHERE key = 'c-missing' OR scope = 'elsewhere';

-- Superseded: the lease ran out and another caller took the key over.  The
-- old holder's complete is refused with ID002, before and after the new
-- holder completes.
SET idem.clock_offset = '11s';
SELECT claimed, state, token > :tok AS greater_token, token AS tok2
  FROM idem_begin('c-err', 'fp', lease => '10 seconds') \gset
\echo :claimed :state :greater_token
SELECT key_row('', 'c-err') AS row1 \gset
SELECT try($$SELECT idem_complete('c-err', 'fp', 500, 'stale', $$ || :tok || $$)$$);
SELECT try_detail(format($$SELECT idem_complete('c-err', 'fp', 500, 'stale', %s)$$, :tok), :tok);
SELECT key_row('', 'c-err') = :'row1' AS unchanged;
SELECT idem_complete('c-err', 'fp', 200, 'fresh', :tok2) IS NOT NULL AS completed;
SELECT key_row('', 'c-err') AS row2 \gset
SELECT try($$SELECT idem_complete('c-err', 'fp', 500, 'stale', $$ || :tok || $$)$$);
SELECT key_row('', 'c-err') = :'row2' AS unchanged;

-- Repeating the complete with the same token and response succeeds and
-- returns the stored expires_at, even later and with another retention.
SELECT expires_at AS exp2 FROM idem.keys WHERE key = 'c-err' \gset
SET idem.clock_offset = '1 min';
SELECT idem_complete('c-err', 'fp', 200, 'fresh', :tok2, retention => '2 hours') = :'exp2' AS stored_expiry;
SELECT key_row('', 'c-err') = :'row2' AS unchanged;

-- A different response with the current token: ID004.
SELECT try($$SELECT idem_complete('c-err', 'fp', 200, 'other body', $$ || :tok2 || $$)$$);
SELECT try($$SELECT idem_complete('c-err', 'fp', 201, 'fresh', $$ || :tok2 || $$)$$);
SELECT try($$SELECT idem_complete('c-err', 'fp', 200, NULL, $$ || :tok2 || $$)$$);
SELECT key_row('', 'c-err') = :'row2' AS unchanged;
-- ... and a wrong fingerprint on the done key is still ID001.
SELECT try($$SELECT idem_complete('c-err', 'other', 200, 'fresh', $$ || :tok2 || $$)$$);
SELECT key_row('', 'c-err') = :'row2' AS unchanged;

-- Expired: once the retention window (24 h from the completion) is over
-- the key has no claim: ID003, even for the last holder repeating its
-- response.
SET idem.clock_offset = '25h';
SELECT try($$SELECT idem_complete('c-err', 'fp', 200, 'fresh', $$ || :tok2 || $$)$$);
SELECT key_row('', 'c-err') = :'row2' AS unchanged;
RESET idem.clock_offset;

-- A claim that expired while still PROCESSING cannot be completed either.
SELECT token AS tok FROM idem_begin('c-expired', 'fp', lease => '10 seconds', retention => '1 hour') \gset
SELECT key_row('', 'c-expired') AS row0 \gset
SET idem.clock_offset = '1h';
SELECT try($$SELECT idem_complete('c-expired', 'fp', 200, 'x', $$ || :tok || $$)$$);
SELECT key_row('', 'c-expired') = :'row0' AS unchanged;
RESET idem.clock_offset;
