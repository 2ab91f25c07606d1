# A duplicate waits in the server for the first request's answer
# (idem_begin's wait_for).  The holder's claim is committed; waiters sleep
# on a condition variable, seen in pg_stat_activity as an Extension wait,
# and wake when the holder's change commits:
#
# 1. the holder completes: the waiter replays its response;
# 2. the holder releases: the waiter claims the key, with a greater token;
# 3. a completion rolled back wakes the waiter for nothing: it sleeps on,
#    and replays the completion that commits;
# 4. a waiter cancelled leaves nothing behind;
# 5. 100 waiters on one key: the holder completes, all 100 replay the same
#    bytes, none claims;
# 6. the same with 20 waiters through pgbouncer in transaction pooling;
# 7. without shared_preload_libraries the waiter looks again every 50 ms:
#    the holder completes, the waiter replays;
# 8. a transaction that completes 40 keys wakes the waiter of the last;
# 9. a REPEATABLE READ waiter gets a serialization failure, to retry.
use strict;
use warnings;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

# pgbouncer, if started, is stopped also when the test dies.
my $bouncer_pid;
END { kill 'TERM', $bouncer_pid if $bouncer_pid; }

my $node = idem_node('waits', conf => qq{
idem.purge_enabled = off
max_connections = 140
});
my $dir = PostgreSQL::Test::Utils::tempdir();

sub sql { return $node->safe_psql('postgres', $_[0]); }

# Wait until n sessions sleep in idem_begin for a key's answer.
sub waiters_sleep
{
	my ($n) = @_;
	return $node->poll_query_until('postgres', qq{
		SELECT count(*) >= $n FROM pg_stat_activity
		 WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%wait_for%'});
}

# --- 1. The holder completes.
my $tok = sql(q{SELECT token FROM idem_begin('w-done', 'fp', lease => '1 hour')});
my $waiter = $node->background_psql('postgres');
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, status, convert_from(body, 'UTF8') AS body
	  FROM idem_begin('w-done', 'fp', wait_for => '5 min');
});
ok(waiters_sleep(1), 'complete: the duplicate sleeps in the server');
sql(qq{SELECT idem_complete('w-done', 'fp', 201, convert_to('paid once', 'UTF8'), $tok)});
is($waiter->query_safe('SELECT 1'), "f|DONE|201|paid once\n1",
	'complete: the duplicate replays the response');
$waiter->quit;

# --- 2. The holder releases.
$tok = sql(q{SELECT token FROM idem_begin('w-rel', 'fp', lease => '1 hour')});
$waiter = $node->background_psql('postgres');
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, token FROM idem_begin('w-rel', 'fp', wait_for => '5 min');
});
ok(waiters_sleep(1), 'release: the duplicate sleeps in the server');
sql(qq{SELECT idem_release('w-rel', $tok)});
my ($claimed, $state, $newtok) = split /\|/, (split /\n/, $waiter->query_safe('SELECT 1'))[0];
is("$claimed|$state", 't|PROCESSING', 'release: the duplicate claims the key');
cmp_ok($newtok, '>', $tok, 'release: with a greater token');
$waiter->quit;

# --- 3. A completion rolled back, then one that commits.
$tok = sql(q{SELECT token FROM idem_begin('w-rb', 'fp', lease => '1 hour')});
$waiter = $node->background_psql('postgres');
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, convert_from(body, 'UTF8') AS body
	  FROM idem_begin('w-rb', 'fp', wait_for => '5 min');
});
ok(waiters_sleep(1), 'rollback: the duplicate sleeps in the server');
sql(qq{BEGIN; SELECT idem_complete('w-rb', 'fp', 200, convert_to('rolled back', 'UTF8'), $tok); ROLLBACK});
ok(waiters_sleep(1), 'rollback: the duplicate sleeps on after a rolled back completion');
sql(qq{SELECT idem_complete('w-rb', 'fp', 200, convert_to('committed', 'UTF8'), $tok)});
is($waiter->query_safe('SELECT 1'), "f|DONE|committed\n1",
	'rollback: the duplicate replays the completion that committed');
$waiter->quit;

