#!/bin/sh
# Check the Prometheus queries file and the Grafana dashboard against a
# throwaway cluster.
#
#   sh test/monitoring.sh
#
# - contrib/prometheus/idem_queries.yaml parses, and every column of its
#   queries is a LABEL, COUNTER or GAUGE;
# - contrib/grafana/idem.json parses, reads a Prometheus data source
#   variable, and its expressions read only metrics the queries define,
#   counters through rate() or increase() and gauges as they are (parsed by
#   contrib/grafana/render.py, which draws the panels);
# - on a cluster with the extension preloaded (in the schema idem_api), the
#   grant block of doc/operations.md (Graphs) runs, and the role it grants,
#   prometheus, is no superuser and a member of no role; after claims,
#   replays, a conflict, claims in flight, a stuck claim, an expired key
#   and a waiting call, every query runs as prometheus, returns exactly the
#   columns the file declares and counts what was done; a role without the
#   grants cannot run them;
# - Debian's prometheus-postgres-exporter (installed with apt-get when
#   missing and run as root; skipped, saying so, when it cannot be), run
#   with the file as prometheus, loads it, scrapes without error, and
#   serves every metric the file defines with its type, and every metric
#   the dashboard reads, for the database app.
#
# The cluster listens on port 55472 (IDEM_MONITORING_PORT) of a Unix
# socket in the suite's own directory, on no TCP port; the exporter on a
# free port of 127.0.0.1 (port 0: it logs the one it got).  The extension
# must be installed (make install).  Prints "ok N - ..." or "not ok N - ..." per check, then
# "N passed, N failed"; exits non-zero on any failure.  Every process it
# starts is stopped on exit.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top" || exit 2
port=${IDEM_MONITORING_PORT:-55472}
# No libpq variable of the caller's reaches a connection (test/ports.sh).
. "$top/test/ports.sh"
py=/usr/bin/python3
yaml=$top/contrib/prometheus/idem_queries.yaml
dash=$top/contrib/grafana/idem.json
work=$(mktemp -d /tmp/idem-monitoring.XXXXXX) || exit 2
chmod 755 "$work"
dir=$work/pg
pids=""
n=0
passed=0
failed=0

