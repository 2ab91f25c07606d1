#!/bin/sh
# Whole-backend instructions, counted by callgrind in a single-user
# backend: per new-key transaction of row 7 (BEGIN; idem_begin; the order
# INSERT; idem_complete; COMMIT, prepared, a fingerprint per key) against
# the hand-written key table's (INSERT ... ON CONFLICT DO NOTHING
# RETURNING; the order; UPDATE of the response), the difference between
# runs of 1100 and 100 transactions, less what the single-user backend
# spends printing results (debugtup, which a client's server does not
# run); and per key of row 1c (idem_begin_many and idem_complete_many of
# B keys in one transaction) against the set-based SQL peer.
#
#   sh test/bench/callgrind_tx.sh        (after make install; root or the server's user)
#   IDEM_KEEP=1 B=20000 sh test/bench/callgrind_tx.sh
set -eu
top=$(cd "$(dirname "$0")/../.." && pwd)
bindir=$(pg_config --bindir)
n=1100
b=${B:-20000}
dir=$(mktemp -d /tmp/idem-callgrind-tx.XXXXXX)
trap '[ -n "${IDEM_KEEP:-}" ] || rm -rf "$dir"' EXIT INT TERM

as_owner() {
	if [ "$(id -u)" -eq 0 ]; then
		su idemtest -s /bin/sh -c "cd / && $1"
	else
		sh -c "$1"
	fi
}
[ "$(id -u)" -eq 0 ] && sh "$top/test/user.sh" && chown idemtest "$dir"
as_owner "'$bindir/initdb' -D '$dir/data' -A trust -U postgres >/dev/null"
cat >"$dir/setup.sql" <<'S'
CREATE EXTENSION idem;
CREATE TABLE e2e_orders (id bigserial PRIMARY KEY, key text NOT NULL, amount int NOT NULL, created timestamptz NOT NULL DEFAULT now());
CREATE TABLE e2e_keys (key text PRIMARY KEY, status int, body bytea, expires_at timestamptz NOT NULL DEFAULT now() + interval '1 day');
CREATE TABLE plain_keys (LIKE idem.keys INCLUDING ALL);
CREATE SEQUENCE plain_token_seq;
S
as_owner "'$bindir/postgres' --single -D '$dir/data' -c shared_preload_libraries=idem \
	-c idem.purge_enabled=off postgres <'$dir/setup.sql' >'$dir/setup.log' 2>&1"

# cg NAME STATEMENTS: whole-backend instructions less the printing of results.
cg() {
	rm -rf "$dir/data.$1"
	cp -a "$dir/data" "$dir/data.$1"
	printf '%s\n' "$2" >"$dir/$1.sql"
	as_owner "valgrind --tool=callgrind --callgrind-out-file='$dir/$1.out' \
		'$bindir/postgres' --single -D '$dir/data.$1' -c shared_preload_libraries=idem \
		-c idem.purge_enabled=off -c max_stack_depth=2MB postgres <'$dir/$1.sql' >'$dir/$1.log' 2>&1"
	callgrind_annotate --inclusive=yes --auto=no --threshold=100 "$dir/$1.out" 2>/dev/null |
		awk '/PROGRAM TOTALS/ { gsub(",", "", $1); t = $1 }
			$2 ~ /^\(/ && /:debug(tup|Startup) / { gsub(",", "", $1); p += $1 }
			END { print t - p }'
}

body="'\\\\x$(printf '%0200d' 0)'"
prep_idem="PREPARE b(text) AS SELECT * FROM idem_begin(\$1, 'amount=4200;' || \$1);
PREPARE o(text) AS INSERT INTO e2e_orders (key, amount) VALUES (\$1, 4200) RETURNING id;
PREPARE c(text, bytea) AS SELECT idem_complete(\$1, 'amount=4200;' || \$1, 201, \$2);"
prep_table="PREPARE b(text) AS INSERT INTO e2e_keys (key) VALUES (\$1) ON CONFLICT DO NOTHING RETURNING true;
PREPARE o(text) AS INSERT INTO e2e_orders (key, amount) VALUES (\$1, 4200) RETURNING id;
PREPARE c(text, bytea) AS UPDATE e2e_keys SET status = 201, body = \$2 WHERE key = \$1;"
tx() {
	awk -v n="$1" -v body="$body" 'BEGIN { for (i = 1; i <= n; i++)
		printf "BEGIN;\nEXECUTE b(%ck%d%c);\nEXECUTE o(%ck%d%c);\nEXECUTE c(%ck%d%c, %s);\nCOMMIT;\n",
			39, i, 39, 39, i, 39, 39, i, 39, body }'
}
i=$(( $(cg i2 "$prep_idem
$(tx $n)") - $(cg i1 "$prep_idem
$(tx 100)") ))
t=$(( $(cg t2 "$prep_table
$(tx $n)") - $(cg t1 "$prep_table
$(tx 100)") ))
echo "$i $t" | awk -v n=$((n - 100)) '{ printf "instructions per new-key transaction (whole backend, without printing): idem %.1fk, table %.1fk (%.3fx)\n",
	$1 / n / 1000, $2 / n / 1000, $1 / $2 }'

keys="ARRAY(SELECT 'b' || g FROM generate_series(1, $b) g)"
bi=$(cg bi "BEGIN;
SET LOCAL idem.max_batch = $b;
SELECT count(*) FROM idem_begin_many($keys, array_fill('fp'::text, ARRAY[$b]));
SELECT count(*) FROM idem_complete_many($keys, array_fill('fp'::text, ARRAY[$b]), array_fill(200, ARRAY[$b]), array_fill('\\\\x6f6b'::bytea, ARRAY[$b]));
COMMIT;")
bs=$(cg bs "BEGIN;
INSERT INTO plain_keys (scope, key, fingerprint, token, lease_until, expires_at) SELECT '', 'b' || g, sha256('fp'::bytea), nextval('plain_token_seq'), clock_timestamp() + '60s', clock_timestamp() + '1 day' FROM generate_series(1, $b) g ON CONFLICT DO NOTHING;
UPDATE plain_keys p SET status = 200, body = '\\\\x6f6b', lease_until = NULL, expires_at = clock_timestamp() + '1 day' FROM generate_series(1, $b) g WHERE p.scope = '' AND p.key = 'b' || g AND p.status IS NULL;
COMMIT;")
b0=$(cg b0 "SELECT 1;")
echo "$bi $bs $b0" | awk -v n="$b" '{ printf "instructions per key of row 1c (%d keys): batch functions %.1fk, set-based SQL %.1fk (%.3fx)\n",
	n, ($1 - $3) / n / 1000, ($2 - $3) / n / 1000, ($1 - $3) / ($2 - $3) }'
