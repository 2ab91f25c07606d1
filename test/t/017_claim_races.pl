# Races on one key under pgbench.
#
# 1. Tokens per key only grow.  Eight clients claim, commit and release
#    the same key in a loop; each claiming transaction records its token
#    beside the highest token recorded before it, in the same transaction
#    as the claim.  No token may be at or below an earlier one.
# 2. wait => false never waits.  Eight clients claim the same new key
#    (a new one every quarter second) with wait => false under a 20 ms
#    lock_timeout; the holder keeps its transaction open for 300 ms.  A
#    non-holder that waited for it would fail with 55P03: none may.
use strict;
use warnings;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('races', conf => qq{
idem.purge_enabled = off
max_connections = 40
}, extension => []);
$node->safe_psql('postgres', q{
CREATE EXTENSION idem;
CREATE TABLE claims (token bigint NOT NULL, prev_max bigint NOT NULL);
CREATE TABLE nowait (claimed boolean NOT NULL);
});

my $dir = PostgreSQL::Test::Utils::tempdir();

# Run a pgbench script; returns its exit status, stdout and stderr.
sub pgbench
{
	my ($name, $script, $seconds) = @_;
	my $file = "$dir/$name.sql";
	PostgreSQL::Test::Utils::append_to_file($file, $script);
	my ($out, $err) = ('', '');
	my $h = IPC::Run::start(
		[
			'pgbench', '-n', '-c', 8, '-j', 2, '-T', $seconds, '-f', $file,
			'-h', $node->host, '-p', $node->port, 'postgres'
		],
		'>', \$out, '2>', \$err);
	$h->finish;
	note "pgbench $name stdout:\n$out\nstderr:\n$err";
	return ($h->result(0), $out, $err);
}

# --- 1. Tokens per key only grow.
my ($rc, $out, $err) = pgbench('grow', q{
BEGIN;
SELECT claimed, coalesce(token, 0) AS token FROM idem_begin('race', 'f', lease => '1 min') \gset
\if :claimed
INSERT INTO claims SELECT :token, coalesce((SELECT max(token) FROM claims), 0);
COMMIT;
SELECT idem_release('race', :token);
\else
COMMIT;
\endif
}, 15);
is($rc, 0, 'pgbench: claim, commit, release on one key ran without error');
unlike($err, qr/ERROR/, 'no client got an SQL error');
my ($claims, $regressions) = split /\|/, $node->safe_psql('postgres',
	'SELECT count(*), count(*) FILTER (WHERE token <= prev_max) FROM claims');
cmp_ok($claims, '>=', 100, "the key was claimed $claims times");
is($regressions, '0', 'no claim got a token at or below an earlier claim of the key');
is( $node->safe_psql('postgres',
		'SELECT count(*) FROM (SELECT token FROM claims GROUP BY token HAVING count(*) > 1) d'),
	'0', 'no token was given to two claims');

# --- 2. wait => false never waits.
($rc, $out, $err) = pgbench('nowait', q{
BEGIN;
SET LOCAL lock_timeout = '20ms';
SELECT claimed FROM idem_begin('nw-' || floor(extract(epoch FROM clock_timestamp()) * 4)::bigint,
                               'f', wait => false) \gset
\if :claimed
INSERT INTO nowait VALUES (true);
SELECT pg_sleep(0.3);
\else
INSERT INTO nowait VALUES (false);
\endif
COMMIT;
}, 10);
is($rc, 0, 'pgbench: wait => false claims of one new key ran without error');
unlike($err, qr/lock timeout|55P03|ERROR/, 'no claimer waited for the holder (no 55P03)');
my ($holders, $others, $keys) = split /\|/, $node->safe_psql('postgres', q{
SELECT count(*) FILTER (WHERE claimed), count(*) FILTER (WHERE NOT claimed),
       (SELECT count(*) FROM idem.keys WHERE key LIKE 'nw-%')
FROM nowait});
cmp_ok($others, '>=', 100, "$others claims answered in flight");
is($holders, $keys, "each of the $keys keys had exactly one holder");

$node->stop;
done_testing();
