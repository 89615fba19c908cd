"""The connector's mover path (the path a CUDA cache takes) against a real cluster,
with the copies' completion held back by a gated mover: the writer puts only once
its copy ticket is done, a load is reported finished receiving only once its copy
into the cache is done, preemption waits for the saves still reading a block, the
rows are allocated once, and a non-CPU cache is never turned into a numpy array or
a memoryview."""

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

NB = 16
SHAPE = (2, NB, 4, 8, 64)  # K/V split: 16 KiB per layer block


class GateTicket(bc.Ticket):
    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def done(self) -> bool:
        return self.gate.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.gate.wait(timeout)


class GatedMover(bc.HostMover):
    """The host mover whose copies are reported complete only once ``gate`` is set,
    as a CUDA copy still queued on its stream would be."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[str] = []

    def gather(self, layers: Any, blocks: Any, rows: Any) -> bc.Ticket:
        super().gather(layers, blocks, rows)
        self.calls.append("gather")
        return GateTicket(self.gate)

    def scatter(self, layers: Any, blocks: Any, rows: Any) -> bc.Ticket:
        super().scatter(layers, blocks, rows)
        self.calls.append("scatter")
        return GateTicket(self.gate)


def _worker(address: str, staging_mb: int = 1, mla: bool = False, tp: tuple[int, int] = (0, 1),
            shape: tuple[int, ...] = SHAPE) -> tuple[WorkerSide, list[Any]]:  # fmt: skip
    cfg = ConnectorConfig(master=address, zero_copy=False, staging_mb=staging_mb)
    setup = Setup(cfg, ModelIdentity("test/mover", None, None), "float32", "l2-test", 32,
                  [0], [], True, True, True, tp[1], 1, mla)  # fmt: skip
    group = SimpleNamespace(layer_names=["l0", "l1"])
    kcc = SimpleNamespace(num_blocks=NB, kv_cache_groups=[group])
    ws = WorkerSide(setup, kcc, Counters(), (tp[0], tp[1], 0, 1))
    caches = [torch.randn(shape), torch.randn(shape)]
    ws.register_kv_caches({"l0": caches[0], "l1": caches[1]})
    client = ws._holder.get(wait=10)
    assert client is not None
    assert client.session_writer  # session hints on: its puts are marked (session shares)
    assert not ws._zero_copy and isinstance(ws.mover, bc.HostMover)
    return ws, caches


def _block(caches: list[Any], b: int) -> bytes:
    return b"".join(c[kv, b].numpy().tobytes() for c in caches for kv in (0, 1))


def _save(ws: WorkerSide, rid: str, ids: list[int], hashes: list[bytes]) -> None:
    meta = KVStoreConnectorMetadata(saves=[Transfer(rid, [ids], hashes, list(range(len(ids))))])
    ws.start_load_kv(meta)
    ws.save_kv_layer("l0", meta)
    ws.wait_for_save(meta)


def _wait_loaded(ws: WorkerSide, rid: str, timeout: float = 10) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = ws.done_loads()
        if rid in done:
            return failed
        time.sleep(0.005)
    raise AssertionError("load did not finish")


def test_writer_waits_for_its_copy_and_preemption_waits_for_the_writer(
    make_cluster: Any,
) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    ws, caches = _worker(c.address)
    gated = GatedMover()
    ws.mover = gated
    hs = block_hashes(list(range(64)), 32, extra=b"gated-save")
    try:
        _save(ws, "r", [3, 5], hs)
        deadline = time.monotonic() + 5
        while "gather" not in gated.calls and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)
        with Client(c.address) as cl:
            assert cl.batch_exists(ws.ns, hs) == [False, False]  # no put before the copy
        assert ws.finished_sends({"r"}) == set()  # its blocks stay held
        waited = threading.Event()

        def preempt() -> None:
            ws.handle_preemptions(SimpleNamespace(preempted=["r"]))
            waited.set()

        pre = threading.Thread(target=preempt)
        pre.start()
        time.sleep(0.3)
        assert not waited.is_set()  # the preempted request's blocks are still being read
        gated.gate.set()
        pre.join(10)
        assert waited.is_set()
        assert ws.drain_saves(10)
        assert ws.finished_sends(set()) == {"r"}
        with Client(c.address) as cl:
            assert cl.batch_get(ws.ns, hs) == [_block(caches, 3), _block(caches, 5)]
    finally:
        gated.gate.set()
        ws.shutdown()


def test_finished_receiving_waits_for_the_copy_into_the_cache(make_cluster: Any) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    w, wc = _worker(c.address)
    r, rc = _worker(c.address)
    gated = GatedMover()
    r.mover = gated
    hs = block_hashes(list(range(64)), 32, extra=b"gated-load")
    try:
        _save(w, "a", [1, 2], hs)
        assert w.drain_saves(10)
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[9, 4]], hs, [0, 1])]))
        deadline = time.monotonic() + 5
        while "scatter" not in gated.calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert "scatter" in gated.calls
        for _ in range(20):
            assert "b" not in r.done_loads()[0]
            time.sleep(0.01)
        gated.gate.set()
        assert _wait_loaded(r, "b") == set()
        assert _block(rc, 9) == _block(wc, 1) and _block(rc, 4) == _block(wc, 2)
    finally:
        gated.gate.set()
        w.shutdown()
        r.shutdown()


def test_transfers_larger_than_the_rows_go_in_chunks(make_cluster: Any) -> None:
    """1 MiB of rows holds 8 blocks of 128 KiB: a 14-block save and load go in two
    chunks each, with the same bytes (the load's blocks copied from their pinned
    arena slots), and a miss in the second chunk ends the run."""
    c = make_cluster(workers=2, dram_size="64MiB")
    big = (2, NB, 16, 8, 64)  # 64 KiB per layer block
    w, wc = _worker(c.address, shape=big)
    r, rc = _worker(c.address, shape=big)
    assert w._rows["save"].cap == 8
    ids = list(range(14))
    hs = block_hashes(list(range(14 * 32)), 32, extra=b"chunks")
    try:
        _save(w, "a", ids, hs)
        assert w.drain_saves(10)
        assert w.take_meta().saved == {"a": ids}  # type: ignore[union-attr]
        # Same-host workers: every block was copied into a reserved arena slot.
        assert w._interval.peek()["arena_stored_blocks"] == 14
        dst = ids[::-1]
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [dst], hs, ids)]))
        assert _wait_loaded(r, "b") == set()
        for s, d in zip(ids, dst, strict=True):
            assert _block(rc, d) == _block(wc, s)
        # Same-host workers: every block was copied from its pinned arena slot.
        assert r._interval.peek()["arena_loaded_blocks"] == 14
        with Client(c.address) as cl:
            cl.remove(w.ns, hs[10:])
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("c", [ids], hs, ids)]))
        assert _wait_loaded(r, "c") == {"c"}
        assert r.block_ids_with_load_errors() == set(ids[10:])
    finally:
        w.shutdown()
        r.shutdown()


def test_rows_are_allocated_once(make_cluster: Any) -> None:
    """Steady state: the same rows every step, and Python allocates far less than
    the bytes moved (tracemalloc) for a save and a load of 8 blocks (1 MiB)."""
    c = make_cluster(workers=2, dram_size="64MiB")
    ws, _ = _worker(c.address, staging_mb=4)
    rows = {k: v.host.data_ptr() for k, v in ws._rows.items()}
    try:
        for turn in range(3):
            hs = block_hashes(list(range(8 * 32)), 32, extra=bytes([turn]) + b"rows")
            ids = list(range(8))
            if turn == 2:
                tracemalloc.start()
            _save(ws, f"s{turn}", ids, hs)
            assert ws.drain_saves(10)
            ws.start_load_kv(
                KVStoreConnectorMetadata(loads=[Transfer(f"l{turn}", [ids[::-1]], hs, ids)])
            )
            assert _wait_loaded(ws, f"l{turn}") == set()
            if turn == 2:
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                assert peak < 256 << 10, f"{peak} bytes allocated for 2 MiB moved"
        assert {k: v.host.data_ptr() for k, v in ws._rows.items()} == rows
    finally:
        ws.shutdown()


def test_mla_ranks_share_one_namespace_and_stripe_their_writes(make_cluster: Any) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    r0, c0 = _worker(c.address, mla=True, tp=(0, 2))
    r1, _ = _worker(c.address, mla=True, tp=(1, 2))
    assert r0.ns == r1.ns and "tp0of1" in r0.ns
    for name, a in zip(("l0", "l1"), c0, strict=True):  # the same latent cache on both ranks
        r1._layers[name].tensor.copy_(a)
    hs = block_hashes(list(range(4 * 32)), 32, extra=b"mla")
    ids = [0, 1, 2, 3]
    try:
        _save(r0, "a", ids, hs)
        _save(r1, "a", ids, hs)
        assert r0.drain_saves(10) and r1.drain_saves(10)
        m0, m1 = r0.take_meta(), r1.take_meta()
        assert m0 is not None and m1 is not None
        assert m0.saved == {"a": [0, 2]} and m1.saved == {"a": [1, 3]}
        with Client(c.address) as cl:
            assert cl.batch_get(r0.ns, hs) == [_block(c0, b) for b in ids]
    finally:
        r0.shutdown()
        r1.shutdown()


def test_a_device_cache_is_never_viewed_as_host_memory() -> None:
    """Geometry of a cache that is not in CPU memory (the meta device stands in for
    CUDA here: numpy() or a memoryview of it raises) reads shapes and strides only,
    and says why zero copy is off."""
    for shape in (SHAPE, (NB, 2, 4, 8, 64), (2, NB * 2, 2, 8, 64)):
        layer = bc.describe(torch.empty(shape, device="meta"), NB)
        assert layer.flat is None and "meta" in layer.why_not
        with pytest.raises(AssertionError):
            layer.views(0)
    with pytest.raises(ValueError, match="no block mover"):
        bc.mover_for("meta")


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_step_loads_its_sync_hits_before_returning_and_queues_the_rest(
    make_cluster: Any, zero_copy: bool
) -> None:
    """load_mode auto gives one step both kinds: the load the scheduler planned inside
    the step is in the cache when start_load_kv returns and is never reported as
    finished receiving; the asynchronous one is reported by done_loads as usual."""
    c = make_cluster(workers=2, dram_size="64MiB")
    w, wc = _worker(c.address)
    cfg = ConnectorConfig(master=c.address, zero_copy=zero_copy, staging_mb=1, load_mode="auto")
    setup = Setup(cfg, ModelIdentity("test/mover", None, None), "float32", "l2-test", 32,
                  [0], [], True, True, True, 1, 1)  # fmt: skip
    kcc = SimpleNamespace(
        num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"])]
    )
    r = WorkerSide(setup, kcc, Counters(), (0, 1, 0, 1))
    rc = [torch.randn(SHAPE), torch.randn(SHAPE)]
    r.register_kv_caches({"l0": rc[0], "l1": rc[1]})
    assert r._holder.get(wait=10) is not None and r._zero_copy is zero_copy
    hs = block_hashes(list(range(4 * 32)), 32, extra=bytes([zero_copy]) + b"auto")
    try:
        _save(w, "a", [1, 2, 3, 4], hs)
        assert w.drain_saves(10)
        now = Transfer("now", [[9, 10]], hs[:2], [0, 1], sync=True)
        later = Transfer("later", [[11, 12]], hs[2:], [2, 3])
        r.start_load_kv(KVStoreConnectorMetadata(loads=[now, later]))
        assert _block(rc, 9) == _block(wc, 1) and _block(rc, 10) == _block(wc, 2)
        # The sync load ran outside the staging cap and gave nothing back to it: the
        # asynchronous one still holds its bytes there until it is reported.
        assert r._budget.used == 2 * r._block_bytes
        assert _wait_loaded(r, "later") == set()
        assert r._budget.used == 0
        assert _block(rc, 11) == _block(wc, 3) and _block(rc, 12) == _block(wc, 4)
        assert "now" not in r.done_loads()[0]
        assert r._interval.peek()["sync_loaded_blocks"] == 2
    finally:
        w.shutdown()
        r.shutdown()
