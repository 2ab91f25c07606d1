# REINDEX CONCURRENTLY, which operators run against a bloated index, under
# claims.
#
# 1. Four clients claim and complete new keys while the primary key is
#    rebuilt concurrently, over and over: no call fails (idem maintains
#    the copy REINDEX builds beside the primary key, as the executor
#    does), and the rebuilt primary key has an entry for every row.
# 2. A REINDEX CONCURRENTLY cancelled while it waits for a claiming
#    transaction leaves an invalid copy behind: idem keeps serving with
#    it, and again once it is dropped.
# 3. Four such leftovers, not ready for inserts, are not maintained and
#    do not count towards the copies idem maintains: idem keeps serving.
#    More copies than idem can track are refused with an error that
#    names the leftovers and DROP INDEX.
use strict;
use warnings;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('reindex', conf => qq{
idem.purge_enabled = off
});
$node->safe_psql('postgres', 'CREATE EXTENSION amcheck');

my $dir = PostgreSQL::Test::Utils::tempdir();
my $script = "$dir/claims.sql";
PostgreSQL::Test::Utils::append_to_file($script, q{
\set k random(1, 1000000000000)
BEGIN;
SELECT token AS tok FROM idem_begin('r-' || :k, 'f') \gset
SELECT idem_complete('r-' || :k, 'f', 201, 'ok', :tok);
COMMIT;
});

# --- 1. Claims during REINDEX TABLE CONCURRENTLY.
my ($out, $err) = ('', '');
my $bench = IPC::Run::start(
	[
		'pgbench', '-n', '-c', 4, '-j', 2, '-t', 1500, '-f', $script,
		'-h', $node->host, '-p', $node->port, 'postgres'
	],
	'>', \$out, '2>', \$err);
my $reindexed = 0;
while ($bench->pumpable)
{
	$node->safe_psql('postgres', 'REINDEX TABLE CONCURRENTLY idem.keys');
	$reindexed++;
	$bench->pump_nb;
}
$bench->finish;
note "pgbench stdout:\n$out\nstderr:\n$err";
is($bench->result(0), 0, 'claims and completes ran without error during REINDEX CONCURRENTLY');
cmp_ok($reindexed, '>=', 1, "the primary key was rebuilt $reindexed times");
is($node->safe_psql('postgres', q{SELECT count(*) FROM idem.keys WHERE status = 201}),
	6000, 'every request stored its response');
is($node->safe_psql('postgres', q{SELECT bt_index_check('idem.keys_pkey', true)}),
	'', 'the rebuilt primary key has an entry for every row');
is($node->safe_psql('postgres', q{
	SELECT string_agg(c.relname, ',' ORDER BY c.relname)
	  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
	 WHERE i.indrelid = 'idem.keys'::regclass}),
	'keys_pkey', 'no copy is left behind');

# --- 2. A cancelled REINDEX CONCURRENTLY.
my $holder = $node->background_psql('postgres');
$holder->query_safe(q{BEGIN; SELECT claimed FROM idem_begin('held', 'f')});
my ($rc, $stdout, $stderr) = $node->psql('postgres', q{
	SET statement_timeout = '1s';
	REINDEX INDEX CONCURRENTLY idem.keys_pkey;
});
like($stderr, qr/canceling statement due to statement timeout/,
	'REINDEX CONCURRENTLY is cancelled while it waits for the claiming transaction');
$holder->query_safe('COMMIT');
$holder->quit;
is($node->safe_psql('postgres', q{
	SELECT c.relname || ' valid=' || i.indisvalid
	  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
	 WHERE i.indrelid = 'idem.keys'::regclass AND c.relname <> 'keys_pkey'}),
	'keys_pkey_ccnew valid=false', 'it left an invalid copy behind');
is($node->safe_psql('postgres', q{
	SELECT b.claimed::text || ',' || c.state
	  FROM idem_begin('after-cancel', 'f') b,
	       LATERAL (SELECT idem_complete('after-cancel', 'f', 200, 'x', b.token)) x,
	       LATERAL idem_begin('held', 'f', wait => false) c}),
	'true,PROCESSING', 'idem claims, completes and answers beside the leftover');
$node->safe_psql('postgres', 'DROP INDEX idem.keys_pkey_ccnew');
is($node->safe_psql('postgres', q{
	SELECT state FROM idem_begin('after-cancel', 'f')}),
	'DONE', 'and after it is dropped');
is($node->safe_psql('postgres', q{SELECT bt_index_check('idem.keys_pkey', true)}),
	'', 'the primary key has an entry for every row');

# --- 3. Four cancelled REINDEX CONCURRENTLY.
sub cancelled_reindex
{
	my $holder = $node->background_psql('postgres');
	$holder->query_safe(q{BEGIN; SELECT claimed FROM idem_begin('held-4', 'f')});
	my ($rc, $stdout, $stderr) = $node->psql('postgres', q{
		SET statement_timeout = '300ms';
		REINDEX INDEX CONCURRENTLY idem.keys_pkey;
	});
	$holder->query_safe('ROLLBACK');
	$holder->quit;
	return $stderr;
}
like(cancelled_reindex(), qr/canceling statement due to statement timeout/,
	"REINDEX CONCURRENTLY cancelled ($_)") for 1 .. 4;
is($node->safe_psql('postgres', q{
	SELECT count(*) || ' ' || bool_or(indisready) || ' ' || bool_or(indisvalid)
	  FROM pg_index WHERE indrelid = 'idem.keys'::regclass AND indexrelid <> 'idem.keys_pkey'::regclass}),
	'4 false false', 'four copies left behind, none ready for inserts nor valid');
is($node->safe_psql('postgres', q{
	SELECT b.claimed::text || ',' || c.state
	  FROM idem_begin('after-4', 'f') b,
	       LATERAL (SELECT idem_complete('after-4', 'f', 200, 'x', b.token)) x,
	       LATERAL idem_begin('after-4', 'f') c}),
	'true,DONE', 'idem claims, completes and replays beside four leftovers');

# 16 copies in all are more than idem tracks: a clear error naming the fix.
like(cancelled_reindex(), qr/canceling statement/, "REINDEX CONCURRENTLY cancelled ($_)")
	for 5 .. 16;
($rc, $stdout, $stderr) = $node->psql('postgres', q{
	SELECT state FROM idem_begin('after-16', 'f')});
like($stderr, qr/it has 16 copies of its primary key in all, more than the 15 idem allows/,
	'16 leftovers: the error names the copies');
like($stderr, qr/HINT:  Drop the copies that are not valid with DROP INDEX CONCURRENTLY/,
	'and the fix');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idem.keys WHERE key = 'after-4' AND status = 200}),
	'1', 'nothing stored was lost');
$node->safe_psql('postgres', q{
	DO $$DECLARE i regclass;
	BEGIN
		FOR i IN SELECT indexrelid::regclass FROM pg_index
				  WHERE indrelid = 'idem.keys'::regclass AND NOT indisvalid
		LOOP EXECUTE 'DROP INDEX ' || i; END LOOP;
	END$$});
is($node->safe_psql('postgres', q{SELECT state FROM idem_begin('after-4', 'f')}),
	'DONE', 'the leftovers dropped, idem serves again');

$node->stop;
done_testing();
