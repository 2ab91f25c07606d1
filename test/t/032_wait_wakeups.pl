# Liveness of wait_for: a duplicate sleeping for a committed claim's
# result is woken by every commit path that answers it, and a sleep that
# cannot end is ended.  Every wait here has wait_for '10 min' and the
# holders leases of an hour: a waiter that is not woken does not answer
# within the test's timeout, so no assertion depends on how fast anything
# is.
#
# - idem_stats counts one wait per call that waited, however many times
#   it was woken.
# - A waiter that waited for a row lock during its wait (a takeover in
#   progress), while a bulk completion woke every condition variable,
#   still wakes when the key's new holder completes it.
# - After that lock wait, a key that is still busy (locked FOR SHARE by
#   the taker's transaction, whose takeover was rolled back to a
#   savepoint) is waited for, not answered in flight while wait_for
#   remains.
# - A completion committed with two-phase commit wakes the waiter at
#   COMMIT PREPARED: a waiter that slept before the PREPARE, and one that
#   came after it.  The time from COMMIT PREPARED to the waiter's answer
#   is measured over 20 runs and reported (not asserted).
# - A waiter that holds a row lock the holder's completing transaction
#   waits for ends with 40P01 after deadlock_timeout, and the completion
#   goes through.

use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('wakeups', conf => qq{
max_prepared_transactions = 5
idem.purge_enabled = off
deadlock_timeout = '100ms'
});

sub sql { return $node->safe_psql('postgres', $_[0]); }

my ($tok, $w, $taker);

# Wait until the call waiting for key sleeps in idem_begin, on a
# condition variable (Extension) or a lock (Lock).
sub sleeps_on
{
	my ($type, $key) = @_;
	return $node->poll_query_until('postgres', qq{
		SELECT count(*) = 1 FROM pg_stat_activity
		 WHERE wait_event_type = '$type' AND query LIKE '%idem_begin(''$key''%'});
}

# Start idem_begin(key, 'fp', wait_for => '10 min') in a new session,
# returning its columns cols; the session is returned.
sub start_waiter
{
	my ($key, $cols, $setup) = @_;
	my $w = $node->background_psql('postgres', on_error_stop => 0);
	$w->query_safe($setup) if defined $setup;
	$w->query_until(qr/start/, qq{
		\\echo start
		SELECT $cols FROM idem_begin('$key', 'fp', wait_for => '10 min');
	});
	return $w;
}

# Claim n keys prefix-1 .. prefix-n; complete them in one transaction,
# which wakes every waiter (more keys than a transaction notes one by one).
sub claim_many
{
	my ($prefix, $n) = @_;
	sql(qq{SELECT count(*) FROM generate_series(1, $n) g,
			idem_begin('$prefix-' || g, 'fp', lease => '1 hour')});
}

sub complete_many
{
	my ($prefix) = @_;
	sql(qq{SELECT count(*) FROM idem.keys k,
			LATERAL idem_complete(k.key, 'fp', 200, 'bulk', k.token)
		   WHERE k.key LIKE '$prefix-%'});
}

# --- One call, woken twice (a bulk completion, then its key's),
# counts one wait.
my $waits = sql(q{SELECT coalesce(sum(waits), 0) FROM idem_stats WHERE datname = 'postgres'});
claim_many('cnt-bulk', 40);
$tok = sql(q{SELECT token FROM idem_begin('cnt', 'fp', lease => '1 hour')});
$w = start_waiter('cnt', q{state});
ok(sleeps_on('Extension', 'cnt'), 'count: the duplicate sleeps');
complete_many('cnt-bulk');
ok(sleeps_on('Extension', 'cnt'), 'count: woken for nothing, it sleeps again');
sql(qq{SELECT idem_complete('cnt', 'fp', 200, 'counted', $tok)});
is($w->query_safe('SELECT 1'), "DONE\n1", 'count: the duplicate replays');
$w->quit;
is(sql(qq{SELECT waits - $waits, wait_time > 0 FROM idem_stats WHERE datname = 'postgres'}),
	'1|t', 'count: idem_stats counts the call once, with its wait time');

