# idem on Citus: a coordinator and two workers, idem.keys distributed by
# key (and, in a second database, by scope, colocated with a tenant
# table), every idem function delegated to the node that holds the key's
# shard.
#
# Skipped when Citus is not installed for this server (PostgreSQL 15: no
# Citus release builds against it; the 17 and 18 chroots of make matrix
# build it, see test/matrix.sh).
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IPC::Run;
use IdemTest;
use Test::More;

my $sharedir = `pg_config --sharedir`;
chomp $sharedir;
if (!-f "$sharedir/extension/citus.control")
{
	plan skip_all => "Citus is not installed for this server "
	  . "($sharedir/extension/citus.control is missing); "
	  . "make matrix builds it in the PostgreSQL 17 and 18 chroots";
}

my @pgbench_runs;
END
{
	# A pgbench left running by a failed test.
	$_->kill_kill for grep { $_->pumpable } @pgbench_runs;
}

sub citus_node
{
	my ($name) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);
	$node->init(allows_streaming => 'logical');
	$node->append_conf('postgresql.conf', qq{
shared_preload_libraries = 'citus,idem'
citus.node_conninfo = 'sslmode=disable'
citus.shard_replication_factor = 1
citus.node_connection_timeout = '5s'
max_connections = 60
max_worker_processes = 16
max_prepared_transactions = 60
max_replication_slots = 10
max_wal_senders = 10
idem.purge_naptime = 1
citus.local_hostname = '${\ $node->host}'
});
	$node->start;
	return $node;
}

my $coord = citus_node('coordinator');
my $w1 = citus_node('worker1');
my $w2 = citus_node('worker2');
my $host = $coord->host;

# Citus in a database of every node, the workers registered, idem created
# on the coordinator (Citus creates it on the workers).
sub citus_database
{
	my ($db) = @_;
	if ($db ne 'postgres')
	{
		$_->safe_psql('postgres', "CREATE DATABASE $db") for ($coord, $w1, $w2);
	}
	$_->safe_psql($db, 'CREATE EXTENSION citus') for ($coord, $w1, $w2);
	$coord->safe_psql($db, qq{
SELECT citus_set_coordinator_host('$host', ${\ $coord->port});
SELECT citus_add_node('$host', ${\ $w1->port});
SELECT citus_add_node('$host', ${\ $w2->port});
CREATE EXTENSION idem;
});
}

citus_database('postgres');
is($w1->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idem'}),
	$coord->safe_psql('postgres', q{SELECT extversion FROM pg_extension WHERE extname = 'idem'}),
	'CREATE EXTENSION idem on the coordinator created it on the workers');

# Before distribution idem works on the coordinator's own table.
is($coord->safe_psql('postgres', q{SELECT claimed FROM idem_begin('before', 'f')}),
	't', 'a key claimed before distribution');

$coord->safe_psql('postgres', q{SELECT idem_distribute(shard_count => 8)});
is($coord->safe_psql('postgres', q{
SELECT column_to_column_name(logicalrelid, partkey) FROM pg_dist_partition
 WHERE logicalrelid = 'idem.keys'::regclass}), 'key', 'idem.keys distributed by key');
$coord->safe_psql('postgres', q{SELECT idem_distribute(shard_count => 8)});
is($coord->safe_psql('postgres', q{
SELECT string_agg(p.proname || ':' || o.distribution_argument_index || ':' || o.force_delegation, ',' ORDER BY p.proname)
  FROM pg_dist_object o JOIN pg_proc p ON o.classid = 'pg_proc'::regclass AND o.objid = p.oid
 WHERE p.proname LIKE 'idem\_%'}),
	'idem_begin:0:true,idem_checkpoint:0:true,idem_complete:0:true,idem_evict:0:true,idem_extend:0:true,idem_force_release:0:true,idem_hold:0:true,idem_lookup:0:true,idem_release:0:true',
	'running idem_distribute() again is harmless; every key function is delegated by its key');
my ($rc, $out, $err) = $coord->psql('postgres', q{SELECT idem_distribute('scope')});
like($err, qr/already distributed by key/, 'distributing by another column is refused');

# The key claimed before distribution was copied into its shard; the
# coordinator's own table is empty.
is($coord->safe_psql('postgres', q{SELECT state FROM idem_begin('before', 'other')}),
	'CONFLICT', 'the key stored before distribution lives on in its shard');
is($coord->safe_psql('postgres', q{SELECT pg_relation_size('idem.keys')}), '0',
	'the coordinator\'s idem.keys stays empty');

# Where the key's shard is: the worker node, and its shard id.
sub placement
{
	my ($node, $db, $table, $value) = @_;
	return split /\|/, $node->safe_psql($db, qq{
SELECT n.nodeport, p.shardid FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid)
 WHERE p.shardid = get_shard_id_for_distribution_column('$table', '$value'::text)});
}

