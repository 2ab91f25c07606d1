#!/bin/sh
# Start or stop a throwaway PostgreSQL cluster for the demo and benchmark.
#
#   test/cluster.sh start DIR PORT [CONF_LINE...]
#   test/cluster.sh stop DIR
#
# initdb and postgres refuse to run as root, so as root the cluster runs as
# the unprivileged user from test/user.sh.  The socket is in DIR.
set -eu

bindir=$(pg_config --bindir)
cmd=$1
dir=$2
shift 2
# Commands run as the cluster's owner start in /, since the caller's
# directory (say /root) may be closed to that user.
case "$dir" in /*) ;; *) dir=$PWD/$dir ;; esac

as_owner() {
	if [ "$(id -u)" -eq 0 ]; then
		su idemtest -s /bin/sh -c "cd / && $1"
	else
		sh -c "$1"
	fi
}

case "$cmd" in
start)
	port=$1
	shift
	[ "$(id -u)" -eq 0 ] && sh "$(dirname "$0")/user.sh"
	rm -rf "$dir"
	mkdir -p "$dir"
	[ "$(id -u)" -eq 0 ] && chown idemtest "$dir"
	as_owner "'$bindir/initdb' -D '$dir/data' -A trust -U postgres >'$dir/initdb.log' 2>&1"
	{
		echo "port = $port"
		echo "unix_socket_directories = '$dir'"
		echo "listen_addresses = ''"
		echo "shared_preload_libraries = 'idem'"
		for line in "$@"; do echo "$line"; done
	} >>"$dir/data/postgresql.conf"
	as_owner "'$bindir/pg_ctl' -D '$dir/data' -l '$dir/server.log' -w start >/dev/null"
	;;
stop)
	as_owner "'$bindir/pg_ctl' -D '$dir/data' -m fast -w stop >/dev/null" || true
	;;
*)
	echo "usage: $0 start DIR PORT [CONF_LINE...] | stop DIR" >&2
	exit 2
	;;
esac
