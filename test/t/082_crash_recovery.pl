# Crash recovery.  kill -9 of a backend in the middle of a claim
# transaction, and of one in the middle of idem_complete, makes the
# postmaster reinitialize; an immediate stop under a pgbench load of claims
# and completes forces WAL recovery at the next start.  Afterwards every
# committed claim and response is there, nothing uncommitted is, no key
# has two holders, the primary key index matches the table, and new tokens
# are greater than every recovered one.
use strict;
use warnings;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('crash', conf => qq{
idem.purge_enabled = off
restart_after_crash = on
max_connections = 40
}, extension => []);
$node->safe_psql('postgres', 'CREATE EXTENSION idem; CREATE EXTENSION amcheck');

sub sql
{
	my ($query) = @_;
	return $node->safe_psql('postgres', $query);
}

# A background session with an open transaction; returns it and its pid.
sub open_session
{
	my ($setup) = @_;
	my $s = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	$s->query_safe($setup) if defined $setup;
	return ($s, $pid);
}

# Start a statement in a session and return once it waits on a lock.
sub start_blocked
{
	my ($s, $query, $like) = @_;
	$s->query_until(qr/started\n/, "\\echo started\n$query;\n");
	return $node->poll_query_until('postgres', qq{
SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE '%$like%'}, '1');
}

# SIGKILL the backend and wait for the server to reinitialize and accept
# connections again.
sub crash_backend
{
	my ($pid, @sessions) = @_;
	my $offset = -s $node->logfile;
	is(kill('KILL', $pid), 1, "backend $pid killed with SIGKILL");
	$node->wait_for_log(qr/all server processes terminated; reinitializing/, $offset);
	# PostgreSQL 18 names the process by its type ("client backend").
	ok($node->log_contains(
			qr/(?:server process|client backend) \(PID $pid\) was terminated by signal 9/,
			$offset),
		'the postmaster saw the backend die and reinitialized');
	ok($node->poll_query_until('postgres', 'SELECT 1', '1'),
		'server accepts connections after the crash restart');
	# The other sessions were terminated along with the killed one.
	foreach my $s (@sessions)
	{
		eval { $s->quit };
	}
}

sub row_of
{
	my ($key) = @_;
	return sql(qq{
SELECT token, coalesce(status::text, '-'), coalesce(encode(body, 'escape'), '-')
FROM idem.keys WHERE key = '$key'});
}

# --- Committed keys the crashes must not touch.
sql(q{
BEGIN;
SELECT count(*) FROM idem_begin('c-done', 'f');
SELECT idem_complete('c-done', 'f', 201, 'kept');
COMMIT;
SET idem.clock_offset = '-1h';
BEGIN;
SELECT count(*) FROM idem_begin('c-expired', 'f', lease => '1s', retention => '1s');
SELECT idem_complete('c-expired', 'f', 200, 'old', NULL, '1s');
COMMIT;
});
my $t_held = sql("SELECT token FROM idem_begin('c-held', 'f', lease => '1h')");
my $t_held2 = sql("SELECT token FROM idem_begin('c-held2', 'f', lease => '1h')");
my $done_row = row_of('c-done');
my $expired_row = row_of('c-expired');

# --- 1. kill -9 of the backend holding an open claim transaction: a new
# key and a re-claim of an expired one, with another claimer waiting.
my ($claimer, $claimer_pid) = open_session();
my $t_open = $claimer->query_safe(q{
BEGIN;
SELECT token FROM idem_begin('c-open', 'f');
SELECT token FROM idem_begin('c-expired', 'g') WHERE claimed;
});
like($t_open, qr/^\d+\n\d+$/, 'two claims made in an open transaction');
my ($waiter) = open_session();
ok(start_blocked($waiter, "SELECT * FROM idem_begin('c-open', 'f')", 'c-open'),
	'another claimer waits for it');

crash_backend($claimer_pid, $claimer, $waiter);
is(sql("SELECT count(*) FROM idem.keys WHERE key = 'c-open'"), '0',
	'the uncommitted new claim is gone');
is(row_of('c-expired'), $expired_row,
	'the uncommitted re-claim is gone; the expired row is as committed');