# Rows of a table in the shards placed on a worker, read there directly.
sub rows_on
{
	my ($node, $db, $table, $where) = @_;
	return $node->safe_psql($db, rows_on_sql($table, $where // 'true'));
}

# Replay, conflict, takeover and a stale token, through the coordinator.
my $t1 = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('k-basic', 'fp', lease => '1 second')});
like($t1, qr/^\d+$/, 'a claim through the coordinator');
is($coord->safe_psql('postgres', q{SELECT state FROM idem_begin('k-basic', 'fp', wait => false)}),
	'PROCESSING', 'a second call while the lease lasts answers in flight');
$coord->poll_query_until('postgres',
	q{SELECT claimed FROM idem_begin('k-basic', 'fp', lease => '1 hour')})
  or die 'the lease of k-basic never ended';
my $t2 = $coord->safe_psql('postgres', q{SELECT token FROM idem_lookup('k-basic')});
cmp_ok($t2, '>', $t1, 'a takeover after the lease gets a greater token');
($rc, $out, $err) = $coord->psql('postgres',
	qq{SELECT idem_complete('k-basic', 'fp', 200, '\\x01'::bytea, $t1)});
like($err, qr/held by a newer claim/, 'the stale holder\'s complete is refused');
$coord->safe_psql('postgres', qq{SELECT idem_complete('k-basic', 'fp', 200, '\\x01'::bytea, $t2)});
is($coord->safe_psql('postgres', q{SELECT state, status, body FROM idem_begin('k-basic', 'fp')}),
	'DONE|200|\x01', 'a retry replays the stored response');
is($coord->safe_psql('postgres', q{SELECT state, status FROM idem_begin('k-basic', 'other')}),
	'CONFLICT|', 'another request with the same key is a conflict');

# wait_for through the coordinator: the call is delegated to the worker
# that holds the key's shard and waits there for the holder's answer.
my $tw = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('k-wait', 'fp', lease => '1 hour')});
my ($wport) = placement($coord, 'postgres', 'idem.keys', 'k-wait');
my $wnode = $wport == $w1->port ? $w1 : $w2;
my $cwaiter = $coord->background_psql('postgres');
$cwaiter->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, status FROM idem_begin('k-wait', 'fp', wait_for => '5 min');
});
ok( $wnode->poll_query_until('postgres', q{
	SELECT count(*) > 0 FROM pg_stat_activity
	 WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%'}),
	'wait_for: the duplicate waits on the worker that holds the key');
$coord->safe_psql('postgres', qq{SELECT idem_complete('k-wait', 'fp', 201, 'x', $tw)});
is($cwaiter->query_safe('SELECT 1'), "f|DONE|201\n1",
	'wait_for: the duplicate replays the response completed through the coordinator');
$cwaiter->quit;

# A completion Citus commits with two-phase commit (its transaction also
# claimed a key on the other worker) wakes the waiter at COMMIT PREPARED,
# not when its wait_for of five minutes ends.
my $t2pc = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('k-wait-2pc', 'fp', lease => '1 hour')});
my ($p2pc) = placement($coord, 'postgres', 'idem.keys', 'k-wait-2pc');
my $n2pc = $p2pc == $w1->port ? $w1 : $w2;
my ($elsewhere) = grep { (placement($coord, 'postgres', 'idem.keys', $_))[0] != $p2pc }
  map { "k-other-$_" } 1 .. 64;
