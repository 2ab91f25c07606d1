# Who waits for what: idem_waits shows each call waiting for a key, with
# the key and whom it waits for, while it waits and not after.
#
# 1. A call waiting for the transaction that holds the key (a row lock):
#    kind 'transaction', the holder's pid and xid, the key clipped to 64
#    bytes; gone once the holder commits.  A holder inside a savepoint is
#    still named by its backend.
# 2. A wait_for wait: kind 'result', the claim's token; the wait event
#    IdemWaitForResult on PostgreSQL 17 and later; gone once the holder
#    completes.
# 3. Waits that end with an error leave no row behind: a cancel
#    (pg_cancel_backend), lock_timeout caught in a PL/pgSQL block while the
#    transaction goes on, for both kinds of wait; and a terminated backend.
# 4. Privileges: the key, the scope and the token are shown to members of
#    pg_read_all_stats and to the waiting session's role, NULL to other
#    roles granted the view; a role without the grant gets 42501.
# 5. A key of a database of another encoding: its characters beyond ASCII
#    are shown as '?' in other databases.
# 6. Without shared_preload_libraries: 55000.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('waits_view', conf => q{
idem.purge_enabled = off
});
my $v17 = $node->safe_psql('postgres', 'SHOW server_version_num') >= 170000;

sub sql { return $node->safe_psql('postgres', $_[0]); }

# Wait until the backend pid shows a wait of the kind in idem_waits.
sub shows_wait
{
	my ($pid, $kind) = @_;
	return $node->poll_query_until('postgres', qq{
		SELECT EXISTS (SELECT FROM idem_waits WHERE pid = $pid AND kind = '$kind')});
}

# Rows idem_waits has for the backend pid.
sub rows_of { return sql("SELECT count(*) FROM idem_waits WHERE pid = $_[0]"); }

# A session of its own (in database postgres unless told), and its
# backend's pid.
sub session
{
	my (%opt) = @_;
	my $db = delete $opt{db} // 'postgres';
	my $s = $node->background_psql($db, on_error_stop => 0, %opt);
	return ($s, $s->query_safe('SELECT pg_backend_pid()'));
}

sql(q{
CREATE ROLE wv_app LOGIN;
GRANT EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  TO wv_app;
CREATE ROLE wv_ops;
CREATE ROLE wv_stats IN ROLE pg_read_all_stats;
CREATE ROLE wv_none;
GRANT EXECUTE ON FUNCTION idem_waits() TO wv_app, wv_ops, wv_stats;
GRANT SELECT ON idem_waits TO wv_app, wv_ops, wv_stats;
});

# --- 1. A row-lock wait.
my $long = 'wv-row-' . ('x' x 100);
my ($holder, $hpid) = session();
$holder->query_safe(qq{BEGIN; SELECT idem_begin('$long', 'fp', scope => 'tenant-1')});
my $hxid = $holder->query_safe('SELECT pg_current_xact_id()');
my ($waiter, $wpid) = session();
$waiter->query_until(qr/start/, qq{
	\\echo start
	SELECT state FROM idem_begin('$long', 'fp', scope => 'tenant-1');
});
ok(shows_wait($wpid, 'transaction'), 'row lock: the waiter is shown');
is(sql(qq{SELECT datname, scope, key = left('$long', 64) || '...', holder_pid, holder_xid,
		  holder_token IS NULL, waiting_since <= now()
		FROM idem_waits WHERE pid = $wpid}),
	"postgres|tenant-1|t|$hpid|$hxid|t|t",
	'row lock: database, scope, key clipped to 64 bytes, holder pid and xid');
$holder->query_safe('COMMIT');
is($waiter->query_safe('SELECT 1'), "PROCESSING\n1",
	'row lock: the waiter answers once the holder commits');
is(rows_of($wpid), '0', 'row lock: no row once the wait is over');

# The holder claimed the key in a savepoint: a subtransaction's xid.
$holder->query_safe(q{BEGIN; SAVEPOINT s; SELECT idem_begin('wv-sub', 'fp')});
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT state FROM idem_begin('wv-sub', 'fp');
});
ok(shows_wait($wpid, 'transaction'), 'savepoint: the waiter is shown');
is(sql(qq{SELECT holder_pid FROM idem_waits WHERE pid = $wpid}), $hpid,
	'savepoint: the holder is named by its backend');
