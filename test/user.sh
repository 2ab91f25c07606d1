#!/bin/sh
# Create the unprivileged user that runs test servers (root only):
# idemtest, or the name given (test/run.sh also runs pg_regress as
# idemcheck, so that no expected output depends on the user's name).
set -eu
user=${1:-idemtest}
id "$user" >/dev/null 2>&1 ||
	useradd --system --create-home --shell /bin/sh "$user"
