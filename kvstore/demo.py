"""The `make run` demo and the `kvstore check` round trip."""

from __future__ import annotations

import os
import resource
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore_client import Client, block_hashes
from kvstore_client.errors import KVStoreError

from .console import make_console

NS = "demo-model/bf16/b16/tp0of1"


def check_roundtrip(master: str, size: int) -> tuple[bool, str]:
    """Put one random block, read it back byte-exact, remove it."""
    value = os.urandom(size)
    key = os.urandom(16)
    try:
        with Client(master, timeout=5.0) as c:
            if not c.workers():
                return False, f"no workers in the map of {master}"
            c.batch_put("kvstore-check", [key], [value])
            got = c.batch_get("kvstore-check", [key])[0]
            c.remove("kvstore-check", [key])
    except KVStoreError as e:
        return False, f"check failed: {e}"
    if got != value:
        return False, "check failed: the block did not round-trip"
    return True, f"ok: {size} bytes round-tripped through {master}"


def resident(rows: int, size: int) -> np.ndarray:
    """A zeroed destination whose pages are already mapped, like an engine's KV cache.
    ``np.zeros`` gets untouched pages from the kernel: the first write to each costs a
    page fault (~30x a memcpy of it), which a timed read would count as its own."""
    out = np.empty((rows, size), dtype=np.uint8)
    out.fill(0)
    return out


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _workload(master: str, blocks: int, block_size: int, console: Console) -> dict[str, float]:
    """Put a turn, put it again, match and read a longer follow-up turn, put its new
    blocks; print the table and return its figures (``get_faults``: minor page faults
    taken while the read was timed)."""
    rng = np.random.default_rng(7)
    # Two "conversations" sharing a system prompt: the second turn extends the first.
    tokens = rng.integers(0, 32000, size=(blocks + blocks // 4) * 16, dtype=np.int64)
    hashes = block_hashes(tokens, 16)
    first, extended = hashes[:blocks], hashes
    base = rng.integers(0, 256, size=block_size, dtype=np.uint8)
    values: list[np.ndarray] = []
    for h in extended:
        v = base.copy()
        v[:16] = np.frombuffer(h, dtype=np.uint8)
        values.append(v)
    gib = blocks * block_size / (1 << 30)
    with Client(master, timeout=30.0) as c:
        t0 = time.perf_counter()
        stored = c.batch_put(NS, first, [v.data for v in values[:blocks]])
        put_s = time.perf_counter() - t0
        again = c.batch_put(NS, first, [v.data for v in values[:blocks]])
        t0 = time.perf_counter()
        matched = c.match_prefix(NS, extended)
        match_s = time.perf_counter() - t0
        out = resident(len(extended), block_size)
        views = [r.data for r in out]
        f0, t0 = minor_faults(), time.perf_counter()
        hits = c.batch_get_into(NS, extended, views).result()
        get_s, get_faults = time.perf_counter() - t0, minor_faults() - f0
        exact = all(np.array_equal(out[i], values[i]) for i in range(len(extended)) if hits[i])
        new = c.batch_put(NS, extended[matched:], [v.data for v in values[matched:]])
    t = Table(title="kvstore demo: a turn, its repeat, and a longer follow-up turn")
    t.add_column("step")
    t.add_column("result", justify="right")
    t.add_row(
        "put (first turn)",
        f"{sum(stored)} blocks of {block_size >> 10} KiB, {gib / put_s:.2f} GiB/s",
    )
    t.add_row("put again (write only new)", f"{len(again) - sum(again)} of {len(again)} skipped")
    t.add_row(
        "match_prefix (follow-up turn)",
        f"{matched}/{len(extended)} blocks cached, {match_s * 1e3:.2f} ms",
    )
    t.add_row("hit rate", f"{100 * sum(hits) / len(extended):.1f}%")
    t.add_row("batch_get_into (hits)", f"{gib / get_s:.2f} GiB/s, byte-exact: {exact}")
    t.add_row("put new blocks only", f"{sum(new)} stored")
    console.print(t)
    if not exact or sum(stored) != blocks or matched != blocks:
        raise SystemExit("demo check failed")
    return {"put_gib_s": gib / put_s, "get_gib_s": gib / get_s, "get_faults": get_faults,
            "matched": matched, "hits": sum(hits)}  # fmt: skip


def run_demo(workers: int, dram_size: str, blocks: int, block_size: int, master: str | None) -> int:
    console = make_console()
    if master:
        _workload(master, blocks, block_size, console)
        return 0
    from .cluster import LocalCluster

    console.print(f"starting a local cluster: master + {workers} workers of {dram_size} ...")
    with LocalCluster(workers=workers, dram_size=dram_size, relay_stderr=True) as cluster:
        console.print(f"cluster up, master at {cluster.address}")
        _workload(cluster.address, blocks, block_size, console)
    console.print("cluster stopped")
    return 0
