# On a streaming hot standby every call that would write (a new claim, a
# takeover, complete, release, extend, purge) fails as read-only (25006)
# and changes nothing, while replays, conflicts and claims in flight are
# answered, and a duplicate with wait_for waits for a claim made on the
# primary (polling) and replays its response; the launcher purges
# nothing.  Tombstones (remember) replay there: a completed key past its
# retention answers EXPIRED on the standby, whether the primary's purge
# dropped its body or not, and a new claim with remember is read-only.
# Once the standby is promoted, it purges, and makes tombstones.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

# Purge is off on the primary, so that expired keys reach the standby.
my $primary = idem_node('primary', init => { allows_streaming => 1 }, conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
});
$primary->backup('backup');

my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'backup', has_streaming => 1);
$standby->append_conf('postgresql.conf', qq{
idem.purge_enabled = on
log_min_messages = debug1
});
$standby->start;

$primary->safe_psql('postgres', q{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, 40) g,
	idem_begin('old-' || g, 'f', lease => '1s', retention => '1s');
RESET idem.clock_offset;
SELECT count(*) FROM idem_begin('live', 'f', lease => '1 hour');
BEGIN;
SELECT count(*) FROM idem_begin('done', 'f');
SELECT idem_complete('done', 'f', 201, convert_to('stored', 'UTF8'));
COMMIT;
SET idem.clock_offset = '-10s';
SELECT count(*) FROM idem_begin('lapsed', 'f', lease => '1s', retention => '1h');
-- Two keys completed three hours ago with a 30 minute retention,
-- remembered for a day: the primary's purge, run with the clock two hours
-- back (before the old- keys expire), makes the first a tombstone.
SET idem.clock_offset = '-3h';
SELECT idem_complete('tomb', 'f', 201, convert_to('gone', 'UTF8'), token) IS NOT NULL
  FROM idem_begin('tomb', 'f', retention => '30 min', remember => '1 day');
SET idem.clock_offset = '-2h';
SELECT idem_purge();
SET idem.clock_offset = '-3h';
SELECT idem_complete('tomb-unpurged', 'f', 202, convert_to('kept', 'UTF8'), token) IS NOT NULL
  FROM idem_begin('tomb-unpurged', 'f', retention => '30 min', remember => '1 day');
});
my $live_token = $primary->safe_psql('postgres',
	"SELECT token FROM idem.keys WHERE key = 'live'");
$primary->wait_for_catchup($standby);

sub count_keys
{
	my ($node, $pattern) = @_;
	return $node->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE '$pattern'");
}

is(count_keys($standby, 'old-%'), '40', 'expired keys replicated to the standby');

# Tombstones on the standby: the purged one has no body, the other still
# has it; both answer EXPIRED with their status and no body, another
# request is a conflict, and idem_keys shows them EXPIRED.
is( $standby->safe_psql('postgres', q{
SELECT string_agg(concat_ws(':', k, b.claimed, b.state, b.status, b.body IS NULL, l.state, l.body_size),
				  ',' ORDER BY k)
  FROM unnest(ARRAY['tomb', 'tomb-unpurged']) k,
	   LATERAL idem_begin(k, 'f') b, LATERAL idem_lookup(k) l}),
	'tomb:f:EXPIRED:201:t:EXPIRED,tomb-unpurged:f:EXPIRED:202:t:EXPIRED:4',
	'tombstones answer EXPIRED on the standby, purged by the primary or not');
is( $standby->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('tomb', 'other')"),
	'f|CONFLICT', 'another request against a tombstone is a conflict on the standby');
is( $standby->safe_psql('postgres',
		"SELECT string_agg(key || ':' || state, ',' ORDER BY key) FROM idem_keys WHERE key LIKE 'tomb%'"),
	'tomb:EXPIRED,tomb-unpurged:EXPIRED', 'idem_keys shows the tombstones on the standby');
is( $standby->safe_psql('postgres',
		"SELECT claimed, state, status FROM idem_begin('done', 'f', remember => '2 days')"),
	'f|DONE|201', 'a replay with remember on the standby');
my (undef, undef, $remember_err) = $standby->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT * FROM idem_begin('new-remembered', 'f', remember => '2 days')");
like($remember_err, qr/ERROR:  25006:/, 'a new claim with remember on the standby fails with 25006');

my ($ret, $out, $err) = $standby->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT * FROM idem_begin('new', 'f')");
isnt($ret, 0, 'idem_begin fails on the standby');
like($err, qr/ERROR:  25006:/, 'with SQLSTATE 25006 (read-only transaction)');

my $keys_before = $standby->safe_psql('postgres',
	'SELECT md5(string_agg(k::text, \',\' ORDER BY key)) FROM idem.keys k');
