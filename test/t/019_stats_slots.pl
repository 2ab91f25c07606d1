# idem_stats has 256 slots, one per database with counters at a time.
# Slots of dropped databases are freed on the launcher's next pass and go
# to databases that had none, also to a session that found every slot
# taken; dropping databases while the launcher visits them logs no FATAL.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;
use Time::HiRes qw(time);

my $slots = 256;

my $node = idem_node('slots', conf => 'idem.purge_naptime = 1',
	extension => []);

my @sessions;
END
{
	eval { $_->quit } for @sessions;
}

# A template with idem: each copy gets a slot on its first purge run.  The
# launcher skips templates, so nothing is connected to it while it is
# copied.
$node->safe_psql('postgres', 'CREATE DATABASE tmpl');
$node->safe_psql('tmpl', 'CREATE EXTENSION idem');
$node->safe_psql('postgres', 'ALTER DATABASE tmpl IS_TEMPLATE true');

# The database the test reads idem_stats from takes one slot; copies of the
# template take the others.
$node->safe_psql('postgres', 'CREATE DATABASE obs TEMPLATE tmpl');
my $started = time;
$node->safe_psql('postgres',
	join('', map { "CREATE DATABASE fill_$_ TEMPLATE tmpl STRATEGY FILE_COPY;\n" }
		  2 .. $slots));
note(sprintf('created %d databases in %.1f s', $slots - 1, time - $started));

ok( $node->poll_query_until('obs',
		'SELECT count(*) FROM idem_stats()', $slots),
	"every one of the $slots slots taken by a purge run");

# One database more: no slot, its calls are not counted.
$node->safe_psql('postgres', 'CREATE DATABASE late TEMPLATE tmpl STRATEGY FILE_COPY');
my $late = $node->background_psql('late');
push @sessions, $late;
$late->query_safe("SELECT count(*) FROM idem_begin('k1', 'f')");
is( $node->safe_psql('obs',
		"SELECT count(*) FROM idem_stats WHERE datname = 'late'"),
	'0', 'a database beyond the slots is not counted');

# Drop many databases while the launcher walks through them: the last ones
# created, which a pass visits last, so that the pass under way still has
# them in its list.
my $offset = -s $node->logfile;
$started = time;
$node->safe_psql('postgres',
	join('', map { "DROP DATABASE fill_$_;\n" } reverse($slots - 39 .. $slots)));
note(sprintf('dropped 40 databases in %.1f s', time - $started));

ok( $node->poll_query_until('obs', q{
SELECT count(*) FROM idem_stats() s
WHERE NOT EXISTS (SELECT FROM pg_database d WHERE d.oid = s.dbid)}, '0'),
	'the slots of dropped databases are freed');

# The session that found no slot counts once a slot is free.
$late->query_safe("SELECT count(*) FROM idem_begin('k2', 'f')");
$late->query_safe("SELECT count(*) FROM idem_begin('k2', 'f')");
ok( $node->poll_query_until('obs',
		"SELECT claims, in_flight FROM idem_stats WHERE datname = 'late'",
		'1|1'),
	'the database without a slot gets a freed one: its next calls are counted');
my $fill = $node->safe_psql('obs', q{
SELECT count(*) FROM idem_stats WHERE datname LIKE 'fill\_%'});
is($fill, $slots - 1 - 40, 'the remaining databases keep their slots');

my @fatal = grep { /FATAL:/ } split /\n/, slurp_file($node->logfile, $offset);
is(scalar(@fatal), 0, 'no FATAL while databases were dropped under the launcher')
  or diag(join("\n", @fatal[ 0 .. ($#fatal > 4 ? 4 : $#fatal) ]));

$late->quit;
@sessions = ();
# Every key written (only the database late had keys) has its primary key
# entry (amcheck).
idem_amcheck($node, 'late');
$node->stop;
done_testing();
