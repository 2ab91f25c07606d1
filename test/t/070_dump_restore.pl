# pg_dump / pg_restore of a database using idem.  The dump keeps the keys
# whose retention window is not over (DONE with their responses, and
# committed PROCESSING claims), the token sequence and the grants made to
# application roles; it leaves out expired keys and claims that were not
# committed when the dump started.  After the restore, completed keys
# replay, a claim's holder completes with its old token, and every new
# token is greater than any token the source ever gave out.  The same holds
# for a database that was created at 1.0 and updated to 1.1.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('dump', conf => qq{
idem.purge_enabled = off
max_prepared_transactions = 5
}, extension => []);
my $tmp = PostgreSQL::Test::Utils::tempdir;

sub sql
{
	my ($db, $query) = @_;
	return $node->safe_psql($db, $query);
}

my $app_functions = 'idem_begin(text,text,interval,interval,text,boolean,interval,interval,text), '
  . 'idem_complete(text,text,integer,bytea,bigint,interval,text)';

# Stores the keys every case below checks; returns the tokens by key.
sub store_keys
{
	my ($db) = @_;
	my %tok;
	my $claim = sub {
		my ($key, $extra) = @_;
		$tok{$key} = sql($db,
			"SELECT token FROM idem_begin('$key', 'fp'$extra)");
		return $tok{$key};
	};

	# Completed keys, one with a binary body, one in a scope, one with a
	# NULL body.
	$claim->('done-bin', ", retention => '2 hours'");
	sql($db, "SELECT idem_complete('done-bin', 'fp', 201, '\\x00ff0a'::bytea, $tok{'done-bin'}, retention => '2 hours')");
	$claim->('done-scoped', ", scope => 't1'");
	sql($db, "SELECT idem_complete('done-scoped', 'fp', 200, 'tenant one', $tok{'done-scoped'}, scope => 't1')");
	$claim->('done-null', '');
	sql($db, "SELECT idem_complete('done-null', 'fp', 204, NULL, $tok{'done-null'})");
	# A committed claim in flight.
	$claim->('flight', ", lease => '10 minutes', retention => '1 hour'");
	# Keys whose window ended an hour ago, done and in flight.
	sql($db, qq{
		SET idem.clock_offset = '-3h';
		SELECT idem_complete('expired-done', 'fp', 200, 'stale',
			(SELECT token FROM idem_begin('expired-done', 'fp', retention => '2 hours')),
			retention => '2 hours');
		SELECT idem_begin('expired-flight', 'fp', retention => '2 hours');
	});
	# Tokens given out after the last stored one: claims given up.
	for my $i (1 .. 5)
	{
		$claim->("released-$i", '');
		sql($db, "SELECT idem_release('released-$i', $tok{\"released-$i\"})");
	}
	return %tok;
}

# The stored keys as one text, to compare source and restored rows.
my $rows_sql = q{SELECT string_agg(format('%s/%s/%s/%s/%s/%s/%s/%s', scope, key,
	encode(fingerprint, 'hex'), token, status, encode(body, 'hex'), lease_until,
	expires_at), E'\n' ORDER BY scope, key) FROM idem.keys};

# Dump $src in custom format and restore it into a new database $dst.
sub dump_and_restore
{
	my ($src, $dst) = @_;
	my $file = "$tmp/$src.dump";
	$node->command_ok([ 'pg_dump', '-Fc', '-f', $file, '-d', $src ],
		"$src: pg_dump");
	sql('postgres', "CREATE DATABASE $dst");
	$node->command_checks_all([ 'pg_restore', '-d', $dst, $file ],
		0, [qr/^$/], [qr/^$/], "$src: pg_restore into $dst without errors");
	return;
}

# The version CREATE EXTENSION installs, from idem.control.
my ($idem_version) = PostgreSQL::Test::Utils::slurp_file(
	($ENV{TESTDIR} || '.') . '/idem.control') =~ /default_version = '([\d.]+)'/;

