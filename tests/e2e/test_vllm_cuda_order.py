"""Issue 47, findings 2-6: the CUDA mover's stream and event calls, in order,
through its seam (``blockcopy.CudaOps``) replaced by a recording fake, since no GPU
is here: the copies themselves run on CPU tensors, so the bytes are real, and the
worker side runs against a real cluster (same-host arena slots and pins). Checked:
the save's gather waits for the event marking the forward and the forward's
stream waits for the gather (finding 5); the background threads
select the cache's device; every slot reservation and pin is given back on every
error path, and never under a copy still in flight; float8 caches; a CPU cache
never initialises CUDA; a step's loads do not queue behind asynchronous jobs."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvstore_client import block_hashes  # noqa: E402
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
from kvstore_client.transport import pins as pins_mod  # noqa: E402

NB = 16
SHAPE = (2, NB, 4, 8, 64)


class FakeEvent:
    def __init__(self, ops: FakeOps) -> None:
        self.ops = ops
        self.n = len(ops.events)
        ops.events.append(self)
        self.stream: str | None = None

    def query(self) -> bool:
        return self.ops.gate.is_set()


class FakeOps(bc.CudaOps):
    """Records every stream and event call as (call, stream name, event number,
    thread name); events complete once ``gate`` is set (set by default)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, str]] = []
        self.events: list[FakeEvent] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def _log(self, call: str, stream: Any = "", event: Any = None) -> None:
        with self.lock:
            self.calls.append((call, str(stream), -1 if event is None else event.n,
                               threading.current_thread().name))  # fmt: skip

    def set_device(self, device: Any) -> None:
        self._log("set_device", str(device))

    def stream(self, device: Any) -> Any:
        self.streams = getattr(self, "streams", 0) + 1
        return "save" if self.streams == 1 else "load"

    def current_stream(self, device: Any) -> Any:
        return "forward"

    def event(self) -> Any:
        return FakeEvent(self)

    def record(self, event: Any, stream: Any) -> None:
        event.stream = stream
        self._log("record", stream, event)

    def wait_event(self, stream: Any, event: Any) -> None:
        self._log("wait_event", stream, event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        self._log("wait_stream", stream)

    def use(self, stream: Any) -> Any:
        ops = self

        class _Use:
            def __enter__(self) -> None:
                ops._log("use", stream)

            def __exit__(self, *exc: object) -> None:
                ops._log("unuse", stream)

        return _Use()


def _fake_mover() -> tuple[bc.CudaMover, FakeOps]:
    ops = FakeOps()
    m = bc.CudaMover("cpu", ops=ops)
    ops.calls.append(("start", "", -1, ""))
    return m, ops


def test_gather_waits_for_the_forwards_event_and_joins_are_event_waits() -> None:
    m, ops = _fake_mover()
    t = torch.randn(SHAPE)
    layer = bc.describe(t, NB)
    rows = torch.zeros((3, layer.nbytes), dtype=torch.uint8)
    host = torch.zeros_like(rows)
    ready = m.mark()
    m.gather([layer], [[1, 2, 3]], rows, after=ready).wait(1)
    m.download(rows, [host]).wait(1)
    got = [(c, s) for c, s, _, _ in ops.calls[1:]]
    assert got == [("record", "forward"), ("wait_event", "save"), ("use", "save"),
                   ("record", "save"), ("unuse", "save"), ("use", "save"),
                   ("record", "save"), ("unuse", "save")]  # fmt: skip
    assert ops.calls[2][2] == ready.n  # the gather waits for the forward's event
    back = m.scatter([layer], [[7, 8, 9]], host)
    m.join(back)
    assert ops.calls[-1][:2] == ("wait_event", "forward")
    assert torch.equal(t[:, 7:10], t[:, 1:4])
    m.bind_thread()
    assert ops.calls[-1][:2] == ("set_device", "cpu")


def _worker(address: str, timeout_s: float = 5.0, load_mode: str = "async",
            dtype: Any = torch.float32) -> tuple[WorkerSide, list[Any]]:  # fmt: skip
    cfg = ConnectorConfig(master=address, zero_copy=False, staging_mb=1, timeout_s=timeout_s,
                          load_mode=load_mode)  # fmt: skip
    setup = Setup(cfg, ModelIdentity("test/order", None, None), "float32", "l2-test", 32,
                  [0], [], True, True, True, 1, 1)  # fmt: skip
    kcc = SimpleNamespace(num_blocks=NB, kv_cache_groups=[SimpleNamespace(layer_names=["l0"])])
    ws = WorkerSide(setup, kcc, Counters(), (0, 1, 0, 1))
    caches = [torch.randn(SHAPE).to(dtype)]
    ws.register_kv_caches({"l0": caches[0]})
    assert ws._holder.get(wait=10) is not None
    return ws, caches


def _as_cuda(ws: WorkerSide) -> FakeOps:
    """The worker side's mover swapped for the CUDA mover over the fake (device rows
    allocated as on CUDA, on the CPU)."""
    m, ops = _fake_mover()
    ws.mover = m
    ws._rows.clear()
    ws._make_all_rows(torch.device("cpu"))
    return ops


def _save(ws: WorkerSide, rid: str, ids: list[int], hashes: list[bytes]) -> None:
    meta = KVStoreConnectorMetadata(saves=[Transfer(rid, [ids], hashes, list(range(len(ids))))])
    ws.start_load_kv(meta)
    ws.save_kv_layer("l0", meta)
    ws.wait_for_save(meta)


def _block(caches: list[Any], b: int) -> bytes:
    return b"".join(c[kv, b].contiguous().view(torch.uint8).numpy().tobytes()
                    for c in caches for kv in (0, 1))  # fmt: skip


def _wait_loaded(ws: WorkerSide, rid: str) -> set[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, failed = ws.done_loads()
        if rid in done:
            return failed
        time.sleep(0.005)
    raise AssertionError("load did not finish")


def test_the_worker_orders_its_copies_and_selects_the_device(make_cluster: Any) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    w, wc = _worker(c.address)
    r, rc = _worker(c.address)
    wops, rops = _as_cuda(w), _as_cuda(r)
    hs = block_hashes(list(range(2 * 32)), 32, extra=b"order")
    try:
        _save(w, "a", [1, 2], hs)
        # vLLM calls finish_forward, then wait_for_save, with the step's metadata:
        # the second hands nothing over again.
        w.wait_for_save(w._handed)
        assert w.drain_saves(10)
        assert w.take_meta().saved == {"a": [0, 1]}  # type: ignore[union-attr]
        calls = [(cl, s, ev, t) for cl, s, ev, t in wops.calls[1:]]
        step = [(cl, s) for cl, s, _, t in calls if not t.startswith("kvstore")]
        # The step's thread: mark the forward, queue the gather on the save stream
        # after that mark, and make the forward's stream wait for the gather (so
        # nothing the engine queues next reuses a block before it is read).
        assert step == [("record", "forward"), ("use", "save"), ("unuse", "save"),
                        ("wait_event", "save"), ("use", "save"), ("record", "save"),
                        ("unuse", "save"), ("wait_event", "forward")]  # fmt: skip
        mark = calls[0][2]
        gathered = next(c for c in calls if c[0] == "record" and c[1] == "save")[2]
        waits = [c for c in calls if c[0] == "wait_event"]
        assert waits[0][2] == mark and waits[1][:3] == ("wait_event", "forward", gathered)
        # The writer selects the device before its first CUDA call and only downloads.
        writer = [(cl, s) for cl, s, _, t in calls if t.startswith("kvstore-save")]
        assert writer[0] == ("set_device", "cpu")
        assert ("wait_event", "save") not in writer and writer[1:] == [
            ("use", "save"),
            ("record", "save"),
            ("unuse", "save"),
        ]
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6]], hs, [0, 1])]))
        assert _wait_loaded(r, "b") == set()
        assert _block(rc, 5) == _block(wc, 1) and _block(rc, 6) == _block(wc, 2)
        loader = [x for x in rops.calls[1:] if x[3].startswith("kvstore-load")]
        assert loader[0][0] == "set_device"
        # The upload and the scatter both go on the load stream, in that order.
        assert [x[:2] for x in loader if x[0] == "use"] == [("use", "load"), ("use", "load")]
    finally:
        w.shutdown()
        r.shutdown()


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("step", ["gather", "download", "commit", "timeout"])
def test_every_slot_is_given_back_on_every_save_error(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """An exception (or a timeout) at each step between reserve and commit: the
    slots are aborted, and only once the copy into them is no longer in flight."""
    c = make_cluster(workers=1, dram_size="64MiB")
    w, _ = _worker(c.address, timeout_s=0.3)
    ops = _as_cuda(w)
    log: list[str] = []
    real_abort, real_commit = pins_mod.ArenaSlots.abort, pins_mod.ArenaSlots.commit

    def abort(self: Any) -> None:
        log.append("abort" if ops.gate.is_set() else "abort-under-copy")
        real_abort(self)

    def commit(self: Any, written: Any) -> list[bool]:
        if step == "commit" and any(written):
            raise Boom("commit")
        return real_commit(self, written)

    monkeypatch.setattr(pins_mod.ArenaSlots, "abort", abort)
    monkeypatch.setattr(pins_mod.ArenaSlots, "commit", commit)
    if step in ("gather", "download"):
        real = getattr(w.mover, step)

        def boom(*a: Any, **kw: Any) -> Any:
            ops.gate.clear()  # an earlier copy of this chunk is still in flight
            threading.Timer(0.5, ops.gate.set).start()
            if step == "gather":
                real(*a, **kw)
            raise Boom(step)

        monkeypatch.setattr(w.mover, step, boom)
    if step == "timeout":
        ops.gate.clear()
        threading.Timer(0.8, ops.gate.set).start()
    hs = block_hashes(list(range(2 * 32)), 32, extra=step.encode())
    try:
        _save(w, "a", [1, 2], hs)
        assert w.drain_saves(10)
        assert w.take_meta().save_failed == {"a": [0, 1]}  # type: ignore[union-attr]
        # A gather fails on the step's thread (CUDA: queued there), before any slot.
        assert log == ([] if step == "gather" else ["abort"])
        assert w._saving == {} and w._pending_save_bytes == 0
    finally:
        ops.gate.set()
        w.shutdown()


@pytest.mark.parametrize("step", ["register", "upload", "scatter"])
def test_every_pin_is_given_back_on_every_load_error(
    make_cluster: Any, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    w, _ = _worker(c.address)
    r, rc = _worker(c.address)
    _as_cuda(r)
    hs = block_hashes(list(range(2 * 32)), 32, extra=b"pins" + step.encode())
    released: list[int] = []
    real_release = pins_mod.ArenaPins.release

    def release(self: Any) -> None:
        released.append(self.count)
        real_release(self)

    monkeypatch.setattr(pins_mod.ArenaPins, "release", release)
    target = r if step == "register" else r.mover
    name = "_register" if step == "register" else step

    def boom(*a: Any, **kw: Any) -> Any:
        raise Boom(step)

    monkeypatch.setattr(target, name, boom)
    before = rc[0].clone()
    try:
        _save(w, "a", [1, 2], hs)
        assert w.drain_saves(10)
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6]], hs, [0, 1])]))
        assert _wait_loaded(r, "b") == {"b"}
        assert r.block_ids_with_load_errors() == {5, 6}
        assert released and released[0] == 2  # the pins of both blocks, given back
        if step != "scatter":
            assert torch.equal(rc[0], before)  # nothing reached the cache
    finally:
        w.shutdown()
        r.shutdown()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_caches_round_trip(make_cluster: Any, dtype: str) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    dt = getattr(torch, dtype)
    w, wc = _worker(c.address, dtype=dt)
    r, rc = _worker(c.address, dtype=dt)
    hs = block_hashes(list(range(2 * 32)), 32, extra=dtype.encode())
    try:
        _save(w, "a", [1, 2], hs)
        assert w.drain_saves(10)
        r.start_load_kv(KVStoreConnectorMetadata(loads=[Transfer("b", [[5, 6]], hs, [0, 1])]))
        assert _wait_loaded(r, "b") == set()
        assert _block(rc, 5) == _block(wc, 1) and _block(rc, 6) == _block(wc, 2)
    finally:
        w.shutdown()
        r.shutdown()


