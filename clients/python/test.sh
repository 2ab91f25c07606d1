#!/bin/sh
# Run the Python client's tests against a throwaway PostgreSQL cluster.
#
#   sh clients/python/test.sh
#
# Installs the Debian packages it needs if any is missing, starts a cluster
# (test/cluster.sh, port 55442, IDEM_PY_PORT) with the idem extension, which
# must already be installed (make && make install), and pgbouncer in
# transaction pooling in front of it; both listen only on Unix sockets in
# the suite's own directory (pgbouncer's on IDEM_PY_PORT + 3), so that
# another suite's servers, on the same ports, are out of reach.  Runs
# pytest with /usr/bin/python3 in the cluster's UTF8 database and again in
# test/odd_database.sql's, then serves the conformance app
# (tests/apps/conformance_*.py) for ASGI
# (FastAPI, gunicorn with two uvicorn workers; its guards on psycopg, then
# on asyncpg) and WSGI (Flask, gunicorn
# with two workers), each on a free TCP port of 127.0.0.1 (gunicorn binds
# port 0 and names the one it got), and runs test/http/conformance.py
# against each, then the inbox's broker kill tests (inbox_kill.sh:
# RabbitMQ and Redis streams, on free ports).  Stops the cluster and every
# app server it started on exit and prints "N passed, N failed" for all of
# it.  Exits non-zero on any failure.
set -u
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
py=/usr/bin/python3
port=${IDEM_PY_PORT:-55442}
# No libpq variable of the caller's reaches a connection (test/ports.sh).
. "$top/test/ports.sh"
dir=$(mktemp -d /tmp/idem-python.XXXXXX) || { echo "0 passed, 1 failed"; exit 1; }

# 1. Debian packages (python3 here is /usr/bin's; a pyenv on PATH does not
#    see them).
pkgs="python3 python3-psycopg python3-psycopg-pool python3-asyncpg python3-pytest \
	python3-starlette python3-fastapi python3-httpx python3-uvicorn \
	python3-flask python3-werkzeug python3-setuptools python3-wheel postgresql-client-15 \
	gunicorn pgbouncer rabbitmq-server redis-server python3-pika python3-redis python3-venv"
missing=""
for p in $pkgs; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
		missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "installing:$missing"
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	export DEBIAN_FRONTEND=noninteractive
	# shellcheck disable=SC2086 # $missing is a list of words
	if ! $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq ||
		! $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
			--no-install-recommends $missing >/dev/null; then
		echo "could not install:$missing" >&2
		echo "0 passed, 1 failed"
		exit 1
	fi
fi

