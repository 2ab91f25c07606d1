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
package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use PostgreSQL::Test::Cluster;

our @EXPORT = qw(idem_node);

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

1;
