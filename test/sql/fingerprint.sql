-- The stored fingerprint is the SHA-256 digest of the caller's text, for
-- every length around the 64-byte block and padding boundaries and for
-- multi-byte text: compare with PostgreSQL's sha256().
SELECT count(*) AS claimed
FROM generate_series(0, 300) g,
	LATERAL idem_begin('fp-' || g, repeat('x', g) || 'é', scope => 'fingerprint') b
WHERE b.claimed;
SELECT count(*) FILTER (WHERE k.fingerprint = sha256(convert_to(repeat('x', g) || 'é', 'UTF8'))) AS matching,
	   count(*) AS keys
FROM generate_series(0, 300) g
JOIN idem.keys k ON k.scope = 'fingerprint' AND k.key = 'fp-' || g;
-- Varied bytes (not one repeated letter), every length from 0 to 200.
SELECT count(*) AS claimed
FROM generate_series(0, 200) g,
	LATERAL idem_begin('fv-' || g, left(repeat(md5(g::text), 7), g), scope => 'fingerprint') b
WHERE b.claimed;
SELECT count(*) FILTER (WHERE k.fingerprint = sha256(convert_to(left(repeat(md5(g::text), 7), g), 'UTF8'))) AS matching,
	   count(*) AS keys
FROM generate_series(0, 200) g
JOIN idem.keys k ON k.scope = 'fingerprint' AND k.key = 'fv-' || g;
-- Known digests (FIPS 180-4's examples), written out: a stored fingerprint
-- keeps matching its request after any update of the library.
SELECT claimed FROM idem_begin('fk-abc', 'abc', scope => 'fingerprint');
SELECT claimed FROM idem_begin('fk-448', 'abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq', scope => 'fingerprint');
SELECT key, fingerprint FROM idem.keys WHERE scope = 'fingerprint' AND key LIKE 'fk-%' ORDER BY key;
-- A fingerprint that differs in one byte conflicts.
SELECT state FROM idem_begin('fp-100', repeat('x', 100) || 'è', scope => 'fingerprint');
DELETE FROM idem.keys WHERE scope = 'fingerprint';
