"""The block mover: moves KV-cache blocks between an engine's paged cache tensors
and host memory. torch only (no engine import), so it is tested with torch alone.

**Geometry.** :func:`describe` reads one layer's cache tensor from its shape,
strides and storage: block-major ``(nb, ...)`` (MLA's latent cache, hybrid state
tensors, FlashInfer's ``(nb, 2, ...)`` with HND strides), K/V split
``(2, nb, ...)`` (FlashAttention), and kernel-split ``(nb*r, ...)`` /
``(2, nb*r, ...)`` caches whose attention kernel block is ``1/r`` of the engine's
block. A layer has one *plane* (block-major) or two (K, V); each plane is viewed
as ``(nb, r, *inner)`` so that engine block ``b`` is ``plane[b]``.

**Stored bytes.** A block's value is, layer after layer, plane after plane, the
plane's block in its *logical* (C) order: ``plane[b].contiguous()``. So an NHD and
an HND cache, or a kernel-split and a plain cache, of one model store the same
bytes, and a host cache whose blocks are one run of memory each is read and
written in place (zero copy) with exactly the bytes a gather would make.

**Copy plans and movers.** :func:`plan` turns a step's block ids into index
tensors on the cache's device. A mover copies between the cache and *rows* (a
``(n, block_bytes)`` uint8 tensor, one row per block) and returns a
:class:`Ticket`:

- :class:`HostMover` (CPU caches): gathers and scatters at once; its tickets are
  done when returned.
- :class:`CudaMover` (CUDA caches): a save's gather runs on a side stream that
  first waits for the forward's stream (so it sees the step's KV), into device
  rows; a download copies device rows to pinned host memory (the store's arena
  slots or pinned staging) with ``non_blocking`` DMA; a load uploads host rows to
  device rows and scatters them into the cache on a load stream. Each ticket holds
  a ``torch.cuda.Event``: ``done()`` polls it, ``wait()`` blocks the calling thread
  (never the device). Index tensors are staged through pinned memory and copied
  with ``non_blocking``, so nothing here synchronizes the device.

The caller keeps the memory a ticket reads or writes alive and unchanged until the
ticket is done.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

log = logging.getLogger(__name__)

BLOCK_MAJOR = "block-major"
KV_SPLIT = "kv-split"


# ---- tickets -------------------------------------------------------------------------


class Ticket:
    """The completion of one asynchronous copy."""

    def done(self) -> bool:
        """True once the copy is complete (never blocks)."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the copy is complete (or ``timeout``
        seconds); True when it is."""
        raise NotImplementedError


class DoneTicket(Ticket):
    """A copy that completed before it was returned (host caches)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True


DONE = DoneTicket()