# 4. Whatever happens, stop the app servers and the cluster.
pytest_pid=""
gunicorn_pid=""
stop_gunicorn() {
	# TERM to the master stops its workers; KILL if it has not after 10 s
	[ -n "$gunicorn_pid" ] || return 0
	kill "$gunicorn_pid" 2>/dev/null
	i=0
	while kill -0 "$gunicorn_pid" 2>/dev/null && [ $i -lt 100 ]; do
		sleep 0.1
		i=$((i + 1))
	done
	kill -9 "$gunicorn_pid" 2>/dev/null
	wait "$gunicorn_pid" 2>/dev/null
	gunicorn_pid=""
}
cleanup() {
	[ -n "$pytest_pid" ] && kill "$pytest_pid" 2>/dev/null && sleep 1
	stop_gunicorn
	if [ -f "$dir/app.pids" ]; then
		while read -r pid; do
			kill -9 "$pid" 2>/dev/null
		done <"$dir/app.pids"
	fi
	[ -s "$dir/pgbouncer.pid" ] && kill "$(cat "$dir/pgbouncer.pid")" 2>/dev/null
	[ -d "$dir/data" ] && sh "$top/test/cluster.sh" stop "$dir"
	rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 2. The cluster, without the purge worker: it runs on the real clock and
# would delete, between two steps of a test, a key that a test stored at a
# clock it moved.
bindir=$(pg_config --bindir)
if ! sh "$top/test/cluster.sh" start "$dir" "$port" 'idem.purge_enabled = off'; then
	cat "$dir/server.log" "$dir/initdb.log" 2>/dev/null | tail -20 >&2
	echo "0 passed, 1 failed"
	exit 1
fi

# 3. The extension, then the tests.  The cluster's superuser is postgres,
#    which the tests need to move time with idem.clock_offset.  The suite
#    runs twice: in the cluster's UTF8 database, then in idem_odd
#    (test/odd_database.sql: SQL_ASCII, where psycopg hands text over as
#    bytes, with the settings that change how values are written and
#    read as text far from their defaults).
dsn="host=$dir port=$port user=postgres dbname=postgres"
if ! "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -d "$dsn" -c 'CREATE EXTENSION idem'; then
	echo "idem is not installed: run make && make install first" >&2
	echo "0 passed, 1 failed"
	exit 1
fi
odd_dsn="host=$dir port=$port user=postgres dbname=idem_odd"
"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -d "$dsn" -f "$top/test/odd_database.sql" ||
	{ echo "0 passed, 1 failed"; exit 1; }
# pgbouncer in transaction pooling in front of every database of the
# cluster, for tests/test_pgbouncer.py: on a Unix socket in $dir (port + 3
# names it) and on no TCP port.  It refuses to run as root: as root it runs
# as the cluster's user.
bport=$((port + 3))
cat >"$dir/pgbouncer.ini" <<-INI
	[databases]
	* = host=$dir port=$port
	[pgbouncer]
	listen_addr =
	listen_port = $bport
	unix_socket_dir = $dir
	auth_type = trust
	auth_file = $dir/pgbouncer.users
	pool_mode = transaction
	server_check_delay = 0
	default_pool_size = 8
	logfile = $dir/pgbouncer.log
	pidfile = $dir/pgbouncer.pid
INI
echo '"postgres" ""' >"$dir/pgbouncer.users"
bouncer="$(command -v pgbouncer || echo /usr/sbin/pgbouncer) -d -q '$dir/pgbouncer.ini'"
if [ "$(id -u)" -eq 0 ]; then
	chown idemtest "$dir/pgbouncer.ini" "$dir/pgbouncer.users"
	su idemtest -s /bin/sh -c "cd / && $bouncer"
else
	sh -c "$bouncer"
fi || { cat "$dir/pgbouncer.log" >&2; echo "0 passed, 1 failed"; exit 1; }
# The daemon binds its socket after the starting process returned: wait
# for this pgbouncer (its pid file, its socket, an answer) before a test
# uses it.
i=0
until [ -s "$dir/pgbouncer.pid" ] && kill -0 "$(cat "$dir/pgbouncer.pid")" 2>/dev/null &&
	"$bindir/psql" -X -q -A -t -d "host=$dir port=$bport user=postgres dbname=postgres connect_timeout=2" \
		-c 'SELECT 1' >/dev/null 2>&1; do
	i=$((i + 1))
	if [ "$i" -ge 100 ]; then
		echo "pgbouncer did not start on $dir/.s.PGSQL.$bport" >&2
		cat "$dir/pgbouncer.log" >&2
		echo "0 passed, 1 failed"
		exit 1
	fi
	sleep 0.1
done
export IDEM_TEST_PGBOUNCER_DSN="host=$dir port=$bport user=postgres connect_timeout=5"
# Nothing listens on this socket of the suite's own directory (neither the
# cluster nor pgbouncer): the store is down.
export IDEM_TEST_DOWN_DSN="host=$dir port=$((port + 1)) user=postgres dbname=postgres connect_timeout=2"
export IDEM_TEST_PIDFILE="$dir/app.pids"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$here/src:$here/tests"
: >"$IDEM_TEST_PIDFILE"

cd "$here" || exit 1
rc=0
passed=0
failed=0
count() {
	echo "$summary" | grep -oE "[0-9]+ $1" | head -1 | cut -d' ' -f1
}
suite() { # NAME DSN [PYTEST_ARGS...]: pytest against DSN, counts added
	log="$dir/pytest-$1.log"
	export IDEM_TEST_DSN="$2"
	shift 2
	# In the background, so that a signal to this script is handled at once.
	"$py" -m pytest -p no:cacheprovider -q -rfE tests "$@" >"$log" 2>&1 &
	pytest_pid=$!
	wait "$pytest_pid"
	src=$?
	pytest_pid=""
	cat "$log"
	summary=$(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -1)
	[ -n "$summary" ] || summary=$(tail -1 "$log")
	p=$(count passed)
	f=$(count failed)
	e=$(count error)
	f=$(( ${f:-0} + ${e:-0} ))
	if [ "$src" -ne 0 ] && [ "$f" -eq 0 ]; then
		f=1            # pytest itself failed (collection, no tests, crash)
	fi
	[ "$src" -ne 0 ] && rc=$src
	passed=$((passed + ${p:-0}))
	failed=$((failed + f))
}
echo "# pytest: UTF8 database"
suite utf8 "$dsn" "$@"
echo "# pytest: idem_odd database (test/odd_database.sql)"
suite odd "$odd_dsn" "$@"

# 5. The conformance runner against each stack's app under gunicorn.
"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -d "$dsn" -c 'CREATE TABLE conf_orders
	(id bigserial PRIMARY KEY, key text NOT NULL, route text NOT NULL)' || failed=$((failed + 1))
conform() { # NAME DRIVER GUNICORN_ARGS...: serve, run the runner, stop
	name=$1
	driver=$2
	shift 2
	# Port 0: the kernel gives gunicorn a free port, which it logs
	# ("Listening at: http://127.0.0.1:PORT (PID)") before the app answers.
	IDEM_CONF_DSN="$dsn" IDEM_CONF_DOWN_DSN="$IDEM_TEST_DOWN_DSN" IDEM_TEST_DRIVER="$driver" \
		PYTHONPATH="$here/src:$here/tests" \
		"$py" -m gunicorn -w 2 -b 127.0.0.1:0 --chdir "$here/tests" \
		--graceful-timeout 5 "$@" >"$dir/gunicorn-$name.log" 2>&1 &
	gunicorn_pid=$!
	echo "$gunicorn_pid" >>"$IDEM_TEST_PIDFILE"
	if ! "$py" - "$dir/gunicorn-$name.log" "$gunicorn_pid" >"$dir/port-$name" <<-'EOF'; then
		import http.client, os, re, sys, time
		log, pid = sys.argv[1], int(sys.argv[2])
		port = None
		for _ in range(600):
		    try:
		        os.kill(pid, 0)
		    except OSError:
		        sys.exit("gunicorn exited")
		    if port is None:
		        m = re.search(r"Listening at: http://127\.0\.0\.1:(\d+) \(%d\)" % pid, open(log).read())
		        port = m and int(m.group(1))
		    if port is not None:
		        try:
		            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
		            c.request("GET", "/health")
		            if c.getresponse().status == 200:
		                print(port)
		                sys.exit(0)
		        except OSError:
		            pass
		    time.sleep(0.1)
		sys.exit("no answer on port %s" % port)
	EOF
		echo "$name: the app did not answer" >&2
		tail -20 "$dir/gunicorn-$name.log" >&2
		failed=$((failed + 1))
		stop_gunicorn
		return
	fi
	aport=$(cat "$dir/port-$name")
	echo "# conformance: $name"
	PSQL="$bindir/psql" "$py" "$top/test/http/conformance.py" \
		--url "http://127.0.0.1:$aport" --dsn "$dsn" >"$dir/conformance-$name.log" 2>&1
	crc=$?
	cat "$dir/conformance-$name.log"
	stop_gunicorn
	line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$dir/conformance-$name.log" | tail -1)
	p=$(echo "$line" | cut -d' ' -f1)
	f=$(echo "$line" | cut -d' ' -f3)
	passed=$((passed + ${p:-0}))
	failed=$((failed + ${f:-0}))
	if [ "$crc" -ne 0 ] && [ "${f:-0}" -eq 0 ]; then
		failed=$((failed + 1))   # the runner itself failed
		tail -20 "$dir/gunicorn-$name.log"
	fi
}
conform asgi psycopg -k uvicorn.workers.UvicornWorker apps.conformance_asgi:app
conform asgi-asyncpg asyncpg -k uvicorn.workers.UvicornWorker apps.conformance_asgi:app
conform wsgi psycopg apps.conformance_wsgi:app


# 6. The inbox's broker kill tests (inbox_kill.sh): RabbitMQ and Redis
#    streams, each started on free ports and stopped by the script.
for broker in rabbitmq redis; do
	echo "# inbox kill test: $broker"
	line=$(sh "$here/inbox_kill.sh" "$broker" "$dsn")
	echo "$line"
	if echo "$line" | grep -q '^ok - '; then
		passed=$((passed + 1))
	else
		failed=$((failed + 1))
	fi
done

# 7. mypy over the package (its own count line, added to the total).
tc=$(sh "$here/typecheck.sh")
trc=$?
echo "$tc"
line=$(echo "$tc" | grep -E '^[0-9]+ passed, [0-9]+ failed$' | tail -1)
p=$(echo "$line" | cut -d' ' -f1)
f=$(echo "$line" | cut -d' ' -f3)
passed=$((passed + ${p:-0}))
failed=$((failed + ${f:-0}))
[ "$trc" -ne 0 ] && [ "${f:-0}" -eq 0 ] && failed=$((failed + 1))
echo "$passed passed, $failed failed"
[ "$rc" -eq 0 ] && [ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
