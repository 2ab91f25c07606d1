# Settings take effect on reload: with idem.purge_enabled off the launcher
# stays quiet; idem.purge_enabled, idem.purge_naptime and
# idem.purge_batch_size change with a SIGHUP, without a restart.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('reload', conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
log_min_messages = debug1
});
my $start = 0;
my $launcher_sql =
  "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'";
$node->poll_query_until('postgres', "SELECT count(*) FROM ($launcher_sql) l", '1');
my $launcher_pid = $node->safe_psql('postgres', $launcher_sql);

sub add_expired
{
	my ($tag, $n) = @_;
	$node->safe_psql('postgres', qq{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, $n) g,
	idem_begin('$tag-' || g, 'f', lease => '1s', retention => '1s')});
}

sub count_keys
{
	my ($tag) = @_;
	return $node->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$tag-%'");
}

# Change settings with ALTER SYSTEM and wait until the launcher has them.
sub reconfigure
{
	my ($settings, $expect) = @_;
	my $offset = -s $node->logfile;
	$node->safe_psql('postgres',
		join('', map { "ALTER SYSTEM SET $_;\n" } @$settings)
		  . 'SELECT pg_reload_conf()');
	$node->wait_for_log(
		qr/idem launcher: configuration reloaded: .*\Q$expect\E/, $offset);
}

# --- Purge disabled: passes are skipped, nothing is purged.
add_expired('quiet', 50);
my $offset = -s $node->logfile;
$offset = $node->wait_for_log(qr/no purge pass, idem.purge_enabled is off/, $offset);
$node->wait_for_log(qr/no purge pass, idem.purge_enabled is off/, $offset);
is(count_keys('quiet'), '50', 'purge disabled: expired keys stay');
is( $node->safe_psql('postgres',
		'SELECT coalesce(sum(purge_runs), 0) FROM idem_stats'),
	'0', 'purge disabled: no purge runs');
ok(!$node->log_contains(qr/background worker "idem purge"|idem purge:/, $start),
	'purge disabled: no purge worker was started');

# --- Enabled with a long naptime: the pass waits.
reconfigure([ 'idem.purge_enabled = on', "idem.purge_naptime = '1h'" ],
	'purge_enabled on, purge_naptime 3600 s');
is(count_keys('quiet'), '50', 'naptime 1h: no pass yet after the reload');

# --- A short naptime: purged without a restart.
reconfigure([ "idem.purge_naptime = '1s'" ],
	'purge_enabled on, purge_naptime 1 s');
ok($node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'quiet-%'", '0'),
	'naptime 1s after reload: expired keys purged');

# --- Batch size: the same 250 keys take 3 transactions, then 1.
reconfigure([ 'idem.purge_batch_size = 100' ], 'purge_batch_size 100');
$offset = -s $node->logfile;
add_expired('small', 250);
ok( $node->wait_for_log(
		qr/deleted 250 expired keys from database "postgres" in 3 transaction\(s\)/,
		$offset),
	'batch size 100: 250 keys purged in 3 transactions');
is(count_keys('small'), '0', 'all purged');

reconfigure([ 'idem.purge_batch_size = 1000' ], 'purge_batch_size 1000');
$offset = -s $node->logfile;
add_expired('large', 250);
ok( $node->wait_for_log(
		qr/deleted 250 expired keys from database "postgres" in 1 transaction\(s\)/,
		$offset),
	'batch size 1000: 250 keys purged in 1 transaction');

# --- Disabled again: the launcher stops passing.
reconfigure([ 'idem.purge_enabled = off' ], 'purge_enabled off');
add_expired('again', 20);
$offset = -s $node->logfile;
$offset = $node->wait_for_log(qr/no purge pass, idem.purge_enabled is off/, $offset);
$node->wait_for_log(qr/no purge pass, idem.purge_enabled is off/, $offset);
is(count_keys('again'), '20', 'disabled again by reload: expired keys stay');

is($node->safe_psql('postgres', $launcher_sql),
	$launcher_pid, 'same launcher throughout: no restart');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
