/* idem--1.0.sql */

-- complain if script is sourced in psql, rather than via CREATE EXTENSION
\echo Use "CREATE EXTENSION idem" to load this file. \quit

/*
 * The key table lives in a fixed schema owned by the extension; the SQL
 * interface lives in the schema the extension is created in.
 */
CREATE SCHEMA idem;
REVOKE ALL ON SCHEMA idem FROM PUBLIC;

/* Fencing tokens: one sequence, so a token never repeats for any key. */
CREATE SEQUENCE idem.token_seq AS bigint;

/*
 * One row per (scope, key).  The fingerprint is a SHA-256 digest of the
 * caller's text.  A row is DONE when status is set, PROCESSING otherwise.
 * Keys compare bytewise (C collation).  The primary key is the only index,
 * and pages keep 10% free, so that storing a response (an UPDATE of
 * non-indexed columns) can be a HOT update; purge walks the table instead
 * of using an index on expires_at.
 */
CREATE TABLE idem.keys (
	scope		text COLLATE "C" NOT NULL,
	key			text COLLATE "C" NOT NULL,
	fingerprint	bytea NOT NULL,
	token		bigint NOT NULL,
	status		integer,
	body		bytea,
	lease_until	timestamptz,
	expires_at	timestamptz NOT NULL,
	PRIMARY KEY (scope, key)
) WITH (fillfactor = 90);
REVOKE ALL ON idem.keys, idem.token_seq FROM PUBLIC;

CREATE FUNCTION idem_begin(key text, fingerprint text,
						   lease interval DEFAULT NULL,
						   retention interval DEFAULT NULL,
						   scope text DEFAULT '',
						   wait boolean DEFAULT true)
RETURNS TABLE (claimed boolean, state text, token bigint, status integer,
			   body bytea, lease_until timestamptz, expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_begin'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION idem_complete(key text, fingerprint text, status integer,
							  body bytea, token bigint DEFAULT NULL,
							  retention interval DEFAULT NULL,
							  scope text DEFAULT '')
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_release(key text, token bigint, scope text DEFAULT '')
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_release'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_extend(key text, token bigint, lease interval,
							scope text DEFAULT '')
RETURNS timestamptz
AS 'MODULE_PATHNAME', 'idem_extend'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION idem_purge(max_rows integer DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_purge'
LANGUAGE C VOLATILE PARALLEL UNSAFE;
REVOKE ALL ON FUNCTION idem_purge(integer) FROM PUBLIC;

/* Counters per database; needs shared_preload_libraries = 'idem'. */
CREATE FUNCTION idem_stats(
	OUT dbid oid, OUT claims bigint, OUT takeovers bigint, OUT replays bigint,
	OUT in_flight bigint, OUT conflicts bigint, OUT completes bigint,
	OUT superseded bigint, OUT releases bigint, OUT purged_rows bigint,
	OUT purge_runs bigint, OUT last_purge timestamptz,
	OUT last_purge_error text)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_stats'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

CREATE VIEW idem_stats AS
	SELECT d.datname, s.*
	FROM idem_stats() s LEFT JOIN pg_catalog.pg_database d ON d.oid = s.dbid;

CREATE FUNCTION idem_stats_reset()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_stats_reset'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;
REVOKE ALL ON FUNCTION idem_stats_reset() FROM PUBLIC;
