# Claims inside prepared transactions (two-phase commit).  A prepared
# claim is an uncommitted row version like any other: other claimers wait
# for it (or get 55P03 under lock_timeout), wait => false answers in
# flight, purge skips it, and it survives a clean restart and a crash.
# COMMIT PREPARED makes it the committed claim (or stored response);
# ROLLBACK PREPARED frees the key for the next claimer.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('twophase', conf => qq{
max_prepared_transactions = 5
idem.purge_enabled = off
});

sub sql
{
	my ($query) = @_;
	return $node->safe_psql('postgres', $query);
}

# The SQLSTATE of a statement that must fail.
sub sqlstate_of
{
	my ($query) = @_;
	my ($ret, $out, $err) =
	  $node->psql('postgres', "\\set VERBOSITY verbose\n$query");
	return 'no error' if $ret == 0;
	return $err =~ /ERROR:  ([0-9A-Z]{5}):/ ? $1 : "unexpected: $err";
}

# A claimer with lock_timeout gets 55P03; one with wait => false is told
# the key is in flight, and not who holds it.
sub check_blocked
{
	my ($key, $what) = @_;
	is( sqlstate_of(
			"SET lock_timeout = '100ms'; SELECT * FROM idem_begin('$key', 'f')"),
		'55P03', "$what: a claimer with lock_timeout gets 55P03");
	is(sql("SELECT claimed, state, token IS NULL FROM idem_begin('$key', 'f', wait => false)"),
		'f|PROCESSING|t', "$what: wait => false answers in flight");
}

# Start idem_begin in a background session; return once it waits on a lock.
sub start_waiter
{
	my ($key, $fp) = @_;
	my $s = $node->background_psql('postgres', on_error_stop => 0);
	$s->query_until(qr/started\n/, qq{\\echo started
SELECT claimed, state, token, status, encode(body, 'escape') FROM idem_begin('$key', '$fp');
});
	ok( $node->poll_query_until('postgres', q{
SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE '%idem_begin%'}, '1'),
		"a claimer of $key waits");
	return $s;
}

# The waiter's answer, once it has one.
sub finish_waiter
{
	my ($s) = @_;
	my $out = $s->query_until(qr/finished\n/, "\\echo finished\n");
	$out =~ s/finished\n//;
	chomp $out;
	is($s->{stderr}, '', 'the waiter got no error');
	$s->quit;
	return $out;
}

# --- A new key claimed in a prepared transaction, then committed.
my $t_new = sql(q{
BEGIN;
SELECT token FROM idem_begin('p-new', 'f', lease => '1h');
PREPARE TRANSACTION 'claim_new';
});
like($t_new, qr/^\d+$/, 'a claim made in a transaction that is then prepared');
is(sql('SELECT gid FROM pg_prepared_xacts'), 'claim_new', 'the transaction is prepared');
check_blocked('p-new', 'prepared new claim');
is(sqlstate_of("SELECT idem_complete('p-new', 'f', 200, 'x', $t_new)"),
	'ID003', 'the token cannot complete the key before COMMIT PREPARED (no committed claim)');
is(sql("SELECT count(*) FROM idem.keys WHERE key = 'p-new'"), '0',
	'the prepared claim is not visible to others');

my $w = start_waiter('p-new', 'f');
sql("COMMIT PREPARED 'claim_new'");
is(finish_waiter($w), 'f|PROCESSING|||',
	'after COMMIT PREPARED the waiter sees the claim in flight (no token)');
is(sql("SELECT token, status FROM idem.keys WHERE key = 'p-new'"), "$t_new|",
	'the committed claim holds the prepared token');
like(sql("SELECT idem_complete('p-new', 'f', 200, 'done', $t_new)"), qr/^\d{4}-/,
	'the holder completes the key with its token');
is(sql("SELECT state, status, encode(body, 'escape') FROM idem_begin('p-new', 'f')"),
	'DONE|200|done', 'and it replays');

# --- A re-claim of an expired key (an UPDATE), prepared; and a claim that
# stores its response in the same prepared transaction.
sql(q{
SET idem.clock_offset = '-1h';
BEGIN;
SELECT count(*) FROM idem_begin('p-old', 'f', lease => '1s', retention => '1s');
SELECT idem_complete('p-old', 'f', 200, 'old', NULL, '1s');
COMMIT;
});
my $t_reclaim = sql(q{
BEGIN;
SELECT token FROM idem_begin('p-old', 'g') WHERE claimed;
PREPARE TRANSACTION 'reclaim';
});
like($t_reclaim, qr/^\d+$/, 'the expired key is re-claimed in a prepared transaction');
sql(q{
BEGIN;
SELECT count(*) FROM idem_begin('p-done', 'f');
SELECT idem_complete('p-done', 'f', 201, 'prepared body');
PREPARE TRANSACTION 'done';
});
check_blocked('p-old', 'prepared re-claim');
check_blocked('p-done', 'prepared claim and response');
is(sql("SET lock_timeout = '5s'; SELECT idem_purge()"), '0',
	'purge skips the prepared re-claim of the expired key without waiting');

# --- Both survive a clean restart ...
$node->restart;
is(sql('SELECT string_agg(gid, \',\' ORDER BY gid) FROM pg_prepared_xacts'),
	'done,reclaim', 'both prepared transactions survive a restart');
check_blocked('p-old', 'after a restart');
check_blocked('p-done', 'after a restart');

# ... and a crash.
$node->stop('immediate');
$node->start;
is(sql('SELECT string_agg(gid, \',\' ORDER BY gid) FROM pg_prepared_xacts'),
	'done,reclaim', 'both prepared transactions survive an immediate stop');
check_blocked('p-old', 'after an immediate stop');
is(sql("SELECT count(*), string_agg(encode(body, 'escape'), ',') FROM idem.keys WHERE key = 'p-old'"),
	'1|old', 'others still see the expired response under the prepared re-claim');

# --- ROLLBACK PREPARED frees the key: the waiter claims it.
$w = start_waiter('p-old', 'h');
sql("ROLLBACK PREPARED 'reclaim'");
my $got = finish_waiter($w);
like($got, qr/^t\|PROCESSING\|\d+\|\|$/, 'after ROLLBACK PREPARED the waiter claims the key');
my ($t_after) = $got =~ /^t\|PROCESSING\|(\d+)/;
cmp_ok($t_after // 0, '>', $t_reclaim, 'with a token greater than the rolled-back one');
is( sql("SELECT token, status IS NULL, fingerprint = sha256('h') FROM idem.keys WHERE key = 'p-old'"),
	($t_after // '') . '|t|t', 'the key holds the new claim only');

# --- COMMIT PREPARED of a stored response: the waiter replays it.
$w = start_waiter('p-done', 'f');
sql("COMMIT PREPARED 'done'");
is(finish_waiter($w), 'f|DONE||201|prepared body',
	'after COMMIT PREPARED the waiter replays the prepared response');

# --- ROLLBACK PREPARED of a new key: the next claim gets it.
my $t_gone = sql(q{
BEGIN;
SELECT token FROM idem_begin('p-gone', 'f');
PREPARE TRANSACTION 'gone';
});
check_blocked('p-gone', 'a second prepared new claim');
sql("ROLLBACK PREPARED 'gone'");
my $next = sql("SELECT claimed, state, token > $t_gone FROM idem_begin('p-gone', 'f')");
is($next, 't|PROCESSING|t', 'after ROLLBACK PREPARED the next claim gets the key');
is(sql('SELECT count(*) FROM pg_prepared_xacts'), '0', 'no prepared transaction left');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
