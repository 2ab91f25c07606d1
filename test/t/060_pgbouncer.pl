# pgbouncer in transaction pooling mode in front of the server: the demo's
# scenarios with the client guard, a claim and its complete on different
# server connections, and a bounded pgbench claim/complete run.  Nothing
# may rely on session state.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $pgbouncer = '/usr/sbin/pgbouncer';
plan skip_all => "$pgbouncer is not installed (test/deps.sh installs it)"
  unless -x $pgbouncer;

my $top = $ENV{TESTDIR} || '.';
my $demo = "$top/test/demo/idem_demo";
system('make', '-s', '-C', "$top/guard") unless -x $demo;
ok(-x $demo, 'demo program is built');

my $node = idem_node('bounced');

# pgbouncer as this (non-root) user, trusting its clients, on a Unix
# socket in a directory of this test's own (short, for the socket path)
# and on no TCP port: no other suite's server can answer in its place, and
# the port only names the socket.
my $user = getpwuid($<);
my $dir = PostgreSQL::Test::Utils::tempdir();
my $bdir = PostgreSQL::Test::Utils::tempdir_short();
my $bport = 6432;
my $node_host = $node->host;
my $node_port = $node->port;
open(my $fh, '>', "$dir/userlist.txt") or die $!;
print $fh qq{"$user" ""\n};
close($fh);
open($fh, '>', "$dir/pgbouncer.ini") or die $!;
print $fh <<"INI";
[databases]
postgres = host=$node_host port=$node_port dbname=postgres

[pgbouncer]
listen_addr =
listen_port = $bport
unix_socket_dir = $bdir
auth_type = trust
auth_file = $dir/userlist.txt
admin_users = $user
pool_mode = transaction
server_check_delay = 0
default_pool_size = 20
max_client_conn = 100
logfile = $PostgreSQL::Test::Utils::log_path/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
close($fh);
ok(system($pgbouncer, '-d', '-q', "$dir/pgbouncer.ini") == 0,
	'pgbouncer starts');

# Stop the pgbouncer this test started, however the test ends.  The
# daemon writes its pid file after the starting process has returned, so
# the file is read again at the end if it was not there yet, and the stop
# waits until the process is gone.
sub bouncer_pid
{
	open(my $pf, '<', "$dir/pgbouncer.pid") or return undef;
	my $pid = <$pf>;
	close($pf);
	chomp $pid if defined $pid;
	return $pid;
}
my $bouncer_pid;
for (1 .. 100)
{
	last if defined($bouncer_pid = bouncer_pid());
	select(undef, undef, undef, 0.1);
}
END
{
	my $pid = $bouncer_pid // bouncer_pid();
	if ($pid && kill('TERM', $pid))
	{
		for (1 .. 100)
		{
			last unless kill(0, $pid);
			select(undef, undef, undef, 0.1);
		}
		kill('KILL', $pid) if kill(0, $pid);
	}
}
ok($bouncer_pid, 'pgbouncer wrote its pid file');

my $bconn = "host=$bdir port=$bport dbname=postgres";

