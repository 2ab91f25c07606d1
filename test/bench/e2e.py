"""End to end, against what users pick instead (make bench, rows 7).

One request: an idempotency key, an order INSERT and a ~100-byte
response.  Three ways of making it take effect once, each through
psycopg 3 from N worker processes, each worker on its own connection(s):

- idem: the Python client's one-transaction helper, atomic(): claim,
  INSERT, complete, one transaction.
- table: a hand-written key table in the same transaction: INSERT ... ON
  CONFLICT DO NOTHING RETURNING, the INSERT, an UPDATE of the stored
  response; a replay reads the stored response.
- redis: Redis SET NX beside PostgreSQL: SET key NX, the INSERT
  (autocommit), SET key response; a replay GETs the response.  The
  order and the response are not atomic: a process killed between the
  INSERT and the second SET leaves the key "processing" (or, with a
  lease, executes the order again).

Each round runs, for each pattern in turn, new keys then replays of the
same keys, so the patterns share the machine's state of the moment
(interleaved).  Prints one line per pattern and phase:
"pattern phase requests_per_s server_cpu_us_per_request rps_spread
client_cpu_us_per_request",
medians of the rounds, and the spread of the rounds' requests/s: (max -
min) / median.  Server CPU: the PostgreSQL cluster's processes (postmaster
children, by their /proc/PID/stat) and the Redis server, summed over the
phase while every worker holds its connections open.  Client CPU: the
workers' own (user + system) time in the phase, summed.

    python3 test/bench/e2e.py --dsn DSN --redis-port PORT [--workers 8]
        [--requests 2000] [--rounds 3] [--schema public]
"""

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time

import psycopg
import redis

from idem_pg import atomic

BODY = b'{"order":"%d","status":"accepted","amount":4200,"currency":"EUR","items":[1,2,3]}'
TICK = os.sysconf("SC_CLK_TCK")
PHASES = ("new", "replay")


