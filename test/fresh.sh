#!/bin/bash
# Run a shell script as root on a fresh Debian 12 machine: a throwaway
# chroot, in a clone of this tree.  The documentation runner
# (test/docs.sh) runs the blocks marked "sh run fresh" with it: the
# README's quickstart and the operator's path in doc/operations.md.
#
#   test/fresh.sh SCRIPT
#
# The machine is what the README promises to start from: Debian 12
# (bookworm, debootstrap's minbase, the host's Debian mirror), root, git,
# make and gcc, nothing else; the source tree as it is now (uncommitted
# changes included, build outputs left out) in /root/idem, the directory
# SCRIPT runs in, with `sh -e` and a clean environment (no LANG, no
# variable of the caller's).  Services start as on a Debian machine
# without systemd, and installing PostgreSQL makes its main cluster.
#
# Isolation from the host and from other runs: the chroot is an overlay
# on the cached chroot of test/deb.sh ($IDEM_DEB_CACHE, default
# /var/cache/idem-deb), thrown away at the end; a cluster made inside it
# listens on no TCP port (/etc/postgresql-common/createcluster.d), only on
# its own Unix socket directory, so it cannot take or reach a port of the
# machine's.  Every process left in the chroot is stopped and every mount
# undone on exit, also on failure or interruption.  Needs root
# (debootstrap, chroot, mount).  Exits with SCRIPT's status; SCRIPT is
# stopped after $IDEM_FRESH_TIMEOUT seconds (default 1200).
set -u

top=$(cd "$(dirname "$0")/.." && pwd)
cache=${IDEM_DEB_CACHE:-/var/cache/idem-deb}
suite=bookworm
script=${1:-}
if [ -z "$script" ] || [ ! -r "$script" ]; then
	echo "usage: test/fresh.sh SCRIPT" >&2
	exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "test/fresh.sh needs root (debootstrap, chroot, mount)" >&2
	exit 2
fi

. "$top/test/chroot.sh"

run_dir=""
cleanup() {
	chroot_cleanup
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

# The cached chroot is prepared under an exclusive lock, then used under
# a shared one: fresh runs go on side by side, test/deb.sh waits for them.
mkdir -p "$cache"
exec 9>"$cache/lock"
flock 9
prepare_chroot "$cache/$suite" "$suite" >/dev/null || exit 1
flock -s 9

run_dir=$(mktemp -d "$cache/fresh.XXXXXX")
root=$run_dir/root
overlay_chroot "$cache" "$suite" "$run_dir" >/dev/null || exit 1

# What the cached chroot adds for the package test goes: services start
# and PostgreSQL makes its main cluster, as on any Debian machine.  What
# this run adds: clusters listen on no TCP port.
rm -f "$root/usr/sbin/policy-rc.d" "$root/etc/postgresql-common/createcluster.conf"
mkdir -p "$root/etc/postgresql-common/createcluster.d"
echo "listen_addresses = ''" >"$root/etc/postgresql-common/createcluster.d/00-no-tcp.conf"

in_chroot() {
	run_child chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root TERM=dumb "$@"
}

echo "== git, make and gcc on a fresh $suite"
in_chroot sh -ec '
	chown _apt /var/cache/apt/archives/partial
	apt-get -o DPkg::Lock::Timeout=600 update -qq
	DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends git make gcc libc6-dev >/dev/null' || exit 1
copy_tree "$top" worktree "$root/root/idem" || exit 1
cp "$script" "$root/root/fresh-script.sh"

echo "== $script in /root/idem"
in_chroot timeout "${IDEM_FRESH_TIMEOUT:-1200}" sh -ec 'cd /root/idem && exec sh -e /root/fresh-script.sh'
