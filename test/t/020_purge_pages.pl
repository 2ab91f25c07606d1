# Purge batches are bounded by pages as well as rows, and read through a
# ring of buffers: a table with few expired rows is walked in many short
# transactions, and a pass over a table larger than a quarter of
# shared_buffers leaves the rest of the cache alone.
use strict;
use warnings;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $batch_pages = 1024;    # IDEM_PURGE_BATCH_PAGES

# 16 MB of shared buffers: 2048 buffers, so a sequential scan of more than
# 512 pages uses the ring.
my $node = idem_node('pages', conf => q{
shared_buffers = 16MB
idem.purge_enabled = off
idem.purge_naptime = 1
log_min_messages = debug1
});
$node->safe_psql('postgres', 'CREATE EXTENSION pg_buffercache');

# 100000 live keys with 200-byte bodies (about 3400 pages), and ten
# expired ones spread over the table, the last in its last page.
$node->safe_psql('postgres', q{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
SELECT '', 'k-' || i, sha256(i::text::bytea), i, 200, convert_to(repeat('x', 200), 'UTF8'),
       CASE WHEN i % 10000 = 0 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END
  FROM generate_series(1, 100000) i;
VACUUM (FREEZE) idem.keys;
CHECKPOINT;
});
my $nblocks = $node->safe_psql('postgres',
	"SELECT pg_relation_size('idem.keys') / current_setting('block_size')::int");
my $batches = int(($nblocks + $batch_pages - 1) / $batch_pages);
ok($nblocks > 3 * $batch_pages, "the table has $nblocks pages");
is( $node->safe_psql('postgres',
		"SELECT max(ctid) >= format('(%s,0)', $nblocks - 1)::tid FROM idem.keys WHERE expires_at < now()"),
	't', 'an expired key is in the last page');

# A cold cache: restart.
$node->restart;

# One pass of idem_purge(): one batch per $batch_pages pages, covering the
# table block after block; the ten expired keys and only they are deleted.
my ($stdout, $stderr);
$node->psql('postgres', 'SET client_min_messages = debug1; SELECT idem_purge()',
	stdout => \$stdout, stderr => \$stderr, on_error_die => 1);
is($stdout, '10', 'idem_purge() deleted the ten expired keys');
my @ranges = $stderr =~ /idem purge batch of "keys": blocks (\d+) to (\d+) of \d+, \d+ read, \d+ rows deleted/g;
my @pairs;
push @pairs, [ splice(@ranges, 0, 2) ] while @ranges;
is(scalar @pairs, $batches, "$batches batches of at most $batch_pages pages");
my $next = 0;
my $contiguous = 1;
for my $p (@pairs)
{
	$contiguous = 0
	  if $p->[0] != $next || $p->[1] - $p->[0] + 1 > $batch_pages;
	$next = $p->[1] + 1;
}
ok($contiguous && $next == $nblocks,
	'the batches cover every page once, in order');

# The pass read through rings of buffers (one per batch, 32 buffers at
# these settings), not through all of shared_buffers: without them the
# pass would leave about 2000 of the table's pages cached.
my $cached = $node->safe_psql('postgres', q{
SELECT count(*) FROM pg_buffercache
 WHERE relfilenode = pg_relation_filenode('idem.keys')
   AND reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database())});
cmp_ok($cached, '<', 64 * ($batches + 1),
	"the pass left $cached of the table's $nblocks pages in shared_buffers");
is( $node->safe_psql('postgres',
		'SELECT count(*), count(*) FILTER (WHERE expires_at < now()) FROM idem.keys'),
	'99990|0', 'the live keys stay');

# idem_purge(n) goes on across page-bounded batches that delete nothing.
$node->safe_psql('postgres', q{
UPDATE idem.keys SET expires_at = now() - interval '1 hour'
 WHERE key IN ('k-1', 'k-99999');
});
is($node->safe_psql('postgres', 'SELECT idem_purge(1)'), '1',
	'idem_purge(1) deletes one key');
is($node->safe_psql('postgres', 'SELECT idem_purge(1)'), '1',
	'the next idem_purge(1) finds the other, pages later');
is($node->safe_psql('postgres', 'SELECT idem_purge(1)'), '0',
	'and then none');

# The purge worker walks the whole table too, batch after batch.
$node->safe_psql('postgres', q{
UPDATE idem.keys SET expires_at = now() - interval '1 hour'
 WHERE key IN ('k-2', 'k-50001', 'k-99998');
});
my $offset = -s $node->logfile;
$node->safe_psql('postgres',
	'ALTER SYSTEM SET idem.purge_enabled = on; SELECT pg_reload_conf()');
ok( $node->poll_query_until('postgres',
		'SELECT count(*) FROM idem.keys WHERE expires_at < now()', '0'),
	'the worker deletes expired keys at the start, middle and end');
ok( $node->wait_for_log(
		qr/idem purge: deleted 3 expired keys from database "postgres" in (\d+) transaction/,
		$offset),
	'the worker logs its pass');
my ($txns) = slurp_file($node->logfile, $offset) =~
  /idem purge: deleted 3 expired keys from database "postgres" in (\d+) transaction/;
cmp_ok($txns, '>=', $batches, "in $txns transactions, one per batch at least");

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
