# Crashed work resumes where it stopped (recovery points, fenced business
# writes), with the C guard's steps (idem_guard_step).
#
# 200 orders, each in three steps (test/guard/recovery_driver: "reserve"
# in one transaction with idem_hold and its checkpoint, "charge" at a
# provider keyed by the reserve step's output, "record" in one transaction
# with idem_hold and its checkpoint).  Each order's attempts are killed
# with SIGKILL, by themselves at a point between or inside the steps or by
# the test at a random moment, zero to two times; the next attempt moves
# the clock past the lease and takes over.  In the end every order is
# done, the provider charged it once, and each step's writes are there
# exactly once.  Control orders run with the mistakes the checks must
# catch (a provider key of the attempt's own token; checkpoints after the
# step's transaction instead of inside it), and the same checks find them.
#
# A step that fails after a checkpoint leaves the claim to its lease, and
# the retry resumes after the checkpoint.
#
# Then a stale holder: once another caller took the key over, its
# idem_hold gets ID002 before its business write; and a takeover waits for
# a holder's transaction that holds the key.
#
# Every driver process and psql session is stopped by the END block, also
# when the test fails.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use IPC::Run;
use Test::More;
use Time::HiRes qw(usleep);

my $top = $ENV{TESTDIR} || '.';
my $driver = "$top/test/guard/recovery_driver";
system('make', '-s', '-C', "$top/guard") unless -x $driver;
ok(-x $driver, 'recovery driver is built');

my (%running, @sessions);
END
{
	for my $h (values %running)
	{
		eval { $h->kill_kill(grace => 1); };
	}
	eval { $_->quit } for @sessions;
}

my $node = idem_node('recovery');
my $connstr = $node->connstr('postgres');
$node->safe_psql('postgres', q{
CREATE TABLE stock (sku text PRIMARY KEY, qty integer NOT NULL);
INSERT INTO stock VALUES ('A', 1000000), ('B', 1000000);
CREATE TABLE reservations (key text NOT NULL, token bigint NOT NULL);
CREATE TABLE provider_requests (idem_key text NOT NULL, key text NOT NULL);
CREATE TABLE provider_charges (id serial, idem_key text PRIMARY KEY, key text NOT NULL);
CREATE TABLE records (key text NOT NULL, charge text NOT NULL, token bigint NOT NULL);
});

my $seed = $ENV{IDEM_RECOVERY_SEED} // time();
srand($seed);
note "random seed $seed (IDEM_RECOVERY_SEED)";

# One attempt: the driver with these arguments, killed from outside after
# kill_after_us if given.  Returns its wait status, output and errors.
sub attempt
{
	my (%a) = @_;
	my ($out, $err) = (q{}, q{});
	my $h = IPC::Run::start(
		[
			$driver, $connstr, $a{key}, $a{offset}, $a{kill_at} // 0,
			$a{mode} // 'fenced', $a{delay_us} // 0
		],
		'>', \$out, '2>', \$err,
		IPC::Run::timeout($PostgreSQL::Test::Utils::timeout_default));
	$running{$h} = $h;
	if (defined $a{kill_after_us})
	{
		usleep($a{kill_after_us});
		eval { $h->signal('KILL') if $h->pumpable; };
	}
	eval { $h->finish; };
	my $timed_out = $@;
	delete $running{$h};
	my $status = $timed_out ? -1 : $h->full_result;
	return {
		status => $status,
		killed => ($status > 0 && ($status & 127) == 9) ? 1 : 0,
		out => $out,
		err => $err . ($timed_out ? "timed out: $timed_out" : q{}),
	};
}

# Run one order: the given attempts (each killed), then one more that must
# finish.  Each attempt moves the clock two leases on.  Returns the last
# attempt's result and how many attempts died of SIGKILL.
sub order
{
	my ($key, $mode, @kills) = @_;
	my ($offset, $killed) = (0, 0);
	for my $k (@kills)
	{
		my $r = attempt(key => $key, offset => $offset, mode => $mode, %$k);
		$killed += $r->{killed};
		$offset += 30;
	}
	my $last = attempt(key => $key, offset => $offset, mode => $mode);
	return ($last, $killed);
}

