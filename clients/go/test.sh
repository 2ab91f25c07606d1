#!/bin/sh
# Run the Go client's tests against a throwaway PostgreSQL cluster.
#
#   sh clients/go/test.sh
#
# The cluster listens on port 55432 unless IDEM_GO_TEST_PORT names another,
# on a Unix socket in the suite's own directory and on no TCP port.
# IDEM_GO_TESTS, when set, is passed to go test -run (a regular expression
# of test names): IDEM_GO_TESTS=TestDoTx sh clients/go/test.sh
#
# The idem extension must be installed already (make install).  Installs
# Debian's Go and pgx v4 packages if they are missing, starts a cluster
# with test/cluster.sh (as root, its server runs as the user idemtest),
# runs CREATE EXTENSION idem and `go test` in GOPATH mode (in the UTF8
# database postgres, then in test/odd_database.sql's), then moduletest's
# TestModuleMode in module mode without a module proxy (README.md, "Module
# mode, offline"), always stops the cluster, and ends with a line
# "N passed, N failed" counting the Go test cases (tests and subtests) and
# the broker kill tests.
#
# The broker kill tests (clients/go/inbox_kill.sh, one case per broker)
# run the Inbox's consumer against RabbitMQ and Redis streams, which
# the script starts on free ports as the unprivileged user, and kill it
# 200 times each; IDEM_GO_BROKERS names the brokers ("rabbitmq redis" by
# default, none when IDEM_GO_TESTS is set): IDEM_GO_BROKERS=redis.  The
# install step installs rabbitmq-server, redis-server and their Go
# libraries (amqp091-go, redigo) when they are needed and missing.
set -u

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
port=${IDEM_GO_TEST_PORT:-55432}
# No libpq variable of the caller's reaches a connection (test/ports.sh).
. "$root/test/ports.sh"
dir=$(mktemp -d /tmp/idem-go-cluster.XXXXXX) || { echo "0 passed, 1 failed"; exit 1; }
work=
gotest=
done_cleanup=

cleanup() {
	[ -n "$done_cleanup" ] && return
	done_cleanup=1
	[ -n "$gotest" ] && kill "$gotest" 2>/dev/null
	if [ -d "$dir" ]; then
		sh "$root/test/cluster.sh" stop "$dir" >/dev/null 2>&1
		rm -rf "$dir"
	fi
	[ -n "$work" ] && rm -rf "$work"
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

fail() {
	echo "go client: $*" >&2
	echo "0 passed, 1 failed"
	exit 1
}

# 1. Debian packages: Go 1.19 and pgx v4 (GOPATH sources in /usr/share/gocode).
missing=
command -v go >/dev/null 2>&1 || missing="$missing golang-go"
[ -d /usr/share/gocode/src/github.com/jackc/pgx/v4/pgxpool ] ||
	missing="$missing golang-github-jackc-pgx-v4-dev"
if [ -z "${IDEM_GO_TESTS:-}" ]; then
	brokers=${IDEM_GO_BROKERS-rabbitmq redis}
else
	brokers=${IDEM_GO_BROKERS:-}
fi
case " $brokers " in *" rabbitmq "*)
	command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] ||
		missing="$missing rabbitmq-server"
	[ -d /usr/share/gocode/src/github.com/rabbitmq/amqp091-go ] ||
		missing="$missing golang-github-rabbitmq-amqp091-go-dev" ;;
esac
case " $brokers " in *" redis "*)
	command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
	[ -d /usr/share/gocode/src/github.com/gomodule/redigo/redis ] ||
		missing="$missing golang-github-gomodule-redigo-dev" ;;
esac
if [ -n "$missing" ]; then
	if [ "$(id -u)" -eq 0 ]; then sudo=; else sudo=sudo; fi
	echo "installing:$missing"
	$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null &&
		$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $missing >/dev/null ||
		fail "could not install$missing"
fi
command -v pg_config >/dev/null 2>&1 || fail "pg_config not found: install the extension first (make install)"

# 2. A throwaway cluster with the extension.  The purge worker is off: it
# runs on the real clock and would delete, between two steps of a test, a
# key that a test stored at a clock it moved (idem.clock_offset).
work=$(mktemp -d /tmp/idem-go-work.XXXXXX) || fail "mktemp failed"
sh "$root/test/cluster.sh" start "$dir" "$port" 'idem.purge_enabled = off' || {
	cat "$dir/initdb.log" "$dir/server.log" 2>/dev/null | tail -n 30 >&2
	fail "could not start the test cluster"
}
psql="$(pg_config --bindir)/psql"
"$psql" -X -q -h "$dir" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 \
	-c 'CREATE EXTENSION idem' || fail "CREATE EXTENSION idem failed"
# The second run's database: SQL_ASCII, with the settings that change how
# values are written and read as text far from their defaults.
"$psql" -X -q -h "$dir" -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 \
	-f "$root/test/odd_database.sql" || fail "could not create the idem_odd database"

