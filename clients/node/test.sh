#!/bin/sh
# The Node client's tests against a throwaway PostgreSQL cluster.
#
#   sh clients/node/test.sh
#
# Installs Debian's nodejs and npm if node or npm is missing (Node 18 or
# later), the locked npm modules (npm ci), starts a cluster on port 55452
# (IDEM_NODE_PORT) under /tmp with test/cluster.sh (a Unix socket in the
# suite's own directory, no TCP port), creates the extension
# (which must be installed: make && make install), runs node --test (in
# its UTF8 database and again in test/odd_database.sql's), then
# test/http/conformance.py against test/conformance_app.js and tsc --strict
# over test/types/example.ts (neither when IDEM_NODE_TESTS picks tests),
# and prints "N passed, N failed".  test/inbox.test.js gets RabbitMQ and
# Redis (test/brokers.sh: Debian's rabbitmq-server and redis-server,
# installed if missing, on free ports of 127.0.0.1, as the unprivileged
# user when run as root; not started when IDEM_NODE_TESTS names no inbox
# test).  The cluster, the brokers and any app server the tests started
# are stopped on exit, also on failure or interrupt.
set -u

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
port=${IDEM_NODE_PORT:-55452}
# No libpq variable of the caller's reaches a connection (test/ports.sh).
. "$root/test/ports.sh"
. "$here/test/brokers.sh"
work=$(mktemp -d /tmp/idem-node.XXXXXX)
chmod 755 "$work"
pgdir="$work/pg"
# A socket directory nothing listens in: the tests' "store is down".
mkdir "$work/down"
export IDEM_TEST_DOWN_HOST="$work/down"
pids="$work/app-pids"
: >"$pids"

cleanup() {
	trap - EXIT INT TERM
	# The test runner and everything it started (its own process group).
	if [ -s "$work/node.pid" ]; then
		runner=$(cat "$work/node.pid")
		if kill -0 "$runner" 2>/dev/null; then
			kill -TERM "-$runner" 2>/dev/null || kill -TERM "$runner" 2>/dev/null
			sleep 1
			kill -KILL "-$runner" 2>/dev/null
		fi
	fi
	# The conformance app: its primary and workers (a process group of their own).
	if [ -s "$work/conf-app.pid" ]; then
		app=$(cat "$work/conf-app.pid")
		kill -TERM "-$app" 2>/dev/null || kill -TERM "$app" 2>/dev/null
		sleep 1
		kill -KILL "-$app" 2>/dev/null
	fi
	while read -r pid; do
		[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
	done <"$pids"
	[ -d "$work/brokers" ] && brokers_stop "$work/brokers"
	[ -d "$pgdir/data" ] && sh "$root/test/cluster.sh" stop "$pgdir" >/dev/null 2>&1
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail_setup() {
	echo "test.sh: $1" >&2
	echo "0 passed, 1 failed"
	exit 1
}

# The inbox tests' brokers, unless the tests picked leave them out.
brokers=yes
case "${IDEM_NODE_TESTS:-inbox}" in *inbox*) ;; *) brokers=no ;; esac
# Node and npm (and the brokers) from Debian's packages when the machine has none.
missing=""
command -v node >/dev/null 2>&1 || missing="nodejs"
command -v npm >/dev/null 2>&1 || missing="$missing npm"
if [ "$brokers" = yes ]; then
	[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing="$missing rabbitmq-server"
	command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
fi
if [ -n "$missing" ]; then
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	echo "installing:$missing"
	{ $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
			install -y -qq --no-install-recommends $missing; } >"$work/apt.log" 2>&1 ||
		{ cat "$work/apt.log" >&2; fail_setup "could not install$missing"; }
fi
# --test-concurrency exists from Node 20.10 on; older runners take the
# files one at a time on two cores anyway.
concurrency=""
node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 10) ? 0 : 1)' &&
	concurrency="--test-concurrency=1"

cd "$here" || fail_setup "no $here"
npm ci --prefer-offline --no-audit --no-fund --loglevel=error >"$work/npm.log" 2>&1 ||
	{ cat "$work/npm.log" >&2; fail_setup "npm ci failed"; }

# Without the purge worker: it runs on the real clock and would delete,
# between two steps of a test, a key that a test stored at a clock it moved.
sh "$root/test/cluster.sh" start "$pgdir" "$port" 'idem.purge_enabled = off' >"$work/cluster.log" 2>&1 ||
	{ cat "$work/cluster.log" "$pgdir/initdb.log" "$pgdir/server.log" >&2 2>/dev/null; fail_setup "could not start the cluster"; }

export PGHOST="$pgdir" PGPORT="$port" PGUSER=postgres PGDATABASE=postgres
export IDEM_TEST_PIDFILE="$pids"
if [ "$brokers" = yes ]; then
	brokers_start "$work/brokers" || fail_setup "could not start the brokers (RabbitMQ, Redis) for test/inbox.test.js"
fi
psql -X -q -v ON_ERROR_STOP=1 -c 'CREATE EXTENSION idem' >"$work/psql.log" 2>&1 ||
	{ cat "$work/psql.log" >&2; fail_setup "CREATE EXTENSION idem failed (is it installed? make && make install)"; }

# The suite runs twice: in the cluster's UTF8 database, then in idem_odd
# (test/odd_database.sql: SQL_ASCII, with the settings that change how
# values are written and read as text far from their defaults).
psql -X -q -v ON_ERROR_STOP=1 -f "$root/test/odd_database.sql" >"$work/psql-odd.log" 2>&1 ||
	{ cat "$work/psql-odd.log" >&2; fail_setup "could not create the idem_odd database"; }