# Orders (of keys LIKE pattern) whose rows in table are not exactly one
# per order, as "key=count", with orders that have none.
sub not_once
{
	my ($table, $pattern) = @_;
	return $node->safe_psql('postgres', qq{
SELECT coalesce(string_agg(k.key || '=' || coalesce(n, 0), ' ' ORDER BY k.key), '')
FROM (SELECT key FROM idem_keys WHERE key LIKE '$pattern') k
LEFT JOIN (SELECT key, count(*) AS n FROM $table GROUP BY key) t USING (key)
WHERE coalesce(n, 0) <> 1});
}

# --- 200 orders, killed with SIGKILL zero to two times each.
my $rounds = 200;
my ($failed, $killed, $external, @failures) = (0, 0, 0);
my %resumed;
for my $round (1 .. $rounds)
{
	my @kills;
	my $nkills = $round % 3;
	for my $i (1 .. $nkills)
	{
		if (rand() < 0.25)
		{
			# From outside, at a random moment, the steps 2 ms apart.
			push @kills, { delay_us => 2000, kill_after_us => int(rand(12000)) };
			$external++;
		}
		else
		{
			# The first kill cycles through the points, later ones are random.
			my $point = $i == 1 ? 1 + int($round / 3) % 7 : 1 + int(rand(7));
			push @kills, { kill_at => $point };
		}
	}
	my ($last, $k) = order("order-$round", 'fenced', @kills);
	$killed += $k;
	$resumed{$1}++ if $last->{out} =~ /resumed=(\w+)/;
	if ($last->{status} != 0 || $last->{out} !~ /^outcome=(EXECUTED|REPLAYED) failed=none/)
	{
		$failed++;
		push @failures, "order-$round: status $last->{status}: $last->{out} $last->{err}";
	}
}
is($failed, 0, "the last attempt of each of $rounds orders finished")
  or diag(join("\n", @failures[ 0 .. ($#failures < 9 ? $#failures : 9) ]));
cmp_ok($killed, '>=', 100,
	"attempts died of SIGKILL ($killed, $external of them killed from outside)");
ok( ($resumed{reserve} // 0) > 0 && ($resumed{charge} // 0) > 0
	  && ($resumed{record} // 0) > 0,
	'takeovers resumed after each step (reserve '
	  . ($resumed{reserve} // 0) . ', charge ' . ($resumed{charge} // 0)
	  . ', record ' . ($resumed{record} // 0) . ')');

is($node->safe_psql('postgres', q{
SELECT count(*) FILTER (WHERE state = 'DONE' AND status = 200), count(*)
FROM idem_keys WHERE key LIKE 'order-%'}),
	"$rounds|$rounds", 'every order is done, with its response');
is(not_once('provider_charges', 'order-%'), q{},
	'the provider charged every order once');
is(not_once('reservations', 'order-%'), q{},
	'every order reserved stock once');
is(not_once('records', 'order-%'), q{}, 'every order recorded its charge once');
is($node->safe_psql('postgres', "SELECT qty FROM stock WHERE sku = 'A'"),
	1000000 - $rounds, "stock moved by $rounds, once per order");
is($node->safe_psql('postgres', q{
SELECT count(*) FROM records r JOIN provider_charges c
	ON c.key = r.key AND 'ch_' || c.id = r.charge
WHERE r.key LIKE 'order-%'}),
	$rounds, "each record holds the provider's charge of its order");

# --- Controls: the same checks catch the mistakes the steps avoid.
# A provider key of the attempt's own token: a crash after the charge
# makes the next attempt charge again.
my ($last) = order('naive-1', 'naive', { kill_at => 3 });
like($last->{out}, qr/^outcome=EXECUTED failed=none resumed=reserve/,
	'control: naive order resumed after reserve');
is(not_once('provider_charges', 'naive-%'), 'naive-1=2',
	'control: the charge check finds the naive order charged twice');
# Checkpoints after the step's transaction: a crash between the two runs
# the step again.
($last) = order('late-1', 'late', { kill_at => 2 });
like($last->{out}, qr/^outcome=EXECUTED failed=none resumed=none/,
	'control: late-checkpoint order started over');
($last) = order('late-2', 'late', { kill_at => 7 });
like($last->{out}, qr/^outcome=EXECUTED failed=none resumed=charge/,
	'control: late-checkpoint order resumed after charge');
is(not_once('reservations', 'late-%'), 'late-1=2',
	'control: the reservation check finds a reserve done twice');
is(not_once('records', 'late-%'), 'late-2=2',
	'control: the record check finds a record done twice');
is($node->safe_psql('postgres', "SELECT 1000000 - qty FROM stock WHERE sku = 'B'"),
	'4', 'control: the stock check sees three orders move it four times');

# --- A step that fails after a checkpoint leaves the claim to its lease
# (a release would drop the checkpoint); the retry resumes after it.
my $r = attempt(key => 'refused-1', offset => 0, mode => 'refuse');
like($r->{out}, qr/^outcome=EXECUTED failed=handler resumed=none skipped=0 run=1 /,
	'a refused charge fails the handler after reserve ran');
like($r->{err}, qr/step "charge" failed/, 'the failure names the step');
is($node->safe_psql('postgres', "SELECT state FROM idem_keys WHERE key = 'refused-1'"),
	'PROCESSING', 'the checkpointed claim is not released');
$r = attempt(key => 'refused-1', offset => 30);
like($r->{out}, qr/^outcome=EXECUTED failed=none resumed=reserve skipped=1 run=2 /,
	'the retry after the lease resumes after reserve');
is(not_once('reservations', 'refused-%'), q{}, 'and reserved once');

# --- A stale holder gets ID002 from idem_hold before its business write.
my $t1 = $node->safe_psql('postgres',
	"SELECT token FROM idem_begin('stale', 'f', lease => '10s')");
my $t2 = $node->safe_psql('postgres', q{
SET idem.clock_offset = '30s';
SELECT token FROM idem_begin('stale', 'f', lease => '10s') WHERE claimed});
cmp_ok($t2, '>', $t1, 'the key is taken over after the lease');
my ($rc, $out, $err) = $node->psql('postgres', qq{
\\set VERBOSITY verbose
BEGIN;
SELECT idem_hold('stale', $t1);
INSERT INTO records VALUES ('stale', 'ch_stale', $t1);
COMMIT;}, on_error_stop => 1);
like($err, qr/ERROR:  ID002:/, 'the stale holder\'s idem_hold gets ID002');
is($node->safe_psql('postgres', "SELECT count(*) FROM records WHERE key = 'stale'"),
	'0', 'and its business write never happened');
($rc, $out, $err) = $node->psql('postgres', qq{
SET idem.clock_offset = '30s';
BEGIN;
SELECT idem_hold('stale', $t2);
INSERT INTO records VALUES ('stale', 'ch_stale', $t2);
COMMIT;}, on_error_stop => 1);
is($rc, 0, 'the new holder holds the key and writes') or diag($err);
is($node->safe_psql('postgres', "SELECT token FROM records WHERE key = 'stale'"),
	$t2, 'the business row is the new holder\'s');

# --- A takeover waits for the transaction that holds the key.
my $t3 = $node->safe_psql('postgres',
	"SELECT token FROM idem_begin('held', 'f', lease => '10s')");
my $holder = $node->background_psql('postgres', on_error_stop => 0);
push @sessions, $holder;
$holder->query_safe("BEGIN; SELECT idem_hold('held', $t3)");
my $taker = $node->background_psql('postgres');
push @sessions, $taker;
$taker->query_until(qr/started/, qq{
\\echo started
SET idem.clock_offset = '30s';
SELECT 'token=' || token FROM idem_begin('held', 'f', lease => '10s') WHERE claimed;
});
ok( $node->poll_query_until('postgres', q{
SELECT count(*) > 0 FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE '%idem_begin(''held''%'}),
	'the takeover waits for the holder\'s transaction');
$holder->query_safe(
	"INSERT INTO records VALUES ('held', 'ch_held', $t3); COMMIT");
my $took = $taker->query_until(qr/token=\d+/, q{});
my ($t4) = $took =~ /token=(\d+)/;
ok(defined $t4 && $t4 > $t3,
	'once it committed, the key is taken over with a greater token');
my ($hold_out, $hold_failed) = $holder->query(
	"\\set VERBOSITY verbose\nBEGIN; SELECT idem_hold('held', $t3); "
	  . "INSERT INTO records VALUES ('held', 'ch_again', $t3); COMMIT");
ok($hold_failed && $holder->{stderr} =~ /ERROR:  ID002:/,
	'the old holder\'s next idem_hold gets ID002') or diag($holder->{stderr});
is($node->safe_psql('postgres',
		"SELECT string_agg(charge, ',') FROM records WHERE key = 'held'"),
	'ch_held', 'only the write made while it held the key is there');
$holder->quit;
$taker->quit;
@sessions = ();

idem_amcheck($node, 'postgres');
done_testing();