my $w2pc = $coord->background_psql('postgres');
$w2pc->query_until(qr/start/, q{
	\echo start
	SELECT claimed, state, status FROM idem_begin('k-wait-2pc', 'fp', wait_for => '5 min');
});
ok( $n2pc->poll_query_until('postgres', q{
	SELECT count(*) > 0 FROM pg_stat_activity
	 WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%'}),
	'2PC: the duplicate waits on the worker that holds the key');
my $committed2pc = $coord->safe_psql('postgres', qq{
	BEGIN;
	SELECT claimed FROM idem_begin('$elsewhere', 'fp') \\gset
	SELECT idem_complete('k-wait-2pc', 'fp', 202, 'y', $t2pc) \\gset
	SELECT count(*) AS before FROM pg_dist_transaction \\gset
	COMMIT;
	SELECT count(*) > :before FROM pg_dist_transaction;});
is($committed2pc, 't', '2PC: the transaction was committed with two-phase commit');
is($w2pc->query_safe('SELECT 1'), "f|DONE|202\n1",
	'2PC: COMMIT PREPARED wakes the duplicate, which replays the response');
$w2pc->quit;

my ($port, $shard) = placement($coord, 'postgres', 'idem.keys', 'k-basic');
my ($key_node, $other_node) = $port == $w1->port ? ($w1, $w2) : ($w2, $w1);
is(rows_on($key_node, 'postgres', 'idem.keys', q{key = 'k-basic'}), '1',
	'the key\'s row is in its shard on the worker Citus places it on');
is(rows_on($other_node, 'postgres', 'idem.keys', q{key = 'k-basic'}), '0',
	'and not on the other worker');

# A call that reaches a node without the key's shard is refused, retryably:
# a call Citus does not delegate (here: with a WHERE clause) runs where it
# is made, on the coordinator, or on a worker with metadata.
for my $node ($coord, $other_node)
{
	($rc, $out, $err) = $node->psql('postgres',
		q{\set VERBOSITY verbose
SELECT state FROM idem_begin('k-basic', 'fp') WHERE state <> 'x'});
	like($err, qr/40001: idempotency key "k-basic" is not stored on this node/,
		'a call not delegated is refused with 40001 (retry) on the ' . $node->name);
}

# The one-transaction pattern with a business table colocated with idem.keys.
$coord->safe_psql('postgres', q{
CREATE TABLE ledger (key text COLLATE "C" NOT NULL, id bigserial, note text, PRIMARY KEY (key, id));
SELECT create_distributed_table('ledger', 'key', colocate_with => 'idem.keys');
});
$coord->safe_psql('postgres', q{
BEGIN;
SELECT claimed FROM idem_begin('order-1', 'sku=A');
INSERT INTO ledger (key, note) VALUES ('order-1', 'reserved');
SELECT idem_complete('order-1', 'sku=A', 201, '\x0201'::bytea);
COMMIT;
});
is($coord->safe_psql('postgres', q{
SELECT (SELECT count(*) FROM ledger WHERE key = 'order-1'),
	   (SELECT state || ' ' || status FROM idem_begin('order-1', 'sku=A'))}),
	'1|DONE 201', 'claim, business write and response commit together');
$coord->safe_psql('postgres', q{
BEGIN;
SELECT claimed FROM idem_begin('order-2', 'sku=B');
INSERT INTO ledger (key, note) VALUES ('order-2', 'reserved');
SELECT idem_complete('order-2', 'sku=B', 201, '\x0202'::bytea);
ROLLBACK;
});
is($coord->safe_psql('postgres', q{
SELECT (SELECT count(*) FROM ledger WHERE key = 'order-2'),
	   (SELECT count(*) FROM idem_lookup('order-2'))}),
	'0|0', 'a rollback leaves neither the claim nor the business write');
is($coord->safe_psql('postgres', q{SELECT claimed FROM idem_begin('order-2', 'sku=B')}),
	't', 'after the rollback the key is free');

# Exactly one execution per key: 8 clients through the coordinator over
# 100 keys, each request one transaction (claim, ledger row, complete).
my $script = $coord->basedir . '/once.sql';
PostgreSQL::Test::Utils::append_to_file($script, q{
\set k random(1, 100)
BEGIN;
SELECT claimed FROM idem_begin('once-:k', 'fp') \gset
\if :claimed
INSERT INTO ledger (key, note) VALUES ('once-:k', 'executed');
SELECT idem_complete('once-:k', 'fp', 200, '\x00'::bytea);
\endif
COMMIT;
});

sub pgbench
{
	my ($db, $file, $transactions, $out) = @_;
	my @cmd = ('pgbench', '-n', '-c', '8', '-j', '2', '-t', $transactions,
		'--max-tries', '50', '-f', $file, '-h', $host, '-p', $coord->port, $db);
	my $h = IPC::Run::start(\@cmd, '>', $out, '2>&1');
	push @pgbench_runs, $h;
	return $h;
}
my $once_out = '';
my $h = pgbench('postgres', $script, 100, \$once_out);
$h->finish;
like($once_out, qr/number of failed transactions: 0 /, '8 clients: no failed transaction')
  or diag $once_out;
is($coord->safe_psql('postgres', q{
SELECT count(*) FILTER (WHERE n <> 1) FROM (
	SELECT key, count(*) AS n FROM ledger WHERE key LIKE 'once-%' GROUP BY key) l}),
	'0', 'every key was executed exactly once');
is($coord->safe_psql('postgres', q{
SELECT count(*) FROM ledger l WHERE key LIKE 'once-%'}),
	$coord->safe_psql('postgres', q{
SELECT count(*) FROM idem.keys WHERE key LIKE 'once-%' AND status = 200}),
	'one stored response per execution');
my $on1 = rows_on($w1, 'postgres', 'idem.keys', q{key LIKE 'once-%'});
my $on2 = rows_on($w2, 'postgres', 'idem.keys', q{key LIKE 'once-%'});
ok($on1 > 0 && $on2 > 0, "the keys live on both workers ($on1 and $on2)");
is($on1 + $on2, $coord->safe_psql('postgres', q{SELECT count(*) FROM idem.keys WHERE key LIKE 'once-%'}),
	'every key is in exactly one shard');
is($coord->safe_psql('postgres', q{SELECT pg_relation_size('idem.keys')}), '0',
	'the coordinator\'s idem.keys is still empty');

# A shard move under load.  A key claimed with a short lease, not
# completed, on the shard that moves: its takeover after the move gets a
# greater token.
my ($from_port, $move_shard) = placement($coord, 'postgres', 'idem.keys', 'mv-held');
my ($from, $to) = $from_port == $w1->port ? ($w1, $w2) : ($w2, $w1);
my $held = $coord->safe_psql('postgres',
	q{SELECT token FROM idem_begin('mv-held', 'fp', lease => '1 second')});
my $move_script = $coord->basedir . '/move.sql';
PostgreSQL::Test::Utils::append_to_file($move_script, q{
\set k random(1, 400)
BEGIN;
SELECT claimed FROM idem_begin('mv-:k', 'fp') \gset
\if :claimed
INSERT INTO ledger (key, note) VALUES ('mv-:k', 'executed');
SELECT idem_complete('mv-:k', 'fp', 200, '\x00'::bytea);
\endif
COMMIT;
});
my $move_out = '';
$h = pgbench('postgres', $move_script, 300, \$move_out);
$coord->poll_query_until('postgres', q{SELECT count(*) > 20 FROM ledger WHERE key LIKE 'mv-%'})
  or die 'the load did not start';
$coord->safe_psql('postgres', qq{
SELECT citus_move_shard_placement($move_shard, '$host', ${\ $from->port}, '$host', ${\ $to->port},
	shard_transfer_mode => 'force_logical')});
$h->finish;
like($move_out, qr/number of failed transactions: 0 /, 'no failed transaction during the shard move')
  or diag $move_out;
note 'pgbench during the move: ' . join(', ', $move_out =~ /^(number of transactions retried: .*|total number of retries: .*)$/mg);
is((placement($coord, 'postgres', 'idem.keys', 'mv-held'))[0], $to->port, 'the shard moved');
is($coord->safe_psql('postgres', q{
SELECT count(*) FILTER (WHERE n <> 1) FROM (
	SELECT key, count(*) AS n FROM ledger WHERE key LIKE 'mv-%' GROUP BY key) l}),
	'0', 'no key executed twice across the move');
is($coord->safe_psql('postgres', q{
SELECT count(*) FROM idem.keys k WHERE key LIKE 'mv-%' AND key <> 'mv-held'
   AND NOT EXISTS (SELECT 1 FROM ledger l WHERE l.key = k.key)}),
	'0', 'no claim lost: every stored key has its execution');
is(rows_on($to, 'postgres', 'idem.keys', q{key = 'mv-held'}), '1',
	'the held key is on the new node');
$coord->poll_query_until('postgres',
	q{SELECT claimed FROM idem_begin('mv-held', 'fp', lease => '1 hour')})
  or die 'the lease of mv-held never ended';
cmp_ok($coord->safe_psql('postgres', q{SELECT token FROM idem_lookup('mv-held')}), '>', $held,
	'a takeover after the move gets a greater token than the one given before it');
($rc, $out, $err) = $coord->psql('postgres',
	qq{SELECT idem_complete('mv-held', 'fp', 200, '\\x01'::bytea, $held)});
like($err, qr/held by a newer claim/, 'the holder from before the move is refused');
# Released and claimed again on the new node: still greater.
my $before_release = $coord->safe_psql('postgres', q{SELECT token FROM idem_lookup('mv-held')});
$coord->safe_psql('postgres', qq{SELECT idem_release('mv-held', $before_release)});
cmp_ok($coord->safe_psql('postgres', q{SELECT token FROM idem_begin('mv-held', 'fp')}), '>',
	$before_release, 'a claim after a release gets a greater token');

# Purge on the workers: expired keys disappear from the shards by the
# workers' own purge, the coordinator's table stays empty.
$coord->safe_psql('postgres', qq{SELECT count(*) FROM idem_begin('exp-$_', 'f', lease => '1 second', retention => '10 seconds')})
  for 1 .. 20;
my $exp1 = rows_on($w1, 'postgres', 'idem.keys', q{key LIKE 'exp-%'});
my $exp2 = rows_on($w2, 'postgres', 'idem.keys', q{key LIKE 'exp-%'});
ok($exp1 > 0 && $exp2 > 0, "expiring keys on both workers ($exp1 and $exp2)");
for my $w ($w1, $w2)
{
	$w->poll_query_until('postgres', qq{SELECT (${\ rows_on_sql('idem.keys', q{key LIKE 'exp-%'})}) = 0})
	  or die 'the purge did not delete the expired keys';
}
pass('each worker\'s purge deleted the expired keys of its shards');
cmp_ok($w1->safe_psql('postgres', q{SELECT purged_rows FROM idem_stats WHERE datname = 'postgres'})
	  + $w2->safe_psql('postgres', q{SELECT purged_rows FROM idem_stats WHERE datname = 'postgres'}),
	'>=', 20, 'idem_stats of the workers count the purged rows');
is($coord->safe_psql('postgres', q{SELECT idem_purge()}), '0',
	'purge on the coordinator finds nothing to delete');
is($coord->safe_psql('postgres', q{SELECT pg_relation_size('idem.keys')}), '0',
	'the coordinator\'s idem.keys is still empty after purge');

sub rows_on_sql
{
	my ($table, $where) = @_;
	return qq{
SELECT coalesce(sum((xpath('/row/c/text()', query_to_xml(
		'SELECT count(*) AS c FROM $table\_' || p.shardid || \$q\$ WHERE $where\$q\$,
		false, true, '')))[1]::text::int), 0)
  FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid)
 WHERE s.logicalrelid = '$table'::regclass
   AND p.groupid = (SELECT groupid FROM pg_dist_local_group)};
}

# A worker stopped: calls for its keys fail, the others go on.
my @keys_w1;
my @keys_w2;
for my $i (1 .. 40)
{
	my ($p) = placement($coord, 'postgres', 'idem.keys', "down-$i");
	push @{ $p == $w1->port ? \@keys_w1 : \@keys_w2 }, "down-$i";
}
$w2->stop('fast');
($rc, $out, $err) = $coord->psql('postgres', qq{SELECT claimed FROM idem_begin('$keys_w2[0]', 'f')});
isnt($rc, 0, 'a call for a key of the stopped worker fails');
like($err, qr/connect|remote node|server closed/i, 'as unavailable (no connection to its node)')
  or diag $err;
is($coord->safe_psql('postgres', qq{SELECT claimed FROM idem_begin('$keys_w1[0]', 'f')}),
	't', 'a key of the running worker is still claimed');
$w2->start;
is($coord->safe_psql('postgres', qq{SELECT claimed FROM idem_begin('$keys_w2[0]', 'f')}),
	't', 'after the restart the stopped worker\'s keys work again');

# Distribution by scope, colocated with a table distributed by tenant, in
# a database of its own.
citus_database('tenants');
$coord->safe_psql('tenants', q{
CREATE TABLE tenant_orders (tenant text COLLATE "C" NOT NULL, id int NOT NULL, PRIMARY KEY (tenant, id));
SELECT create_distributed_table('tenant_orders', 'tenant', shard_count => 4);
SELECT idem_distribute('scope', colocate_with => 'tenant_orders');
});
is($coord->safe_psql('tenants', q{
SELECT count(DISTINCT colocationid) FROM pg_dist_partition
 WHERE logicalrelid IN ('idem.keys'::regclass, 'tenant_orders'::regclass)}),
	'1', 'idem.keys distributed by scope, colocated with the tenant table');
for my $tenant ('acme', 'globex', 'initech', 'umbrella')
{
	$coord->safe_psql('tenants', qq{
BEGIN;
SELECT claimed FROM idem_begin('req-1', 'f', scope => '$tenant');
INSERT INTO tenant_orders VALUES ('$tenant', 1);
SELECT idem_complete('req-1', 'f', 201, '\\x01'::bytea, scope => '$tenant');
COMMIT;
});
}
is(join(',', map { $coord->safe_psql('tenants', qq{SELECT state FROM idem_begin('req-1', 'f', scope => '$_')}) }
		('acme', 'globex', 'initech', 'umbrella')),
	'DONE,DONE,DONE,DONE', 'one key per tenant, each with its order');
is(rows_on($w1, 'tenants', 'idem.keys') + rows_on($w2, 'tenants', 'idem.keys'), '4',
	'the tenants\' keys are in the workers\' shards');
my $tenants_on_w1 = $w1->safe_psql('tenants', rows_on_sql('idem.keys', 'true'));
is($w1->safe_psql('tenants', rows_on_sql('tenant_orders', 'true')), $tenants_on_w1,
	'each tenant\'s key is on the node of its orders');

# Distributing again is harmless.
$coord->safe_psql('tenants', q{SELECT idem_distribute('scope', colocate_with => 'tenant_orders')});
is($coord->safe_psql('tenants', q{SELECT state FROM idem_begin('req-1', 'f', scope => 'acme')}),
	'DONE', 'after idem_distribute() again the keys are still there');

# Shard moves and the one-transaction pattern through the coordinator:
# claim, business write, complete.  A move takes the shard's metadata lock
# on the coordinator, then on the workers; idem takes the coordinator's
# before Citus routes the claim (src/citus.c), so a move waits for the
# transaction, or the claim waits for the move and is routed to the
# shard's new node: no distributed deadlock either way.  In a database of
# its own: orders distributed by tenant, idem.keys by scope colocated with
# them.
citus_database('moves');
$coord->safe_psql('moves', q{
CREATE TABLE orders (tenant text COLLATE "C" NOT NULL, id int NOT NULL, PRIMARY KEY (tenant, id));
SELECT create_distributed_table('orders', 'tenant', shard_count => 4);
SELECT idem_distribute('scope', colocate_with => 'orders');
});

# A session of the moves database on node, and its backend's pid.
sub moves_session
{
	my ($node) = @_;
	my $s = $node->background_psql('moves', on_error_stop => 0);
	$s->query_safe(q{SET client_min_messages = warning});
	return ($s, $s->query_safe('SELECT pg_backend_pid()'));
}

# Run sql in the background session s: its output and its errors (also
# those of a statement started before with query_until).
sub run_in
{
	my ($s, $sql) = @_;
	my $out = $s->query($sql);
	my $err = $s->{stderr};
	$s->{stderr} = '';
	return ($out, $err);
}

# Wait until the backend pid of node waits for a lock.
sub waits_for_lock
{
	my ($node, $pid) = @_;
	return $node->poll_query_until('moves',
		qq{SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $pid AND NOT granted)});
}

