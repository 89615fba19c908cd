"""Issue 47, finding 3: same-host arenas page-locked for DMA. Registered when the
client connects (on the loader thread, before any load), never unmapped while
registered, unregistered once their worker is gone; an arena the driver refuses
loads through the pinned rows. No GPU here: ``cudaHostRegister`` and
``cudaHostUnregister`` are recorded stand-ins, the mover is the CUDA mover over the
recording fake of test_vllm_cuda_order, the cluster and the bytes are real."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvstore_client import block_hashes  # noqa: E402
from kvstore_client.connectors import blockcopy as bc  # noqa: E402
from kvstore_client.connectors.vllm import worker as worker_mod  # noqa: E402
from kvstore_client.connectors.vllm.common import KVStoreConnectorMetadata, Transfer  # noqa: E402

from .test_vllm_cuda_order import _block, _fake_mover, _save, _wait_loaded, _worker  # noqa: E402


class Driver:
    """Stand-ins for cudaHostRegister / cudaHostUnregister: (call, address, thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, accept: bool = True) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.accept = accept
        monkeypatch.setattr(bc, "register_host", self.register)
        monkeypatch.setattr(bc, "unregister_ptr", self.unregister)

    def register(self, view: memoryview, read_only: bool = False) -> bool:
        self.calls.append(("register", bc.host_address(view), threading.current_thread().name))
        return self.accept

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr, threading.current_thread().name))

    def wait(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.calls) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.calls) >= n, self.calls


def _cuda_worker(monkeypatch: pytest.MonkeyPatch, address: str) -> tuple[Any, list[Any]]:
    """A worker side whose cache takes the CUDA mover (over the fake) from the start,
    as a CUDA cache does: the connect hook sees device rows."""
    monkeypatch.setattr(worker_mod.bc, "mover_for", lambda device: _fake_mover()[0])
    return _worker(address)


def test_arenas_are_registered_when_the_client_connects(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    w, _ = _worker(c.address)  # the writer: a CPU cache (no registrations)
    drv = Driver(monkeypatch)
    r, _ = _cuda_worker(monkeypatch, c.address)
    try:
        client = r.store_client(10)
        assert client is not None
        arenas = client.local_arenas()
        assert len(arenas) == 2
        drv.wait(2)  # no load asked for: registered at connect, on the loader thread
        assert sorted(a for _, a, _ in drv.calls) == sorted(bc.host_address(a.view) for a in arenas)
        assert all(call == "register" and t.startswith("kvstore-load") for call, _, t in drv.calls)
        # A load does not register them again.
        hs = block_hashes(list(range(2 * 32)), 32, extra=b"reg-connect")
        try:
            _save(w, "a", [1, 2], hs)
            assert w.drain_saves(10)
        finally:
            w.shutdown()
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6]], hs, [0, 1])]))
        assert _wait_loaded(r, "b") == set()
        assert len(drv.calls) == 2
    finally:
        r.shutdown()
    assert sorted(call for call, _, _ in drv.calls) == ["register"] * 2 + ["unregister"] * 2


def test_a_gone_workers_arena_is_unregistered_before_its_mapping_goes(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_cluster(workers=2, dram_size="64MiB")
    drv = Driver(monkeypatch)
    r, _ = _cuda_worker(monkeypatch, c.address)
    try:
        client = r.store_client(10)
        assert client is not None
        drv.wait(2)
        gone = c.worker_procs[0]
        regs = r._registered.snapshot()
        assert len(regs) == 2
        gone.stop()
        deadline = time.monotonic() + 10
        dead = []
        while not dead and time.monotonic() < deadline:
            dead = [aid for aid, g in regs.items() if not g.arena.alive()]
            time.sleep(0.05)
        assert len(dead) == 1
        held = regs[dead[0]]
        assert held.view is not None and held.view.nbytes > 0  # the mapping is still held
        r._register([])  # any later load's registration pass
        assert ("unregister", held.addr) in [(c_, a) for c_, a, _ in drv.calls]
        assert held.view is None and dead[0] not in r._registered
        assert len(r._registered) == 1  # the live worker's stays
    finally:
        r.shutdown()


def test_an_arena_the_driver_refuses_loads_through_the_pinned_rows(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    drv = Driver(monkeypatch, accept=False)
    w, wc = _worker(c.address)
    r, rc = _cuda_worker(monkeypatch, c.address)
    hs = block_hashes(list(range(2 * 32)), 32, extra=b"reg-refused")
    uploads: list[Any] = []
    real_upload = r.mover.upload

    def upload(srcs: list[Any], dst: Any) -> Any:
        uploads.append(list(srcs))
        return real_upload(srcs, dst)

    monkeypatch.setattr(r.mover, "upload", upload)
    try:
        assert r.store_client(10) is not None
        drv.wait(1)
        _save(w, "a", [1, 2], hs)
        assert w.drain_saves(10)
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6]], hs, [0, 1])]))
        assert _wait_loaded(r, "b") == set()
        assert _block(rc, 5) == _block(wc, 1) and _block(rc, 6) == _block(wc, 2)
        # Uploaded from the pinned host rows, never from the refused arena's slots.
        rows = r._rows["load"].host
        assert uploads and all(s is rows for up in uploads for s in up)
        assert r._interval.take().get("arena_loaded_blocks", 0) == 0
        # Its saves: downloaded into the pinned rows, copied into the inbox by the host.
        hs2 = block_hashes(list(range(100, 100 + 2 * 32)), 32, extra=b"reg-refused-save")
        _save(r, "c", [3, 4], hs2)
        r.wait_for_save(r._handed)
        assert r.drain_saves(10)
        assert r.take_meta().saved == {"c": [0, 1]}  # type: ignore[union-attr]
        assert r._interval.take()["arena_stored_blocks"] == 2  # into reserved inbox slots
        w.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("d", [[7, 8]], hs2, [0, 1])]))
        assert _wait_loaded(w, "d") == set()
        assert _block(wc, 7) == _block(rc, 3) and _block(wc, 8) == _block(rc, 4)
    finally:
        w.shutdown()
        r.shutdown()
