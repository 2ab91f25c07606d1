#!/bin/sh
# Build with warnings as errors, install, and run every test suite:
# pg_regress, isolation, TAP, the Go, Python and Node clients' suites,
# the documentation's code blocks, and the monitoring queries and dashboard,
# then the port check (no suite reached a server it did not start).  As root, the suites run as the user
# idemtest, and pg_regress and isolation once more as the user idemcheck
# (no expected output depends on the user's name).
# Ends with "N passed, N failed".
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
# The suites' servers are initialized in the caller's locale, and the
# expected output is that of UTF-8 databases with English messages
# (multibyte keys, an ICU collation).  A shell without a locale (a fresh
# container, env -i) would give SQL_ASCII: run everything under C.UTF-8,
# which every Debian has.  pg_regress unsets LC_ALL and initializes its
# server in LANG (LC_CTYPE and LC_COLLATE would come first), so LANG is
# set too.
LANG=C.UTF-8
LC_ALL=C.UTF-8
export LANG LC_ALL
unset LC_CTYPE LC_COLLATE

pg_config=$(command -v pg_config)
# No include or require cycle between the project's own modules, and
# no exported symbol without the idem_ prefix.
sh test/include_graph.sh || exit 1
make -s clean >/dev/null
make -s IDEM_WERROR=1 || exit 1
sh test/symbols.sh || exit 1

log=$(mktemp /tmp/idem-test-log.XXXXXX)
if [ "$(id -u)" -eq 0 ]; then
	make -s install >/dev/null || exit 1
	sh test/user.sh
	# The suites start their own servers, which must not run as root: run
	# them as idemtest in a copy of the tree it owns.
	work=$(mktemp -d /tmp/idem-test.XXXXXX)
	cp -a "$top"/. "$work"/
	chown -R idemtest "$work"
	{ su idemtest -s /bin/sh -c "cd '$work' && make -s PG_CONFIG='$pg_config' installcheck" 2>&1
	  echo "exit status $?"; } | tee "$log"
	[ -d "$work/test/output" ] && rm -rf "$top/test/output" && cp -a "$work/test/output" "$top/test/output"
	# The TAP tests' server and test logs.
	[ -d "$work/tmp_check/log" ] && mkdir -p "$top/test/output" &&
		cp -a "$work/tmp_check/log" "$top/test/output/tap"
	rm -rf "$work"
	# pg_regress and isolation (not TAP) again as a superuser of another
	# name, in an environment without a locale: no expected output may
	# depend on the name of the user who runs the suites, and make
	# installcheck sets the locale the expected output needs itself.
	sh test/user.sh idemcheck
	work=$(mktemp -d /tmp/idem-test.XXXXXX)
	cp -a "$top"/. "$work"/
	rm -rf "$work/test/output" "$work/tmp_check" "$work/tmp_check_iso"
	chown -R idemcheck "$work"
	echo "== pg_regress and isolation as idemcheck"
	{ su idemcheck -s /bin/sh -c "cd '$work' && env -i PATH=\"\$PATH\" HOME=/tmp make -s PG_CONFIG='$pg_config' installcheck TAP_TESTS=" 2>&1
	  echo "exit status $?"; } | tee -a "$log"
	[ -d "$work/test/output" ] && mkdir -p "$top/test/output" &&
		rm -rf "$top/test/output/idemcheck" &&
		cp -a "$work/test/output" "$top/test/output/idemcheck"
	rm -rf "$work"
else
	sudo make -s install >/dev/null || exit 1
	{ make -s installcheck 2>&1; echo "exit status $?"; } | tee "$log"
