# idem: idempotency keys with a dedup window, as a PostgreSQL extension.
#
#   make demo    build, install and run the demo on a throwaway cluster
#   make test    build, install and run every test suite
#
# Both install missing Debian packages first (see test/deps.sh), so this
# file must work before pg_config exists.

EXTENSION = idem
MODULE_big = idem
OBJS = src/init.o src/settings.o src/args.o src/keyrel.o src/keyrows.o src/keys.o src/batch.o src/purge.o src/expiry.o src/sha256.o \
	src/stats.o src/waits.o src/worker.o src/inspect.o src/control.o src/citus.o
DATA = sql/idem--1.0.sql sql/idem--1.0--1.1.sql sql/idem--1.1--1.2.sql sql/idem--1.2--1.3.sql \
	sql/idem--1.3--1.4.sql sql/idem--1.4--1.5.sql sql/idem--1.5--1.6.sql sql/idem--1.6--1.7.sql sql/idem--1.7.sql
PGFILEDESC = "idem - idempotency keys with a dedup window"

REGRESS = setup begin fingerprint complete lease release_extend savepoint statement purge tombstone batch bad_input \
	settings go_scenarios interface inspect operator recovery storage shape wait_for security amcheck role_quoting upgrade
REGRESS_OPTS = --temp-config=test/idem.conf --temp-instance=tmp_check --inputdir=test \
	--outputdir=test/output/regress

ISOLATION = claim_concurrent lease_takeover conflict savepoint purge_reclaim \
	two_keys eight_claimers isolation_levels waiter_locks holder_snapshots reinstall \
	role_claims update_13 update_15 storage_door wait_for recovery_points tombstone_purge \
	batch_order batch_duplicate batch_single holder_reentry
ISOLATION_OPTS = --temp-config=test/idem.conf --temp-instance=tmp_check_iso \
	--inputdir=test/isolation --outputdir=test/output/isolation \
	--load-extension=idem

TAP_TESTS = 1
PROVE_TESTS = test/t/*.pl

PG_CFLAGS = -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers
ifdef IDEM_WERROR
PG_CFLAGS += -Werror
endif

EXTRA_CLEAN = test/output tmp_check tmp_check_iso

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs 2>/dev/null)
ifeq ($(PGXS),)
# Without pg_config nothing builds: say what installs it.
all install installcheck:
	@echo "$(PG_CONFIG) was not found: run 'make deps' first (it installs, with sudo if not root, PostgreSQL 15's server headers and libpq on Debian), or set PG_CONFIG=/path/to/pg_config" >&2; exit 2
else
include $(PGXS)
# The expected output is that of UTF-8 databases with English messages,
# whatever the caller's locale (test/run.sh sets the same).
installcheck: export LANG = C.UTF-8
installcheck: export LC_ALL = C.UTF-8
# The TAP suites' shared cluster set-up (test/perl/IdemTest.pm).
PROVE_FLAGS += -I test/perl
# PGXS tracks no header dependencies (PostgreSQL built without
# --enable-depend): rebuild every object and bitcode file when one of
# idem's headers changes, so that none keeps an old struct layout.
$(OBJS) $(OBJS:.o=.bc): $(wildcard src/*.h)
# The client guard library (guard/) and the programs built on it.
all: guard-all
install: install-guard
clean: clean-guard
endif

.PHONY: guard-all install-guard clean-guard
guard-all:
	$(MAKE) -C guard PG_CONFIG='$(PG_CONFIG)' all
install-guard: guard-all
	$(MAKE) -C guard PG_CONFIG='$(PG_CONFIG)' install
clean-guard:
	$(MAKE) -C guard PG_CONFIG='$(PG_CONFIG)' clean

.PHONY: deps demo test

deps:
	sh test/deps.sh

demo: deps
	sh test/demo.sh

test: deps
	sh test/run.sh

# pg_regress does not create its --outputdir.
ifneq ($(PGXS),)
installcheck: output-dirs
endif

.PHONY: output-dirs
output-dirs:
	@mkdir -p test/output/regress test/output/isolation

.PHONY: bench
bench: deps
	$(MAKE) -s all install
	bash test/bench/bench.sh

# The pg_regress suite against a server under valgrind (minutes; not part
# of make test).  VALGRIND_ISOLATION=1 adds the isolation specs.
.PHONY: valgrind-check
valgrind-check: deps
	sh test/valgrind.sh

# Build the Debian packages (debian/) from the committed tree and test them
# in a clean Debian 12 chroot (root only).  IDEM_DEB_TAP=1 adds the TAP suites.
# make deb-build only builds them (into test/output/deb/).
.PHONY: deb deb-build
deb:
	bash test/deb.sh
deb-build:
	bash test/deb.sh --build-only

# Build and run every suite and the demo against each supported PostgreSQL
# version: 15 on the host, 17 and 18 in cached Debian chroots (root only).
# MATRIX="17 18" runs a subset.
.PHONY: matrix
matrix:
	bash test/matrix.sh $(MATRIX)
