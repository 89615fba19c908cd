"""The vLLM connector's worker side without an engine, against a real cluster: blocks
go between the paged KV tensors and the store through the multi-part calls (no
staging buffer), in the same stored bytes as the staging path (a block written by
one path reads with the other), and a finished request's blocks are released only
once the writes reading them are done."""

from __future__ import annotations

import threading
import time
import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvstore_client import Client, block_hashes  # noqa: E402
from kvstore_client.connectors import blockcopy as bc  # noqa: E402
from kvstore_client.connectors.config import ConnectorConfig  # noqa: E402
from kvstore_client.connectors.naming import ModelIdentity  # noqa: E402
from kvstore_client.connectors.stats import Counters  # noqa: E402
from kvstore_client.connectors.vllm.common import (  # noqa: E402
    KVStoreConnectorMetadata,
    Setup,
    Transfer,
)
from kvstore_client.connectors.vllm.worker import WorkerSide  # noqa: E402
from kvstore_client.transport import shm  # noqa: E402

NB = 16
SHAPE = (2, NB, 4, 32, 64)  # K/V split, as vLLM's CPU backend: 64 KiB per layer block


@pytest.mark.parametrize("split", [False, True])
def test_parts_are_the_staging_bytes(split: bool) -> None:
    a = torch.randn((2, NB, 3, 5) if split else (NB, 2, 3, 5))
    b = torch.randn((NB, 7), dtype=torch.float64)
    la, lb = bc.describe(a, NB, 0), bc.describe(b, NB, 0)
    assert la.flat is not None and lb.flat is not None
    staging = torch.empty((2, la.nbytes + lb.nbytes), dtype=torch.uint8)
    lb.offset = la.nbytes
    src = [9, 2]
    bc.HostMover().gather([la, lb], [src], staging)
    for row, blk in enumerate(src):
        parts = bc.value_views([la, lb], [src], row)
        assert len(parts) == (3 if split else 2)
        assert b"".join(parts) == staging[row].numpy().tobytes()
        for p in parts:
            p[:] = bytes(len(p))  # writable views of the cache itself
        assert not (a[:, blk] if split else a[blk]).any() and not b[blk].any()


def test_a_block_that_is_not_one_run_falls_back_with_a_reason() -> None:
    t = torch.randn((4, 3, NB)).permute(2, 0, 1)  # blocks interleaved in memory
    layer = bc.describe(t, NB, 0)
    assert layer.flat is None and "not one run of memory" in layer.why_not


def _worker(address: str, zero_copy: bool) -> tuple[WorkerSide, list[Any]]:
    cfg = ConnectorConfig(master=address, zero_copy=zero_copy)
    setup = Setup(cfg, ModelIdentity("test/zero-copy", None, None), "float32", "l2-test", 32,
                  [0], [], True, True, True, 1, 1)  # fmt: skip
    group = SimpleNamespace(layer_names=["l0", "l1"])
    kcc = SimpleNamespace(num_blocks=NB, kv_cache_groups=[group])
    ws = WorkerSide(setup, kcc, Counters(), (0, 1, 0, 1))
    caches = [torch.randn(SHAPE), torch.randn(SHAPE)]
    ws.register_kv_caches({"l0": caches[0], "l1": caches[1]})
    assert ws._holder.get(wait=10) is not None
    assert ws._zero_copy is zero_copy
    return ws, caches


def _save(ws: WorkerSide, rid: str, ids: list[int], hashes: list[bytes]) -> None:
    meta = KVStoreConnectorMetadata(saves=[Transfer(rid, [ids], hashes, list(range(len(ids))))])
    ws.start_load_kv(meta)
    ws.save_kv_layer("l0", meta)
    ws.wait_for_save(meta)


def _load(ws: WorkerSide, rid: str, ids: list[int], hashes: list[bytes]) -> None:
    ws.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer(rid, [ids], hashes, [0, 1])]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, failed = ws.done_loads()
        if rid in done:
            assert not failed
            return
        time.sleep(0.005)
    raise AssertionError("load did not finish")


def _block(caches: list[Any], b: int) -> bytes:
    return b"".join(c[kv, b].numpy().tobytes() for c in caches for kv in (0, 1))