is(row_of('c-done'), $done_row, 'the committed response is intact');
is(row_of('c-held'), "$t_held|-|-", 'the committed claim is intact');
my ($c1, $c2) = split /\n/, $t_open;
is( sql("SELECT claimed, token > greatest($c1, $c2) FROM idem_begin('c-open', 'f')"),
	't|t', 'the key can be claimed again, with a token above the lost ones');

# --- 2. kill -9 of a backend in the middle of idem_complete (waiting for
# the row lock of a heartbeat), and one whose complete returned but did
# not commit.
my ($completer, $completer_pid) = open_session();
$completer->query_safe(
	"BEGIN; SELECT idem_complete('c-held', 'f', 200, 'lost', $t_held)");
my ($heartbeat) = open_session(
	"BEGIN; SELECT count(*) FROM idem_extend('c-held2', $t_held2, '2h')");
my ($blocked, $blocked_pid) = open_session();
ok( start_blocked($blocked,
		"SELECT idem_complete('c-held2', 'f', 200, 'lost too', $t_held2)", 'c-held2'),
	'a complete waits for the heartbeat\'s row lock');

crash_backend($blocked_pid, $completer, $heartbeat, $blocked);
is(row_of('c-held'), "$t_held|-|-",
	'the uncommitted complete is gone: the claim is still PROCESSING');
is(row_of('c-held2'), "$t_held2|-|-",
	'the complete killed mid-call left the claim PROCESSING');
like(sql("SELECT idem_complete('c-held', 'f', 200, 'retried', $t_held)"),
	qr/^\d{4}-/, 'the holder completes the key again with its token');
is(sql("SELECT state, status, encode(body, 'escape') FROM idem_begin('c-held', 'f')"),
	'DONE|200|retried', 'and the retried response replays');
is(row_of('c-done'), $done_row, 'the earlier response is still intact');

# --- 3. Immediate stop under a pgbench load of claims and completes.
# Each script run logs what it did in the same transactions as its idem
# calls: attempts (one row per run, whether or not it claimed) and
# completes (each stored response).
sql(q{
CREATE TABLE attempts (n int NOT NULL, claimed boolean NOT NULL, token bigint NOT NULL);
CREATE TABLE completes (n int NOT NULL, token bigint NOT NULL, status int NOT NULL, body bytea NOT NULL);
});

# mode 0: complete in a second transaction with the token; 1: complete in
# the claiming transaction; 2: roll the claim back; 3: never complete.
my $script = PostgreSQL::Test::Utils::tempdir() . '/claims.sql';
PostgreSQL::Test::Utils::append_to_file($script, q{
\set n random(1, 1500)
\set mode random(0, 3)
BEGIN;
SELECT claimed::int AS c, coalesce(token, 0) AS tok FROM idem_begin('k' || :n, 'f' || :n, lease => '1h', retention => '1d') \gset
\if :c = 1 and :mode = 2
ROLLBACK;
INSERT INTO attempts VALUES (:n, false, 0);
\else
INSERT INTO attempts VALUES (:n, :c = 1, :tok);
\if :c = 1 and :mode = 1
SELECT idem_complete('k' || :n, 'f' || :n, 200 + :n % 50, ('body-' || :n || '-' || :tok)::bytea);
INSERT INTO completes VALUES (:n, :tok, 200 + :n % 50, ('body-' || :n || '-' || :tok)::bytea);
\endif
COMMIT;
\endif
\if :c = 1 and :mode = 0
BEGIN;
SELECT idem_complete('k' || :n, 'f' || :n, 200 + :n % 50, ('body-' || :n || '-' || :tok)::bytea, :tok);
INSERT INTO completes VALUES (:n, :tok, 200 + :n % 50, ('body-' || :n || '-' || :tok)::bytea);
COMMIT;
\endif
});

my $clients = 4;
my ($out, $err) = ('', '');
my $pgbench = IPC::Run::start(
	[
		'pgbench', '-n', '-c', $clients, '-j', 2, '-T', 120, '-f', $script,
		'-h', $node->host, '-p', $node->port, 'postgres'
	],
	'>', \$out, '2>', \$err);
