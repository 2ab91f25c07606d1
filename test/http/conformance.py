#!/usr/bin/env python3
"""Check one running app against doc/http.md over real HTTP.

    python3 test/http/conformance.py --url http://127.0.0.1:PORT --dsn 'CONNINFO'

The app serves the routes of test/http/README.md and writes into
conf_orders in the database of --dsn, which the runner reads with psql
(a role that may also call idem_lookup: the stack's test superuser).
Prints one "ok N - name" / "not ok N - name" line per check, then
"N passed, N failed"; exits 1 on any failure.  Standard library only.
"""

import argparse
import datetime
import email.utils
import hashlib
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid

LEASE = 30            # the routes' lease (README), seconds
RETENTION = 3600      # the routes' retention, seconds
SHORT = 64            # the server's idem.max_key_length for /short (README)
REPLAYED = "idempotent-replayed"
NOT_STORED = {
    "type": "about:blank", "title": "Response not stored", "status": 500,
    "detail": "The response to the first request with this key was larger than "
              "idem.max_body_size; it was sent then and is not replayed.",
}
# doc/http.md, "Problem bodies": every answer of the middleware itself is
# application/problem+json with the members type, title, status and detail,
# in that order, compact JSON in UTF-8, byte for byte the same from every
# stack.  The routes use the header Idempotency-Key and keys of at most
# 255 bytes.
PROBLEMS = {
    "required": (400, "Idempotency-Key required", "this request needs the Idempotency-Key header"),
    "bad_key": (400, "invalid Idempotency-Key", "the Idempotency-Key header must be an "
                "sf-string or a token of 1 to 255 printable ASCII characters"),
    "in_flight": (409, "request in flight", "a request with this key is being processed; retry later"),
    "conflict": (422, "Idempotency-Key reused", "this key was used with a different request"),
    "expired": (410, "response expired", "a request with this key was processed and completed; "
                "its response is no longer kept, and the request is not run again"),
    "unavailable": (503, "idempotency store unavailable", "the request was not processed; retry later"),
    "not_authorized": (403, "replay not authorized",
                       "the stored response to this request is not available to this caller"),
    "caller_unknown": (500, "caller unknown", "the caller's identity could not be established"),
    "two_keys": (400, "two idempotency keys",
                 "Idempotency-Key and Repeatability-Request-ID in one request: send one"),
    "incomplete": (400, "incomplete repeatable request", "Repeatability-Request-ID and "
                   "Repeatability-First-Sent go together: both are required"),
    "bad_first_sent": (400, "invalid Repeatability-First-Sent", "the Repeatability-First-Sent "
                       "header must be an IMF-fixdate (like Sun, 06 Nov 1994 08:49:37 GMT)"),
    "too_old": (412, "repeatable request too old", "the Repeatability-First-Sent time is older "
                "than this route's window of %d seconds: the request cannot be repeated "
                "safely" % RETENTION),
}
# doc/http.md, "Batches": the members of an item's answer, in order, and
# the problems of the items that have no answer of their own.
BATCH_MEMBERS = ["index", "key", "status", "body", "replayed", "duplicateOf"]
BATCH_PROBLEMS = {
    "conflict": (422, "item key reused", "this item's key was used with another item"),
    "in_flight": (409, "item in flight", "this item is being processed by another request"),
    "expired": (410, "item expired", "this item was processed once; its answer is no longer kept"),
    "failed": (500, "item failed", "this item was not processed; retry the request"),
    "unavailable": (503, "store unavailable", "this item was not processed; retry the request"),
}
# The key the server refuses (longer than its idem.max_key_length): the
# detail quotes the server's message.
REFUSED_KEY = re.compile(r"the idempotency store refuses the Idempotency-Key header's key "
                         r"\(([^()]+(?:\([^()]*\)[^()]*)*)\): a key is at most the server's "
                         r"idem\.max_key_length bytes")


def problem_body(status, title, detail):
    """The bytes of a problem+json body as doc/http.md defines them."""
    return json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail},
                      separators=(",", ":"), ensure_ascii=False).encode("utf-8")


IMF_FIXDATE = re.compile(r"^(Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d "
                         r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
                         r"\d{4} \d\d:\d\d:\d\d GMT$")


RESULT = "repeatability-result"
LIFETIME = "idempotency-key-lifetime"
LONG_AGO = "Sun, 06 Nov 1994 08:49:37 GMT"   # older than any route's window

PRINCIPAL = "conf-caller"   # the caller of every request unless a check says otherwise


def caller_scope(tenant, principal, max_length=255):
    """doc/http.md: the scope of a key claimed for principal within tenant."""
    head = "%d:%s" % (len(tenant.encode("utf-8")), tenant)
    plain = head + "=" + principal
    if all(" " <= c <= "~" for c in principal) and len(plain.encode("utf-8")) <= max_length:
        return plain
    return head + "#" + hashlib.sha256(principal.encode("utf-8")).hexdigest()


class Failed(Exception):
    pass


def check(cond, what, *detail):
    if not cond:
        raise Failed(what + ("" if not detail else ": " + " ".join(repr(d) for d in detail)))


class Reply:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers          # lower-case name -> value (last wins)
        self.body = body

    def header(self, name):
        return self.headers.get(name.lower())

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    def __repr__(self):
        return "<%d %r %r>" % (self.status, self.headers, self.body[:200])


