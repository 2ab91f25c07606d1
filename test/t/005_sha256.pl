# The fingerprint's SHA-256 on both of src/sha256.c's paths: the portable
# rounds and the processor's SHA extensions (where it has them), against
# FIPS 180-4's examples and each other (test/sha256/sha256_check.c).  The
# server takes one path only (valgrind the portable one); the regression
# tests compare that one with PostgreSQL's sha256().
use strict;
use warnings;
use File::Basename qw(dirname);
use PostgreSQL::Test::Utils;
use Test::More;

my $top = dirname(__FILE__) . '/../..';
my $pg_config = $ENV{PG_CONFIG} // 'pg_config';
chomp(my $cc = `$pg_config --cc`);
chomp(my $inc = `$pg_config --includedir-server`);
my $dir = PostgreSQL::Test::Utils::tempdir;
my @cflags = ('-O2', "-I$top/src", "-I$inc");

ok(run_log([ $cc, @cflags, '-c', "$top/src/sha256.c", '-o', "$dir/native.o" ]),
	'sha256.c builds');
ok(run_log([ $cc, @cflags, '-DIDEM_SHA256_PORTABLE', '-Didem_sha256=idem_sha256_portable',
			'-c', "$top/src/sha256.c", '-o', "$dir/portable.o" ]),
	'sha256.c builds with the portable path only');
ok(run_log([ $cc, '-O2', "$top/test/sha256/sha256_check.c", "$dir/native.o",
			"$dir/portable.o", '-o', "$dir/sha256_check" ]),
	'sha256_check builds');

my ($out, $err);
my $ran = IPC::Run::run([ "$dir/sha256_check" ], '>', \$out, '2>', \$err);
ok($ran, 'sha256_check exits 0');
my @lines = split /\n/, $out;
is(scalar(grep { /^ok / } @lines), 11, 'eleven checks pass');
is(join("\n", grep { /^not ok / } @lines), '', 'none fails');

done_testing();
