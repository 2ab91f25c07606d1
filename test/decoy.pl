# The port check of test/run.sh: a decoy server for the client suites.
#
#   perl test/decoy.pl LOG PORT...
#
# Listens on 127.0.0.1 on a port of the kernel's choosing and on each PORT
# it can bind (a PORT something else holds is busy all the same, and
# logged as such), writes "port N" for the first to LOG, then accepts
# connections until SIGTERM, logging each as "connection to port N" and
# closing it.  test/run.sh points the libpq environment at the first port
# and names the ports the suites once took for themselves: no suite may
# need one of them, and no connection of a suite may reach the decoy,
# which is no server any suite started.
use strict;
use warnings;
use IO::Handle;
use IO::Select;
use IO::Socket::INET;

my ($logfile, @ports) = @ARGV;
die "usage: $0 LOG PORT...\n" unless defined $logfile;
open(my $log, '>>', $logfile) or die "$logfile: $!\n";
$log->autoflush(1);

my $sel = IO::Select->new;
foreach my $port (0, @ports)
{
	my $s = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => $port,
		Proto => 'tcp', Listen => 16, ReuseAddr => 1);
	if (!$s)
	{
		die "no port for the decoy: $!\n" if $port == 0;
		print $log "busy $port\n";
		next;
	}
	print $log "port ", $s->sockport, "\n" if $port == 0;
	$sel->add($s);
}
print $log "ready\n";

$SIG{TERM} = $SIG{INT} = sub { exit 0 };
while (1)
{
	foreach my $s ($sel->can_read)
	{
		my $c = $s->accept or next;
		print $log "connection to port ", $s->sockport, " from port ", $c->peerport, "\n";
		close($c);
	}
}