# Wait until a shard move waits on node for the ExclusiveLock on a shard's
# metadata, which it takes to block writes to the shard.
sub move_waits_on
{
	my ($node) = @_;
	return $node->poll_query_until('moves', q{
SELECT EXISTS (SELECT 1 FROM pg_locks
				WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND NOT granted)});
}

# Hold the metadata lock of shardid's shard group on node, as a running
# call does, until the session commits.
sub hold_shard
{
	my ($node, $shardid) = @_;
	my ($s) = moves_session($node);
	$s->query_safe(qq{BEGIN; SELECT lock_shard_metadata(5, ARRAY[$shardid]::bigint[])});
	return $s;
}

# The claim and the transaction's rest: the order, the response, COMMIT.
sub claim_sql
{
	my ($key, $tenant) = @_;
	return qq{BEGIN;
SELECT claimed FROM idem_begin('$key', 'f', scope => '$tenant');
};
}
sub write_sql
{
	my ($key, $tenant) = @_;
	return qq{INSERT INTO orders VALUES ('$tenant', 1);
SELECT 'completed' FROM idem_complete('$key', 'f', 201, '\\x01'::bytea, scope => '$tenant');
COMMIT;};
}

# The transaction committed once, and its key reads back, from the node
# the shard moved to.
sub committed_once
{
	my ($name, $key, $tenant, $to) = @_;
	is($coord->safe_psql('moves', qq{
SELECT (SELECT count(*) FROM orders WHERE tenant = '$tenant'),
	   (SELECT count(*) FROM idem.keys WHERE scope = '$tenant' AND status = 201)}),
		'1|1', "$name: exactly one order and one completed key");
	is($coord->safe_psql('moves', qq{
SELECT state || ' ' || status FROM idem_begin('$key', 'f', scope => '$tenant')}),
		'DONE 201', "$name: the key replays its response after the move");
	is(rows_on($to, 'moves', 'idem.keys', qq{key = '$key'}), '1',
		"$name: the key is stored on the shard's new node");
	return;
}