# --- 4. A waiter cancelled.
$tok = sql(q{SELECT token FROM idem_begin('w-cancel', 'fp', lease => '1 hour')});
$waiter = $node->background_psql('postgres', on_error_stop => 0);
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed FROM idem_begin('w-cancel', 'fp', wait_for => '5 min');
});
ok(waiters_sleep(1), 'cancel: the duplicate sleeps in the server');
sql(q{SELECT pg_cancel_backend(pid) FROM pg_stat_activity
	   WHERE wait_event_type = 'Extension' AND query LIKE '%w-cancel%wait_for%'});
my $after = $waiter->query('SELECT 1');
like($waiter->{stderr}, qr/canceling statement due to user request/,
	'cancel: the wait ends with the cancel');
is($after, '1', 'cancel: the session is usable afterwards');
$waiter->quit;
is(sql(qq{SELECT token = $tok AND status IS NULL FROM idem.keys WHERE key = 'w-cancel'}),
	't', 'cancel: the key is still the holder\'s');
is(sql(q{SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		  WHERE a.query LIKE '%w-cancel%' AND l.locktype = 'transactionid'}),
	'0', 'cancel: the waiter holds no lock');

# --- 5. 100 waiters on one key.
sql(q{CREATE TABLE answers (claimed boolean, state text, body bytea)});
my $script = "$dir/wait.sql";
PostgreSQL::Test::Utils::append_to_file($script, q{
INSERT INTO answers SELECT claimed, state, body
  FROM idem_begin('w-hot', 'fp', wait_for => '5 min');
});
$tok = sql(q{SELECT token FROM idem_begin('w-hot', 'fp', lease => '1 hour')});
my ($out, $err) = ('', '');
my $bench = IPC::Run::start(
	[
		'pgbench', '-n', '-c', 100, '-j', 2, '-t', 1, '-f', $script,
		'-h', $node->host, '-p', $node->port, 'postgres'
	],
	'>', \$out, '2>', \$err);
ok(waiters_sleep(100), '100 duplicates sleep in the server');
sql(qq{SELECT idem_complete('w-hot', 'fp', 200, '\\x00ff10'::bytea, $tok)});
$bench->finish;
note "pgbench:\n$out\n$err";
is($bench->result(0), 0, '100 waiters: pgbench ran without error');
is(sql(q{SELECT count(*), count(*) FILTER (WHERE NOT claimed AND state = 'DONE' AND body = '\x00ff10'::bytea)
		   FROM answers}),
	'100|100', '100 waiters: all replay the same bytes, none claims');

# --- 6. 20 waiters through pgbouncer, transaction pooling.
SKIP:
{
	my $pgbouncer = '/usr/sbin/pgbouncer';
	skip "$pgbouncer is not installed (test/deps.sh installs it)", 2
	  unless -x $pgbouncer;
	my $user = getpwuid($<);
	# On a Unix socket in a directory of its own, on no TCP port: no other
	# suite's server can answer in its place.
	my $bdir = PostgreSQL::Test::Utils::tempdir_short();
	my $bport = 6432;
	my ($host, $port) = ($node->host, $node->port);
	PostgreSQL::Test::Utils::append_to_file("$dir/userlist.txt", qq{"$user" ""\n});
	PostgreSQL::Test::Utils::append_to_file("$dir/pgbouncer.ini", <<"INI");
[databases]
postgres = host=$host port=$port dbname=postgres

[pgbouncer]
listen_addr =
listen_port = $bport
unix_socket_dir = $bdir
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
default_pool_size = 25
max_client_conn = 100
logfile = $PostgreSQL::Test::Utils::log_path/pgbouncer_023.log
pidfile = $dir/pgbouncer.pid
INI
	system($pgbouncer, '-d', '-q', "$dir/pgbouncer.ini") == 0
	  or BAIL_OUT('pgbouncer does not start');
	for (1 .. 100)
	{
		if (open(my $pf, '<', "$dir/pgbouncer.pid"))
		{
			$bouncer_pid = <$pf>;
			close($pf);
			chomp $bouncer_pid if defined $bouncer_pid;
			last if $bouncer_pid;
		}
		select(undef, undef, undef, 0.1);
	}
	sql(q{TRUNCATE answers});
	my $script2 = "$dir/wait2.sql";
	PostgreSQL::Test::Utils::append_to_file($script2, q{
INSERT INTO answers SELECT claimed, state, body
  FROM idem_begin('w-bounced', 'fp', wait_for => '5 min');
});
	$tok = sql(q{SELECT token FROM idem_begin('w-bounced', 'fp', lease => '1 hour')});
	($out, $err) = ('', '');
	$bench = IPC::Run::start(
		[
			'pgbench', '-n', '-c', 20, '-j', 2, '-t', 1, '-f', $script2,
			'-h', $bdir, '-p', $bport, 'postgres'
		],
		'>', \$out, '2>', \$err);
	my $slept = waiters_sleep(20);
	sql(qq{SELECT idem_complete('w-bounced', 'fp', 200, 'bounced', $tok)});
	$bench->finish;
	kill 'TERM', $bouncer_pid if $bouncer_pid;
	$bouncer_pid = undef;
	note "pgbench:\n$out\n$err";
	ok($slept && $bench->result(0) == 0, 'pgbouncer: 20 duplicates slept and pgbench ran without error');
	is(sql(q{SELECT count(*), count(*) FILTER (WHERE NOT claimed AND state = 'DONE' AND body = 'bounced'::bytea)
			   FROM answers}),
		'20|20', 'pgbouncer: all 20 replay, none claims');
}