# The runner gets its own process group (setsid) so that cleanup can stop
# it with every test process and app server under it.
newgroup=""
command -v setsid >/dev/null 2>&1 && newgroup="setsid -w"
rc=0
passed=0
failed=0
suite() { # DATABASE: node --test against it, counts added
	echo "# node --test: database $1"
	(
		PGDATABASE=$1 $newgroup sh -c 'echo $$ >"$0"; c=$1; shift; exec node --test --test-reporter=tap $c "$@"' \
			"$work/node.pid" "$concurrency" ${IDEM_NODE_TESTS:-test/*.test.js}
		echo $? >"$work/rc"
	) 2>&1 | tee "$work/node-$1.log" &
	wait $!
	src=$(cat "$work/rc" 2>/dev/null || echo 1)
	rm -f "$work/rc"
	p=$(sed -n 's/^# pass \([0-9][0-9]*\)$/\1/p' "$work/node-$1.log" | tail -n 1)
	f=$(sed -n 's/^# fail \([0-9][0-9]*\)$/\1/p' "$work/node-$1.log" | tail -n 1)
	c=$(sed -n 's/^# cancelled \([0-9][0-9]*\)$/\1/p' "$work/node-$1.log" | tail -n 1)
	f=$(( ${f:-0} + ${c:-0} ))
	[ "$src" -ne 0 ] && [ "$f" -eq 0 ] && f=1
	[ "$src" -ne 0 ] && rc=$src
	passed=$((passed + ${p:-0}))
	failed=$((failed + f))
}
suite postgres
suite idem_odd

# The conformance app of test/http/README.md (test/conformance_app.js: two
# workers under node:cluster, a killed one forked again) on a free port of
# 127.0.0.1 (port 0: the app writes the port it got to conf.ready), or on
# IDEM_CONF_PORT when set (the suite fails at once if that port is taken),
# checked by test/http/conformance.py (IDEM_CONFORMANCE
# names another runner); skipped when the runner is missing.
runner=${IDEM_CONFORMANCE:-$root/test/http/conformance.py}
if [ -f "$runner" ] && [ -z "${IDEM_NODE_TESTS:-}" ]; then
	app_port=${IDEM_CONF_PORT:-0}
	conf_passed=0
	conf_failed=1
	if [ "$app_port" != 0 ] && ! port_free "$app_port" IDEM_CONF_PORT; then
		echo "test.sh: the conformance app cannot listen on port $app_port" >&2
	elif psql -X -q -v ON_ERROR_STOP=1 -c 'CREATE TABLE conf_orders (id bigserial PRIMARY KEY, key text NOT NULL, route text NOT NULL)' \
		>"$work/conf-psql.log" 2>&1; then
		IDEM_CONF_PORT=$app_port IDEM_CONF_READY="$work/conf.ready" $newgroup sh -c 'echo $$ >"$0"; exec node test/conformance_app.js' "$work/conf-app.pid" \
			>"$work/conf-app.log" 2>&1 </dev/null &
		i=0
		while [ ! -s "$work/conf.ready" ] && [ "$i" -lt 300 ]; do
			sleep 0.1
			i=$((i + 1))
		done
		if [ -s "$work/conf.ready" ]; then
			app_port=$(cat "$work/conf.ready")
			python3 "$runner" --url "http://127.0.0.1:$app_port" \
				--dsn "host=$pgdir port=$port user=postgres dbname=postgres" 2>&1 | tee "$work/conf.log"
			summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$work/conf.log" | tail -n 1)
			if [ -n "$summary" ]; then
				conf_passed=${summary%% passed*}
				conf_failed=${summary#*passed, }
				conf_failed=${conf_failed%% failed}
			fi
		else
			echo "test.sh: the conformance app did not start" >&2
			cat "$work/conf-app.log" >&2
		fi
	else
		cat "$work/conf-psql.log" >&2
	fi
	echo "conformance: $conf_passed passed, $conf_failed failed"
	passed=$((passed + conf_passed))
	failed=$((failed + conf_failed))
fi

# The types: a scratch project installs this package as npm would
# (--install-links) with typescript, @types/express and @types/pg, and
# compiles test/types/example.ts (the middleware, the guard, transactional
# mode) with tsc --strict.  One test.
if [ -z "${IDEM_NODE_TESTS:-}" ]; then
	ts="$work/ts"
	mkdir -p "$ts"
	cp "$here/test/types/example.ts" "$ts/example.ts"
	if (cd "$ts" && echo '{"name":"idem-pg-types-check","private":true}' >package.json &&
		npm install --install-links --prefer-offline --no-audit --no-fund --loglevel=error \
			"$here" typescript @types/express @types/pg express pg &&
		npx --no-install tsc --strict --noEmit --esModuleInterop --module commonjs --target es2020 example.ts) \
		>"$work/tsc.log" 2>&1; then
		echo "ok - tsc --strict compiles test/types/example.ts against the installed package"
		passed=$((passed + 1))
	else
		cat "$work/tsc.log" >&2
		echo "not ok - tsc --strict compiles test/types/example.ts against the installed package"
		failed=$((failed + 1))
	fi
fi

echo "$passed passed, $failed failed"
[ "$rc" -eq 0 ] && [ "$failed" -eq 0 ]
