"""ucx:// versus tcp:// throughput, 1 MiB blocks, in the same run.

    python -m kvstore_bench.transfer.ucx [--total 512MiB] [--batch 16] [--rounds 3]

A real local cluster (a master and one ``kvstore worker --ucx-port 0``, started with
:class:`kvstore.cluster.LocalCluster`) serves the blocks; this process drives it through
two clients, ``Client(transport="tcp")`` and ``Client(transport="ucx")``, so the bench
measures what an engine gets (routing, batching and the worker's request core included).
Rounds alternate the transports so a neighbour's load hits both alike.
Per round and transport: PUT ``--total`` bytes of fresh blocks in batches of
``--batch`` (one call each), GET them back into preallocated buffers (checked
byte-exact once), then REMOVE them. Prints GiB/s (2**30 bytes per second of
wall time) and CPU seconds per GiB (client + worker process; steadier than GiB/s
on a shared host) for every round and the best of each; ``--json`` prints one
JSON object instead. Without ucxx only tcp:// is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.cluster import LocalCluster
from kvstore.config import format_size, parse_size
from kvstore_client import Client
from kvstore_client.transport import ucx as ucx_client

from ..peers.procs import cpu_seconds

GIB = float(1 << 30)
MIB = 1 << 20
NS = "bench/ucx/b0/tp0of1"
TIMEOUT = 30.0

Cpu = Callable[[], float]
Put = Callable[[list[bytes], list[memoryview]], list[bool]]
Get = Callable[[list[bytes], list[memoryview]], list[bool]]
Remove = Callable[[list[bytes]], int]


# ---- the cluster ----------------------------------------------------------------------


@contextlib.contextmanager
def cluster(dram: int, block: int) -> Iterator[tuple[LocalCluster, bool]]:
    """A master and one worker on 127.0.0.1 serving tcp:// and, when ucxx loads, ucx://
    (``--ucx-port 0``); yields it and whether ucx:// is served. Always stopped (by pid)."""
    ucx = ucx_client.available()
    with (
        tempfile.TemporaryDirectory(prefix="kvbench-ucx-") as logs,
        LocalCluster(
            workers=1,
            dram_size=format_size(dram),
            max_value_size=format_size(block),
            extra_worker_args=["--ucx-port", "0"] if ucx else [],
            log_dir=logs,  # the daemons' log lines would interleave with the table
        ) as c,
    ):
        yield c, ucx


def _calls(client: Client) -> tuple[Put, Get, Remove]:
    return (
        lambda h, v: client.batch_put(NS, h, v),
        lambda h, d: client.batch_get_into(NS, h, d).result(TIMEOUT),
        lambda h: client.remove(NS, h),
    )


# ---- measurement ----------------------------------------------------------------------


def _batches(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(i + size, n))


def measure(
    put: Put, get: Get, remove: Remove, total: int, block: int, batch: int, cpu: Cpu
) -> dict[str, float]:
    """One round on one transport: PUT, GET (checked), REMOVE ``total`` bytes.

    Returns GiB/s and CPU seconds per GiB moved (``cpu()``: client + worker CPU
    seconds so far) for PUT and GET; AssertionError when a block does not come back
    byte-exact or a PUT is refused.
    """
    n = max(1, total // block)
    rng = np.random.default_rng()
    data = rng.integers(0, 256, size=(n, block), dtype=np.uint8)
    keys = [os.urandom(16) for _ in range(n)]
    views = [memoryview(data[i]) for i in range(n)]
    out = np.zeros_like(data)
    dests = [memoryview(out[i]) for i in range(n)]
    c0, t0 = cpu(), time.perf_counter()
    for s in _batches(n, batch):
        stored = put(keys[s], views[s])
        assert all(stored), f"PUT refused {stored.count(False)} of {len(stored)} blocks"
    c1, t1 = cpu(), time.perf_counter()
    for s in _batches(n, batch):
        assert all(get(keys[s], dests[s])), "a block stored a moment ago missed"
    c2, t2 = cpu(), time.perf_counter()
    assert np.array_equal(data, out), "GET did not return the bytes PUT stored"
    for s in _batches(n, 1024):
        remove(keys[s])
    moved = n * block / GIB
    return {
        "put_gib_s": moved / (t1 - t0),
        "get_gib_s": moved / (t2 - t1),
        "put_cpu_s_per_gib": (c1 - c0) / moved,
        "get_cpu_s_per_gib": (c2 - c1) / moved,
    }


def run(total: int, batch: int, rounds: int, block: int = MIB) -> dict[str, Any]:
    """Start a local cluster and measure each transport ``rounds`` times, alternating.

    Returns ``{"rounds": [{round, transport, put_gib_s, get_gib_s, put_cpu_s_per_gib,
    get_cpu_s_per_gib}], "best": {transport: {the highest GiB/s, the lowest CPU s/GiB}},
    "ucx": bool, ...}``.
    """
    dram = max(2 * total, 64 * MIB) + 16 * block
    dram -= dram % block
    results: list[dict[str, Any]] = []
    with cluster(dram, block) as (c, ucx), contextlib.ExitStack() as stack:
        clients = {"tcp": stack.enter_context(Client(c.address, transport="tcp"))}
        if ucx:
            clients["ucx"] = stack.enter_context(Client(c.address, transport="ucx"))
        transports = {name: _calls(cl) for name, cl in clients.items()}
        pid = c.worker_procs[0].pid

        def cpu() -> float:
            return cpu_seconds() + cpu_seconds(pid)

        for put, get, remove in transports.values():  # warm-up: connect, fault in
            measure(put, get, remove, min(total, 16 * block), block, batch, cpu)
        for r in range(rounds):
            for name, (put, get, remove) in transports.items():
                res = measure(put, get, remove, total, block, batch, cpu)
                results.append({"round": r, "transport": name, **res})
    best: dict[str, dict[str, float]] = {}
    for row in results:
        b = best.setdefault(row["transport"], {})
        for k in ("put_gib_s", "get_gib_s"):
            b[k] = max(b.get(k, 0.0), row[k])
        for k in ("put_cpu_s_per_gib", "get_cpu_s_per_gib"):
            b[k] = min(b.get(k, float("inf")), row[k])
    return {
        "block_bytes": block,
        "batch": batch,
        "total_bytes": total,
        "rounds": results,
        "best": best,
        "ucx": "ucx" in best,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total", default="256MiB", help="bytes per round and transport")
    p.add_argument("--batch", type=int, default=16, help="blocks per frame")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    out = run(parse_size(a.total), a.batch, a.rounds)
    if a.json:
        print(json.dumps(out))
        return 0
    if not out["ucx"]:
        print("ucxx is not importable: measuring tcp:// only (pip install 'kvstore-cache[ucx]')")
    print(
        f"{'round':>5} {'transport':>9} {'put GiB/s':>10} {'get GiB/s':>10} "
        f"{'put CPU s/GiB':>14} {'get CPU s/GiB':>14}"
    )
    for row in out["rounds"]:
        print(
            f"{row['round']:>5} {row['transport']:>9} "
            f"{row['put_gib_s']:>10.3f} {row['get_gib_s']:>10.3f} "
            f"{row['put_cpu_s_per_gib']:>14.2f} {row['get_cpu_s_per_gib']:>14.2f}"
        )
    for name, b in out["best"].items():
        print(
            f"best {name}: put {b['put_gib_s']:.3f} GiB/s, get {b['get_gib_s']:.3f} GiB/s; "
            f"CPU s/GiB put {b['put_cpu_s_per_gib']:.2f}, get {b['get_cpu_s_per_gib']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
