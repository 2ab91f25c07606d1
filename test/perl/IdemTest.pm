# The cluster set-up the TAP suites share.
#
#   use IdemTest;
#   my $node = idem_node('name', conf => q{idem.purge_naptime = 1});
#
# idem_node creates, configures and starts a PostgreSQL::Test::Cluster with
# idem in shared_preload_libraries (preload => 0 leaves it out), the given
# postgresql.conf lines, the given init options (init => {allows_streaming
# => 1}), and CREATE EXTENSION idem in the databases listed in extension
# (default: postgres; extension => [] for none).  The cluster is stopped by
# PostgreSQL::Test::Cluster's END block when the test ends, also when it
# fails.
#
#   idem_amcheck($node, 'postgres');
#
# idem_amcheck checks idem.keys_pkey against idem.keys in the database
# with amcheck's bt_index_check and its heap check, as one test: a row the
# node sees in the table without its index entry (one that idem's direct
# heap path stored but did not index) fails it.  It creates the amcheck
# extension if the database lacks it; on a hot standby, where CREATE
# EXTENSION fails, create it on the primary first.  Each TAP test calls it
# at its end for every database and node that had keys written, while the
# node is up.
package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use PostgreSQL::Test::Cluster;
use Test::More;

our @EXPORT = qw(idem_node idem_amcheck);

sub idem_node
{
	my ($name, %opt) = @_;
	my $node = PostgreSQL::Test::Cluster->new($name);

	$node->init(%{ $opt{init} // {} });
	my $conf = $opt{conf} // '';
	$conf = "shared_preload_libraries = 'idem'\n$conf"
	  unless defined $opt{preload} && !$opt{preload};
	$node->append_conf('postgresql.conf', $conf) if $conf ne '';
	$node->start;
	$node->safe_psql($_, 'CREATE EXTENSION idem')
	  for @{ $opt{extension} // ['postgres'] };
	return $node;
}

sub idem_amcheck
{
	my ($node, $dbname) = @_;
	my ($ret, $out, $err) = $node->psql($dbname, q{
SELECT NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'amcheck') AS missing \gset
\if :missing
CREATE EXTENSION amcheck;
\endif
SELECT bt_index_check('idem.keys_pkey', true);
});
	my $where = $node->name . ", database $dbname";
	my $ok = ok($ret == 0 && $err eq '',
		"amcheck: idem.keys_pkey has every row of idem.keys ($where)");
	diag("bt_index_check('idem.keys_pkey', true) failed ($where), "
		  . "exit status $ret:\n$err")
	  unless $ok;
	return $ok;
}

1;
