#!/bin/bash
# Build the Debian packages of idem and test them in a clean Debian 12
# (bookworm) chroot (make deb).
#
#   test/deb.sh               build from the committed tree (git archive HEAD),
#                             or from the tree as it is when it is not a git
#                             checkout (a release tarball, a PGXN zip)
#   test/deb.sh --worktree    build from the working tree as it is now
#   test/deb.sh --prepare     only build (or check) the cached chroot
#   test/deb.sh --build-only  only build the packages (steps 1 and 2; make deb-build)
#
# 1. META.json is checked against the PGXN meta spec (test/pgxn_meta.pl),
#    and its version against debian/changelog and idem.control.
# 2. A clean copy of the tree is built on the host (Debian 12) with
#    `dpkg-buildpackage -us -uc -b` (debian/: pg_buildext, one
#    postgresql-NN-idem per version in debian/pgversions, libidem-guard-dev,
#    and python3-idem-pg with pybuild), with Debian's own tools first on
#    PATH.  The build dependencies (and lintian) are installed if missing;
#    lintian --pedantic finds no tag but the one every extension gets.
#    The .debs and the logs go to test/output/deb/ ($IDEM_DEB_OUT).
# 3. A bookworm chroot is built with debootstrap (variant minbase) from the
#    host's configured Debian mirror, with the host's Debian apt sources,
#    and cached in $IDEM_DEB_CACHE (default /var/cache/idem-deb) for the
#    next run.  Each run works in a throwaway overlay on top of it (a copy if
#    overlayfs is not available), so the cached chroot stays clean.
# 4. In that chroot: `apt-get install -y ./*.deb`; a server started as the
#    unprivileged user idemtest with shared_preload_libraries = 'idem' runs
#    CREATE EXTENSION idem, a claim, a complete and a replay; a program
#    built against libidem-guard-dev (pkg-config idem-guard) runs the
#    guard against it; Debian's python3 imports idem_pg from
#    python3-idem-pg (with its py.typed) and runs its Guard against it; the
#    installed README's Install block, run as written in a database of its
#    own, gives the role app a secure setup (schema idem_api) that the
#    Python Guard uses; the links of the installed README and doc/*.md lead
#    to installed files;
#    then `make installcheck` of the source tree, as
#    idemtest, with the chroot's pg_config (pg_regress and isolation suites,
#    each on its own temporary server; IDEM_DEB_TAP=1 adds the TAP suites).
#
# Mounts and processes started by a run are undone and stopped on exit, also
# on failure or interruption.  Ends with one line "deb: N passed, N failed"
# and exits non-zero if anything failed.  Needs root (debootstrap, chroot,
# mount).
set -u

top=$(cd "$(dirname "$0")/.." && pwd)
cache=${IDEM_DEB_CACHE:-/var/cache/idem-deb}
out=${IDEM_DEB_OUT:-$top/test/output/deb}
suite=bookworm
pgv=15
source_mode=head
prepare_only=0
build_only=0
case "${1:-}" in
--worktree) source_mode=worktree ;;
--prepare) prepare_only=1 ;;
--build-only) build_only=1 ;;
"") ;;
*)
	echo "usage: test/deb.sh [--worktree | --prepare | --build-only]" >&2
	exit 2
	;;
esac

if [ "$(id -u)" -ne 0 ]; then
	echo "test/deb.sh needs root (debootstrap, chroot, mount)" >&2
	exit 2
fi

# Shared chroot helpers: mirror, run_child, mount_chroot, unmount_below,
# mounted_below, and chroot_cleanup with the state it undoes.
. "$(dirname "$0")/chroot.sh"

# Temporary directories, removed by cleanup.
build_dir=""
run_dir=""

