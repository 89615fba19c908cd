"""The engine bench's kvstore backing gets exactly the sweep point's memory: DRAM in its
one worker or split over its workers, or half DRAM and half SSD with ``--ssd`` (real
daemons, no engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore_bench.engine.peers import Context, make_backing
from kvstore_client import Client

BLOCK = 64 << 10


@pytest.mark.parametrize("ssd", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_kvstore_backing_holds_the_points_memory(tmp_path: Path, ssd: bool, workers: int) -> None:
    """One worker by default (one per host); ``--kvstore-workers 2`` splits the memory."""
    memory = 6 << 20
    ctx = Context(Path("/nonexistent/python"), tmp_path, memory, 32, block_bytes=BLOCK, ssd=ssd)
    if workers != 1:
        ctx.kvstore_workers = workers
    b = make_backing("kvstore", ctx)
    try:
        assert b.cluster is not None
        with Client(b.cluster.address) as c:
            running = list(c.cluster_status().workers)
        assert len(running) == ctx.kvstore_workers == workers
        dram = sum(int(w.info.capacity_bytes) for w in running)
        disk = sum(int(w.stats.ssd_capacity_bytes) for w in running)
        assert {int(w.info.max_value_bytes) for w in running} == {256 << 10}
        if ssd:
            assert dram == memory // 2 and 0 < disk <= memory // 2
            assert "SSD" in b.note
        else:
            assert dram == memory and disk == 0
        cfg = b.kv_transfer_config
        assert cfg is not None and cfg["kv_connector_extra_config"]["master"] == b.cluster.address
    finally:
        b.stop()
