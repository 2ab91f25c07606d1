#!/bin/bash
# Build and test idem against several PostgreSQL major versions (make matrix).
#
#   test/matrix.sh [VERSION...]             default: 15 17 18
#   test/matrix.sh --prepare [VERSION...]   only build (or check) the chroots
#
# 15 is the host's (Debian 12) PostgreSQL.  Every other version runs in a
# Debian chroot that ships it: 17 in trixie, 18 in sid.  Each version gets
# the same snapshot of this tree, taken when the matrix starts, and runs what
# make test runs (test/run.sh: build with -Werror, install, pg_regress,
# isolation, TAP as the user idemtest) and then the demo (test/demo.sh).
# In each chroot it then builds that version's Debian package from debian/
# (postgresql-NN-idem, with `pg_buildext updatecontrol` for the suite's
# PostgreSQL) and installs it with apt.
#
# The chroots are built with debootstrap from the host's configured Debian
# mirror and kept in $IDEM_MATRIX_CACHE (default /var/cache/idem-matrix) for
# the next run; a chroot is reused only if its preparation finished (marker
# file written last) with the same package list.  Mounts made for a run are
# undone on exit, also when a test fails or the run is interrupted.
#
# Prints one summary line per version and exits non-zero if any failed.
# Full logs: test/output-matrix/pgNN.log (and pgNN/, the suites' output).
# Needs root (debootstrap, chroot, mount).
set -u

top=$(cd "$(dirname "$0")/.." && pwd)
cache=${IDEM_MATRIX_CACHE:-/var/cache/idem-matrix}
logdir=$top/test/output-matrix
host_version=15
prepare_only=0
if [ "${1:-}" = "--prepare" ]; then
	prepare_only=1
	shift
fi
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(15 17 18)

# Debian suite that ships each PostgreSQL major version.
suite_of() {
	case "$1" in
	17) echo trixie ;;
	18) echo sid ;;
	*) return 1 ;;
	esac
}

# Packages a chroot needs: the server and headers of one version, what
# test/deps.sh installs on the host for the suites and the demo, and what
# Citus needs to build (see citus_tarball; libselinux1-dev, in Citus's
# list, is optional and was not installable in sid, so it is left out).
packages_of() {
	echo "postgresql-$1 postgresql-server-dev-$1 libpq-dev libipc-run-perl" \
		"pgbouncer make gcc libc6-dev perl" \
		"liblz4-dev libzstd-dev libcurl4-openssl-dev libkrb5-dev libssl-dev" \
		"libxml2-dev libxslt1-dev libpam0g-dev libreadline-dev" \
		"zlib1g-dev libicu-dev"
}

# Citus, for the Citus suite (test/t/090_citus.pl) in the 17 and 18
# chroots.  No package source reachable from CI ships it: its source
# tarball lives outside this repository ($IDEM_CITUS_TARBALL; else
# shared/deps next to the checkout, else /work/shared/deps, where machines
# of this kind keep it), is copied into the chroot when the chroot is
# prepared, checked against the digest pinned here, built and installed
# there, and cached with the chroot.  Without the tarball the chroot has no
# Citus and the Citus suite skips itself, saying so.
citus_tarball=${IDEM_CITUS_TARBALL:-}
if [ -z "$citus_tarball" ]; then
	for d in "$top/../shared/deps" /work/shared/deps; do
		citus_tarball=$d/citus-14.0.1.tar.gz
		[ -f "$citus_tarball" ] && break
	done
fi
citus_sha256=acfa9a77cd84a8e1edab26cca4a71355f39c910c01586da89560e0240d4b05ba

if [ "$(id -u)" -ne 0 ]; then
	echo "test/matrix.sh needs root (debootstrap, chroot, mount)" >&2
	exit 2
fi
for v in "${versions[@]}"; do
	if [ "$v" != "$host_version" ] && ! suite_of "$v" >/dev/null; then
		echo "no Debian suite known for PostgreSQL $v" >&2
		exit 2
	fi
done

# Shared chroot helpers: mirror, run_child, mount_chroot, unmount_below,
# mounted_below, and chroot_cleanup with the state it undoes.
. "$top/test/chroot.sh"

