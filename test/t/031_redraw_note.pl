# A new key whose token is drawn again (another token was drawn while the
# key was inserted) is written a second time, and that version may land on
# another page: its expiry is noted there too, so purge's expiry map sends
# the next pass to that page once the key expires.  Without the note the
# key would wait for the hourly full pass.
#
# Claims of large keys (four or five to a page), one after the other, run
# beside a session that draws tokens all the time, so that nearly every
# claim draws again, and the second version of a key that filled its page
# goes to the next page, where the keys after it go too.  One key in
# twenty has a retention of a few seconds, the others a day: the pages of
# those second versions have no other short-lived key to make their range
# of the map read.  Once the short-lived keys expired, the worker's
# passes, which read only the ranges of blocks the map marks, leave none
# of them.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('redraw', conf => qq{
idem.purge_naptime = 1
idem.purge_rate_limit = 0
idem.max_key_length = 1024
});

sub runs
{
	return $node->safe_psql('postgres', q{
		SELECT purge_runs FROM idem_stats WHERE datname = current_database()});
}

sub wait_runs
{
	my ($n) = @_;
	$node->poll_query_until('postgres', qq{
		SELECT purge_runs >= $n FROM idem_stats WHERE datname = current_database()})
	  or die "purge runs did not reach $n";
}

# A pass that read the whole table makes the map known.
$node->safe_psql('postgres', q{SELECT claimed FROM idem_begin('first', 'f')});
wait_runs(runs() + 2);

my $dir = PostgreSQL::Test::Utils::tempdir();
PostgreSQL::Test::Utils::append_to_file("$dir/claims.sql", q{
\set k random(1, 1000000000000)
\set short random(1, 20)
SELECT claimed FROM idem_begin(
	CASE WHEN :short = 1 THEN 'short-' ELSE 'long-' END || :k || '-'
	  || (SELECT string_agg(md5(:k::text || i), '') FROM generate_series(1, 30) i),
	'f',
	lease => interval '1 s',
	retention => CASE WHEN :short = 1 THEN interval '4 s' ELSE interval '1 day' END,
	scope => (SELECT string_agg(md5(i || :k::text), '') FROM generate_series(1, 22) i));
});
PostgreSQL::Test::Utils::append_to_file("$dir/draws.sql",
	q{SELECT nextval('idem.token_seq') FROM generate_series(1, 50);});

# The draws run beside the claims; how many keys get drawn again depends on
# how the two sessions are scheduled, so the claims go on, 500 at a time,
# past 2000 until more than 50 second versions went to another page (a
# busy machine needs more claims for that), or 6000 claims were made.
my ($out, $err) = ('', '');
my @connect = ('-h', $node->host, '-p', $node->port, 'postgres');
my $draws = IPC::Run::start(
	[ 'pgbench', '-n', '-c', 1, '-T', 900, '-f', "$dir/draws.sql", @connect ],
	'>', \my $dout, '2>', \my $derr);
$node->safe_psql('postgres', 'CREATE EXTENSION pageinspect');

# The first versions of redrawn keys, updated by their own transaction:
# how many pointed to another page.
sub elsewhere
{
	return $node->safe_psql('postgres', q{
		SELECT count(*) FILTER (WHERE t_xmax = t_xmin AND (t_ctid::text::point)[0] <> b)
		  FROM generate_series(0, pg_relation_size('idem.keys') / 8192 - 1) b,
		       LATERAL heap_page_items(get_raw_page('idem.keys', b::int))});
}
my ($claimed, $claims_ok, $elsewhere) = (0, 1, 0);
while ($claimed < 2000 || ($claimed < 6000 && $elsewhere <= 50))
{
	$claims_ok &&= IPC::Run::run(
		[ 'pgbench', '-n', '-c', 1, '-t', 500, '-f', "$dir/claims.sql", @connect ],
		'>', \$out, '2>', \$err);
	$claimed += 500;
	$elsewhere = elsewhere();
}
$draws->kill_kill;
ok($claims_ok, "the claims ran ($claimed)") or diag("pgbench: $out\n$err");
cmp_ok($elsewhere, '>', 50, "$elsewhere keys were drawn again and written on another page");
my $short = $node->safe_psql('postgres',
	q{SELECT count(*) FROM idem.keys WHERE key LIKE 'short-%'});
cmp_ok($short, '>', 0, "$short keys have a short retention");
is($node->safe_psql('postgres', q{
	SELECT count(DISTINCT (ctid::text::point)[0]) > 100 FROM idem.keys}), 't',
	'the keys fill more than 100 pages');

# Once they expired, a few passes (each reads only the ranges of blocks
# the map marks) leave none of them.
$node->poll_query_until('postgres', q{
	SELECT max(expires_at) < now() FROM idem.keys WHERE key LIKE 'short-%'})
  or die 'the short keys did not expire';
wait_runs(runs() + 4);
is($node->safe_psql('postgres', q{SELECT count(*) FROM idem.keys WHERE key LIKE 'short-%'}),
	'0', 'every expired key is purged');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idem.keys WHERE key LIKE 'long-%'}),
	$claimed - $short, 'and no other');

$node->stop;
done_testing();
