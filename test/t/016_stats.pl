# idem_stats counts exactly what the test did, per database: each claim
# outcome, completes, superseded tokens, releases, purged rows and purge
# runs, and a failed purge run's error.  idem_stats_reset() is for
# superusers and zeroes everything.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('stats', conf => qq{
idem.purge_naptime = 1
}, extension => []);
$node->safe_psql('postgres', 'CREATE DATABASE other');
$node->safe_psql($_, 'CREATE EXTENSION idem') for qw(postgres other);

my $counters =
  'claims, takeovers, replays, in_flight, conflicts, completes, superseded, releases';

sub stats
{
	my ($columns, $db) = @_;
	$db //= 'postgres';
	return $node->safe_psql('postgres',
		"SELECT $columns FROM idem_stats WHERE datname = '$db'");
}

sub psql_ok
{
	my ($sql) = @_;
	return $node->safe_psql('postgres', $sql);
}

# --- Claim outcomes.
my $t1 = psql_ok("SELECT token FROM idem_begin('a', 'fa')");    # claim
is(psql_ok("SELECT state FROM idem_begin('a', 'fa')"),
	'PROCESSING', 'in flight');
is(psql_ok("SELECT state FROM idem_begin('a', 'other')"),
	'CONFLICT', 'conflict');
psql_ok("SELECT idem_complete('a', 'fa', 200, 'ok', $t1)");     # complete
is(psql_ok("SELECT state FROM idem_begin('a', 'fa')"), 'DONE', 'replay');
is(psql_ok("SELECT state FROM idem_begin('a', 'fa')"), 'DONE', 'replay again');

my $t2 = psql_ok("SELECT token FROM idem_begin('b', 'fb', lease => '1s')");  # claim
my $t3 = psql_ok(
	"SET idem.clock_offset = '1min'; SELECT token FROM idem_begin('b', 'fb') WHERE claimed"
);                                                               # takeover
cmp_ok($t3, '>', $t2, 'takeover with a greater token');
my ($ret, $out, $err) =
  $node->psql('postgres', "SELECT idem_complete('b', 'fb', 200, 'late', $t2)");
isnt($ret, 0, 'complete with the superseded token fails');

my $t4 = psql_ok("SELECT token FROM idem_begin('c', 'fc')");    # claim
is(psql_ok("SELECT idem_release('c', $t4)"), 't', 'release');

# One claim in the other database.
$node->safe_psql('other', "SELECT count(*) FROM idem_begin('x', 'f')");

is(stats($counters), '3|1|2|1|1|1|1|1', 'postgres: counters match what was done');
is(stats($counters, 'other'), '1|0|0|0|0|0|0|0', 'other: counted apart');

# --- Purge: 30 expired keys, purged by the worker.
psql_ok(q{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, 30) g,
	idem_begin('old-' || g, 'f', lease => '1s', retention => '1s')});
ok($node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'old-%'", '0'),
	'expired keys purged');
ok( $node->poll_query_until('postgres',
		"SELECT claims, purged_rows, purge_runs > 0, last_purge IS NOT NULL, last_purge_error IS NULL"
		  . " FROM idem_stats WHERE datname = 'postgres'",
		'33|30|t|t|t'),
	'postgres: 30 rows purged, runs recorded, no error');
ok( $node->poll_query_until('postgres',
		"SELECT purged_rows = 0 AND purge_runs > 0 FROM idem_stats WHERE datname = 'other'"),
	'other: visited, nothing to purge');

# --- A purge run that fails records its error; the next one clears it.
my $launcher_sql =
  "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'";
my $launcher = psql_ok($launcher_sql);
my $offset = -s $node->logfile;
# The key table is moved away in the transaction that creates five expired
# keys, so every purge run fails until it is back.
my $missing = 'extension "idem" is not installed in this database';
psql_ok(q{
BEGIN;
SET LOCAL idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, 5) g,
	idem_begin('doomed-' || g, 'f', lease => '1s', retention => '1s');
ALTER TABLE idem.keys RENAME TO keys_moved;
COMMIT;
});
ok( $node->poll_query_until('postgres',
		"SELECT last_purge_error FROM idem_stats WHERE datname = 'postgres'",
		$missing),
	'the purge error is in idem_stats');
is(psql_ok("SELECT count(*) FROM idem.keys_moved WHERE key LIKE 'doomed-%'"),
	'5', 'nothing purged by the failed run');
ok( $node->log_contains(qr/ERROR:  \Q$missing\E/, $offset),
	'the error is logged');
ok( $node->wait_for_log(
		qr/background worker "idem purge" \(PID \d+\) exited with exit code 1/,
		$offset),
	'the failed purge worker exited with status 1');
is(stats('last_purge_error IS NULL', 'other'), 't',
	'the other database is purged without error meanwhile');

psql_ok('ALTER TABLE idem.keys_moved RENAME TO keys');
ok( $node->poll_query_until('postgres',
		"SELECT last_purge_error IS NULL AND purged_rows = 35 FROM idem_stats WHERE datname = 'postgres'"),
	'after the fix, the next run purges and clears the error');
is(psql_ok($launcher_sql), $launcher, 'same launcher throughout');

# --- Reset: superuser only.
psql_ok('CREATE ROLE someone LOGIN');
psql_ok('GRANT EXECUTE ON FUNCTION idem_stats_reset() TO someone');
($ret, $out, $err) = $node->psql('postgres',
	'SET ROLE someone; SELECT idem_stats_reset()');
like($err, qr/only superusers may reset idem statistics/,
	'idem_stats_reset refused to a non-superuser');
is(stats('claims'), '38', 'counters unchanged by the refused reset');
psql_ok('SELECT idem_stats_reset()');
is(stats("$counters, purged_rows, last_purge_error IS NULL"),
	'0|0|0|0|0|0|0|0|0|t', 'postgres: counters reset');
is(stats($counters, 'other'), '0|0|0|0|0|0|0|0', 'other: counters reset');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, $_) for qw(postgres other);

$node->stop;
done_testing();
