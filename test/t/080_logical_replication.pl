# Logical replication of idem.keys.  idem.keys is an ordinary table that
# belongs to the extension, so CREATE PUBLICATION ... FOR ALL TABLES
# publishes it, and a subscriber that has run CREATE EXTENSION idem
# subscribes to it like any other table: the initial copy and every later
# claim, complete, release, extend, takeover and purge on the publisher
# arrive as row changes.  The subscriber answers replays from its copy.
#
# What a subscriber does not get: idem.token_seq (PostgreSQL 15 does not
# replicate sequences), and deletions it makes itself are not undone.  So
# a subscriber keeps idem.purge_enabled = off (the publisher's purge
# arrives as deletes), makes no claims while subscribed, and before it
# takes over as the writer moves idem.token_seq past every replicated
# token.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $pub = idem_node('publisher', init => { allows_streaming => 'logical' }, conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
log_min_messages = debug1
}, extension => []);

my $sub = idem_node('subscriber', conf => qq{
idem.purge_enabled = off
}, extension => []);

$_->safe_psql('postgres', 'CREATE EXTENSION idem') for ($pub, $sub);

# Every column of every key, times as microseconds since the epoch.
my $dump_sql = q{
SELECT coalesce(string_agg(concat_ws('|', scope, key, encode(fingerprint, 'hex'),
	token, coalesce(status::text, '-'), coalesce(encode(body, 'hex'), '-'),
	coalesce((extract(epoch FROM lease_until) * 1000000)::bigint::text, '-'),
	(extract(epoch FROM expires_at) * 1000000)::bigint), E'\n' ORDER BY scope, key), '')
FROM idem.keys};

sub keys_of
{
	my ($node) = @_;
	return $node->safe_psql('postgres', $dump_sql);
}

sub states_of
{
	my ($node, $pattern) = @_;
	return $node->safe_psql('postgres', qq{
SELECT count(*) FILTER (WHERE status IS NULL) || ' processing, '
	|| count(*) FILTER (WHERE status IS NOT NULL) || ' done'
FROM idem.keys WHERE key LIKE '$pattern'});
}

# Keys that exist before the subscription: a stored response, a claim in
# flight, and one in another scope.
$pub->safe_psql('postgres', q{
SELECT count(*) FROM idem_begin('pre-done', 'f');
SELECT idem_complete('pre-done', 'f', 201, '\x00ff'::bytea,
	(SELECT token FROM idem.keys WHERE key = 'pre-done'));
SELECT count(*) FROM idem_begin('pre-open', 'f', lease => '1h');
SELECT count(*) FROM idem_begin('pre-done', 'f', scope => 'tenant-b');
});

$pub->safe_psql('postgres', 'CREATE PUBLICATION idem_pub FOR ALL TABLES');
is( $pub->safe_psql('postgres',
		"SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = 'idem_pub'"),
	'idem.keys', 'FOR ALL TABLES publishes the extension table idem.keys');
is( $pub->safe_psql('postgres', q{
SELECT relreplident, (SELECT count(*) FROM pg_index WHERE indrelid = c.oid AND indisprimary)
FROM pg_class c WHERE oid = 'idem.keys'::regclass}),
	'd|1', 'its replica identity is the primary key (updates and deletes replicate)');

my $pub_connstr = $pub->connstr . ' dbname=postgres';
$sub->safe_psql('postgres',
	"CREATE SUBSCRIPTION idem_sub CONNECTION '$pub_connstr' PUBLICATION idem_pub");
$sub->wait_for_subscription_sync($pub, 'idem_sub');

my $pre = keys_of($pub);
is(scalar(split /\n/, $pre), 3, 'three keys on the publisher before subscribing');
is(keys_of($sub), $pre, 'the initial copy brings every key, byte for byte');

