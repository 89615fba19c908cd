"""`kvstore bench store --tier ssd`: the SSD tier's write and read GiB/s next to the raw
sequential speed of the same disk, measured in the same run.

The raw figures come from dd (write with conv=fdatasync, read back) on a file in the
same directory the worker's LMDB lives in. The store figures come from one worker whose
DRAM tier is far smaller than the data, so writes are bound by demotion to SSD and reads
of the older blocks are served from LMDB. Cold reads drop the page cache first (root
only; otherwise the table says "warm").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.cluster import LocalCluster
from kvstore_client import Client, block_hashes

GiB = float(1 << 30)


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_disk(directory: str, total: int) -> dict[str, float]:
    """dd write (fdatasync) and read GiB/s of ``total`` bytes in ``directory``."""
    path = os.path.join(directory, "raw.bin")
    mib = max(1, total >> 20)
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"],
        check=True, capture_output=True,
    )  # fmt: skip
    write = mib / 1024 / (time.perf_counter() - t0)
    cold = drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    read = mib / 1024 / (time.perf_counter() - t0)
    os.unlink(path)
    return {"write_gib_s": write, "read_gib_s": read, "cold": float(cold)}


def store_tier(directory: str, total: int, block: int, dram: str) -> dict[str, float]:
    """Write ``total`` bytes through a small DRAM tier into LMDB, then read the SSD part."""
    n = total // block
    hashes = block_hashes(np.arange(n * 16, dtype=np.int64), 16)
    payload = np.random.default_rng(1).integers(0, 256, size=block, dtype=np.uint8)
    ssd = os.path.join(directory, "ssd")
    with (
        LocalCluster(
            workers=1,
            dram_size=dram,
            max_value_size=str(block),
            extra_worker_args=["--ssd-path", ssd, "--ssd-size", str(total * 2), "--id", "t0"],
            stderr=subprocess.DEVNULL,
        ) as cluster,
        Client(cluster.address, timeout=60, transport="tcp") as c,
    ):
        batch = max(1, (16 << 20) // block)
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            part = hashes[s : s + batch]
            c.batch_put("tierbench", part, [payload.data] * len(part))
        write = total / GiB / (time.perf_counter() - t0)
        dram_blocks = _parse(dram) // block
        on_ssd = hashes[: max(0, n - 2 * dram_blocks)]  # the oldest blocks were demoted
        cold = drop_caches()
        out = np.empty((batch, block), dtype=np.uint8)
        t0 = time.perf_counter()
        hits = 0
        for s in range(0, len(on_ssd), batch):
            part = on_ssd[s : s + batch]
            got = c.batch_get_into("tierbench", part, [r.data for r in out[: len(part)]])
            hits += sum(got.result())
        read = len(on_ssd) * block / GiB / (time.perf_counter() - t0)
    return {
        "write_gib_s": write,
        "read_gib_s": read,
        "ssd_blocks_read": float(len(on_ssd)),
        "hits": float(hits),
        "cold": float(cold),
    }


def _parse(size: str) -> int:
    from kvstore.config import parse_size

    return parse_size(size)


def run_tier(
    ssd_dir: str | None, total: int, block: int, dram: str, out: str, console: Console
) -> dict[str, Any]:
    """Measure both, print a table, write JSON under ``out``; returns the results."""
    base = tempfile.mkdtemp(prefix="kvstore-tierbench-", dir=ssd_dir)
    try:
        raw = raw_disk(base, total)
        st = store_tier(base, total, block, dram)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
    t = Table(title=f"SSD tier vs raw disk ({total >> 20} MiB, {block >> 10} KiB blocks, {base})")
    for col in ("", "write GiB/s", "read GiB/s", "read cache"):
        t.add_column(col, justify="right")
    t.add_row("raw disk (dd)", f"{raw['write_gib_s']:.2f}", f"{raw['read_gib_s']:.2f}",
              "cold" if raw["cold"] else "warm")  # fmt: skip
    t.add_row("kvstore SSD tier", f"{st['write_gib_s']:.2f}", f"{st['read_gib_s']:.2f}",
              "cold" if st["cold"] else "warm")  # fmt: skip
    t.add_row("ratio", f"{st['write_gib_s'] / raw['write_gib_s']:.2f}",
              f"{st['read_gib_s'] / raw['read_gib_s']:.2f}", "")  # fmt: skip
    console.print(t)
    if st["hits"] < st["ssd_blocks_read"]:
        console.print(f"[yellow]{st['ssd_blocks_read'] - st['hits']:.0f} SSD reads missed")
    result = {"raw": raw, "store": st, "total_bytes": total, "block_bytes": block}
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / f"tier-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"results: {path}")
    return result
