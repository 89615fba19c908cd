"""kvstore as a peer: :class:`kvstore_client.Client` against a local or existing cluster."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence

import numpy as np

from .base import ClusterSpec
from .procs import StartError

# Bytes the SSD tier adds to a block's payload: its record header (32) and LMDB's header
# on the first page of an overflow run (16). tests/unit/test_bench_layout.py checks these
# against the worker's own constants, so the bench needs no worker internals.
SSD_RECORD_HEADER = 32
SSD_PAGE_HEADER = 16


def ssd_footprint(block_bytes: int) -> int:
    """Bytes of SSD (LMDB pages) one block of ``block_bytes`` occupies."""
    page = mmap.PAGESIZE
    return -(-(SSD_RECORD_HEADER + block_bytes + SSD_PAGE_HEADER) // page) * page


class KVStoreBackend:
    """kvstore through :class:`kvstore_client.Client`; ``prefix`` is the namespace."""

    name = "kvstore"

    def __init__(
        self,
        master: str,
        prefix: str,
        description: str = "kvstore",
        transport: str | None = None,
    ) -> None:
        from kvstore_client import Client

        self.description = description
        self.pids: list[int] = []
        self.ns = prefix
        self.client = Client(master, timeout=30.0, transport=transport)
        # One I/O thread: a batch's per-worker reads run one after another.
        self.serial = Client(master, timeout=30.0, max_threads=1, transport=transport)

    def exists(self, keys: list[bytes]) -> list[bool]:
        return self.client.batch_exists(self.ns, keys) if keys else []

    def match_prefix(self, keys: list[bytes]) -> int:
        return self.client.match_prefix(self.ns, keys) if keys else 0

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        if not keys:
            return []
        c = self.client if parallel else self.serial
        return c.batch_get_into(self.ns, keys, buffers).result()

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        from kvstore_client.errors import ResourceExhausted

        if not keys:
            return 0, 0
        try:
            return sum(self.client.batch_put(self.ns, keys, values)), 0
        except ResourceExhausted:
            # Some blocks found no unpinned slot; which ones is not reported.
            present = self.client.batch_exists(self.ns, keys)
            return sum(present), len(keys) - sum(present)

    def remove(self, keys: list[bytes]) -> None:
        if keys:
            self.client.remove(self.ns, keys)

    def register(self, buf: np.ndarray) -> None:
        return None

    def unregister(self, buf: np.ndarray) -> None:
        return None

    def capacity_blocks(self, block_bytes: int) -> int | None:
        from kvstore_client.sizeclasses import blocks_that_fit

        total = 0
        for w in self.client.cluster_status().workers:
            slab = int(w.info.max_value_bytes)
            if block_bytes > slab:
                return 0
            total += blocks_that_fit(int(w.info.capacity_bytes), slab, block_bytes)
            # LMDB keeps a value in whole pages (with its header and LMDB's): a 4 KiB
            # block takes two 4 KiB pages, so count what the SSD really holds.
            total += int(w.stats.ssd_capacity_bytes) // ssd_footprint(block_bytes)
        return total

    def close(self) -> None:
        self.client.close()
        self.serial.close()


@contextlib.contextmanager
def _kvstore(spec: ClusterSpec, prefix: str, tmp: str) -> Iterator[KVStoreBackend]:
    from kvstore.cluster import LocalCluster
    from kvstore.cluster import StartError as ClusterStartError
    from kvstore.config import format_size

    if spec.master:
        desc = f"kvstore at {spec.master}, transport {spec.transport or 'auto'}"
        b = KVStoreBackend(spec.master, prefix, desc, spec.transport)
        try:
            yield b  # this run's blocks stay: they are cache entries, evicted in time
        finally:
            b.close()
        return
    cluster = LocalCluster(
        workers=0,
        dram_size=str(spec.dram_bytes),
        max_value_size=str(spec.max_value_bytes),
        log_dir=tmp,
    )
    desc = f"kvstore: {spec.workers} workers x {format_size(spec.dram_bytes)} DRAM"
    desc += f", slabs of {format_size(spec.max_value_bytes)}, transport {spec.transport or 'auto'}"
    try:
        cluster.start()
        for i in range(spec.workers):
            extra = ["--id", f"w{i}"]  # stable ids: the same ring, run after run
            if spec.ssd_size:
                extra += ["--ssd-path", os.path.join(tmp, f"ssd{i}"), "--ssd-size", spec.ssd_size]
            cluster.add_worker(*extra)
        cluster.wait_for_workers(spec.workers)
    except ClusterStartError as e:
        cluster.stop()
        raise StartError(f"kvstore cluster did not start: {e} (logs were in {tmp})") from e
    except BaseException:
        cluster.stop()
        raise
    if spec.ssd_size:
        desc += f" + {spec.ssd_size} SSD"
    try:
        b = KVStoreBackend(cluster.address, prefix, desc, spec.transport)
        b.pids = [
            d.pid for d in [*cluster.worker_procs, *([cluster.master] if cluster.master else [])]
        ]
        try:
            yield b
        finally:
            b.close()
    finally:
        cluster.stop()
