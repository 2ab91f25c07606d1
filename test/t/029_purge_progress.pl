# The background worker's purge makes progress over the whole table:
#
# 1. A paced pass goes on at the next visit where the last one stopped.
#    Keys at the front of the table expire, in reverse physical order,
#    faster than idem.purge_rate_limit lets the worker delete them; keys
#    at the tail expired an hour ago.  A worker that started each visit at
#    block 0 would spend every visit at the front and reach the tail only
#    once the front stopped expiring; the pass that goes on reaches the
#    tail while front keys are still expiring.
# 2. A rewrite of the table (ALTER TABLE ... SET UNLOGGED then SET LOGGED,
#    ALTER COLUMN ... TYPE, VACUUM FULL, CLUSTER) moves keys to blocks
#    whose range of the expiry map says nothing expires there soon: the
#    map is of the old file, so the next pass reads the whole table and
#    purges them.
# 3. The hourly full pass is scheduled by the server's clock:
#    idem.clock_offset two hours ahead does not make every pass read the
#    table again while nothing has expired.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

# naptime 1 s: the visit deadline is its 5 s floor.
my $node = idem_node('progress', conf => qq{
idem.purge_naptime = 1
idem.purge_enabled = off
idem.purge_batch_size = 20
idem.purge_rate_limit = 20
});

sub set_conf
{
	$node->safe_psql('postgres',
		join('', map { "ALTER SYSTEM SET $_;\n" } @_)
		  . 'SELECT pg_reload_conf();');
}

# SQL adding n keys named prefix-1 .. prefix-n, key i expiring at the
# expression expiry (of g, the key's number).
sub rows
{
	my ($prefix, $n, $expiry) = @_;
	return qq{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
SELECT '', '$prefix-' || g, sha256('f'), nextval('idem.token_seq'), 200, 'x', $expiry
FROM generate_series(1, $n) g ORDER BY g};
}

sub count_of
{
	my ($where) = @_;
	return $node->safe_psql('postgres', "SELECT count(*) FROM idem.keys WHERE $where");
}

# --- 1. A paced pass goes on at the next visit.
# 6000 front keys, the last one expiring first, one every 20 ms (50 a
# second against the worker's 20): the last 300 have expired already,
# more than a visit of 5 s deletes, and the others expire over two
# minutes.  Then 100 tail keys that expired an hour ago.
$node->safe_psql('postgres',
	rows('front', 6000, q{clock_timestamp() - interval '6 s' + (6000 - g) * interval '20 ms'})
	  . ";\n" . rows('tail', 100, q{now() - interval '1 hour'}));
is($node->safe_psql('postgres', q{
	SELECT max(ctid) FILTER (WHERE key LIKE 'front-%') < min(ctid) FILTER (WHERE key LIKE 'tail-%')
	  FROM idem.keys}), 't', 'the tail keys lie after the front keys');
set_conf('idem.purge_enabled = on');
# Done once the tail is purged, or once no front key is left to expire.
$node->poll_query_until('postgres', q{
	SELECT count(*) FILTER (WHERE key LIKE 'tail-%') = 0
	    OR count(*) FILTER (WHERE key LIKE 'front-%' AND expires_at > clock_timestamp()) = 0
	  FROM idem.keys}) or die 'the purge made no progress';
my $unexpired = count_of(q{key LIKE 'front-%' AND expires_at > clock_timestamp()});
is(count_of(q{key LIKE 'tail-%'}), '0', 'the tail keys are purged');
cmp_ok($unexpired, '>', 0,
	"while front keys were still expiring ($unexpired left to expire): the pass went on past the front");
set_conf('idem.purge_enabled = off');
$node->safe_psql('postgres', 'TRUNCATE idem.keys');

# --- 2. Rewrites of the table.
# Wait for a worker pass that read the whole table to end, once the
# purge runs counted reach n.
sub runs
{
	return $node->safe_psql('postgres',
		q{SELECT purge_runs FROM idem_stats WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())});
}

sub wait_runs
{
	my ($n) = @_;
	$node->poll_query_until('postgres', qq{
		SELECT purge_runs >= $n FROM idem_stats
		 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())})
	  or die "purge runs did not reach $n";
}

my @rewrites = (
	'ALTER TABLE idem.keys SET UNLOGGED; ALTER TABLE idem.keys SET LOGGED',
	q{ALTER TABLE idem.keys ALTER COLUMN phase_data TYPE bytea USING phase_data || ''::bytea},
	'VACUUM FULL idem.keys',
	'CLUSTER idem.keys USING keys_pkey');
set_conf('idem.purge_rate_limit = 0', 'idem.purge_batch_size = 1000');
foreach my $rewrite (@rewrites)
{
	# Keys that expire in a day fill the front of the table, keys that
	# expire in 5 s its tail; a pass that reads the whole table sizes the
	# map's ranges and marks the front's far off.
	$node->safe_psql('postgres', 'TRUNCATE idem.keys');
	$node->safe_psql('postgres',
		rows('live', 3000, q{now() + interval '1 day'}) . ";\n"
		  . rows('soon', 200, q{clock_timestamp() + interval '5 s'}));
	set_conf('idem.purge_enabled = on');
	my $n = runs();
	wait_runs($n + 2);
	set_conf('idem.purge_enabled = off');
	is(count_of(q{key LIKE 'soon-%'}), '200', "before: the soon keys are there ($rewrite)");

	# A plain DELETE leaves the map as it is; the rewrite moves the soon
	# keys to the front blocks.
	$node->safe_psql('postgres', "DELETE FROM idem.keys WHERE key LIKE 'live-%'");
	my $before = $node->safe_psql('postgres', q{SELECT pg_relation_filenode('idem.keys')});
	$node->safe_psql('postgres', $rewrite);
	isnt($node->safe_psql('postgres', q{SELECT pg_relation_filenode('idem.keys')}),
		$before, "the table has another file ($rewrite)");
	is($node->safe_psql('postgres', q{SELECT min(ctid) FROM idem.keys}), '(0,1)',
		"the soon keys moved to the front ($rewrite)");
	$node->poll_query_until('postgres', q{
		SELECT max(expires_at) < now() FROM idem.keys}) or die 'the keys did not expire';
	set_conf('idem.purge_enabled = on');
	$node->poll_query_until('postgres', q{SELECT count(*) = 0 FROM idem.keys})
	  or diag("keys left after $rewrite: " . count_of('true'));
	is(count_of('true'), '0', "after $rewrite the expired keys are purged");
	set_conf('idem.purge_enabled = off');
}

# --- 3. idem.clock_offset two hours ahead.
$node->safe_psql('postgres', rows('far', 3000, q{now() + interval '1 day'}));
set_conf('idem.clock_offset = 7200', 'idem.purge_enabled = on');
my $n = runs();
wait_runs($n + 3);
# The watermark is known now: later passes are skipped without reading.
$node->safe_psql('postgres', 'SELECT pg_stat_reset()');
my $reset = runs();
wait_runs($reset + 5);
set_conf('idem.purge_enabled = off');
$node->safe_psql('postgres', 'SELECT pg_stat_force_next_flush()');
is($node->safe_psql('postgres', q{
	SELECT coalesce(heap_blks_read, 0) + coalesce(heap_blks_hit, 0)
	  FROM pg_statio_user_tables WHERE relid = 'idem.keys'::regclass}),
	'0', 'with the clock two hours ahead, five passes over unexpired keys read no block');
is(count_of(q{key LIKE 'far-%'}), '3000', 'and deleted nothing');

$node->stop;
done_testing();
