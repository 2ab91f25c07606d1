"""Fixtures: the test cluster (IDEM_TEST_DSN, set by test.sh), a DSN where
no server listens, app servers as real processes or threads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
import psycopg
import pytest

from idem_pg._common import text

from drivers import ASYNC_DRIVERS

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")

DSN = os.environ.get("IDEM_TEST_DSN", "")
DOWN_DSN = os.environ.get("IDEM_TEST_DOWN_DSN", "")
if not DSN or not DOWN_DSN:
    raise RuntimeError("run the tests with clients/python/test.sh "
                       "(it sets IDEM_TEST_DSN and IDEM_TEST_DOWN_DSN)")


def new_key(prefix: str = "k") -> str:
    return "%s-%s" % (prefix, uuid.uuid4().hex[:12])


def lookup(conn, key, scope=""):
    """The stored row of a key as a dict (operator view), or None."""
    row = conn.execute(
        "SELECT state, token, status, lease_until, expires_at, body_size"
        " FROM public.idem_lookup(%s::text, %s::text)", [key, scope], binary=True).fetchone()
    if row is None:
        return None
    return dict(zip(("state", "token", "status", "lease_until", "expires_at",
                     "body_size"), (text(row[0]),) + tuple(row[1:])))


def setting(conn, name):
    """SHOW name, as str."""
    return text(conn.execute("SHOW " + name).fetchone()[0])


def wait_for(predicate, timeout=30.0, step=0.02, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("timed out waiting for %s" % what)


@pytest.fixture(params=ASYNC_DRIVERS)
def adriver(request):
    """The async tests run once with psycopg and once with asyncpg
    (tests/drivers.py)."""
    return request.param


@pytest.fixture(scope="session")
def dsn():
    return DSN


@pytest.fixture(scope="session")
def down_dsn():
    return DOWN_DSN


@pytest.fixture(scope="session", autouse=True)
def schema_setup():
    with psycopg.connect(DSN, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS http_calls ("
                  " id bigserial PRIMARY KEY, app text, tenant text, key text,"
                  " path text, at timestamptz DEFAULT clock_timestamp())")
        c.execute("CREATE TABLE IF NOT EXISTS stock (sku text PRIMARY KEY, qty int NOT NULL)")
        c.execute("CREATE TABLE IF NOT EXISTS orders (key text PRIMARY KEY, sku text, qty int)")
    yield


@pytest.fixture
def db():
    conn = psycopg.connect(DSN, autocommit=True)
    yield conn
    conn.close()


@pytest.fixture
def future_schema(db):
    """A schema whose idem_begin plays a server newer than the client: it
    answers the state 'TOMBSTONED', which no idem version has (seven
    parameters: no remember).  Dropped after the test."""
    schema = "idem_future_%d" % os.getpid()
    db.execute("DROP SCHEMA IF EXISTS %s CASCADE" % schema)
    db.execute("CREATE SCHEMA %s" % schema)
    db.execute("CREATE FUNCTION %s.idem_begin(text, text, interval DEFAULT NULL,"
               " interval DEFAULT NULL, text DEFAULT '', boolean DEFAULT true,"
               " interval DEFAULT NULL) RETURNS SETOF idem.begin_result"
               " LANGUAGE sql AS $$ SELECT false, 'TOMBSTONED', NULL::bigint, 200,"
               " pg_catalog.decode('6f6b', 'hex'), NULL::timestamptz,"
               " now() + interval '1 day', NULL::text, NULL::bytea $$" % schema)
    yield schema
    db.execute("DROP SCHEMA %s CASCADE" % schema)


@pytest.fixture
def expired_schema(db):
    """A schema whose idem_begin plays a server with tombstones: eight
    parameters, the last ``remember``, and every call answered EXPIRED
    (claimed false, status 201, body and token NULL).  Each call records
    its key and remember in the schema's table ``calls``.  Dropped after
    the test."""
    schema = "idem_expired_%d" % os.getpid()
    db.execute("DROP SCHEMA IF EXISTS %s CASCADE" % schema)
    db.execute("CREATE SCHEMA %s" % schema)
    db.execute("CREATE TABLE %s.calls (id bigserial PRIMARY KEY, key text,"
               " remember interval)" % schema)
    db.execute("CREATE FUNCTION %s.idem_begin(key text, fingerprint text,"
               " lease interval DEFAULT NULL, retention interval DEFAULT NULL,"
               " scope text DEFAULT '', wait boolean DEFAULT true,"
               " wait_for interval DEFAULT NULL, remember interval DEFAULT NULL)"
               " RETURNS SETOF idem.begin_result LANGUAGE plpgsql AS $$ BEGIN"
               " INSERT INTO %s.calls (key, remember)"
               " VALUES (idem_begin.key, idem_begin.remember);"
               " RETURN QUERY SELECT false, 'EXPIRED'::text, NULL::bigint, 201, NULL::bytea,"
               " NULL::timestamptz, now() + interval '1 day', NULL::text, NULL::bytea;"
               " END $$" % (schema, schema))
    yield schema
    db.execute("DROP SCHEMA %s CASCADE" % schema)


def remembered(conn, schema, key):
    """The remember of each call of the expired_schema's idem_begin for key,
    in seconds (None: the argument was not sent, or sent as NULL)."""
    rows = conn.execute("SELECT extract(epoch FROM remember)::float8 FROM %s.calls"
                        " WHERE key = %%s ORDER BY id" % schema, [key],
                        binary=True).fetchall()
    return [r[0] for r in rows]


def calls(conn, key=None, app=None):
    q, args = "SELECT count(*) FROM http_calls WHERE true", []
    if key is not None:
        q += " AND key = %s"
        args.append(key)
    if app is not None:
        q += " AND app = %s"
        args.append(app)
    return conn.execute(q, args).fetchone()[0]


# -- app servers -----------------------------------------------------------------


def listening_socket() -> socket.socket:
    """A TCP socket listening on a free port of 127.0.0.1."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _record_pid(pid: int) -> None:
    path = os.environ.get("IDEM_TEST_PIDFILE")
    if path:
        with open(path, "a") as f:
            f.write("%d\n" % pid)


