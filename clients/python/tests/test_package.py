"""pyproject.toml builds a wheel with the package and its metadata."""

import os
import shutil
import subprocess
import sys
import zipfile

import idem_pg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_builds_offline(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    out = tmp_path / "dist"
    code = ("from setuptools import build_meta as b; import sys;"
            " print(b.build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = out / done.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    for mod in ("__init__", "guard", "aio", "atomic", "errors", "asgi", "wsgi", "_http", "_common"):
        assert "idem_pg/%s.py" % mod in names
    meta = zipfile.ZipFile(wheel).read("idem_pg-%s.dist-info/METADATA" % idem_pg.__version__)
    assert b"Name: idem-pg" in meta and b"Requires-Dist: psycopg" in meta


def test_public_names():
    for name in idem_pg.__all__:
        assert hasattr(idem_pg, name), name
    assert issubclass(idem_pg.Timeout, idem_pg.Unavailable)
    assert [c.sqlstate for c in (idem_pg.FingerprintMismatch, idem_pg.TokenSuperseded,
                                 idem_pg.NoLiveClaim, idem_pg.AlreadyCompleted)] == \
        ["ID001", "ID002", "ID003", "ID004"]