cleanup() {
	chroot_cleanup
	if [ -n "$build_dir" ]; then
		save_outputs
		rm -rf "$build_dir"
	fi
	if [ -n "$run_dir" ]; then
		if mounted_below "$run_dir"; then
			echo "$run_dir still has mounts below it; not deleting it" >&2
		else
			rm -rf "$run_dir"
		fi
	fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A command in the chroot $root, as root, with a clean environment.
in_chroot() {
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive sh -ec "$1"
}

# A command in the chroot $root as the unprivileged user idemtest.
as_idemtest() {
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		LANG=C.UTF-8 runuser -u idemtest -- /usr/bin/env HOME=/home/idemtest \
		PATH=/usr/lib/postgresql/$pgv/bin:/usr/bin:/bin sh -ec "$1"
}

mkdir -p "$cache"
exec 9>"$cache/lock"
if ! flock -n 9; then
	echo "waiting for another test/deb.sh (lock $cache/lock)"
	flock 9
fi

if [ "$prepare_only" -eq 1 ]; then
	start=$SECONDS
	prepare_chroot "$cache/$suite" "$suite" || exit 1
	echo "chroot preparation took $((SECONDS - start))s"
	exit 0
fi

# Packages and logs are made in $work (under /tmp) and copied to $out on
# exit, so a concurrent make clean or make test that empties test/output
# does not break a run.
build_dir=$(mktemp -d /tmp/idem-deb-build.XXXXXX)
work=$build_dir/out
mkdir -p "$work"
save_outputs() {
	mkdir -p "$out" || return
	rm -rf "$out"/*.deb "$out"/*.changes "$out"/*.buildinfo "$out"/*.log "$out/installcheck"
	cp -a "$work"/. "$out"/
}
log=$work/test.log
: >"$log"
passed=0
failed=0
t_build=0
t_chroot=0
t_test=0

result() {
	echo "deb timings: build ${t_build}s, chroot ${t_chroot}s, test ${t_test}s; logs in $out"
	echo "deb: $passed passed, $failed failed"
	[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
	exit
}

# Run check $1 (the rest is the command); its output goes to the log.
check() {
	local name=$1
	shift
	echo "== $name" >>"$log"
	if "$@" >>"$log" 2>&1; then
		passed=$((passed + 1))
		echo "ok: $name"
		return 0
	fi
	failed=$((failed + 1))
	echo "FAILED: $name (see $out/test.log)"
	tail -n 30 "$log" | sed 's/^/    /'
	return 1
}

# The build's tools (dpkg-parsechangelog, which step 1 needs too) and
# dependencies, installed first if missing.
build_deps="dpkg-dev build-essential debhelper postgresql-server-dev-all libpq-dev dh-python
	pybuild-plugin-pyproject python3-all python3-setuptools lintian"
install_build_deps() {
	local p missing=""
	for p in $build_deps; do
		dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed ||
			missing="$missing $p"
	done
	[ -n "$missing" ] || return 0
	echo "installing$missing"
	apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		# shellcheck disable=SC2086
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
			--no-install-recommends $missing >/dev/null
}

check "build tools and dependencies on the host" install_build_deps || result

# 1. META.json.
meta_versions() {
	local meta changelog control
	meta=$(perl -MJSON::PP -0777 -ne 'print decode_json($_)->{version}' "$top/META.json") &&
		changelog=$(dpkg-parsechangelog -l "$top/debian/changelog" -S Version) &&
		control=$(sed -n "s/^default_version = '\(.*\)'/\1/p" "$top/idem.control") || return 1
	echo "META.json $meta, debian/changelog $changelog, idem.control $control"
	[ "$meta" = "$changelog" ] && [ "${meta%.0}" = "$control" ]
}
check "META.json against the PGXN meta spec" perl "$top/test/pgxn_meta.pl" "$top/META.json"
check "versions agree" meta_versions

build() {
	local version src
	version=$(dpkg-parsechangelog -l "$top/debian/changelog" -S Version) || return 1
	src=$build_dir/idem-$version
	copy_tree "$top" "$source_mode" "$src" || return 1
	# Debian's python3 and tools, not whatever else is first on PATH.
	(cd "$src" && env PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg-buildpackage -us -uc -b) \
		>"$work/build.log" 2>&1 || {
		tail -n 40 "$work/build.log"
		return 1
	}
	cp "$build_dir"/*.deb "$build_dir"/*.changes "$build_dir"/*.buildinfo "$work"/ &&
		ls "$work"/*.deb
}

# 2. Build.
start=$SECONDS
check "dpkg-buildpackage -us -uc -b (log: $out/build.log)" build
rc=$?
t_build=$((SECONDS - start))
[ "$rc" -eq 0 ] || result
# lintian: no tag but the one every extension's package
# gets (the repeated lib of /usr/lib/postgresql/NN/lib/).
lint() {
	local tags
	tags=$(cd "$work" && lintian --pedantic -I ./*.changes 2>&1 |
		grep -v 'running with root privileges' |
		grep -v 'repeated-path-segment lib \[usr/lib/postgresql/[0-9]*/lib/\]')
	[ -z "$tags" ] && echo "lintian: no tags" && return 0
	echo "$tags"
	return 1
}
check "lintian --pedantic" lint
# The test needs the extension's package, not its debug symbols.
debs=()
for f in "$work"/*.deb; do
	case "$f" in *-dbgsym_*) ;; *) debs+=("$(basename "$f")") ;; esac
done

echo "packages: $out/ (install as root with: apt-get install $out/postgresql-$pgv-idem_*.deb; libidem-guard-dev_*.deb and python3-idem-pg_*.deb beside it, as needed)"
[ "$build_only" -eq 0 ] || result

# 3. The chroot, and this run's overlay on top of it.
start=$SECONDS
check "the cached $suite chroot" prepare_chroot "$cache/$suite" "$suite" || result
t_chroot=$((SECONDS - start))

start=$SECONDS
run_dir=$(mktemp -d "$cache/run.XXXXXX")
root=$run_dir/root
overlay() {
	overlay_chroot "$cache" "$suite" "$run_dir" || return 1
	mkdir -p "$root/build/debs"
	cp "${debs[@]/#/$work/}" "$root/build/debs/"
	copy_tree "$top" "$source_mode" "$root/build/idem"
}
check "a throwaway overlay on the chroot" overlay || result

# 4. Install and test.
check "apt-get install -y ./*.deb (${debs[*]})" in_chroot "
	chown _apt /var/cache/apt/archives/partial
	apt-get -o DPkg::Lock::Timeout=600 update -qq
	cd /build/debs && apt-get -o DPkg::Lock::Timeout=600 install -y ./*.deb
	dpkg -l postgresql-$pgv-idem libidem-guard-dev python3-idem-pg postgresql-$pgv | grep '^ii'" ||
	result

# The extension's version and its install and update scripts, as in the
# tree that was built.
ext_version=$(sed -n "s/^default_version = '\(.*\)'/\1/p" "$root/build/idem/idem.control")
scripts=()
for f in "$root"/build/idem/sql/idem--*.sql; do
	scripts+=("postgresql-$pgv-idem:/usr/share/postgresql/$pgv/extension/$(basename "$f")")
done
docs=()
for f in "$root"/build/idem/doc/*.md; do
	docs+=("postgresql-$pgv-idem:/usr/share/doc/postgresql-$pgv-idem/$(basename "$f")")
done
installed_files() {
	local f
	for f in "postgresql-$pgv-idem:/usr/lib/postgresql/$pgv/lib/idem.so" \
		"postgresql-$pgv-idem:/usr/share/postgresql/$pgv/extension/idem.control" \
		"${scripts[@]}" \
		"libidem-guard-dev:/usr/include/postgresql/idem_guard.h" \
		"libidem-guard-dev:/usr/lib/x86_64-linux-gnu/libidem_guard.a" \
		"libidem-guard-dev:/usr/lib/x86_64-linux-gnu/pkgconfig/idem-guard.pc" \
		"python3-idem-pg:/usr/lib/python3/dist-packages/idem_pg/__init__.py" \
		"python3-idem-pg:/usr/lib/python3/dist-packages/idem_pg/py.typed" \
		"postgresql-$pgv-idem:/usr/share/doc/postgresql-$pgv-idem/README.md" \
		"${docs[@]}"; do
		in_chroot "dpkg -S '${f#*:}' | grep -q '^${f%%:*}: '" || {
			echo "${f#*:} is not in ${f%%:*}"
			return 1
		}
		echo "${f#*:} ($(in_chroot "dpkg -S '${f#*:}'" | cut -d: -f1))"
	done
}
check "files in their packages" installed_files || result

# Tools for the tests only: make for installcheck, a compiler and
# pkg-config for the guard program.
check "make, gcc and pkg-config for the tests" in_chroot \
	"apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends make gcc libc6-dev pkg-config >/dev/null" ||
	result

sock=/tmp/idem-deb-sock
check "a server as idemtest with shared_preload_libraries = 'idem'" in_chroot "
	useradd --create-home --shell /bin/sh idemtest
	chown -R idemtest /build/idem
	runuser -u idemtest -- sh -ec '
		mkdir -p $sock
		/usr/lib/postgresql/$pgv/bin/initdb -D /tmp/idem-deb-pg -A trust >/dev/null
		/usr/lib/postgresql/$pgv/bin/pg_ctl -D /tmp/idem-deb-pg -l /tmp/idem-deb-pg.log -w \
			-o \"-c listen_addresses= -k $sock -c shared_preload_libraries=idem\" start
	'" || result

sql_check() {
	local got expected
	expected="$ext_version
t|PROCESSING
t
f|DONE|201|done
1"
	got=$(as_idemtest "psql -h $sock -d postgres -X -q -At -v ON_ERROR_STOP=1 <<'SQL'
CREATE EXTENSION idem;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
BEGIN;
SELECT claimed, state FROM idem_begin('deb-1', 'sku=A');
SELECT idem_complete('deb-1', 'sku=A', 201, 'done') > now();
COMMIT;
SELECT claimed, state, status, convert_from(body, 'UTF8') FROM idem_begin('deb-1', 'sku=A');
SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idem launcher';
SQL") || { echo "$got"; return 1; }
	echo "$got"
	[ "$got" = "$expected" ] || { printf 'expected:\n%s\n' "$expected"; return 1; }
}
check "CREATE EXTENSION idem, claim, complete, replay, launcher running" sql_check || result

guard_check() {
	local got
	cat >"$root/build/guard_check.c" <<'EOF'
/* Claim, run and complete one key through the installed guard, then replay. */
#include <stdio.h>
#include <idem_guard.h>

