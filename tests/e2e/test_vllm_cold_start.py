"""Issue 47, finding 8: a store hit right after the engine starts. The worker side's
client connects on a background thread; a load requested before it is connected
must wait for it (bounded by ``timeout_s``, as saves do) instead of marking every
block failed without asking the store, and ``sync_loaded_blocks`` counts only the
blocks that arrived. Against a real cluster; the client's connect is slowed by a
factory that sleeps first (the only stand-in: a real connect is just fast)."""

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
from kvstore_client.connectors.vllm import worker as worker_mod  # noqa: E402
from kvstore_client.connectors.vllm.common import (  # noqa: E402
    KVStoreConnectorMetadata,
    Setup,
    Transfer,
)
from kvstore_client.connectors.vllm.worker import WorkerSide  # noqa: E402

NB = 16
SHAPE = (2, NB, 4, 8, 64)


def _worker(address: str, zero_copy: bool, load_mode: str = "async") -> tuple[WorkerSide, list]:
    cfg = ConnectorConfig(master=address, zero_copy=zero_copy, staging_mb=1, load_mode=load_mode)
    setup = Setup(cfg, ModelIdentity("test/cold", None, None), "float32", "l2-test", 32,
                  [0], [], True, True, True, 1, 1)  # fmt: skip
    kcc = SimpleNamespace(num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0"])])
    ws = WorkerSide(setup, kcc, Counters(), (0, 1, 0, 1))
    caches = [torch.randn(SHAPE)]
    ws.register_kv_caches({"l0": caches[0]})
    return ws, caches


def _block(caches: list[Any], b: int) -> bytes:
    return b"".join(c[kv, b].numpy().tobytes() for c in caches for kv in (0, 1))


def _slow_client(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    def slow(*a: Any, **kw: Any) -> Client:
        time.sleep(delay)
        return Client(*a, **kw)

    monkeypatch.setattr(worker_mod, "Client", slow)


@pytest.mark.parametrize("mode", ["zero_copy_async", "mover_async", "zero_copy_sync", "mover_sync"])
def test_a_hit_right_after_start_waits_for_the_connection(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    w, wc = _worker(c.address, zero_copy=True)
    hs = block_hashes(list(range(3 * 32)), 32, extra=mode.encode())
    _slow_client(monkeypatch, 0.5)
    zero_copy, sync = mode.startswith("zero_copy"), mode.endswith("_sync")
    r, rc = _worker(c.address, zero_copy=zero_copy, load_mode="sync" if sync else "async")
    try:
        meta = KVStoreConnectorMetadata(saves=[Transfer("a", [[1, 2, 3]], hs, [0, 1, 2])])
        w.start_load_kv(meta)
        w.save_kv_layer("l0", meta)
        w.wait_for_save(meta)
        assert w.drain_saves(10)
        assert w.take_meta().saved == {"a": [0, 1, 2]}  # type: ignore[union-attr]
        # The reader's engine just started: its client is still connecting.
        assert r._holder.get() is None
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6, 7]], hs, [0, 1, 2])]))
        if not sync:
            deadline = time.monotonic() + 10
            while True:
                done, failed = r.done_loads()
                if "b" in done:
                    break
                assert time.monotonic() < deadline, "load did not finish"
                time.sleep(0.005)
            assert failed == set(), failed
        assert r.block_ids_with_load_errors() == set()
        for src, dst in ((1, 5), (2, 6), (3, 7)):
            assert _block(rc, dst) == _block(wc, src)
        if sync:
            assert r._interval.peek()["sync_loaded_blocks"] == 3
    finally:
        w.shutdown()
        r.shutdown()


def test_sync_loaded_blocks_counts_only_blocks_that_arrived(make_cluster: Any) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    w, _ = _worker(c.address, zero_copy=True)
    r, _ = _worker(c.address, zero_copy=False, load_mode="sync")
    hs = block_hashes(list(range(3 * 32)), 32, extra=b"partial")
    try:
        assert r._holder.get(wait=10) is not None
        meta = KVStoreConnectorMetadata(saves=[Transfer("a", [[1]], hs[:1], [0])])
        w.start_load_kv(meta)
        w.save_kv_layer("l0", meta)
        w.wait_for_save(meta)
        assert w.drain_saves(10)
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6, 7]], hs, [0, 1, 2])]))
        assert r.block_ids_with_load_errors() == {6, 7}
        assert r._interval.peek()["sync_loaded_blocks"] == 1
    finally:
        w.shutdown()
        r.shutdown()