# --- A lock wait inside the wait: the taker's transaction holds the
# key (a takeover under a clock two minutes ahead) while a bulk
# completion wakes every waiter; the taker commits, the waiter sleeps for
# its result, which the taker then completes.
sql(q{SELECT token FROM idem_begin('lw', 'fp', lease => '1 min')});
claim_many('lw-bulk', 40);
$taker = $node->background_psql('postgres');
$taker->query_safe(q{SET idem.clock_offset = '2 min'; BEGIN});
my $ttok = $taker->query_safe(
	q{SELECT token FROM idem_begin('lw', 'fp', lease => '1 hour') WHERE claimed});
$w = start_waiter('lw', q{claimed, state, convert_from(body, 'UTF8')},
	q{SET idem.clock_offset = '2 min'; SET deadlock_timeout = '10 min'});
ok(sleeps_on('Lock', 'lw'), 'lock wait: the duplicate waits for the takeover');
complete_many('lw-bulk');
$taker->query_safe('COMMIT');
ok(sleeps_on('Extension', 'lw'),
	'lock wait: after the takeover commits, the duplicate sleeps for its result');
sql(qq{SELECT idem_complete('lw', 'fp', 200, convert_to('after a lock wait', 'UTF8'), $ttok)});
is($w->query_safe('SELECT 1'), "f|DONE|after a lock wait\n1",
	'lock wait: the completion wakes the duplicate, which replays it');
$w->quit;
$taker->quit;

# --- Still busy after the lock wait: the taker locked the row FOR
# SHARE, then took the key over in a savepoint it rolls back.  The
# duplicate's lock wait ends, the row is still locked: it waits on, and
# claims the key once the taker's transaction ends.
sql(q{SELECT token FROM idem_begin('ls', 'fp', lease => '1 min')});
$taker = $node->background_psql('postgres');
$taker->query_safe(q{SET idem.clock_offset = '2 min'; BEGIN;
	SELECT token FROM idem.keys WHERE key = 'ls' FOR SHARE;
	SAVEPOINT s;
	SELECT claimed FROM idem_begin('ls', 'fp', lease => '1 hour')});
$w = start_waiter('ls', q{claimed, state}, q{SET idem.clock_offset = '2 min'; SET deadlock_timeout = '10 min'});
ok(sleeps_on('Lock', 'ls'), 'still busy: the duplicate waits for the takeover');
$taker->query_safe('ROLLBACK TO SAVEPOINT s');
ok(sleeps_on('Lock', 'ls'),
	'still busy: the takeover undone, the duplicate waits for the row lock');
$taker->query_safe('COMMIT');
is($w->query_safe('SELECT 1'), "t|PROCESSING\n1",
	'still busy: the duplicate claims the key once the lock is gone, not in flight before');
$w->quit;
$taker->quit;

# --- COMMIT PREPARED.
$tok = sql(q{SELECT token FROM idem_begin('p-before', 'fp', lease => '1 hour')});
$w = start_waiter('p-before', q{claimed, state, convert_from(body, 'UTF8')});
ok(sleeps_on('Extension', 'p-before'), 'prepared: the duplicate sleeps');
sql(qq{BEGIN;
	SELECT idem_complete('p-before', 'fp', 200, convert_to('prepared', 'UTF8'), $tok);
	PREPARE TRANSACTION 'p_before'});
ok(sleeps_on('Extension', 'p-before'),
	'prepared: the duplicate sleeps on while the completion is prepared');
sql(q{COMMIT PREPARED 'p_before'});
is($w->query_safe('SELECT 1'), "f|DONE|prepared\n1",
	'prepared: COMMIT PREPARED wakes the duplicate, which replays the response');
