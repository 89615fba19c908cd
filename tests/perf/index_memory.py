"""Heap bytes per stored block of the DRAM tier's bookkeeping, and the cost of its
per-block operations, at 1M and 10M blocks:
``python -m tests.perf.index_memory [--blocks 1M,10M] [--out bench/results]``.

It measures a worker internal (``kvstore.worker.tiers.dram.DramTier``) directly, so it
lives with the tests rather than in the benchmarks, which use only the public API.

The tier is pure bookkeeping, so no arena is needed: a DramTier sized for the blocks
is filled with N blocks of 4 KiB (reserve + commit, random 16-byte keys, one namespace).
Memory is measured two ways, around the fill only (the key buffer is allocated before):

- heap: ``tracemalloc`` traced bytes after the fill (Python objects, ``array`` buffers
  and numpy buffers alike: numpy reports its allocations to tracemalloc), divided by N;
- RSS: the growth of the process's resident set over the same fill, divided by N.

The fill runs under tracemalloc, which slows allocation; the per-operation costs are
then timed as CPU time (the machine may be shared; wall time goes to the JSON too)
with tracemalloc off, on the full tier: acquire + release of random present
keys, reserve + commit of new keys into free room, reserve + commit that each evict
the least recently used block, and exists_many of 1,000-key batches.
The previous, object-per-block index took ~490 B per block; the goal is at most 128 B.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvstore.worker.tiers.dram import DramTier
from kvstore.worker.tiers.shared import SharedIndex
from kvstore_bench import report

BLOCK = 4096
SLAB = 1 << 20
GOAL_BYTES = 128
NS = "bench/index"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def needed_bytes(n: int) -> int:
    """A generous estimate: keys, the tier, its table rebuild and the timing phases."""
    return n * 400 + (512 << 20)


def measure(n: int, ops: int, seed: int = 0, *, shared: bool = False) -> dict[str, Any]:
    """Fill a tier with ``n`` blocks and time ``ops`` of each operation (see module doc);
    ``shared``: with the same-host index attached, as a worker runs it (its entries live
    in shared memory, not the heap; its bookkeeping does)."""
    ops = max(1, min(ops, n))
    rng = np.random.default_rng(seed)
    keys = rng.bytes(16 * (n + 2 * ops))  # n to fill, ops into free room, ops evicting
    slabs = -(-(n + ops) * BLOCK // SLAB)
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    tier = DramTier(slabs * SLAB, SLAB)
    if shared:
        tier.shared = SharedIndex(tier.capacity, 0x1234, ssd=False)
    reserve, commit = tier.reserve, tier.commit
    for i in range(n):
        b = reserve(NS, keys[16 * i : 16 * i + 16], BLOCK, i)
        assert b is not None
        commit(b)
    fill_s = time.perf_counter() - t0
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    rss = rss_bytes() - rss0
    assert tier.keys == n

    picks = rng.integers(0, n, ops)
    present = [keys[16 * int(i) : 16 * int(i) + 16] for i in picks]
    acquire, release = tier.acquire, tier.release
    c0, t0 = time.process_time(), time.perf_counter()
    for k in present:
        h = acquire(NS, k)
        assert h is not None
        release(h)
    acq = time.process_time() - c0, time.perf_counter() - t0

    def put_range(lo: int, hi: int) -> tuple[float, float]:
        fresh = [keys[16 * i : 16 * i + 16] for i in range(lo, hi)]
        c0, t0 = time.process_time(), time.perf_counter()
        for i, k in enumerate(fresh):
            b = reserve(NS, k, BLOCK, i)
            assert b is not None
            commit(b)
        return time.process_time() - c0, time.perf_counter() - t0

    evictions = tier.counters.evictions
    room = put_range(n, n + ops)
    assert tier.counters.evictions == evictions, "the tier was sized to leave room"
    evict = put_range(n + ops, n + 2 * ops)
    assert tier.counters.evictions >= evictions + ops - SLAB // BLOCK  # room left by rounding

    batch = [keys[16 * int(i) : 16 * int(i) + 16] for i in rng.integers(0, n + 2 * ops, 1000)]
    rounds = max(3, min(200, ops // 1000))
    c0 = time.process_time()
    for _ in range(rounds):
        tier.exists_many(NS, batch)
    exists_s = (time.process_time() - c0) / rounds
    if tier.shared is not None:
        tier.shared.close()
    return {
        "blocks": n,
        "with_shared_index": shared,
        "block_bytes": BLOCK,
        "heap_bytes": heap,
        "heap_bytes_per_block": heap / n,
        "rss_bytes": rss,
        "rss_bytes_per_block": rss / n,
        "tier_arrays_bytes": tier.heap_bytes(),
        "fill_under_tracemalloc_s": fill_s,
        "ops": ops,
        "acquire_release_us": acq[0] / ops * 1e6,
        "reserve_commit_us": room[0] / ops * 1e6,
        "reserve_commit_evicting_us": evict[0] / ops * 1e6,
        "exists_many_1000_us": exists_s * 1e6,
        "wall_acquire_release_us": acq[1] / ops * 1e6,
        "wall_reserve_commit_us": room[1] / ops * 1e6,
        "wall_reserve_commit_evicting_us": evict[1] / ops * 1e6,
    }


def run_index_memory(
    counts: list[int], ops: int, out: str, console: Console, shared: bool = False
) -> list[dict[str, Any]]:
    """Measure each block count in turn; refuse counts the machine cannot hold."""
    rows: list[dict[str, Any]] = []
    for n in counts:
        need, avail = needed_bytes(n), available_bytes()
        if avail and need > avail:
            console.print(
                f"[yellow]skipping {n:,} blocks[/]: needs ~{need >> 20} MiB, "
                f"{avail >> 20} MiB available"
            )
            continue
        with console.status(f"filling a DRAM tier with {n:,} blocks"):
            rows.append(measure(n, ops, shared=shared))
        gc.collect()
    if not rows:
        return rows
    cols = ["blocks", "heap B/block", "RSS B/block", "acquire+release", "reserve+commit"]
    cols += ["... evicting", "exists_many x1000"]
    console.print(
        report.table(
            f"DRAM tier index memory{' with the same-host index' if shared else ''} "
            f"(goal <= {GOAL_BYTES} B/block; was ~490 B)",
            cols,
            [
                [
                    f"{r['blocks']:,}",
                    f"{r['heap_bytes_per_block']:.1f}",
                    f"{r['rss_bytes_per_block']:.1f}",
                    f"{r['acquire_release_us']:.2f} us",
                    f"{r['reserve_commit_us']:.2f} us",
                    f"{r['reserve_commit_evicting_us']:.2f} us",
                    f"{r['exists_many_1000_us']:.0f} us",
                ]
                for r in rows
            ],
        )
    )
    console.print(
        "  heap = tracemalloc traced bytes after the fill; RSS = resident set growth over "
        "the fill; per-op costs are CPU time (process_time; wall time is in the JSON), "
        "timed with tracemalloc off, on the full tier"
    )
    doc = {"command": report.command_line(), "bench": "index-memory", "results": rows}
    path = report.write_json(
        report.results_path(Path(out), "index-memory", report.stamp(), ".json"), doc
    )
    console.print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.perf.index_memory")
    p.add_argument("--blocks", default="1M,10M", help="block counts, e.g. 1M,10M or 20000")
    p.add_argument("--ops", type=int, default=200_000, help="operations timed per kind")
    p.add_argument("--out", default="bench/results")
    p.add_argument(
        "--shared", action="store_true", help="with the same-host index attached (a worker's tier)"
    )
    a = p.parse_args(argv)
    counts = [int(x.strip().replace("M", "000000")) for x in a.blocks.split(",") if x.strip()]
    run_index_memory(counts, a.ops, a.out, Console(), a.shared)


if __name__ == "__main__":
    main()
