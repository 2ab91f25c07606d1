# What an operator sees: one LOG line per purge that deleted keys, per
# takeover, per forced release and eviction, a WARNING per response not
# stored, and silence when idem.log_purge / idem.log_takeovers are off;
# idem_stats times calls and waits, keeps its counters across a clean
# restart (not across a crash) and says since when it counts.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('operator', conf => qq{
idem.purge_naptime = 1
idem.default_retention = '1h'
restart_after_crash = on
});

sub psql_ok { return $node->safe_psql('postgres', $_[0]); }

# Wait until the server log, from offset $from on, matches $re.
sub log_has
{
	my ($from, $re) = @_;
	return $node->wait_for_log($re, $from) ? 1 : 0;
}

sub log_lacks
{
	my ($from, $re) = @_;
	return slurp_file($node->logfile, $from) !~ $re;
}

# --- A purge pass that deletes keys logs one line with the count.
my $off = -s $node->logfile;
psql_ok(q{SELECT count(*) FROM generate_series(1, 25) g,
  LATERAL idem_begin('p-' || g, 'f', lease => '1s', retention => '2s')});
ok(log_has($off, qr/LOG:  idem purge: deleted 25 expired keys from database "postgres" in \d+ transaction\(s\), \d+ ms/),
	'a purge that deleted keys is logged with its count');

# --- idem.log_purge = off: deleted, counted, not logged.
$node->append_conf('postgresql.conf', 'idem.log_purge = off');
$node->reload;
my $purged0 = psql_ok(q{SELECT purged_rows FROM idem_stats WHERE datname = 'postgres'});
$off = -s $node->logfile;
psql_ok(q{SELECT count(*) FROM generate_series(1, 7) g,
  LATERAL idem_begin('q-' || g, 'f', lease => '1s', retention => '2s')});
$node->poll_query_until('postgres',
	"SELECT purged_rows >= $purged0 + 7 FROM idem_stats WHERE datname = 'postgres'")
  or die 'the purge did not run';
ok(log_lacks($off, qr/idem purge: deleted/), 'idem.log_purge = off: no purge line');

# --- A takeover: key, scope, old and new token and roles, the lease's end.
psql_ok(q{CREATE ROLE worker_a LOGIN; CREATE ROLE worker_b LOGIN;
  GRANT EXECUTE ON FUNCTION idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)
  TO worker_a, worker_b});
my $t1 = $node->safe_psql('postgres',
	q{SET ROLE worker_a; SELECT token FROM idem_begin('order-7', 'f', lease => '1 minute', scope => 'shop')});
$off = -s $node->logfile;
my $t2 = $node->safe_psql('postgres',
	q{SET idem.clock_offset = '2min'; SET ROLE worker_b;
	  SELECT token FROM idem_begin('order-7', 'f', scope => 'shop') WHERE claimed});
cmp_ok($t2, '>', $t1, 'taken over with a greater token');
ok(log_has($off, qr/LOG:  idempotency key "order-7" in scope "shop" taken over after its lease ended\n.*DETAIL:  Token $t1 of role worker_a, whose lease ended at [^,]+, is superseded by token $t2 of role worker_b\./),
	'a takeover is logged with both tokens and roles');

# --- A forced release and an eviction, with the reason and the role.
$off = -s $node->logfile;
is(psql_ok(q{SELECT idem_force_release('order-7', 'shop', 'worker host lost')}), 't',
	'force-released');
ok(log_has($off, qr/LOG:  idempotency key "order-7" in scope "shop" force-released by role \S+: worker host lost\n.*DETAIL:  The claim with token $t2 of role worker_b, leased until .*, is ended\./),
	'a forced release is logged with the reason, the holder and its token');
my $t3 = psql_ok(q{SELECT token FROM idem_begin('order-8', 'f')});
psql_ok(qq{SELECT idem_complete('order-8', 'f', 201, 'ok', $t3)});
$off = -s $node->logfile;
is(psql_ok(q{SELECT idem_evict('order-8')}), 't', 'evicted');
ok(log_has($off, qr/LOG:  idempotency key "order-8" in scope "" evicted by role \S+\n.*DETAIL:  Its stored response \(status 201\) is dropped/),
	'an eviction is logged');

# --- idem.log_takeovers = off silences takeovers and evictions (a
# forced release is always logged); only superusers may set it.
my ($ret, $out, $err) = $node->psql('postgres',
	q{SET ROLE worker_a; SET idem.log_takeovers = off});
like($err, qr/permission denied to set parameter "idem.log_takeovers"/,
	'an application role cannot silence takeover logging');
