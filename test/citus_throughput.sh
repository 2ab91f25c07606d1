#!/bin/bash
# Throughput of idem through a Citus coordinator against a single node, with
# the CPU each server spends per transaction (doc/citus.md, "Throughput and
# workers").
#
#   test/citus_throughput.sh                  # where PostgreSQL, Citus and idem are installed
#   test/citus_throughput.sh --chroot DIR     # as root: in the make matrix chroot DIR
#
# Starts four servers on ports 57401-57404: a single node (idem only) and a
# Citus coordinator with two workers (idem.keys distributed by scope,
# colocated with the table orders), all with synchronous_commit = off (the
# disk is left out: one machine's four servers would share one disk) and
# pg_stat_statements.  Clients connect over TCP to 127.0.0.1.  For each
# round, -M prepared and simple, new keys and replays, and each client
# count, pgbench runs the one-transaction request (BEGIN; idem_begin;
# INSERT INTO orders; idem_complete; COMMIT; a replay skips to COMMIT)
# against the single node, then through the coordinator.  Then, pinned
# with taskset (at least 2 cores): the single node on core 1 and pgbench on
# core 0; the coordinator on core 0, both workers on core 1 and pgbench on
# core 0, then on core 1.  Last, unpinned, the same through the coordinator
# and with pgbench connected to worker 1, which routes the calls itself
# (Citus keeps its metadata on the workers; TPUT_VIA_WORKER=0 skips it).
#
# Per run it prints one line with tps, latency, and CPU milliseconds per
# transaction of the single node or the coordinator, of the two workers
# together (from /proc: the postmaster, its children, and
# the children it reaped) and of pgbench, the machine's busy cores and the
# part of them spent by other processes, and from pg_stat_statements the
# mean time of the idem_begin statement on the coordinator and on the
# workers and the statements the workers ran per transaction.  Then the
# medians per case.
#
# Settings (environment): TPUT_SECONDS (10), TPUT_CLIENTS ("1 4 16"),
# TPUT_ROUNDS (2), TPUT_PINNED_CLIENTS (16), TPUT_PINNED_ROUNDS (2),
# TPUT_OUT (a results file to keep; default: in the work directory).
# --chroot DIR bind-mounts DIR privately at a new directory, mounts /proc
# and /dev there, builds and installs this tree with PostgreSQL 17's
# pg_config (TPUT_PG, default 17) inside it, runs itself there, copies the
# results to TPUT_OUT (default test/output/citus_throughput.txt) and undoes
# the mounts, also on failure.  Without --chroot, as root the servers run as
# the user idemtest (test/user.sh).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
pgv=${TPUT_PG:-17}

