"""End to end, against what users pick instead (make bench, rows 7).

One request: an idempotency key, an order INSERT and a ~100-byte
response.  Three ways of making it take effect once, each through
psycopg 3 (--driver psycopg: redis-py) or asyncpg (--driver asyncpg:
redis-py's asyncio client, with hiredis) from N worker processes, each
worker on its own connection(s), one request at a time (asyncpg: one
event loop and one task a process):

- idem: the Python client's one-transaction helper, atomic() (asyncpg:
  atomic_async()): claim, INSERT, complete, one transaction.
- table: a hand-written key table in the same transaction: INSERT ... ON
  CONFLICT DO NOTHING RETURNING, the INSERT, an UPDATE of the stored
  response; a replay reads the stored response.
- redis: Redis SET NX beside PostgreSQL: SET key NX GET PX (one round
  trip: claimed, or the value stored), the INSERT (autocommit), SET key
  response PX.  The order and the response are not atomic: a process
  killed between the INSERT and the second SET leaves the key
  "processing" (or, with a lease, executes the order again).

Every replay must answer the bytes of the key's first response, and
every key must have made exactly one order; else the run exits 1.

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

    python3 test/bench/e2e.py --dsn DSN --redis-port PORT --redis-pid PID
        [--driver psycopg|asyncpg] [--setup] [--workers 8] [--requests 2000]
        [--rounds 3] [--schema public]

--setup drops and creates the tables (e2e_orders, e2e_keys); the other
clients' runs (test/bench/e2e_go, e2e_node) use them after it, each
with keys of its own prefix.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time

import psycopg
import redis

from idem_pg import atomic, atomic_async

BODY = b'{"order":"%d","status":"accepted","amount":4200,"currency":"EUR","items":[1,2,3]}'
TICK = os.sysconf("SC_CLK_TCK")
PHASES = ("new", "replay")
TTL_MS = 86400000


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
    old = r.set(key, b"processing", nx=True, get=True, px=TTL_MS)
    if old is not None:
        return old
    row = conn.execute("INSERT INTO e2e_orders (key, amount) VALUES (%s, 4200) RETURNING id",
                       (key,)).fetchone()
    body = BODY % row[0]
    r.set(key, body, px=TTL_MS)
    return body


PATTERNS = {"idem": idem_request, "table": table_request, "redis": redis_request}

INSERT_ORDER_1 = "INSERT INTO e2e_orders (key, amount) VALUES ($1, 4200) RETURNING id"


async def idem_request_async(conn, r, key, schema):
    async with atomic_async(conn, key, "amount=4200", schema=schema) as tx:
        if not tx.claimed:
            return tx.response.body
        body = BODY % await conn.fetchval(INSERT_ORDER_1, key)
        await tx.complete(201, body)
        return body


async def table_request_async(conn, r, key, schema):
    async with conn.transaction():
        if await conn.fetchval("INSERT INTO e2e_keys (key) VALUES ($1) ON CONFLICT DO NOTHING"
                               " RETURNING true", key) is None:
            return await conn.fetchval("SELECT body FROM e2e_keys WHERE key = $1", key)
        body = BODY % await conn.fetchval(INSERT_ORDER_1, key)
        await conn.execute("UPDATE e2e_keys SET status = 201, body = $1 WHERE key = $2", body, key)
        return body


async def redis_request_async(conn, r, key, schema):
    old = await r.set(key, b"processing", nx=True, get=True, px=TTL_MS)
    if old is not None:
        return old
    body = BODY % await conn.fetchval(INSERT_ORDER_1, key)
    await r.set(key, body, px=TTL_MS)
    return body


ASYNC_PATTERNS = {"idem": idem_request_async, "table": table_request_async,
                  "redis": redis_request_async}


def worker(args, pattern, prefix, wid, ready, go, done, leave, client_cpu):
    try:
        run_worker(args, pattern, prefix, wid, ready, go, done, leave, client_cpu)
    except BaseException:
        # Let the main process and the other workers stop waiting.
        for b in (ready, go, leave, *done.values()):
            b.abort()
        raise


def checked(pattern, key, body, first):
    """A new key's first response (kept), or a replay's: the same bytes."""
    body = bytes(body) if body is not None else None
    assert body is not None and body.startswith(b'{"order"'), (pattern, key, body)
    if key in first:
        if body != first[key]:
            raise SystemExit("e2e: %s: the replay of %s differs: %r, first %r"
                             % (pattern, key, body, first[key]))
    else:
        first[key] = body


def run_worker(args, pattern, prefix, wid, ready, go, done, leave, client_cpu):
    if args.driver == "asyncpg":
        import asyncio
        asyncio.run(run_worker_async(args, pattern, prefix, wid, ready, go, done, leave,
                                     client_cpu))
        return
    conn = psycopg.connect(args.dsn, autocommit=True)
    r = redis.Redis(port=args.redis_port) if pattern == "redis" else None
    handle = PATTERNS[pattern]
    keys = ["%s-%d-%d" % (prefix, wid, i) for i in range(args.requests)]
    first = {}
    # A warm connection: the first statements prepare and plan.
    ready.wait()
    go.wait()
    for i, phase in enumerate(PHASES):
        cpu0 = time.process_time()
        for key in keys:
            checked(pattern, key, handle(conn, r, key, args.schema), first)
        client_cpu[len(PHASES) * wid + i] = time.process_time() - cpu0
        done[phase].wait()
        go.wait()
    leave.wait()
    conn.close()
    if r is not None:
        r.close()


async def run_worker_async(args, pattern, prefix, wid, ready, go, done, leave, client_cpu):
    # One task: the barriers may block the event loop.
    import asyncpg
    import redis.asyncio
    d = psycopg.conninfo.conninfo_to_dict(args.dsn)
    conn = await asyncpg.connect(host=d.get("host"), port=int(d.get("port") or 5432),
                                 user=d.get("user"), database=d.get("dbname"))
    r = redis.asyncio.Redis(port=args.redis_port) if pattern == "redis" else None
    handle = ASYNC_PATTERNS[pattern]
    keys = ["%s-%d-%d" % (prefix, wid, i) for i in range(args.requests)]
    first = {}
    ready.wait()
    go.wait()
    for i, phase in enumerate(PHASES):
        cpu0 = time.process_time()
        for key in keys:
            checked(pattern, key, await handle(conn, r, key, args.schema), first)
        client_cpu[len(PHASES) * wid + i] = time.process_time() - cpu0
        done[phase].wait()
        go.wait()
    leave.wait()
    await conn.close()
    if r is not None:
        await r.close()


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
    like = "py-%s-%s-%%" % (args.driver, args.run)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        dup = conn.execute("SELECT count(*) FROM (SELECT key FROM e2e_orders WHERE key LIKE %s"
                           " GROUP BY key HAVING count(*) > 1) d", [like]).fetchone()[0]
        total = conn.execute("SELECT count(*) FROM e2e_orders WHERE key LIKE %s",
                             [like]).fetchone()[0]
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
    ap.add_argument("--driver", choices=("psycopg", "asyncpg"), default="psycopg")
    ap.add_argument("--setup", action="store_true")
    args = ap.parse_args()
    # keys of this run only, whatever the tables or Redis hold already
    args.run = "%x" % int(time.time() * 1000)

    if args.setup:
        setup(args.dsn)
    results = {(p, ph): [] for p in PATTERNS for ph in PHASES}
    prefixes = []
    for rnd in range(args.rounds):
        for pattern in PATTERNS:
            prefix = "py-%s-%s-%s%d" % (args.driver, args.run, pattern, rnd)
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