@pytest.mark.parametrize("writer_zero_copy", [True, False])
def test_zero_copy_and_staging_share_the_stored_bytes(
    make_cluster: Any, writer_zero_copy: bool
) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    w, wc = _worker(c.address, writer_zero_copy)
    r, rc = _worker(c.address, not writer_zero_copy)
    try:
        hs = block_hashes(list(range(64)), 32, extra=bytes([writer_zero_copy]))
        _save(w, "a", [3, 5], hs)
        assert w.drain_saves(10)
        assert w.take_meta().saved == {"a": [0, 1]}  # type: ignore[union-attr]
        with Client(c.address) as cl:  # the stored value: layer after layer, K then V
            assert cl.batch_get(w.ns, hs) == [_block(wc, 3), _block(wc, 5)]
        _load(r, "b", [7, 0], hs)
        assert _block(rc, 7) == _block(wc, 3) and _block(rc, 0) == _block(wc, 5)
    finally:
        w.shutdown()
        r.shutdown()


def test_no_staging_in_steady_state(make_cluster: Any) -> None:
    """Zero copy: no staging buffer is made, and Python allocates far less than the
    bytes moved (tracemalloc) for a save and a load of 8 blocks (1 MiB)."""
    c = make_cluster(workers=2, dram_size="64MiB")
    ws, _ = _worker(c.address, True)
    try:
        for turn in range(3):
            hs = block_hashes(list(range(8 * 32)), 32, extra=bytes([turn]))
            ids = list(range(8))
            if turn == 2:
                tracemalloc.start()
            _save(ws, f"s{turn}", ids, hs)
            assert ws.drain_saves(10)
            ws.start_load_kv(
                KVStoreConnectorMetadata(loads=[Transfer(f"l{turn}", [ids[::-1]], hs, ids)])
            )
            while not ws.done_loads()[0]:
                time.sleep(0.002)
            if turn == 2:
                _, peak = tracemalloc.get_traced_memory()
                kept = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(True, shm.__file__)]
                )
                tracemalloc.stop()
                # A thread's first parts read out of the arena makes that thread's
                # bounce buffer (1 MiB, kept for its later reads): the executor may run
                # this turn on a thread the first two did not use. What stays allocated
                # in the transport after the turn is that buffer; the rest is per-call.
                bounce = sum(t.size for t in kept.traces)
                assert peak - bounce < 256 << 10, (
                    f"{peak} bytes allocated for 2 MiB moved ({bounce} kept as bounce buffers)"
                )
        assert ws._rows == {}  # zero copy: no staging rows at all
        wm = ws.take_meta()
        assert wm is not None and wm.saved and wm.load_samples
    finally:
        ws.shutdown()


def test_finished_request_blocks_are_held_until_its_writes_are_done(make_cluster: Any) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    ws, _ = _worker(c.address, True)
    gate = threading.Event()
    try:
        ws._save_pool.submit(gate.wait, 10)  # the writer is busy
        _save(ws, "r", [1, 2], block_hashes(list(range(64)), 32, extra=b"held"))
        assert ws.finished_sends({"r", "other"}) == set()  # still to be read
        assert ws.finished_sends(set()) == set()
        gate.set()
        assert ws.drain_saves(10)
        assert ws.finished_sends(set()) == {"r"}  # now the blocks may be reused
        assert ws.finished_sends({"r"}) == set()  # reported once
    finally:
        gate.set()
        ws.shutdown()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_load_is_timed_to_its_bytes_not_to_the_step_that_notices(
    make_cluster: Any, zero_copy: bool
) -> None:
    """Bug (engine runs): a load's time ran until the next step polled it, so every
    asynchronous load looked a step long to the scheduler's bandwidth meter and
    ``load_mode: auto`` never loaded inside a step. Polled 0.5 s late, a load of 16
    blocks still reports its own time."""
    c = make_cluster(workers=2, dram_size="64MiB")
    ws, _ = _worker(c.address, zero_copy)
    try:
        hs = block_hashes(list(range(NB * 32)), 32, extra=b"timed" + bytes([zero_copy]))
        ids = list(range(NB))
        _save(ws, "s", ids, hs)
        assert ws.drain_saves(10)
        ws.take_meta()
        ws.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("l", [ids], hs, ids)]))
        time.sleep(0.5)
        done, failed = ws.done_loads()
        assert done == {"l"} and not failed
        wm = ws.take_meta()
        assert wm is not None and len(wm.load_samples) == 1
        nbytes, secs = wm.load_samples[0]
        assert nbytes == NB * 2 * (64 << 10)  # 64 KiB per layer block, 2 layers
        assert secs < 0.4, f"a load of {nbytes} bytes timed at {secs:.3f} s"
    finally:
        ws.shutdown()
