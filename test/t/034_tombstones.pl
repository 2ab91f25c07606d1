# Tombstones and the purge worker.  Keys completed with remember =>
# '2 days' whose retention is over are rewritten once by the worker as
# tombstones (no body), and from then on count in the expiry map at
# remember_until: passes over a table of tombstones with nothing due read
# no page (purge stays O(due)), and a key that falls due among them is
# purged by a pass that reads a few pages.  Measures the size of a
# tombstone with a 36-byte key and the cost of those passes (printed with
# diag; doc/performance.md).  IDEM_TOMBSTONES sets how many (200000 by
# default).
use strict;
use warnings;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);
use IdemTest;

my $n = $ENV{IDEM_TOMBSTONES} // 200000;

my $node = idem_node('tombstones', conf => q{
idem.purge_naptime = 1
idem.purge_rate_limit = 0
log_min_messages = debug1
});

my $batch_line = qr/idem purge batch of "keys"/;

# Pages read by the worker's batches since offset, and the number of
# batches.
sub pages_read_since
{
	my ($offset) = @_;
	my ($read, $batches) = (0, 0);
	for my $line (split /\n/, slurp_file($node->logfile, $offset))
	{
		next unless $line =~ /$batch_line: blocks \d+ to \d+ of \d+, (\d+) read/;
		$read += $1;
		$batches++;
	}
	return ($read, $batches);
}

sub purge_runs
{
	return $node->safe_psql('postgres',
		"SELECT purge_runs FROM idem_stats WHERE datname = current_database()");
}

sub wait_passes
{
	my ($count) = @_;
	my $target = purge_runs() + $count;
	ok( $node->poll_query_until('postgres',
			"SELECT purge_runs >= $target FROM idem_stats WHERE datname = current_database()"),
		"$count more purge passes");
}

# $n keys with 36-byte keys and 200-byte bodies, completed two hours ago
# with a 1 hour retention and remembered for 2 days: all due for their
# tombstone.  Written through idem's functions, so the expiry map knows
# them.
$node->safe_psql('postgres', qq{
SET idem.clock_offset = '-2h';
SELECT count(*)
  FROM generate_series(1, $n) g,
	   LATERAL (SELECT '00000000-0000-4000-8000-' || lpad(g::text, 12, '0') AS k) k,
	   LATERAL idem_begin(k.k, 'f', retention => '1 hour', remember => '2 days') b,
	   LATERAL idem_complete(k.k, 'f', 200, convert_to(repeat('x', 200), 'UTF8'), b.token);
});
my $pages_before = $node->safe_psql('postgres',
	"SELECT pg_relation_size('idem.keys') / current_setting('block_size')::int");
# Pages read from the commit of the keys on (passes during the load read
# the uncommitted rows again and again, as any due row they cannot see).
my $offset = -s $node->logfile;
my $started = time;
ok( $node->poll_query_until('postgres',
		'SELECT count(*) FROM idem.keys WHERE body IS NOT NULL', '0'),
	"the worker made tombstones of the $n keys");
my $tombstoning_secs = time - $started;
my ($read, $batches) = pages_read_since($offset);
diag(sprintf("tombstoning %d keys: %d pages read in %d batches, about %.1f s (table of %d pages)",
		$n, $read, $batches, $tombstoning_secs, $pages_before));
is( $node->safe_psql('postgres', q{
SELECT count(*), count(*) FILTER (WHERE body IS NULL AND claimed_by IS NULL AND remember_until > now())
  FROM idem.keys}),
	"$n|$n", 'every key is a tombstone, none deleted');
is( $node->safe_psql('postgres',
		"SELECT claimed, state, status, body IS NULL FROM idem_begin('00000000-0000-4000-8000-000000000001', 'f')"),
	'f|EXPIRED|200|t', 'a retry answers EXPIRED');

# The size of a tombstone with a 36-byte key, as pg_column_size counts a
# row.
my $size = $node->safe_psql('postgres',
	'SELECT max(pg_column_size(k.*)) FROM idem.keys k');
cmp_ok($size, '<=', 150, "a tombstone with a 36-byte key is $size bytes");
$node->safe_psql('postgres', 'VACUUM idem.keys');
my $pages = $node->safe_psql('postgres',
	"SELECT pg_relation_size('idem.keys') / current_setting('block_size')::int");

# Passes over the tombstones with nothing due read no page: each counts
# at remember_until, two days away.
wait_passes(1);
$offset = -s $node->logfile;
$started = time;
wait_passes(3);
my $three_passes_secs = time - $started;
($read, $batches) = pages_read_since($offset);
is($read, 0, "three passes over $n tombstones with nothing due read no page");
diag(sprintf("three passes over %d tombstones, nothing due: %d pages read, %d batches, %.2f s (naptime 1 s)",
		$n, $read, $batches, $three_passes_secs));

# A key that falls due among them is purged by a pass that reads few
# pages: the range it is in, not the tombstones.
$offset = -s $node->logfile;
$node->safe_psql('postgres', q{
SET idem.clock_offset = '-2d';
SELECT claimed FROM idem_begin('due', 'f', lease => '1s', retention => '1s');
});
ok($node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key = 'due'", '0'),
	'the due key is purged');
($read, $batches) = pages_read_since($offset);
ok($read > 0 && $read < $pages / 8,
	"the passes that purged it read $read of the table's $pages pages");
is($node->safe_psql('postgres', 'SELECT count(*) FROM idem.keys'), $n,
	'the tombstones stay');

# For comparison: idem_purge() walks the whole table (no expiry map).
$started = time;
is($node->safe_psql('postgres', 'SELECT idem_purge()'), '0',
	'idem_purge() finds nothing due');
diag(sprintf("idem_purge() over %d tombstones, nothing due: every one of %d pages read, %.2f s",
		$n, $pages, time - $started));

# When remember is over, the tombstones are deleted.
$node->safe_psql('postgres', "ALTER SYSTEM SET idem.clock_offset = '3d'");
$node->reload;
ok($node->poll_query_until('postgres', 'SELECT count(*) FROM idem.keys', '0'),
	'the worker deletes the tombstones once remember is over');
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