def test_a_cpu_cache_never_initialises_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with a GPU, a CPU cache's rows are not pinned and the capture
    check does not start CUDA (CUDA is made to look present here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(True))
    assert bc.capturing() is False and not asked
    from kvstore_client.connectors.vllm import jobs

    rows = jobs.make_rows(2, 64, torch.device("cpu"), on_device=False)
    assert not rows.host.is_pinned()


def test_a_steps_load_does_not_queue_behind_asynchronous_jobs(make_cluster: Any) -> None:
    c = make_cluster(workers=1, dram_size="64MiB")
    w, wc = _worker(c.address)
    r, rc = _worker(c.address, load_mode="auto")
    hs = block_hashes(list(range(2 * 32)), 32, extra=b"not-behind")
    try:
        _save(w, "a", [1, 2], hs)
        assert w.drain_saves(10)
        stuck = threading.Event()
        for _ in range(3):  # asynchronous jobs queued on the loader thread
            r._load_pool.submit(stuck.wait, 30)
        t0 = time.monotonic()
        now = Transfer("now", [[5, 6]], hs, [0, 1], sync=True)
        r.start_load_kv(KVStoreConnectorMetadata(loads=[now]))
        took = time.monotonic() - t0
        stuck.set()
        assert _block(rc, 5) == _block(wc, 1) and _block(rc, 6) == _block(wc, 2)
        assert took < 5, f"the step's load waited {took:.1f} s behind the queue"
    finally:
        w.shutdown()
        r.shutdown()
