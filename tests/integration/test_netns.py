"""Multi-host behaviour on network namespaces (see tests/netns.py): three worker
hosts, the master and the client on a hub. A silent partition of one host costs
its blocks as misses within the client's deadline, never a hang; the master drops
the host after its TTL; once the link heals the worker is back in the map, with
its blocks. Skips, saying why, when not root or when ``ip netns`` is not allowed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import arena_files
from tests.netns import HUB_ADDR, RemoteClient, Topology, unavailable

TIMEOUT = 2.0  # the client's deadline per call
TTL = "2s"
N = 300
SIZE = 8 * 1024


@pytest.fixture
def topo(tmp_path: Path) -> Iterator[Topology]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    t = Topology(hosts=3, log_dir=tmp_path).create()
    try:
        yield t
    finally:
        t.destroy()
        for d in t.daemons:
            assert not d.alive(), f"{d.role} pid {d.pid} still running"
            assert not arena_files(d.pid), f"arena of pid {d.pid} left in /dev/shm"


def wait_for(what: str, cond: Callable[[], bool], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def workers(c: RemoteClient) -> list[str]:
    ids: list[str] = c.call({"op": "workers"})["ids"]
    return ids


def test_partitioned_worker_costs_misses_then_rejoins(topo: Topology) -> None:
    master = topo.spawn(
        topo.hub, "master", ["--host", HUB_ADDR, "--port", "0", "--worker-ttl", TTL]
    )
    ids = []
    for i in range(topo.hosts):
        w = topo.spawn(
            topo.host(i),
            "worker",
            [
                *("--master", master.address, "--host", topo.addr(i), "--id", f"host{i}"),
                *("--dram-size", "64MiB", "--max-value-size", "1MiB"),
            ],
        )
        ids.append(w.ready["id"])
    assert all(w.ready["tcp"].startswith("tcp://10.200.1.") for w in topo.daemons[1:])
    c = topo.client(master.address, TIMEOUT)
    wait_for("3 workers in the client's map", lambda: workers(c) == sorted(ids), 30)
    blocks: dict[str, Any] = {"salt": "netns", "n": N, "size": SIZE}
    assert c.call({"op": "put", **blocks})["stored"] == N
    before = c.call({"op": "get", **blocks})
    assert all(before["hit"]) and before["wrong"] == 0

    topo.cut(0)
    # Right away: the cut host's blocks are misses, the others hits, within the deadline.
    got = c.call({"op": "get", **blocks}, deadline=4 * TIMEOUT + 10)
    assert got["secs"] < TIMEOUT + 1.5, f"a get took {got['secs']:.2f}s across a partition"
    hits = sum(got["hit"])
    assert 0 < hits < N and got["wrong"] == 0
    # Within the TTL the master drops the silent host and the client's map follows.
    dropped = wait_for("the cut host to leave the map", lambda: "host0" not in workers(c), 30)
    assert workers(c) == sorted(set(ids) - {"host0"})
    ex = c.call({"op": "exists", **blocks})
    assert sum(ex["present"]) == hits and ex["secs"] < TIMEOUT, "routed to live hosts only"

    topo.heal(0)
    rejoined = wait_for("the healed host to rejoin", lambda: workers(c) == sorted(ids), 90)
    after = c.call({"op": "get", **blocks})
    assert all(after["hit"]) and after["wrong"] == 0, "the host kept its blocks"
    print(
        f"\npartition: get {got['secs']:.2f}s with {N - hits} misses; "
        f"dropped after {dropped:.1f}s; rejoined {rejoined:.1f}s after the heal"
    )
