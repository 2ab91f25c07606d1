# On a hot standby, a call that finds the key being claimed by a
# transaction still running on the primary waits for that transaction as
# a call on the primary does: lock_timeout ends the wait with 55P03 (not
# statement_timeout with 57014), the wait shows in pg_stat_activity as an
# Extension wait (IdemWaitForPrimary from PostgreSQL 17 on), and the call
# answers once the primary's commit is replayed.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $primary = idem_node('primary', init => { allows_streaming => 1 },
	conf => 'idem.purge_enabled = off');
$primary->backup('backup');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
$standby->start;

# A claim of a new key, uncommitted on the primary; a commit of another
# transaction sends its WAL to the standby.
my $holder = $primary->background_psql('postgres');
$holder->query_safe(q{BEGIN; SELECT claimed FROM idem_begin('sb', 'f', lease => '1 hour')});
$primary->safe_psql('postgres', 'SELECT txid_current()');
$primary->wait_for_catchup($standby);

# lock_timeout, with a statement_timeout far longer.
my ($ret, $out, $err) = $standby->psql('postgres', q{\set VERBOSITY verbose
SET lock_timeout = '500ms';
SET statement_timeout = '20s';
SELECT claimed, state FROM idem_begin('sb', 'f')});
like($err, qr/ERROR:  55P03: canceling statement due to lock timeout/,
	'standby: lock_timeout ends the wait for the primary\'s transaction with 55P03');
like($err, qr/waiting for the transaction that holds idempotency key "sb"/,
	'standby: the error names the key');

# Without lock_timeout the call waits, visibly, until the primary commits.
my $w = $standby->background_psql('postgres');
$w->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state FROM idem_begin('sb', 'f');
});
ok( $standby->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE wait_event_type = 'Extension'
	   AND wait_event IN ('Extension', 'IdemWaitForPrimary')
	   AND query LIKE '%idem_begin(''sb''%'}),
	'standby: the wait shows in pg_stat_activity');
is($standby->safe_psql('postgres', q{SELECT key, kind FROM idem_waits}), 'sb|transaction',
	'standby: idem_waits shows the wait for the transaction');
$holder->query_safe('COMMIT');
$holder->quit;
is($w->query_safe('SELECT 1'), "f|PROCESSING\n1",
	'standby: once the commit is replayed, the claim is in flight');
$w->quit;

$standby->stop;
$primary->stop;
done_testing();
