# The background worker purges expired keys in every database that has the
# extension, picks up new databases without a restart, leaves databases
# without the extension alone (and quiet), and shows itself in
# pg_stat_activity.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('purge', conf => qq{
idem.purge_naptime = 1
}, extension => []);
my $log_start = -s $node->logfile;

# Created first, so a pass visits it before the databases with idem.
$node->safe_psql('postgres', 'CREATE DATABASE plain');
for my $db (qw(app1 app2))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idem');
}

# n keys that are already expired on the worker's clock, and m live ones.
sub add_keys
{
	my ($db, $prefix, $n, $m) = @_;
	$node->safe_psql($db, qq{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, $n) g,
	idem_begin('$prefix-old-' || g, 'f', lease => '1s', retention => '1s');
RESET idem.clock_offset;
SELECT count(*) FROM generate_series(1, $m) g,
	idem_begin('$prefix-live-' || g, 'f');
});
}

sub count_keys
{
	my ($db, $pattern) = @_;
	return $node->safe_psql($db,
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$pattern'");
}

# Launcher: one, connected to no database, waiting on an extension event.
ok( $node->poll_query_until(
		'postgres', q{
SELECT count(*) FROM pg_stat_activity
WHERE backend_type = 'idem launcher' AND application_name = 'idem launcher'
  AND datname IS NULL AND wait_event_type = 'Extension'}, '1'),
	'launcher shown in pg_stat_activity, waiting on an Extension event');
my $launcher_pid = $node->safe_psql('postgres',
	"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'");

add_keys('app1', 'a', 300, 20);
add_keys('app2', 'b', 400, 30);

ok($node->poll_query_until('app1', "SELECT count(*) FROM idem.keys WHERE key LIKE 'a-old-%'", '0'),
	'expired keys purged in app1');
ok($node->poll_query_until('app2', "SELECT count(*) FROM idem.keys WHERE key LIKE 'b-old-%'", '0'),
	'expired keys purged in app2');
is(count_keys('app1', 'a-live-%'), '20', 'live keys kept in app1');
is(count_keys('app2', 'b-live-%'), '30', 'live keys kept in app2');
# The run is recorded just after its last batch commits.
ok( $node->poll_query_until(
		'app1',
		"SELECT datname, purged_rows, last_purge IS NOT NULL, last_purge_error IS NULL"
		  . " FROM idem_stats WHERE purge_runs > 0 ORDER BY datname",
		"app1|300|t|t\napp2|400|t|t"),
	'idem_stats: rows purged per database, no error');
is( $node->safe_psql('app1',
		"SELECT count(*) FROM idem_stats WHERE datname IN ('postgres', 'plain')"),
	'0', 'databases without idem get no purge runs');

# A database created now, with the extension created later, is picked up.
$node->safe_psql('postgres', 'CREATE DATABASE app3');
$node->safe_psql('app3', 'SELECT 1');
$node->safe_psql('app3', 'CREATE EXTENSION idem');
add_keys('app3', 'c', 100, 5);
ok($node->poll_query_until('app3', "SELECT count(*) FROM idem.keys WHERE key LIKE 'c-old-%'", '0'),
	'new database purged without a restart');
is(count_keys('app3', 'c-live-%'), '5', 'live keys kept in app3');

# The per-database worker, caught waiting for a lock on the key table.
# The locking transaction writes keys that expired (a pass with nothing
# expired does not open the table).
my $locker = $node->background_psql('app1');
$locker->query_safe(q{
BEGIN;
LOCK TABLE idem.keys IN ACCESS EXCLUSIVE MODE;
SET LOCAL idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, 10) g,
	idem_begin('d-old-' || g, 'f', lease => '1s', retention => '1s');
});
ok( $node->poll_query_until(
		'postgres', q{
SELECT count(*) FROM pg_stat_activity
WHERE backend_type = 'idem purge' AND application_name = 'idem purge'
  AND datname = 'app1' AND wait_event_type = 'Lock'}, '1'),
	'purge worker shown in pg_stat_activity with its database');
$locker->query_safe('COMMIT');
$locker->quit;
my $runs = $node->safe_psql('app1',
	"SELECT purge_runs FROM idem_stats WHERE datname = 'app1'");
ok( $node->poll_query_until(
		'app1',
		"SELECT purge_runs > $runs FROM idem_stats WHERE datname = 'app1'"),
	'purge runs again once the lock is gone');

is( $node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'"),
	$launcher_pid, 'same launcher throughout');

my $log = slurp_file($node->logfile, $log_start);
my @problems = grep { /\b(ERROR|FATAL|PANIC):|exited with exit code [1-9]/ }
  split /\n/, $log;
is(scalar(@problems), 0, 'no errors in the server log')
  or diag(join("\n", @problems));

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, $_) for qw(app1 app2 app3);

$node->stop;
done_testing();