$holder->query_safe('COMMIT');
is($waiter->query_safe('SELECT 1'), "PROCESSING\n1",
	'savepoint: the waiter answers once the holder commits');
is(rows_of($wpid), '0', 'savepoint: no row once the wait is over');

# --- 2. A wait_for wait.
my $tok = sql(q{SELECT token FROM idem_begin('wv-result', 'fp', lease => '1 hour')});
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT state, status FROM idem_begin('wv-result', 'fp', wait_for => '5 min');
});
ok(shows_wait($wpid, 'result'), 'wait_for: the waiter is shown');
is(sql(qq{SELECT key, holder_token, holder_pid IS NULL, holder_xid IS NULL
			FROM idem_waits WHERE pid = $wpid}),
	"wv-result|$tok|t|t", 'wait_for: the key and the claim\'s token');
is(sql(qq{SELECT wait_event_type || '/' || wait_event FROM pg_stat_activity WHERE pid = $wpid}),
	$v17 ? 'Extension/IdemWaitForResult' : 'Extension/Extension',
	'wait_for: the wait event in pg_stat_activity');
my $since = sql(qq{SELECT waiting_since FROM idem_waits WHERE pid = $wpid});
sql(qq{BEGIN; SELECT idem_complete('wv-result', 'fp', 200, 'rolled back', $tok); ROLLBACK});
ok(shows_wait($wpid, 'result'), 'wait_for: a rolled back completion: still shown');
is(sql(qq{SELECT waiting_since = '$since' FROM idem_waits WHERE pid = $wpid}), 't',
	'wait_for: waiting since the wait began, not since the last wake-up');
sql(qq{SELECT idem_complete('wv-result', 'fp', 201, 'done', $tok)});
is($waiter->query_safe('SELECT 1'), "DONE|201\n1",
	'wait_for: the waiter replays the completion');
is(rows_of($wpid), '0', 'wait_for: no row once the wait is over');

# --- 3. Waits that end with an error.
# A cancelled row-lock wait.
$holder->query_safe(q{BEGIN; SELECT idem_begin('wv-err', 'fp')});
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT state FROM idem_begin('wv-err', 'fp');
});
ok(shows_wait($wpid, 'transaction'), 'cancel, row lock: the waiter is shown');
sql("SELECT pg_cancel_backend($wpid)");
is($waiter->query('SELECT 1'), '1', 'cancel, row lock: the session is usable');
like($waiter->{stderr}, qr/canceling statement due to user request/,
	'cancel, row lock: the wait ends with the cancel');
is(rows_of($wpid), '0', 'cancel, row lock: no row left');

# lock_timeout during a row-lock wait, caught: the transaction goes on.
$waiter->query_until(qr/start/, q{
	\echo start
	SET lock_timeout = '3s';
	DO $$
	BEGIN
		PERFORM idem_begin('wv-err', 'fp');
	EXCEPTION WHEN lock_not_available THEN
		PERFORM pg_sleep(300);
	END $$;
});
ok(shows_wait($wpid, 'transaction'), 'lock_timeout, row lock: the waiter is shown');
ok($node->poll_query_until('postgres', qq{
	SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $wpid}),
	'lock_timeout, row lock: the error is caught, the transaction goes on');
is(rows_of($wpid), '0', 'lock_timeout, row lock: no row left');
sql("SELECT pg_cancel_backend($wpid)");
$waiter->query('RESET lock_timeout');
$holder->query_safe('ROLLBACK');

# A cancelled wait_for wait.
$tok = sql(q{SELECT token FROM idem_begin('wv-err2', 'fp', lease => '1 hour')});
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT state FROM idem_begin('wv-err2', 'fp', wait_for => '5 min');
});
ok(shows_wait($wpid, 'result'), 'cancel, wait_for: the waiter is shown');
sql("SELECT pg_cancel_backend($wpid)");
is($waiter->query('SELECT 1'), '1', 'cancel, wait_for: the session is usable');
like($waiter->{stderr}, qr/canceling statement due to user request/,
	'cancel, wait_for: the wait ends with the cancel');
is(rows_of($wpid), '0', 'cancel, wait_for: no row left');