# Run psql through pgbouncer; returns (exit code, stdout, stderr).
sub bpsql
{
	my ($sql, $db) = @_;
	my ($out, $err);
	my $conn = "host=$bdir port=$bport dbname=" . ($db // 'postgres');
	IPC::Run::run([ 'psql', '-X', '-A', '-t', '-q', '-v', 'ON_ERROR_STOP=1',
			'-d', $conn, '-c', $sql ],
		'>', \$out, '2>', \$err);
	chomp $out;
	return ($? >> 8, $out, $err);
}

my $ready = 0;
foreach (1 .. 10 * $PostgreSQL::Test::Utils::timeout_default)
{
	my ($rc) = bpsql('SELECT 1');
	if ($rc == 0) { $ready = 1; last; }
	select(undef, undef, undef, 0.1);
}
ok($ready, 'pgbouncer accepts connections');

# The demo's four scenarios through pgbouncer.
# No server listens in this directory of the test's own: the store is down.
my $down = 'host=' . PostgreSQL::Test::Utils::tempdir_short()
  . ' port=1 dbname=postgres connect_timeout=2';
my ($out, $err);
my $demo_ok = IPC::Run::run([ $demo, $bconn, $down, 'bouncer' ],
	'>', \$out, '2>', \$err);
ok($demo_ok, 'demo exits 0 through pgbouncer') or diag("$out\n$err");
like($out,
	qr/^scenario 1 OK: .* actual: executed=1 calls=1 stock=9 reservations=1 charges=1 others=7 errors=0 conflict=CONFLICT\/calls=1/m,
	'scenario 1 through pgbouncer');
like($out,
	qr/^scenario 2 OK: .* actual: first=EXECUTED\/failed=complete in-lease=IN_FLIGHT takeover=EXECUTED\/failed=none calls=2 stock=9 reservations=1 charges=1 window=EXECUTED\/failed=none\/calls=3 server-down=UNAVAILABLE\/calls=3$/m,
	'scenario 2 through pgbouncer');
like($out,
	qr/^scenario 3 OK: .* actual: executed=1 replayed=7 waited=7 errors=0 stock=9 reservations=1 charges=1$/m,
	'scenario 3 through pgbouncer');
like($out,
	qr/^scenario 4 OK: .* actual: killed=SIGKILL retry=EXECUTED\/failed=none resumed-after=charge skipped=2 run=1 provider-requests=1 charges=1 stock=9 reserves=1 records=1 replay=REPLAYED$/m,
	'scenario 4 through pgbouncer: resumed after the charge, one charge');
like($out, qr/^4 of 4 scenarios match /m, 'demo summary');

# A claim, then the server connection that made it is terminated: the
# complete must run on another server connection, with the token only.
my ($rc, $claim) = bpsql(
	"SELECT token || ' ' || pg_backend_pid() FROM idem_begin('split', 'fp', scope => 'bouncer')");
my ($token, $claim_pid) = split / /, $claim;
ok($token && $claim_pid, 'claimed through pgbouncer');
$node->safe_psql('postgres', "SELECT pg_terminate_backend($claim_pid)");
$node->poll_query_until('postgres',
	"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $claim_pid")
  or die 'backend did not exit';
my ($crc, $complete, $cerr) = bpsql(
	"SELECT pg_backend_pid() FROM (SELECT idem_complete('split', 'fp', 200, 'ok', $token, scope => 'bouncer')) c");
is($crc, 0, 'complete with the token succeeds') or diag($cerr);
isnt($complete, $claim_pid, 'complete ran on another server connection');
is( $node->safe_psql('postgres',
		"SELECT status FROM idem.keys WHERE scope = 'bouncer' AND key = 'split'"),
	'200', 'the key is DONE');

# pgbench: 4 clients x 50 claim/complete transactions on 40 keys.
my $script = "$dir/claim.sql";
open($fh, '>', $script) or die $!;
print $fh <<'SQL';
\set k random(1, 40)
SELECT claimed::int AS c, coalesce(token, 0) AS t FROM idem_begin('bench-' || :k, 'fp', scope => 'bench') \gset
\if :c
SELECT idem_complete('bench-' || :k, 'fp', 200, 'ok', :t, scope => 'bench');
\endif
SQL
close($fh);

my $stats_sql =
  "SELECT claims, takeovers, replays, in_flight, conflicts, completes, superseded"
  . " FROM idem_stats WHERE datname = 'postgres'";
my @before = split /\|/, $node->safe_psql('postgres', $stats_sql);

my ($bout, $berr);
my $bench_ok = IPC::Run::run(
	[ 'pgbench', '-n', '-M', 'extended', '-c', '4', '-j', '2', '-t', '50',
	  '-f', $script, '-h', $bdir, '-p', $bport, 'postgres' ],
	'>', \$bout, '2>', \$berr);
ok($bench_ok, 'pgbench exits 0 through pgbouncer') or diag("$bout\n$berr");
like($bout, qr/number of transactions actually processed: 200\/200/,
	'pgbench processed 200 transactions');
like($bout, qr/number of failed transactions: 0 /, 'no transaction failed');

my @after = split /\|/, $node->safe_psql('postgres', $stats_sql);
my ($claims, $takeovers, $replays, $in_flight, $conflicts, $completes,
	$superseded) = map { $after[$_] - $before[$_] } 0 .. 6;
my ($keys, $done) = split /\|/, $node->safe_psql('postgres',
	"SELECT count(*), count(*) FILTER (WHERE status = 200)"
	  . " FROM idem.keys WHERE scope = 'bench'");
ok($keys >= 1 && $keys <= 40, "between 1 and 40 keys used ($keys)");
is($done, $keys, 'every key is DONE');
is($claims, $keys, 'one claim per key');
is($completes, $keys, 'one complete per key');
is($claims + $replays + $in_flight, 200, 'every begin answered once');
is("$takeovers $conflicts $superseded", '0 0 0',
	'no takeover, conflict or superseded token');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
