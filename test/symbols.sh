#!/bin/sh
# Every symbol that idem.so and libidem_guard.a define for others to link
# against is idem's own: named idem_..., or one PostgreSQL looks up in a
# module (Pg_magic_func, _PG_init, pg_finfo_idem_...).  On PostgreSQL 15 a
# module's global symbols share the backend's namespace, so an unprefixed
# one could clash with the server's or another extension's; the guard
# library is linked into applications.
#
#   sh test/symbols.sh        (after make; prints one line, exits non-zero on a stray symbol)
set -u
cd "$(dirname "$0")/.."
status=0
for lib in idem.so guard/libidem_guard.a; do
	if [ ! -f "$lib" ]; then
		echo "symbols: $lib is not built"
		status=1
		continue
	fi
	stray=$(nm -g --defined-only "$lib" 2>/dev/null |
		awk 'NF == 3 && $2 ~ /^[TDBRVW]$/ { print $3 }' |
		grep -Ev '^(idem_|pg_finfo_idem_|Pg_magic_func$|_PG_init$)' | sort -u)
	n=$(nm -g --defined-only "$lib" 2>/dev/null | awk 'NF == 3 && $2 ~ /^[TDBRVW]$/' | wc -l)
	if [ -n "$stray" ]; then
		echo "symbols: $lib defines symbols without the idem_ prefix:"
		echo "$stray" | sed 's/^/    /'
		status=1
	else
		echo "symbols: $lib defines $n global symbols, all idem's own"
	fi
done
exit $status