# The shard of idem.keys that tenant is in, and the worker it is on and
# the other one.
sub tenant_shard
{
	my ($tenant) = @_;
	my ($port, $shardid) = placement($coord, 'moves', 'idem.keys', $tenant);
	return ($shardid, $port == $w1->port ? ($w1, $w2) : ($w2, $w1));
}

sub move_sql
{
	my ($shardid, $from, $to) = @_;
	return qq{SELECT true FROM citus_move_shard_placement($shardid, '$host', ${\ $from->port},
	'$host', ${\ $to->port}, shard_transfer_mode => 'block_writes');
};
}

# block_writes, claim first: the move waits on the coordinator for the
# transaction, which writes and commits.
{
	my $name = 'block_writes move after the claim';
	my ($shardid, $from, $to) = tenant_shard('tenant-03');
	my ($a) = moves_session($coord);
	my ($b, $bpid) = moves_session($coord);
	my ($out, $err) = run_in($a, claim_sql('dl-1', 'tenant-03'));
	is("$out$err", 't', "$name: the key is claimed");
	$b->query_until(qr/moving/, "\\echo moving\n" . move_sql($shardid, $from, $to));
	ok(waits_for_lock($coord, $bpid),
		"$name: the move waits for the transaction's lock on the coordinator");
	($out, $err) = run_in($a, write_sql('dl-1', 'tenant-03'));
	is("$out$err", 'completed', "$name: the order and the response commit, no deadlock");
	($out, $err) = run_in($b, 'SELECT 1');
	is("$out$err", "t\n1", "$name: the move completes");
	is((placement($coord, 'moves', 'idem.keys', 'tenant-03'))[0], $to->port,
		"$name: the shard is on its new node");
	committed_once($name, 'dl-1', 'tenant-03', $to);
	$_->quit for ($a, $b);
}

