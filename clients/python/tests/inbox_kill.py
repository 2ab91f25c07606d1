"""The inbox's broker kill test (clients/python/inbox_kill.sh starts the
broker and runs ``drive``).

    inbox_kill.py drive BROKER ADDR DSN KILLS
    inbox_kill.py consume BROKER ADDR DSN QUEUE      (the consumer process)

The driver publishes messages (ids m-0, m-1, ...) to a queue of its own,
then starts a consumer process and SIGKILLs it, KILLS times, at one of
three points chosen at random: between its handlers and its COMMIT, and
between its COMMIT and its acks (the consumer stops there, with
probability IDEM_INBOX_PAUSE_P, and says so on stdout:
IDEM_INBOX_PAUSE_AT names the point), or after a random time.  It keeps
a backlog of messages published.  The handler inserts one row per
message into inbox_effects, which has no unique constraint, and raises
for about one message in 30 (that message is not acked and must come
back).  Then one consumer runs to the end of the queue, and the driver
checks that every message's effect happened exactly once and that every
message was acked, and prints

    ok - BROKER: N kills (A before commit, B before ack, C at random), M messages,
         0 duplicated effects, 0 lost, 0 not acked, F handler failures redelivered
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid

import psycopg

import idem_pg
from idem_pg.inbox import Message, process_batch

BATCH = 10
HERE = os.path.dirname(os.path.abspath(__file__))


# -- brokers -------------------------------------------------------------------------


class Rabbit:
    def __init__(self, addr: str, queue: str):
        import pika
        self.pika = pika
        self.conn = pika.BlockingConnection(pika.URLParameters(addr))
        self.ch = self.conn.channel()
        self.queue = queue
        self.ch.queue_declare(queue, durable=False)

    def publish(self, ids):
        for i in ids:
            self.ch.basic_publish("", self.queue, b"payload " + i.encode(),
                                  self.pika.BasicProperties(message_id=i))

    def fetch(self, timeout: float):
        """Up to BATCH messages: (Message, delivery tag)."""
        self.ch.basic_qos(prefetch_count=BATCH)
        out = []
        for method, props, body in self.ch.consume(self.queue, inactivity_timeout=timeout):
            if method is None:
                break
            out.append(Message(props.message_id, method.delivery_tag))
            if len(out) >= BATCH:
                break
        return out

    def ack(self, m: Message):
        self.ch.basic_ack(m.body)

    def nack(self, m: Message):
        self.ch.basic_nack(m.body, requeue=True)

    def left(self) -> int:
        """Messages in the queue, not acked (after the consumers closed)."""
        return self.ch.queue_declare(self.queue, passive=True).method.message_count

    def close(self):
        try:
            self.ch.cancel()
        except Exception:  # noqa: BLE001
            pass
        self.conn.close()


class RedisStream:
    GROUP = "workers"

    def __init__(self, addr: str, queue: str):
        import redis
        host, port = addr.rsplit(":", 1)
        self.r = redis.Redis(host=host, port=int(port))
        self.queue = queue
        self.name = "c-%d" % os.getpid()
        self.stream_ids = {}
        try:
            self.r.xgroup_create(queue, self.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def publish(self, ids):
        p = self.r.pipeline()
        for i in ids:
            p.xadd(self.queue, {"id": i})
        p.execute()

    def fetch(self, timeout: float):
        # first the pending messages of dead consumers (and this one's
        # failed ones), then new ones
        got = self.r.xautoclaim(self.queue, self.GROUP, self.name, min_idle_time=0,
                                start_id="0-0", count=BATCH)
        entries = got[1]
        if not entries:
            res = self.r.xreadgroup(self.GROUP, self.name, {self.queue: ">"}, count=BATCH,
                                    block=max(1, int(timeout * 1000)))
            entries = res[0][1] if res else []
        return [Message(fields[b"id"].decode(), sid) for sid, fields in entries if fields]

    def ack(self, m: Message):
        self.r.xack(self.queue, self.GROUP, m.body)

    def nack(self, m: Message):
        pass        # left pending: XAUTOCLAIM hands it out again

    def left(self) -> int:
        pending = self.r.xpending(self.queue, self.GROUP)["pending"]
        info = [g for g in self.r.xinfo_groups(self.queue)
                if g["name"] in (self.GROUP, self.GROUP.encode())][0]
        lag = info.get("lag") or 0
        return pending + lag

    def close(self):
        self.r.close()


def broker(kind: str, addr: str, queue: str):
    return Rabbit(addr, queue) if kind == "rabbitmq" else RedisStream(addr, queue)


# -- the consumer ----------------------------------------------------------------------


def pause(point: str) -> None:
    if os.environ.get("IDEM_INBOX_PAUSE_AT") == point and \
            random.random() < float(os.environ.get("IDEM_INBOX_PAUSE_P", "0")):
        print("pause " + point, flush=True)
        time.sleep(60)


def consume(kind: str, addr: str, dsn: str, queue: str) -> int:
    """Consume until the queue stays empty for IDEM_INBOX_IDLE seconds (or
    forever, until killed)."""
    idle = float(os.environ.get("IDEM_INBOX_IDLE", "0"))
    b = broker(kind, addr, queue)
    conn = psycopg.connect(dsn)
    quiet_since = time.monotonic()
    print("ready", flush=True)

    def handle(conn, m: Message):
        conn.execute("INSERT INTO inbox_effects (queue, msg_id) VALUES (%s, %s)",
                     [queue, m.id])
        if random.random() < 1 / 30:
            raise RuntimeError("handler failed for " + m.id)

    while True:
        msgs = b.fetch(0.2)
        if not msgs:
            if idle and time.monotonic() - quiet_since > idle and b.left() == 0:
                b.close()
                return 0
            continue
        quiet_since = time.monotonic()
        deliveries = process_batch(conn, queue, msgs, handle,
                                   before_commit=lambda: pause("before_commit"))
        pause("before_ack")
        for d in deliveries:
            if d.ack:
                b.ack(d.message)
            else:
                b.nack(d.message)
                if d.error is not None:
                    print("failed %s" % d.message.id, flush=True)


# -- the driver ------------------------------------------------------------------------


def drive(kind: str, addr: str, dsn: str, kills: int) -> int:
    queue = "inbox-%s-%s" % (kind, uuid.uuid4().hex[:8])
    db = psycopg.connect(dsn, autocommit=True)
    db.execute("CREATE TABLE IF NOT EXISTS inbox_effects (queue text, msg_id text)")
    b = broker(kind, addr, queue)
    published = 0

    def top_up():
        nonlocal published
        done = db.execute("SELECT count(DISTINCT msg_id) FROM inbox_effects WHERE queue = %s",
                          [queue]).fetchone()[0]
        if published - done < 60:
            b.publish(["m-%d" % n for n in range(published, published + 60)])
            published += 60

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(HERE),
                                                                    "src"), HERE]))
    cmd = [sys.executable, os.path.abspath(__file__), "consume", kind, addr, dsn, queue]
    counts = {"before_commit": 0, "before_ack": 0, "random": 0}
    failures = set()
    start = time.monotonic()

    def run(extra_env, on_line=None, limit=None):
        """The consumer process; on_line(line) -> True kills it."""
        p = subprocess.Popen(cmd, env=dict(env, **extra_env), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        killed = False
        deadline = None if limit is None else time.monotonic() + limit
        try:
            buf = ""
            while True:
                timeout = 0.05 if deadline is None else max(0.0, deadline - time.monotonic())
                r, _, _ = select.select([p.stdout], [], [], min(timeout, 0.05))
                if r:
                    line = p.stdout.readline()
                    if not line:
                        break
                    line = line.strip()
                    if line.startswith("failed "):
                        failures.add(line.split()[1])
                    if line == "ready" and limit is not None:
                        deadline = time.monotonic() + limit
                    if on_line is not None and on_line(line):
                        p.send_signal(signal.SIGKILL)
                        killed = True
                        break
                    buf = line
                if deadline is not None and time.monotonic() >= deadline:
                    p.send_signal(signal.SIGKILL)
                    killed = True
                    break
                if p.poll() is not None and not r:
                    break
        finally:
            if p.poll() is None and not killed:
                p.send_signal(signal.SIGKILL)
            rest, err = p.communicate()
            for line in rest.splitlines():
                if line.startswith("failed "):
                    failures.add(line.split()[1])
        return killed, p.returncode, err

    for _ in range(kills):
        top_up()
        mode = random.choice(["before_commit", "before_ack", "random"])
        if mode == "random":
            killed, rc, err = run({}, limit=random.uniform(0.02, 0.4))
        else:
            killed, rc, err = run({"IDEM_INBOX_PAUSE_AT": mode, "IDEM_INBOX_PAUSE_P": "0.5"},
                                  on_line=lambda line: line == "pause " + mode, limit=20.0)
        if not killed:
            print("not ok - %s: the consumer exited %s before its kill:\n%s"
                  % (kind, rc, err[-2000:]))
            return 1
        counts[mode] += 1
    # the last consumer runs to the end of the queue
    killed, rc, err = run({"IDEM_INBOX_IDLE": "1.0"}, limit=60.0)
    if killed or rc != 0:
        print("not ok - %s: the last consumer %s:\n%s"
              % (kind, "did not finish in 60 s" if killed else "exited %s" % rc, err[-2000:]))
        return 1
    rows = dict(db.execute("SELECT msg_id, count(*) FROM inbox_effects WHERE queue = %s"
                           " GROUP BY msg_id", [queue]).fetchall())
    ids = ["m-%d" % n for n in range(published)]
    dup = sum(1 for i in ids if rows.get(i, 0) > 1)
    lost = sum(1 for i in ids if rows.get(i, 0) == 0)
    stray = len(set(rows) - set(ids))
    left = b.left()
    stored = db.execute("SELECT count(*) FROM idem.keys WHERE scope = %s AND status IS NOT NULL",
                        [queue]).fetchone()[0] if _has_keys_table(db) else published
    b.close()
    took = time.monotonic() - start
    line = ("%s: %d kills (%d before commit, %d before ack, %d at random), %d messages, "
            "%d duplicated effects, %d lost, %d not acked, %d handler failures redelivered, "
            "%.1f s" % (kind, sum(counts.values()), counts["before_commit"],
                        counts["before_ack"], counts["random"], published, dup, lost, left,
                        len(failures), took))
    ok = dup == 0 and lost == 0 and left == 0 and stray == 0 and stored == published
    if stored != published:
        line += ", %d keys stored" % stored
    print(("ok - " if ok else "not ok - ") + line)
    return 0 if ok else 1


def _has_keys_table(db) -> bool:
    return db.execute("SELECT to_regclass('idem.keys') IS NOT NULL").fetchone()[0]


def main(argv) -> int:
    if argv[1] == "drive":
        return drive(argv[2], argv[3], argv[4], int(argv[5]))
    if argv[1] == "consume":
        return consume(argv[2], argv[3], argv[4], argv[5])
    raise SystemExit("usage: inbox_kill.py drive|consume ...")


if __name__ == "__main__":
    assert idem_pg.inbox is not None
    sys.exit(main(sys.argv))
