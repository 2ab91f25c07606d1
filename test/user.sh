#!/bin/sh
# Create the unprivileged user that runs test servers (root only).
set -eu
id idemtest >/dev/null 2>&1 ||
	useradd --system --create-home --shell /bin/sh idemtest