# block_writes, move first: the move holds the coordinator's lock (and
# waits for a worker's, held by a third session), the claim waits for the
# move, then is routed to the shard's new node.
{
	my $name = 'block_writes move before the claim';
	my ($shardid, $from, $to) = tenant_shard('tenant-05');
	my $gate = hold_shard($to, $shardid);
	my ($a, $apid) = moves_session($coord);
	my ($b) = moves_session($coord);
	$b->query_until(qr/moving/, "\\echo moving\n" . move_sql($shardid, $from, $to));
	ok(move_waits_on($to), "$name: the move has begun blocking writes");
	$a->query_until(qr/claiming/, "\\echo claiming\n" . claim_sql('dl-2', 'tenant-05'));
	ok(waits_for_lock($coord, $apid), "$name: the claim waits for the move on the coordinator");
	$gate->query_safe('COMMIT');
	my ($out, $err) = run_in($b, 'SELECT 1');
	is("$out$err", "t\n1", "$name: the move completes");
	($out, $err) = run_in($a, write_sql('dl-2', 'tenant-05'));
	is("$out$err", "t\ncompleted", "$name: the claim, the order and the response commit, no deadlock");
	is((placement($coord, 'moves', 'idem.keys', 'tenant-05'))[0], $to->port,
		"$name: the shard is on its new node");
	committed_once($name, 'dl-2', 'tenant-05', $to);
	$_->quit for ($a, $b, $gate);
}

