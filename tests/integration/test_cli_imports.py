"""The daemon package never imports the bench package at start.

`kvstore bench` is an entry point (pyproject.toml, group "kvstore.commands") loaded only
when that command runs; `kvstore --help`, the daemons and the local-cluster helpers must
not pull in kvstore_bench (nor its numpy/rich/matplotlib weight) when they start.
"""

from __future__ import annotations

import subprocess
import sys


def test_help_does_not_import_the_bench_package() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvstore", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "bench" in out.stdout  # listed (lazily), ...
    imported = [ln for ln in out.stderr.splitlines() if "kvstore_bench" in ln]
    assert imported == []  # ... but not imported


def test_daemon_modules_do_not_import_the_bench_package() -> None:
    code = (
        "import sys\n"
        "import kvstore.cli, kvstore.cluster, kvstore.procs\n"
        "import kvstore.master.server, kvstore.worker.server\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'kvstore_bench')\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