# Checks on a restored database whose source stored %tok.
sub check_restored
{
	my ($src, $dst, $last_token, %tok) = @_;

	is(sql($dst, "SELECT extversion FROM pg_extension WHERE extname = 'idem'"),
		$idem_version, "$dst: idem $idem_version, the installed default");
	is(sql($dst, 'SELECT string_agg(scope || \'/\' || key || \'/\' || state, \' \' ORDER BY scope, key) FROM idem_keys'),
		'/done-bin/DONE /done-null/DONE /flight/PROCESSING t1/done-scoped/DONE',
		"$dst: the live keys, and no expired, released or uncommitted one");

	# Completed keys replay their responses.
	is(sql($dst, "SELECT claimed, state, token, status, body FROM idem_begin('done-bin', 'fp')"),
		'f|DONE||201|\x00ff0a', "$dst: binary response replays");
	is(sql($dst, "SELECT claimed, state, status, convert_from(body, 'UTF8') FROM idem_begin('done-scoped', 'fp', scope => 't1')"),
		'f|DONE|200|tenant one', "$dst: scoped response replays");
	is(sql($dst, "SELECT claimed, state, status, body IS NULL FROM idem_begin('done-null', 'fp')"),
		'f|DONE|204|t', "$dst: NULL body replays");
	is(sql($dst, "SELECT claimed, state, token, status, body FROM idem_begin('done-bin', 'other')"),
		'f|CONFLICT|||', "$dst: another fingerprint is a conflict");

	# The claim is still in flight; its holder completes it with its token.
	is(sql($dst, "SELECT claimed, state, token FROM idem_begin('flight', 'fp')"),
		'f|PROCESSING|', "$dst: the claim is in flight");
	is(sql($dst, "SELECT idem_complete('flight', 'fp', 200, 'late', $tok{flight}) IS NOT NULL"),
		't', "$dst: its holder completes it with the old token");
	is(sql($dst, "SELECT state, convert_from(body, 'UTF8') FROM idem_begin('flight', 'fp')"),
		'DONE|late', "$dst: and it replays");

	# Expired keys are new again, and new tokens are above every token the
	# source gave out.
	my $next = sql($dst,
		"SELECT string_agg(claimed || '/' || (token > $last_token), ' ' ORDER BY k) "
		  . "FROM unnest(ARRAY['expired-done', 'expired-flight', 'uncommitted', 'brand-new']) k, "
		  . "LATERAL idem_begin(k, 'fp')");
	is($next, 'true/true true/true true/true true/true',
		"$dst: expired, uncommitted and new keys are claimed with tokens above $last_token");

	# Grants to the application role came along; PUBLIC still has none.
	is(sql($dst, qq{SELECT has_function_privilege('app', 'idem_begin(text,text,interval,interval,text,boolean,interval,interval,text)', 'EXECUTE'),
		has_function_privilege('app', 'idem_complete(text,text,integer,bytea,bigint,interval,text)', 'EXECUTE'),
		has_function_privilege('app', 'idem_release(text,bigint,text)', 'EXECUTE'),
		has_function_privilege('public', 'idem_begin(text,text,interval,interval,text,boolean,interval,interval,text)', 'EXECUTE'),
		has_table_privilege('public', 'idem.keys', 'SELECT')}),
		't|t|f|f|f', "$dst: app keeps its grants, PUBLIC has none");
	is(sql($dst, "SET ROLE app; SELECT claimed, state FROM idem_begin('app-key', 'fp')"),
		't|PROCESSING', "$dst: app claims keys");
	return;
}

sql('postgres', 'CREATE ROLE app; CREATE DATABASE src');
sql('src', "CREATE EXTENSION idem; GRANT EXECUTE ON FUNCTION $app_functions TO app");
my %tok = store_keys('src');
cmp_ok($tok{'released-5'}, '>',
	sql('src', 'SELECT max(token) FROM idem.keys'),
	'src: the last released token is above every stored one');

