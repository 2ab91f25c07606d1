#!/bin/sh
# The inbox's broker kill test against one broker Debian ships (run by
# clients/python/test.sh):
#
#   sh clients/python/inbox_kill.sh rabbitmq|redis DSN
#
# Starts the broker on free TCP ports of 127.0.0.1 (as root, as the user
# idemtest), with its state in a directory of its own: RabbitMQ with its
# own node name, Mnesia and log directories, AMQP, distribution and epmd
# ports, so that two runs share nothing; Redis with no persistence.  A
# port found in use fails the run at once, naming it.  Then
# tests/inbox_kill.py publishes messages and SIGKILLs the consumer
# IDEM_INBOX_KILLS times (80 by default) and prints "ok - BROKER: N
# kills, ..., 0 duplicated effects, 0 lost, 0 not acked" or "not ok -
# ...".  The broker is stopped on exit, failure included.
set -u

broker=$1
dsn=$2
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../../test/ports.sh"
kills=${IDEM_INBOX_KILLS:-80}
py=/usr/bin/python3

dir=$(mktemp -d /tmp/idem-py-inbox-$broker.XXXXXX) || exit 1
chmod 755 "$dir"
pidfile=$dir/broker.pid
epmd_port=
cleaned=

as_user() {
	if [ "$(id -u)" -eq 0 ]; then
		su idemtest -s /bin/sh -c "cd / && $1"
	else
		sh -c "cd / && $1"
	fi
}

cleanup() {
	[ -n "$cleaned" ] && return
	cleaned=1
	if [ -s "$pidfile" ]; then
		pid=$(cat "$pidfile")
		kill "$pid" 2>/dev/null
		i=0
		while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 100 ]; do
			sleep 0.1
			i=$((i + 1))
		done
		kill -9 "$pid" 2>/dev/null
	fi
	# the epmd that this run's RabbitMQ started on its own port
	[ -n "$epmd_port" ] && as_user "ERL_EPMD_PORT=$epmd_port epmd -kill >/dev/null 2>&1"
	rm -rf "$dir"
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

fail() {
	echo "not ok - $broker: $*"
	exit 1
}

[ "$(id -u)" -eq 0 ] && chown idemtest "$dir"

# wait_port PORT SECONDS: until something listens on 127.0.0.1:PORT.
wait_port() {
	perl -MIO::Socket::INET -e '
		my ($port, $secs) = @ARGV;
		for (1 .. $secs * 10) {
			exit 0 if IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $port, Proto => "tcp");
			select(undef, undef, undef, 0.1);
		}
		exit 1;' "$1" "$2"
}

case "$broker" in
rabbitmq)
	[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || fail "rabbitmq-server is not installed"
	port=$(free_port) && dist=$(free_port) && epmd=$(free_port) || fail "no free port"
	[ "$port" != "$dist" ] && [ "$dist" != "$epmd" ] && [ "$port" != "$epmd" ] ||
		fail "free_port answered one port twice"
	for p in "$port" "$dist" "$epmd"; do
		port_free "$p" rabbitmq || fail "port $p is in use"
	done
	epmd_port=$epmd
	node="idempy$$@localhost"
	as_user "HOME='$dir' RABBITMQ_HOME=/usr/lib/rabbitmq RABBITMQ_NODENAME='$node' \
		RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=$port RABBITMQ_DIST_PORT=$dist \
		ERL_EPMD_PORT=$epmd ERL_EPMD_ADDRESS=127.0.0.1 \
		RABBITMQ_MNESIA_BASE='$dir/mnesia' RABBITMQ_LOG_BASE='$dir/log' \
		RABBITMQ_PID_FILE='$pidfile' RABBITMQ_CONFIG_FILE='$dir/rabbitmq' \
		RABBITMQ_ADVANCED_CONFIG_FILE='$dir/advanced.config' RABBITMQ_CONF_ENV_FILE='$dir/env.conf' \
		RABBITMQ_ENABLED_PLUGINS_FILE='$dir/enabled_plugins' RABBITMQ_ENABLED_PLUGINS= \
		/usr/lib/rabbitmq/bin/rabbitmq-server >'$dir/server.out' 2>&1 &"
	if ! wait_port "$port" 90; then
		tail -n 20 "$dir/server.out" >&2
		grep -q -i 'eaddrinuse' "$dir/server.out" "$dir"/log/* 2>/dev/null &&
			fail "port $port, $dist or $epmd is in use: RabbitMQ could not listen"
		fail "RabbitMQ did not start on port $port in 90 s"
	fi
	addr="amqp://guest:guest@127.0.0.1:$port/%2F"
	;;
redis)
	command -v redis-server >/dev/null 2>&1 || fail "redis-server is not installed"
	port=$(free_port) || fail "no free port"
	port_free "$port" redis || fail "port $port is in use"
	as_user "redis-server --port $port --bind 127.0.0.1 --save '' --appendonly no --dir '$dir' \
		--pidfile '$pidfile' --daemonize yes --logfile '$dir/redis.log'"
	if ! wait_port "$port" 20; then
		tail -n 20 "$dir/redis.log" >&2
		grep -q -i 'address already in use' "$dir/redis.log" 2>/dev/null && fail "port $port is in use"
		fail "Redis did not start on port $port"
	fi
	i=0
	while [ ! -s "$pidfile" ] && [ "$i" -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
	addr="127.0.0.1:$port"
	;;
*)
	fail "unknown broker (rabbitmq or redis)"
	;;
esac

PYTHONPATH="$here/src:$here/tests" "$py" "$here/tests/inbox_kill.py" drive "$broker" "$addr" \
	"$dsn" "$kills" 2>"$dir/driver.err"
rc=$?
if [ "$rc" -ne 0 ]; then
	tail -n 20 "$dir/driver.err" >&2
	tail -n 20 "$dir/redis.log" "$dir/server.out" >&2 2>/dev/null
	echo "not ok - $broker: the driver exited $rc"
fi
exit "$rc"
