#!/bin/sh
# Run the documentation's code blocks against a throwaway cluster.
#
#   sh test/docs.sh [FILE...]     # default: README.md doc/*.md clients/*/README.md guard/README.md
#
# Every fenced block of SQL, Python, JavaScript, Go, shell or C must say
# after its language whether it runs: "```sql run" or "```sh norun: why"
# (doc/testing.md, "Documentation that runs"; test/docs/blocks.pl).  The
# first test checks that; then each "run" block runs, in the order of the
# files:
#
# - sql: psql -v ON_ERROR_STOP=1, as the superuser postgres, or as ROLE
#   with "as=ROLE";
# - python: /usr/bin/python3 with clients/python/src on PYTHONPATH, after
#   the names of test/docs/prelude.py;
# - js: node, with idem-pg and the Node client's modules resolvable, after
#   the names of test/docs/prelude.cjs; an ES module if it has an import
#   statement; with "serve=PATH" the server it starts gets two requests
#   (test/docs/serve.cjs);
# - go: the block inside test/docs/main.go.in, built in GOPATH mode with
#   Debian's pgx v4, as clients/go/test.sh does;
# - sh: sh -e from the repository's root, TMPDIR a folder of the runner's;
#   with "fresh", as root on a fresh Debian 12 machine instead
#   (test/fresh.sh; skipped unless root).
#
# A "```text output" block right after a run block is what it prints: its
# lines must come in the block's output, in order.
#
# Each file's blocks share one database, app, made afresh for the file:
# the roles app and ops exist, test/docs/setup.sql has run, and, unless
# the file creates the extension itself, so has the top-level README's
# Install block (the extension in idem_api, granted to app).  A block
# passes if it exits 0 within 120 s (a Go build and run, 300 s) and the server logged no ERROR or
# FATAL while it ran.  After a file's Python, JavaScript or Go blocks,
# the keys they used must be stored, none left in flight.  The README's
# Install block also runs with "\set schema public", followed by a call
# as app.
#
# The cluster listens on port 55462 (IDEM_DOCS_PORT) of a Unix socket in
# the suite's own directory, on no TCP port, without the purge worker; a
# "serve=" block's server on a free port (test/docs/serve.cjs).  The extension must be installed (make install).  Prints
# "ok N - FILE:LINE" or "not ok N - FILE:LINE" per test (the output of a
# failure after it, as "# " lines; with IDEM_DOCS_VERBOSE=1 that of every
# block), then "N passed, N failed"; exits
# non-zero on any failure.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top" || exit 2
port=${IDEM_DOCS_PORT:-55462}
# No libpq variable of the caller's reaches a connection (test/ports.sh).
. "$top/test/ports.sh"
py=/usr/bin/python3
docs=$top/test/docs
work=$(mktemp -d /tmp/idem-docs.XXXXXX) || exit 2
chmod 755 "$work"
dir=$work/pg
n=0
passed=0
failed=0

