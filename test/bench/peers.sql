-- The two peers idem is measured against, on the same table shape.
--
-- plain_keys: the table a hand-written version keeps (a copy of
-- idem.keys: same columns, primary key and expiry index).
-- plpg_begin / plpg_complete: the same contract written in PL/pgSQL.

CREATE TABLE plain_keys (LIKE idem.keys INCLUDING ALL);
CREATE SEQUENCE plain_token_seq AS bigint;

CREATE FUNCTION plpg_begin(p_key text, p_fp text,
						   p_lease interval DEFAULT '60s',
						   p_retention interval DEFAULT '1 day',
						   p_scope text DEFAULT '')
RETURNS TABLE (claimed boolean, state text, token bigint, status integer,
			   body bytea, lease_until timestamptz, expires_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
	v_now timestamptz := clock_timestamp();
	v_fp bytea := sha256(convert_to(p_fp, 'UTF8'));
	r plain_keys%ROWTYPE;
	t bigint;
BEGIN
	IF p_key IS NULL OR p_key = '' OR p_fp IS NULL THEN
		RAISE EXCEPTION 'key and fingerprint are required';
	END IF;
	INSERT INTO plain_keys AS k (scope, key, fingerprint, token, lease_until, expires_at)
	VALUES (p_scope, p_key, v_fp, nextval('plain_token_seq'), v_now + p_lease, v_now + p_retention)
	ON CONFLICT DO NOTHING
	RETURNING k.token INTO t;
	IF FOUND THEN
		RETURN QUERY SELECT true, 'PROCESSING', t, NULL::int, NULL::bytea,
			v_now + p_lease, v_now + p_retention;
		RETURN;
	END IF;
	SELECT * INTO r FROM plain_keys k WHERE k.scope = p_scope AND k.key = p_key FOR UPDATE;
	IF NOT FOUND OR r.expires_at <= v_now THEN
		DELETE FROM plain_keys k WHERE k.scope = p_scope AND k.key = p_key;
		INSERT INTO plain_keys AS k (scope, key, fingerprint, token, lease_until, expires_at)
		VALUES (p_scope, p_key, v_fp, nextval('plain_token_seq'), v_now + p_lease, v_now + p_retention)
		RETURNING k.token INTO t;
		RETURN QUERY SELECT true, 'PROCESSING', t, NULL::int, NULL::bytea,
			v_now + p_lease, v_now + p_retention;
	ELSIF r.fingerprint <> v_fp THEN
		RETURN QUERY SELECT false, 'CONFLICT', NULL::bigint, NULL::int, NULL::bytea,
			NULL::timestamptz, NULL::timestamptz;
	ELSIF r.status IS NOT NULL THEN
		RETURN QUERY SELECT false, 'DONE', NULL::bigint, r.status, r.body,
			NULL::timestamptz, r.expires_at;
	ELSIF r.lease_until > v_now THEN
		RETURN QUERY SELECT false, 'PROCESSING', NULL::bigint, NULL::int, NULL::bytea,
			r.lease_until, r.expires_at;
	ELSE
		UPDATE plain_keys k SET token = nextval('plain_token_seq'), lease_until = v_now + p_lease
		WHERE k.scope = p_scope AND k.key = p_key RETURNING k.token INTO t;
		RETURN QUERY SELECT true, 'PROCESSING', t, NULL::int, NULL::bytea,
			v_now + p_lease, r.expires_at;
	END IF;
END $$;

CREATE FUNCTION plpg_complete(p_key text, p_fp text, p_status int, p_body bytea,
							  p_token bigint,
							  p_retention interval DEFAULT '1 day',
							  p_scope text DEFAULT '')
RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
	v_exp timestamptz;
BEGIN
	UPDATE plain_keys k SET status = p_status, body = p_body, lease_until = NULL,
		expires_at = clock_timestamp() + p_retention
	WHERE k.scope = p_scope AND k.key = p_key AND k.token = p_token
	  AND k.fingerprint = sha256(convert_to(p_fp, 'UTF8')) AND k.status IS NULL
	RETURNING k.expires_at INTO v_exp;
	IF NOT FOUND THEN
		RAISE EXCEPTION 'no claim for key % with token %', p_key, p_token;
	END IF;
	RETURN v_exp;
END $$;

CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO accounts SELECT g FROM generate_series(1, 100000) g;

-- Contention check: a key's holder is recorded here while it holds the
-- key; a second simultaneous holder would violate the primary key.
CREATE TABLE holders (k int PRIMARY KEY, token bigint NOT NULL);
CREATE TABLE claims_log (k int NOT NULL, token bigint NOT NULL);