# shellcheck disable=SC2317 # called by the traps
cleanup() {
	trap - EXIT INT TERM
	for p in $pids; do kill "$p" 2>/dev/null; done
	for p in $pids; do wait "$p" 2>/dev/null; done
	[ -d "$dir/data" ] && sh "$top/test/cluster.sh" stop "$dir" >/dev/null 2>&1
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# python3-yaml reads the queries file (as root, installed if missing).
if ! "$py" -c 'import yaml' 2>/dev/null && [ "$(id -u)" -eq 0 ]; then
	{ apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
			--no-install-recommends python3-yaml; } >"$work/apt-yaml.log" 2>&1
fi

# check NAME LOG STATUS: report the check NAME as passed if STATUS is 0,
# else as failed with the end of LOG.
check() {
	n=$((n + 1))
	if [ "$3" -eq 0 ]; then
		passed=$((passed + 1))
		echo "ok $n - $1"
	else
		failed=$((failed + 1))
		echo "not ok $n - $1"
		[ -s "$2" ] && tail -n 30 "$2" | sed 's/^/# /'
	fi
}

finish() {
	echo "$passed passed, $failed failed"
	[ "$failed" -eq 0 ]
	exit
}

# 1. The files themselves.
"$py" - "$yaml" "$work" >"$work/yaml.log" 2>&1 <<'EOF'
import sys, yaml
path, work = sys.argv[1], sys.argv[2]
with open(path) as f:
    doc = yaml.safe_load(f)
assert isinstance(doc, dict) and doc, "no namespaces"
cols = open(work + "/columns", "w")      # NAMESPACE TAB col,col,...
metrics = open(work + "/metrics", "w")   # METRIC TAB usage TAB labels
for ns, d in doc.items():
    assert set(d) <= {"query", "metrics", "master", "cache_seconds", "runonserver"}, (ns, set(d))
    assert isinstance(d.get("query"), str) and d["query"].strip(), ns + ": no query"
    assert "\t" not in d["query"], ns + ": a tab in the query"
    names, labels, values = [], [], []
    for m in d["metrics"]:
        assert isinstance(m, dict) and len(m) == 1, (ns, m)
        (name, spec), = m.items()
        assert spec.get("usage") in ("LABEL", "COUNTER", "GAUGE"), (ns, name, spec)
        assert spec.get("description"), (ns, name, "no description")
        assert name not in names, (ns, name, "twice")
        names.append(name)
        (labels if spec["usage"] == "LABEL" else values).append((name, spec["usage"]))
    assert values, ns + ": no metric"
    cols.write("%s\t%s\n" % (ns, ",".join(names)))
    for name, usage in values:
        metrics.write("%s_%s\t%s\t%s\n" % (ns, name, usage, ",".join(l for l, _ in labels)))
    with open("%s/query.%s.sql" % (work, ns), "w") as q:
        q.write(d["query"])
EOF
check "the queries file parses; each column is a LABEL, COUNTER or GAUGE" "$work/yaml.log" $?

"$py" - "$dash" >"$work/dash.log" 2>&1 <<'EOF'
import json, sys
with open(sys.argv[1]) as f:
    dash = json.load(f)
assert dash.get("schemaVersion", 0) >= 36, "schemaVersion %r" % dash.get("schemaVersion")
ds = [v for v in dash["templating"]["list"] if v.get("type") == "datasource"]
assert len(ds) == 1 and ds[0]["query"] == "prometheus", ds
ref = "${%s}" % ds[0]["name"]
assert dash["panels"], "no panels"
ids = [p["id"] for p in dash["panels"]]
assert len(set(ids)) == len(ids), "panel ids repeat"
for p in dash["panels"]:
    assert p["datasource"] == {"type": "prometheus", "uid": ref}, (p["title"], p["datasource"])
    assert p.get("targets"), p["title"] + ": no query"
    for t in p["targets"]:
        assert t["datasource"] == {"type": "prometheus", "uid": ref}, (p["title"], t)
        assert t.get("expr"), p["title"] + ": empty expression"
for v in dash["templating"]["list"]:
    if v.get("type") == "query":
        assert v["datasource"]["uid"] == ref, v["name"]
EOF
check "the dashboard parses, with a Prometheus data source variable that every panel reads" "$work/dash.log" $?

# Every metric the dashboard reads is defined, counters read as rates.
"$py" - "$dash" "$work/metrics" "$top/contrib/grafana" >"$work/refs.log" 2>&1 <<'EOF'
import sys
sys.path.insert(0, sys.argv[3])
import render
usage = {}
for line in open(sys.argv[2]):
    name, u, _ = line.rstrip("\n").split("\t")
    usage[name] = u
_, panels = render.load_dashboard(sys.argv[1])
bad = []
def walk(node, in_rate, where):
    if node[0] == "sel":
        u = usage.get(node[1])
        if u is None:
            bad.append("%s: %s is not defined by the queries file" % (where, node[1]))
        elif in_rate and u != "COUNTER":
            bad.append("%s: the gauge %s read through rate()" % (where, node[1]))
        elif not in_rate and u != "GAUGE":
            bad.append("%s: the counter %s read without rate()" % (where, node[1]))
    elif node[0] == "call":
        walk(node[2], True, where)
    elif node[0] == "agg":
        walk(node[3], in_rate, where)
    elif node[0] == "bin":
        walk(node[2], in_rate, where)
        walk(node[3], in_rate, where)
n = 0
for p, targets in panels:
    for node, _ in targets:
        n += 1
        walk(node, False, p["title"])
print("\n".join(bad))
assert not bad and n > 0
EOF
check "every expression of the dashboard reads only metrics of the queries file, counters through rate()" "$work/refs.log" $?
"$py" "$top/contrib/grafana/render.py" --metrics "$dash" >"$work/dash_metrics" 2>"$work/dash_metrics.log"
check "render.py lists the dashboard's metrics" "$work/dash_metrics.log" $?
{ [ -s "$work/metrics" ] && [ -s "$work/dash_metrics" ]; } || finish

# 2. A cluster, the documented grants, and something to count.
command -v pg_config >/dev/null 2>&1 || { check "pg_config on PATH" /dev/null 1; finish; }
bindir=$(pg_config --bindir)
# Without the purge worker: the expired key stays until the queries ran.
if ! sh "$top/test/cluster.sh" start "$dir" "$port" 'idem.purge_enabled = off' \
	'idem.log_takeovers = off' >"$work/cluster.log" 2>&1; then
	cat "$dir/initdb.log" "$dir/server.log" >>"$work/cluster.log" 2>/dev/null
	check "start the cluster" "$work/cluster.log" 1
	finish
fi
psql_as() {
	role=$1
	shift
	"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" -U "$role" -d app "$@"
}
"$bindir/psql" -X -q -h "$dir" -p "$port" -U postgres -d postgres \
	-c "CREATE DATABASE app" >"$work/setup.log" 2>&1 &&
	psql_as postgres -c "CREATE SCHEMA idem_api" -c "CREATE EXTENSION idem SCHEMA idem_api" \
		>>"$work/setup.log" 2>&1
check "the extension installs in the schema idem_api of the database app" "$work/setup.log" $?

# The grant block of doc/operations.md, Graphs: the SQL run block that
# grants to prometheus.
mkdir -p "$work/blocks"
grants=""
if perl "$top/test/docs/blocks.pl" extract "$work/blocks" doc/operations.md >"$work/blocks.log" 2>&1; then
	for f in "$work"/blocks/*.sql; do
		[ -f "$f" ] && grep -q 'TO prometheus' "$f" && grep -q 'CREATE ROLE prometheus' "$f" &&
			{ grants=$f; break; }
	done
fi
if [ -z "$grants" ]; then
	echo "doc/operations.md has no sql run block with CREATE ROLE prometheus and grants to it" >>"$work/blocks.log"
	check "the grant block of doc/operations.md runs" "$work/blocks.log" 1
	finish
fi
psql_as postgres -f "$grants" >"$work/grants.log" 2>&1
check "the grant block of doc/operations.md runs" "$work/grants.log" $?

# prometheus has the grants of that block and nothing more: no superuser,
# no role membership, no privilege on the table.
out=$(psql_as postgres -A -t -c "
	SELECT r.rolsuper OR r.rolbypassrls OR r.rolcreaterole
	       OR EXISTS (SELECT 1 FROM pg_auth_members m WHERE m.member = r.oid)
	       OR has_table_privilege(r.oid, 'idem.keys', 'SELECT')
	       OR has_schema_privilege(r.oid, 'idem', 'USAGE')
	  FROM pg_roles r WHERE r.rolname = 'prometheus'" 2>&1)
echo "$out" >"$work/role.log"
[ "$out" = f ]
check "prometheus is no superuser, a member of no role, and cannot read idem.keys" "$work/role.log" $?

# Activity: done, replayed, conflicting, in flight, stuck and expired keys,
# and a call waiting for the transaction that holds a key.
psql_as postgres >"$work/activity.log" 2>&1 <<'EOF'
SELECT token FROM idem_api.idem_begin('done', 'fp', lease => '1h', retention => '1h') \gset
SELECT idem_api.idem_complete('done', 'fp', 200, '\x6f6b'::bytea, token => :token);
SELECT state FROM idem_api.idem_begin('done', 'fp');
SELECT state FROM idem_api.idem_begin('done', 'other');
SELECT claimed FROM idem_api.idem_begin('running', 'fp', lease => '1h', retention => '1h');
SELECT state FROM idem_api.idem_begin('running', 'fp', wait => false);
SELECT claimed FROM idem_api.idem_begin('stuck', 'fp', lease => '1s', retention => '1h');
SELECT claimed FROM idem_api.idem_begin('expiring', 'fp', lease => '1s', retention => '1s');
EOF
check "claims, a complete, a replay, a conflict and an in-flight answer" "$work/activity.log" $?
"$bindir/psql" -X -q -h "$dir" -p "$port" -U postgres -d app >"$work/holder.log" 2>&1 <<'EOF' &
SET application_name = 'holder';
BEGIN;
SELECT claimed FROM idem_api.idem_begin('held', 'fp');
SELECT pg_sleep(600);
EOF
pids="$pids $!"
# The waiter starts once the holder holds the key.
wait_for_sql() {
	i=0
	while [ "$i" -lt 300 ]; do
		[ "$(psql_as postgres -A -t -c "$1" 2>/dev/null)" = t ] && return 0
		sleep 0.2
		i=$((i + 1))
	done
	return 1
}
wait_for_sql "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = 'holder' AND query LIKE '%pg_sleep%')"
"$bindir/psql" -X -q -h "$dir" -p "$port" -U postgres -d app \
	-c "SET application_name = 'waiter'" \
	-c "SELECT claimed FROM idem_api.idem_begin('held', 'fp')" >"$work/waiter.log" 2>&1 &
pids="$pids $!"
# The stuck claim's lease and the expiring key's window end by the server's
# clock; the waiter shows in idem_waits.
wait_for_sql "SELECT EXISTS (SELECT 1 FROM idem_api.idem_keys WHERE key = 'expiring' AND expires_at <= now())
	AND EXISTS (SELECT 1 FROM idem_api.idem_stalled())
	AND EXISTS (SELECT 1 FROM idem_api.idem_waits WHERE key = 'held')" >"$work/waits.log" 2>&1
check "a stuck claim, an expired key and a waiting call are there" "$work/waits.log" $?

# 3. Every query as prometheus: the declared columns, one row or more.
while IFS="$(printf '\t')" read -r ns cols; do
	q=$work/query.$ns.sql
	res=$work/result.$ns
	psql_as prometheus -A -F "$(printf '\t')" -P footer=off -f "$q" >"$res" 2>&1
	st=$?
	if [ "$st" -eq 0 ]; then
		got=$(head -n 1 "$res" | tr '\t' ',')
		if [ "$got" != "$cols" ]; then
			echo "columns: $got" >>"$res"
			echo "declared: $cols" >>"$res"
			st=1
		elif [ "$(wc -l <"$res")" -lt 2 ]; then
			echo "no row" >>"$res"
			st=1
		fi
	fi
	check "$ns: runs as prometheus and returns the columns the file declares" "$res" "$st"
done <"$work/columns"

# What the queries count, read from their results as prometheus.
"$py" - "$work" >"$work/values.log" 2>&1 <<'EOF'
import sys
work = sys.argv[1]
def rows(ns):
    lines = open("%s/result.%s" % (work, ns)).read().splitlines()
    head = lines[0].split("\t")
    return [dict(zip(head, l.split("\t"))) for l in lines[1:]]
def one(ns, key, value):
    r = [r for r in rows(ns) if r[key] == value]
    assert len(r) == 1, (ns, key, value, rows(ns))
    return {k: (v if k == key else float(v)) for k, v in r[0].items()}
s = one("idem_stats", "datname", "app")
bad = []
def want(what, ok):
    print(("ok  " if ok else "BAD ") + what)
    ok or bad.append(what)
want("claims_total >= 5: %g" % s["claims_total"], s["claims_total"] >= 5)
want("replays_total >= 1: %g" % s["replays_total"], s["replays_total"] >= 1)
want("conflicts_total >= 1: %g" % s["conflicts_total"], s["conflicts_total"] >= 1)
want("in_flight_total >= 1: %g" % s["in_flight_total"], s["in_flight_total"] >= 1)
want("completes_total >= 1: %g" % s["completes_total"], s["completes_total"] >= 1)
want("claim_seconds_total > 0: %g" % s["claim_seconds_total"], s["claim_seconds_total"] > 0)
want("purge_error = 0: %g" % s["purge_error"], s["purge_error"] == 0)
w = one("idem_waits", "kind", "transaction")
want("one call waits for a transaction: %g" % w["waiting"], w["waiting"] == 1)
want("its wait lasts: %g s" % w["oldest_seconds"], w["oldest_seconds"] > 0)
r = one("idem_waits", "kind", "result")
want("no call waits for a result: %g" % r["waiting"], r["waiting"] == 0)
k = one("idem_keys", "datname", "app")
# held is not committed: the holder's transaction is open
want("processing = 2 (running, stuck): %g" % k["processing"], k["processing"] == 2)
want("done = 1: %g" % k["done"], k["done"] == 1)
want("expired = 1: %g" % k["expired"], k["expired"] == 1)
want("purge lag > 0: %g" % k["purge_lag_seconds"], k["purge_lag_seconds"] > 0)
st = one("idem_stalled", "datname", "app")
want("one stuck claim: %g" % st["keys"], st["keys"] == 1)
want("stuck for more than 0 s: %g" % st["oldest_seconds"], st["oldest_seconds"] > 0)
t = one("idem_table", "datname", "app")
want("table size >= heap + index > 0: %g" % t["total_bytes"],
     t["total_bytes"] >= t["heap_bytes"] + t["index_bytes"] > 0)
assert not bad
EOF
check "the queries count the claims, replays, conflicts, waits, stuck and expired keys made" "$work/values.log" $?

# Without the grants, the queries fail: the grants are what lets
# prometheus run them.
psql_as postgres -c "CREATE ROLE nogrants LOGIN" >"$work/nogrants.log" 2>&1
st=0
while IFS="$(printf '\t')" read -r ns cols; do
	[ "$ns" = idem_table ] && continue # reads only the catalogs
	if psql_as nogrants -f "$work/query.$ns.sql" >"$work/nogrants.$ns" 2>&1; then
		echo "$ns ran without the grants" >>"$work/nogrants.log"
		st=1
	elif ! grep -q "permission denied" "$work/nogrants.$ns"; then
		cat "$work/nogrants.$ns" >>"$work/nogrants.log"
		st=1
	fi
done <"$work/columns"
check "a role without the grants cannot run the queries" "$work/nogrants.log" "$st"

# 4. The exporter.
exporter=$(command -v prometheus-postgres-exporter 2>/dev/null)
if [ -z "$exporter" ] && [ "$(id -u)" -eq 0 ]; then
	DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends prometheus-postgres-exporter >"$work/apt.log" 2>&1 ||
		{ apt-get -o DPkg::Lock::Timeout=600 update -qq >>"$work/apt.log" 2>&1 &&
			DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
				--no-install-recommends prometheus-postgres-exporter >>"$work/apt.log" 2>&1; }
	exporter=$(command -v prometheus-postgres-exporter 2>/dev/null)
fi
if [ -z "$exporter" ]; then
	echo "# skipped: prometheus-postgres-exporter is not installed and could not be (apt-get install prometheus-postgres-exporter as root)"
	finish
fi
DATA_SOURCE_NAME="user=prometheus host=$dir port=$port dbname=app sslmode=disable" \
	"$exporter" --web.listen-address=127.0.0.1:0 --extend.query-path="$yaml" \
	>"$work/exporter.log" 2>&1 &
epid=$!
pids="$pids $epid"
i=0
eport=
: >"$work/scrape"
while [ "$i" -lt 300 ] && kill -0 "$epid" 2>/dev/null; do
	[ -n "$eport" ] ||
		eport=$(sed -n 's/.*msg="Listening on" address=127\.0\.0\.1:\([0-9][0-9]*\).*/\1/p' "$work/exporter.log" | head -n 1)
	if [ -n "$eport" ] && "$py" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
		"http://127.0.0.1:$eport/metrics" >"$work/scrape" 2>/dev/null &&
		grep -q '^pg_up 1$' "$work/scrape"; then
		break
	fi
	sleep 0.2
	i=$((i + 1))
done
cp "$work/exporter.log" "$work/up.log"
grep -q '^pg_up 1$' "$work/scrape"
check "the exporter connects as prometheus and serves /metrics" "$work/up.log" $?
{
	grep '^pg_exporter_user_queries_load_error{' "$work/scrape"
	grep -c '^pg_exporter_user_queries_load_error{.*} 0$' "$work/scrape"
} >"$work/load.log"
grep -q "^pg_exporter_user_queries_load_error{filename=\"$yaml\".*} 0$" "$work/scrape"
check "the exporter loads the queries file" "$work/load.log" $?
{
	grep '^pg_exporter_last_scrape_error' "$work/scrape"
	grep -i 'level=error' "$work/exporter.log"
} >"$work/scrape_err.log"
grep -q '^pg_exporter_last_scrape_error 0$' "$work/scrape" && ! grep -qi 'level=error' "$work/exporter.log"
check "the exporter runs every query without error" "$work/scrape_err.log" $?

# Every metric of the file, with its type; every metric of the dashboard,
# for the database app where it has a datname label.
: >"$work/types.log"
while IFS="$(printf '\t')" read -r metric usage labels; do
	type=$(echo "$usage" | tr '[:upper:]' '[:lower:]')
	if ! grep -q "^# TYPE $metric $type$" "$work/scrape"; then
		echo "missing: # TYPE $metric $type" >>"$work/types.log"
	fi
	case ",$labels," in
	*,datname,*) pat="^$metric{.*datname=\"app\"" ;;
	*) pat="^$metric{" ;;
	esac
	grep -q "$pat" "$work/scrape" || echo "no sample: $metric (for $pat)" >>"$work/types.log"
