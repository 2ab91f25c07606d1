"""Runs one Python block of the documentation, for test/docs.sh.

    python3 test/docs/prelude.py BLOCK FILE LINE

The names the examples take as given are defined here (a connection
string, a connection, a payment provider), and Guard.do raises when its
result reports a failure; the block then runs in this module's
namespace, compiled so that a traceback names FILE and its line.
The connection parameters other than user and database come from PGHOST
and PGPORT.
"""
import sys

import psycopg

import idem_pg

DSN = "dbname=app user=app"
conn = psycopg.connect(DSN)
card = "4242 4242 4242 4242"


class _Provider:
    """A payment provider that accepts every charge."""

    def charge(self, *args, **kwargs):
        return {"id": "ch_1"}


provider = _Provider()


def tenant_of(scope):
    return ""


# A guard's do() reports a failure in its result rather than raising it: an
# example whose call fails (unavailable, or a step that failed) fails.
def _checked(do):
    def checked_do(self, *args, **kwargs):
        r = do(self, *args, **kwargs)
        if r.outcome == idem_pg.Outcome.UNAVAILABLE or r.failed_step is not None:
            raise AssertionError("do(): %s, failed step %s" % (r.outcome, r.failed_step)) from r.error
        return r
    return checked_do


idem_pg.Guard.do = _checked(idem_pg.Guard.do)


if __name__ == "__main__":
    block, file, line = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(block) as f:
        text = f.read()
    # The block's first line is the line after the opening fence.
    code = compile("\n" * line + text, file, "exec")
    exec(code, globals())
    conn.close()