class EventTicket(Ticket):
    """A copy queued on a CUDA stream, done when its event has completed."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout: float | None = None) -> bool:
        # Polls (no cudaEventSynchronize): a waiting thread never counts as a
        # device synchronization, and the wait can time out.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.event.query():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.0001)
        return True


class AllTickets(Ticket):
    """Done when every ticket it holds is."""

    __slots__ = ("tickets",)

    def __init__(self, tickets: list[Ticket]) -> None:
        self.tickets = tickets

    def done(self) -> bool:
        return all(t.done() for t in self.tickets)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.tickets:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not t.wait(left):
                return False
        return True


# ---- geometry --------------------------------------------------------------------------


@dataclass(slots=True)
class Plane:
    """One plane (the whole layer, or its K or its V half) as ``(nb, r, *inner)``."""

    blocks: Any  # the tensor view; block b is blocks[b]
    nbytes: int  # bytes of one block of this plane
    offset: int  # of this plane's bytes in the layer's part of a stored value
    dense: bool  # each block is one run of memory, in logical order
    base: int = 0  # byte offset of block 0 in the tensor's storage (dense only)
    stride: int = 0  # bytes from one block to the next in the storage (dense only)


@dataclass(slots=True)
class LayerGeometry:
    """How one layer's cache tensor holds engine blocks (see the module doc)."""

    tensor: Any
    kind: str  # BLOCK_MAJOR or KV_SPLIT
    rows: int  # kernel blocks per engine block (1 unless kernel-split)
    planes: list[Plane]
    nbytes: int  # bytes of one block of this layer (all planes)
    offset: int = 0  # of this layer's bytes in a stored value
    group: int = 0  # index of its cache group among the KV (or state) groups
    flat: memoryview | None = None  # host zero copy: the storage as one byte view
    why_not: str = ""  # why ``flat`` is None

    @property
    def device(self) -> Any:
        return self.tensor.device

    def views(self, block: int) -> list[memoryview]:
        """Block ``block`` as byte views of the cache itself, in stored order (host
        zero copy only: needs ``flat``)."""
        flat = self.flat
        assert flat is not None, self.why_not
        return [flat[p.base + block * p.stride : p.base + block * p.stride + p.nbytes]
                for p in self.planes]  # fmt: skip

    def typed(self, rows: Any, plane: Plane) -> Any:
        """The part of ``rows`` (``(n, value_bytes)`` uint8) that holds ``plane``,
        typed and shaped like its blocks: ``(n, r, *inner)`` (float8: as uint8)."""
        a = self.offset + plane.offset
        part = rows[:, a : a + plane.nbytes].view(_copyable(plane.blocks).dtype)
        return part.view(rows.shape[0], *plane.blocks.shape[1:])

    def gather(self, index: Any, rows: Any) -> None:
        """Blocks ``index`` of the cache -> ``rows`` (one index_select per plane)."""
        n = rows.shape[0]
        for p in self.planes:
            a = self.offset + p.offset
            got = _copyable(p.blocks).index_select(0, index)  # contiguous, (n, r, *inner)
            rows[:, a : a + p.nbytes].copy_(got.view(torch.uint8).reshape(n, p.nbytes))

    def scatter(self, index: Any, rows: Any) -> None:
        """``rows`` -> blocks ``index`` of the cache (one index_copy_ per plane)."""
        for p in self.planes:
            try:
                src = self.typed(rows, p)
            except RuntimeError:  # a part not aligned to the dtype: copy it first
                a = self.offset + p.offset
                part = rows[:, a : a + p.nbytes].contiguous().view(_copyable(p.blocks).dtype)
                src = part.view(rows.shape[0], *p.blocks.shape[1:])
            _copyable(p.blocks).index_copy_(0, index, src)


# float8 caches (FP8 KV, e4m3 / e5m2): index_copy_ has no float8 kernel (CPU, and not
# every CUDA build); their blocks are copied as the bytes they are.
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                            "float8_e5m2fnuz", "float8_e8m0fnu")
                if hasattr(torch, n))  # fmt: skip