if [ "${1:-}" = "--chroot" ]; then
	src=${2:?--chroot needs a directory}
	[ "$(id -u)" -eq 0 ] || { echo "--chroot needs root" >&2; exit 2; }
	[ -x "$src/usr/lib/postgresql/$pgv/bin/pg_config" ] || { echo "no PostgreSQL $pgv in $src" >&2; exit 2; }
	root=$(mktemp -d /tmp/idem-tput-root.XXXXXX)
	mounts=()
	out=${TPUT_OUT:-$top/test/output/citus_throughput.txt}
	# shellcheck disable=SC2317 # called by the traps
	outer_cleanup() {
		local i p
		trap - EXIT INT TERM
		# Processes of this root only: all of them were started here.
		for sig in TERM KILL; do
			for p in /proc/[0-9]*; do
				[ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -s "$sig" "${p#/proc/}" 2>/dev/null
			done
			sleep 1
		done
		[ -n "${in:-}" ] && rm -rf "${root:?}$in"
		for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
			umount "${mounts[$i]}" 2>/dev/null || umount -l "${mounts[$i]}" || echo "could not unmount ${mounts[$i]}" >&2
		done
		rmdir "$root" 2>/dev/null
	}
	trap outer_cleanup EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	mnt() {
		local target=$1
		shift
		mount "$@" "$target" || exit 1
		mounts+=("$target")
		mount --make-private "$target" || exit 1
	}
	# A private bind mount: nothing mounted below it shows in DIR, and the
	# processes here have their own root (make matrix stops those of DIR).
	mnt "$root" --bind "$src"
	mnt "$root/proc" -t proc proc
	mnt "$root/dev" --bind /dev
	mnt "$root/dev/pts" --bind /dev/pts
	mnt "$root/dev/shm" -t tmpfs -o mode=1777 shm
	# A directory of this run's own inside DIR (another run may share DIR).
	in=$(mktemp -d "$root/tmp/idem-tput-run.XXXXXX") || exit 1
	in=${in#"$root"}
	mkdir -p "$root$in/src"
	tar -C "$top" --exclude=./.git --exclude='*.o' --exclude='*.bc' --exclude='*.so' \
		--exclude=./test/output --exclude=./tmp_check -cf - . | tar -C "$root$in/src" -xf - || exit 1
	chroot "$root" /usr/bin/env -i PATH="/usr/lib/postgresql/$pgv/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
		HOME=/root LANG=C.UTF-8 sh -c "cd $in/src &&
			make -s PG_CONFIG=/usr/lib/postgresql/$pgv/bin/pg_config >$in/build.log 2>&1 &&
			make -s PG_CONFIG=/usr/lib/postgresql/$pgv/bin/pg_config install >>$in/build.log 2>&1" ||
		{ tail -n 30 "$root$in/build.log"; exit 1; }
	chroot "$root" /usr/bin/env -i PATH="/usr/lib/postgresql/$pgv/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
		HOME=/root LANG=C.UTF-8 TPUT_OUT="$in/results.txt" \
		${TPUT_SECONDS:+TPUT_SECONDS=$TPUT_SECONDS} ${TPUT_CLIENTS:+TPUT_CLIENTS="$TPUT_CLIENTS"} \
		${TPUT_ROUNDS:+TPUT_ROUNDS=$TPUT_ROUNDS} ${TPUT_PINNED_CLIENTS:+TPUT_PINNED_CLIENTS="$TPUT_PINNED_CLIENTS"} \
		${TPUT_PINNED_ROUNDS:+TPUT_PINNED_ROUNDS=$TPUT_PINNED_ROUNDS} ${TPUT_VIA_WORKER:+TPUT_VIA_WORKER=$TPUT_VIA_WORKER} \
		bash "$in/src/test/citus_throughput.sh"
	rc=$?
	mkdir -p "$(dirname "$out")"
	cp "$root$in/results.txt" "$out" 2>/dev/null && echo "results: $out"
	cp "$root$in/results.txt.medians" "$out.medians" 2>/dev/null
	exit $rc
fi

secs=${TPUT_SECONDS:-10}
clients=${TPUT_CLIENTS:-1 4 16}
rounds=${TPUT_ROUNDS:-2}
pclients=${TPUT_PINNED_CLIENTS:-16}
prounds=${TPUT_PINNED_ROUNDS:-2}
bindir=$(pg_config --bindir)
pg_config --version
"$bindir/psql" -V >/dev/null || exit 1
[ -f "$(pg_config --sharedir)/extension/citus.control" ] || { echo "Citus is not installed" >&2; exit 2; }
ncores=$(nproc)
hz=$(getconf CLK_TCK)
work=$(mktemp -d /tmp/idem-tput.XXXXXX)
chmod 755 "$work"
out=${TPUT_OUT:-$work/results.txt}
: >"$out"
nodes="single coord w1 w2"
# The nodes reach each other over TCP on 127.0.0.1: on four free ports
# (test/ports.sh, which also clears the libpq environment); a node that
# cannot bind its port does not start, and the run stops there.
. "$top/test/ports.sh"
declare -A port=()
for n in $nodes; do
	p=$(free_port) || exit 1
	while [[ " ${port[*]-} " == *" $p "* ]]; do p=$(free_port) || exit 1; done
	port[$n]=$p
done

as_owner() {
	if [ "$(id -u)" -eq 0 ]; then
		su idemtest -s /bin/sh -c "cd / && $1"
	else
		sh -c "$1"
	fi
}
started=()
# shellcheck disable=SC2317 # called by the traps
cleanup() {
	local n
	trap - EXIT INT TERM
	for n in "${started[@]+"${started[@]}"}"; do
		as_owner "'$bindir/pg_ctl' -D '$work/$n' -m immediate -w stop >/dev/null 2>&1"
	done
	[ -z "${TPUT_OUT:-}" ] || [ "$out" = "$work/results.txt" ] || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
[ "$(id -u)" -eq 0 ] && { sh "$top/test/user.sh" || exit 1; chown idemtest "$work"; }

for n in $nodes; do
	as_owner "'$bindir/initdb' -D '$work/$n' -A trust -U postgres >'$work/$n.initdb.log' 2>&1" ||
		{ cat "$work/$n.initdb.log"; exit 1; }
	if [ "$n" = single ]; then libs="idem,pg_stat_statements"; else libs="citus,idem,pg_stat_statements"; fi
	cat >>"$work/$n/postgresql.conf" <<-EOF
		port = ${port[$n]}
		listen_addresses = '127.0.0.1'
		unix_socket_directories = '$work'
		shared_preload_libraries = '$libs'
		synchronous_commit = off
		max_connections = 100
		max_prepared_transactions = 100
		idem.purge_enabled = off
		citus.shard_replication_factor = 1
		citus.node_conninfo = 'sslmode=disable'
	EOF
	[ "$n" = single ] && sed -i '/^citus\./d' "$work/$n/postgresql.conf"
	started+=("$n")
	as_owner "'$bindir/pg_ctl' -D '$work/$n' -l '$work/$n.log' -w start >/dev/null" ||
		{ cat "$work/$n.log"; exit 1; }
done

q() { # q NODE SQL...: psql on NODE's database bench
	local n=$1
	shift
	"$bindir/psql" -X -q -A -t -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "${port[$n]}" -U postgres -d bench "$@"
}
for n in $nodes; do
	"$bindir/psql" -X -q -h 127.0.0.1 -p "${port[$n]}" -U postgres -d postgres -c 'CREATE DATABASE bench' || exit 1
	q "$n" -c 'CREATE EXTENSION pg_stat_statements' || exit 1
	[ "$n" = single ] || q "$n" -c 'CREATE EXTENSION citus' || exit 1
done
orders='CREATE TABLE orders (tenant text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, qty int, PRIMARY KEY (tenant, key))'
q single -c 'CREATE EXTENSION idem' -c "$orders" || exit 1
q coord -c "SELECT citus_set_coordinator_host('127.0.0.1', ${port[coord]})" \
	-c "SELECT citus_add_node('127.0.0.1', ${port[w1]})" -c "SELECT citus_add_node('127.0.0.1', ${port[w2]})" \
	-c 'CREATE EXTENSION idem' -c "$orders" -c "SELECT create_distributed_table('orders', 'tenant')" \
	-c "SELECT idem_distribute('scope', colocate_with => 'orders')" >/dev/null || exit 1
echo "cluster: $(q coord -c "SELECT string_agg(nodeport || ':' || n, ' ') FROM (SELECT nodeport, count(*) n
	FROM pg_dist_shard_placement WHERE shardid IN (SELECT shardid FROM pg_dist_shard WHERE logicalrelid = 'idem.keys'::regclass)
	GROUP BY 1 ORDER BY 1) s") shards of idem.keys per worker port"

# The request; :k is the key, :t the scope (tenant); keys below 1000000 are
# stored before the runs (the replays), new keys are drawn far above.
cat >"$work/prepared.sql" <<'EOF'
\set k random(:lo, :hi)
\set t :k % 100
BEGIN;
SELECT claimed FROM idem_begin(:k, 'f', scope => :t) \gset
\if :claimed
INSERT INTO orders (tenant, key, qty) VALUES (:t, :k, 1);
SELECT idem_complete(:k, 'f', 201, '\x00'::bytea, scope => :t);
\endif
COMMIT;
EOF
# Simple protocol: the values are spliced in as text, so they are quoted.
sed "/^\\\\/! s/:\([kt]\)\b/':\1'/g" "$work/prepared.sql" >"$work/simple.sql"
nkeys=5000
for n in single coord; do
	for ((i = 1; i <= nkeys; i++)); do
		echo "BEGIN; SELECT claimed FROM idem_begin('$i', 'f', scope => '$((i % 100))');"
		echo "SELECT idem_complete('$i', 'f', 201, '\\x00'::bytea, scope => '$((i % 100))'); COMMIT;"
	done | q "$n" >/dev/null || exit 1
done
echo "stored $nkeys keys for the replays on the single node and through the coordinator"

# cpu_ticks PID: CPU ticks of the postmaster PID, its children, and the
# children it reaped.
cpu_ticks() {
	cat /proc/[0-9]*/stat 2>/dev/null |
		awk -v pm="$1" '$1 == pm { s += $14 + $15 + $16 + $17 } $4 == pm { s += $14 + $15 } END { print s + 0 }'
}
busy_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }
declare -A pm
for n in $nodes; do pm[$n]=$(head -1 "$work/$n/postmaster.pid"); done
# pin NODE CPULIST: the postmaster and its children (new backends inherit it).
pin() {
	local p
	for p in $(cat /proc/[0-9]*/stat 2>/dev/null | awk -v pm="${pm[$1]}" '$1 == pm || $4 == pm { print $1 }'); do
		taskset -a -p -c "$2" "$p" >/dev/null 2>&1
	done
}
pss_reset() { local n; for n in "$@"; do q "$n" -c 'SELECT pg_stat_statements_reset()' >/dev/null; done; }
# pss NODE...: calls and mean ms of the idem_begin statements, all calls.
pss() {
	local n
	for n in "$@"; do
		q "$n" -F ' ' -c "SELECT coalesce(sum(calls) FILTER (WHERE query LIKE '%idem_begin(%'), 0),
			coalesce(sum(total_exec_time) FILTER (WHERE query LIKE '%idem_begin(%'), 0), sum(calls)
			FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'"
	done | awk '{ b += $1; t += $2; a += $3 } END { printf "%d %.4f %d\n", b, t, a }'
}

printf '%s\n' "phase round system mode work clients tps lat_ms failed cpu_single_or_coord cpu_workers cpu_pgbench busy_cores other_cores begin_ms_entry begin_ms_worker worker_stmts_per_txn pgbench_core" >"$out"
# run PHASE ROUND SYSTEM MODE WORK CLIENTS [PGBENCH_CORES]
run() {
	local phase=$1 r=$2 sys=$3 mode=$4 wk=$5 c=$6 cores=${7:-} entry lo hi j log b0 b1 tps lat failed pgt
	local -A t0 t1
	case "$sys" in single) entry=single ;; citus) entry=coord ;; citus-via-w1) entry=w1 ;; esac
	if [ "$wk" = new ]; then lo=1000000; hi=9000000000000000; else lo=1; hi=$nkeys; fi
	j=$((c < 2 ? 1 : 2))
	log=$work/run.log
	pss_reset $entry w1 w2
	for n in $nodes; do t0[$n]=$(cpu_ticks "${pm[$n]}"); done
	b0=$(busy_ticks)
	(
		if [ -n "$cores" ]; then set -- taskset -c "$cores"; else set --; fi
		"$@" "$bindir/pgbench" -n -h 127.0.0.1 -p "${port[$entry]}" -U postgres -M "$mode" -c "$c" -j "$j" \
			-T "$secs" --max-tries 10 -D lo=$lo -D hi=$hi -f "$work/$mode.sql" bench >"$log" 2>&1
		awk '{ print $16 + $17 }' "/proc/$BASHPID/stat" >"$work/pgbench.ticks"
	)
	b1=$(busy_ticks)
	for n in $nodes; do t1[$n]=$(cpu_ticks "${pm[$n]}"); done
	tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$log")
	lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$log")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$log")
	[ -n "$tps" ] || { echo "pgbench failed:"; cat "$log"; return 1; }
	pgt=$(cat "$work/pgbench.ticks")
	local me=coord
	[ "$sys" = single ] && me=single

	local e w pg_e pg_w
	read -r pg_e e _ <<<"$(pss $entry)"
	read -r pg_w w wst <<<"$(pss w1 w2)"
	awk -v phase="$phase" -v r="$r" -v sys="$sys" -v mode="$mode" -v wk="$wk" -v c="$c" -v tps="$tps" -v lat="$lat" \
		-v failed="${failed:-0}" -v secs="$secs" -v hz="$hz" -v ncores="$ncores" \
		-v ce=$((t1[$me] - t0[$me])) -v cw=$((t1[w1] - t0[w1] + t1[w2] - t0[w2])) -v cp="$pgt" \
		-v busy=$((b1 - b0)) -v pe="$pg_e" -v e="$e" -v pw="$pg_w" -v w="$w" -v wst="$wst" -v cores="${cores:--}" '
	BEGIN {
		n = tps * secs; ms = 1000 / hz
		if (sys == "single") cw = 0
		other = busy - ce - cw - cp; if (other < 0) other = 0
		printf "%s %d %s %s %s %d %.0f %.2f %d %.3f %.3f %.3f %.2f %.2f %.3f %.3f %.1f %s\n",
			phase, r, sys, mode, wk, c, tps, lat, failed, ce * ms / n, cw * ms / n, cp * ms / n,
			busy / hz / secs, other / hz / secs, pe ? e / pe : 0, pw ? w / pw : 0, sys == "single" ? 0 : wst / n, cores
	}' | tee -a "$out"
}
unpin_all() { local n; for n in $nodes; do pin "$n" "0-$((ncores - 1))"; done; }