done <"$work/metrics"
[ ! -s "$work/types.log" ]
check "/metrics has every metric of the queries file, with its type" "$work/types.log" $?
: >"$work/dash_scrape.log"
while read -r metric; do
	labels=$(awk -F '\t' -v m="$metric" '$1 == m { print $3 }' "$work/metrics")
	case ",$labels," in
	*,datname,*) pat="^$metric{.*datname=\"app\".*} [0-9]" ;;
	*) pat="^$metric{.*} [0-9]" ;;
	esac
	grep -q "$pat" "$work/scrape" || echo "missing: $metric (for $pat)" >>"$work/dash_scrape.log"
done <"$work/dash_metrics"
[ ! -s "$work/dash_scrape.log" ]
check "/metrics has every metric the dashboard reads, for the database app" "$work/dash_scrape.log" $?
{
	grep '^idem_stalled_keys{' "$work/scrape"
	grep '^idem_waits_waiting{' "$work/scrape"
} >"$work/agree.log"
grep -q '^idem_stalled_keys{.*datname="app".*} 1$' "$work/scrape" &&
	grep -q '^idem_waits_waiting{kind="transaction".*} 1$' "$work/scrape"
check "the exporter's values agree with the cluster (one stuck claim, one waiting call)" "$work/agree.log" $?

finish
