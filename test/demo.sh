#!/bin/sh
# The README's first command (make demo): build and install idem and its
# client guard, start a throwaway cluster, and replay the Go guard
# document's scenarios against it with the guard (test/demo/idem_demo.c).
# Prints one line per scenario; exits non-zero if any figure differs.
# IDEM_DEMO_PORT sets the throwaway cluster's port (default 54329).
set -eu
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"

sudo=""
if [ "$(id -u)" -ne 0 ]; then
	if ! command -v sudo >/dev/null 2>&1; then
		echo "make demo installs idem into the server's directories: run it as root, or install sudo (apt-get install sudo) and give this user sudo rights" >&2
		exit 2
	fi
	sudo="sudo"
fi
make -s
$sudo make -s install >/dev/null

dir=/tmp/idem-demo.$$
port=${IDEM_DEMO_PORT:-54329}
# No libpq variable of the caller's reaches a connection (test/ports.sh).
. "$top/test/ports.sh"
bindir=$(pg_config --bindir)
trap 'sh "$top/test/cluster.sh" stop "$dir"; rm -rf "$dir"' EXIT
trap 'exit 130' INT TERM
echo "starting a throwaway cluster in $dir"
sh test/cluster.sh start "$dir" "$port"

# The demo moves the server clock with idem.clock_offset, a superuser
# setting: it connects as the cluster's superuser.
conninfo="host=$dir port=$port user=postgres dbname=postgres"
"$bindir/psql" -X -q -d "$conninfo" -c 'CREATE EXTENSION idem'
# No server listens on the next port's socket in the cluster's directory:
# the store is down.
down="host=$dir port=$((port + 1)) user=postgres dbname=postgres connect_timeout=2"
test/demo/idem_demo "$conninfo" "$down"