fi
# The client libraries' suites (clients/*/test.sh), then the
# documentation's code blocks (test/docs.sh) and the exporter's queries
# and the dashboard (test/monitoring.sh), each against its own throwaway
# cluster, on the host's PostgreSQL only (the version matrix sets
# IDEM_CLIENTS=no).  Each ends with its own "N passed, N failed" line.
#
# The port check: two suites on one machine (two checkouts, two make test
# at once) must not reach each other's servers.  While the suites run, a
# decoy (test/decoy.pl) holds the TCP ports they once took for themselves
# (a Python or Node app, pgbouncer, the exporter), where free, and the
# libpq environment (PGHOST, PGHOSTADDR, PGPORT) names the decoy: a suite
# that still needs a fixed port fails for want of it, and a connection of
# a suite to a server it did not start (on a fixed port, or by a libpq
# variable let through) reaches the decoy, which fails the check.  (Not
# 5432: a PostgreSQL of the machine's may have to start there meanwhile.)
if [ "${IDEM_CLIENTS:-yes}" != no ]; then
	decoy_log=$(mktemp /tmp/idem-decoy.XXXXXX)
	perl test/decoy.pl "$decoy_log" 55443 55444 55445 55453 55473 &
	decoy=$!
	i=0
	until grep -q '^ready$' "$decoy_log" || [ "$i" -ge 100 ]; do
		sleep 0.1
		i=$((i + 1))
	done
	decoy_port=$(sed -n 's/^port //p' "$decoy_log")
	for t in clients/go/test.sh clients/python/test.sh clients/node/test.sh test/docs.sh \
		test/monitoring.sh; do
		echo "== $t" | tee -a "$log.clients"
		{ PGHOST=127.0.0.1 PGHOSTADDR=127.0.0.1 PGPORT=${decoy_port:-1} PGUSER=decoy PGDATABASE=decoy \
			sh "$t" 2>&1; echo "client exit status $?"; } | tee -a "$log.clients"
	done
	kill "$decoy" 2>/dev/null
	wait "$decoy" 2>/dev/null
	{
		echo "== port-check"
		if [ -n "$decoy_port" ] && ! grep -q '^connection ' "$decoy_log"; then
			busy=$(sed -n 's/^busy //p' "$decoy_log" | tr '\n' ' ')
			echo "ok - the client suites needed none of the decoy's ports and connected to none${busy:+ (taken already: ${busy% })}"
			echo "1 passed, 0 failed"
			echo "client exit status 0"
		else
			[ -n "$decoy_port" ] || echo "port check: the decoy did not start"
			awk '/^connection / { n[$4]++ }
				END { for (p in n) print "port check: " n[p] " connections of a suite to the decoy on port " p }' \
				"$decoy_log"
			echo "0 passed, 1 failed"
			echo "client exit status 1"
		fi
	} | tee -a "$log.clients"
	rm -f "$decoy_log"
fi

# Count test cases: pg_regress and isolation lines (the "test x ... ok" of
# PostgreSQL 15, the "ok 1 - x" of 16 and later), TAP assertions.
regress=$(grep -Ec '^(test|     ) .*\.\.\. ok|^ok [0-9]+ +[-+] ' "$log")
tap=$(sed -n 's/^Files=[0-9]*, Tests=\([0-9]*\),.*/\1/p' "$log" | awk '{n += $1} END {print n + 0}')
passed=$((regress + tap))
fail_re='\.\.\. FAILED|^not ok |Dubious|^Result: FAIL|failed \(ignored\)'
failed=$(grep -Ec "$fail_re" "$log")
# Every make installcheck exited 0 (a failure it did not count still fails).
{ grep -q "^exit status 0$" "$log" && ! grep -q "^exit status [1-9]" "$log"; } ||
	[ "$failed" -gt 0 ] || failed=1
# What failed, last, where a log's tail shows it: the failing cases and
# tests of every suite and each client suite's count.
failures=$(grep -hE "$fail_re"'|^--- FAIL|^(FAILED|ERROR) |^exit status [1-9]|did not (answer|start)|^test\.sh: |^go client: |^port check: |is in use: |^[0-9]+ passed, [1-9][0-9]* failed$' \
	"$log" "$log.clients" 2>/dev/null | head -n 40)
[ -f "$log.clients" ] && echo "== suites" &&
	awk '/^== / { name = $2 } /^[0-9]+ passed, [0-9]+ failed$/ { last = $0 }
		/^client exit status / { print name ": " last " (exit " $4 ")"; last = "" }' "$log.clients"
[ -n "$failures" ] && printf '== failures\n%s\n' "$failures"
if [ -f "$log.clients" ]; then
	# Each suite's last count line is its total (a suite may print the
	# counts of its parts, such as the HTTP conformance runs, before it).
	counts=$(awk '/^[0-9]+ passed, [0-9]+ failed$/ { last = $1 " " $3 }
		/^client exit status / { if (last != "") { split(last, c, " "); p += c[1]; f += c[2] } last = "" }
		END { print p + 0, f + 0 }' "$log.clients")
	cp=${counts% *}
	cf=${counts#* }
	passed=$((passed + cp))
	failed=$((failed + cf))
	# A suite that failed without counting its failures still fails.
	bad=$(grep -c '^client exit status [1-9]' "$log.clients" || true)
	[ "$bad" -gt 0 ] && [ "$cf" -eq 0 ] && failed=$((failed + bad))
	rm -f "$log.clients"
fi
rm -f "$log"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
