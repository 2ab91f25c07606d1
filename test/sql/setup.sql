-- Install the extension for the other regression tests.
CREATE EXTENSION idem;
SELECT extname, extversion FROM pg_extension WHERE extname = 'idem';

-- Helpers shared by the later test files (they run in this database, in
-- order):
--   try(q)         runs q and returns 'ok' or 'SQLSTATE: message'.
--   keys_digest()  one value for the whole content of idem.keys, to show
--                  that a failed call changed nothing stored.
--   key_row(s, k)  the stored row of one key, as text.
CREATE FUNCTION try(q text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	EXECUTE q;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	RETURN SQLSTATE || ': ' || SQLERRM;
END $$;
CREATE FUNCTION keys_digest() RETURNS text LANGUAGE sql AS $$
	SELECT md5(coalesce(string_agg(k::text, ',' ORDER BY scope, key), ''))
	FROM idem.keys k
$$;
CREATE FUNCTION key_row(s text, k text) RETURNS text LANGUAGE sql AS $$
	SELECT r::text FROM idem.keys r WHERE r.scope = s AND r.key = k
$$;