static int
charge(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	(*(int *) arg)++;
	return idem_response_set(resp, 200, "paid", 4);
}

int
main(int argc, char **argv)
{
	PGconn	   *conn = PQconnectdb(argc > 1 ? argv[1] : "");
	IdemResult	r1, r2;
	int			calls = 0;

	if (PQstatus(conn) != CONNECTION_OK)
	{
		fprintf(stderr, "%s", PQerrorMessage(conn));
		return 1;
	}
	idem_guard_do(conn, "deb-guard", "card=1", charge, &calls, &r1);
	idem_guard_do(conn, "deb-guard", "card=1", charge, &calls, &r2);
	printf("%s %s calls=%d status=%d body=%.*s\n", idem_outcome_name(r1.outcome),
		   idem_outcome_name(r2.outcome), calls, r2.resp.status,
		   (int) r2.resp.body_len, (const char *) r2.resp.body);
	idem_result_clear(&r1);
	idem_result_clear(&r2);
	PQfinish(conn);
	return 0;
}
EOF
	got=$(as_idemtest "
		cc -Wall -o /tmp/guard_check /build/guard_check.c \$(pkg-config --cflags --libs idem-guard)
		/tmp/guard_check 'host=$sock dbname=postgres'") || { echo "$got"; return 1; }
	echo "$got"
	[ "$got" = "EXECUTED REPLAYED calls=1 status=200 body=paid" ]
}
check "a program built with \$(pkg-config --cflags --libs idem-guard): executed, then replayed" guard_check

