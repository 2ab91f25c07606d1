# The client guard (guard/idem_guard.c) against a live server: every
# outcome, a fault at each step (begin, handler, complete, release,
# replay), a response the server refuses (the fixed 500 stored in its
# place), the heartbeat (with the server's default lease, re-connecting
# to a host that never answers, and stopped while its extend waits for a
# row lock), a superseded token, eight threads on one key, schema-qualified
# calls (a missing schema or function named), a timeout after the claim
# committed, and a cancel held by a proxy (the server ends the wait).
# The test program test/guard/guard_test prints one line per case; each
# line must be exactly as listed here, in the database postgres and in
# test/odd_database.sql's.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $top = $ENV{TESTDIR} || '.';
my $program = "$top/test/guard/guard_test";
system('make', '-s', '-C', "$top/guard") unless -x $program;
ok(-x $program, 'guard test program is built');

# WAL senders, so that commits can wait for a synchronous standby (the
# case of a timeout after the claim committed).
my $node = idem_node('guard', conf => qq{
wal_level = replica
max_wal_senders = 2
});

# No server listens on this port: the store is down.
my $down = 'host=' . $node->host . ' port='
  . PostgreSQL::Test::Cluster::get_free_port()
  . ' dbname=postgres connect_timeout=2';

# The program's lines against database $db, by case.  A guard that hangs
# (a heartbeat that cannot be stopped) fails the test instead of blocking
# it: the program is killed after the timeout.
sub run_guard
{
	my ($db) = @_;
	my ($stdout, $stderr) = (q{}, q{});
	my $ok = eval {
		IPC::Run::run([ $program, $node->connstr($db), $down ],
			'>', \$stdout, '2>', \$stderr,
			IPC::Run::timeout($PostgreSQL::Test::Utils::timeout_default));
	};
	diag("guard test program: $@") if $@;
	ok($ok, "$db: guard test program exits 0") or diag($stderr);
	return map { /^(\w+)(?:: (.*))?$/ ? ($1 => $2 // q{}) : () } split /\n/, $stdout;
}

my @expected = (
	# A new key runs the handler and stores its response; the same key
	# replays it; another fingerprint is a conflict and reveals nothing.
	[ executed => 'outcome=EXECUTED failed=none calls=1 status=201 body=created token=set stored=DONE/201/created' ],
	[ replayed => 'outcome=REPLAYED failed=none calls=1 status=201 body=created' ],
	[ conflict => 'outcome=CONFLICT failed=none calls=1 status=0 body_len=0' ],
	[ defaults => 'outcome=EXECUTED failed=none calls=1' ],
	# Bodies go through as bytes: zero bytes, empty and NULL bodies.
	[ binary => 'first=EXECUTED replay=REPLAYED len=6 hex=00ff0a00275c' ],
	[ empty_body => 'outcome=REPLAYED body=empty len=0' ],
	[ null_body => 'outcome=REPLAYED body=null len=0' ],
	# Another caller's claim: committed, uncommitted with wait off, and
	# uncommitted with wait on, cut by the client timeout (the connection
	# stays usable and claims the key once the holder rolls back).
	[ in_flight => 'outcome=IN_FLIGHT failed=none calls=0 state=PROCESSING' ],
	[ in_flight_nowait => 'outcome=IN_FLIGHT failed=none calls=0' ],
	[ timeout => 'outcome=UNAVAILABLE failed=begin message=statement timed out after 300 ms calls=0 conn=ok' ],
	[ after_timeout => 'outcome=EXECUTED failed=none calls=1 state=DONE' ],
	# No claim can be made: the handler never runs.
	[ unavailable_refused => 'outcome=UNAVAILABLE failed=begin calls=0' ],
	[ unavailable_no_conn => 'outcome=UNAVAILABLE failed=begin calls=0' ],
	[ unavailable_lost => 'outcome=UNAVAILABLE failed=begin calls=0 state=NONE' ],
	[ unavailable_read_only => 'outcome=UNAVAILABLE failed=begin sqlstate=25006 calls=0 state=NONE' ],
	[ unavailable_in_transaction => 'outcome=UNAVAILABLE failed=begin calls=0 state=NONE' ],
	# Fault hook at begin (twice, then the call goes through).
	[ fault_begin => 'outcome=UNAVAILABLE failed=begin message=fault injected at begin calls=0 state=NONE' ],
	[ fault_begin_n => 'outcomes=UNAVAILABLE,UNAVAILABLE,EXECUTED calls=1 state=DONE' ],
	# Fault hook at complete: reported, key PROCESSING, in flight inside
	# the lease, taken over after it (test clock moved by 10 s).
	[ fault_complete => 'outcome=EXECUTED failed=complete message=fault injected at complete status=201 calls=1 state=PROCESSING' ],
	[ fault_complete_retry => 'outcome=IN_FLIGHT calls=1' ],
	[ fault_complete_takeover => 'outcome=EXECUTED failed=none calls=2 state=DONE' ],
	# Handler error: released by default, so a retry runs at once ...
	[ handler_error => 'outcome=EXECUTED failed=handler message=handler failed (7) released=yes calls=1 state=NONE' ],
	[ handler_error_retry => 'outcome=EXECUTED failed=none calls=2 state=DONE' ],
	# ... or left to the lease as the Go guard does.
	[ handler_error_keep => 'outcome=EXECUTED failed=handler released=no calls=1 state=PROCESSING' ],
	[ handler_error_keep_retry => 'outcome=IN_FLIGHT calls=1' ],
	[ handler_error_keep_takeover => 'outcome=EXECUTED failed=none calls=2 state=DONE' ],
	[ release_fault => 'outcome=EXECUTED failed=handler message=handler failed (7); release failed: fault injected at release released=no state=PROCESSING' ],
	# Complete fails for real: connection lost, token superseded.
	[ complete_lost => 'outcome=EXECUTED failed=complete status=201 calls=1 state=PROCESSING' ],
	[ superseded => 'outcome=EXECUTED failed=complete sqlstate=ID002 taken_over=yes token_changed=yes state=PROCESSING' ],
	# The server refuses the response for good (status -1, 22023): the
	# fixed 500 "Response not stored" is stored in its place, the result
	# says so with the key, and retries replay it without running the
	# handler.
	[ not_stored => 'outcome=EXECUTED failed=complete sqlstate=22023 not_stored=yes names_key=yes status=-1 calls=1 stored=DONE/500/true' ],
	[ not_stored_retry1 => 'outcome=REPLAYED failed=none calls=1 status=500 body=fixed' ],
	[ not_stored_retry2 => 'outcome=REPLAYED failed=none calls=1 status=500 body=fixed' ],
	# The heartbeat keeps a 6 s lease alive past its first end (another
	# caller finds the key in flight), and stops when the token is
	# superseded, which makes complete fail.
	[ heartbeat => 'outcome=EXECUTED failed=none lease_outlived=yes competitor=IN_FLIGHT extends=some superseded=no calls=1 state=DONE' ],
	[ heartbeat_superseded => 'outcome=EXECUTED failed=complete sqlstate=ID002 taken_over=yes lost_seen=yes superseded=yes state=PROCESSING' ],
	[ heartbeat_unavailable => 'outcome=UNAVAILABLE failed=heartbeat released=yes calls=0 state=NONE' ],
	# Scopes are separate namespaces; the window ends (test clock).
	[ scopes => 'a=EXECUTED b=EXECUTED b_again=REPLAYED calls=2' ],
	[ window => 'first=EXECUTED inside=REPLAYED after=EXECUTED calls=2' ],
	# Eight threads with a connection each, one key: one execution.
	[ threads => 'executed=1 others=7 errors=0 calls=1 state=DONE' ],
	# The heartbeat follows the lease the claim returned: with the server's
	# default lease of 6 s (lease_ms 0) the claim outlives its first end.
	[ heartbeat_default_lease => 'outcome=EXECUTED failed=none lease_outlived=yes competitor=IN_FLIGHT extends=some calls=1 state=DONE' ],
	# The heartbeat's connection is lost and its first host never answers:
	# re-connecting does not keep the guard from stopping the heartbeat.
	[ heartbeat_reset => 'outcome=EXECUTED failed=none reconnecting=yes calls=1 state=DONE' ],
	# A stored response that cannot be copied (out of memory) is a
	# failure, not a replay with an empty body; the next call replays.
	[ replay_out_of_memory => 'outcome=UNAVAILABLE failed=replay message=out of memory copying the stored response calls=1 body=none' ],
	[ replay_after_failure => 'outcome=REPLAYED failed=none status=201 body=created' ],
	# Calls are schema-qualified with exact argument types: a look-alike
	# idem_begin in the "$user" schema is not called; a missing schema or
	# function is a failed claim that names what it looked for.
	[ user_schema => 'outcome=EXECUTED failed=none fake_token=no calls=1 state=DONE' ],
	[ schema_missing => 'outcome=UNAVAILABLE failed=begin sqlstate=3F000 message=idem_begin not found in schema "nosuch"; set IdemGuardOptions.schema to the schema where CREATE EXTENSION idem put it, or if the version is old run ALTER EXTENSION idem UPDATE calls=1 state=NONE' ],
	# A state the guard does not know is a failed claim, not in flight.
	[ unknown_state => 'outcome=UNAVAILABLE failed=begin message=idem_begin answered an unknown state "TOMBSTONED" calls=0' ],
	# remember is sent (named) only when set: that idem_begin has none.
	[ remember_unknown => 'outcome=UNAVAILABLE failed=begin sqlstate=42883 calls=0' ],
	# EXPIRED (a server with tombstones, a look-alike): not run, the status
	# without a body; remember sent when set, with and without wait_for.
	[ expired_0 => 'outcome=EXPIRED failed=none status=201 body=none calls=0 remember=none' ],
	[ expired_1 => 'outcome=EXPIRED failed=none status=201 body=none calls=0 remember=90000' ],
	[ expired_2 => 'outcome=EXPIRED failed=none status=201 body=none calls=0 remember=5000' ],
	[ function_missing => 'outcome=UNAVAILABLE failed=begin sqlstate=42883 message=idem_begin with wait_for not found in schema "pg_catalog"; set IdemGuardOptions.schema to the schema where CREATE EXTENSION idem put it, or if the version is old run ALTER EXTENSION idem UPDATE calls=1 state=NONE' ],
	# The client timeout fires after the claim (and the response) committed
	# locally, while the commit waits for a synchronous standby: the claim
	# is used, not thrown away.
	[ timeout_after_commit => 'outcome=EXECUTED failed=none calls=1 state=DONE' ],
	# A cancel is bounded by the statement's deadline: the guard's
	# connection goes through a proxy that holds cancel requests for 30 s,
	# and the guard returns while the request is still held.  The server
	# ends the claim's wait by its own timeout (the connection stays
	# usable): no claim is made later for the call that gave up, and once
	# the holder rolls back the next claimant gets the key at once.
	[ cancel_held => 'outcome=UNAVAILABLE failed=begin message=statement timed out after 300 ms calls=0 cancel_sent=yes returned_while_held=yes conn=ok wait_ended=yes next_claimed=t state=NONE' ],
	# The server-side bound never loosens the session's own: a
	# lock_timeout of 200 ms ends a claim's wait although the call's
	# timeout is ten minutes.
	[ session_timeout => 'outcome=UNAVAILABLE failed=begin sqlstate=55P03 calls=0 conn=ok' ],
	# Under a timeout each call is one round trip (one Sync): its
	# timeouts go in one pipeline with it, no BEGIN or COMMIT of its own.
	[ round_trips_new => 'outcome=EXECUTED calls=1 syncs=2 state=DONE idle=yes' ],
	[ round_trips_replay => 'outcome=REPLAYED calls=1 syncs=1 body=created' ],
	# The statement setting the clock offset (superuser only) fails for a
	# plain role: the call after it in the pipeline is skipped, nothing is
	# claimed, and the connection is usable at once.
	[ settings_refused => 'outcome=UNAVAILABLE failed=begin sqlstate=42501 calls=0 state=NONE idle=yes next=1' ],
	# Stopping the heartbeat does not wait for its idem_extend, which waits
	# for the key's row, held FOR UPDATE by another session for up to 30 s:
	# the extend is cancelled, the guard goes on to complete, and the
	# response is stored once the row is let go.
	[ heartbeat_stop_lock => 'outcome=EXECUTED failed=none extend_waited=yes stop_prompt=yes superseded=no calls=1 state=DONE' ],
	# wait_for: a key held by a committed claim is waited for in the
	# server (seen in pg_stat_activity); its holder completes it meanwhile,
	# and the guard replays that response without running the handler.
	# A wait that runs out is in flight.
	[ wait_for => 'outcome=REPLAYED failed=none calls=0 status=200 body=first seen_waiting=yes' ],
	[ wait_for_runs_out => 'outcome=IN_FLIGHT failed=none calls=0' ],
	# The server's own tombstones: a key completed with a retention of 1 s
	# and remember_ms of an hour, retried once its retention is over
	# (polled), is EXPIRED with the stored status, no body, the handler not
	# run again; without remember_ms the retry runs the handler again.
	[ server_tombstone => 'retention_over=t outcome=EXPIRED failed=none status=201 body=none calls=1 lookup=EXPIRED/201' ],
	[ server_tombstone_plain => 'outcome=EXECUTED failed=none calls=2' ],
	# Batches (idem_guard_do_many): one claim for all, handlers in input
	# order, a stored key replayed, a key repeated (its first result, or
	# CONFLICT for another fingerprint), a handler error releasing its
	# item alone, which the retry runs; keys that need quoting in an
	# array; no claim: every item UNAVAILABLE.
	[ many => 'outcomes=EXECUTED,REPLAYED,EXECUTED,EXECUTED,CONFLICT,EXECUTED dups=-1,-1,0,-1,0,-1 bodies=many-a:0|created|many-a:0|many-c:3||many-"q\\{,}:5 failed=none,none,none,handler,none,none order=0,3,5' ],
	[ many_states => 'rc=0 a=DONE b=DONE c=NONE q=DONE released=yes' ],
	[ many_retry => 'outcomes=REPLAYED,REPLAYED,REPLAYED,EXECUTED,CONFLICT,REPLAYED dups=-1,-1,0,-1,0,-1 bodies=many-a:0|created|many-a:0|many-c:3||many-"q\\{,}:5 failed=none,none,none,none,none,none order=3' ],
	[ many_unavailable => 'rc=-1 outcomes=UNAVAILABLE,UNAVAILABLE failed=begin order=' ],
	[ done => '' ]);

# The same cases in the cluster's database, then in test/odd_database.sql's
# (SQL_ASCII, with the settings that change how values are written and
# read as text far from their defaults): the guard reads nothing in a form
# those settings change.
$node->safe_psql('postgres', slurp_file("$top/test/odd_database.sql"));
foreach my $db ('postgres', 'idem_odd')
{
	my %got = run_guard($db);
	foreach my $case (@expected)
	{
		my ($name, $line) = @$case;
		is($got{$name}, $line, "$db: $name");
	}

	# Exactly the keys whose complete failed or whose claim was kept are
	# left PROCESSING.
	is( $node->safe_psql(
			$db,
			"SELECT string_agg(key, ',' ORDER BY key) FROM idem.keys"
			  . " WHERE scope = 'gt' AND status IS NULL"),
		'complete-lost,heartbeat-lost,held,release-fault,superseded,waited-held',
		"$db: keys left PROCESSING");

	# Every key written has its primary key entry (amcheck).
	idem_amcheck($node, $db);
}

$node->stop;
done_testing();
