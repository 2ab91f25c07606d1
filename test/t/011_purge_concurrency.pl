# The background purge never deletes a key that is being re-claimed and
# never blocks a claim: it skips rows locked by an uncommitted re-claim, and
# a purge of 200000 expired keys runs while claims keep succeeding.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

# Batches of 1000 rows: the purge of 200000 keys takes 200 transactions,
# long enough for many rounds of claims to run while it is under way; not
# paced (test 028 covers idem.purge_rate_limit), so that it takes seconds.
my $node = idem_node('concurrency', conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
idem.purge_batch_size = 1000
idem.purge_rate_limit = 0
});

sub set_purge
{
	my ($on) = @_;
	$node->safe_psql('postgres',
		"ALTER SYSTEM SET idem.purge_enabled = $on; SELECT pg_reload_conf()");
}

sub purge_runs
{
	return $node->safe_psql('postgres',
		"SELECT coalesce(sum(purge_runs), 0) FROM idem_stats WHERE datname = 'postgres'");
}

# --- An uncommitted re-claim of an expired key, and one that rolls back.
$node->safe_psql('postgres', q{
SET idem.clock_offset = '-1h';
SELECT count(*) FROM idem_begin('held', 'old', lease => '1s', retention => '1s');
SELECT count(*) FROM idem_begin('dropped', 'old', lease => '1s', retention => '1s');
});

my $holder = $node->background_psql('postgres');
my $token = $holder->query_safe(
	"BEGIN; SELECT token FROM idem_begin('held', 'new', lease => '1 hour') WHERE claimed");
like($token, qr/^\d+$/, 're-claim of the expired key is held uncommitted');
my $roller = $node->background_psql('postgres');
$roller->query_safe(
	"BEGIN; SELECT token FROM idem_begin('dropped', 'new') WHERE claimed");

set_purge('on');
my $runs = purge_runs();
ok($node->poll_query_until('postgres', 'SELECT ' . purge_runs_sql() . " >= $runs + 2"),
	'purge passes complete while the re-claims are uncommitted');
is( $node->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE key IN ('held', 'dropped')"),
	'2', 'both locked keys survive the purge passes');

$holder->query_safe('COMMIT');
$holder->quit;
$roller->query_safe('ROLLBACK');
$roller->quit;

ok($node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key = 'dropped'", '0'),
	'the key whose re-claim rolled back is purged afterwards');
$runs = purge_runs();
ok($node->poll_query_until('postgres', 'SELECT ' . purge_runs_sql() . " >= $runs + 1"),
	'another purge pass completes');
is( $node->safe_psql('postgres',
		"SELECT token, status IS NULL, expires_at > now() FROM idem.keys WHERE key = 'held'"),
	"$token|t|t", 'the committed re-claim is intact, with its token');
is( $node->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('held', 'new', wait => false)"),
	'f|PROCESSING', 'and is in flight for everyone else');

# --- 200000 expired keys, purged while claims run.
set_purge('off');
$node->safe_psql('postgres', q{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
SELECT '', 'bulk-' || g, sha256('f'), nextval('idem.token_seq'), 200, 'x',
	now() - interval '1 hour'
FROM generate_series(1, 200000) g;
SELECT idem_stats_reset();
});
is( $node->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE expires_at < now()"),
	'200000', '200000 expired keys in place');

my $client = $node->background_psql('postgres');
set_purge('on');

# Each round: claim a new key, re-claim one of the expired keys, and see
# how many expired keys are left.
my ($rounds, $during, $bad) = (0, 0, 0);
my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
while (time() < $deadline)
{
	$rounds++;
	my $out = $client->query_safe(qq{
SELECT (SELECT claimed FROM idem_begin('fresh-$rounds', 'f'))
	AND (SELECT claimed FROM idem_begin('bulk-$rounds', 'again')),
	(SELECT count(*) FROM idem.keys WHERE expires_at < now())});
	my ($ok, $left) = split /\|/, $out;
	$bad++ unless $ok eq 't';
	$during++ if $left > 0 && $left < 200000 - $rounds;
	last if $left == 0;
}
$client->quit;

note "$rounds rounds, $during of them while the purge was under way";
is($bad, 0, "all $rounds rounds of claims succeeded");
cmp_ok($during, '>', 0, 'some claims ran while the purge was under way');
is( $node->safe_psql('postgres',
		"SELECT count(*) FROM idem.keys WHERE expires_at < now()"),
	'0', 'all expired keys purged');
is( $node->safe_psql('postgres', qq{
SELECT count(*) FILTER (WHERE key LIKE 'fresh-%'),
	count(*) FILTER (WHERE key LIKE 'bulk-%'),
	count(*) FILTER (WHERE key LIKE 'bulk-%' AND fingerprint = sha256('again'))
FROM idem.keys}),
	"$rounds|$rounds|$rounds",
	'every claimed and re-claimed key survived; every other expired key is gone');
is( $node->safe_psql('postgres',
		"SELECT claims, purged_rows BETWEEN 200000 - $rounds AND 200000"
		  . " FROM idem_stats WHERE datname = 'postgres'"),
	(2 * $rounds) . '|t', 'idem_stats counts every claim and the purged rows');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();

sub purge_runs_sql
{
	return "(SELECT coalesce(sum(purge_runs), 0) FROM idem_stats WHERE datname = 'postgres')";
}
