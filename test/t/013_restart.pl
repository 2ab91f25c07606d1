# Lifecycle of the launcher: pg_terminate_backend brings it back after its
# restart interval; kill -9 makes the server crash-restart, after which
# committed keys are there, uncommitted claims are gone and the launcher
# purges again.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('restart', conf => qq{
idem.purge_naptime = 1
restart_after_crash = on
});

my $launcher_sql =
  "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'";

# Wait for a launcher other than the given pid; return its pid.
sub wait_for_new_launcher
{
	my ($old) = @_;
	$node->poll_query_until('postgres', qq{
SELECT count(*) FROM pg_stat_activity
WHERE backend_type = 'idem launcher' AND pid <> $old}, '1')
	  or return '';
	return $node->safe_psql('postgres', $launcher_sql);
}

# Add expired keys and wait until the worker has purged them.
sub purged_again
{
	my ($tag) = @_;
	$node->safe_psql('postgres', qq{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, 50) g,
	idem_begin('$tag-' || g, 'f', lease => '1s', retention => '1s')});
	return $node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$tag-%'", '0');
}

ok($node->poll_query_until('postgres', "SELECT count(*) FROM ($launcher_sql) l", '1'),
	'launcher running');
my $pid1 = $node->safe_psql('postgres', $launcher_sql);
ok(purged_again('first'), 'launcher purges');

# --- pg_terminate_backend: the launcher exits with status 1 and comes back.
my $offset = -s $node->logfile;
is($node->safe_psql('postgres', "SELECT pg_terminate_backend($pid1)"),
	't', 'launcher terminated');
my $pid2 = wait_for_new_launcher($pid1);
like($pid2, qr/^\d+$/, 'a new launcher starts after pg_terminate_backend');
ok( $node->log_contains(
		qr/background worker "idem launcher" \(PID $pid1\) exited with exit code 1/,
		$offset),
	'the terminated launcher exited with status 1 (restartable)');
ok(purged_again('second'), 'the new launcher purges');

# --- kill -9: crash and restart of the whole server.
$node->safe_psql('postgres', q{
BEGIN;
SELECT count(*) FROM idem_begin('committed', 'f');
SELECT idem_complete('committed', 'f', 201, 'saved');
COMMIT;
});
my $open = $node->background_psql('postgres', on_error_stop => 0);
$open->query_safe("BEGIN; SELECT count(*) FROM idem_begin('uncommitted', 'f')");

$offset = -s $node->logfile;
is(kill('KILL', $pid2), 1, 'launcher killed with SIGKILL');
$node->wait_for_log(qr/all server processes terminated; reinitializing/, $offset);
ok($node->poll_query_until('postgres', 'SELECT 1', '1'),
	'server accepts connections after the crash restart');
eval { $open->quit };

my $pid3 = wait_for_new_launcher($pid2);
like($pid3, qr/^\d+$/, 'launcher back after the crash restart');
is( $node->safe_psql('postgres',
		"SELECT claimed, state, status, encode(body, 'escape') FROM idem_begin('committed', 'f')"),
	'f|DONE|201|saved', 'committed key survived the crash');
is( $node->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE key = 'uncommitted'"),
	'0', 'uncommitted claim is gone');
is( $node->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('uncommitted', 'f')"),
	't|PROCESSING', 'and the key can be claimed again');
ok(purged_again('third'), 'the launcher purges after the crash restart');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
