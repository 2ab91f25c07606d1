#!/bin/sh
# Install the Debian packages idem needs to build, test and demo, if any is
# missing.  Runs as root (or through sudo).
set -eu

pkgs="postgresql-15 postgresql-server-dev-15 postgresql-contrib libpq-dev \
	libipc-run-perl pgbouncer make gcc libc6-dev perl pkg-config"

missing=""
for p in $pkgs; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
		missing="$missing $p"
done
[ -z "$missing" ] && exit 0

echo "installing:$missing"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
$sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $missing >/dev/null
