# idem without shared_preload_libraries: CREATE EXTENSION says that no
# worker will purge and how to schedule idem_purge() (a WARNING), the functions work,
# the counters say clearly that the library is not preloaded.  With it,
# they count, and CREATE EXTENSION says nothing.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $node = idem_node('plain', preload => 0, extension => []);

my ($ret, $out, $err) = $node->psql('postgres', 'CREATE EXTENSION idem');
is($ret, 0, 'CREATE EXTENSION idem without preload');
like($err,
	qr/WARNING:  idem is not in shared_preload_libraries: no background worker will purge expired keys\n/,
	'CREATE EXTENSION without preload: a WARNING that no worker will purge');
like($err,
	qr/HINT:  Add idem to shared_preload_libraries and restart the server, or run SELECT public\.idem_purge\(\) every minute, from cron \(psql -c\) or with pg_cron: SELECT cron\.schedule\('idem-purge', '\* \* \* \* \*', 'SELECT public\.idem_purge\(\)'\);/,
	'the WARNING names the setting and how to schedule idem_purge()');

is($node->safe_psql('postgres',
		"SELECT claimed, state FROM idem_begin('k', 'f', lease => '1 hour')"),
	't|PROCESSING', 'claim works without preload');
($ret, $out, $err) = $node->psql('postgres', 'SELECT * FROM idem_stats');
isnt($ret, 0, 'idem_stats fails without preload');
like($err, qr/the library is not preloaded/, 'idem_stats says why');
is($node->safe_psql('postgres', 'SELECT idem_purge()'), '0',
	'idem_purge works without preload');
$node->stop;

$node->append_conf('postgresql.conf', "shared_preload_libraries = 'idem'");
$node->start;
$node->safe_psql('postgres', 'CREATE DATABASE preloaded');
($ret, $out, $err) = $node->psql('preloaded', 'CREATE EXTENSION idem');
is($ret, 0, 'CREATE EXTENSION idem with preload');
is($err, '', 'CREATE EXTENSION with preload: no WARNING');
$node->safe_psql('postgres',
	"SELECT * FROM idem_begin('k', 'f'); SELECT * FROM idem_begin('k', 'g')");
is($node->safe_psql('postgres',
		"SELECT in_flight, conflicts FROM idem_stats WHERE datname = 'postgres'"),
	'1|1', 'counters count with preload');

# Every key written has its primary key entry (amcheck).
idem_amcheck($node, 'postgres');
$node->stop;

done_testing();