for my $call (
	[ 'takeover', "SELECT * FROM idem_begin('lapsed', 'f')" ],
	[ 'complete', "SELECT idem_complete('live', 'f', 200, 'x', $live_token)" ],
	[ 'release', "SELECT idem_release('live', $live_token)" ],
	[ 'extend', "SELECT idem_extend('live', $live_token, '5 min')" ],
	[ 'purge', 'SELECT idem_purge()' ])
{
	my ($name, $query) = @$call;
	($ret, $out, $err) = $standby->psql('postgres', "\\set VERBOSITY verbose\n$query");
	like($err, qr/ERROR:  25006:/, "$name on the standby fails with 25006");
}
is( $standby->safe_psql('postgres',
		'SELECT md5(string_agg(k::text, \',\' ORDER BY key)) FROM idem.keys k'),
	$keys_before, 'nothing changed on the standby');
is( $standby->safe_psql('postgres',
		"SELECT claimed, state, status, convert_from(body, 'UTF8') FROM idem_begin('done', 'f')"),
	'f|DONE|201|stored', 'a completed key replays on the standby');
is( $standby->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('done', 'other')"),
	'f|CONFLICT', 'another request with the key is a conflict on the standby');
is( $standby->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('live', 'f')"),
	'f|PROCESSING', 'a claim in flight is reported on the standby');
# The calls of one statement share the transaction's scan of the primary
# key, read-only on the standby too.
is( $standby->safe_psql('postgres', q{
SELECT string_agg(b.state || ':' || coalesce(convert_from(b.body, 'UTF8'), ''), ',' ORDER BY v.n)
  FROM (VALUES (1, 'done', 'f'), (2, 'done', 'other'), (3, 'live', 'f'), (4, 'done', 'f')) v(n, k, fp),
       LATERAL idem_begin(v.k, v.fp) b}),
	'DONE:stored,CONFLICT:,PROCESSING:,DONE:stored',
	'replays, a conflict and a claim in flight in one statement on the standby');

# wait_for on the standby: a duplicate waits for a claim made on the
# primary (looking at the key again every 50 ms, as nothing commits on
# the standby), and replays the response once the primary's completion
# is replayed.
my $wtok = $primary->safe_psql('postgres',
	"SELECT token FROM idem_begin('wait-standby', 'f', lease => '1 hour')");
$primary->wait_for_catchup($standby);
my $swaiter = $standby->background_psql('postgres');
$swaiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, convert_from(body, 'UTF8') AS body
	  FROM idem_begin('wait-standby', 'f', wait_for => '5 min');
});
ok( $standby->poll_query_until('postgres', q{
	SELECT count(*) = 1 FROM pg_stat_activity
	 WHERE query LIKE '%wait-standby%wait_for%' AND state = 'active' AND pid <> pg_backend_pid()}),
	'a duplicate waits on the standby');
$primary->safe_psql('postgres',
	"SELECT idem_complete('wait-standby', 'f', 200, convert_to('from the primary', 'UTF8'), $wtok)");
is($swaiter->query_safe('SELECT 1'), "f|DONE|from the primary\n1",
	'the waiter on the standby replays the response completed on the primary');
$swaiter->quit;

# The launcher runs on the standby and skips its passes.
ok( $standby->poll_query_until('postgres',
		"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idem launcher'",
		'1'),
	'launcher running on the standby');
my $offset = -s $standby->logfile;
$offset = $standby->wait_for_log(qr/no purge pass, recovery is in progress/, $offset);
$standby->wait_for_log(qr/no purge pass, recovery is in progress/, $offset);
is(count_keys($standby, 'old-%'), '40', 'no purge on the standby');
is( $standby->safe_psql('postgres',
		'SELECT coalesce(sum(purge_runs), 0) FROM idem_stats'),
	'0', 'no purge runs counted on the standby');
ok(!$standby->log_contains(qr/background worker "idem purge"/, 0),
	'no purge worker started on the standby');

# Promotion: the same launcher starts purging.
my $launcher = $standby->safe_psql('postgres',
	"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'");
$standby->promote;
ok($standby->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'old-%'", '0'),
	'expired keys purged after promotion');
is(count_keys($standby, 'live'), '1', 'the live key stays');
# The 40 expired keys deleted and the tombstone the primary had left with
# its body rewritten without it: 41 rows purged.
ok( $standby->poll_query_until('postgres',
		"SELECT purge_runs > 0, purged_rows FROM idem_stats WHERE datname = 'postgres'",
		't|41'),
	'idem_stats counts the purge on the promoted server');
is( $standby->safe_psql('postgres', q{
SELECT string_agg(key || ':' || state || ':' || coalesce(body_size::text, 'none'), ',' ORDER BY key)
  FROM idem_keys WHERE key LIKE 'tomb%'}),
	'tomb:EXPIRED:none,tomb-unpurged:EXPIRED:none',
	'the promoted server made a tombstone of the key the primary had not purged');
is( $standby->safe_psql('postgres',
		"SELECT claimed FROM idem_begin('new', 'f')"),
	't', 'idem_begin works after promotion');
is( $standby->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'idem launcher'"),
	$launcher, 'the launcher of the standby carried on after promotion');

# Every key written has its primary key entry (amcheck): on the primary,
# and on the promoted standby, which holds the replicated keys and its own.
idem_amcheck($primary, 'postgres');
idem_amcheck($standby, 'postgres');

$standby->stop;
$primary->stop;
done_testing();
