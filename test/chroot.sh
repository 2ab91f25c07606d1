# Chroot helpers shared by test/matrix.sh and test/deb.sh (bash; sourced).
#
# Both build Debian chroots with debootstrap from the host's configured
# mirror, run servers and tests inside them, and must leave no process or
# mount behind, also when a step fails or the run is interrupted.  A script
# that sources this file calls chroot_cleanup from its EXIT trap.

mounts=()
chroots=()
# The command running now, in a process group of its own, so that an
# interrupted run can stop it with all its children.
child=""

# The Debian mirror the host's apt is configured with.
mirror() {
	local m=""
	if [ -r /etc/apt/sources.list.d/debian.sources ]; then
		m=$(awk '$1 == "URIs:" && $2 !~ /security/ { print $2; exit }' \
			/etc/apt/sources.list.d/debian.sources)
	fi
	if [ -z "$m" ] && [ -r /etc/apt/sources.list ]; then
		m=$(awk '$1 == "deb" && $0 !~ /security/ {
				for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' \
			/etc/apt/sources.list)
	fi
	[ -n "$m" ] || return 1
	echo "$m"
}

# Stop every process whose root directory is the chroot $1 (servers a failed
# step left behind); they hold the chroot's mounts busy.
kill_chroot_processes() {
	local root=$1 sig p pid left
	for sig in TERM KILL; do
		left=0
		for p in /proc/[0-9]*; do
			[ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] || continue
			pid=${p#/proc/}
			kill -s "$sig" "$pid" 2>/dev/null && left=1
		done
		[ "$left" -eq 0 ] && return 0
		sleep 2
	done
}

# Run a command in its own process group and wait for it; unlike a command
# in the foreground, the wait ends as soon as the script gets a signal.
run_child() {
	local rc
	setsid "$@" &
	child=$!
	wait "$child"
	rc=$?
	child=""
	return $rc
}

# Is anything mounted on or below the directory $1?  Nothing may be before
# it is deleted.
mounted_below() {
	awk -v p="$1/" 'index($2, p) == 1 || $2 == substr(p, 1, length(p) - 1) { found = 1 }
		END { exit !found }' /proc/mounts
}

# A fresh debootstrap minbase of the Debian suite $2 in $1, from the
# host's mirror (installing debootstrap first if it is missing).  Refuses
# to delete a directory that has mounts below it.
debootstrap_chroot() {
	local root=$1 suite=$2 m
	if mounted_below "$root"; then
		echo "$root has mounts below it; not deleting it" >&2
		return 1
	fi
	m=$(mirror) || { echo "no Debian mirror configured in /etc/apt" >&2; return 1; }
	command -v debootstrap >/dev/null || {
		apt-get -o DPkg::Lock::Timeout=600 update -qq &&
			DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq debootstrap >/dev/null ||
			return 1
	}
	echo "preparing a $suite chroot in $root"
	rm -rf "$root"
	mkdir -p "$root"
	debootstrap --variant=minbase "$suite" "$root" "$m"
}

# Mount $1 with the options that follow, private so that nothing mounted
# below it can propagate back to the host's own mount of the same source.
mount_in() {
	local target=$1
	shift
	mount "$@" "$target" || return 1
	mounts+=("$target")
	mount --make-private "$target"
}

# Mount what servers, tests and apt need inside the chroot $1.
mount_chroot() {
	local root=$1
	chroots+=("$root")
	mount_in "$root/proc" -t proc proc &&
		mount_in "$root/dev" --bind /dev &&
		mount_in "$root/dev/pts" --bind /dev/pts &&
		mount_in "$root/dev/shm" -t tmpfs -o mode=1777 shm
}

# Stop the chroot $1's processes and undo the mounts on and below it that
# this run made.
unmount_below() {
	local root=$1 i keep=()
	kill_chroot_processes "$root"
	for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
		case "${mounts[$i]}" in
		"$root" | "$root"/*) umount "${mounts[$i]}" 2>/dev/null || umount -l "${mounts[$i]}" ;;
		esac
	done
	for i in "${mounts[@]+"${mounts[@]}"}"; do
		case "$i" in "$root" | "$root"/*) ;; *) keep+=("$i") ;; esac
	done
	mounts=("${keep[@]+"${keep[@]}"}")
}

# Stop the running command and every chroot's processes, and undo every
# mount this run made (the EXIT trap's part).
chroot_cleanup() {
	local i
	if [ -n "$child" ]; then
		kill -TERM -- "-$child" 2>/dev/null && sleep 2
		kill -KILL -- "-$child" 2>/dev/null
	fi
	for i in "${chroots[@]+"${chroots[@]}"}"; do
		kill_chroot_processes "$i"
	done
	for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
		umount "${mounts[$i]}" 2>/dev/null || umount -l "${mounts[$i]}" 2>/dev/null ||
			echo "could not unmount ${mounts[$i]}" >&2
	done
	mounts=()
	chroots=()
}

# The cached chroot in $1: debootstrap's minbase of the Debian suite $2
# with the host's apt sources, nothing else but what keeps a package test
# quiet (no service starts, no default cluster is made; test/fresh.sh
# undoes both in its overlay).  Reused only if its preparation finished
# (marker written last) with the same recipe.  test/deb.sh and
# test/fresh.sh share it, under the lock of their cache directory.
prepare_chroot() {
	local root=$1 suite=$2 marker=$1/.idem-deb-ready recipe
	recipe="$suite minbase, host Debian sources, v1"
	if [ -f "$marker" ] && [ "$(cat "$marker")" = "$recipe" ]; then
		echo "reusing the $suite chroot in $root"
		return 0
	fi
	debootstrap_chroot "$root" "$suite" || return 1
	# The same Debian suites as the host (updates, security), when the host
	# is on $suite too: the packages built here depend on its server's
	# minor version.
	if [ -r /etc/apt/sources.list.d/debian.sources ] &&
		grep -q "^Suites:.*\b$suite\b" /etc/apt/sources.list.d/debian.sources; then
		cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/debian.sources"
		rm -f "$root/etc/apt/sources.list"
	elif [ -r /etc/apt/sources.list ] && grep -q "^deb .* $suite main" /etc/apt/sources.list; then
		grep "^deb .* $suite\(-[a-z]*\)\? main" /etc/apt/sources.list |
			grep -v '\[' >"$root/etc/apt/sources.list"
	fi
	# The mirror may be a dated snapshot whose Release files are past their
	# Valid-Until; apt in the chroot accepts them.
	echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99idem-deb"
	# No service starts inside the chroot, and no default cluster is made.
	printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
	chmod 755 "$root/usr/sbin/policy-rc.d"
	mkdir -p "$root/etc/postgresql-common"
	echo "create_main_cluster = false" >"$root/etc/postgresql-common/createcluster.conf"
	echo "$recipe" >"$marker"
}

# overlay_chroot CACHE SUITE RUN_DIR: a throwaway chroot in RUN_DIR/root,
# an overlay on the cached chroot CACHE/SUITE (a copy if overlayfs is not
# available), with what servers and apt need mounted, the downloaded
# packages kept in CACHE/archives for the next run, and the host's
# resolver.
overlay_chroot() {
	local cache=$1 suite=$2 run_dir=$3 root=$3/root
	mkdir -p "$run_dir/upper" "$run_dir/work" "$root"
	if mount_in "$root" -t overlay overlay \
		-o "lowerdir=$cache/$suite,upperdir=$run_dir/upper,workdir=$run_dir/work"; then
		echo "overlay on $cache/$suite"
	else
		echo "no overlayfs: copying $cache/$suite"
		cp -a "$cache/$suite/." "$root/"
	fi
	mount_chroot "$root" || return 1
	mkdir -p "$cache/archives/partial" &&
		mount_in "$root/var/cache/apt/archives" --bind "$cache/archives" || return 1
	cp -L /etc/resolv.conf "$root/etc/resolv.conf"
}

# copy_tree TOP MODE DEST: a clean copy of the source tree TOP in DEST.
# MODE head: the committed tree (git archive HEAD) when TOP is the top of a
# git checkout; otherwise, or with MODE worktree, the files as they are
# (a release tarball, a PGXN zip), without build outputs.
copy_tree() {
	local top=$1 mode=$2 dest=$3
	mkdir -p "$dest"
	if [ "$mode" = head ] && [ -e "$top/.git" ] &&
		[ "$(git -C "$top" rev-parse --show-toplevel 2>/dev/null)" = "$top" ]; then
		git -C "$top" cat-file -e HEAD:debian/control 2>/dev/null || {
			echo "debian/ is not committed; commit it or use --worktree"
			return 1
		}
		git -C "$top" archive HEAD | tar -C "$dest" -xf -
	else
		tar -C "$top" --exclude=./.git --exclude='*.o' --exclude='*.bc' --exclude='*.so' \
			--exclude='*.a' --exclude=./tmp_check --exclude=./tmp_check_iso \
			--exclude=./results --exclude=./log \
			--exclude=./test/output --exclude=./test/output-matrix \
			--exclude=./test/bench/out --exclude=./test/guard/guard_test \
			--exclude=./test/demo/idem_demo --exclude=./clients/node/node_modules \
			-cf - . | tar -C "$dest" -xf -
	fi
}
