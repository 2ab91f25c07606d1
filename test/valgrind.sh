#!/bin/sh
# Run the pg_regress suite (and, with VALGRIND_ISOLATION=1, the isolation
# specs) against a server running under valgrind's memcheck, then report
# every error valgrind found in any server process.  Slow (minutes), so
# not part of make test.  Run as root it installs idem and runs the server
# as the unprivileged user from test/user.sh in a copy of the tree.
#
#   sh test/valgrind.sh          # or: make valgrind-check
#
# Output: test/output/valgrind/ (logs/PID.log per server process, with a
# ready-made suppression after each error; the test results; the server
# log).  Exits non-zero if valgrind reported an error or a test failed.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
pg_config=${PG_CONFIG:-pg_config}
bindir=$("$pg_config" --bindir)

# Debian's valgrind package, if missing (as make deps installs the rest).
if ! command -v valgrind >/dev/null 2>&1; then
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	echo "installing: valgrind"
	DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends valgrind >/dev/null || {
		echo "valgrind is not installed and could not be installed" >&2
		exit 2
	}
fi

if [ "$(id -u)" -eq 0 ]; then
	make -s PG_CONFIG="$pg_config" || exit 1
	make -s PG_CONFIG="$pg_config" install >/dev/null || exit 1
	sh test/user.sh
	work=$(mktemp -d /tmp/idem-valgrind.XXXXXX)
	cp -a "$top"/. "$work"/
	rm -rf "$work/test/output/valgrind"
	chown -R idemtest "$work"
	su idemtest -s /bin/sh -c \
		"cd '$work' && PG_CONFIG='$pg_config' VALGRIND_ISOLATION='${VALGRIND_ISOLATION:-}' sh test/valgrind.sh"
	status=$?
	rm -rf "$top/test/output/valgrind"
	mkdir -p "$top/test/output"
	cp -a "$work/test/output/valgrind" "$top/test/output/valgrind"
	rm -rf "$work"
	exit $status
fi

out="$top/test/output/valgrind"
rm -rf "$out"
mkdir -p "$out/logs" "$out/regress" "$out/isolation"
dir=$(mktemp -d /tmp/idem-vg-data.XXXXXX)
port=${VALGRIND_PORT:-54391}

"$bindir/initdb" -D "$dir/data" -A trust >"$out/initdb.log" 2>&1 || {
	cat "$out/initdb.log"
	exit 1
}
{
	cat test/idem.conf
	echo "port = $port"
	echo "unix_socket_directories = '$dir'"
	echo "listen_addresses = ''"
	echo "shared_buffers = 16MB"
	echo "max_connections = 20"
	echo "log_min_messages = warning"
} >>"$dir/data/postgresql.conf"

# Backends are forked, not exec'd, so memcheck follows them anyway;
# --trace-children also covers anything the server executes.  One log
# file per process.
valgrind --quiet --tool=memcheck --trace-children=yes \
	--suppressions="$top/test/valgrind.supp" \
	--track-origins=yes --read-var-info=no --num-callers=30 \
	--leak-check=no --gen-suppressions=all \
	--error-markers=VALGRINDERROR-BEGIN,VALGRINDERROR-END \
	--log-file="$out/logs/%p.log" \
	"$bindir/postgres" -D "$dir/data" >"$out/server.log" 2>&1 &
vg=$!

ready=0
i=0
while [ $i -lt 300 ]; do
	if "$bindir/pg_isready" -q -h "$dir" -p "$port"; then
		ready=1
		break
	fi
	kill -0 $vg 2>/dev/null || break
	sleep 1
	i=$((i + 1))
done
if [ $ready -ne 1 ]; then
	echo "the server did not start under valgrind; see $out/server.log" >&2
	kill $vg 2>/dev/null
	exit 1
fi

# The suites as make installcheck runs them, against this server.
opts="--host=$dir --port=$port"
make -s PG_CONFIG="$pg_config" installcheck TAP_TESTS= ISOLATION= \
	REGRESS_OPTS="$opts --inputdir=test --outputdir=$out/regress --dbname=idem_regression" \
	>"$out/tests.log" 2>&1
tests=$?
if [ -n "${VALGRIND_ISOLATION:-}" ]; then
	make -s PG_CONFIG="$pg_config" installcheck TAP_TESTS= REGRESS= \
		ISOLATION_OPTS="$opts --inputdir=test/isolation --outputdir=$out/isolation --load-extension=idem --dbname=idem_isolation" \
		>>"$out/tests.log" 2>&1 || tests=1
fi
cat "$out/tests.log"

"$bindir/pg_ctl" -D "$dir/data" -m fast -w -t 300 stop >/dev/null
wait $vg
rm -rf "$dir"

# A process's log has one block per error between the markers.
errors=$(cat "$out"/logs/*.log | grep -c '^==[0-9]*== VALGRINDERROR-BEGIN')
files=$(grep -l 'VALGRINDERROR-BEGIN' "$out"/logs/*.log 2>/dev/null)
nprocs=$(ls "$out"/logs | wc -l)
echo "valgrind: $errors errors in $nprocs server processes"
for f in $files; do
	echo "--- $f"
	sed -n '/VALGRINDERROR-BEGIN/,/VALGRINDERROR-END/p' "$f" | head -80
done
[ "$tests" -eq 0 ] && [ "$errors" -eq 0 ]
