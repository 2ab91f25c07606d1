# shellcheck shell=sh
# Sourced by clients/node/test.sh (after test/ports.sh): throwaway message
# brokers for the inbox tests, each on free TCP ports of 127.0.0.1, in a
# directory of its own, as the unprivileged user (idemtest, test/user.sh)
# when run as root.
#
#   brokers_start DIR    RabbitMQ and Redis; sets IDEM_TEST_AMQP_URL and
#                        IDEM_TEST_REDIS_PORT, or says which failed and
#                        returns 1 (a port in use is named)
#   brokers_stop DIR     stops both (by their process ids), also half-started
#
# RabbitMQ (Debian's rabbitmq-server): a node name, a Mnesia and a log
# directory of its own, its AMQP, distribution and epmd ports (an epmd of
# its own, started here, so that no other suite's node is seen), no
# plugins.  Redis (Debian's redis-server): no RDB, no AOF.

broker_user() { # COMMAND: run it as the brokers' owner, from /
	if [ "$(id -u)" -eq 0 ]; then
		su idemtest -s /bin/sh -c "cd / && $1"
	else
		sh -c "cd / && $1"
	fi
}

port_listening() { # PORT: true if something accepts on 127.0.0.1:PORT
	perl -MIO::Socket::INET -e 'IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $ARGV[0],
		Proto => "tcp", Timeout => 1) or exit 1;' "$1"
}

brokers_start() {
	bdir=$1
	mkdir -p "$bdir/rabbit" "$bdir/redis"
	[ "$(id -u)" -eq 0 ] && { sh "$root/test/user.sh"; chown -R idemtest "$bdir"; }
	amqp_port=${IDEM_AMQP_PORT:-$(free_port)}
	dist_port=$(free_port)
	epmd_port=$(free_port)
	redis_port=${IDEM_REDIS_PORT:-$(free_port)}
	for p in "$amqp_port:RabbitMQ AMQP" "$dist_port:RabbitMQ distribution" "$epmd_port:epmd" "$redis_port:Redis"; do
		port_free "${p%%:*}" "${p#*:}" || return 1
	done
	# Redis: the shell's pid is redis-server's (exec).
	broker_user "echo \$\$ >'$bdir/redis/pid'; exec redis-server --port $redis_port --bind 127.0.0.1 \
		--save '' --appendonly no --dir '$bdir/redis' --daemonize no >'$bdir/redis/log' 2>&1" &
	r="$bdir/rabbit"
	echo '[].' >"$r/enabled_plugins"
	: >"$r/env.conf"
	echo 'loopback_users = none' >"$r/rabbitmq.conf"
	[ "$(id -u)" -eq 0 ] && chown -R idemtest "$r"
	broker_user "echo \$\$ >'$r/epmd.pid'; exec epmd -port $epmd_port -address 127.0.0.1 >'$r/epmd.log' 2>&1" &
	i=0
	until port_listening "$epmd_port" || [ "$i" -ge 50 ]; do sleep 0.1; i=$((i + 1)); done
	broker_user "echo \$\$ >'$r/sh.pid'; HOME='$r' ERL_EPMD_PORT=$epmd_port RABBITMQ_NODENAME='idem$$@localhost' \
		RABBITMQ_MNESIA_BASE='$r/mnesia' RABBITMQ_LOG_BASE='$r/log' RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
		RABBITMQ_NODE_PORT=$amqp_port RABBITMQ_DIST_PORT=$dist_port RABBITMQ_CONFIG_FILE='$r/rabbitmq' \
		RABBITMQ_ENABLED_PLUGINS_FILE='$r/enabled_plugins' RABBITMQ_CONF_ENV_FILE='$r/env.conf' \
		RABBITMQ_ADVANCED_CONFIG_FILE='$r/advanced.config' RABBITMQ_PID_FILE='$r/rabbit.pid' \
		exec /usr/lib/rabbitmq/bin/rabbitmq-server >'$r/out.log' 2>&1" &
	i=0
	until port_listening "$redis_port" || [ "$i" -ge 100 ]; do sleep 0.1; i=$((i + 1)); done
	port_listening "$redis_port" || { cat "$bdir/redis/log" >&2; echo "test.sh: redis-server did not start on port $redis_port" >&2; return 1; }
	i=0
	until port_listening "$amqp_port" || [ "$i" -ge 900 ]; do sleep 0.1; i=$((i + 1)); done
	port_listening "$amqp_port" || { tail -n 30 "$r/out.log" >&2; echo "test.sh: rabbitmq-server did not start on port $amqp_port" >&2; return 1; }
	IDEM_TEST_AMQP_URL="amqp://guest:guest@127.0.0.1:$amqp_port"
	IDEM_TEST_REDIS_PORT=$redis_port
	export IDEM_TEST_AMQP_URL IDEM_TEST_REDIS_PORT
}

brokers_stop() {
	bdir=$1
	for f in "$bdir/rabbit/rabbit.pid" "$bdir/rabbit/sh.pid" "$bdir/redis/pid"; do
		[ -s "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null
	done
	i=0
	while [ "$i" -lt 100 ]; do
		alive=""
		for f in "$bdir/rabbit/rabbit.pid" "$bdir/redis/pid"; do
			[ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=yes
		done
		[ -z "$alive" ] && break
		sleep 0.1
		i=$((i + 1))
	done
	for f in "$bdir/rabbit/rabbit.pid" "$bdir/rabbit/sh.pid" "$bdir/redis/pid" "$bdir/rabbit/epmd.pid"; do
		[ -s "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null
	done
	return 0
}
