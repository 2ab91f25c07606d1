# Liveness of wait_for: a duplicate sleeping for a committed claim's
# result is woken by every commit path that answers it, and a sleep that
# cannot end is ended.  Every wait here has wait_for '10 min' and the
# holders leases of an hour: a waiter that is not woken does not answer
# within the test's timeout, so no assertion depends on how fast anything
# is.
#
# - idem_stats counts one wait per call that waited, however many times
#   it was woken.

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

idem_amcheck($node, 'postgres');
$node->stop;
done_testing();