# --- Claims, completes, release and extend on the publisher.
$pub->safe_psql('postgres', q{
-- one transaction: claim and response together
BEGIN;
SELECT count(*) FROM generate_series(1, 20) g, idem_begin('tx-' || g, 'f' || g);
SELECT count(*) FROM generate_series(1, 20) g,
	idem_complete('tx-' || g, 'f' || g, 200, ('body-' || g)::bytea);
COMMIT;
-- claim, then complete with the token in a later transaction
SELECT count(*) FROM generate_series(1, 10) g, idem_begin('two-' || g, 'f', lease => '10min');
SELECT count(*) FROM idem.keys k,
	idem_complete(k.key, 'f', 202, 'later', k.token)
WHERE k.key IN ('two-1', 'two-2', 'two-3', 'two-4', 'two-5');
-- release two claims, extend one
SELECT idem_release('two-6', (SELECT token FROM idem.keys WHERE key = 'two-6'));
SELECT idem_release('two-7', (SELECT token FROM idem.keys WHERE key = 'two-7'));
SELECT count(*) FROM idem_extend('two-8', (SELECT token FROM idem.keys WHERE key = 'two-8'), '20min');
-- a rolled-back claim leaves nothing
BEGIN;
SELECT count(*) FROM idem_begin('rolled-back', 'f');
ROLLBACK;
});
$pub->wait_for_catchup('idem_sub');

is(states_of($sub, 'tx-%'), '0 processing, 20 done',
	'one-transaction claims arrive completed');
is(states_of($sub, 'two-%'), '3 processing, 5 done',
	'two-step claims arrive; released ones are deleted');
is( $sub->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE key = 'rolled-back'"),
	'0', 'a rolled-back claim never reaches the subscriber');
is( $sub->safe_psql('postgres', q{
SELECT lease_until - (SELECT lease_until FROM idem.keys WHERE key = 'two-9') > '9min'
FROM idem.keys WHERE key = 'two-8'}),
	't', 'the extended lease arrives');
is(keys_of($sub), keys_of($pub), 'subscriber and publisher hold the same keys');

# The subscriber answers replays and conflicts from its copy (reads only).
is( $sub->safe_psql('postgres',
		"SELECT claimed, state, status, encode(body, 'escape') FROM idem_begin('tx-7', 'f7')"),
	'f|DONE|200|body-7', 'a replay on the subscriber returns the stored response');
is( $sub->safe_psql('postgres',
		"SELECT claimed, state, token IS NULL, body IS NULL FROM idem_begin('tx-7', 'other')"),
	'f|CONFLICT|t|t', 'a conflict on the subscriber reveals nothing');

# --- Takeover after the lease, and the stale holder refused, on the publisher.
my $old = $pub->safe_psql('postgres', "SELECT token FROM idem.keys WHERE key = 'two-9'");
my $new = $pub->safe_psql('postgres', q{
SET idem.clock_offset = '15min';
SELECT token FROM idem_begin('two-9', 'f') WHERE claimed});
cmp_ok($new, '>', $old, 'takeover on the publisher with a greater token');
my ($ret, $out, $err) = $pub->psql('postgres',
	"\\set VERBOSITY verbose\nSELECT idem_complete('two-9', 'f', 200, 'stale', $old)");
like($err, qr/ERROR:  ID002:/, 'the stale holder is refused (ID002)');
$pub->wait_for_catchup('idem_sub');
is( $sub->safe_psql('postgres', "SELECT token, status FROM idem.keys WHERE key = 'two-9'"),
	"$new|", 'the subscriber sees the new holder');

# --- Purge on the publisher: explicit, then by the background worker.
$pub->safe_psql('postgres', q{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM generate_series(1, 30) g,
	idem_begin('old-' || g, 'f', lease => '1s', retention => '1s');
});
$pub->wait_for_catchup('idem_sub');
is($sub->safe_psql('postgres', "SELECT count(*) FROM idem.keys WHERE key LIKE 'old-%'"),
	'30', 'expired keys reach the subscriber');
is($pub->safe_psql('postgres', 'SELECT idem_purge(10)'), '10', 'idem_purge(10) on the publisher');
$pub->wait_for_catchup('idem_sub');
is($sub->safe_psql('postgres', "SELECT count(*) FROM idem.keys WHERE key LIKE 'old-%'"),
	'20', 'the purged rows are deleted on the subscriber');

