# idem_stats.last_purge_error is kept in one encoding (UTF-8), whatever the
# encoding of the database whose purge failed, and shown in the encoding of
# the database that reads it.
#
# Purges fail in three databases because idem.keys has an index idem does
# not maintain, named with a non-ASCII character: "idx_<e-acute>" in a
# LATIN1 database, "idx_<euro sign>" in a UTF8 one and "idx_<bytes c3 a9>"
# in a SQL_ASCII one.  Read from the UTF8 database, the LATIN1 error shows
# its e-acute; read from the LATIN1 database, the euro sign, which LATIN1
# cannot represent, shows as '?'; the SQL_ASCII database's bytes, whose
# meaning nobody knows, show as one '?' each.  No read fails, also through
# a client encoding the server must convert to.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('stats_encoding', conf => 'idem.purge_naptime = 1',
	extension => []);

# The test talks UTF-8 to every database (the server converts for LATIN1);
# its strings are bytes.
$ENV{PGCLIENTENCODING} = 'UTF8';
my $e_acute = "\xc3\xa9";
my $euro = "\xe2\x82\xac";

my %index = (
	l1 => "idx_$e_acute",
	u8 => "idx_$euro",
	sa => "idx_$e_acute");
my %encoding = (l1 => 'LATIN1', u8 => 'UTF8', sa => 'SQL_ASCII');
for my $db (qw(l1 u8 sa))
{
	$node->safe_psql('postgres',
		"CREATE DATABASE $db ENCODING '$encoding{$db}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
	);
	$node->safe_psql($db, 'CREATE EXTENSION idem');
	$node->safe_psql($db,
		qq{CREATE INDEX "$index{$db}" ON idem.keys (expires_at)});
}

sub error_for
{
	my ($name) = @_;
	return qq{idem cannot use table idem.keys: it has index "$name", which idem does not maintain};
}

my $errors = q{SELECT datname, last_purge_error FROM idem_stats
WHERE datname IN ('l1', 'u8', 'sa') ORDER BY datname};

# Every purge in the three databases fails from now on.
ok( $node->poll_query_until('u8', q{
SELECT count(*) FROM idem_stats
WHERE datname IN ('l1', 'u8', 'sa') AND last_purge_error LIKE '%which idem does not maintain'},
		'3'),
	'the three purge errors are in idem_stats');

# --- Read from the UTF8 database: every character as it was.
is( $node->safe_psql('u8', $errors),
	join("\n",
		'l1|' . error_for("idx_$e_acute"),
		'sa|' . error_for('idx_??'),
		'u8|' . error_for("idx_$euro")),
	'UTF8 reader: e-acute from LATIN1, euro from UTF8, SQL_ASCII bytes as ?');
is( $node->safe_psql('u8', q{
SELECT position(chr(233) IN last_purge_error) > 0,
	pg_catalog.octet_length(last_purge_error) - pg_catalog.length(last_purge_error)
FROM idem_stats WHERE datname = 'l1'}),
	't|1',
	'UTF8 reader: the LATIN1 error holds U+00E9, encoded in two bytes');
is( $node->safe_psql('u8', q{
SELECT bool_and(convert_from(convert_to(last_purge_error, 'UTF8'), 'UTF8') = last_purge_error)
FROM idem_stats}),
	't',
	'UTF8 reader: every error is valid UTF-8');

# A client in LATIN1 makes the server convert, and check, what it sends.
{
	local $ENV{PGCLIENTENCODING} = 'LATIN1';
	is( $node->safe_psql('u8',
			"SELECT last_purge_error FROM idem_stats WHERE datname = 'l1'"),
		error_for("idx_\xe9"),
		'UTF8 reader, LATIN1 client: the LATIN1 error arrives as LATIN1');
}
my ($ret, $out, $err) = $node->psql('u8', 'SELECT * FROM idem_stats');
is($ret, 0, 'UTF8 reader: SELECT * FROM idem_stats succeeds');
is($err, '', 'UTF8 reader: no error or warning');

# --- Read from the LATIN1 database: what LATIN1 cannot represent is '?'.
is( $node->safe_psql('l1', $errors),
	join("\n",
		'l1|' . error_for("idx_$e_acute"),
		'sa|' . error_for('idx_??'),
		'u8|' . error_for('idx_?')),
	'LATIN1 reader: e-acute as itself, the euro sign as ?');
is( $node->safe_psql('l1', q{
SELECT position(chr(233) IN last_purge_error) > 0,
	pg_catalog.octet_length(last_purge_error) = pg_catalog.length(last_purge_error)
FROM idem_stats WHERE datname = 'l1'}),
	't|t',
	'LATIN1 reader: its own error holds e-acute as one LATIN1 byte');
{
	local $ENV{PGCLIENTENCODING} = 'LATIN1';
	($ret, $out, $err) = $node->psql('l1', 'SELECT * FROM idem_stats');
	is($ret, 0, 'LATIN1 reader, LATIN1 client: SELECT * FROM idem_stats succeeds');
	is($err, '', 'LATIN1 reader, LATIN1 client: no error or warning');
	is( $node->safe_psql('l1',
			"SELECT last_purge_error FROM idem_stats WHERE datname = 'l1'"),
		error_for("idx_\xe9"),
		'LATIN1 reader, LATIN1 client: e-acute is byte e9');
}

# --- Read from the SQL_ASCII database: the stored UTF-8 as it is.
is( $node->safe_psql('sa', $errors),
	join("\n",
		'l1|' . error_for("idx_$e_acute"),
		'sa|' . error_for('idx_??'),
		'u8|' . error_for("idx_$euro")),
	'SQL_ASCII reader: the stored UTF-8');

# --- Once the indexes are gone, the next purges clear the errors.
$node->safe_psql($_, qq{DROP INDEX idem."$index{$_}"}) for qw(l1 u8 sa);
ok( $node->poll_query_until('u8', q{
SELECT count(*) FROM idem_stats
WHERE datname IN ('l1', 'u8', 'sa') AND last_purge_error IS NULL}, '3'),
	'the errors clear once the purges succeed');

$node->stop;
done_testing();
