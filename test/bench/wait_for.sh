#!/bin/sh
# What a duplicate that waits for the first request's answer (idem_begin's
# wait_for) costs, on a throwaway cluster:
#
# - the latency from the holder's commit of idem_complete (its commit
#   timestamp, track_commit_timestamp) to each waiter's answer (the
#   waiter's clock when idem_begin returned), p50 and p99, with 1, 10 and
#   100 waiters on one key;
# - the CPU time 100 waiters use while they sleep 10 s on a key nobody
#   completes (user + system time of their backends, from /proc).
#
#   sh test/bench/wait_for.sh        (after make install; root or the server's user)
#
# The cost to idem_complete when nobody waits is counted by
# test/bench/callgrind.sh.
set -eu
top=$(cd "$(dirname "$0")/../.." && pwd)
bindir=$(pg_config --bindir)
dir=$(mktemp -d /tmp/idem-waitfor.XXXXXX)
port=${IDEM_BENCH_PORT:-55499}
psql="$bindir/psql -X -q -At -h $dir -p $port -U postgres -d postgres"

cleanup() {
	sh "$top/test/cluster.sh" stop "$dir" >/dev/null 2>&1 || true
	rm -rf "$dir"
}
trap cleanup EXIT INT TERM
sh "$top/test/cluster.sh" start "$dir" "$port" \
	"idem.purge_enabled = off" "max_connections = 150" "track_commit_timestamp = on" >/dev/null
$psql -c "CREATE EXTENSION idem;
	CREATE TABLE woke (n int, at timestamptz, state text, claimed boolean)" >/dev/null

# N waiters on a key whose holder completes once they all sleep.
latency() {
	n=$1
	key="lat-$n"
	tok=$($psql -c "SELECT token FROM idem_begin('$key', 'fp', lease => '1 hour')")
	printf "INSERT INTO woke SELECT %s, clock_timestamp(), state, claimed FROM idem_begin('%s', 'fp', wait_for => '5 min');\n" \
		"$n" "$key" >"$dir/wait.sql"
	"$bindir/pgbench" -n -c "$n" -j 2 -t 1 -f "$dir/wait.sql" -h "$dir" -p "$port" -U postgres postgres \
		>"$dir/pgbench.log" 2>&1 &
	bench=$!
	until [ "$($psql -c "SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%wait_for%'")" -ge "$n" ]; do
		sleep 0.1
	done
	$psql -c "SELECT idem_complete('$key', 'fp', 200, 'done', $tok)" >/dev/null
	wait $bench
	$psql -c "SELECT format('%s waiters: commit to answer p50 %s ms, p99 %s ms, max %s ms (%s replays)',
			$n,
			round((percentile_cont(0.5) WITHIN GROUP (ORDER BY ms))::numeric, 2),
			round((percentile_cont(0.99) WITHIN GROUP (ORDER BY ms))::numeric, 2),
			round(max(ms)::numeric, 2),
			count(*) FILTER (WHERE state = 'DONE' AND NOT claimed))
		FROM (SELECT extract(epoch FROM w.at - pg_xact_commit_timestamp(k.xmin)) * 1000 AS ms, w.state, w.claimed
				FROM woke w, idem.keys k
			   WHERE w.n = $n AND k.key = '$key') x"
}

latency 1
latency 10
latency 100

# CPU of 100 sleeping waiters over 10 s.
$psql -c "SELECT token FROM idem_begin('cpu', 'fp', lease => '1 hour')" >/dev/null
printf "SELECT state FROM idem_begin('cpu', 'fp', wait_for => '10s');\n" >"$dir/cpu.sql"
"$bindir/pgbench" -n -c 100 -j 2 -t 1 -f "$dir/cpu.sql" -h "$dir" -p "$port" -U postgres postgres \
	>"$dir/pgbench.log" 2>&1 &
bench=$!
until [ "$($psql -c "SELECT count(*) FROM pg_stat_activity
	WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%wait_for%'")" -ge 100 ]; do
	sleep 0.1
done
pids=$($psql -c "SELECT pid FROM pg_stat_activity
	WHERE wait_event_type = 'Extension' AND query LIKE '%idem_begin%wait_for%'")
ticks() {
	t=0
	for p in $pids; do
		s=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
		t=$((t + s))
	done
	echo "$t"
}
t0=$(ticks)
sleep 5
t1=$(ticks)
wait $bench
hz=$(getconf CLK_TCK)
echo "100 waiters sleeping 5 s (of their 10 s wait): $(( (t1 - t0) * 1000 / hz )) ms of CPU in all"