ok( $node->poll_query_until('postgres', q{
SELECT count(*) >= 3000 AND count(*) FILTER (WHERE claimed) >= 300 FROM attempts}),
	'pgbench has run 3000 claim transactions');

my $offset = -s $node->logfile;
$node->stop('immediate');
$pgbench->finish;
note "pgbench stdout:\n$out\npgbench stderr:\n$err";
my ($processed) = $out =~ /number of transactions actually processed: (\d+)/;
like($processed // '', qr/^\d+$/, "pgbench reports $processed runs completed before the stop");
unlike($err, qr/ERROR:/, 'no pgbench client got an SQL error before the stop');

$node->start;
ok( $node->log_contains(qr/database system was interrupted|not properly shut down/,
		$offset),
	'the server ran crash recovery at start');

my $logged = sql('SELECT count(*) FROM attempts');
cmp_ok($logged, '>=', $processed // 0,
	'every run pgbench saw committed left its attempt');
cmp_ok($logged, '<=', ($processed // 0) + $clients,
	'at most one run per client committed without pgbench seeing it');

# The keys are exactly the committed claims; the responses exactly the
# committed completes.
is( sql(q{
SELECT count(*) FROM (
	(SELECT 'k' || n AS key, token FROM attempts WHERE claimed
	 EXCEPT ALL SELECT key, token FROM idem.keys WHERE key LIKE 'k%')
	UNION ALL
	(SELECT key, token FROM idem.keys WHERE key LIKE 'k%'
	 EXCEPT ALL SELECT 'k' || n, token FROM attempts WHERE claimed)) d}),
	'0', 'the recovered keys are exactly the committed claims (key and token)');
is( sql(q{
SELECT count(*) FROM (
	(SELECT 'k' || n AS key, token, status, body FROM completes
	 EXCEPT ALL SELECT key, token, status, body FROM idem.keys
	 WHERE key LIKE 'k%' AND status IS NOT NULL)
	UNION ALL
	(SELECT key, token, status, body FROM idem.keys
	 WHERE key LIKE 'k%' AND status IS NOT NULL
	 EXCEPT ALL SELECT 'k' || n, token, status, body FROM completes)) d}),
	'0', 'the recovered responses are exactly the committed completes');
is( sql(q{
SELECT count(*) FROM idem.keys k WHERE key LIKE 'k%' AND status IS NULL
	AND NOT EXISTS (SELECT FROM attempts a WHERE 'k' || a.n = k.key AND a.claimed AND a.token = k.token)}),
	'0', 'every PROCESSING row is a committed claim');
is( sql(q{
SELECT count(*) FROM completes c
	WHERE NOT EXISTS (SELECT FROM idem_begin('k' || c.n, 'f' || c.n) b
		WHERE b.state = 'DONE' AND b.status = c.status AND b.body = c.body)}),
	'0', 'every committed response replays');
is( sql(q{
SELECT count(*) = count(DISTINCT token), count(*) = count(DISTINCT (scope, key))
FROM idem.keys}),
	't|t', 'tokens are unique and each key has one row');
is(sql('SELECT count(*) FROM (SELECT n FROM attempts WHERE claimed GROUP BY n HAVING count(*) > 1) d'),
	'0', 'no key was ever committed-claimed twice (the lease is an hour)');
is( sql(q{
SELECT count(*) FILTER (WHERE status IS NULL) > 0, count(*) FILTER (WHERE status IS NOT NULL) > 0
FROM idem.keys WHERE key LIKE 'k%'}),
	't|t', 'the recovered keys include both PROCESSING and DONE rows');
is(sql("SELECT bt_index_parent_check('idem.keys_pkey', true)"), '',
	'the primary key index matches the table (amcheck)');

my $max = sql('SELECT max(token) FROM idem.keys');
is(sql("SELECT claimed, token > $max FROM idem_begin('after-recovery', 'f')"),
	't|t', 'a new claim after recovery gets a token above every recovered one');
is(row_of('c-done'), $done_row, 'the first committed response is still intact');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
