# The worker holds no database connection between passes and leaves a
# database as soon as a command waits for it: CREATE DATABASE ... TEMPLATE,
# ALTER DATABASE ... RENAME and DROP DATABASE of a database with idem
# succeed while its keys are being purged.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('ddl');
$node->init;
# Small batches, so that purging a database takes many transactions.
$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'idem'
idem.purge_naptime = 1
idem.purge_batch_size = 20
log_min_messages = debug1
});
$node->start;

for my $db (qw(app other))
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idem');
}
my $launcher_pid = launcher_pid();

sub launcher_pid
{
	return $node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'");
}

# Add n expired keys to a database.
sub add_expired
{
	my ($db, $n) = @_;
	$node->safe_psql($db, qq{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
SELECT '', 'old-' || g || '-' || nextval('idem.token_seq'), sha256('f'),
	nextval('idem.token_seq'), 200, 'x', now() - interval '1 hour'
FROM generate_series(1, $n) g});
}

# Wait until a purge worker is connected to the database.
sub wait_for_purge_in
{
	my ($db) = @_;
	return $node->poll_query_until('postgres', qq{
SELECT count(*) FROM pg_stat_activity
WHERE backend_type = 'idem purge' AND datname = '$db'}, '1');
}

my $offset = -s $node->logfile;

add_expired('app', 50000);
ok(wait_for_purge_in('app'), 'purge worker busy in app');
my ($ret, $out, $err) =
  $node->psql('postgres', 'CREATE DATABASE app_copy TEMPLATE app');
is($ret, 0, 'CREATE DATABASE ... TEMPLATE app succeeds during purge')
  or diag($err);
cmp_ok($node->safe_psql('app_copy', 'SELECT count(*) FROM idem.keys'),
	'>', 0, 'the copy has expired keys of its own');
ok($node->poll_query_until('app_copy', 'SELECT count(*) FROM idem.keys', '0'),
	'and the worker purges the copy too');

add_expired('app', 50000);
ok(wait_for_purge_in('app'), 'purge worker busy in app again');
($ret, $out, $err) =
  $node->psql('postgres', 'ALTER DATABASE app RENAME TO app_renamed');
is($ret, 0, 'ALTER DATABASE ... RENAME succeeds during purge') or diag($err);

add_expired('app_renamed', 50000);
ok(wait_for_purge_in('app_renamed'), 'purge worker busy in the renamed database');
($ret, $out, $err) = $node->psql('postgres', 'DROP DATABASE app_renamed');
is($ret, 0, 'DROP DATABASE succeeds during purge') or diag($err);

# With FORCE, PostgreSQL terminates the purge worker; the launcher goes on.
add_expired('app_copy', 50000);
ok(wait_for_purge_in('app_copy'), 'purge worker busy in the copy');
($ret, $out, $err) =
  $node->psql('postgres', 'DROP DATABASE app_copy WITH (FORCE)');
is($ret, 0, 'DROP DATABASE ... WITH (FORCE) succeeds during purge')
  or diag($err);

is( $node->safe_psql('postgres',
		"SELECT count(*) FROM pg_database WHERE datname LIKE 'app%'"),
	'0', 'all three databases are gone');

add_expired('other', 1000);
ok($node->poll_query_until('other', 'SELECT count(*) FROM idem.keys', '0'),
	'the worker still purges the remaining database');
is(launcher_pid(), $launcher_pid, 'same launcher throughout');

# The purge worker left each database when a command waited for it (with
# FORCE it was terminated instead).
my @yields = grep { /idem purge: leaving database "app(_renamed)?" to a command that waits for it/ }
  split /\n/, slurp_file($node->logfile, $offset);
is(scalar(@yields), 3, 'the purge worker made way for each of the three commands');

my @errors =
  grep { /\b(ERROR|PANIC):|being accessed by other users/ }
  split /\n/, slurp_file($node->logfile, $offset);
is(scalar(@errors), 0, 'no errors in the server log') or diag(join("\n", @errors));

$node->stop;
done_testing();
