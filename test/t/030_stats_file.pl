# The file a clean shutdown keeps idem_stats in (pg_stat/idem.stat) is
# read back whatever it holds: a record whose times are out of range does
# not break idem_stats (it would fail with "timestamp out of range"), and
# two records of one database are merged into one row, their counters
# added.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('statsfile', conf => qq{
idem.purge_enabled = off
});
$node->safe_psql('postgres', q{
	SELECT idem_complete('k' || g, 'f', 200, 'ok', b.token)
	  FROM generate_series(1, 3) g, LATERAL idem_begin('k' || g, 'f') b});
is($node->safe_psql('postgres',
	q{SELECT claims || ' ' || completes FROM idem_stats WHERE datname = 'postgres'}),
	'3 3', 'three claims and completes counted');
$node->stop;

# The file: a header of three 32-bit words (magic, counters, records),
# then the records: the database's OID, the counters, start_failures,
# last_purge, stats_reset (64 bits each, aligned) and the last error.
my $file = $node->data_dir . '/pg_stat/idem.stat';
my $data = slurp_file($file);
my ($magic, $ncounters, $nrec) = unpack('L3', $data);
is($nrec, 1, 'the file has one record');
my $reclen = (length($data) - 12) / $nrec;
is($reclen, 8 + 8 * ($ncounters + 3) + 256, 'records have the expected layout');
my $rec = substr($data, 12, $reclen);
my $times = 8 + 8 * ($ncounters + 1);

# A second record of the same database, its times out of range.
my $bad = $rec;
substr($bad, $times, 16) = pack('q<q<', 9_223_372_036_854_775_792, -9_223_372_036_854_775_792);
open(my $fh, '>:raw', $file) or die "cannot write $file: $!";
print $fh pack('L3', $magic, $ncounters, 2), $rec, $bad;
close $fh;

$node->start;
my ($ret, $out, $err) = $node->psql('postgres', q{
	SELECT count(*) || ' ' || sum(claims) || ' ' || sum(completes) || ' '
	       || bool_and(stats_reset <= now()) || ' ' || bool_and(last_purge IS NULL)
	  FROM idem_stats WHERE datname = 'postgres'});
is($err, '', 'idem_stats reads a record whose times are out of range');
is($out, '1 6 6 true true', 'two records of one database merge: one row, counters added, times in range');

$node->stop;
done_testing();