class Runner:
    def __init__(self, url, dsn, psql, schema):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.dsn = dsn
        self.psql_bin = psql
        self.schema = schema
        self.run_id = uuid.uuid4().hex[:8]
        self.n = 0
        self.passed = 0
        self.failed = 0

    # -- HTTP and SQL ------------------------------------------------------------

    def post(self, path, key=None, body=b"{}", headers=None, raw_key=None, timeout=60,
             principal=PRINCIPAL):
        """POST as ``principal`` (X-Conf-Principal; None: no header);
        ``key`` goes as a bare token, ``raw_key`` as given (any bytes
        http.client lets through: latin-1 text).  Raises on a cut connection."""
        return self.request("POST", path, key, body, headers, raw_key, timeout, principal)

    def request(self, method, path, key=None, body=b"{}", headers=None, raw_key=None,
                timeout=60, principal=PRINCIPAL):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            if raw_key is not None:
                conn.putheader("Idempotency-Key", raw_key)
            elif key is not None:
                conn.putheader("Idempotency-Key", key)
            if principal is not None:
                conn.putheader("X-Conf-Principal", principal)
            for k, v in (headers or {}).items():
                conn.putheader(k, v)
            conn.endheaders(body)
            r = conn.getresponse()
            data = r.read()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
        finally:
            conn.close()

    def sql(self, query, **params):
        """One value from psql; params are psql variables (:'name')."""
        args = [self.psql_bin, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", self.dsn]
        for k, v in params.items():
            args += ["-v", "%s=%s" % (k, v)]
        out = subprocess.run(args, input=query + "\n", capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise Failed("psql: %s" % out.stderr.strip())
        return out.stdout.strip()

    def executions(self, key, route):
        return int(self.sql("SELECT count(*) FROM conf_orders WHERE key = :'k' AND route = :'r';",
                            k=key, r=route))

    def key_row(self, key, principal=PRINCIPAL):
        """(state, seconds until lease_until) of a key claimed for
        principal (tenant ''), from idem_lookup."""
        out = self.sql("SELECT state || ' ' || coalesce(extract(epoch FROM lease_until"
                       " - clock_timestamp())::text, '') FROM \"%s\".idem_lookup(:'k', :'s');"
                       % self.schema, k=key, s=caller_scope("", principal))
        if not out:
            return None, None
        state, _, left = out.partition(" ")
        return state, (float(left) if left else None)

    def rows(self, key):
        """Rows of the key in any scope."""
        return int(self.sql("SELECT count(*) FROM \"%s\".idem_keys WHERE key = :'k';"
                            % self.schema, k=key))

    def key(self, name):
        return "conf-%s-%s-%s" % (self.run_id, name, uuid.uuid4().hex[:8])

    # -- checks --------------------------------------------------------------------

    def run(self, name, fn):
        self.n += 1
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failed check, reported
            self.failed += 1
            print("not ok %d - %s" % (self.n, name))
            for line in ("%s: %s" % (type(exc).__name__, exc)).splitlines():
                print("#   " + line)
        else:
            self.passed += 1
            print("ok %d - %s" % (self.n, name))
        sys.stdout.flush()

    def problem(self, r, status, which=None):
        """r is a problem+json answer with this status; with which (a
        name in PROBLEMS), its body is that answer's, byte for byte."""
        check(r.status == status, "status", status, r)
        check((r.header("content-type") or "").startswith("application/problem+json"),
              "problem+json content-type", r.header("content-type"))
        if which is not None:
            want = problem_body(*PROBLEMS[which])
            check(PROBLEMS[which][0] == status, "the answer's status", which, status)
            check(r.body == want, "the %s problem body" % which, r.body, want)

    def expires(self, r):
        value = r.header("idempotency-expires")
        check(value is not None and IMF_FIXDATE.match(value), "Idempotency-Expires IMF-fixdate",
              value)
        at = email.utils.parsedate_to_datetime(value)
        now = datetime.datetime.now(datetime.timezone.utc)
        check(now < at <= now + datetime.timedelta(seconds=RETENTION + 60),
              "Idempotency-Expires within the retention", value)
        return value

    def concurrent_retries(self):
        key = self.key("conc")
        replies = [None] * 8
        errors = []

        def one(i):
            try:
                replies[i] = self.post("/plain/orders", key, headers={"X-Conf-Sleep-Ms": "300"})
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        check(not errors, "all answered", errors)
        check([r.status for r in replies] == [201] * 8, "all 201", [r.status for r in replies])
        check(len({r.body for r in replies}) == 1, "one body", [r.body for r in replies])
        first = [r for r in replies if r.header(REPLAYED) is None]
        check(len(first) == 1, "one not replayed", [r.header(REPLAYED) for r in replies])
        check(all(r.header(REPLAYED) == "true" for r in replies if r is not first[0]),
              "the others replayed")
        check(self.executions(key, "plain") == 1, "one execution")

    def replay_fidelity(self):
        key = self.key("replay")
        r1 = self.post("/plain/orders", key)
        check(r1.status == 201, "first 201", r1)
        order = r1.json()["order"]
        check(r1.header("location") == "/orders/%d" % order, "Location", r1)
        check(r1.header("etag") == '"%d"' % order, "ETag", r1)
        check(r1.header(REPLAYED) is None, "first not replayed", r1)
        e1 = self.expires(r1)
        r2 = self.post("/plain/orders", key)
        check(r2.status == 201 and r2.header(REPLAYED) == "true", "replayed 201", r2)
        for h in ("location", "etag", "content-type"):
            check(r2.header(h) == r1.header(h), h, r1.header(h), r2.header(h))
        check(r2.body == r1.body, "same body", r1.body, r2.body)
        check(self.expires(r2) == e1, "same Idempotency-Expires", e1,
              r2.header("idempotency-expires"))
        check(self.executions(key, "plain") == 1, "one execution")

    def binary_replay(self):
        key = self.key("bin")
        expected = bytes(range(256)) * 4
        r1 = self.post("/plain/binary", key)
        r2 = self.post("/plain/binary", key)
        check(r1.status == 200 and r1.body == expected, "first 200 with the bytes", r1)
        check(r2.status == 200 and r2.header(REPLAYED) == "true", "replayed 200", r2)
        check(r2.body == expected, "byte-identical replay")
        check(r2.header("content-type") == "application/octet-stream", "content-type", r2)
        self.expires(r2)
        check(self.executions(key, "binary") == 1, "one execution")

    def different_request(self):
        key = self.key("reuse")
        r1 = self.post("/plain/orders", key, body=b'{"qty":1}')
        check(r1.status == 201, "first 201", r1)
        r2 = self.post("/plain/orders", key, body=b'{"qty":2}')
        self.problem(r2, 422, "conflict")
        check(self.executions(key, "plain") == 1, "one execution")

    def missing_key(self):
        marker = self.key("nokey")
        r = self.post("/plain/orders", None, body=json.dumps({"m": marker}).encode())
        self.problem(r, 400, "required")
        check(self.sql("SELECT count(*) FROM conf_orders WHERE key IS NULL OR key = '';")
              == "0", "no execution")

    def bad_keys(self, cases, app_answers):
        """Each raw header value must get 400 and run nothing.  A control
        character may be refused by the HTTP server's parser before the app
        sees it (still 400, not problem+json); the others must come from
        the middleware."""
        for raw, marker in cases:
            r = self.post("/plain/orders", raw_key=raw)
            if app_answers:
                self.problem(r, 400, "bad_key")
            else:
                check(r.status == 400, "400 for %r" % raw, r)
            n = self.sql("SELECT count(*) FROM conf_orders WHERE strpos(key, :'m') > 0;", m=marker)
            check(n == "0", "no execution for %r" % raw, n)

    def control_characters(self):
        cases = []
        for ch in ("\x01", "\x7f", "\x1b"):
            m = self.key("ctl")
            cases.append((m + ch + "x", m))
            cases.append(('"' + m + ch + 'x"', m))
        self.bad_keys(cases, app_answers=False)

    def too_long(self):
        m = self.key("long")
        self.bad_keys([(m + "x" * (256 - len(m)), m), ('"%s"' % (m + "y" * (256 - len(m))), m)],
                      app_answers=True)
        ok = self.key("max")
        ok += "z" * (255 - len(ok))
        r = self.post("/plain/orders", ok)
        check(r.status == 201, "a 255-byte key is a key", r)
        check(self.executions(ok, "plain") == 1, "one execution of the 255-byte key")

    def server_limit(self):
        """/short: the server takes keys of at most SHORT bytes.  A longer
        key, within the middleware's 255, is refused by the server (22001):
        400 as a malformed key, not 503, and nothing runs or is claimed."""
        m = self.key("short")
        long_key = m + "x" * (SHORT + 1 - len(m))
        for _ in range(2):                  # a retry gets the same answer
            r = self.post("/short/orders", long_key)
            self.problem(r, 400)
            body = r.json()
            check(list(body) == ["type", "title", "status", "detail"], "problem members", r.body)
            m = REFUSED_KEY.fullmatch(body["detail"])
            check(m is not None and body["title"] == "invalid Idempotency-Key", "refused key body", r.body)
            check(r.body == problem_body(400, body["title"], body["detail"]), "compact JSON", r.body)
            check(r.header("retry-after") is None, "no Retry-After", r)
        check(self.executions(long_key, "short") == 0, "no execution")
        check(self.key_row(long_key)[0] is None, "nothing claimed")
        ok = self.key("short")
        ok += "z" * (SHORT - len(ok))
        r = self.post("/short/orders", ok)
        check(r.status == 201, "a key of the server's limit is a key", r)
        check(self.executions(ok, "short") == 1, "one execution")

    def bad_sf_string(self):
        cases = []
        for raw in ('"%s', '"%s\\q"', '"%s"x', '"%s\\"', '"%s" "y"', '"%s\xe9"', '%s\xe9'):
            m = self.key("sf")
            cases.append((raw % m, m))
        self.bad_keys(cases, app_answers=True)
        for raw in ('""', ""):
            r = self.post("/plain/orders", raw_key=raw)
            self.problem(r, 400, "bad_key")

    def in_flight_409(self):
        key = self.key("nowait")
        first = {}

        def run():
            try:
                first["r"] = self.post("/nowait/orders", key, headers={"X-Conf-Sleep-Ms": "5000"})
            except Exception as exc:  # noqa: BLE001
                first["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        try:
            for _ in range(600):
                if self.executions(key, "nowait") == 1:
                    break
                time.sleep(0.05)
            check(self.executions(key, "nowait") == 1, "the first request's handler runs")
            state, before = self.key_row(key)
            check(state == "PROCESSING", "the key is in flight", state)
            r = self.post("/nowait/orders", key)
            state, after = self.key_row(key)
        finally:
            t.join(120)
        self.problem(r, 409, "in_flight")
        check(state == "PROCESSING", "still in flight after the 409", state)
        ra = r.header("retry-after")
        check(ra is not None and ra.isdigit(), "Retry-After in seconds", ra)
        ra = int(ra)
        check(1 <= ra <= LEASE, "Retry-After between 1 and the lease", ra)
        # between the seconds left of the lease after and before the request
        check(int(after) <= ra <= int(before) + 2, "Retry-After from lease_until",
              ra, before, after)
        check("r" in first and first["r"].status == 201, "the first request 201", first)
        again = self.post("/nowait/orders", key)
        check(again.status == 201 and again.header(REPLAYED) == "true", "then replayed", again)
        check(again.body == first["r"].body, "the first body")
        check(self.executions(key, "nowait") == 1, "one execution")

    def store_down(self):
        key = self.key("down")
        r = self.post("/down/orders", key)
        self.problem(r, 503, "unavailable")
        ra = r.header("retry-after")
        check(ra is not None and ra.isdigit() and int(ra) >= 1, "Retry-After", ra)
        check(self.executions(key, "down") == 0, "no execution")

    def header_forms(self):
        key = self.key("forms")
        r1 = self.post("/plain/orders", raw_key='"%s"' % key)
        check(r1.status == 201 and r1.header(REPLAYED) is None, "sf-string executes", r1)
        r2 = self.post("/plain/orders", raw_key=key)
        check(r2.status == 201 and r2.header(REPLAYED) == "true", "bare token replays", r2)
        check(r2.body == r1.body, "same body")
        check(self.executions(key, "plain") == 1, "one execution, the key unquoted")
        # escapes: "a\"b\\c" is the key a"b\c
        esc = self.key("esc")
        parsed = 'q"' + esc + "\\x"
        r3 = self.post("/plain/orders", raw_key='"q\\"' + esc + '\\\\x"')
        check(r3.status == 201 and r3.header(REPLAYED) is None, "escaped sf-string executes", r3)
        r4 = self.post("/plain/orders", raw_key=parsed)
        check(r4.status == 201 and r4.header(REPLAYED) == "true", "its bare form replays", r4)
        check(self.executions(parsed, "plain") == 1, "one execution, the key unescaped")
        # optional whitespace around the value is not part of the key
        r5 = self.post("/plain/orders", raw_key='  "%s"  ' % key)
        check(r5.status == 201 and r5.header(REPLAYED) == "true", "OWS ignored", r5)

    def killed(self, route, key):
        try:
            r = self.post("/%s/orders" % route, key, headers={"X-Conf-Kill": "after-write"})
        except (http.client.HTTPException, OSError):
            return
        raise Failed("an answer from a killed worker: %r" % r)

    def kill_plain(self):
        key = self.key("killplain")
        self.killed("plain", key)
        check(self.executions(key, "plain") == 1, "the insert is committed")
        state, _ = self.key_row(key)
        check(state == "PROCESSING", "the claim stays in flight", state)
        r = self.post("/plain/orders", key)
        self.problem(r, 409, "in_flight")
        check(1 <= int(r.header("retry-after")) <= LEASE, "Retry-After", r)
        check(self.executions(key, "plain") == 1, "no second execution inside the lease")

    def kill_tx(self):
        key = self.key("killtx")
        self.killed("tx", key)
        check(self.executions(key, "tx") == 0, "the insert is rolled back")
        r1 = self.post("/tx/orders", key)
        check(r1.status == 201 and r1.header(REPLAYED) is None, "the retry executes", r1)
        check(self.executions(key, "tx") == 1, "one execution")
        order = r1.json()["order"]
        check(r1.header("location") == "/orders/%d" % order, "Location", r1)
        self.expires(r1)
        for _ in range(2):
            r = self.post("/tx/orders", key)
            check(r.status == 201 and r.header(REPLAYED) == "true", "later retries replay", r)
            check(r.body == r1.body, "the same body")
        check(self.executions(key, "tx") == 1, "still one execution")

    def tx_concurrent(self):
        key = self.key("txconc")
        replies = []

        def one():
            replies.append(self.post("/tx/orders", key, headers={"X-Conf-Sleep-Ms": "300"}))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        check([r.status for r in replies] == [201] * 4, "all 201", replies)
        check(sum(r.header(REPLAYED) is None for r in replies) == 1, "one executed", replies)
        check(len({r.body for r in replies}) == 1, "one body")
        check(self.executions(key, "tx") == 1, "one execution")

    def max_body_size(self):
        size = parse_size(self.sql("SHOW idem.max_body_size;"))
        key = self.key("max")
        r1 = self.post("/plain/big", key, headers={"X-Conf-Size": str(size)})
        check(r1.status == 201 and len(r1.body) == size and r1.body == b"x" * size,
              "first 201 with %d bytes" % size, r1.status, len(r1.body))
        r2 = self.post("/plain/big", key, headers={"X-Conf-Size": str(size)})
        check(r2.status == 201 and r2.header(REPLAYED) == "true", "replayed", r2.status,
              r2.headers)
        check(r2.body == r1.body, "the same bytes", len(r2.body))
        check(r2.header("content-type") == "application/octet-stream", "content-type", r2.headers)
        check(self.executions(key, "big") == 1, "one execution")

    def over_max_body_size(self):
        size = parse_size(self.sql("SHOW idem.max_body_size;")) + 1
        key = self.key("over")
        r1 = self.post("/plain/big", key, headers={"X-Conf-Size": str(size)})
        check(r1.status == 201 and r1.body == b"x" * size, "first 201 with %d bytes" % size,
              r1.status, len(r1.body))
        r2 = self.post("/plain/big", key, headers={"X-Conf-Size": str(size)})
        self.problem(r2, 500)
        check(r2.json() == NOT_STORED, "the Response not stored body", r2.body)
        check(r2.header(REPLAYED) == "true", "replayed", r2.headers)
        state, _ = self.key_row(key)
        check(state == "DONE", "the key is completed", state)
        check(self.executions(key, "big") == 1, "one execution")

    def policy(self):
        for path, route, code, stored in (("/plain/status/503", "status", 503, False),
                                          ("/plain/status/429", "status", 429, False),
                                          ("/plain/status/500", "status", 500, False),
                                          ("/plain/status/401", "status", 401, False),
                                          ("/plain/status/403", "status", 403, False),
                                          ("/plain/status/407", "status", 407, False),
                                          ("/plain/status/408", "status", 408, False),
                                          ("/plain/status/425", "status", 425, False),
                                          ("/store5xx/status/401", "store5xx", 401, True),
                                          ("/plain/status/404", "status", 404, True),
                                          ("/plain/status/200", "status", 200, True),
                                          ("/store5xx/status/500", "store5xx", 500, True),
                                          ("/store5xx/status/429", "store5xx", 429, True)):
            key = self.key("policy%d" % code)
            r1 = self.post(path, key)
            check(r1.status == code and r1.json() == {"status": code}, path + " first", r1)
            r2 = self.post(path, key)
            check(r2.status == code and r2.json() == {"status": code}, path + " retry", r2)
            if stored:
                check(r2.header(REPLAYED) == "true", path + " replayed", r2)
                check(self.executions(key, route) == 1, path + " one execution")
            else:
                check(r2.header(REPLAYED) is None, path + " run again", r2)
                check(self.executions(key, route) == 2, path + " two executions")
                check(self.key_row(key)[0] is None, path + " released")

    def two_principals(self):
        key = self.key("callers")
        a1 = self.post("/plain/orders", key, principal="alice")
        b1 = self.post("/plain/orders", key, principal="bob")
        check(a1.status == b1.status == 201, "both 201", a1, b1)
        check(a1.header(REPLAYED) is None and b1.header(REPLAYED) is None, "neither replayed",
              a1, b1)
        check(self.executions(key, "plain") == 2, "two executions")
        check(a1.body != b1.body, "two orders", a1.body, b1.body)
        a2 = self.post("/plain/orders", key, principal="alice")
        b2 = self.post("/plain/orders", key, principal="bob")
        check(a2.header(REPLAYED) == "true" and a2.body == a1.body, "alice gets hers", a2)
        check(b2.header(REPLAYED) == "true" and b2.body == b1.body, "bob gets his", b2)
        check(self.executions(key, "plain") == 2, "still two executions")
        for who in ("alice", "bob"):
            state, _ = self.key_row(key, who)
            check(state == "DONE", "the key in the scope of %s" % who, state)
        check(self.key_row(key, "carol")[0] is None, "nothing in another caller's scope")

    def authorize(self):
        key = self.key("authz")
        r1 = self.post("/authz/orders", key)
        check(r1.status == 201, "first 201", r1)
        order = str(r1.json()["order"]).encode()
        r2 = self.post("/authz/orders", key, headers={"X-Conf-Revoked": "1"})
        self.problem(r2, 403, "not_authorized")
        check(r2.header(REPLAYED) is None, "not a replay", r2)
        check(order not in r2.body and r2.header("location") is None, "the body not sent", r2)
        check(self.executions(key, "authz") == 1, "one execution")
        r3 = self.post("/authz/orders", key)
        check(r3.status == 201 and r3.header(REPLAYED) == "true" and r3.body == r1.body,
              "allowed again: replayed", r3)
        check(self.executions(key, "authz") == 1, "still one execution")

    def bad_principal(self):
        for how in ("raise", "none"):
            key = self.key("who" + how)
            r = self.post("/plain/orders", key, principal=how)
            self.problem(r, 500, "caller_unknown")
            check(self.executions(key, "plain") == 0, "no execution (%s)" % how)
            check(self.rows(key) == 0, "nothing claimed (%s)" % how)
            r = self.post("/tx/orders", key, principal=how)
            self.problem(r, 500, "caller_unknown")
            check(self.executions(key, "tx") == 0, "no execution on /tx (%s)" % how)
            check(self.rows(key) == 0, "nothing claimed on /tx (%s)" % how)

    def no_decision(self):
        """The app built a middleware with neither a principal hook nor the
        shared opt-out at start and reports the error it got."""
        r = self.request("GET", "/no-decision", body=b"", principal=None)
        check(r.status == 200, "GET /no-decision", r)
        error = r.json().get("error")
        check(isinstance(error, str) and "principal" in error and "shared" in error,
              "construction refused, naming the options", error)

    # -- OASIS Repeatable Requests and the advertised window (issue #44, 5-6) ---------

    def oasis(self, path, rid, first_sent, body=b"{}", **headers):
        h = {"Repeatability-Request-ID": rid, "Repeatability-First-Sent": first_sent}
        h.update(headers)
        return self.post(path, None, body=body, headers=h)

    def oasis_accepted(self):
        for path, route in (("/plain/orders", "plain"), ("/tx/orders", "tx")):
            rid = self.key("oasis")
            sent = email.utils.formatdate(usegmt=True)
            r1 = self.oasis(path, rid, sent)
            check(r1.status == 201, path + " first 201", r1)
            check(r1.header(RESULT) == "accepted", path + " accepted", r1)
            check(r1.header(REPLAYED) is None, path + " not replayed", r1)
            r2 = self.oasis(path, rid, sent)
            check(r2.status == 201 and r2.body == r1.body and r2.header(REPLAYED) == "true",
                  path + " the retry replayed", r2)
            check(r2.header(RESULT) == "accepted", path + " the replay accepted", r2)
            check(self.executions(rid, route) == 1, path + " one execution")
            check(self.key_row(rid)[0] == "DONE", path + " the id is the caller's key")

    def oasis_rejected(self):
        rid = self.key("oasis-other")
        sent = email.utils.formatdate(usegmt=True)
        check(self.oasis("/plain/orders", rid, sent).header(RESULT) == "accepted", "first")
        r = self.oasis("/plain/orders", rid, sent, body=b'{"other": 1}')
        self.problem(r, 422, "conflict")
        check(r.header(RESULT) == "rejected", "rejected", r)
        check(self.executions(rid, "plain") == 1, "one execution")

    def oasis_too_old(self):
        for path, route in (("/plain/orders", "plain"), ("/tx/orders", "tx")):
            rid = self.key("oasis-old")
            r = self.oasis(path, rid, LONG_AGO)
            self.problem(r, 412, "too_old")
            check(r.header(RESULT) == "rejected", path + " rejected", r)
            check(self.executions(rid, route) == 0, path + " no execution")
            check(self.rows(rid) == 0, path + " nothing claimed")

    def oasis_malformed(self):
        rid = self.key("oasis-bad")
        now = email.utils.formatdate(usegmt=True)
        for what, which, headers in (
                ("a date that is no IMF-fixdate", "bad_first_sent",
                 {"Repeatability-Request-ID": rid, "Repeatability-First-Sent": "yesterday"}),
                ("an RFC 850 date", "bad_first_sent",
                 {"Repeatability-Request-ID": rid,
                  "Repeatability-First-Sent": "Sunday, 06-Nov-94 08:49:37 GMT"}),
                ("a Request-ID without First-Sent", "incomplete", {"Repeatability-Request-ID": rid}),
                ("a First-Sent without Request-ID", "incomplete", {"Repeatability-First-Sent": now}),
                ("a Request-ID and an Idempotency-Key", "two_keys",
                 {"Repeatability-Request-ID": rid, "Repeatability-First-Sent": now,
                  "Idempotency-Key": rid})):
            r = self.post("/plain/orders", None, headers=headers)
            self.problem(r, 400, which)
            check(r.header(RESULT) == "rejected", what + ": rejected", r)
        check(self.executions(rid, "plain") == 0, "no execution")
        check(self.rows(rid) == 0, "nothing claimed")
        # a request without the OASIS headers carries no Repeatability-Result
        key = self.key("no-oasis")
        for r in (self.post("/plain/orders", key), self.post("/plain/orders", key),
                  self.post("/plain/orders", raw_key="")):
            check(r.header(RESULT) is None, "no Repeatability-Result", r)

    def lifetime_on(self):
        key = self.key("life")
        answers = [self.post("/advertise/orders", key), self.post("/advertise/orders", key),
                   self.post("/advertise/orders", key, body=b"[]"),
                   self.post("/advertise/orders", raw_key=""),
                   self.request("GET", "/advertise/orders", body=b""),
                   self.oasis("/advertise/orders", self.key("life-old"), LONG_AGO)]
        check([r.status for r in answers] == [201, 201, 422, 400, 200, 412], "statuses",
              answers)
        for r in answers:
            check(r.header(LIFETIME) == str(RETENTION), "Idempotency-Key-Lifetime", r)
        check(self.executions(key, "advertise") == 1, "one execution")

    def remember_expired(self):
        """/remember: retention 1 s, remember 1 hour.  Once the response's
        retention is over (the server's expires_at, polled), the retry is
        410 problem+json; the handler does not run again and the key's row
        stays (a tombstone, EXPIRED)."""
        key = self.key("remember")
        r1 = self.post("/remember/orders", key)
        check(r1.status == 201 and r1.header(REPLAYED) is None, "first 201, not replayed", r1)
        check(r1.json().get("order") is not None, "the handler's answer", r1)
        check(self.executions(key, "remember") == 1, "one execution")
        over = ""
        for _ in range(300):
            over = self.sql("SELECT coalesce(bool_and(expires_at < now()), false) FROM"
                            " \"%s\".idem_keys WHERE key = :'k';" % self.schema, k=key)
            if over == "t":
                break
            time.sleep(0.1)
        check(over == "t", "the retention is over", over)
        for _ in range(2):                  # a second retry: the same answer
            r = self.post("/remember/orders", key)
            self.problem(r, 410, "expired")
            check(r.header(REPLAYED) is None, "not a replay", r)
            check(r.json().get("status") == 410, "problem status 410", r.body)
            check(str(r1.json()["order"]).encode() not in r.body, "not the stored body", r)
        check(self.executions(key, "remember") == 1, "still one execution")
        check(self.sql("SELECT count(*) FROM conf_orders WHERE key = :'k';", k=key) == "1",
              "one business row")
        check(self.rows(key) == 1, "the key's row is still there")
        check(self.key_row(key)[0] == "EXPIRED", "the key is EXPIRED", self.key_row(key))

    def batch(self):
        """/batch/orders (doc/http.md, "Batches"): items under <key>:<index>
        or their own keys, the envelope replayed whole; the envelope's
        members, the items' problems and fingerprints as the doc has them."""
        key = self.key("batch")
        body = json.dumps({"items": [{"sku": "a"}, {"sku": "b"}, {"sku": "c"}]}).encode()
        r = self.post("/batch/orders", key, body=body, headers={"X-Conf-Fail-Item": "1"})
        check(r.status == 503, "an item failed: 503, not stored", r)
        check(r.header("retry-after") == "1", "the 503 has Retry-After: 1", r)
        check(list(r.json()) == ["results"], 'the envelope is {"results": [...]}', r)
        res = r.json()["results"]
        check([list(i) for i in res] == [BATCH_MEMBERS] * 3,
              "each item's members, in order: %s" % ", ".join(BATCH_MEMBERS), r)
        check([i["status"] for i in res] == [201, 500, 201], "per-item statuses", r)
        check([(i["index"], i["key"], i["duplicateOf"]) for i in res]
              == [(n, "%s:%d" % (key, n), None) for n in range(3)], "indexes, derived keys", r)
        check(json.dumps(res[1]["body"], separators=(",", ":")).encode()
              == problem_body(*BATCH_PROBLEMS["failed"]), "the failed item's problem", r)
        runs = lambda k: self.executions(k, "batch")  # noqa: E731
        check([runs("%s:%d" % (key, i)) for i in range(3)] == [1, 0, 1], "items 0 and 2 ran once")
        r2 = self.post("/batch/orders", key, body=body)
        check(r2.status == 200, "the retry answers", r2)
        res = r2.json()["results"]
        check([i["status"] for i in res] == [201, 201, 201], "every item done", r2)
        check([i["replayed"] for i in res] == [True, False, True], "items 0 and 2 replayed", r2)
        check([runs("%s:%d" % (key, i)) for i in range(3)] == [1, 1, 1], "each item once")
        r3 = self.post("/batch/orders", key, body=body)
        check(r3.status == 200 and r3.header("idempotent-replayed") == "true", "the envelope replayed", r3)
        check(r3.body == r2.body, "the envelope replayed whole, byte for byte", r3, r2)
        check([runs("%s:%d" % (key, i)) for i in range(3)] == [1, 1, 1], "nothing ran again")
        # Keys given per item: a repeated one runs once; another envelope replays it.
        own_a, own_b = self.key("item-a"), self.key("item-b")
        items = [{"key": own_a, "sku": "x"}, {"key": own_a, "sku": "x"}, {"key": own_b, "sku": "y"}]
        r4 = self.post("/batch/orders", self.key("batch2"), body=json.dumps({"items": items}).encode())
        check(r4.status == 200, "answered", r4)
        res = r4.json()["results"]
        check([i["duplicateOf"] for i in res] == [None, 0, None], "the repeated key is a duplicate of item 0", r4)
        check([i["key"] for i in res] == [own_a, own_a, own_b], "the items' own keys", r4)
        check(res[1]["body"] == res[0]["body"], "with item 0's answer", r4)
        check(runs(own_a) == 1 and runs(own_b) == 1, "each own key ran once")
        r5 = self.post("/batch/orders", self.key("batch3"),
                       body=json.dumps({"items": [{"key": own_a, "sku": "x"}]}).encode())
        check(r5.status == 200 and r5.json()["results"][0]["replayed"] is True,
              "another envelope replays the item", r5)
        check(r5.json()["results"][0]["body"] == res[0]["body"], "its stored answer", r5)
        r6 = self.post("/batch/orders", self.key("batch4"),
                       body=json.dumps({"items": [{"key": own_a, "sku": "z"}]}).encode())
        check(r6.json()["results"][0]["status"] == 422, "the item's key with another item: 422", r6)
        check(json.dumps(r6.json()["results"][0]["body"], separators=(",", ":")).encode()
              == problem_body(*BATCH_PROBLEMS["conflict"]), "the 422 item's problem", r6)
        check(runs(own_a) == 1, "still once")
        # The fingerprint: the lower-case hex SHA-256 of the whole item as
        # JSON.stringify writes it (members in the order sent, no spaces,
        # 2.50 as 2.5, UTF-8); the server stores its SHA-256 in idem.keys.
        own_c = self.key("item-c")
        sent = '{"items": [{"key": "%s", "sku": "w", "qty": 2.50, "note": "caf\u00e9 \u00e0"}]}' % own_c
        r7 = self.post("/batch/orders", self.key("batch5"), body=sent.encode())
        check(r7.status == 200 and r7.json()["results"][0]["status"] == 201, "answered", r7)
        fp = hashlib.sha256(('{"key":"%s","sku":"w","qty":2.5,"note":"caf\u00e9 \u00e0"}'
                             % own_c).encode("utf-8")).hexdigest()
        stored = self.sql("SELECT encode(fingerprint, 'hex') FROM idem.keys WHERE key = :'k';",
                          k=own_c)
        check(stored == hashlib.sha256(fp.encode()).hexdigest(),
              "the item's fingerprint is the SHA-256 of its JSON", stored, fp)

    def lifetime_off(self):
        key = self.key("nolife")
        for r in (self.post("/plain/orders", key), self.post("/plain/orders", key),
                  self.request("GET", "/plain/orders", body=b"")):
            check(r.status in (200, 201), "answered", r)
            check(r.header(LIFETIME) is None, "no Idempotency-Key-Lifetime", r)


def parse_size(text):
    """A SHOW of a byte setting ("1MB", "8kB", "100B") in bytes."""
    m = re.match(r"^(\d+)\s*(B|kB|MB|GB|TB)?$", text.strip())
    if not m:
        raise Failed("cannot read idem.max_body_size %r" % text)
    unit = {None: 1, "B": 1, "kB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
    return int(m.group(1)) * unit[m.group(2)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the app, http://HOST:PORT")
    p.add_argument("--dsn", required=True, help="libpq conninfo of the app's database")
    p.add_argument("--psql", default=os.environ.get("PSQL", "psql"), help="psql to run")
    p.add_argument("--schema", default="public", help="the schema of the idem functions")
    a = p.parse_args(argv)
    r = Runner(a.url, a.dsn, a.psql, a.schema)
    checks = [
        ("8 concurrent retries: one execution, all 201, the others replayed", r.concurrent_retries),
        ("replay: status, Location, ETag, content-type, body, Idempotency-Expires",
         r.replay_fidelity),
        ("replay of a binary body byte for byte", r.binary_replay),
        ("422 for the key with another body", r.different_request),
        ("400 without the key", r.missing_key),
        ("400 for control characters in the key", r.control_characters),
        ("400 for a key over 255 bytes; 255 bytes is a key", r.too_long),
        ("400 for a bad sf-string or an empty key", r.bad_sf_string),
        ("400 on /short for a key over the server's idem.max_key_length (64), none claimed",
         r.server_limit),
        ("409 on /nowait with Retry-After from the lease", r.in_flight_409),
        ("503 with Retry-After on /down and no execution", r.store_down),
        ("sf-string and bare token are one key", r.header_forms),
        ("kill mid-handler on /plain: the row stays, the retry gets 409", r.kill_plain),
        ("kill mid-handler on /tx: no row, the retry executes once, then replays", r.kill_tx),
        ("4 concurrent retries on /tx: one execution", r.tx_concurrent),
        ("a body of idem.max_body_size is stored and replayed", r.max_body_size),
        ("a body one byte larger: 201, then 500 Response not stored", r.over_max_body_size),
        ("replay policy: 5xx, 429, 401, 403, 407, 408, 425 run again, 404 replays, "
         "/store5xx replays", r.policy),
        ("two callers, one key and body: two executions, each replayed to its own caller",
         r.two_principals),
        ("/authz: a replay the authorize hook denies is 403 without the body", r.authorize),
        ("a principal hook that raises or returns no string: 500, nothing run or claimed",
         r.bad_principal),
        ("a middleware with no principal hook and no shared opt-out is refused",
         r.no_decision),
        ("OASIS Request-ID and First-Sent: accepted, the retry replayed and accepted",
         r.oasis_accepted),
        ("OASIS: the same Request-ID with another body is 422, rejected", r.oasis_rejected),
        ("OASIS: a First-Sent older than the window is 412, rejected, nothing run or claimed",
         r.oasis_too_old),
        ("OASIS: a malformed or incomplete request is 400, rejected; none without the headers",
         r.oasis_malformed),
        ("/advertise: Idempotency-Key-Lifetime on every response of the route",
         r.lifetime_on),
        ("/plain: no Idempotency-Key-Lifetime when not advertised", r.lifetime_off),
        ("/batch: items under <key>:<index> or their own keys; a failed item runs again on the "
         "retry, the done ones replayed; the envelope then replayed whole", r.batch),
        ("/remember (retention 1 s, remember 1 hour): after the retention the retry is 410 "
         "problem+json, not run again, the key's row kept", r.remember_expired),
    ]
    for name, fn in checks:
        r.run(name, fn)
    print("%d passed, %d failed" % (r.passed, r.failed))
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