# The background rebalancer (citus_rebalance_start()):
# all shard groups on one worker first, so that it moves some to the
# other; the tenant (prefix-N) is one of the first group it plans to move.
sub unbalance
{
	my ($prefix) = @_;
	$coord->safe_psql('moves', 'CALL citus_cleanup_orphaned_resources()');
	for my $row (split /\n/, $coord->safe_psql('moves', qq{
SELECT p.shardid FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid)
 WHERE s.logicalrelid = 'orders'::regclass AND p.groupid =
	   (SELECT groupid FROM pg_dist_node WHERE nodeport = ${\ $w2->port})}))
	{
		$coord->safe_psql('moves', move_sql($row, $w2, $w1));
	}
	my $shardid = $coord->safe_psql('moves',
		q{SELECT shardid FROM get_rebalance_table_shards_plan() LIMIT 1});
	my $tenant = $coord->safe_psql('moves', qq{
SELECT t FROM (SELECT '$prefix-' || i AS t FROM generate_series(1, 1000) i) c
 WHERE (SELECT shardminvalue FROM pg_dist_shard
		 WHERE shardid = get_shard_id_for_distribution_column('orders', t))
	 = (SELECT shardminvalue FROM pg_dist_shard WHERE shardid = $shardid)
 ORDER BY t LIMIT 1});
	return ($tenant, $shardid);
}

sub rebalance_done
{
	my ($name) = @_;
	$coord->safe_psql('moves', 'SELECT citus_rebalance_wait()');
	is($coord->safe_psql('moves',
		q{SELECT state FROM pg_dist_background_job ORDER BY job_id DESC LIMIT 1}),
		'finished', "$name: the rebalance completes");
	return;
}

# Rebalance, move first: the move holds the coordinator's lock, waiting
# for the worker's; the claim waits for it.
{
	my $name = 'rebalance move before the claim';
	my ($tenant, $shardid) = unbalance('rb-first');
	my $gate = hold_shard($w2, $shardid);
	my ($a, $apid) = moves_session($coord);
	$coord->safe_psql('moves', 'SELECT citus_rebalance_start()');
	ok(move_waits_on($w2), "$name: the move has begun blocking writes");
	$a->query_until(qr/claiming/, "\\echo claiming\n" . claim_sql('dl-3', $tenant));
	ok(waits_for_lock($coord, $apid), "$name: the claim waits for the move on the coordinator");
	$gate->query_safe('COMMIT');
	my ($out, $err) = run_in($a, write_sql('dl-3', $tenant));
	is("$out$err", "t\ncompleted", "$name: the claim, the order and the response commit, no deadlock");
	rebalance_done($name);
	is((placement($coord, 'moves', 'idem.keys', $tenant))[0], $w2->port,
		"$name: the shard is on its new node");
	committed_once($name, 'dl-3', $tenant, $w2);
	$_->quit for ($a, $gate);
}

