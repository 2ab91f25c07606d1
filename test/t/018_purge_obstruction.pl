# No database can stop the purge worker in the others.
#
# - A role with only CREATEDB owns a database (without idem, and another
#   one where a superuser installed idem) set to SERIALIZABLE, READ ONLY
#   and DEFERRABLE by default, and keeps a serializable transaction open:
#   the worker overrides those settings, never waits for a safe snapshot,
#   and purges every database, including the one with those settings.
# - LOCK TABLE idem.keys IN SHARE MODE held in one database: the worker
#   there gives up after its lock timeout, the other databases are purged,
#   and the locked one is purged once the lock is gone.
# - The same role renames its database in a transaction it leaves open, so
#   a worker cannot even connect to it: the launcher terminates the
#   overdue worker and purges the other databases.
# - Parallel queries of an unprivileged role take every background worker
#   slot: the launcher counts, logs and records the failed starts, and
#   purges once a slot is free.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('obstruction', conf => 'idem.purge_naptime = 1',
	extension => []);

# The test's own sessions run READ COMMITTED and read-write whatever the
# databases' defaults (options from the client override them).
$ENV{PGOPTIONS} = join(' ',
	'-c default_transaction_isolation=read\\ committed',
	'-c default_transaction_read_only=off',
	'-c default_transaction_deferrable=off');

# Sessions left open by a failing test are closed by this END block.
my @sessions;
END
{
	eval { $_->quit } for @sessions;
}

sub session
{
	my ($db, $user) = @_;
	my $s = $node->background_psql($db,
		$user ? (extra_params => [ '-U', $user ]) : ());
	push @sessions, $s;
	return $s;
}

$node->safe_psql('postgres', 'CREATE ROLE mallory LOGIN CREATEDB');

# Created in the order a pass visits them: the obstructions first.
for my $db (qw(trap trap_idem locked renamed))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db",
		extra_params => [ '-U', 'mallory' ]);
}
$node->safe_psql('postgres', 'CREATE DATABASE app');
$node->safe_psql($_, 'CREATE EXTENSION idem') for qw(trap_idem locked app);
for my $db (qw(trap trap_idem))
{
	$node->safe_psql('postgres', qq{
ALTER DATABASE $db SET default_transaction_isolation = 'serializable';
ALTER DATABASE $db SET default_transaction_read_only = on;
ALTER DATABASE $db SET default_transaction_deferrable = on;
}, extra_params => [ '-U', 'mallory' ]);
}

# SQL adding n keys that are already expired on the worker's clock.
sub expired_keys
{
	my ($prefix, $n) = @_;
	return qq{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, $n) g,
	idem_begin('$prefix-' || g, 'f', lease => '1s', retention => '1s');
};
}