echo "== unpinned: $rounds rounds, ${secs}s runs, $ncores cores"
for ((r = 1; r <= rounds; r++)); do
	for mode in prepared simple; do
		for wk in new replay; do
			for c in $clients; do
				run free "$r" single "$mode" "$wk" "$c" || exit 1
				run free "$r" citus "$mode" "$wk" "$c" || exit 1
			done
		done
	done
done
if [ "$ncores" -ge 2 ]; then
	echo "== pinned: single on core 1; coordinator on core 0, workers on core 1; pgbench on core 0 or 1"
	pin single 1
	pin coord 0
	pin w1 1
	pin w2 1
	for ((r = 1; r <= prounds; r++)); do
		for mode in prepared simple; do
			for wk in new replay; do
				for c in $pclients; do
					run pinned "$r" single "$mode" "$wk" "$c" 0 || exit 1
					run pinned "$r" citus "$mode" "$wk" "$c" 0 || exit 1
					run pinned "$r" citus "$mode" "$wk" "$c" 1 || exit 1
				done
			done
		done
	done
	unpin_all
fi
if [ "${TPUT_VIA_WORKER:-1}" = 1 ]; then
	echo "== unpinned, clients connected to worker 1 (Citus routes from a worker too)"
	for ((r = 1; r <= prounds; r++)); do
		for wk in new replay; do
			for c in $pclients; do
				run via-w1 "$r" citus prepared "$wk" "$c" || exit 1
				run via-w1 "$r" citus-via-w1 prepared "$wk" "$c" || exit 1
			done
		done
	done
fi

echo "== medians per case (CPU in ms per transaction)"
awk 'NR > 1 { k = $1 " " $3 " " $4 " " $5 " " $6 " " $18; for (i = 7; i <= 17; i++) v[k, i, ++cnt[k, i]] = $i; keys[k] = 1 }
	function med(k, i,   n, a, j, m, t) {
		n = cnt[k, i]; for (j = 1; j <= n; j++) a[j] = v[k, i, j]
		for (j = 2; j <= n; j++) { t = a[j]; m = j - 1; while (m > 0 && a[m] > t) { a[m + 1] = a[m]; m-- } a[m + 1] = t }
		return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
	}
	END {
		print "phase system mode work clients pgbench_core tps lat_ms cpu_entry cpu_workers cpu_pgbench other_cores begin_ms_entry begin_ms_worker worker_stmts"
		for (k in keys) printf "%s %.0f %.2f %.3f %.3f %.3f %.2f %.3f %.3f %.1f\n", k, med(k, 7), med(k, 8), med(k, 10), med(k, 11), med(k, 12), med(k, 14), med(k, 15), med(k, 16), med(k, 17)
	}' "$out" | sort -k1,1 -k4,4 -k3,3 -k5,5n -k2,2 | tee "$out.medians"