cleanup() {
	chroot_cleanup
	[ -n "${snapshot:-}" ] && rm -f "$snapshot"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Build the chroot for version $1 in $2, unless a complete one is cached.
prepare_chroot() {
	local v=$1 root=$2 suite pkgs marker
	suite=$(suite_of "$v")
	pkgs=$(packages_of "$v")
	marker=$root/.idem-matrix-ready
	if [ -f "$marker" ] && [ "$(cat "$marker")" = "$suite: $pkgs" ]; then
		echo "reusing the $suite chroot in $root"
		return 0
	fi
	debootstrap_chroot "$root" "$suite" || return 1
	# The mirror may be a dated snapshot whose Release files are past their
	# Valid-Until; apt in the chroot accepts them.
	echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99idem-matrix"
	# No service starts inside the chroot, and no default cluster is made.
	printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
	chmod 755 "$root/usr/sbin/policy-rc.d"
	mkdir -p "$root/etc/postgresql-common"
	echo "create_main_cluster = false" >"$root/etc/postgresql-common/createcluster.conf"
	mount_chroot "$root" || return 1
	# shellcheck disable=SC2086
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 sh -c "
		apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
			-o Dpkg::Options::=--force-confold $pkgs >/dev/null &&
		apt-get clean" || { unmount_below "$root"; return 1; }
	unmount_below "$root"
	echo "$suite: $pkgs" >"$marker"
}

# What building the Debian packages needs (debian/control's Build-Depends),
# installed on top of a prepared chroot unless its marker says they are.
deb_packages="build-essential dpkg-dev debhelper postgresql-server-dev-all dh-python"
deb_packages="$deb_packages pybuild-plugin-pyproject python3-all python3-setuptools"
prepare_deb() {
	local root=$1 marker=$1/.idem-matrix-deb rc
	if [ -f "$marker" ] && [ "$(cat "$marker")" = "$deb_packages" ]; then
		echo "reusing the packaging tools in $root"
		return 0
	fi
	mount_chroot "$root" || return 1
	# shellcheck disable=SC2086
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 sh -c "
		apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
			-o Dpkg::Options::=--force-confold $deb_packages >/dev/null &&
		apt-get clean"
	rc=$?
	unmount_below "$root"
	[ "$rc" -eq 0 ] || { echo "installing the packaging tools in $root failed" >&2; return 1; }
	echo "$deb_packages" >"$marker"
}

# Build and install Citus for version $1 in the chroot $2 from
# $citus_tarball, unless the chroot already has this Citus (marker).
prepare_citus() {
	local v=$1 root=$2 marker=$2/.idem-matrix-citus name rc
	if [ -f "$marker" ] && [ "$(cat "$marker")" = "$citus_sha256" ]; then
		echo "reusing the Citus build in $root"
		return 0
	fi
	if [ ! -f "$citus_tarball" ]; then
		echo "no Citus source at $citus_tarball: the Citus suite will be skipped"
		return 0
	fi
	echo "$citus_sha256  $citus_tarball" | sha256sum -c --quiet - || {
		echo "$citus_tarball does not have the expected sha256 $citus_sha256" >&2
		return 1
	}
	name=$(basename "$citus_tarball" .tar.gz)
	rm -rf "$root/build/citus"
	mkdir -p "$root/build/citus"
	cp "$citus_tarball" "$root/build/citus/$name.tar.gz"
	mount_chroot "$root" || return 1
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		LANG=C.UTF-8 sh -c "
		set -e
		cd /build/citus
		echo '$citus_sha256  $name.tar.gz' | sha256sum -c --quiet -
		tar xzf $name.tar.gz
		cd $name
		./configure -q PG_CONFIG=/usr/lib/postgresql/$v/bin/pg_config >/dev/null
		make -s -j$(nproc) >/dev/null
		make -s install >/dev/null"
	rc=$?
	unmount_below "$root"
	rm -rf "$root/build/citus"
	[ "$rc" -eq 0 ] || { echo "building Citus in $root failed" >&2; return 1; }
	echo "$citus_sha256" >"$marker"
}

# The tree as it is now, without build products and test output.
snapshot=$(mktemp /tmp/idem-matrix-src.XXXXXX.tar)
tar -C "$top" --exclude=./.git --exclude='*.o' --exclude='*.bc' --exclude='*.so' \
	--exclude='*.a' --exclude=./tmp_check --exclude=./tmp_check_iso \
	--exclude=./test/output --exclude=./test/output-matrix \
	--exclude=./test/bench/out --exclude=./test/guard/guard_test \
	--exclude=./test/demo/idem_demo -cf "$snapshot" . || exit 1

# What runs for version $1 inside its tree: the suites, then the demo.  It
# first checks that pg_config is the one of that version.
suite_cmd() {
	echo "pg_config --version | grep -q '^PostgreSQL $1\.' ||
		{ echo \"pg_config is not PostgreSQL $1: \$(pg_config --version)\"; exit 1; }
	pg_config --version
	rc=0
	IDEM_CLIENTS=no sh test/run.sh || rc=1
	echo '== demo'
	sh test/demo.sh || rc=1
	exit \$rc"
}

# Run the suites for version $1 on the host; output goes to stdout.
run_host() {
	local work rc
	sh "$top/test/deps.sh" || return 1
	work=$(mktemp -d /tmp/idem-matrix-host.XXXXXX)
	tar -C "$work" -xf "$snapshot"
	cd "$work" && run_child sh -c "$(suite_cmd "$1")"
	rc=$?
	cd "$top"
	rm -rf "$logdir/pg$1"
	[ -d "$work/test/output" ] && cp -a "$work/test/output" "$logdir/pg$1"
	rm -rf "$work"
	return $rc
}

# Build the Debian package of version $1 from a fresh copy of the snapshot
# (in /build/deb) and install it with apt: the commands, run in its chroot.
deb_cmd() {
	echo "set -e
	echo '== Debian package postgresql-$1-idem'
	rm -rf /build/deb && mkdir -p /build/deb/idem && cd /build/deb/idem
	tar -xf /build/idem-src.tar
	pg_buildext updatecontrol
	grep -q '^Package: postgresql-$1-idem\$' debian/control
	dpkg-buildpackage -us -uc -b >/build/deb/build.log 2>&1 ||
		{ tail -n 40 /build/deb/build.log; exit 1; }
	cd /build/deb
	ls ./*.deb
	apt-get -o DPkg::Lock::Timeout=600 install -y -qq ./postgresql-$1-idem_*.deb >/dev/null
	dpkg -S /usr/lib/postgresql/$1/lib/idem.so /usr/share/postgresql/$1/extension/idem.control
	# The cached chroot keeps no package of this tree.
	dpkg --purge postgresql-$1-idem >/dev/null
	echo 'package postgresql-$1-idem: built and installed'"
}

# Run the suites for version $1 in the chroot $2; output goes to stdout.
run_chroot() {
	local v=$1 root=$2 rc
	mount_chroot "$root" || return 1
	# An interrupted earlier run may have left its work trees behind.
	rm -rf "$root/build" "$root"/tmp/idem-*
	mkdir -p "$root/build/idem"
	tar -C "$root/build/idem" -xf "$snapshot"
	cp "$snapshot" "$root/build/idem-src.tar"
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 PG_CONFIG="/usr/lib/postgresql/$v/bin/pg_config" \
		sh -c "cd /build/idem && $(suite_cmd "$v")"
	rc=$?
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive sh -c "$(deb_cmd "$v")" || rc=1
	unmount_below "$root"
	rm -rf "$logdir/pg$v"
	[ -d "$root/build/idem/test/output" ] &&
		cp -a "$root/build/idem/test/output" "$logdir/pg$v"
	return $rc
}

mkdir -p "$logdir"
if [ "$prepare_only" -eq 1 ]; then
	rc=0
	for v in "${versions[@]}"; do
		[ "$v" = "$host_version" ] && continue
		start=$SECONDS
		if prepare_chroot "$v" "$cache/$(suite_of "$v")" &&
			prepare_deb "$cache/$(suite_of "$v")"; then
			echo "PostgreSQL $v: chroot preparation took $((SECONDS - start))s"
			start=$SECONDS
			prepare_citus "$v" "$cache/$(suite_of "$v")" || rc=1
			echo "PostgreSQL $v: Citus build took $((SECONDS - start))s"
		else
			rc=1
			echo "PostgreSQL $v: chroot preparation failed after $((SECONDS - start))s"
		fi
	done
	exit $rc
fi
summary=()
failed=0
matrix_start=$SECONDS
for v in "${versions[@]}"; do
	log=$logdir/pg$v.log
	prep=0
	where="host"
	start=$SECONDS
	rc=0
	if [ "$v" = "$host_version" ]; then
		echo "=== PostgreSQL $v on the host"
		run_host "$v" >"$log" 2>&1 || rc=$?
	else
		suite=$(suite_of "$v")
		where="$suite chroot"
		root=$cache/$suite
		echo "=== PostgreSQL $v in a $where"
		if prepare_chroot "$v" "$root" >"$logdir/pg$v-prepare.log" 2>&1 &&
			prepare_deb "$root" >>"$logdir/pg$v-prepare.log" 2>&1 &&
			prepare_citus "$v" "$root" >>"$logdir/pg$v-prepare.log" 2>&1; then
			prep=$((SECONDS - start))
			start=$SECONDS
			run_chroot "$v" "$root" >"$log" 2>&1 || rc=$?
		else
			prep=$((SECONDS - start))
			start=$SECONDS
			rc=1
			echo "preparing the chroot failed, see $logdir/pg$v-prepare.log" >"$log"
		fi
	fi
	took=$((SECONDS - start))
	counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -1)
	[ -n "$counts" ] || counts="no test results (build or install failed?)"
	if [ "$rc" -eq 0 ]; then
		status=PASS
	else
		status=FAIL
		failed=$((failed + 1))
		tail -n 40 "$log"
	fi
	line=$(printf 'PostgreSQL %s (%s): %s, %s; prepare %ds, test %ds' \
		"$v" "$where" "$status" "$counts" "$prep" "$took")
	echo "$line"
	summary+=("$line")
done

echo "=== matrix summary ($((SECONDS - matrix_start))s)"
printf '%s\n' "${summary[@]}"
[ "$failed" -eq 0 ]