# lock_timeout during a wait_for wait, caught.
$waiter->query_until(qr/start/, q{
	\echo start
	SET lock_timeout = '3s';
	DO $$
	BEGIN
		PERFORM idem_begin('wv-err2', 'fp', wait_for => '5 min');
	EXCEPTION WHEN lock_not_available THEN
		PERFORM pg_sleep(300);
	END $$;
});
ok(shows_wait($wpid, 'result'), 'lock_timeout, wait_for: the waiter is shown');
ok($node->poll_query_until('postgres', qq{
	SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $wpid}),
	'lock_timeout, wait_for: the error is caught, the transaction goes on');
is(rows_of($wpid), '0', 'lock_timeout, wait_for: no row left');
sql("SELECT pg_cancel_backend($wpid)");
$waiter->query('RESET lock_timeout');

# A waiter terminated: its backend exits.
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT state FROM idem_begin('wv-err2', 'fp', wait_for => '5 min');
});
ok(shows_wait($wpid, 'result'), 'terminate: the waiter is shown');
sql("SELECT pg_terminate_backend($wpid, 60000)");
is(rows_of($wpid), '0', 'terminate: no row left');
# Its psql has lost the connection and exited: \q has nowhere to go.
eval { $waiter->quit };

# --- 4. Who sees what.  The waiter runs as wv_app.
my ($app, $apid) = session(extra_params => [ '-U', 'wv_app' ]);
$tok = sql(q{SELECT token FROM idem_begin('wv-secret', 'fp', lease => '1 hour', scope => 'tenant-2')});
$app->query_until(qr/start/, q{
	\echo start
	SELECT state FROM idem_begin('wv-secret', 'fp', scope => 'tenant-2', wait_for => '5 min');
});
ok(shows_wait($apid, 'result'), 'privileges: the waiter is shown');
my $cols = "concat_ws(',', scope, key, holder_token, kind, waiting_since IS NOT NULL)";
for my $case (
	[ 'wv_ops', "result,t", 'another role: no scope, key or token' ],
	[ 'wv_app', "tenant-2,wv-secret,$tok,result,t", 'the waiting role: everything' ],
	[ 'wv_stats', "tenant-2,wv-secret,$tok,result,t", 'pg_read_all_stats: everything' ])
{
	my ($role, $want, $what) = @$case;
	is(sql(qq{SET ROLE $role; SELECT $cols FROM idem_waits WHERE pid = $apid}),
		$want, "privileges, $what");
}
my ($ret, $out, $err) = $node->psql('postgres',
	"\\set VERBOSITY verbose\nSET ROLE wv_none; SELECT * FROM idem_waits");
like($err, qr/42501: permission denied for view idem_waits/,
	'privileges: 42501 for a role without the grant');
sql("SELECT pg_cancel_backend($apid)");
$app->query('SELECT 1');
is(rows_of($apid), '0', 'privileges: no row once the wait is cancelled');
$app->quit;

# --- 5. A database of another encoding.
sql(q{CREATE DATABASE wv_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0});
$node->safe_psql('wv_latin1', 'CREATE EXTENSION idem');
($holder, $hpid) = session(db => 'wv_latin1');
$holder->query_safe(q{BEGIN; SELECT idem_begin('wv-' || chr(233), 'fp')});
($waiter, $wpid) = session(db => 'wv_latin1');
$waiter->query_until(qr/start/, q{
	\echo start
	SELECT state FROM idem_begin('wv-' || chr(233), 'fp');
});
ok(shows_wait($wpid, 'transaction'), 'encoding: the waiter is shown');
is(sql(qq{SELECT datname || ' ' || key FROM idem_waits WHERE pid = $wpid}),
	'wv_latin1 wv-?', 'encoding: beyond ASCII, ? in a database of another encoding');
is($node->safe_psql('wv_latin1',
		qq{SELECT key = 'wv-' || chr(233) FROM idem_waits WHERE pid = $wpid}),
	't', 'encoding: the key as it is in its own database');
$holder->query_safe('COMMIT');
is($waiter->query_safe('SELECT 1'), "PROCESSING\n1", 'encoding: the waiter answers');
$holder->quit;
$waiter->quit;

idem_amcheck($node, 'postgres');

# --- 6. Without shared_preload_libraries.
$node->adjust_conf('postgresql.conf', 'shared_preload_libraries', "''");
$node->restart;
($ret, $out, $err) = $node->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT * FROM idem_waits");
like($err, qr/55000: idem waits are not tracked: the library is not preloaded/,
	'without preload: 55000');

done_testing();