def _copyable(t: Any) -> Any:
    """``t``, or a uint8 view of it (same shape) when its dtype is a float8."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def describe(t: Any, num_blocks: int, offset: int = 0, group: int = 0) -> LayerGeometry:
    """The geometry of cache tensor ``t`` holding ``num_blocks`` engine blocks;
    ValueError for a shape it cannot read."""
    shape = tuple(t.shape)
    if num_blocks <= 0 or not shape:
        raise ValueError(f"unknown KV cache layout {shape} for {num_blocks} blocks")
    if shape[0] == num_blocks:
        kind, rows, raw = BLOCK_MAJOR, 1, [t]
    elif len(shape) > 1 and shape[0] == 2 and shape[1] and shape[1] % num_blocks == 0:
        kind, rows, raw = KV_SPLIT, shape[1] // num_blocks, [t[0], t[1]]
    elif shape[0] % num_blocks == 0:
        kind, rows, raw = BLOCK_MAJOR, shape[0] // num_blocks, [t]
    else:
        raise ValueError(f"unknown KV cache layout {shape} for {num_blocks} blocks")
    es = t.element_size()
    planes: list[Plane] = []
    at = 0
    for r in raw:
        blocks = r.unflatten(0, (num_blocks, rows))
        n = math.prod(blocks.shape[1:]) * es
        dense = bool(blocks[0].is_contiguous())
        base = r.storage_offset() * es
        planes.append(Plane(blocks, n, at, dense, base, blocks.stride(0) * es))
        at += n
    layer = LayerGeometry(t, kind, rows, planes, at, offset, group)
    _host_view(layer)
    return layer


def _host_view(layer: LayerGeometry) -> None:
    """Sets ``layer.flat`` when the cache is host memory whose every block (each
    plane's block) is one run of memory; else says why not in ``why_not``."""
    t = layer.tensor
    if t.device.type != "cpu":
        layer.why_not = f"its cache is on {t.device}"
        return
    bad = next((p for p in layer.planes if not p.dense), None)
    if bad is not None:
        layer.why_not = (f"a block is not one run of memory (shape {tuple(t.shape)}, "
                         f"strides {t.stride()})")  # fmt: skip
        return
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    layer.flat = memoryview(base.numpy())


def value_views(layers: list[LayerGeometry], ids: list[list[int]], row: int) -> list[memoryview]:
    """Row ``row`` of a transfer as the list of its parts in a host cache: every
    layer in order (the stored byte order), block ``ids[layer.group][row]``."""
    return [v for layer in layers for v in layer.views(ids[layer.group][row])]


# ---- plans -----------------------------------------------------------------------------


@dataclass(slots=True)
class CopyPlan:
    """One transfer's blocks: per cache group the block ids of its rows, and the
    same as index tensors on the cache's device."""

    ids: list[list[int]]
    index: list[Any] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.ids[0]) if self.ids else 0


def plan(ids: list[list[int]], device: Any) -> CopyPlan:
    """The copy plan of block ids ``ids`` (one list per cache group, equal lengths)
    for a cache on ``device``. On CUDA the indices are staged in pinned memory and
    copied with ``non_blocking`` on the current stream (no device sync)."""
    if len({len(g) for g in ids}) > 1:
        raise ValueError("every cache group needs as many block ids as the others")
    dev = torch.device(device)
    out = []
    for g in ids:
        host = torch.tensor(g, dtype=torch.long)
        if dev.type == "cuda":
            host = host.pin_memory()
            out.append(host.to(dev, non_blocking=True))
        else:
            out.append(host.to(dev))
    return CopyPlan(ids, out)


# ---- movers ----------------------------------------------------------------------------


Blocks = CopyPlan | list[list[int]]


def _index(layer: LayerGeometry, p: CopyPlan) -> Any:
    return p.index[layer.group] if layer.group < len(p.index) else p.index[0]


def _gather(layers: list[LayerGeometry], blocks: Blocks, rows: Any, device: Any) -> None:
    p = blocks if isinstance(blocks, CopyPlan) else plan(blocks, device)
    for layer in layers:
        layer.gather(_index(layer, p), rows[: p.n])


def _scatter(layers: list[LayerGeometry], blocks: Blocks, rows: Any, device: Any) -> None:
    p = blocks if isinstance(blocks, CopyPlan) else plan(blocks, device)
    for layer in layers:
        layer.scatter(_index(layer, p), rows[: p.n])


class HostMover:
    """Caches in host memory: every copy completes before it returns. ``blocks``:
    a :class:`CopyPlan`, or the block ids per cache group."""

    device_rows = False  # gathers go straight into the host rows given

    def bind_thread(self) -> None:
        """Nothing to select: a host cache never touches CUDA."""

    def fence(self) -> Ticket:
        """Every copy is complete when it returns: nothing in flight."""
        return DONE

    def gather(self, layers: list[LayerGeometry], blocks: Blocks, rows: Any) -> Ticket:
        """The blocks -> ``rows[:n]``."""
        _gather(layers, blocks, rows, "cpu")
        return DONE

    def scatter(self, layers: list[LayerGeometry], blocks: Blocks, rows: Any) -> Ticket:
        """``rows[:n]`` -> the blocks."""
        _scatter(layers, blocks, rows, "cpu")
        return DONE

    def download(self, rows: Any, dests: list[Any]) -> Ticket:
        """Rows -> host tensors ``dests`` (one per row, or one for all rows)."""
        _copy_rows(rows, dests, non_blocking=False)
        return DONE

    def upload(self, srcs: list[Any], rows: Any) -> Ticket:
        """Host tensors ``srcs`` (one per row, or one for all) -> rows."""
        _copy_rows_in(srcs, rows, non_blocking=False)
        return DONE


