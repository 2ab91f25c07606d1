#!/bin/sh
# Record a run of a mixed load and draw the dashboard's panels from it.
#
#   sh contrib/grafana/record.sh [OUT.png]     default doc/img/dashboard.png
#
# Starts a throwaway cluster with the extension preloaded (test/cluster.sh,
# port 55474, RECORD_PORT), the database app with the extension in
# idem_api, the role prometheus with the grants of doc/operations.md
# (Graphs), and prometheus-postgres-exporter with
# contrib/prometheus/idem_queries.yaml (on 127.0.0.1 and a free port, or
# RECORD_EXPORTER_PORT, which must be free).  Scrapes /metrics every second for
# RECORD_SECONDS + 20 s (default 60 + 20); from the 5th second pgbench
# runs the scripts of contrib/grafana/load/ for RECORD_SECONDS: new
# requests, retries that replay, a key reused for another request,
# duplicates of slow requests that wait, claims in one transaction that
# duplicates wait for, and claims never completed, which retries take
# over; from a third to two thirds of the run a burst of retries comes
# on top.  Then contrib/grafana/render.py draws every panel of
# contrib/grafana/idem.json from the scrapes into OUT
# (RECORD_KEEP_SAMPLES=FILE keeps the scrapes too).
#
# Needs the extension installed (make install), pgbench, Debian's
# prometheus-postgres-exporter and python3-matplotlib.  Not part of make
# test.
set -eu
top=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$top/doc/img/dashboard.png}
port=${RECORD_PORT:-55474}
# No libpq variable of the caller's reaches a connection; free_port and
# port_free (test/ports.sh).
. "$top/test/ports.sh"
if [ -n "${RECORD_EXPORTER_PORT:-}" ]; then
	eport=$RECORD_EXPORTER_PORT
	port_free "$eport" RECORD_EXPORTER_PORT || exit 2
else
	eport=$(free_port)
fi
secs=${RECORD_SECONDS:-60}
bindir=$(pg_config --bindir)
exporter=$(command -v prometheus-postgres-exporter) || {
	echo "record.sh: prometheus-postgres-exporter is not installed (apt-get install prometheus-postgres-exporter)" >&2
	exit 2
}
work=$(mktemp -d /tmp/idem-record.XXXXXX)
chmod 755 "$work"
dir=$work/pg
pids=""

# shellcheck disable=SC2317 # called by the traps
cleanup() {
	trap - EXIT INT TERM
	for p in $pids; do kill "$p" 2>/dev/null || true; done
	for p in $pids; do wait "$p" 2>/dev/null || true; done
	[ -d "$dir/data" ] && sh "$top/test/cluster.sh" stop "$dir" >/dev/null 2>&1
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

sh "$top/test/cluster.sh" start "$dir" "$port" "idem.log_takeovers = off" \
	"log_min_messages = warning"
psql() { "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" "$@"; }
psql -U postgres -d postgres -c "CREATE DATABASE app"
psql -U postgres -d app <<'EOF'
CREATE SCHEMA idem_api;
CREATE EXTENSION idem SCHEMA idem_api;
CREATE ROLE prometheus LOGIN;
GRANT USAGE ON SCHEMA idem_api TO prometheus;
GRANT EXECUTE ON FUNCTION idem_api.idem_stats(), idem_api.idem_waits(),
  idem_api.idem_stalled(interval) TO prometheus;
GRANT SELECT ON idem_api.idem_stats, idem_api.idem_waits, idem_api.idem_keys TO prometheus;
EOF

DATA_SOURCE_NAME="user=prometheus host=$dir port=$port dbname=app sslmode=disable" \
	"$exporter" --web.listen-address="127.0.0.1:$eport" \
	--extend.query-path="$top/contrib/prometheus/idem_queries.yaml" \
	>"$work/exporter.log" 2>&1 &
epid=$!
pids="$pids $epid"
# This exporter, not another server, answers on the port: it is still
# running once it listens.
i=0
until grep -q 'msg="Listening on"' "$work/exporter.log"; do
	i=$((i + 1))
	if ! kill -0 "$epid" 2>/dev/null || [ "$i" -ge 100 ]; then
		echo "record.sh: the exporter did not start on 127.0.0.1:$eport" >&2
		cat "$work/exporter.log" >&2
		exit 1
	fi
	sleep 0.1
done
sleep 0.5
kill -0 "$epid" 2>/dev/null || { cat "$work/exporter.log" >&2; exit 1; }

load=$top/contrib/grafana/load
pgbench() { "$bindir/pgbench" -n -h "$dir" -p "$port" -U postgres "$@" app; }

# The sampler: one scrape a second, each after a line "# scrape TIME".
/usr/bin/python3 - "http://127.0.0.1:$eport/metrics" "$((secs + 20))" "$work/samples.txt" <<'EOF' &
import sys, time, urllib.request
url, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.time() + 30
while True:
    try:
        urllib.request.urlopen(url, timeout=5).read()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit("record.sh: the exporter does not answer at " + url)
        time.sleep(0.2)
start = time.time()
with open(path, "w") as f:
    for i in range(n):
        time.sleep(max(0.0, start + i - time.time()))
        t = time.time()
        page = urllib.request.urlopen(url, timeout=5).read().decode()
        f.write("# scrape %.3f\n" % t)
        f.write("".join(l + "\n" for l in page.splitlines() if l.startswith("idem_")))
        f.flush()
EOF
sampler=$!
pids="$pids $sampler"
sleep 5
third=$((secs / 3))
pgbench -c 4 -j 2 -R 200 -T "$secs" -f "$load/new.sql@40" -f "$load/retry.sql@40" \
	-f "$load/conflict.sql@4" -f "$load/crash.sql@2" >"$work/fast.log" 2>&1 &
fast=$!
pgbench -c 4 -j 2 -R 40 -T "$secs" -f "$load/slow.sql@1" -f "$load/onetx.sql@1" >"$work/slow.log" 2>&1 &
slow=$!
pids="$pids $fast $slow"
sleep "$third"
status=0
pgbench -c 2 -j 1 -R 300 -T "$third" -f "$load/retry.sql@9" -f "$load/conflict.sql@1" \
	>"$work/burst.log" 2>&1 || status=$?
wait "$fast" || status=$?
wait "$slow" || status=$?
if [ "$status" -ne 0 ]; then
	cat "$work/fast.log" "$work/slow.log" "$work/burst.log" >&2
	exit 1
fi
wait "$sampler"
grep -h "^number of transactions actually processed\|^tps" "$work/fast.log" "$work/slow.log" "$work/burst.log"
mkdir -p "$(dirname "$out")"
/usr/bin/python3 "$top/contrib/grafana/render.py" "$work/samples.txt" "$out"
[ -n "${RECORD_KEEP_SAMPLES:-}" ] && cp "$work/samples.txt" "$RECORD_KEEP_SAMPLES"
echo "record.sh: wrote $out ($(wc -c <"$out") bytes)"