$off = -s $node->logfile;
psql_ok(q{SELECT token FROM idem_begin('order-9', 'f', lease => '1 minute')});
psql_ok(q{SET idem.log_takeovers = off; SET idem.clock_offset = '2min';
  SELECT token FROM idem_begin('order-9', 'f') WHERE claimed});
my $t4 = psql_ok(q{SELECT token FROM idem_begin('order-10', 'f')});
psql_ok(qq{SELECT idem_complete('order-10', 'f', 200, 'ok', $t4)});
psql_ok(q{SET idem.log_takeovers = off; SELECT idem_evict('order-10')});
psql_ok(q{SELECT 'marker after the silent calls'});
ok(log_lacks($off, qr/"order-9" in scope "" taken over|"order-10" in scope "" evicted/),
	'idem.log_takeovers = off: no takeover or eviction line');

# --- A response too large to store: one WARNING with the key.
$off = -s $node->logfile;
my $t5 = psql_ok(q{SELECT token FROM idem_begin('big-1', 'f')});
psql_ok(qq{SET idem.max_body_size = 10; SELECT idem_complete('big-1', 'f', 200, 'eleven byte', $t5)});
ok(log_has($off, qr/WARNING:  response to idempotency key "big-1" not stored: its body is too large/),
	'a response not stored is logged at WARNING');
is(psql_ok(q{SELECT status || ' ' || (convert_from(body, 'UTF8')::json->>'title') FROM idem_begin('big-1', 'f')}),
	'500 Response not stored', 'a retry replays the fixed answer');

# --- Times: claims, replays, completes and waits are timed.
psql_ok(q{SELECT idem_stats_reset()});
my $reset = psql_ok(q{SELECT stats_reset FROM idem_stats WHERE datname = 'postgres'});
my $t6 = psql_ok(q{SELECT token FROM idem_begin('timed', 'f')});
psql_ok(qq{SELECT idem_complete('timed', 'f', 200, 'ok', $t6)});
psql_ok(q{SELECT state FROM idem_begin('timed', 'f')});
# A wait: a holder's open transaction, a duplicate that waits for it.
my $holder = $node->background_psql('postgres');
$holder->query_safe(q{BEGIN; SELECT claimed FROM idem_begin('waited', 'f')});
my $waiter = $node->background_psql('postgres');
$waiter->query_until(qr/sent/, q{\echo sent
SELECT state FROM idem_begin('waited', 'f');
});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%idem_begin(''waited''%'})
  or die 'the duplicate did not wait';
$holder->query_safe(q{SELECT idem_complete('waited', 'f', 200, 'ok'); COMMIT});
$holder->quit;
$waiter->quit;
is(psql_ok(q{SELECT concat_ws(' ', claims, replays, completes, waits,
                 claim_time > 0, replay_time > 0, complete_time > 0, wait_time > 0,
                 wait_time <= claim_time + replay_time)
  FROM idem_stats WHERE datname = 'postgres'}),
	'2 2 2 1 t t t t t', 'claims, replays, completes and waits are counted and timed');
cmp_ok(psql_ok(q{SELECT stats_reset FROM idem_stats WHERE datname = 'postgres'}), 'eq', $reset,
	'stats_reset is the time of the reset');

# --- A clean restart keeps every counter and the reset time (the purge
# is turned off first, so that nothing counts in between).
$node->append_conf('postgresql.conf', 'idem.purge_enabled = off');
$node->reload;
$node->poll_query_until('postgres',
	q{SELECT count(*) = 0 FROM pg_stat_activity WHERE backend_type = 'idem purge'})
  or die 'a purge worker is still running';
sleep 1;
my $before = psql_ok(q{SELECT row(s.*)::text FROM idem_stats s WHERE datname = 'postgres'});
$node->restart;
is(psql_ok(q{SELECT row(s.*)::text FROM idem_stats s WHERE datname = 'postgres'}), $before,
	'a clean restart keeps the counters, times and stats_reset');
ok(!-e $node->data_dir . '/pg_stat/idem.stat', 'the file is removed once read');

# --- After a crash (a backend killed), the counters start from zero:
# shared memory is initialized again and nothing was written.
my $victim = $node->background_psql('postgres');
my $vpid = $victim->query_safe(q{SELECT pg_backend_pid()});
kill 'KILL', $vpid;
$victim->quit;
$node->poll_query_until('postgres', 'SELECT 1', '1')
  or die 'the server did not come back';
is(psql_ok(q{SELECT count(*) FROM idem_stats WHERE datname = 'postgres' AND claims > 0}), '0',
	'after a crash the counters start from zero');

idem_amcheck($node, 'postgres');
$node->stop;
done_testing();