# shellcheck disable=SC2317 # called by the traps
cleanup() {
	trap - EXIT INT TERM
	[ -d "$dir/data" ] && sh "$top/test/cluster.sh" stop "$dir" >/dev/null 2>&1
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# report OK|FAIL NAME [LOG]
report() {
	n=$((n + 1))
	if [ "$1" = OK ]; then
		passed=$((passed + 1))
		echo "ok $n - $2"
		[ "${IDEM_DOCS_VERBOSE:-}" = 1 ] && [ -n "${3:-}" ] && [ -s "$3" ] && sed 's/^/# /' "$3"
	else
		failed=$((failed + 1))
		echo "not ok $n - $2"
		[ -n "${3:-}" ] && [ -s "$3" ] && tail -n 40 "$3" | sed 's/^/# /'
	fi
}

finish() {
	echo "$passed passed, $failed failed"
	[ "$failed" -eq 0 ]
	exit
}

if [ $# -gt 0 ]; then
	files="$*"
else
	files="README.md $(ls doc/*.md) $(ls clients/*/README.md) guard/README.md"
fi

# 1. Every block of a language that runs says whether it runs.
# shellcheck disable=SC2086 # $files is a list of words
if perl "$docs/blocks.pl" check $files >"$work/check.log" 2>&1; then
	report OK "every sql, python, js, go, sh and c block is marked run or norun"
else
	report FAIL "every sql, python, js, go, sh and c block is marked run or norun" "$work/check.log"
fi
mkdir -p "$work/blocks"
# shellcheck disable=SC2086
if ! perl "$docs/blocks.pl" extract "$work/blocks" $files >"$work/extract.log" 2>&1; then
	report FAIL "extract the blocks" "$work/extract.log"
	finish
fi
# The README's Install block installs the extension for the other files.
install=$(awk -F '\t' '$2 == "README.md" && $4 == "sql" { print $1 }' "$work/blocks/index" |
	while read -r k; do
		grep -q 'CREATE EXTENSION idem' "$work/blocks/$k.sql" && { echo "$work/blocks/$k.sql"; break; }
	done)
if [ ! -f README.md ] || [ -z "$install" ]; then
	# Files named on the command line: take it from the README all the same.
	perl "$docs/blocks.pl" extract "$work" README.md >/dev/null 2>&1
	for f in "$work"/[0-9]*.sql; do
		grep -q 'CREATE EXTENSION idem' "$f" 2>/dev/null && { install=$f; break; }
	done
fi
[ -n "$install" ] || { report FAIL "README.md has a run block with CREATE EXTENSION idem"; finish; }

# The README is a landing page: under 250 lines, with a link to every
# document and client README, where the reference and the details live.
landing() {
	lines=$(wc -l <README.md)
	echo "README.md: $lines lines"
	[ "$lines" -lt 250 ] || { echo "README.md has $lines lines; the details belong in doc/"; return 1; }
	for f in doc/*.md guard/README.md clients/*/README.md; do
		grep -q "]($f)" README.md || { echo "README.md does not link $f"; return 1; }
	done
}
case " $files " in *" README.md "*)
	if landing >"$work/landing.log" 2>&1; then
		report OK "README.md is a landing page: under 250 lines, linking every doc/*.md and client README"
	else
		report FAIL "README.md is a landing page: under 250 lines, linking every doc/*.md and client README" "$work/landing.log"
	fi
	;;
esac

# 2. The languages' tools.
command -v pg_config >/dev/null 2>&1 || { report FAIL "pg_config on PATH"; finish; }
bindir=$(pg_config --bindir)
need=$(cut -f4 "$work/blocks/index" | sort -u | tr '\n' ' ')
case " $need " in *" js "*)
	if [ ! -d clients/node/node_modules/pg ] || [ ! -d clients/node/node_modules/express ]; then
		(cd clients/node && npm ci --prefer-offline --no-audit --no-fund --loglevel=error) \
			>"$work/npm.log" 2>&1 || report FAIL "npm ci in clients/node" "$work/npm.log"
	fi
	# A folder whose node_modules resolves idem-pg and the client's modules,
	# for CommonJS and ES modules alike.
	mkdir -p "$work/js/node_modules"
	ln -s "$top/clients/node" "$work/js/node_modules/idem-pg"
	for m in "$top"/clients/node/node_modules/* "$top"/clients/node/node_modules/.bin; do
		[ -e "$m" ] && ln -s "$m" "$work/js/node_modules/"
	done
	cp "$docs/prelude.cjs" "$docs/serve.cjs" "$work/js/"
	;;
esac
case " $need " in *" go "*)
	mkdir -p "$work/gopath/src/idem/clients"
	ln -s "$top/clients/go" "$work/gopath/src/idem/clients/go"
	[ -n "${GOCACHE:-}" ] || [ -n "${HOME:-}" ] || export GOCACHE="$work/gocache"
	;;
esac

# 3. The cluster, its roles, and a database per file.
if ! sh "$top/test/cluster.sh" start "$dir" "$port" 'idem.purge_enabled = off' >"$work/cluster.log" 2>&1; then
	cat "$dir/initdb.log" "$dir/server.log" >>"$work/cluster.log" 2>/dev/null
	report FAIL "start the cluster" "$work/cluster.log"
	finish
fi
export PGHOST="$dir" PGPORT="$port"
psql_as() {
	role=$1
	shift
	"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -U "$role" "$@"
}
psql_as postgres -d postgres -c 'CREATE ROLE app LOGIN; CREATE ROLE ops LOGIN' >"$work/roles.log" 2>&1 ||
	{ report FAIL "create the roles app and ops" "$work/roles.log"; finish; }

# fresh_db [INSTALL_FILE]: the database app, made afresh, with setup.sql.
fresh_db() {
	psql_as postgres -d postgres -c 'DROP DATABASE IF EXISTS app WITH (FORCE)' -c 'CREATE DATABASE app' &&
		psql_as postgres -d app -f "$docs/setup.sql" &&
		{ [ -z "${1:-}" ] || psql_as postgres -d app -f "$1"; }
}

# run_block K FILE LINE LANG OPTS LOG: runs block K, each program with a
# deadline (timeout exits 124), reading /dev/null (fd 3), not the index.
run_block() {
	k=$1 file=$2 line=$3 lang=$4 opts=$5 log=$6
	as=postgres
	serve=
	for o in $opts; do
		case "$o" in
		as=*) as=${o#as=} ;;
		serve=*) serve=${o#serve=} ;;
		esac
	done
	src=$work/blocks/$k.$lang
	case "$lang" in
	sql)
		timeout 120 "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -U "$as" -d app -f "$src"
		;;
	python)
		PYTHONPATH="$top/clients/python/src" PYTHONDONTWRITEBYTECODE=1 \
			timeout 120 "$py" "$docs/prelude.py" "$src" "$file" "$line"
		;;
	js)
		if grep -Eq '^import ' "$src"; then ext=mjs; else ext=cjs; fi
		cp "$src" "$work/js/$k.$ext"
		if [ -n "$serve" ]; then pre="--require ./serve.cjs"; else pre=; fi
		# shellcheck disable=SC2086 # $pre is empty or two words
		(cd "$work/js" && PGUSER=app PGDATABASE=app IDEM_DOCS_SERVE="$serve" \
			timeout 120 node --require ./prelude.cjs $pre "./$k.$ext")
		;;
	go)
		mkdir -p "$work/gopath/src/docs/b$k" &&
			perl "$docs/blocks.pl" go "$docs/main.go.in" "$src" "$file" "$line" \
				>"$work/gopath/src/docs/b$k/main.go" &&
			(cd "$work/gopath/src/docs/b$k" &&
				GO111MODULE=off GOPATH="$work/gopath:/usr/share/gocode" GOFLAGS='' GOPROXY=off \
					timeout 300 go run .)
		;;
	sh)
		case " $opts " in
		*" fresh "*) bash "$top/test/fresh.sh" "$src" ;;
		*)
			# Their mktemp folders go with the runner's.
			mkdir -p "$work/tmp" && TMPDIR="$work/tmp" timeout 120 sh -e "$src"
			;;
		esac
		;;
	*)
		echo "no way to run a $lang block"
		false
		;;
	esac <&3 >"$log" 2>&1
}

# run_one K FILE LINE LANG OPTS NAME: runs block K and reports it,
# failing it also for an ERROR or FATAL in the server log.
run_one() {
	log=$work/$1.log
	case " $5 " in *" fresh "*)
		if [ "$(id -u)" -ne 0 ]; then
			n=$((n + 1))
			passed=$((passed + 1))
			echo "ok $n - $6 # skip: a fresh Debian 12 chroot needs root (make test as root runs it)"
			return
		fi
		;;
	esac
	before=$(wc -c <"$dir/server.log")
	run_block "$1" "$2" "$3" "$4" "$5" "$log"
	rc=$?
	[ "$rc" -eq 124 ] && echo "killed after its deadline" >>"$log"
	if [ "$rc" -eq 0 ] && [ -f "$work/blocks/$1.expected" ]; then
		perl "$docs/blocks.pl" expect "$work/blocks/$1.expected" "$log" >"$work/$1.expect" ||
			{ cat "$work/$1.expect" >>"$log"; rc=1; }
	fi
	tail -c +"$((before + 1))" "$dir/server.log" | grep -E 'ERROR:|FATAL:' >"$work/$1.server" &&
		{ echo "server log:"; cat "$work/$1.server"; } >>"$log" && rc=1
	if [ "$rc" -eq 0 ]; then report OK "$6" "$log"; else report FAIL "$6" "$log"; fi
}

# file_done: after the blocks of a file with client code (Python,
# JavaScript, Go), the keys they used are stored: a client that could not
# reach the server answers unavailable without an error in the server's log.
file_done() {
	[ -n "$clients" ] || return 0
	"$bindir/psql" -X -A -t -U postgres -d app -c "SELECT count(*) FILTER (WHERE state = 'DONE') || ' done, '
		|| count(*) FILTER (WHERE state <> 'DONE') || ' in flight' FROM idem_api.idem_keys" \
		>"$work/keys.log" 2>&1
	if grep -Eq '^[1-9][0-9]* done, 0 in flight$' "$work/keys.log"; then
		report OK "$current: the keys of its examples are stored ($(cat "$work/keys.log"))"
	else
		report FAIL "$current: the keys of its examples are stored, none left in flight" "$work/keys.log"
	fi
}

# 4. The blocks, a database per file.  The files that create the extension
# themselves:
installers=$(awk -F '\t' '$4 == "sql" { print $1 "\t" $2 }' "$work/blocks/index" |
	while IFS="$(printf '\t')" read -r k file; do
		grep -q 'CREATE EXTENSION idem' "$work/blocks/$k.sql" && echo "$file"
	done)
current=
clients=
while IFS="$(printf '\t')" read -r k file line lang opts; do
	if [ "$file" != "$current" ]; then
		[ -n "$current" ] && file_done
		current=$file
		clients=
		if printf '%s\n' "$installers" | grep -qxF "$file"; then
			inst=
		else
			inst=$install
		fi
		fresh_db "$inst" >"$work/db.log" 2>&1 || report FAIL "$file: the database app" "$work/db.log"
	fi
	run_one "$k" "$file" "$line" "$lang" "$opts" "$file:$line"
	case "$lang" in python | js | go) clients=1 ;; esac
	if [ "$work/blocks/$k.sql" = "$install" ]; then
		# The Install block's other layout: the extension in public.
		sed 's/^\\set schema idem_api$/\\set schema public/' "$install" >"$work/public.sql"
		if { grep -q '^\\set schema public$' "$work/public.sql" &&
			fresh_db "" && psql_as postgres -d app -f "$work/public.sql" &&
			psql_as app -d app -c "SELECT claimed FROM public.idem_begin('docs-public', 'fp')"
		} >"$work/public.log" 2>&1; then
			report OK "$file:$line with \\set schema public, then a call as app"
		else
			report FAIL "$file:$line with \\set schema public, then a call as app" "$work/public.log"
		fi
		# Back to the layout the file's next blocks expect.
		fresh_db "$install" >"$work/db.log" 2>&1 || report FAIL "$file: the database app" "$work/db.log"
	fi
done 3</dev/null <"$work/blocks/index"
[ -n "$current" ] && file_done

finish