# --- 9. A REPEATABLE READ waiter: its snapshot cannot show the
# completion, so the change is a serialization failure, to retry.
$tok = sql(q{SELECT token FROM idem_begin('w-rr', 'fp', lease => '1 hour')});
$waiter = $node->background_psql('postgres', on_error_stop => 0);
$waiter->query_until(qr/start/, q{
	\echo start
	BEGIN ISOLATION LEVEL REPEATABLE READ;
	SELECT claimed FROM idem_begin('w-rr', 'fp', wait_for => '5 min');
});
ok(waiters_sleep(1), 'repeatable read: the duplicate sleeps in the server');
sql(qq{SELECT idem_complete('w-rr', 'fp', 200, 'rr', $tok)});
$waiter->query('ROLLBACK');
like($waiter->{stderr}, qr/could not serialize access due to concurrent update/,
	'repeatable read: a completion during the wait is a serialization failure');
$waiter->quit;
is(sql(q{SELECT state FROM idem_begin('w-rr', 'fp', wait_for => '5 min')}), 'DONE',
	'repeatable read: the retry replays');

# --- 8. One transaction completes 40 keys (more than it notes one by
# one): the waiter on the last one is woken at its commit too.
sql(q{SELECT count(*) FROM generate_series(1, 40) g,
	   idem_begin('ovf-' || g, 'fp', lease => '1 hour')});
$waiter = $node->background_psql('postgres');
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, convert_from(body, 'UTF8') AS body
	  FROM idem_begin('ovf-40', 'fp', wait_for => '5 min');
});
ok(waiters_sleep(1), 'many keys: the duplicate sleeps in the server');
sql(q{SELECT count(*) FROM idem.keys k,
	   LATERAL idem_complete(k.key, 'fp', 200, convert_to('bulk', 'UTF8'), k.token)
	  WHERE k.key LIKE 'ovf-%'});
is($waiter->query_safe('SELECT 1'), "f|DONE|bulk\n1",
	'many keys: the duplicate replays the response completed with 39 others');
$waiter->quit;

idem_amcheck($node, 'postgres');
$node->stop;

# --- 7. Without shared_preload_libraries: the waiter polls.
my $plain = idem_node('waits_plain', preload => 0, conf => 'idem.purge_enabled = off');
$tok = $plain->safe_psql('postgres', q{SELECT token FROM idem_begin('w-poll', 'fp', lease => '1 hour')});
$waiter = $plain->background_psql('postgres');
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, convert_from(body, 'UTF8') AS body
	  FROM idem_begin('w-poll', 'fp', wait_for => '5 min');
});
ok($plain->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE query LIKE '%idem_begin%wait_for%' AND state = 'active' AND pid <> pg_backend_pid()}),
	'no preload: the duplicate waits');
$plain->safe_psql('postgres', qq{SELECT idem_complete('w-poll', 'fp', 200, convert_to('polled', 'UTF8'), $tok)});
is($waiter->query_safe('SELECT 1'), "f|DONE|polled\n1", 'no preload: the duplicate replays');
$waiter->quit;
idem_amcheck($plain, 'postgres');
$plain->stop;

done_testing();
