#!/bin/sh
# Type-check the Python client's package (src/idem_pg, which ships py.typed)
# with mypy from Debian (python3-mypy), installing it and the packages the
# client imports if any is missing.  Prints one line "N passed, N failed"
# (1 passed when mypy finds no issue) and exits non-zero on any issue.
# Where python3-mypy cannot be installed, says so and counts nothing.
#
#   sh clients/python/typecheck.sh      (clients/python/test.sh runs it)
set -u
here=$(cd "$(dirname "$0")" && pwd)
py=/usr/bin/python3

pkgs="python3-mypy python3-psycopg python3-psycopg-pool"
missing=""
for p in $pkgs; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
		missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "installing:$missing"
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	# shellcheck disable=SC2086 # $missing is a list of words
	if ! { $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
		$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
			install -y -qq --no-install-recommends $missing >/dev/null; }; then
		if ! apt-cache show python3-mypy >/dev/null 2>&1; then
			echo "typecheck: python3-mypy is not installable here; not checked"
			exit 0
		fi
		echo "could not install:$missing" >&2
		echo "0 passed, 1 failed"
		exit 1
	fi
fi

cd "$here" || exit 1
# No cache: a check from scratch each time, nothing written to the tree.
if "$py" -m mypy --cache-dir=/dev/null --python-executable "$py" src/idem_pg; then
	echo "1 passed, 0 failed"
else
	echo "0 passed, 1 failed"
	exit 1
fi
