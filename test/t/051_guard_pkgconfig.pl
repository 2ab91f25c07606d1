# The installed guard links like a library: a program built with
# cc prog.c $(pkg-config --cflags --libs idem-guard), and nothing else,
# claims, runs and completes a key, then replays it.  pkg-config finds
# idem-guard.pc where make install puts it: in the pkgconfig directory
# under pg_config --libdir.
use strict;
use warnings;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use IdemTest;
use Test::More;

my $libdir = `pg_config --libdir`;
chomp $libdir;
ok(-f "$libdir/pkgconfig/idem-guard.pc", "idem-guard.pc is installed in $libdir/pkgconfig");

my $dir = PostgreSQL::Test::Utils::tempdir;
open my $fh, '>', "$dir/prog.c" or die "$dir/prog.c: $!";
print $fh <<'C';
#include <stdio.h>
#include <idem_guard.h>

static int
charge(const IdemClaim *claim, void *arg, IdemResponse *resp)
{
	(*(int *) arg)++;
	return idem_response_set(resp, 200, "paid", 4);
}

int
main(int argc, char **argv)
{
	PGconn	   *conn = PQconnectdb(argv[1]);
	IdemResult	r1, r2;
	int			calls = 0;

	if (PQstatus(conn) != CONNECTION_OK)
	{
		fprintf(stderr, "%s", PQerrorMessage(conn));
		return 1;
	}
	idem_guard_do(conn, "pc-guard", "card=1", charge, &calls, &r1);
	idem_guard_do(conn, "pc-guard", "card=1", charge, &calls, &r2);
	printf("%s %s calls=%d status=%d body=%.*s\n", idem_outcome_name(r1.outcome),
		   idem_outcome_name(r2.outcome), calls, r2.resp.status,
		   (int) r2.resp.body_len, (const char *) r2.resp.body);
	idem_result_clear(&r1);
	idem_result_clear(&r2);
	PQfinish(conn);
	return 0;
}
C
close $fh;

local $ENV{PKG_CONFIG_PATH} = join ':', "$libdir/pkgconfig",
  grep { defined && $_ ne '' } $ENV{PKG_CONFIG_PATH};
my ($flags, $err) = run_command([ 'pkg-config', '--cflags', '--libs', 'idem-guard' ]);
like($flags, qr/-lidem_guard\b.*-lpq\b.*-pthread/, 'pkg-config idem-guard gives the link line')
  or diag($err);
ok(system("cc -Wall -o '$dir/prog' '$dir/prog.c' $flags") == 0,
	'cc prog.c $(pkg-config --cflags --libs idem-guard) builds');

my $node = idem_node('guard_pkgconfig');
my ($out, $run_err) = run_command([ "$dir/prog", $node->connstr('postgres') ]);
is($out, "EXECUTED REPLAYED calls=1 status=200 body=paid",
	'the program executes the handler once, then replays')
  or diag($run_err);

idem_amcheck($node, 'postgres');
$node->stop;

done_testing();