def setup(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS e2e_orders, e2e_keys")
        conn.execute("CREATE TABLE e2e_orders (id bigserial PRIMARY KEY, key text NOT NULL,"
                     " amount int NOT NULL, created timestamptz NOT NULL DEFAULT now())")
        # The hand-written table: what a competent user keeps (key, stored
        # response, expiry for their own purge job).
        conn.execute("CREATE TABLE e2e_keys (key text PRIMARY KEY, status int, body bytea,"
                     " expires_at timestamptz NOT NULL DEFAULT now() + interval '1 day')")


def idem_request(conn, r, key, schema):
    with atomic(conn, key, "amount=4200", schema=schema) as tx:
        if not tx.claimed:
            return tx.response.body
        row = conn.execute("INSERT INTO e2e_orders (key, amount) VALUES (%s, 4200) RETURNING id",
                           (key,)).fetchone()
        body = BODY % row[0]
        tx.complete(201, body)
        return body


def table_request(conn, r, key, schema):
    with conn.transaction():
        if conn.execute("INSERT INTO e2e_keys (key) VALUES (%s) ON CONFLICT DO NOTHING RETURNING true",
                        (key,)).fetchone() is None:
            return conn.execute("SELECT body FROM e2e_keys WHERE key = %s", (key,)).fetchone()[0]
        row = conn.execute("INSERT INTO e2e_orders (key, amount) VALUES (%s, 4200) RETURNING id",
                           (key,)).fetchone()
        body = BODY % row[0]
        conn.execute("UPDATE e2e_keys SET status = 201, body = %s WHERE key = %s", (body, key))
        return body


def redis_request(conn, r, key, schema):
    if not r.set(key, b"processing", nx=True, ex=86400):
        return r.get(key)
    row = conn.execute("INSERT INTO e2e_orders (key, amount) VALUES (%s, 4200) RETURNING id",
                       (key,)).fetchone()
    body = BODY % row[0]
    r.set(key, body, ex=86400)
    return body


PATTERNS = {"idem": idem_request, "table": table_request, "redis": redis_request}


def worker(args, pattern, prefix, wid, ready, go, done, leave, client_cpu):
    try:
        run_worker(args, pattern, prefix, wid, ready, go, done, leave, client_cpu)
    except BaseException:
        # Let the main process and the other workers stop waiting.
        for b in (ready, go, leave, *done.values()):
            b.abort()
        raise


def run_worker(args, pattern, prefix, wid, ready, go, done, leave, client_cpu):
    conn = psycopg.connect(args.dsn, autocommit=True)
    r = redis.Redis(port=args.redis_port) if pattern == "redis" else None
    handle = PATTERNS[pattern]
    keys = ["%s-%d-%d" % (prefix, wid, i) for i in range(args.requests)]
    # A warm connection: the first statements prepare and plan.
    ready.wait()
    go.wait()
    for i, phase in enumerate(PHASES):
        cpu0 = time.process_time()
        for key in keys:
            body = handle(conn, r, key, args.schema)
            assert body is not None and body.startswith(b'{"order"'), (pattern, key, body)
        client_cpu[len(PHASES) * wid + i] = time.process_time() - cpu0
        done[phase].wait()
        go.wait()
    leave.wait()
    conn.close()
    if r is not None:
        r.close()


def cluster_cpu(dsn, redis_pid):
    """CPU ticks used so far by the cluster's processes and Redis."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        data_dir = conn.execute("SHOW data_directory").fetchone()[0]
    with open(os.path.join(data_dir, "postmaster.pid")) as f:
        ppid = int(f.readline())
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[1] is the parent pid, fields[11] and [12] utime and stime
        if int(pid) in (ppid, redis_pid) or int(fields[1]) == ppid:
            total += int(fields[11]) + int(fields[12])
    return total


def run_pattern(args, pattern, prefix):
    n = args.workers
    ready, go, leave = mp.Barrier(n + 1), mp.Barrier(n + 1), mp.Barrier(n + 1)
    done = {phase: mp.Barrier(n + 1) for phase in PHASES}
    client_cpu = mp.Array("d", len(PHASES) * n)
    procs = [mp.Process(target=worker, args=(args, pattern, prefix, w, ready, go, done, leave,
                                             client_cpu))
             for w in range(n)]
    for p in procs:
        p.start()
    try:
        return measure(args, pattern, procs, ready, go, done, leave, client_cpu)
    except threading.BrokenBarrierError:
        for p in procs:
            p.join()
        raise SystemExit("e2e: a %s worker failed" % pattern)


def measure(args, pattern, procs, ready, go, done, leave, client_cpu):
    n = args.workers
    ready.wait()
    out = {}
    for phase in PHASES:
        cpu0 = cluster_cpu(args.dsn, args.redis_pid)
        t0 = time.monotonic()
        go.wait()
        done[phase].wait()
        elapsed = time.monotonic() - t0
        cpu = cluster_cpu(args.dsn, args.redis_pid) - cpu0
        requests = n * args.requests
        out[phase] = [requests / elapsed, cpu * 1e6 / TICK / requests]
    go.wait()
    leave.wait()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit("e2e: a %s worker failed" % pattern)
    for i, phase in enumerate(PHASES):
        cpu = sum(client_cpu[len(PHASES) * w + i] for w in range(n))
        out[phase].append(cpu * 1e6 / (n * args.requests))
    return out


def check(args, prefix_of):
    """Every request of every round made exactly one order."""
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        dup = conn.execute("SELECT count(*) FROM (SELECT key FROM e2e_orders GROUP BY key"
                           " HAVING count(*) > 1) d").fetchone()[0]
        total = conn.execute("SELECT count(*) FROM e2e_orders").fetchone()[0]
    want = len(prefix_of) * args.workers * args.requests
    if dup != 0 or total != want:
        raise SystemExit("e2e: %d orders for %d requests, %d keys with more than one" % (total, want, dup))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--redis-port", type=int, required=True)
    ap.add_argument("--redis-pid", type=int, required=True)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schema", default="public")
    args = ap.parse_args()

    setup(args.dsn)
    results = {(p, ph): [] for p in PATTERNS for ph in PHASES}
    prefixes = []
    for rnd in range(args.rounds):
        for pattern in PATTERNS:
            prefix = "%s%d" % (pattern, rnd)
            prefixes.append(prefix)
            for phase, value in run_pattern(args, pattern, prefix).items():
                results[(pattern, phase)].append(value)
    check(args, prefixes)
    for (pattern, phase), values in results.items():
        rps = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        spread = (max(v[0] for v in values) - min(v[0] for v in values)) / rps if rps else 0
        client = statistics.median(v[2] for v in values)
        print("%s %s %.0f %.1f %.3f %.1f" % (pattern, phase, rps, cpu, spread, client))


if __name__ == "__main__":
    main()
