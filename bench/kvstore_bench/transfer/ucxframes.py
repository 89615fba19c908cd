"""ucx:// frames alone, for A/B runs of the packed path (wire.FLAG_PACKED): one real
`kvstore worker --ucx-port 0`, one ``UcxPool`` to it (no Client routing, so a batch is
one frame), PUT of fresh keys and GET into fixed buffers of ``batch`` x ``block`` per
frame. Prints one JSON line of GiB/s per (op, batch). Alternate two trees' runs to
compare them (docs/UCX.md: the bounded staging of issue 41)::

    python -m kvstore_bench.transfer.ucxframes --batches 32,1024 --frames 150,8
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import click
import xxhash

from kvstore.cluster import LocalCluster
from kvstore.config import parse_size
from kvstore_client import Client
from kvstore_client.transport import ucx

NS = b"bench/ucxframes/b16/tp0of1"


def measure(pool: ucx.UcxPool, block: int, batch: int, frames: int, tag: int) -> dict[str, float]:
    """GiB/s of ``frames`` PUT frames of fresh keys, then as many GET frames."""
    value = os.urandom(block)
    sums = [xxhash.xxh3_64_intdigest(value)] * batch

    def keys(t: int) -> list[bytes]:
        return [t.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(batch)]

    t0 = time.perf_counter()
    for f in range(frames):
        status = pool.put(120.0, NS, keys(tag + f), [value] * batch, sums)
        if status != bytes(batch):
            raise click.ClickException(f"PUT answered {status[:8]!r}...: the worker is full")
    put = frames * batch * block / (time.perf_counter() - t0) / 2**30
    bufs = [memoryview(bytearray(block)) for _ in range(batch)]
    t0 = time.perf_counter()
    for _ in range(frames):
        if not all(pool.get(120.0, NS, keys(tag), bufs).found):
            raise click.ClickException("a stored block was missed")
    get = frames * batch * block / (time.perf_counter() - t0) / 2**30
    for f in range(frames):
        pool.remove(120.0, NS, keys(tag + f))
    return {f"put x{batch}": round(put, 3), f"get x{batch}": round(get, 3)}


@click.command()
@click.option("--block", default="64KiB", show_default=True)
@click.option("--batches", default="32,1024", show_default=True)
@click.option("--frames", default="150,8", show_default=True, help="per batch size")
@click.option("--dram-size", default="1536MiB", show_default=True)
def main(block: str, batches: str, frames: str, dram_size: str) -> None:
    size = parse_size(block)
    sizes, counts = [int(b) for b in batches.split(",")], [int(f) for f in frames.split(",")]
    if len(sizes) != len(counts):
        raise click.BadParameter("one --frames count per batch size")
    pairs = list(zip(sizes, counts, strict=True))
    cluster = LocalCluster(
        workers=1,
        dram_size=dram_size,
        max_value_size="1MiB",
        extra_worker_args=["--ucx-port", "0"],
        stderr=subprocess.DEVNULL,
    ).start()
    try:
        with Client(cluster.address, transport="tcp") as c:
            url = ucx.find_ucx_url(c.workers()[0].endpoints)
        pool = ucx.UcxPool(*ucx.parse_ucx_url(url))
        try:
            out: dict[str, float] = {}
            for i, (batch, n) in enumerate(pairs):
                out.update(measure(pool, size, batch, n, tag=i << 32))
        finally:
            pool.close()
        print(json.dumps(out), flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