sub count_keys
{
	my ($db, $prefix) = @_;
	return $node->safe_psql($db,
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$prefix-%'");
}

sub purged
{
	my ($db, $prefix) = @_;
	return $node->poll_query_until($db,
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$prefix-%'", '0');
}

my $launcher_sql =
  "SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'";
my $launcher = $node->safe_psql('postgres', $launcher_sql);

# --- 1. Settings of a database owned by a role with only CREATEDB.
# The serializable transaction that a deferrable snapshot would wait for.
my $serializable = session('postgres', 'mallory');
$serializable->query_safe(
	'BEGIN ISOLATION LEVEL SERIALIZABLE READ WRITE; SELECT count(*) FROM pg_class');
$node->safe_psql('trap_idem', expired_keys('t', 40));
$node->safe_psql('app', expired_keys('a', 50));

ok(purged('app', 'a'),
	'database settings of another database: app is purged');
ok(purged('trap_idem', 't'),
	'a database set to serializable, read-only, deferrable is purged too');
ok( $node->poll_query_until('app', q{
SELECT purged_rows, last_purge_error IS NULL FROM idem_stats
WHERE datname = 'trap_idem'}, '40|t'),
	'idem_stats: 40 rows purged in trap_idem, no error');
# Its worker connects, finds no idem and leaves: the owner can drop it while
# the serializable transaction is still open.
# (A worker stuck there would make DROP DATABASE wait for its lock on the
# database: lock_timeout turns that into a failure instead of a hang.)
my ($ret, $out, $err) = $node->psql('postgres',
	"SET lock_timeout = '${PostgreSQL::Test::Utils::timeout_default}s';\n"
	  . 'DROP DATABASE trap',
	extra_params => [ '-U', 'mallory' ]);
is($ret, 0, 'DROP DATABASE of the database with those settings')
  or diag($err);
$serializable->query_safe('COMMIT');

# --- 2. LOCK TABLE idem.keys IN SHARE MODE held in one database.  Its
# keys expire 3 s after they are made, under the lock: a purge pass
# between their insertion and the lock would find nothing to delete yet.
my $offset = -s $node->logfile;
my $locker = session('locked');
$node->safe_psql('locked', q{
SELECT count(*) FROM generate_series(1, 30) g,
	idem_begin('l-' || g, 'f', lease => '1s', retention => '3s');
});
$locker->query_safe('BEGIN; LOCK TABLE idem.keys IN SHARE MODE');
ok( $node->poll_query_until('locked', q{
SELECT count(*) FROM idem.keys WHERE key LIKE 'l-%' AND expires_at < now()}, '30'),
	'the locked database\'s keys expire under the lock');
$node->safe_psql('app', expired_keys('b', 60));

ok(purged('app', 'b'), 'table locked in another database: app is purged');
ok( $node->wait_for_log(
		qr/idem purge: skipped database "locked": a lock was held by another session for more than 5000 ms/,
		$offset),
	'the worker in the locked database gives up after its lock timeout, and logs it');
ok( $node->poll_query_until('app', q{
SELECT last_purge_error FROM idem_stats WHERE datname = 'locked'},
		'purge skipped: a lock was held by another session for more than 5000 ms'),
	'idem_stats: the skipped purge is recorded');
is(count_keys('locked', 'l'), '30', 'nothing purged under the lock');
$node->safe_psql('app', expired_keys('c', 20));
ok(purged('app', 'c'), 'app is purged again on the next passes');

$locker->query_safe('COMMIT');
ok(purged('locked', 'l'), 'the locked database is purged once the lock is gone');
ok( $node->poll_query_until('app', q{
SELECT last_purge_error IS NULL FROM idem_stats WHERE datname = 'locked'}),
	'idem_stats: the error is cleared');

# --- 3. A database its worker cannot connect to: the owner renames it in a
# transaction left open, which holds the lock a connection takes.
$offset = -s $node->logfile;
my $renamer = session('postgres', 'mallory');
$renamer->query_safe('BEGIN; ALTER DATABASE renamed RENAME TO renamed_away');
$node->safe_psql('app', expired_keys('d', 70));

ok( $node->wait_for_log(
		qr/idem launcher: purge worker for database "renamed" did not start purging within 10000 ms; terminating it/,
		$offset),
	'the launcher terminates a worker that cannot start purging');
ok(purged('app', 'd'), 'the database behind it is purged');
$renamer->query_safe('ROLLBACK');

# The launcher carried on throughout.
is($node->safe_psql('postgres', $launcher_sql),
	$launcher, 'same launcher throughout');

$_->quit for @sessions;
@sessions = ();
# Every key written has its primary key entry (amcheck), in the databases
# with idem (trap, without it, is gone).
idem_amcheck($node, $_) for qw(trap_idem locked app);
$node->stop;

# --- 4. Parallel queries of an unprivileged role take every background
# worker slot: the launcher counts, logs and records each failed start and
# tries again until a slot is free.  Three slots: the launcher's and two.
my $small = idem_node('slots_full', conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
max_worker_processes = 3
max_logical_replication_workers = 0
});
$small->safe_psql('postgres', 'CREATE ROLE reporter LOGIN');
$small->safe_psql('postgres', expired_keys('p', 25));
my $force_parallel =
  $small->safe_psql('postgres', 'SHOW server_version_num') >= 160000
  ? 'debug_parallel_query'
  : 'force_parallel_mode';
for my $i (1 .. 2)
{
	my $s = $small->background_psql('postgres',
		extra_params => [ '-U', 'reporter' ]);
	push @sessions, $s;
	$s->query_safe("SET $force_parallel = on");
	$s->query_until(qr/sleeping/, "\\echo sleeping\nSELECT pg_sleep(3600);\n");
}
ok( $small->poll_query_until('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'parallel worker'",
		'2'),
	'two parallel queries hold the two free background worker slots');

$offset = -s $small->logfile;
$small->safe_psql('postgres',
	'ALTER SYSTEM SET idem.purge_enabled = on; SELECT pg_reload_conf()');
ok( $small->wait_for_log(
		qr/idem launcher could not start a purge worker for database "postgres"\n.*DETAIL:  All 3 background worker slots are in use; \d+ purge worker starts have failed since the server started/,
		$offset),
	'a purge worker that cannot start is logged with the count of failures');
ok( $small->poll_query_until('postgres', q{
SELECT last_purge_error FROM idem_stats WHERE datname = 'postgres'},
		'purge worker not started: all 3 background worker slots (max_worker_processes) were in use'),
	'idem_stats: the failed start is recorded');
ok( $small->safe_psql('postgres', q{
SELECT purge_start_failures FROM idem_stats WHERE datname = 'postgres'}) >= 1,
	'idem_stats: purge_start_failures counts it');
is( $small->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'p-%'"),
	'25', 'nothing purged while no slot is free');

$small->safe_psql('postgres', q{
SELECT pg_cancel_backend(pid) FROM pg_stat_activity
WHERE usename = 'reporter' AND backend_type = 'client backend'});
ok( $small->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'p-%'", '0'),
	'the launcher tries again and purges once a slot is free');
ok( $small->poll_query_until('postgres', q{
SELECT last_purge_error IS NULL FROM idem_stats WHERE datname = 'postgres'}),
	'idem_stats: the error is cleared');
my $failures = $small->safe_psql('postgres', q{
SELECT purge_start_failures FROM idem_stats WHERE datname = 'postgres'});
ok($failures >= 1, "purge_start_failures stays after the purge ($failures)");

eval { $_->quit } for @sessions;
@sessions = ();
idem_amcheck($small, 'postgres');
$small->stop;
done_testing();