def _copy_rows(rows: Any, dests: list[Any], non_blocking: bool) -> None:
    if len(dests) == 1 and dests[0].dim() == 2:
        dests[0][: rows.shape[0]].copy_(rows, non_blocking=non_blocking)
        return
    for i, d in enumerate(dests):
        if d is not None:
            d.copy_(rows[i], non_blocking=non_blocking)


def _copy_rows_in(srcs: list[Any], rows: Any, non_blocking: bool) -> None:
    if len(srcs) == 1 and srcs[0].dim() == 2:
        rows.copy_(srcs[0][: rows.shape[0]], non_blocking=non_blocking)
        return
    for i, s in enumerate(srcs):
        if s is not None:
            rows[i].copy_(s, non_blocking=non_blocking)


class CudaOps:
    """The CUDA calls the mover makes on streams and events, and nothing else: the
    seam a test replaces with a recording fake (no GPU here) to check their order."""

    def set_device(self, device: Any) -> None:
        torch.cuda.set_device(device)

    def stream(self, device: Any) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: Any) -> Any:
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def use(self, stream: Any) -> Any:
        """A context making ``stream`` current (the copies inside are queued on it)."""
        return torch.cuda.stream(stream)


class CudaMover:
    """Caches on a CUDA device: copies on one side stream per direction, each
    ticket a ``torch.cuda.Event``. ``gather`` waits for the stream current at the
    call (the forward's) first; ``scatter`` leaves the forward's stream alone (the
    caller makes it wait when the step needs the data: :meth:`join`). Every stream
    and event call goes through ``ops`` (:class:`CudaOps`)."""

    device_rows = True  # gathers and scatters go through device rows

    def __init__(self, device: Any, ops: CudaOps | None = None) -> None:
        self.device = torch.device(device)
        self.ops = ops or CudaOps()
        self.save_stream = self.ops.stream(self.device)
        self.load_stream = self.ops.stream(self.device)

    def bind_thread(self) -> None:
        """Select the cache's device in the calling thread (each background thread,
        before its first CUDA call): otherwise a rank whose cache is on GPU N makes
        a context on GPU 0 and any allocation without a device lands there."""
        self.ops.set_device(self.device)

    def _ticket(self, stream: Any) -> Ticket:
        ev = self.ops.event()
        self.ops.record(ev, stream)
        return EventTicket(ev)

    def mark(self) -> Any:
        """An event recorded on the current (forward's) stream: a later
        :meth:`gather` given it as ``after`` sees everything queued before it."""
        ev = self.ops.event()
        self.ops.record(ev, self.ops.current_stream(self.device))
        return ev

    def gather(self, layers: list[LayerGeometry], blocks: Blocks, rows: Any,
               after: Any = None) -> Ticket:  # fmt: skip
        """The blocks -> device ``rows[:n]``, after event ``after`` (from
        :meth:`mark`) or else after the work queued on the current stream."""
        s = self.save_stream
        if after is not None:
            self.ops.wait_event(s, after)
        else:
            self.ops.wait_stream(s, self.ops.current_stream(self.device))
        with self.ops.use(s):
            _gather(layers, blocks, rows, self.device)
            return self._ticket(s)

    def download(self, rows: Any, dests: list[Any]) -> Ticket:
        """Device rows -> pinned host tensors ``dests`` (DMA, on the save stream,
        after the gathers queued there)."""
        s = self.save_stream
        with self.ops.use(s):
            _copy_rows(rows, dests, non_blocking=True)
            return self._ticket(s)

    def upload(self, srcs: list[Any], rows: Any) -> Ticket:
        """Pinned host tensors ``srcs`` -> device rows (DMA, on the load stream)."""
        s = self.load_stream
        with self.ops.use(s):
            _copy_rows_in(srcs, rows, non_blocking=True)
            return self._ticket(s)

    def scatter(self, layers: list[LayerGeometry], blocks: Blocks, rows: Any) -> Ticket:
        """Device ``rows[:n]`` -> the blocks (on the load stream, after the uploads
        queued there)."""
        s = self.load_stream
        with self.ops.use(s):
            _scatter(layers, blocks, rows, self.device)
            return self._ticket(s)

    def save_rows(self, n: int, width: int) -> Any:
        """Device rows of a step's gather, allocated on the save stream (every use
        of them is queued there, so the allocator never hands them out early)."""
        with self.ops.use(self.save_stream):
            return torch.empty((n, width), dtype=torch.uint8, device=self.device)

    def fence(self) -> Ticket:
        """A ticket done once everything queued so far on the save stream is, such
        as the copies of a gather that raised before returning its own ticket."""
        return self._ticket(self.save_stream)

    def join(self, ticket: Ticket) -> None:
        """Make the current (forward's) stream wait for ``ticket`` without blocking
        the host (``load_mode: sync``)."""
        if isinstance(ticket, EventTicket):
            self.ops.wait_event(self.ops.current_stream(self.device), ticket.event)
        elif isinstance(ticket, AllTickets):
            for t in ticket.tickets:
                self.join(t)


