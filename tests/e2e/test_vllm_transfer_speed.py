"""Measurement (no timing assertion): the vLLM connector's worker side moving one
request's blocks, staging copy vs zero copy (multi-part calls), against the client's
``batch_get_into`` / ``batch_put`` alone for the same bytes (whole 1 MiB blocks, and
the same 32 parts per block), in one run.

The layout is a 16-layer model with K/V-split paged tensors (8 KV heads x 64, fp16,
32-token blocks: 32 parts of 32 KiB per 1 MiB block) and a 2,016-token request (63
blocks, 63 MiB). Figures go to the e2e report (``KVSTORE_E2E_REPORT``)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvstore_client import Client, block_hashes  # noqa: E402
from kvstore_client.connectors.config import ConnectorConfig  # noqa: E402
from kvstore_client.connectors.naming import ModelIdentity  # noqa: E402
from kvstore_client.connectors.stats import Counters  # noqa: E402
from kvstore_client.connectors.vllm.common import (  # noqa: E402
    KVStoreConnectorMetadata,
    Setup,
    Transfer,
)
from kvstore_client.connectors.vllm.worker import WorkerSide  # noqa: E402

from .conftest import REPORT  # noqa: E402

LAYERS, NB, BLOCKS, REPS = 16, 72, 63, 3
SHAPE = (2, NB, 8, 32, 64)


def _worker(address: str, zero_copy: bool, caches: dict[str, Any]) -> WorkerSide:
    cfg = ConnectorConfig(master=address, zero_copy=zero_copy)
    setup = Setup(cfg, ModelIdentity("bench/speed", None, None), "float16", "l16-bench", 32,
                  [0], [], True, True, True, 1, 1)  # fmt: skip
    kcc = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=list(caches))]
    )
    ws = WorkerSide(setup, kcc, Counters(), (0, 1, 0, 1))
    ws.register_kv_caches(caches)
    assert ws._holder.get(wait=10) is not None
    return ws


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def test_connector_load_and_save_speed(make_cluster: Any) -> None:
    c = make_cluster(workers=2, dram_size="1GiB")
    caches = {f"l{i}": torch.randn(SHAPE).to(torch.float16) for i in range(LAYERS)}
    ids = list(range(BLOCKS))
    block_bytes = LAYERS * 2 * 8 * 32 * 64 * 2
    total = BLOCKS * block_bytes
    res: dict[str, dict[str, list[float]]] = {}
    n = 0
    for mode in ("staging", "parts"):
        ws = _worker(c.address, mode == "parts", caches)
        res[mode] = {"save": [], "load": []}
        try:
            for _ in range(REPS):
                n += 1
                hs = block_hashes(list(range(BLOCKS * 32)), 32, extra=n.to_bytes(4, "big"))
                meta = KVStoreConnectorMetadata(
                    saves=[Transfer(f"s{n}", [ids], hs, list(range(BLOCKS)))]
                )
                t0 = time.perf_counter()
                ws.start_load_kv(meta)
                ws.wait_for_save(meta)  # gathers (staging) and hands off
                assert ws.drain_saves(60)
                res[mode]["save"].append(time.perf_counter() - t0)
                load = Transfer(f"l{n}", [ids[::-1]], hs, list(range(BLOCKS)))
                t0 = time.perf_counter()
                ws.start_load_kv(KVStoreConnectorMetadata(loads=[load]))
                while not ws.done_loads()[0]:
                    time.sleep(0.0005)
                res[mode]["load"].append(time.perf_counter() - t0)
                wm = ws.take_meta()
                assert wm is not None and not wm.failed and len(wm.saved[f"s{n}"]) == BLOCKS
        finally:
            ws.shutdown()
    # The client alone: the same bytes into / out of contiguous 1 MiB buffers.
    bufs = [bytearray(block_bytes) for _ in range(BLOCKS)]
    views = [memoryview(b) for b in bufs]
    part = block_bytes // (2 * LAYERS)
    parts = [[memoryview(bytearray(part)) for _ in range(2 * LAYERS)] for _ in range(BLOCKS)]
    base: dict[str, list[float]] = {"save": [], "load": []}
    base_parts: dict[str, list[float]] = {"save": [], "load": []}
    with Client(c.address) as cl:
        for _ in range(REPS):
            n += 1
            hs = block_hashes(list(range(BLOCKS * 32)), 32, extra=n.to_bytes(4, "big"))
            t0 = time.perf_counter()
            assert all(cl.batch_put("bench/raw", hs, views))
            base["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert all(cl.batch_get_into("bench/raw", hs, views).result())
            base["load"].append(time.perf_counter() - t0)
            n += 1
            hs = block_hashes(list(range(BLOCKS * 32)), 32, extra=n.to_bytes(4, "big"))
            t0 = time.perf_counter()
            assert all(cl.batch_put_parts("bench/raw", hs, parts))
            base_parts["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert all(cl.batch_get_into_parts("bench/raw", hs, parts).result())
            base_parts["load"].append(time.perf_counter() - t0)

    def mibs(secs: list[float]) -> float:
        return total / _median(secs) / 2**20

    lines = [f"connector transfer, one request of {BLOCKS} blocks ({total >> 20} MiB, "
             f"{LAYERS * 2} parts per block), median of {REPS}, MiB/s:"]  # fmt: skip
    for op in ("load", "save"):
        raw, rawp = mibs(base[op]), mibs(base_parts[op])
        st, pa = mibs(res["staging"][op]), mibs(res["parts"][op])
        lines.append(
            f"  {op}: client alone {raw:.0f} (whole blocks), {rawp:.0f} (same parts); "
            f"connector staging {st:.0f} ({st / raw:.0%}), zero copy {pa:.0f} "
            f"({pa / raw:.0%} of whole, {pa / rawp:.0%} of parts)"
        )
    REPORT.extend(lines)
    print("\n".join(lines))
