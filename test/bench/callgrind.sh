#!/bin/sh
# Instructions per call of idem_begin (new key and replay) and
# idem_complete, counted by callgrind in a single-user backend: 2000 new
# keys claimed, completed and replayed, each set in one statement (the
# replays also on a copy vacuumed after the completes).  Then
# the whole backend's instructions per one-call statement of a prepared
# replay, against the primary-key SELECT of the same stored response
# from a copy of the table (test/bench/peers.sql's plain_keys, vacuumed):
# the difference between runs of 2100 and 100 statements, so that start-up
# and shutdown cancel.  Instruction counts do not depend on the machine's
# load.
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

# cg NAME FROM TOGGLES STATEMENT...: run the statements in a single-user
# backend under callgrind, on a copy of the data directory FROM, with the
# callgrind options TOGGLES (empty: the whole backend), into $dir/NAME.out.
cg() {
	name=$1 from=$2 toggles=$3
	shift 3
	printf '%s\n' "$@" >"$dir/$name.sql"
	rm -rf "$dir/data.$name"
	cp -a "$dir/$from" "$dir/data.$name"
	as_owner "valgrind --tool=callgrind --callgrind-out-file='$dir/$name.out' $toggles \
		'$bindir/postgres' --single -D '$dir/data.$name' \
		-c shared_preload_libraries=idem -c idem.purge_enabled=off \
		-c max_stack_depth=2MB postgres <'$dir/$name.sql' >'$dir/$name.log' 2>&1"
}

# run NAME FROM STATEMENT...: count only inside idem_begin, idem_complete
# and idem_checkpoint; print "begin complete checkpoint" totals.
run() {
	name=$1 from=$2
	shift 2
	cg "$name" "$from" "--toggle-collect=idem_begin --toggle-collect=idem_complete \
		--toggle-collect=idem_checkpoint" "$@"
	callgrind_annotate --inclusive=yes "$dir/$name.out" 2>/dev/null |
		awk '$2 ~ /^\(/ && $3 ~ /:idem_begin$/ && !b { gsub(",", "", $1); b = $1 }
		     $2 ~ /^\(/ && $3 ~ /:idem_complete$/ && !c { gsub(",", "", $1); c = $1 }
		     $2 ~ /^\(/ && $3 ~ /:idem_checkpoint$/ && !k { gsub(",", "", $1); k = $1 }
		     END { print b + 0, c + 0, k + 0 }'
}

# Whole-backend instructions of a run of statements, on data.stmt.
total() {
	name=$1
	shift
	cg "$name" data.stmt "" "$@"
	sed -n 's/^totals: *//p' "$dir/$name.out"
}
# k1..k1000 completed in idem.keys and copied into plain_keys.
as_owner "cp -a '$dir/data' '$dir/data.stmt'"
printf '%s\n' "$setup" "$claims" "$completes" \
	"CREATE TABLE plain_keys (LIKE idem.keys INCLUDING ALL);" \
	"INSERT INTO plain_keys SELECT * FROM idem.keys;" \
	"VACUUM ANALYZE plain_keys;" "VACUUM ANALYZE idem.keys;" >"$dir/stmt-setup.sql"
as_owner "'$bindir/postgres' --single -D '$dir/data.stmt' -c shared_preload_libraries=idem \
	-c idem.purge_enabled=off postgres <'$dir/stmt-setup.sql' >'$dir/stmt-setup.log' 2>&1"
# n EXECUTEs of the prepared q, keys k1..k1000 in turn.
statements() {
	awk -v n="$1" 'BEGIN { for (i = 0; i < n; i++) printf "EXECUTE q(%ck%d%c);\n", 39, i % 1000 + 1, 39 }'
}
idem_q="PREPARE q(text) AS SELECT count(*) FROM idem_begin(\$1, 'fp') b WHERE b.state = 'DONE';"
peer_q="PREPARE q(text) AS SELECT count(*) FROM plain_keys k WHERE k.scope = '' AND k.key = \$1 AND k.status IS NOT NULL;"
si=$(( $(total si2100 "$idem_q" "$(statements 2100)") - $(total si100 "$idem_q" "$(statements 100)") ))
sp=$(( $(total sp2100 "$peer_q" "$(statements 2100)") - $(total sp100 "$peer_q" "$(statements 100)") ))

a=$(run a data "$setup" "$claims" "$completes")
b=$(run b data "$setup" "$claims" "$completes" "$replays")
c=$(run c data "$setup" "$claims" "$checkpoints")
# The same replays on data.stmt, vacuumed after its completes: the key's
# version is found without passing the versions the completes left.
v=$(run v data.stmt "$replays")
echo "$a $b $c $v" | awk -v n=$n '{
	printf "instructions per call (callgrind, %d keys): new claim %.1fk, complete %.1fk, replay %.1fk (%.1fk on a vacuumed table), checkpoint %.1fk\n",
		n, $1 / n / 1000, $2 / n / 1000, ($4 - $1) / n / 1000, $10 / n / 1000, $9 / n / 1000 }'
echo "$si $sp" | awk '{
	printf "instructions per one-call statement (prepared, whole backend): replay %.1fk, primary-key SELECT %.1fk (%.2fx)\n",
		$1 / 2000 / 1000, $2 / 2000 / 1000, $1 / $2 }'