Mover = HostMover | CudaMover


def mover_for(device: Any) -> Mover:
    """The mover for caches on ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaMover(dev)
    if dev.type != "cpu":
        raise ValueError(f"no block mover for device {dev}")
    return HostMover()


def capturing() -> bool:
    """True while a CUDA graph is being captured (the hooks then do nothing). Never
    initialises CUDA: with CUDA not initialised in this process, nothing captures."""
    return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def pinned_rows(n: int, width: int, pin: bool | None = None) -> Any:
    """Host rows for DMA, allocated once: pinned when ``pin`` (default: where CUDA
    is present; pinning raises on a CPU-only torch). A CPU cache passes False, so
    that it never initialises CUDA on a machine that has a GPU."""
    pin = bool(torch.cuda.is_available()) and (pin is None or pin)
    return torch.empty((n, width), dtype=torch.uint8, pin_memory=pin)


def host_tensor(view: memoryview) -> Any:
    """A uint8 tensor over host memory ``view`` (no copy)."""
    return torch.frombuffer(view, dtype=torch.uint8)


def register_host(view: memoryview, read_only: bool = False) -> bool:
    """Page-lock host memory that torch did not allocate (``cudaHostRegister``), so
    DMA can read and write it directly; False when it cannot be (no CUDA, or the
    driver refused). Unregister with :func:`unregister_host`."""
    if not torch.cuda.is_available() or view.nbytes == 0:
        return False
    t = host_tensor(view)
    rt = torch.cuda.cudart()
    # cudaHostRegisterReadOnly (8, CUDA 11.1+): a mapping the process may only read
    # (a sealed arena); where the driver refuses it, False: the vLLM connector then
    # reads that arena's blocks into its pinned rows instead of DMA from the slots.
    flags = 8 if read_only or view.readonly else 0
    rc = rt.cudaHostRegister(t.data_ptr(), view.nbytes, flags)
    if int(getattr(rc, "value", rc)) == 0:
        return True
    # A failed registration leaves a sticky error that the next unrelated CUDA call
    # would raise (seen with arenas of 512 GiB and more): clear it here.
    _clear_cuda_error(rt)
    return False


def _clear_cuda_error(rt: Any) -> None:
    """``cudaGetLastError``: from torch's runtime bindings, or else from the CUDA
    runtime library this process has loaded (torch's bindings name few calls)."""
    get = getattr(rt, "cudaGetLastError", None)
    if get is None:
        get = _loaded_cudart_call("cudaGetLastError")
    if get is not None:
        get()


def _loaded_cudart_call(name: str) -> Any:
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {ln.split()[-1] for ln in f if "libcudart" in ln}
    except OSError:
        return None
    for lib in sorted(libs):
        try:
            return getattr(ctypes.CDLL(lib), name)
        except (OSError, AttributeError):
            continue
    return None


def unregister_host(view: memoryview) -> None:
    if torch.cuda.is_available() and view.nbytes:
        unregister_ptr(host_tensor(view).data_ptr())


def unregister_ptr(ptr: int) -> None:
    """Undo :func:`register_host` of the mapping at address ``ptr`` (before it is
    unmapped or remapped: a later DMA must never target stale pages)."""
    if torch.cuda.is_available():
        rt = torch.cuda.cudart()
        rc = rt.cudaHostUnregister(ptr)
        if int(getattr(rc, "value", rc)) != 0:
            _clear_cuda_error(rt)


@dataclass(slots=True)
class Registration:
    """An arena mapping page-locked for DMA (:func:`register_host`). It holds the
    mapping's view while registered, so the mapping is never unmapped under a
    registration; :meth:`undo` unregisters first, then lets the view go."""

    arena: Any
    view: memoryview | None
    addr: int
    size: int
    ok: bool

    @classmethod
    def make(cls, arena: Any, view: memoryview) -> Registration:
        ok = register_host(view)
        return cls(arena, view if ok else None, host_address(view), view.nbytes, ok)

    def covers(self, view: memoryview) -> bool:
        """Whether ``view`` is the mapping registered (not a remap of it)."""
        return (host_address(view), view.nbytes) == (self.addr, self.size)

    def stale(self) -> bool:
        """The arena's worker is gone or the client dropped the mapping."""
        alive = getattr(self.arena, "alive", None)
        return not alive() if callable(alive) else bool(getattr(self.arena, "stale", False))

    def undo(self) -> None:
        if self.ok:
            unregister_ptr(self.addr)
            self.ok = False
        self.view = None


class Registrations:
    """The arena mappings page-locked for DMA, by arena id (thread-safe)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Registration] = {}
        self._lock = threading.Lock()

    def register(self, arenas: list[Any]) -> set[str]:
        """Page-lock each mapping once; returns the ids of ``arenas`` that are. A
        registration holds its mapping (never unmapped while registered); one whose
        arena went stale (its worker is gone, or it was remapped) is undone here,
        before the mapping is let go, so no later DMA targets its pages."""
        with self._lock:
            for aid in [aid for aid, r in self._by_id.items() if r.stale()]:
                self._by_id.pop(aid).undo()
            for a in arenas:
                view = a.view
                old = self._by_id.get(a.id)
                if old is not None and old.covers(view):
                    continue
                if old is not None:
                    self._by_id.pop(a.id).undo()
                reg = self._by_id[a.id] = Registration.make(a, view)
                if not reg.ok:
                    log.warning("kvstore connector: arena %s could not be page-locked for "
                                "DMA; its blocks go through the pinned rows", a.id)  # fmt: skip
            return {a.id for a in arenas if (r := self._by_id.get(a.id)) is not None and r.ok}

    def undo_all(self) -> None:
        with self._lock:
            done, self._by_id = self._by_id, {}
        for r in done.values():
            r.undo()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, aid: object) -> bool:
        return aid in self._by_id

    def snapshot(self) -> dict[str, Registration]:
        with self._lock:
            return dict(self._by_id)


def host_address(view: memoryview) -> int:
    """The address of host memory ``view``."""
    return int(host_tensor(view).data_ptr()) if view.nbytes else 0