python_check() {
	local got
	cat >"$root/build/python_check.py" <<'EOF'
"""Claim, run and complete one key through the installed idem_pg, then replay."""
import os
import sys

import idem_pg
from idem_pg import Guard, Response

calls = []

def charge(claim):
    calls.append(claim.key)
    return Response(201, b"made")

guard = Guard(sys.argv[1])
r1 = guard.do("deb-python", "card=1", charge)
r2 = guard.do("deb-python", "card=1", charge)
here = os.path.dirname(idem_pg.__file__)
print(here, os.path.exists(os.path.join(here, "py.typed")), r1.outcome.value,
      r2.outcome.value, "calls=%d" % len(calls), r2.response.status, r2.response.body.decode())
EOF
	got=$(as_idemtest "cd /tmp && python3 /build/python_check.py 'host=$sock dbname=postgres'") ||
		{ echo "$got"; return 1; }
	echo "$got"
	[ "$got" = "/usr/lib/python3/dist-packages/idem_pg True EXECUTED REPLAYED calls=1 201 made" ]
}
check "python3 imports idem_pg from python3-idem-pg: its Guard executed, then replayed" python_check

# The secure setup as a newcomer makes it: the Install block of the
# installed README, run as written by psql in a database of its own, then
# the Python client as the application role, on the schema idem_api.
secure_check() {
	local got readme=/usr/share/doc/postgresql-$pgv-idem/README.md
	awk '/^```sql run$/ && !done { f = 1; next } f && /^```$/ { f = 0; done = 1 } f' \
		"$root$readme" >"$root/build/install_block.sql"
	grep -q 'CREATE EXTENSION idem SCHEMA' "$root/build/install_block.sql" ||
		{ echo "no Install block in $readme"; return 1; }
	cat >"$root/build/secure_check.py" <<'EOF'
"""The application role claims, runs and completes through idem_api."""
import sys

from idem_pg import Guard, Response

calls = []

def order(claim):
    calls.append(claim.key)
    return Response(201, b"ordered")

guard = Guard(sys.argv[1], schema="idem_api")
r1 = guard.do("deb-secure", "sku=A", order)
r2 = guard.do("deb-secure", "sku=A", order)
print(r1.outcome.value, r2.outcome.value, "calls=%d" % len(calls), r2.response.body.decode())
EOF
	cat >"$root/build/secure_grant.sql" <<'EOF'
SELECT has_function_privilege('app', 'idem_api.idem_begin(text, text, interval, interval, text, boolean, interval, interval, text)', 'EXECUTE');
EOF
	got=$(as_idemtest "
		psql -h $sock -d postgres -X -q -v ON_ERROR_STOP=1 -c 'CREATE ROLE app LOGIN' -c 'CREATE DATABASE app'
		psql -h $sock -d app -X -q -v ON_ERROR_STOP=1 -f /build/install_block.sql
		psql -h $sock -d app -X -q -At -f /build/secure_grant.sql
		cd /tmp && python3 /build/secure_check.py 'host=$sock dbname=app user=app'") ||
		{ echo "$got"; return 1; }
	echo "$got"
	[ "$got" = "t
EXECUTED REPLAYED calls=1 ordered" ]
}
check "the README's Install block as written, then python3-idem-pg as the role app on idem_api" secure_check

# Every relative link of the installed README and doc/*.md leads to a file
# of the installed packages: none to the Go and Node clients' READMEs,
# which no package ships (debian/rules makes them plain text).
doc_links() {
	local d=$root/usr/share/doc/postgresql-$pgv-idem f target bad=0 n=0
	for f in "$d"/*.md; do
		for target in $(grep -oE '\]\([^)#]+' "$f" | sed 's/^](//' |
			grep -vE '^[a-z]+:'); do
			n=$((n + 1))
			[ -e "$d/$target" ] || { echo "$(basename "$f"): $target is not installed"; bad=1; }
		done
	done
	echo "$n links checked"
	[ "$bad" -eq 0 ] && [ "$n" -gt 0 ]
}
check "the installed README's and doc/*.md's links lead to installed files" doc_links

check "server stopped" as_idemtest \
	"pg_ctl -D /tmp/idem-deb-pg -m fast -w stop && rm -rf /tmp/idem-deb-pg"

# make installcheck of the source tree against the installed files.
tap="TAP_TESTS="
if [ "${IDEM_DEB_TAP:-0}" = 1 ]; then
	tap=""
	check "IPC::Run and pgbouncer for the TAP suites" in_chroot \
		"apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
			libipc-run-perl pgbouncer libpq-dev >/dev/null" ||
		result
	check "the guard's test programs for the TAP suites" as_idemtest \
		"cd /build/idem && make -s guard-all PG_CONFIG=/usr/lib/postgresql/$pgv/bin/pg_config" ||
		result
fi
installcheck() {
	local ic=$work/installcheck.log rc cases bad
	as_idemtest "cd /build/idem &&
		make installcheck PG_CONFIG=/usr/lib/postgresql/$pgv/bin/pg_config $tap" >"$ic" 2>&1
	rc=$?
	[ -d "$root/build/idem/test/output" ] && cp -a "$root/build/idem/test/output" "$work/installcheck"
	cases=$(grep -Ec '^(test|     ) .*\.\.\. ok|^ok [0-9]+ +[-+] ' "$ic")
	cases=$((cases + $(sed -n 's/^Files=[0-9]*, Tests=\([0-9]*\),.*/\1/p' "$ic" |
		awk '{n += $1} END {print n + 0}')))
	bad=$(grep -Ec '\.\.\. FAILED|^not ok |Dubious|^Result: FAIL|failed \(ignored\)' "$ic")
	ic_cases=$cases
	ic_bad=$bad
	echo "installcheck: exit $rc, $cases test cases passed, $bad failed (log: $out/installcheck.log)"
	grep -E '^(test|     ) |^ok |^not ok |^# |^=+$|tests? (passed|failed)' "$ic" | tail -n 60
	[ "$rc" -eq 0 ] && [ "$bad" -eq 0 ] && [ "$cases" -gt 0 ]
}
# Its test cases count in the result instead of the check itself.
ic_cases=0
ic_bad=0
if check "make installcheck as idemtest against the installed files" installcheck; then
	passed=$((passed - 1 + ic_cases))
else
	failed=$((failed - 1 + (ic_bad > 0 ? ic_bad : 1)))
	passed=$((passed + ic_cases))
fi
t_test=$((SECONDS - start))

unmount_below "$root"
result