# Rebalance, claim first, blocking writes from the start (with logical
# replication the move would wait for the transaction before it locks
# anything, when it creates its replication slot): the move waits on the
# coordinator for the transaction.
{
	my $name = 'rebalance (block_writes) move after the claim';
	my ($tenant) = unbalance('rb-second');
	my ($a, $apid) = moves_session($coord);
	my ($out, $err) = run_in($a, claim_sql('dl-4', $tenant));
	is("$out$err", 't', "$name: the key is claimed");
	$coord->safe_psql('moves',
		q{SELECT citus_rebalance_start(shard_transfer_mode => 'block_writes')});
	ok(move_waits_on($coord),
		"$name: the move waits for the transaction's lock on the coordinator");
	($out, $err) = run_in($a, write_sql('dl-4', $tenant));
	is("$out$err", 'completed', "$name: the order and the response commit, no deadlock");
	rebalance_done($name);
	is((placement($coord, 'moves', 'idem.keys', $tenant))[0], $w2->port,
		"$name: the shard is on its new node");
	committed_once($name, 'dl-4', $tenant, $w2);
	$a->quit;
}

# The benchmark (IDEM_CITUS_BENCH=seconds; doc/citus.md): the one-transaction
# request (claim, business row, complete) on new keys, 8 clients, through
# the coordinator to the two workers, against single-node idem in a
# database of the coordinator without Citus, in the same run.
if ($ENV{IDEM_CITUS_BENCH})
{
	my $secs = $ENV{IDEM_CITUS_BENCH};
	$coord->safe_psql('postgres', 'CREATE DATABASE single');
	$coord->safe_psql('single', q{
CREATE EXTENSION idem;
CREATE TABLE ledger (key text COLLATE "C" NOT NULL, id bigserial, note text, PRIMARY KEY (key, id));
});
	my $bench = $coord->basedir . '/bench.sql';
	PostgreSQL::Test::Utils::append_to_file($bench, q{
\set k random(1, 1000000000)
BEGIN;
SELECT claimed FROM idem_begin('b-:client_id-:k', 'fp') \gset
\if :claimed
INSERT INTO ledger (key, note) VALUES ('b-:client_id-:k', 'executed');
SELECT idem_complete('b-:client_id-:k', 'fp', 200, '\x00'::bytea);
\endif
COMMIT;
});
	for my $db ('single', 'postgres')
	{
		my $bout = '';
		IPC::Run::run(['pgbench', '-n', '-c', '8', '-j', '2', '-T', $secs, '--max-tries', '50',
			'-f', $bench, '-h', $host, '-p', $coord->port, $db], '>', \$bout, '2>&1');
		my ($tps) = $bout =~ /^tps = ([\d.]+)/m;
		my ($lat) = $bout =~ /^latency average = ([\d.]+ ms)/m;
		diag(($db eq 'single' ? 'single-node idem' : 'Citus, delegated (2 workers)')
			  . ": $tps tps, latency $lat, 8 clients, ${secs}s");
	}
}

# Every key written has its primary key entry (amcheck): the coordinator's
# own idem.keys (idem_amcheck also creates amcheck there, which Citus
# propagates to the workers), and each shard of idem.keys on the worker
# that holds it, through run_command_on_shards (%s is the shard's name).
sub amcheck_shards
{
	my ($db) = @_;
	idem_amcheck($coord, $db);
	my ($shards, $checked, $failed) = split /\|/, $coord->safe_psql($db, q{
SELECT count(*), count(*) FILTER (WHERE success AND result LIKE '%keys_pkey%'),
       string_agg(shardid || ': ' || result, E'\n') FILTER (WHERE NOT success)
  FROM run_command_on_shards('idem.keys', $cmd$
SELECT string_agg(i.indexrelid::regclass || bt_index_check(i.indexrelid::regclass, true)::text, ',')
  FROM pg_index i WHERE i.indrelid = '%s'::regclass AND i.indisprimary$cmd$)});
	ok($shards > 0 && $checked == $shards,
		"$db: amcheck finds every row of each of the $shards shards of idem.keys in its primary key index")
	  or diag("$shards shards, $checked checked:\n" . ($failed // q{}));
	return;
}
amcheck_shards($_) for qw(postgres tenants moves);
idem_amcheck($coord, 'single') if $ENV{IDEM_CITUS_BENCH};

$coord->stop;
$w1->stop;
$w2->stop;
done_testing();
