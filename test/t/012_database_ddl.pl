# The worker holds no database connection between passes and leaves a
# database as soon as a command waits for it: CREATE DATABASE ... TEMPLATE,
# ALTER DATABASE ... RENAME and DROP DATABASE of a database with idem
# succeed while its keys are being purged.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

# Small batches, so that purging a database takes several transactions.
my $node = idem_node('ddl', conf => qq{
idem.purge_naptime = 1
idem.purge_batch_size = 20
log_min_messages = debug1
}, extension => []);

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

# SQL adding n expired keys.
sub expired_rows
{
	my ($n) = @_;
	return qq{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
SELECT '', 'old-' || g || '-' || nextval('idem.token_seq'), sha256('f'),
	nextval('idem.token_seq'), 200, 'x', now() - interval '1 hour'
FROM generate_series(1, $n) g};
}

# Run a command on a database while a purge worker is in it.  A session
# adds 200 expired keys under a lock on idem.keys, which holds the worker
# at its first batch; the command then waits for the worker's lock on the
# database; the session commits and leaves, the worker deletes one batch,
# sees the command waiting and leaves instead of starting the next batch.
# The worker waits at most 5 s for the lock (idem.purge_naptime, raised to
# its 5 s floor), so the command's session is connected before the worker
# starts waiting and only the command is sent in that window.  Returns true
# if the command succeeded.
sub ddl_during_purge
{
	my ($db, $ddl) = @_;

	my $runner = $node->background_psql('postgres', on_error_stop => 0);
	my $blocker = $node->background_psql($db);
	$blocker->query_safe(
		'BEGIN; LOCK TABLE idem.keys IN SHARE MODE; ' . expired_rows(200));
	$node->poll_query_until('postgres', qq{
SELECT count(*) FROM pg_stat_activity
WHERE backend_type = 'idem purge' AND datname = '$db' AND wait_event_type = 'Lock'},
		'1')
	  or die "no purge worker in $db";

	$runner->query_until(qr/sent/, "\\echo sent\n$ddl;\n");
	$node->poll_query_until('postgres', qq{
SELECT count(*) FROM pg_stat_activity
WHERE query = '$ddl;' AND wait_event_type = 'Lock'}, '1')
	  or die "$ddl does not wait for the purge worker";

	# Not query_safe: with FORCE the command terminates this session as
	# soon as it can go on, which may come before psql has reported the
	# COMMIT (the COMMIT itself is done by then: the command cannot go on
	# before the worker leaves, nor the worker before this lock is gone).
	$blocker->query('COMMIT');
	$blocker->quit;
	# Returns when the command has ended; its error, if any, is on stderr.
	$runner->query('SELECT 1');
	my $err = $runner->{stderr};
	$runner->quit;
	diag($err) if $err ne '';
	return $err eq '';
}

my $offset = -s $node->logfile;

ok(ddl_during_purge('app', 'CREATE DATABASE app_copy TEMPLATE app'),
	'CREATE DATABASE ... TEMPLATE app succeeds during purge');
ok($node->poll_query_until('app_copy', 'SELECT count(*) FROM idem.keys', '0'),
	'the worker purges the copy too');
is( $node->safe_psql('app_copy',
		"SELECT purged_rows FROM idem_stats WHERE datname = 'app_copy'"),
	'180', 'the copy had the 180 keys left after one batch of 20');
# app and its copy are dropped below: their keys' primary key entries are
# checked now (amcheck).
idem_amcheck($node, $_) for qw(app app_copy);

ok(ddl_during_purge('app', 'ALTER DATABASE app RENAME TO app_renamed'),
	'ALTER DATABASE ... RENAME succeeds during purge');
ok(ddl_during_purge('app_renamed', 'DROP DATABASE app_renamed'),
	'DROP DATABASE succeeds during purge');
# With FORCE, PostgreSQL may also terminate the purge worker.
ok(ddl_during_purge('app_copy', 'DROP DATABASE app_copy WITH (FORCE)'),
	'DROP DATABASE ... WITH (FORCE) succeeds during purge');

is( $node->safe_psql('postgres',
		"SELECT count(*) FROM pg_database WHERE datname LIKE 'app%'"),
	'0', 'all three databases are gone');

$node->safe_psql('other', expired_rows(1000));
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

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'other');

$node->stop;
done_testing();
