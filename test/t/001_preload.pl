# idem without shared_preload_libraries: the functions work, the counters
# say clearly that the library is not preloaded.  With it, they count.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('plain', preload => 0);

is($node->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('k', 'f', lease => '1 hour')"),
	't|PROCESSING', 'claim works without preload');
my ($ret, $out, $err) = $node->psql('postgres', 'SELECT * FROM idem_stats');
isnt($ret, 0, 'idem_stats fails without preload');
like($err, qr/the library is not preloaded/, 'idem_stats says why');
is($node->safe_psql('postgres', 'SELECT idem_purge()'), '0',
	'idem_purge works without preload');
$node->stop;

$node->append_conf('postgresql.conf', "shared_preload_libraries = 'idem'");
$node->start;
$node->safe_psql('postgres',
	"SELECT * FROM idem_begin('k', 'f'); SELECT * FROM idem_begin('k', 'g')");
is($node->safe_psql('postgres',
		"SELECT in_flight, conflicts FROM idem_stats WHERE datname = 'postgres'"),
	'1|1', 'counters count with preload');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');
$node->stop;

done_testing();