class UvicornServer:
    """tests/apps/asgi_app.py under uvicorn, a real server process."""

    def __init__(self, lease: float = 30.0, driver: str = "psycopg"):
        self.lease = lease
        self.driver = driver
        self.proc = None
        self.port = None

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self) -> "UvicornServer":
        # The listening socket is bound here, on a port the kernel picks,
        # and handed to uvicorn (--fd): no other server can take the port
        # between the choice and uvicorn's start.
        sock = listening_socket()
        self.port = sock.getsockname()[1]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([SRC, HERE])
        env["IDEM_TEST_LEASE"] = str(self.lease)
        env["IDEM_TEST_DRIVER"] = self.driver
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        with sock:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "apps.asgi_app:app",
                 "--fd", str(sock.fileno()), "--log-level", "warning"],
                env=env, cwd=HERE, pass_fds=(sock.fileno(),))
        _record_pid(self.proc.pid)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError("uvicorn exited with %s" % self.proc.returncode)
            try:
                return httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:          # not listening yet, or slow to answer
                return False
        wait_for(ready, timeout=60, step=0.1, what="uvicorn to answer")
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, requests in progress see their connection cut."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class WerkzeugServer:
    """tests/apps/wsgi_app.py (Flask) under werkzeug's threaded server."""

    def __init__(self):
        from werkzeug.serving import make_server
        from apps.wsgi_app import app
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.port = self.server.port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self) -> "WerkzeugServer":
        self.thread.start()

        def ready():
            try:
                return httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:          # a timeout included
                return False
        wait_for(ready, timeout=60, step=0.1, what="werkzeug to answer")
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(10)


@pytest.fixture(scope="session")
def asgi_server():
    server = UvicornServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def asgi_asyncpg_server():
    server = UvicornServer(driver="asyncpg").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def wsgi_server():
    server = WerkzeugServer().start()
    yield server
    server.stop()


@pytest.fixture(params=["asgi", "asgi_asyncpg", "wsgi"])
def server(request):
    """Each HTTP test runs against the FastAPI/Starlette app under uvicorn
    (its guards on psycopg, then on asyncpg) and against the Flask app
    under werkzeug."""
    return request.getfixturevalue(request.param + "_server")
