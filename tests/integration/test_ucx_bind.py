"""A worker started with ``--host 127.0.0.1`` keeps its ucx:// server to that address
(issue 43, item 8): before, UCX opened its transport sockets on every device and the
listener served connections that came in on any address. Run in a network namespace
(tests/netns.py) that has a second address, 10.200.1.10, besides loopback; the peer on
the hub namespace reaches that address only."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import arena_files
from tests.netns import REPO, Topology, unavailable

pytest.importorskip("ucxx")

PROBE = """
import json, sys
from kvstore_client.errors import KVStoreError
from kvstore_client.transport import ucx
host, port = sys.argv[1], int(sys.argv[2])
p = ucx.UcxPool(host, port)
try:
    p.get(5.0, b"bind/b16/tp0of1", [bytes(16)], None)
    print(json.dumps({"served": True}))
except KVStoreError as e:
    print(json.dumps({"served": False, "error": f"{type(e).__name__}: {e}"}))
finally:
    p.close()
"""


@pytest.fixture
def topo(tmp_path: Path) -> Iterator[Topology]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    t = Topology(hosts=1, log_dir=tmp_path).create()
    try:
        yield t
    finally:
        t.destroy()
        for d in t.daemons:
            assert not d.alive(), f"{d.role} pid {d.pid} still running"
            assert not arena_files(d.pid)


def probe(ns: str, host: str, port: int) -> dict[str, object]:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", PROBE, host, str(port)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-2000:]
    result: dict[str, object] = json.loads(lines[-1])
    return result


def listeners(ns: str, pid: int) -> list[str]:
    """Local addresses (host:port) of the TCP sockets ``pid`` listens on in ``ns``."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-ltnpH"], capture_output=True, text=True, timeout=30
    )
    return [line.split()[3] for line in out.stdout.splitlines() if f"pid={pid}," in line]


def test_a_loopback_worker_serves_ucx_on_loopback_only(topo: Topology) -> None:
    ns = topo.host(0)
    w = topo.spawn(
        ns,
        "worker",
        ["--master", "127.0.0.1:1", "--host", "127.0.0.1", "--ucx-port", "0",
         "--dram-size", "64MiB", "--max-value-size", "1MiB"],
    )  # fmt: skip
    port = int(w.ready["ucx"].rsplit(":", 1)[1])
    # UCX's transport sockets: on loopback only (before: one on every device, 10.200.1.10
    # too); its connection manager is the one socket on every address (ucxx's listener).
    socks = listeners(ns, w.pid)
    assert socks, "no listening socket found for the worker"
    loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
    stray = [a for a in socks if not a.startswith(loopback) and not a.endswith(f":{port}")]
    assert not stray, f"ucx:// sockets outside 127.0.0.1: {stray} (all: {socks})"
    assert probe(ns, "127.0.0.1", port) == {"served": True}
    remote = probe(topo.hub, topo.addr(0), port)
    assert remote["served"] is False, remote
    w.stop()
