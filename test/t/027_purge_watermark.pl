# The purge worker skips a pass when no key can have expired yet, without
# reading the table, and otherwise reads only the ranges of blocks where
# one can have: every write of a key lowers a watermark in shared memory
# to the key's expiry, for the table and for the key's range of blocks,
# and a pass raises those of what it read to the least expiry it left.  Keys written while passes run are still
# purged once they expire; INSERT, UPDATE and COPY into the table make the
# watermark unknown.
use strict;
use warnings;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

my $node = idem_node('watermark', conf => q{
idem.purge_naptime = 1
log_min_messages = debug1
});

# Worker passes that read the table log one "purge batch" line per batch.
my $batch_line = qr/idem purge batch of "keys"/;

sub batches_since
{
	my ($offset) = @_;
	my @lines = slurp_file($node->logfile, $offset) =~ /$batch_line/g;
	return scalar @lines;
}

# Pages read by the worker's batches since offset, the table's pages as
# the last of them saw it, and the number of batches.
sub pages_read_since
{
	my ($offset) = @_;
	my ($read, $of, $n) = (0, 0, 0);
	for my $line (split /\n/, slurp_file($node->logfile, $offset))
	{
		next unless $line =~ /$batch_line: blocks \d+ to \d+ of (\d+), (\d+) read/;
		$of = $1;
		$read += $2;
		$n++;
	}
	return ($read, $of, $n);
}

# Store a response for the claimed key with a retention that has already
# run out, and wait until the worker has purged it.
sub complete_expired
{
	my ($key, $what) = @_;
	$node->safe_psql('postgres', qq{
SET idem.clock_offset = '-2d';
SELECT idem_complete('$key', 'f', 200, '\\x7b7d',
	(SELECT token FROM idem.keys WHERE key = '$key'), retention => '1s') IS NOT NULL;
});
	ok($node->poll_query_until('postgres',
			"SELECT count(*) FROM idem.keys WHERE key = '$key'", '0'), $what);
}

sub purge_runs
{
	return $node->safe_psql('postgres',
		"SELECT purge_runs FROM idem_stats WHERE datname = current_database()");
}

# Wait until the worker has finished n more passes over this database.
sub wait_passes
{
	my ($n) = @_;
	my $target = purge_runs() + $n;
	ok( $node->poll_query_until('postgres',
			"SELECT purge_runs >= $target FROM idem_stats WHERE datname = current_database()"),
		"$n more purge passes");
}

# 20000 live keys (expiring in a day).
my $offset = -s $node->logfile;
$node->safe_psql('postgres', q{
SELECT count(*) FROM generate_series(1, 20000) g, idem_begin('live-' || g, 'f');
});

# The first passes after the start read the table: the watermark is not
# known after a start until a pass has read what is there.
wait_passes(2);
cmp_ok(batches_since($offset), '>', 0, 'a pass read the table');
my ($read, $of, $nbatches) = pages_read_since($offset);
ok($nbatches > 0 && $read >= $of,
	"the first passes read every page ($read pages read, table of $of)");

# From then on, passes find nothing to read.
$offset = -s $node->logfile;
wait_passes(3);
is(batches_since($offset), 0, 'three passes skipped the table: nothing expired');

# A key written with an expiry in the past lowers the watermark: the next
# pass reads the table and deletes it, and only it.
$node->safe_psql('postgres', q{
SET idem.clock_offset = '-2d';
SELECT claimed FROM idem_begin('old-1', 'f', lease => '1s', retention => '1s');
});
ok($node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key = 'old-1'", '0'),
	'the expired key is purged');
is($node->safe_psql('postgres', 'SELECT count(*) FROM idem.keys'),
	'20000', 'the live keys stay');

# A completion that shortens a key's life lowers it too: a key claimed
# for a day, passes that skip, then its response stored with a retention
# that has already run out.
$node->safe_psql('postgres', q{
SELECT claimed FROM idem_begin('old-2', 'f', lease => '1h');
});
wait_passes(2);
$offset = -s $node->logfile;
wait_passes(1);
is(batches_since($offset), 0, 'passes skip the table while old-2 is in flight');
complete_expired('old-2', 'a key completed with an expiry in the past is purged');

# A pass reads only the ranges of blocks where a key can have expired:
# a key in the middle of the table completed with an expiry in the past
# is purged by a pass that reads a few of the table's pages.
my $pages = $node->safe_psql('postgres',
	"SELECT pg_relation_size('idem.keys') / current_setting('block_size')::int");
my $mid = $node->safe_psql('postgres',
	"SELECT (ctid::text::point)[0] FROM idem.keys WHERE key = 'live-10000'");
cmp_ok($mid, '>', $pages / 4, "live-10000 is in the middle of the table (block $mid of $pages)");
$offset = -s $node->logfile;
complete_expired('live-10000', 'the key in the middle of the table is purged');
($read, $of, $nbatches) = pages_read_since($offset);
ok($nbatches > 0 && $read > 0 && $read < $pages / 8,
	"the passes since read $read of the table's $pages pages in $nbatches batches");
is($node->safe_psql('postgres', "SELECT count(*) FROM idem.keys WHERE key LIKE 'live-%'"),
	'19999', 'the other live keys stay');

