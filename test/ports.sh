# shellcheck shell=sh
# Sourced (. test/ports.sh) by every script that starts servers for a
# test suite, so that two suites on one machine (two checkouts, two
# `make test` at once) never reach each other's servers:
#
# - the libpq environment (PGHOST, PGHOSTADDR, PGPORT, PGSERVICE, ...) is
#   cleared: every connection names the server the suite started, and
#   none goes, by a variable of the caller's, to one it did not start;
# - free_port prints a TCP port on 127.0.0.1 that nothing listens on;
# - port_free PORT [WHAT] returns 0 if nothing listens on 127.0.0.1:PORT;
#   otherwise it says "port PORT (WHAT) is in use" and returns 1.
#
# The clusters of test/cluster.sh and the suites' pgbouncers listen on a
# Unix socket in the suite's own directory and on no TCP port: their port
# numbers only name a socket file, which no other suite can reach.  A
# "store is down" DSN names a socket in such a directory that nothing
# creates.  The servers that must listen on TCP (the HTTP apps, the
# Prometheus exporter) bind port 0 where they can report the port the
# kernel gave them; otherwise the suite takes one from free_port and
# fails if its server did not start on it.  perl is the one tool used:
# every Debian has it (perl-base).

for _v in PGHOST PGHOSTADDR PGPORT PGDATABASE PGUSER PGPASSWORD PGPASSFILE \
	PGSERVICE PGSERVICEFILE PGSYSCONFDIR PGOPTIONS PGAPPNAME PGCONNECT_TIMEOUT \
	PGCLIENTENCODING PGDATESTYLE PGTZ PGGEQO PGTARGETSESSIONATTRS \
	PGLOADBALANCEHOSTS PGSSLMODE PGREQUIRESSL PGSSLCOMPRESSION PGSSLCERT \
	PGSSLKEY PGSSLROOTCERT PGSSLCRL PGSSLCRLDIR PGSSLSNI PGREQUIREPEER \
	PGSSLMINPROTOCOLVERSION PGSSLMAXPROTOCOLVERSION PGSSLCERTMODE \
	PGSSLNEGOTIATION PGGSSENCMODE PGGSSDELEGATION PGKRBSRVNAME PGGSSLIB \
	PGCHANNELBINDING PGREQUIREAUTH PGMINPROTOCOLVERSION PGMAXPROTOCOLVERSION; do
	unset "$_v"
done
unset _v

free_port() {
	perl -MIO::Socket::INET -e '
		my $s = IO::Socket::INET->new(LocalAddr => "127.0.0.1", LocalPort => 0,
			Proto => "tcp", Listen => 1) or die "no free TCP port on 127.0.0.1: $!\n";
		print $s->sockport, "\n";'
}

port_free() {
	perl -MIO::Socket::INET -e '
		IO::Socket::INET->new(LocalAddr => "127.0.0.1", LocalPort => $ARGV[0],
			Proto => "tcp", Listen => 1, ReuseAddr => 1) or exit 1;' "$1" && return 0
	echo "port $1${2:+ ($2)} is in use: something else listens on 127.0.0.1:$1" >&2
	return 1
}