$w->quit;

$tok = sql(q{SELECT token FROM idem_begin('p-after', 'fp', lease => '1 hour')});
sql(qq{BEGIN;
	SELECT idem_complete('p-after', 'fp', 201, convert_to('prepared too', 'UTF8'), $tok);
	PREPARE TRANSACTION 'p_after'});
$w = start_waiter('p-after', q{claimed, state, convert_from(body, 'UTF8')});
ok(sleeps_on('Extension', 'p-after'),
	'prepared: a duplicate that comes after the PREPARE sleeps');
sql(q{COMMIT PREPARED 'p_after'});
is($w->query_safe('SELECT 1'), "f|DONE|prepared too\n1",
	'prepared: COMMIT PREPARED wakes it too');
$w->quit;

# From COMMIT PREPARED to the waiter's answer, by the server's clock.
my @ms;
$w = $node->background_psql('postgres');
for my $i (1 .. 20)
{
	$tok = sql(qq{SELECT token FROM idem_begin('p-m$i', 'fp', lease => '1 hour')});
	$w->query_until(qr/start/, qq{
		\\echo start
		SELECT extract(epoch FROM clock_timestamp()) FROM idem_begin('p-m$i', 'fp', wait_for => '10 min');
	});
	sleeps_on('Extension', "p-m$i");
	sql(qq{BEGIN; SELECT idem_complete('p-m$i', 'fp', 200, 'm', $tok);
		PREPARE TRANSACTION 'p_m$i'});
	my $t0 = sql(qq{SELECT extract(epoch FROM clock_timestamp()); COMMIT PREPARED 'p_m$i'});
	my ($t1) = split /\n/, $w->query_safe('SELECT 1');
	push @ms, ($t1 - $t0) * 1000;
}
$w->quit;
@ms = sort { $a <=> $b } @ms;
note sprintf('COMMIT PREPARED to the answer over %d runs: p50 %.1f ms, p99 %.1f ms, max %.1f ms',
	scalar(@ms), $ms[$#ms / 2], $ms[int(0.99 * $#ms)], $ms[-1]);

# --- The waiter holds a row lock the completing transaction needs.
sql(q{CREATE TABLE accounts (id int PRIMARY KEY, balance int);
	INSERT INTO accounts VALUES (1, 0)});
$tok = sql(q{SELECT token FROM idem_begin('dl', 'fp', lease => '1 hour')});
my $locker = $node->background_psql('postgres', on_error_stop => 0);
$locker->query_safe(q{\set VERBOSITY verbose});
$locker->query_until(qr/start/, q{
	\echo start
	BEGIN;
	UPDATE accounts SET balance = balance + 1 WHERE id = 1;
	SELECT state FROM idem_begin('dl', 'fp', wait_for => '10 min');
});
ok(sleeps_on('Extension', 'dl'), 'deadlock: the duplicate sleeps holding a row lock');
my $completer = $node->background_psql('postgres', on_error_stop => 0);
$completer->query_until(qr/start/, qq{
	\\echo start
	BEGIN;
	UPDATE accounts SET balance = balance + 10 WHERE id = 1;
	SELECT idem_complete('dl', 'fp', 200, 'paid', $tok) IS NOT NULL;
	COMMIT;
});
$locker->query('ROLLBACK');
like($locker->{stderr}, qr/ERROR:  40P01: deadlock detected while waiting for the result of idempotency key "dl"/,
	'deadlock: the duplicate\'s wait ends with 40P01');
is($completer->query_safe('SELECT 1'), "t\n1", 'deadlock: the completing transaction goes on');
is(sql(q{SELECT k.status, a.balance FROM idem.keys k, accounts a WHERE k.key = 'dl'}),
	'200|10', 'deadlock: the completion and its business write committed');
$locker->quit;
$completer->quit;

idem_amcheck($node, 'postgres');
$node->stop;
done_testing();
