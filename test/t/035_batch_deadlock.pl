# Two clients claim overlapping batches of keys in opposite orders, in a
# loop, and complete them, for IDEM_BATCH_SECONDS seconds (20 by default;
# the issue's measurement is 60).  Each transaction claims the same twenty
# keys of the current fifth of a second (so the two clients' batches
# overlap whenever they run at the same time), one client listing them in
# ascending order and the other in descending order; the claimer records
# an effect in a business table and completes its keys with
# idem_complete_many in the same transaction, the other client replays
# them.
#
# idem_begin_many locks the keys sorted bytewise whatever the input's
# order, so no transaction may deadlock (40P01, counted by pgbench and in
# the server log), and every key is claimed and completed exactly once.
# A control run first does the same with a LATERAL join over idem_begin,
# which claims in the order of its input: it does deadlock, which shows
# that the check can fail.
use strict;
use warnings;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $seconds = $ENV{IDEM_BATCH_SECONDS} // 20;

my $node = idem_node('batch_deadlock', conf => qq{
idem.purge_enabled = off
deadlock_timeout = 50ms
log_min_messages = error
}, extension => []);
$node->safe_psql('postgres', q{
CREATE EXTENSION idem;
CREATE TABLE effects (key text PRIMARY KEY, xid xid8 NOT NULL DEFAULT pg_current_xact_id());
-- The twenty keys of the fifth of a second the transaction started in.
CREATE FUNCTION batch_keys(prefix text, descending boolean) RETURNS text[]
LANGUAGE sql STABLE AS $$
	SELECT array_agg(prefix || '-' || floor(extract(epoch FROM now()) * 5)::bigint || '-' || g
					 ORDER BY CASE WHEN descending THEN -g ELSE g END)
	  FROM generate_series(10, 29) g
$$;
});

my $dir = PostgreSQL::Test::Utils::tempdir();

# The transaction of one client: order is ASC or DESC; with lateral, the
# control's LATERAL join over idem_begin instead of idem_begin_many.
sub script
{
	my ($order, $lateral) = @_;
	my $prefix = $lateral ? 'l' : 'b';
	my $desc = $order eq 'DESC' ? 'true' : 'false';
	my $claim = $lateral
	  ? qq{INSERT INTO effects (key)
SELECT k.key FROM unnest(batch_keys('$prefix', $desc)) k(key), LATERAL idem_begin(k.key, 'f') b
 WHERE b.claimed;}
	  : qq{INSERT INTO effects (key)
SELECT k.key FROM idem_begin_many(batch_keys('$prefix', $desc), array_fill('f'::text, ARRAY[20])) b
  JOIN unnest(batch_keys('$prefix', $desc)) WITH ORDINALITY k(key, o) ON k.o = b.ordinality
 WHERE b.claimed;};
	return qq{BEGIN;
$claim
SELECT count(*) AS completed FROM idem_complete_many(
  ARRAY(SELECT key FROM effects WHERE xid = pg_current_xact_id() ORDER BY key $order),
  ARRAY(SELECT 'f' FROM effects WHERE xid = pg_current_xact_id()),
  ARRAY(SELECT 200 FROM effects WHERE xid = pg_current_xact_id()),
  ARRAY(SELECT NULL::bytea FROM effects WHERE xid = pg_current_xact_id()));
COMMIT;
};
}

# Run two pgbench clients, ascending and descending, for secs seconds;
# returns the number of transactions that failed with a deadlock, as
# pgbench counts them, and whether both ran without another error.
sub run_pair
{
	my ($name, $lateral, $secs) = @_;
	my @runs;
	for my $order ('ASC', 'DESC')
	{
		my $file = "$dir/$name-$order.sql";
		PostgreSQL::Test::Utils::append_to_file($file, script($order, $lateral));
		my %run = (out => '', err => '');
		$run{h} = IPC::Run::start(
			[
				'pgbench', '-n', '-c', 1, '-T', $secs, '--max-tries', 1,
				'--failures-detailed', '-f', $file,
				'-h', $node->host, '-p', $node->port, 'postgres'
			],
			'>', \$run{out}, '2>', \$run{err});
		push @runs, \%run;
	}
	my ($deadlocks, $clean, $xacts) = (0, 1, 0);
	for my $run (@runs)
	{
		$run->{h}->finish;
		note "pgbench $name stdout:\n$run->{out}\nstderr:\n$run->{err}";
		$clean = 0 if $run->{h}->result(0) != 0;
		$deadlocks += $1 if $run->{out} =~ /number of deadlock failures: (\d+)/;
		$xacts += $1 if $run->{out} =~ /number of transactions actually processed: (\d+)/;
	}
	return ($deadlocks, $clean, $xacts);
}

# The control: a LATERAL join claims in input order, and deadlocks.
my $log_offset = -s $node->logfile;
my ($deadlocks, $clean, $xacts) = run_pair('lateral', 1, 5);
cmp_ok($deadlocks, '>', 0,
	"control: LATERAL idem_begin in opposite orders deadlocked $deadlocks times in 5 s");

# The batch functions, in opposite orders.
$log_offset = -s $node->logfile;
($deadlocks, $clean, $xacts) = run_pair('batch', 0, $seconds);
ok($clean, 'both batch clients ran without an error that ends a client');
is($deadlocks, 0, "idem_begin_many in opposite orders: no deadlock in $seconds s ($xacts transactions)");
my $log = slurp_file($node->logfile, $log_offset);
my $logged = () = $log =~ /deadlock detected/g;
is($logged, 0, 'the server logged no deadlock');
cmp_ok($xacts, '>=', 10 * $seconds, "the clients committed $xacts transactions");

# Every key of the batches was claimed and completed exactly once.
my ($keys, $done, $effects, $doubled, $without) = split /\|/, $node->safe_psql('postgres', q{
SELECT (SELECT count(*) FROM idem.keys WHERE key LIKE 'b-%'),
       (SELECT count(*) FROM idem.keys WHERE key LIKE 'b-%' AND status = 200),
       (SELECT count(*) FROM effects WHERE key LIKE 'b-%'),
       (SELECT count(*) FROM (SELECT key FROM effects GROUP BY key HAVING count(*) > 1) d),
       (SELECT count(*) FROM idem.keys k WHERE key LIKE 'b-%'
           AND NOT EXISTS (SELECT FROM effects e WHERE e.key = k.key))});
cmp_ok($keys, '>', 0, "$keys keys were claimed");
is($done, $keys, 'every key is completed');
is($effects, $keys, 'one effect per key');
is($doubled, '0', 'no key had its effect twice');
is($without, '0', 'no completed key lacks its effect');

idem_amcheck($node, 'postgres');
$node->stop;
done_testing();
