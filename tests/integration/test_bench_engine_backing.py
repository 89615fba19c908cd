"""The engine bench's kvstore backing gets exactly the sweep point's memory: DRAM split
over its workers, or half DRAM and half SSD with ``--ssd`` (real daemons, no engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore_bench.engine.peers import Context, make_backing
from kvstore_client import Client

BLOCK = 64 << 10


@pytest.mark.parametrize("ssd", [False, True])
def test_kvstore_backing_holds_the_points_memory(tmp_path: Path, ssd: bool) -> None:
    memory = 6 << 20
    ctx = Context(Path("/nonexistent/python"), tmp_path, memory, 32, block_bytes=BLOCK, ssd=ssd)
    b = make_backing("kvstore", ctx)
    try:
        assert b.cluster is not None
        with Client(b.cluster.address) as c:
            workers = list(c.cluster_status().workers)
        assert len(workers) == 2
        dram = sum(int(w.info.capacity_bytes) for w in workers)
        disk = sum(int(w.stats.ssd_capacity_bytes) for w in workers)
        assert {int(w.info.max_value_bytes) for w in workers} == {256 << 10}
        if ssd:
            assert dram == memory // 2 and 0 < disk <= memory // 2
            assert "SSD" in b.note
        else:
            assert dram == memory and disk == 0
        cfg = b.kv_transfer_config
        assert cfg is not None and cfg["kv_connector_extra_config"]["master"] == b.cluster.address
    finally:
        b.stop()