# Keys written while passes run: four clients claim short-lived keys for
# ten seconds, a pass a second.  Once the writes stop and the keys
# expire, every one of them is purged by the worker: a write missed by the
# watermark would leave its key for the full-pass interval (an hour).
my $dir = PostgreSQL::Test::Utils::tempdir();
PostgreSQL::Test::Utils::append_to_file("$dir/churn.sql", q{
\set k random(1, 1000000)
SELECT claimed FROM idem_begin('churn-' || :client_id || '-' || :k, 'f', lease => '1s', retention => '2s');
});
my ($out, $err) = ('', '');
my $h = IPC::Run::start(
	[
		'pgbench', '-n', '-c', 4, '-j', 2, '-T', 10, '-f', "$dir/churn.sql",
		'-h', $node->host, '-p', $node->port, 'postgres'
	],
	'>', \$out, '2>', \$err);
$h->finish;
is($h->result(0), 0, 'pgbench wrote keys while the worker purged')
  or diag $err;
my $churned = $node->safe_psql('postgres',
	"SELECT count(*) FROM idem.keys WHERE key LIKE 'churn-%'");
note "$churned churn keys left when the writes stopped";
ok( $node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key LIKE 'churn-%'", '0'),
	'every key written during the passes is purged once expired');

# Rows written by plain SQL (INSERT, UPDATE, a writable CTE, COPY) make
# the watermark unknown when the statement ends: the next pass reads the
# table and deletes what expired.  A DELETE does not.
my @sql = (
	[ 'INSERT', q{
INSERT INTO idem.keys (scope, key, fingerprint, token, status, body, expires_at)
VALUES ('', 'sql-1', sha256('f'), 0, 200, '\x7b7d', now() - interval '1 hour');}, 'sql-1' ],
	[ 'UPDATE', q{
UPDATE idem.keys SET expires_at = now() - interval '1 hour' WHERE key = 'live-1';}, 'live-1' ],
	[ 'a writable CTE', q{
WITH u AS (UPDATE idem.keys SET expires_at = now() - interval '1 hour'
           WHERE key = 'live-2' RETURNING key)
SELECT count(*) FROM u;}, 'live-2' ],
	[ 'COPY',
		"COPY idem.keys (scope, key, fingerprint, token, status, body, expires_at) FROM STDIN;\n"
		  . join("\t", '', 'copy-1', '\\\\x00', '0', '200', '\\\\x7b7d', '2000-01-01 00:00:00+00')
		  . "\n\\.\n",
		'copy-1' ]);
for my $case (@sql)
{
	my ($what, $stmt, $key) = @$case;
	wait_passes(2);
	$offset = -s $node->logfile;
	wait_passes(1);
	is(batches_since($offset), 0, "before the $what, passes skip the table");
	$node->safe_psql('postgres', $stmt);
	ok( $node->poll_query_until('postgres',
			"SELECT count(*) FROM idem.keys WHERE key = '$key'", '0'),
		"after the $what, a pass reads the table and purges $key");
}
# Settle first, as for the statements above: the pass that purged the
# COPY's key may log its batch after the key is seen gone.
wait_passes(2);
$offset = -s $node->logfile;
wait_passes(1);
is(batches_since($offset), 0, "before the DELETE, passes skip the table");
$offset = -s $node->logfile;
$node->safe_psql('postgres', "DELETE FROM idem.keys WHERE key = 'live-3'");
wait_passes(2);
is(batches_since($offset), 0, 'after a DELETE, passes still skip the table');

# VACUUM FULL and CLUSTER move rows to other blocks without noting their
# expiry there: the next pass reads every page.
for my $rewrite ('VACUUM FULL idem.keys', 'CLUSTER idem.keys USING keys_pkey')
{
	$offset = -s $node->logfile;
	$node->safe_psql('postgres', $rewrite);
	wait_passes(2);
	($read, $of, $nbatches) = pages_read_since($offset);
	ok($nbatches > 0 && $read >= $of,
		"after $rewrite, a pass reads every page ($read pages read, table of $of)");
}
wait_passes(1);
$offset = -s $node->logfile;
$node->safe_psql('postgres', 'VACUUM idem.keys');
wait_passes(2);
is(batches_since($offset), 0, 'after a plain VACUUM, passes still skip the table');
is($node->safe_psql('postgres', 'SELECT count(*) FROM idem.keys'),
	'19996', 'the other live keys stay');

# A pass with nothing to read still opens the table: an index idem does
# not maintain, added while passes skip, is reported in idem_stats.
$node->safe_psql('postgres', 'CREATE INDEX keys_extra ON idem.keys (expires_at)');
ok( $node->poll_query_until('postgres', q{
SELECT last_purge_error LIKE '%"keys_extra", which idem does not maintain'
  FROM idem_stats WHERE datname = current_database()}),
	'a pass with nothing expired reports a table idem cannot use');
$node->safe_psql('postgres', 'DROP INDEX idem.keys_extra');

# A key claimed with an expiry in the past by a transaction still open:
# passes read the table but cannot delete it (nobody else sees it yet);
# they must not raise the watermark past it, so that it is purged once
# committed, without any further write.
my $pending = $node->background_psql('postgres');
$pending->query_safe(q{
SET idem.clock_offset = '-2d';
BEGIN;
SELECT claimed FROM idem_begin('pending-1', 'f', lease => '1s', retention => '1s');
});
$offset = -s $node->logfile;
wait_passes(3);
cmp_ok(batches_since($offset), '>=', 3, 'passes read the table while the claim is open');
$pending->query_safe('COMMIT');
$pending->quit;
ok( $node->poll_query_until('postgres',
		"SELECT count(*) FROM idem.keys WHERE key = 'pending-1'", '0'),
	'the key committed after those passes is purged');

# After a restart the watermark is not known: the first pass reads.
$offset = -s $node->logfile;
$node->restart;
wait_passes(1);
cmp_ok(batches_since($offset), '>', 0, 'the first pass after a restart reads the table');

$node->stop;
done_testing();
