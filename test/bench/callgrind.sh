#!/bin/sh
# Instructions per call of idem_begin (new key and replay) and
# idem_complete, counted by callgrind in a single-user backend: 2000 new
# keys claimed, completed and replayed, each set in one statement.
# Instruction counts do not depend on the machine's load.
#
#   sh test/bench/callgrind.sh          (after make install; root or the server's user)
set -eu
top=$(cd "$(dirname "$0")/../.." && pwd)
bindir=$(pg_config --bindir)
n=2000
dir=$(mktemp -d /tmp/idem-callgrind.XXXXXX)
trap '[ -n "${IDEM_KEEP:-}" ] || rm -rf "$dir"' EXIT INT TERM

as_owner() {
	if [ "$(id -u)" -eq 0 ]; then
		su idemtest -s /bin/sh -c "cd / && $1"
	else
		sh -c "$1"
	fi
}
command -v valgrind >/dev/null || {
	echo "installing valgrind"
	sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
	$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		$sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq valgrind >/dev/null
}
[ "$(id -u)" -eq 0 ] && sh "$top/test/user.sh" && chown idemtest "$dir"
as_owner "'$bindir/initdb' -D '$dir/data' -A trust -U postgres >/dev/null"

# IDEM_CG_VERSION=1.2 measures a table of that version (no claimed_by).
setup="CREATE EXTENSION idem${IDEM_CG_VERSION:+ VERSION '$IDEM_CG_VERSION'};${IDEM_CG_SETUP:-}"
claims="SELECT count(*) FROM generate_series(1, $n) g, idem_begin('k' || g, 'fp');"
completes="SELECT count(*) FROM idem.keys k, idem_complete(k.key, 'fp', 200, convert_to('{\"id\":' || k.token || '}', 'UTF8'), k.token);"
replays="SELECT count(*) FROM generate_series(1, $n) g, idem_begin('k' || g, 'fp') b WHERE b.state = 'DONE';"
checkpoints="SELECT count(*) FROM idem.keys k, idem_checkpoint(k.key, k.token, 'charge', convert_to('{\"id\":' || k.token || '}', 'UTF8'));"

# Run the statements in a single-user backend under callgrind, counting
# only inside idem_begin, idem_complete and idem_checkpoint; print
# "begin complete checkpoint" totals.
run() {
	name=$1
	shift
	printf '%s\n' "$@" >"$dir/$name.sql"
	rm -rf "$dir/data.$name"
	cp -a "$dir/data" "$dir/data.$name"
	as_owner "valgrind --tool=callgrind --callgrind-out-file='$dir/$name.out' \
		--toggle-collect=idem_begin --toggle-collect=idem_complete \
		--toggle-collect=idem_checkpoint \
		'$bindir/postgres' --single -D '$dir/data.$name' \
		-c shared_preload_libraries=idem -c idem.purge_enabled=off \
		-c max_stack_depth=2MB postgres <'$dir/$name.sql' >'$dir/$name.log' 2>&1"
	callgrind_annotate --inclusive=yes "$dir/$name.out" 2>/dev/null |
		awk '$2 ~ /^\(/ && $3 ~ /:idem_begin$/ && !b { gsub(",", "", $1); b = $1 }
		     $2 ~ /^\(/ && $3 ~ /:idem_complete$/ && !c { gsub(",", "", $1); c = $1 }
		     $2 ~ /^\(/ && $3 ~ /:idem_checkpoint$/ && !k { gsub(",", "", $1); k = $1 }
		     END { print b + 0, c + 0, k + 0 }'
}

a=$(run a "$setup" "$claims" "$completes")
b=$(run b "$setup" "$claims" "$completes" "$replays")
c=$(run c "$setup" "$claims" "$checkpoints")
echo "$a $b $c" | awk -v n=$n '{
	printf "instructions per call (callgrind, %d keys): new claim %.1fk, complete %.1fk, replay %.1fk, checkpoint %.1fk\n",
		n, $1 / n / 1000, $2 / n / 1000, ($4 - $1) / n / 1000, $9 / n / 1000 }'