$pub->safe_psql('postgres',
	'ALTER SYSTEM SET idem.purge_enabled = on; SELECT pg_reload_conf()');
ok( $pub->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'old-%'", '0'),
	'the purge worker deletes the rest on the publisher');
# Purge off again, and no purge worker left that started before.
my $offset = -s $pub->logfile;
$pub->safe_psql('postgres',
	'ALTER SYSTEM SET idem.purge_enabled = off; SELECT pg_reload_conf()');
$pub->wait_for_log(qr/idem launcher: configuration reloaded: purge_enabled off/, $offset);
$pub->poll_query_until('postgres',
	"SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idem purge'", '0')
  or die 'a purge worker is still running on the publisher';
$pub->wait_for_catchup('idem_sub');
is($sub->safe_psql('postgres', "SELECT count(*) FROM idem.keys WHERE key LIKE 'old-%'"),
	'0', 'and those deletes arrive too');
is(keys_of($sub), keys_of($pub), 'subscriber and publisher still hold the same keys');

# Claims keep working on the publisher after the purge.
is( $pub->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('after-purge', 'f')"),
	't|PROCESSING', 'a claim on the publisher after the purge');

# --- Why the subscriber must not purge by itself: a key it deleted stays
# missing when the publisher re-claims it (the UPDATE finds no row there).
$pub->safe_psql('postgres', q{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM idem_begin('diverge', 'f', lease => '1s', retention => '1s');
});
$pub->wait_for_catchup('idem_sub');
is($sub->safe_psql('postgres', 'SELECT idem_purge()'), '1',
	'idem_purge() on the subscriber deletes its copy of the expired key');
$pub->safe_psql('postgres', "SELECT count(*) FROM idem_begin('diverge', 'g')");
$pub->safe_psql('postgres', "SELECT count(*) FROM idem_begin('after-diverge', 'f')");
$pub->wait_for_catchup('idem_sub');
is( $sub->safe_psql('postgres',
		"SELECT count(*) FILTER (WHERE key = 'diverge'), count(*) FILTER (WHERE key = 'after-diverge') FROM idem.keys"),
	'0|1', 'the re-claim is lost on the subscriber while later claims arrive');
$pub->safe_psql('postgres', "SELECT idem_release('diverge', (SELECT token FROM idem.keys WHERE key = 'diverge'))");

# --- The token sequence is not replicated.
is( $sub->safe_psql('postgres', 'SELECT last_value, is_called FROM idem.token_seq'),
	'1|f', 'the subscriber\'s idem.token_seq is untouched by replication');

# Taking over as the writer: stop subscribing, move the sequence past every
# replicated token; then a takeover gives a greater token than the old one.
$pub->wait_for_catchup('idem_sub');
$sub->safe_psql('postgres', 'DROP SUBSCRIPTION idem_sub');
my $max_token = $sub->safe_psql('postgres', 'SELECT max(token) FROM idem.keys');
$sub->safe_psql('postgres',
	"SELECT setval('idem.token_seq', (SELECT max(token) FROM idem.keys))");
my $held = $sub->safe_psql('postgres', "SELECT token FROM idem.keys WHERE key = 'two-10'");
my $taken = $sub->safe_psql('postgres', q{
SET idem.clock_offset = '1h';
SELECT token FROM idem_begin('two-10', 'f') WHERE claimed});
cmp_ok($taken, '>', $max_token,
	'after setval, a takeover on the former subscriber gets a token above every replicated one');
cmp_ok($held, '<', $taken, 'and above the old holder\'s');
is( $sub->safe_psql('postgres',
		"SELECT claimed, state, status, encode(body, 'escape') FROM idem_begin('pre-done', 'f')"),
	'f|DONE|201|\\000\\377', 'the initially copied response still replays');

# Every key written has its primary key entry (amcheck): on the publisher,
# and on the former subscriber, which holds the replicated keys and its own.
idem_amcheck($pub, 'postgres');
idem_amcheck($sub, 'postgres');

$sub->stop;
$pub->stop;
done_testing();