# A claim held by a prepared transaction while the dump runs: it is not in
# the dump, but its token was given out.
my $last_token = sql('src',
	"BEGIN; SELECT token FROM idem_begin('uncommitted', 'fp'); PREPARE TRANSACTION 'held'");
cmp_ok($last_token, '>', $tok{'released-5'}, 'src: the held claim has the last token');

# What the dump holds, as SQL.
my $plain;
$node->command_ok([ 'pg_dump', '-f', "$tmp/src.sql", '-d', 'src' ],
	'src: plain pg_dump');
$plain = PostgreSQL::Test::Utils::slurp_file("$tmp/src.sql");
like($plain, qr/^COPY idem\.keys .*FROM stdin;$/m, 'the dump has the key table data');
for my $key (qw(done-bin done-scoped done-null flight))
{
	like($plain, qr/\t\Q$key\E\t/, "the dump has key $key");
}
for my $key (qw(expired-done expired-flight released-1 uncommitted))
{
	unlike($plain, qr/\Q$key\E/, "the dump does not have key $key");
}
my $seq_last = sql('src', 'SELECT last_value FROM idem.token_seq');
cmp_ok($seq_last, '>=', $last_token, 'src: the token sequence is at or past the last token given out');
like($plain, qr/SELECT pg_catalog\.setval\('idem\.token_seq', $seq_last, true\);/,
	'the dump sets the token sequence to where it stood');
like($plain, qr/GRANT ALL ON FUNCTION public\.idem_begin\(.*\) TO app;/,
	'the dump has the grant to app');

dump_and_restore('src', 'dst');
sql('src', "COMMIT PREPARED 'held'");
is(sql('dst', $rows_sql),
	sql('src', "$rows_sql WHERE expires_at > now() AND key <> 'uncommitted'"),
	'dst: the restored rows are the live source rows, byte for byte');
check_restored('src', 'dst', $last_token, %tok);

# A claim belongs to its role across a dump and a restore into the same
# cluster: another role with the token is refused, the claiming role
# completes it.
sql('postgres', 'CREATE ROLE other');
sql('src', "GRANT EXECUTE ON FUNCTION $app_functions TO other");
my $app_tok = sql('src',
	"SET ROLE app; SELECT token FROM idem_begin('app-flight', 'fp', lease => '10 minutes')");
dump_and_restore('src', 'dst_roles');
is(sql('dst_roles', "SELECT claimed_by FROM idem_keys WHERE key = 'app-flight'"),
	'app', 'dst_roles: the claim is still app\'s');
my ($ret, $out, $err) = $node->psql('dst_roles',
	"SET ROLE other; SELECT idem_complete('app-flight', 'fp', 200, 'forged', $app_tok)");
like($err, qr/permission denied for idempotency key "app-flight"/,
	'dst_roles: another role with the token is refused');
is(sql('dst_roles', "SET ROLE app; SELECT idem_complete('app-flight', 'fp', 200, 'paid', $app_tok) IS NOT NULL"),
	't', 'dst_roles: app completes its claim');

# The same dump restored into another cluster whose roles were created in
# the other order, so that each has the other's OID there: the claim
# stays app's, because it names its role.
my $node2 = idem_node('dump2', conf => qq{
idem.purge_enabled = off
}, extension => []);
$node2->safe_psql('postgres', 'CREATE ROLE filler; CREATE ROLE other; CREATE ROLE app; CREATE DATABASE dst_roles');
is($node2->safe_psql('postgres', q{
	SELECT (SELECT oid FROM pg_roles WHERE rolname = 'app') <> }
	  . sql('postgres', "SELECT oid FROM pg_roles WHERE rolname = 'app'")),
	't', 'cluster 2: app has another OID than in cluster 1');
$node2->command_checks_all([ 'pg_restore', '-d', 'dst_roles', "$tmp/src.dump" ],
	0, [qr/^$/], [qr/^$/], 'cluster 2: pg_restore without errors');
is($node2->safe_psql('dst_roles', "SELECT claimed_by FROM idem_keys WHERE key = 'app-flight'"),
	'app', 'cluster 2: the claim is app\'s');
