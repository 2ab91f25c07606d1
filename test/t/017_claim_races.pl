# Races on one key under pgbench.
#
# 1. Tokens per key only grow.  Eight clients claim, commit and release
#    the same key in a loop; each claiming transaction records its token
#    beside the highest token recorded before it, in the same transaction
#    as the claim.  No token may be at or below an earlier one.
# 2. wait => false never waits.  Eight clients claim the same new key
#    (a new one every quarter second) with wait => false under a 150 ms
#    lock_timeout; the holder keeps its transaction open for 300 ms.  A
#    non-holder that waited for it would fail with 55P03: none may.
# 3. A waiter waits until the holder's transaction ends.  Eight clients
#    claim the same new key (a new one every 10 ms) and the holder
#    completes it in the claiming transaction, so every other client must
#    get the replay.  One that found the key still being inserted
#    (speculatively) once took that short wait for its one wait and
#    answered in flight while the holder's transaction was still open.
# 4. Claims belong to their role.  Two roles, four clients each, claim,
#    commit and release one key in a loop; a client that finds the key in
#    flight tries to release it with the token of its latest claim, when
#    another role made that claim.  No such release may succeed, and every
#    holder's own release must.
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
CREATE TABLE waited (claimed boolean NOT NULL, state text NOT NULL);
});

my $dir = PostgreSQL::Test::Utils::tempdir();

# Start a pgbench script with the given clients as the given role (the
# bootstrap superuser if undef); returns a handle for pgbench_finish.
sub pgbench_start
{
	my ($name, $script, $seconds, $clients, $role) = @_;
	my $file = "$dir/$name.sql";
	PostgreSQL::Test::Utils::append_to_file($file, $script) unless -e $file;
	my %run = (name => $name, out => '', err => '');
	$run{h} = IPC::Run::start(
		[
			'pgbench', '-n', '-c', $clients, '-j', 2, '-T', $seconds, '-f', $file,
			'-h', $node->host, '-p', $node->port,
			(defined $role ? ('-U', $role) : ()), 'postgres'
		],
		'>', \$run{out}, '2>', \$run{err});
	return \%run;
}

# Wait for a pgbench started by pgbench_start; returns its exit status,
# stdout and stderr.
sub pgbench_finish
{
	my ($run) = @_;
	$run->{h}->finish;
	note "pgbench $run->{name} stdout:\n$run->{out}\nstderr:\n$run->{err}";
	return ($run->{h}->result(0), $run->{out}, $run->{err});
}

# Run a pgbench script with eight clients.
sub pgbench
{
	my ($name, $script, $seconds) = @_;
	return pgbench_finish(pgbench_start($name, $script, $seconds, 8));
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
SET LOCAL lock_timeout = '150ms';
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

# --- 3. A waiter waits until the holder's transaction ends.
($rc, $out, $err) = pgbench('waiters', q{
SELECT floor(extract(epoch FROM clock_timestamp()) * 100)::bigint AS n \gset
BEGIN;
INSERT INTO waited SELECT claimed, state FROM idem_begin('w-' || :n, 'f') RETURNING claimed \gset
\if :claimed
SELECT idem_complete('w-' || :n, 'f', 200, 'paid');
\endif
COMMIT;
}, 10);
is($rc, 0, 'pgbench: claim and complete in one transaction ran without error');
unlike($err, qr/ERROR/, 'no client got an SQL error');
my ($wkeys, $wholders, $replays, $in_flight) = split /\|/, $node->safe_psql('postgres', q{
SELECT (SELECT count(*) FROM idem.keys WHERE key LIKE 'w-%'),
       count(*) FILTER (WHERE claimed),
       count(*) FILTER (WHERE NOT claimed AND state = 'DONE'),
       count(*) FILTER (WHERE NOT claimed AND state = 'PROCESSING')
FROM waited});
cmp_ok($wkeys, '>=', 100, "$wkeys keys claimed");
is($wholders, $wkeys, 'each key had exactly one holder');
cmp_ok($replays, '>=', 1000, "$replays waiters got the replay");
is($in_flight, '0', 'no waiter answered in flight while the holder was completing');

# --- 4. Claims belong to their role.
$node->safe_psql('postgres', q{
CREATE ROLE race_a LOGIN;
CREATE ROLE race_b LOGIN;
GRANT EXECUTE ON FUNCTION
  idem_begin(text, text, interval, interval, text, boolean, interval, interval, text),
  idem_release(text, bigint, text)
  TO race_a, race_b;
CREATE TABLE rclaims (token bigint NOT NULL, role name NOT NULL);
CREATE TABLE rown (role name NOT NULL, token bigint NOT NULL, released boolean);
CREATE TABLE rcross (role name NOT NULL, token bigint NOT NULL, holder name NOT NULL,
                     outcome text NOT NULL);
GRANT SELECT, INSERT ON rclaims, rown, rcross TO race_a, race_b;
-- Release the key with another role's token: the outcome, or the SQLSTATE.
CREATE FUNCTION cross_release(tok bigint) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	RETURN CASE WHEN idem_release('rr', tok) THEN 'released' ELSE 'no key' END;
EXCEPTION WHEN OTHERS THEN
	RETURN SQLSTATE;
END $$;
});
my $script = q{
BEGIN;
SELECT claimed, coalesce(token, 0) AS token FROM idem_begin('rr', 'f', lease => '1 min') \gset
\if :claimed
INSERT INTO rclaims VALUES (:token, current_user);
COMMIT;
SELECT pg_sleep(0.002);
INSERT INTO rown SELECT current_user, :token, idem_release('rr', :token);
\else
COMMIT;
INSERT INTO rcross
SELECT current_user, c.token, c.role, cross_release(c.token)
  FROM (SELECT token, role FROM rclaims ORDER BY token DESC LIMIT 1) c
 WHERE c.role <> current_user;
\endif
};
my @runs = map { pgbench_start("roles_$_", $script, 10, 4, "race_$_") } qw(a b);
for my $run (@runs)
{
	($rc, $out, $err) = pgbench_finish($run);
	is($rc, 0, "pgbench as $run->{name}: ran without error");
	unlike($err, qr/ERROR/, "$run->{name}: no client got an SQL error");
}
my ($own, $own_failed, $roles) = split /\|/, $node->safe_psql('postgres', q{
SELECT count(*), count(*) FILTER (WHERE released IS NOT TRUE), count(DISTINCT role) FROM rown});
cmp_ok($own, '>=', 50, "$own claims by $roles roles");
is($own_failed, '0', 'every holder released its own claim');
my ($cross, $stolen, $refused) = split /\|/, $node->safe_psql('postgres', q{
SELECT count(*), count(*) FILTER (WHERE outcome = 'released'),
       count(*) FILTER (WHERE outcome = '42501') FROM rcross});
note "cross-role releases: $cross tried, $refused refused with 42501";
cmp_ok($cross, '>=', 10, "$cross releases tried with another role's token");
is($stolen, '0', "no release with another role's token succeeded");

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');

$node->stop;
done_testing();