# 3. go test in GOPATH mode: the package is linked into a temporary GOPATH.
mkdir -p "$work/gopath/src/idem/clients" &&
	ln -s "$here" "$work/gopath/src/idem/clients/go" || fail "GOPATH set-up failed"
[ -n "${GOCACHE:-}" ] || [ -n "${HOME:-}" ] || GOCACHE="$work/gocache"
[ -n "${GOCACHE:-}" ] && export GOCACHE
log="$work/go-test.log"
: >"$log"
rc=0
# go test against database $1, its output added to $log.  In the background,
# so that a signal interrupts the wait and the trap stops the cluster at once.
run_go() {
	echo "# go test: database $1" >>"$log"
	(
		cd "$work/gopath/src/idem/clients/go" &&
			GO111MODULE=off GOPATH="$work/gopath:/usr/share/gocode" GOFLAGS= GOPROXY=off \
				IDEM_TEST_DSN="host=$dir port=$port user=postgres dbname=$1" \
				exec go test -v -count=1 -timeout 300s ${IDEM_GO_TESTS:+-run "$IDEM_GO_TESTS"} ./idempotency/
	) >>"$log" 2>&1 &
	gotest=$!
	wait "$gotest"
	grc=$?
	gotest=
	[ "$grc" -ne 0 ] && rc=$grc
}
run_go postgres
run_go idem_odd

# 4. Module mode, offline (README.md, "Module mode, offline"): a module of
# the user's that requires idem/clients/go, replaces it with this folder
# and takes pgx v4 from Debian's sources through vendor/, with no module
# proxy; its test (moduletest/) runs against the database postgres.
run_module() {
	echo "# go test: module mode, database postgres" >>"$log"
	mod=$work/module
	mkdir -p "$mod/vendor/idem/clients" &&
		cp "$here/moduletest/module_test.go" "$mod/" &&
		ln -s /usr/share/gocode/src/github.com /usr/share/gocode/src/golang.org "$mod/vendor/" &&
		ln -s "$here" "$mod/vendor/idem/clients/go" &&
		cat >"$mod/go.mod" <<EOF &&
module example.com/moduletest

go 1.19

require (
	github.com/jackc/pgx/v4 v4.15.0
	idem/clients/go v0.0.0
)

replace idem/clients/go => $here
EOF
		cat >"$mod/vendor/modules.txt" <<EOF || { echo "module set-up failed" >>"$log"; rc=1; return; }
# github.com/jackc/pgx/v4 v4.15.0
## explicit
# idem/clients/go v0.0.0 => $here
## explicit; go 1.19
# idem/clients/go => $here
EOF
	(
		cd "$mod" &&
			GO111MODULE=on GOFLAGS= GOPROXY=off \
				IDEM_TEST_DSN="host=$dir port=$port user=postgres dbname=postgres" \
				exec go test -v -count=1 -timeout 300s .
	) >>"$log" 2>&1 &
	gotest=$!
	wait "$gotest"
	grc=$?
	gotest=
	[ "$grc" -ne 0 ] && rc=$grc
}
case "${IDEM_GO_TESTS:-}" in '' | *Module*) run_module ;; esac
# 5. The Inbox's broker kill tests: a consumer (clients/go/inboxtest)
# killed with SIGKILL between its handler and its commit, between its
# commit and its ack and at random times, 200 times per broker; each
# prints "ok - BROKER: ..." or "not ok - BROKER: ...".
if [ -n "$brokers" ]; then
	(
		cd "$work/gopath/src/idem/clients/go" &&
			GO111MODULE=off GOPATH="$work/gopath:/usr/share/gocode" GOFLAGS= GOPROXY=off \
				exec go build -o "$work/inboxtest" ./inboxtest/
	) >>"$log" 2>&1 || { echo "not ok - inboxtest did not build" >>"$log"; rc=1; }
	for b in $brokers; do
		[ -x "$work/inboxtest" ] || break
		echo "# inbox kill test: $b" >>"$log"
		sh "$here/inbox_kill.sh" "$b" "$work/inboxtest" \
			"host=$dir port=$port user=postgres dbname=postgres" >>"$log" 2>&1 &
		gotest=$!
		wait "$gotest" || rc=1
		gotest=
	done
fi
cat "$log"

# 6. Count the cases.
passed=$(grep -c -e '--- PASS:' -e '^ok - ' "$log")
failed=$(grep -c -e '--- FAIL:' -e '^not ok - ' "$log")
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
	failed=1	# build failure, panic or timeout
fi
if [ "$rc" -ne 0 ]; then
	echo "go client: go test exited $rc; server log:" >&2
	tail -n 20 "$dir/server.log" >&2 2>/dev/null
fi
echo "$passed passed, $failed failed"
[ "$rc" -eq 0 ] && [ "$failed" -eq 0 ]
