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
