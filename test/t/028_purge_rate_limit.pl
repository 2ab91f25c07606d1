# idem.purge_rate_limit paces the background worker: a batch holds at most
# a second's worth of keys, the worker waits after each batch that did not
# end the pass (wait event IdemPurgeRateLimit, Extension before 17), a
# reload to 0 ends the wait, a paced visit ends at its deadline and the
# next visit goes on, and a DROP DATABASE waiting for a paced worker
# succeeds.  SELECT idem_purge() is not paced.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;
use Time::HiRes qw(usleep);

# naptime 1 s: the visit deadline is its 5 s floor.
my $node = idem_node('rate', conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
idem.purge_rate_limit = 1000
});

sub set_conf
{
	my ($db, @settings) = @_;
	$node->safe_psql($db,
		join('', map { "ALTER SYSTEM SET $_;\n" } @settings)
		  . 'SELECT pg_reload_conf();');
}

# SQL adding n expired keys named prefix-1 .. prefix-n.
sub expired_rows
{
	my ($prefix, $n) = @_;
	return qq{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
SELECT '', '$prefix-' || g, sha256('f'), nextval('idem.token_seq'), 200, 'x',
	now() - interval '1 hour'
FROM generate_series(1, $n) g};
}

sub left
{
	my ($db, $prefix) = @_;
	return $node->safe_psql($db,
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$prefix-%'");
}

# The worker's log lines for prefix's database since offset, as [keys,
# transactions, detail or ''].
sub purge_lines
{
	my ($offset, $db) = @_;
	my $log = slurp_file($node->logfile, $offset);
	my @lines;
	while ($log =~
		/idem purge: deleted (\d+) expired keys from database "$db" in (\d+) transaction\(s\), \d+ ms, \d+ ms of it paced by idem.purge_rate_limit\n(?:.*DETAIL:\s+(.*)\n)?/g)
	{
		push @lines, [ $1, $2, $3 // '' ];
	}
	return @lines;
}

# purge_lines once their keys add up to n: a worker logs its line just
# after its last batch commits.
sub purge_lines_for
{
	my ($offset, $db, $n) = @_;
	my @lines;
	foreach my $try (1 .. 10 * $PostgreSQL::Test::Utils::timeout_default)
	{
		my $total = 0;
		@lines = purge_lines($offset, $db);
		$total += $_->[0] for @lines;
		last if $total >= $n;
		usleep(100_000);
	}
	return @lines;
}

my $wait_event =
  $node->safe_psql('postgres', 'SHOW server_version_num') >= 170000
  ? 'IdemPurgeRateLimit'
  : 'Extension';

# --- 2500 keys at 1000 a second: batches of 1000 (idem.purge_batch_size
# is 10000), the worker waiting between them.
$node->safe_psql('postgres', expired_rows('a', 2500));
my $offset = -s $node->logfile;
set_conf('postgres', 'idem.purge_enabled = on');
ok( $node->poll_query_until(
		'postgres', qq{
SELECT EXISTS (SELECT FROM pg_stat_activity
	WHERE backend_type = 'idem purge' AND wait_event_type = 'Extension'
	  AND wait_event = '$wait_event')}),
	"the paced worker waits between batches (wait event $wait_event)");
ok($node->poll_query_until('postgres', "SELECT count(*) = 0 FROM idem.keys"),
	'the worker deleted the 2500 keys');
my @lines = purge_lines_for($offset, 'postgres', 2500);
is_deeply(\@lines, [ [ 2500, 3, '' ] ],
	'one visit: 2500 keys in 3 transactions (1000, 1000, 500)');

# --- A reload to 0 ends the wait: at 1 key a second, the first key goes,
# then the limit is lifted and the other 29 go in the next batch.
set_conf('postgres', 'idem.purge_enabled = off', 'idem.purge_rate_limit = 1');
$node->safe_psql('postgres', expired_rows('b', 30));
$offset = -s $node->logfile;
set_conf('postgres', 'idem.purge_enabled = on');
ok($node->poll_query_until('postgres', "SELECT count(*) < 30 FROM idem.keys"),
	'at 1 key a second, the first key is deleted');
set_conf('postgres', 'idem.purge_rate_limit = 0');
ok($node->poll_query_until('postgres', "SELECT count(*) = 0 FROM idem.keys"),
	'after a reload to 0, the other keys are deleted');
@lines = purge_lines_for($offset, 'postgres', 30);
ok(@lines && $lines[0][0] == 30 && $lines[0][1] < 30,
	'one visit deleted the 30 keys, the rest in one batch after the reload: '
	  . (@lines ? "$lines[0][0] keys in $lines[0][1] transactions" : 'no line'));

# --- A paced visit ends at its deadline (5 s): at 1 key a second, 8 keys
# take two visits, the first one logging where it stopped.
set_conf('postgres', 'idem.purge_enabled = off', 'idem.purge_rate_limit = 1');
$node->safe_psql('postgres', expired_rows('c', 8));
$offset = -s $node->logfile;
set_conf('postgres', 'idem.purge_enabled = on');
ok($node->poll_query_until('postgres', "SELECT count(*) = 0 FROM idem.keys"),
	'the 8 keys are deleted');
@lines = purge_lines_for($offset, 'postgres', 8);
my ($first) = grep { $_->[0] > 0 } @lines;
ok( defined $first
	  && $first->[0] < 8
	  && $first->[2] eq
	  'The visit reached its deadline of 5000 ms; the pass goes on at the next visit.',
	'the first visit stopped at its deadline: '
	  . (defined $first ? "$first->[0] keys, '$first->[2]'" : 'no line'));
my $total = 0;
$total += $_->[0] for @lines;
is($total, 8, 'the visits deleted the 8 keys between them');

# --- DROP DATABASE while a worker is paced in that database.
set_conf('postgres', 'idem.purge_enabled = off');
$node->safe_psql('postgres', 'CREATE DATABASE doomed');
$node->safe_psql('doomed', 'CREATE EXTENSION idem');
$node->safe_psql('doomed', expired_rows('d', 100));
set_conf('postgres', 'idem.purge_enabled = on');
ok( $node->poll_query_until(
		'postgres', q{
SELECT EXISTS (SELECT FROM pg_stat_activity a JOIN pg_database d ON d.oid = a.datid
	WHERE a.backend_type = 'idem purge' AND d.datname = 'doomed'
	  AND a.wait_event_type = 'Extension')}),
	'a worker is paced in the database');
my ($ret, $out, $err) = $node->psql('postgres', 'DROP DATABASE doomed');
is($ret, 0, 'DROP DATABASE succeeds while its worker is paced')
  or diag($err);

# --- SELECT idem_purge() is not paced: 3000 keys at 1 key a second.
set_conf('postgres', 'idem.purge_enabled = off');
$node->safe_psql('postgres', expired_rows('e', 3000));
is($node->safe_psql('postgres', 'SELECT idem_purge()'),
	3000, 'idem_purge() deletes 3000 keys in one call');

idem_amcheck($node, 'postgres');
done_testing();
