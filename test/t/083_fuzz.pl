# Fuzzing: every function of the interface is called tens of thousands of
# times with random and hostile arguments (NULLs, empty, boundary-length
# and multi-megabyte strings, invalid UTF-8 attempts, extreme, negative and
# calendar-dependent intervals, extreme tokens, statuses and max_rows,
# bodies around idem.max_body_size, random settings), by two concurrent
# sessions in a UTF8 database and one in a SQL_ASCII database, where keys
# may hold bytes that are not UTF-8.
#
# Every call returns, or raises an ERROR of an expected class (22, 54000,
# ID, and 55P03/40P01/40001 from the concurrent sessions); never an
# internal error.  idem_begin always answers one well-formed row.  The
# server never crashes, the control keys stored before (DONE with binary,
# empty, NULL and 1 MB bodies, and a claim in flight) are byte-identical
# and not even rewritten afterwards, and every row left in idem.keys is
# well-formed.
use strict;
use warnings;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

# Calls per session; three sessions.
my $iterations = 8000;

my $node = idem_node('fuzz', conf => qq{
idem.purge_naptime = 1
# Not the ERRORs of every call, but crash reports (LOG).
log_min_messages = log
log_min_error_statement = panic
}, extension => []);
$node->safe_psql('postgres', q{
CREATE DATABASE fuzz_utf8 TEMPLATE template0 ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C';
CREATE DATABASE fuzz_ascii TEMPLATE template0 ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C';
});
my @dbs = qw(fuzz_utf8 fuzz_ascii);

# Generators and the fuzzing procedure.  Each call runs in its own
# subtransaction (an EXCEPTION block); the outcome is logged after it.
my $fuzz_sql = <<'EOSQL';
CREATE EXTENSION idem;

CREATE TABLE fuzz_log (session int, fn text, outcome text);
CREATE TABLE fuzz_bad (session int, fn text, outcome text, message text, args text);

CREATE FUNCTION fz_int(lo bigint, hi bigint) RETURNS bigint
LANGUAGE sql AS $$ SELECT lo + floor(random() * (hi - lo + 1))::bigint $$;