($ret, $out, $err) = $node2->psql('dst_roles',
	"SET ROLE other; SELECT idem_complete('app-flight', 'fp', 200, 'forged', $app_tok)");
like($err, qr/permission denied for idempotency key "app-flight"/,
	'cluster 2: another role with the token is refused');
is($node2->safe_psql('dst_roles', "SET ROLE app; SELECT idem_complete('app-flight', 'fp', 200, 'paid', $app_tok) IS NOT NULL"),
	't', 'cluster 2: app completes its claim');
idem_amcheck($node2, 'dst_roles');
$node2->stop;

# A role dropped while it holds a claim: a role created later with the
# dropped role's OID (here by setting the OID counter back with
# pg_resetwal, as its wraparound would) does not get the claim; a
# superuser can still release it.
sql('postgres', 'CREATE ROLE doomed');
sql('src', "GRANT EXECUTE ON FUNCTION $app_functions TO doomed");
my $doomed_oid = sql('postgres', "SELECT oid FROM pg_roles WHERE rolname = 'doomed'");
my $doomed_tok = sql('src',
	"SET ROLE doomed; SELECT token FROM idem_begin('doomed-flight', 'fp', lease => '10 minutes')");
sql('src', "REVOKE EXECUTE ON FUNCTION $app_functions FROM doomed");
sql('postgres', 'DROP ROLE doomed');
# A new OID is one no row version of pg_authid has, dead ones included.
sql('postgres', 'VACUUM pg_authid');
$node->stop;
$node->command_ok([ 'pg_resetwal', '-o', $doomed_oid, $node->data_dir ],
	'pg_resetwal sets the OID counter back to the dropped role\'s OID');
$node->start;
# New roles get OIDs from there on.
my $heir;
for my $i (1 .. 5)
{
	sql('postgres', "CREATE ROLE heir$i");
	my $oid = sql('postgres', "SELECT oid FROM pg_roles WHERE rolname = 'heir$i'");
	if ($oid == $doomed_oid)
	{
		$heir = "heir$i";
		last;
	}
	last if $oid > $doomed_oid;
}
ok(defined $heir, 'a new role has the dropped role\'s OID');
$heir //= 'heir1';
sql('src', "GRANT EXECUTE ON FUNCTION $app_functions TO $heir");
($ret, $out, $err) = $node->psql('src',
	"SET ROLE $heir; SELECT idem_complete('doomed-flight', 'fp', 200, 'stolen', $doomed_tok)");
like($err, qr/permission denied for idempotency key "doomed-flight"/,
	'the role with the dropped role\'s OID is refused');
is(sql('src', "SELECT idem_release('doomed-flight', $doomed_tok)"),
	't', 'a superuser releases the dropped role\'s claim');

# A database created at 1.0, with keys and a grant, then updated.
sql('postgres', 'CREATE DATABASE src10');
# (the signature idem_begin had before 1.4)
(my $app_functions_10 = $app_functions) =~ s/boolean,interval,interval,text\)/boolean)/;
sql('src10', "CREATE EXTENSION idem VERSION '1.0'; GRANT EXECUTE ON FUNCTION $app_functions_10 TO app");
my %tok10 = store_keys('src10');
sql('src10', 'ALTER EXTENSION idem UPDATE');
my $last_token10 = sql('src10',
	"BEGIN; SELECT token FROM idem_begin('uncommitted', 'fp'); PREPARE TRANSACTION 'held10'");
dump_and_restore('src10', 'dst10');
sql('src10', "ROLLBACK PREPARED 'held10'");
is(sql('dst10', $rows_sql),
	sql('src10', "$rows_sql WHERE expires_at > now()"),
	'dst10: the restored rows are the live source rows, byte for byte');
check_restored('src10', 'dst10', $last_token10, %tok10);

# Every key written, and every key restored by pg_restore, has its primary
# key entry (amcheck).
idem_amcheck($node, $_) for qw(src dst dst_roles src10 dst10);

$node->stop;
done_testing();