-- Keys, scopes and fingerprints: mostly from small pools that hit the
-- same rows (control keys included), sometimes hostile.  Calls that may
-- fail take a volatile argument, so that the planner does not fold them
-- into an error in every branch.
CREATE FUNCTION fz_text(kind text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	maxlen int := pg_size_bytes(regexp_replace(current_setting('idem.max_key_length'), '(\d)B$', '\1'));
	r int := fz_int(0, 99);
BEGIN
	IF kind = 'key' AND r < 35 THEN
		RETURN (ARRAY['ctl-done', 'ctl-proc', 'ctl-bin', 'ctl-big', 'ctl-empty',
			'ctl-null'])[fz_int(1, 6)];
	ELSIF kind = 'key' AND r < 80 THEN
		RETURN 'key-' || fz_int(1, 40);
	ELSIF kind = 'scope' AND r < 80 THEN
		RETURN (ARRAY['', 'ctl', 'fz1', 'fz2'])[fz_int(1, 4)];
	ELSIF kind = 'fp' AND r < 80 THEN
		RETURN (ARRAY['ctl-fp', 'fp-1', 'fp-2', ''])[fz_int(1, 4)];
	END IF;
	RETURN CASE fz_int(0, 17)
		WHEN 0 THEN NULL
		WHEN 1 THEN ''
		WHEN 2 THEN repeat('x', maxlen)
		WHEN 3 THEN repeat('x', maxlen + 1)
		WHEN 4 THEN repeat('é', fz_int(1, 600)::int)
		WHEN 5 THEN repeat('ÿ', maxlen / 2) || 'z'
		WHEN 6 THEN CASE WHEN fz_int(0, 5) = 0
			THEN repeat(md5(random()::text), fz_int(1, 100000)::int)
			ELSE repeat('m', fz_int(1, 5000)::int) END
		WHEN 7 THEN convert_from(decode(md5(random()::text), 'hex'), 'UTF8')
		WHEN 8 THEN convert_from(decode(md5(random()::text), 'hex'), 'SQL_ASCII')
		WHEN 9 THEN convert_from('\xc328'::bytea, 'UTF8')
		WHEN 10 THEN convert_from('\xedb080'::bytea, 'LATIN1')
		WHEN 11 THEN chr(fz_int(1, 1114111)::int) || chr(fz_int(1, 255)::int)
		WHEN 12 THEN (ARRAY['%s%s%s%n', E'\\', '"', E'\n\t\r', ''' OR 1=1 --', '\x00',
			'ctl-done' || chr(fz_int(160, 160)::int), 'CTL-DONE', 'ctl-done ', ' ctl-done', 'ctl', E'ctl-done\r'])[fz_int(1, 12)]
		WHEN 13 THEN md5(random()::text)
		WHEN 14 THEN chr(fz_int(0, 0)::int)
		WHEN 15 THEN repeat(chr(fz_int(1114111, 1114111)::int), fz_int(1, 300)::int)
		WHEN 16 THEN convert_from(decode(repeat('ff', fz_int(1, 40)::int), 'hex'), 'SQL_ASCII')
		ELSE encode(decode(md5(random()::text), 'hex'), 'escape') END;
END $$;

CREATE FUNCTION fz_interval() RETURNS interval LANGUAGE sql AS $$
SELECT CASE fz_int(0, 24)
	WHEN 0 THEN NULL
	WHEN 1 THEN interval '0'
	WHEN 2 THEN interval '-1 microsecond'
	WHEN 3 THEN interval '1 microsecond'
	WHEN 4 THEN interval '1 second'
	WHEN 5 THEN interval '1 hour'
	WHEN 6 THEN interval '29 days'
	WHEN 7 THEN interval '30 days'
	WHEN 8 THEN interval '30 days 00:00:00.000001'
	WHEN 9 THEN interval '1 mon'
	WHEN 10 THEN interval '1 mon -1 day'
	WHEN 11 THEN interval '-1 mon 31 days'
	WHEN 12 THEN interval '1 day -86399.999999 seconds'
	WHEN 13 THEN interval '178000000 years'
	WHEN 14 THEN interval '-178000000 years'
	WHEN 15 THEN interval '2562047788 hours'
	WHEN 16 THEN interval '-2562047788 hours'
	WHEN 17 THEN make_interval(days => 2147483647)
	WHEN 18 THEN make_interval(days => -2147483647, hours => 2147483647)
	WHEN 19 THEN make_interval(months => 2147483647, days => -2147483647)
	WHEN 20 THEN fz_int(-1000000, 1000000) * interval '1 second'
	WHEN 21 THEN random() * interval '40 days'
	WHEN 22 THEN fz_int(1, 3600) * interval '1 second'
	ELSE fz_int(1, 600) * interval '1 millisecond' END $$;

CREATE FUNCTION fz_int4() RETURNS int LANGUAGE sql AS $$
SELECT CASE fz_int(0, 8)
	WHEN 0 THEN NULL WHEN 1 THEN 0 WHEN 2 THEN -1 WHEN 3 THEN 200
	WHEN 4 THEN 2147483647 WHEN 5 THEN -2147483648 WHEN 6 THEN 1
	ELSE fz_int(-2147483648, 2147483647)::int END $$;

-- Tokens: extreme, random, or recent ones of this session; never a
-- control key's (those are 1 .. ctl_max).
CREATE FUNCTION fz_token(recent bigint, ctl_max bigint) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
	t bigint := CASE fz_int(0, 9)
		WHEN 0 THEN NULL WHEN 1 THEN 0 WHEN 2 THEN -1
		WHEN 3 THEN -9223372036854775808 WHEN 4 THEN 9223372036854775807
		WHEN 5 THEN ((random() * 2 - 1) * 9.2e18)::bigint
		WHEN 6 THEN recent - fz_int(0, 3)
		ELSE recent END;
BEGIN
	IF t BETWEEN 1 AND ctl_max THEN
		t := -t;
	END IF;
	RETURN t;
END $$;

CREATE FUNCTION fz_body() RETURNS bytea LANGUAGE plpgsql AS $$
DECLARE
	maxsize bigint := pg_size_bytes(regexp_replace(current_setting('idem.max_body_size'), '(\d)B$', '\1'));
BEGIN
	RETURN CASE fz_int(0, 19)
		WHEN 0 THEN NULL
		WHEN 1 THEN ''::bytea
		WHEN 2 THEN '\x00'::bytea
		WHEN 3 THEN decode(md5(random()::text), 'hex')
		WHEN 4 THEN convert_to(repeat('b', least(maxsize, 3000000)::int), 'UTF8')
		WHEN 5 THEN convert_to(repeat('b', least(maxsize + 1, 3000000)::int), 'UTF8')
		WHEN 6 THEN CASE WHEN fz_int(0, 4) = 0
			THEN convert_to(repeat('c', 3 * 1024 * 1024), 'UTF8') ELSE '\xff'::bytea END
		ELSE convert_to(repeat('d', fz_int(0, 300)::int), 'UTF8') END;
END $$;

-- Random values of the user settings (sometimes out of bounds) and of the
-- clock offset (never forward, so the control keys stay live).
CREATE FUNCTION fz_setting() RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	RETURN CASE fz_int(0, 6)
		WHEN 0 THEN set_config('idem.max_key_length', fz_int(-1, 1100)::text, false)
		WHEN 1 THEN set_config('idem.max_body_size', fz_int(-1, 2100000)::text, false)
		WHEN 2 THEN set_config('idem.max_retention', fz_int(-1, 2147483647)::text, false)
		WHEN 3 THEN set_config('idem.default_lease', fz_int(-1, 100000)::text, false)
		WHEN 4 THEN set_config('idem.default_retention', fz_int(0, 3000000)::text, false)
		ELSE set_config('idem.clock_offset', (-CASE WHEN fz_int(0, 1) = 0
			THEN fz_int(0, 7200) ELSE fz_int(0, 2147483647) END)::text, false) END;
END $$;

CREATE FUNCTION fz_reset() RETURNS void LANGUAGE sql AS $$
RESET idem.max_key_length; RESET idem.max_body_size; RESET idem.max_retention;
RESET idem.default_lease; RESET idem.default_retention; RESET idem.clock_offset $$;

CREATE PROCEDURE fuzz(session int, iterations int, ctl_max bigint)
LANGUAGE plpgsql AS $$
DECLARE
	fn text;
	outcome text;
	msg text;
	args text;
	recent bigint := 0;
	rk text; rfp text; rsc text;
	b record;
	nrows int;
	k text; fp text; sc text;
	lease interval; ret interval;
	tok bigint; st int; body bytea; w boolean; maxrows int;
BEGIN
	FOR i IN 1 .. iterations LOOP
		fn := (ARRAY['idem_begin', 'idem_begin', 'idem_begin', 'idem_complete',
			'idem_complete', 'idem_release', 'idem_extend', 'idem_purge',
			'setting'])[fz_int(1, 9)];
		outcome := '00000';
		msg := NULL;
		args := NULL;
		-- The arguments; an invalid one (such as invalid UTF-8) fails here,
		-- before any call.
		BEGIN
			IF rk IS NOT NULL AND fz_int(0, 9) < 4 THEN
				-- The key this session claimed last, to reach completes,
				-- releases and extends that succeed, and repeats of them.
				k := rk; fp := rfp; sc := rsc;
			ELSE
				k := fz_text('key'); fp := fz_text('fp'); sc := fz_text('scope');
			END IF;
			lease := CASE WHEN fz_int(0, 1) = 0 THEN NULL ELSE fz_interval() END;
			ret := CASE WHEN fz_int(0, 1) = 0 THEN NULL ELSE fz_interval() END;
			tok := fz_token(recent, ctl_max); st := fz_int4(); body := fz_body();
			w := (ARRAY[NULL, true, true, true, false, false, false, false])[fz_int(1, 8)];
			maxrows := fz_int4();
			args := format('key=%s fp=%s scope=%s lease=%s ret=%s tok=%s status=%s body=%s wait=%s max=%s',
				left(k, 40), left(fp, 40), left(sc, 40), lease, ret, tok, st,
				length(body), w, maxrows);
		EXCEPTION WHEN OTHERS THEN
			GET STACKED DIAGNOSTICS outcome = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
			fn := 'arguments';
		END;
		IF fn <> 'arguments' THEN
		-- Only the call waits at most lock_timeout, not the logging.
		PERFORM set_config('lock_timeout', '5ms', false);
		BEGIN
			IF fn = 'idem_begin' THEN
				nrows := 0;
				FOR b IN SELECT * FROM idem_begin(k, fp, lease, ret, sc, w) LOOP
					nrows := nrows + 1;
					IF b.claimed IS NULL OR b.state IS NULL
						OR b.state NOT IN ('PROCESSING', 'DONE', 'CONFLICT')
						OR (b.claimed AND (b.token IS NULL OR b.state <> 'PROCESSING'
							OR b.lease_until IS NULL OR b.expires_at IS NULL
							OR b.lease_until > b.expires_at))
						OR (NOT b.claimed AND b.token IS NOT NULL)
						OR (b.state = 'CONFLICT' AND (b.status IS NOT NULL OR b.body IS NOT NULL))
						OR (b.state <> 'DONE' AND (b.status IS NOT NULL OR b.body IS NOT NULL))
					THEN
						outcome := 'BAD ROW';
						msg := format('%s', b);
					END IF;
					IF b.claimed THEN
						recent := b.token;
						rk := k; rfp := fp; rsc := sc;
					END IF;
				END LOOP;
				IF nrows <> 1 THEN
					outcome := 'BAD ROW COUNT';
					msg := nrows::text;
				END IF;
			ELSIF fn = 'idem_complete' THEN
				PERFORM idem_complete(k, fp, st, body, tok, ret, sc);
			ELSIF fn = 'idem_release' THEN
				PERFORM idem_release(k, tok, sc);
			ELSIF fn = 'idem_extend' THEN
				PERFORM idem_extend(k, tok, lease, sc);
			ELSIF fn = 'idem_purge' THEN
				PERFORM idem_purge(maxrows);
			ELSE
				PERFORM fz_setting();
			END IF;
		EXCEPTION WHEN OTHERS THEN
			GET STACKED DIAGNOSTICS outcome = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
		END;
		PERFORM set_config('lock_timeout', '0', false);
		END IF;
		INSERT INTO fuzz_log VALUES (session, fn, outcome);
		-- Documented SQLSTATEs only; lock timeouts and deadlocks come from
		-- the concurrent session.
		IF (fn = 'arguments' AND outcome !~ '^(22...|54000)$')
			OR (fn <> 'arguments'
				AND outcome !~ '^(00000|22004|22023|22001|54000|ID00[1-4]|55P03|40P01|40001)$')
		THEN
			INSERT INTO fuzz_bad VALUES (session, fn, outcome, msg, args);
		END IF;
		IF i % 100 = 0 THEN
			COMMIT;
			PERFORM fz_reset();
		END IF;
	END LOOP;
END $$;
EOSQL

# The control keys, stored before any fuzzing.
my $control_sql = q{
BEGIN;
SELECT count(*) FROM idem_begin('ctl-done', 'ctl-fp', retention => '30 days', scope => 'ctl');
SELECT idem_complete('ctl-done', 'ctl-fp', 200, '{"ok":true}', NULL, '30 days', 'ctl');
SELECT count(*) FROM idem_begin('ctl-bin', 'ctl-fp', retention => '30 days');
SELECT idem_complete('ctl-bin', 'ctl-fp', 7, (SELECT string_agg(set_byte('\x00'::bytea, 0, g), ''::bytea) FROM generate_series(0, 255) g), NULL, '30 days');
SELECT count(*) FROM idem_begin('ctl-big', 'ctl-fp', retention => '30 days', scope => 'ctl');
SELECT idem_complete('ctl-big', 'ctl-fp', 2147483647, convert_to(repeat('B', 1048576), 'UTF8'), NULL, '30 days', 'ctl');
SELECT count(*) FROM idem_begin('ctl-empty', 'ctl-fp', retention => '30 days');
SELECT idem_complete('ctl-empty', 'ctl-fp', 0, '', NULL, '30 days');
SELECT count(*) FROM idem_begin('ctl-null', 'ctl-fp', retention => '30 days', scope => 'ctl');
SELECT idem_complete('ctl-null', 'ctl-fp', 204, NULL, NULL, '30 days', 'ctl');
COMMIT;
SELECT count(*) FROM idem_begin('ctl-proc', 'ctl-fp', lease => '29 days', retention => '30 days');
};

my $control_rows = q{
SELECT string_agg(concat_ws('|', scope, key, encode(fingerprint, 'hex'), token,
	status, length(body), md5(body), lease_until, expires_at, xmin, ctid), E'\n'
	ORDER BY scope, key)
FROM idem.keys WHERE key LIKE 'ctl-%' AND token <= };

# The control keys' tokens are the first ones each database gave out, up
# to where its token sequence stood after them.
my %before;
my %ctl_max;
foreach my $db (@dbs)
{
	$node->safe_psql($db, $fuzz_sql);
	$node->safe_psql($db, $control_sql);
	$ctl_max{$db} = $node->safe_psql($db, 'SELECT last_value FROM idem.token_seq');
	is( $node->safe_psql($db,
			"SELECT count(DISTINCT token), count(*), max(token) <= $ctl_max{$db} FROM idem.keys"),
		'6|6|t', "$db: six control keys with six tokens, the first the database gave out");
	$before{$db} = $node->safe_psql($db, $control_rows . $ctl_max{$db});
}
is( $node->safe_psql('fuzz_ascii',
		"SELECT encode(body, 'hex') = (SELECT string_agg(lpad(to_hex(g), 2, '0'), '') FROM generate_series(0, 255) g) FROM idem.keys WHERE key = 'ctl-bin'"),
	't', 'the binary control body holds all 256 byte values');

my $started = $node->safe_psql('postgres', 'SELECT pg_postmaster_start_time()');
my $log_offset = -s $node->logfile;

# Three sessions at once: two in the UTF8 database, one in SQL_ASCII.
my @runs;
my %out;
my $session = 0;
foreach my $db ('fuzz_utf8', 'fuzz_utf8', 'fuzz_ascii')
{
	$session++;
	my $s = $session;
	$out{$s} = '';
	push @runs, IPC::Run::start(
		[
			'psql', '-X', '-q', '-v', 'ON_ERROR_STOP=1',
			'-d', $node->connstr($db),
			'-c', "SELECT setseed(0.$s)",
			'-c', "CALL fuzz($s, $iterations, $ctl_max{$db})"
		],
		'>&', \$out{$s},
		IPC::Run::timeout($PostgreSQL::Test::Utils::timeout_default));
}
my $i = 0;
foreach my $run (@runs)
{
	$i++;
	ok($run->finish, "fuzz session $i completed its $iterations calls")
	  or diag($out{$i});
}

# --- The server is up and never crashed.
is($node->safe_psql('postgres', 'SELECT pg_postmaster_start_time()'), $started,
	'the server is up and was never restarted');
my $log = slurp_file($node->logfile, $log_offset);
unlike($log, qr/terminated by signal|exited with exit code [1-9]|server process .* was terminated|terminating any other active server processes|PANIC:|TRAP:/,
	'the server log shows no crashed process');

# --- Every call returned or raised an expected error.
my %seen;
foreach my $db (@dbs)
{
	is($node->safe_psql($db, 'SELECT count(*) FROM fuzz_log'),
		$db eq 'fuzz_utf8' ? 2 * $iterations : $iterations, "$db: every call was logged");
	is( $node->safe_psql($db,
			"SELECT coalesce(string_agg(format('%s %s %s: %s [%s]', session, fn, outcome, message, args), E'\\n'), '') FROM (SELECT * FROM fuzz_bad LIMIT 20) b"),
		'', "$db: no call failed with an unexpected SQLSTATE or answered a malformed row");
	note $node->safe_psql($db,
		"SELECT string_agg(format('%s %s %s', fn, outcome, n), E'\\n' ORDER BY fn, outcome) FROM (SELECT fn, outcome, count(*) n FROM fuzz_log GROUP BY 1, 2) c");
	$seen{$_} = 1
	  for split /\n/,
	  $node->safe_psql($db, "SELECT DISTINCT fn || ' ' || outcome FROM fuzz_log");
}
# The fuzzing reached the interesting paths: each function succeeded and
# each kind of refusal happened.
foreach my $case (
	'idem_begin 00000', 'idem_begin 22004', 'idem_begin 22023',
	'idem_begin 22001', 'arguments 22021',
	'idem_complete 00000',
	'idem_complete ID002', 'idem_complete ID003', 'idem_complete ID004',
	'idem_release 00000', 'idem_release ID002', 'idem_release ID004',
	'idem_extend 00000', 'idem_extend ID003', 'idem_purge 00000',
	'idem_purge 22023', 'setting 00000', 'setting 22023')
{
	ok($seen{$case}, "reached: $case");
}
# A call that waits for another session's claim gives up under
# lock_timeout with 55P03.  Shown here with a claim held open, since the
# fuzzing sessions collide on a held key only by chance.
my $holder = $node->background_psql('fuzz_utf8', on_error_stop => 0);
$holder->query_safe("BEGIN; SELECT claimed FROM idem_begin('lt-held', 'f')");
my ($lt_ret, $lt_out, $lt_err) = $node->psql('fuzz_utf8',
	"\\set VERBOSITY verbose\nSET lock_timeout = '50ms'; SELECT * FROM idem_begin('lt-held', 'f')");
like($lt_err, qr/ERROR:  55P03:/,
	'a call that waits for another session\'s claim gets 55P03 under lock_timeout');
like($lt_err, qr/idempotency key "lt-held"/, 'and its context names the key');
$holder->query_safe('ROLLBACK');
$holder->quit;
# A complete with another fingerprint than the claim's gets ID001.  The
# fuzzing sessions reach it only when a key they picked is free at that
# moment, which depends on their timing; so it is shown here.
my ($fp_ret, $fp_out, $fp_err) = $node->psql('fuzz_utf8', q{
\set VERBOSITY verbose
BEGIN;
SELECT claimed FROM idem_begin('fp-other', 'f');
SELECT idem_complete('fp-other', 'g', 200, 'x');
});
like($fp_err, qr/ERROR:  ID001:/, 'a complete with another fingerprint gets ID001');

# Keys that are not UTF-8: stored and replayed in SQL_ASCII, refused
# before any call in UTF8.
is( $node->safe_psql('fuzz_ascii', q{
SELECT claimed FROM idem_begin(convert_from('\xfffe80'::bytea, 'SQL_ASCII'), 'f', scope => 'raw');
SELECT idem_complete(convert_from('\xfffe80'::bytea, 'SQL_ASCII'), 'f', 200, '\xc0'::bytea, token, scope => 'raw')
	IS NOT NULL FROM idem.keys WHERE scope = 'raw';
SELECT state, encode(body, 'hex') FROM idem_begin(convert_from('\xfffe80'::bytea, 'SQL_ASCII'), 'f', scope => 'raw');
SELECT encode(convert_to(key, 'SQL_ASCII'), 'hex') FROM idem.keys WHERE scope = 'raw';
}),
	"t\nt\nDONE|c0\nfffe80", 'SQL_ASCII: a key of non-UTF-8 bytes is claimed, completed and replayed');
my ($ret, $stdout, $stderr) = $node->psql('fuzz_utf8',
	"\\set VERBOSITY verbose\nSELECT * FROM idem_begin(convert_from('\\xfffe80'::bytea, 'SQL_ASCII'), 'f')");
like($stderr, qr/ERROR:  22021:/, 'UTF8: the same key is refused as invalid UTF-8 (22021)');

# --- The control keys are untouched; every row is well-formed.
foreach my $db (@dbs)
{
	is($node->safe_psql($db, $control_rows . $ctl_max{$db}), $before{$db},
		"$db: the control keys are byte-identical and were not rewritten");
	is( $node->safe_psql($db, q{
SELECT count(*) FROM idem.keys
WHERE length(fingerprint) <> 32 OR key = '' OR octet_length(key) > 1024
	OR octet_length(scope) > 1024
	OR (status IS NULL AND (body IS NOT NULL OR lease_until IS NULL OR lease_until > expires_at))
	OR (status IS NOT NULL AND lease_until IS NOT NULL)}),
		'0', "$db: every stored row is well-formed");
	is($node->safe_psql($db,
			'SELECT count(*) = count(DISTINCT token) FROM idem.keys'),
		't', "$db: tokens are unique");
	is( $node->safe_psql($db,
			"SELECT state, status, md5(body) = md5(convert_to(repeat('B', 1048576), 'UTF8')) FROM idem_begin('ctl-big', 'ctl-fp', scope => 'ctl')"),
		'DONE|2147483647|t', "$db: the 1 MB control response replays");
}

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, $_) for @dbs;

$node->stop;
done_testing();
