"""The worker side of the vLLM connector: moves block bytes between vLLM's paged KV
cache and the store.

Zero copy (default): each layer tensor gets one byte view of its memory at
``register_kv_caches``; a block is the list of its per-layer runs (K and V apart
for split layouts), given to the client's multi-part calls: ``start_load_kv``
starts one ``batch_get_into_parts`` per request straight into its blocks (in-flight
bytes capped by ``max_pending_load_mb``), ``get_transfer_results`` reports it when
done; ``wait_for_save`` hands the step's block ids to a background writer (one
``batch_put_parts`` reading the cache). Since the writer reads the cache after the
step, a finished request's blocks are held (the scheduler's ``request_finished``
returns True) until :meth:`WorkerSide.finished_sends` reports its writes done, and
``handle_preemptions`` waits for writes of preempted requests. Layouts whose block
is not one run of CPU memory (or ``zero_copy: false``) use the staging path: one
``index_select`` per layer into a staging buffer, one ``index_copy_`` back; the
stored bytes are the same. The two store calls are :meth:`WorkerSide._get` and
:meth:`WorkerSide._put_rows`.

Hybrid models: a stored KV value is one block of every layer of the attention
groups; a stored state value is one block of every layer of the state groups (the
recurrent state after that many tokens), under the state namespace with the hash
of the block that ends at that boundary. A hybrid load fills the KV blocks and the
state block together, or reports the request as failed (never KV without state).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from ...keys import leading_run
from ..holder import ClientHolder
from ..naming import STATE_KIND
from ..planning import StagingBudget
from ..stats import Counters, record
from .common import NAME, KVStoreConnectorMetadata, KVStoreWorkerMetadata, Setup, Transfer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Layer:
    """One layer's cache tensor and where its part of a block sits in a stored
    value; ``group``: the position of its cache group among the attention groups
    (KV layers) or the state groups (state layers)."""

    tensor: Any
    offset: int
    nbytes: int
    kv_split: bool  # (2, num_blocks, ...) instead of (num_blocks, ...)
    group: int = 0
    flat: Any = None  # the tensor's storage as one writable byte view (zero copy), or None
    planes: tuple[int, ...] = ()  # byte offset of block 0 in each plane (K, V) of ``flat``
    stride: int = 0  # bytes from one block to the next in ``flat``
    why_not: str = ""  # why ``flat`` is None (the staging path is used)

    def parts(self, block: int) -> list[memoryview]:
        """Block ``block`` of this layer as byte views of the cache itself, in stored
        order (K then V for split layouts); needs ``flat``."""
        n = self.nbytes // len(self.planes)
        at = block * self.stride
        return [self.flat[p + at : p + at + n] for p in self.planes]

    def typed(self, staging: Any) -> Any:
        """The layer's part of each staging row, typed and shaped like its blocks
        (one row per block; K/V-split layers as (rows, 2, ...))."""
        t = self.tensor
        part = staging[:, self.offset : self.offset + self.nbytes].view(t.dtype)
        inner = (2, *t.shape[2:]) if self.kv_split else tuple(t.shape[1:])
        return part.view(staging.shape[0], *inner)

    def gather(self, idx: list[Any], staging: Any) -> None:
        """Blocks ``idx[group]`` of the cache -> staging rows (one index_select)."""
        t, i = self.tensor, idx[self.group]
        if self.kv_split:
            self.typed(staging).copy_(t.index_select(1, i).transpose(0, 1))
        else:
            self.typed(staging).copy_(t.index_select(0, i))

    def scatter(self, idx: list[Any], staging: Any) -> None:
        """Staging rows -> blocks ``idx[group]`` of the cache (one index_copy_)."""
        i = idx[self.group]
        if self.kv_split:
            self.tensor.index_copy_(1, i, self.typed(staging).transpose(0, 1))
        else:
            self.tensor.index_copy_(0, i, self.typed(staging))


def describe_layer(t: Any, num_blocks: int, offset: int, group: int = 0) -> _Layer:
    """How a layer's cache tensor holds blocks: block-major or K/V-split."""
    if t.shape[0] == num_blocks:
        split = False
        per = math.prod(t.shape[1:])
    elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        split = True
        per = 2 * math.prod(t.shape[2:])
    else:
        raise ValueError(f"unknown KV cache layout {tuple(t.shape)} for {num_blocks} blocks")
    layer = _Layer(t, offset, per * t.element_size(), split, group)
    _zero_copy_view(layer)
    return layer


def _zero_copy_view(layer: _Layer) -> None:
    """Sets ``layer.flat`` when each block of the layer (each K and V block of a
    split layout) is one contiguous run of CPU memory, else ``why_not``."""
    t = layer.tensor
    if t.device.type != "cpu":
        layer.why_not = f"its cache is on {t.device}, not in CPU memory"
        return
    if t.shape[1 if layer.kv_split else 0] == 0:
        layer.why_not = "it has no blocks"
        return
    block = t[0, 0] if layer.kv_split else t[0]
    if not block.is_contiguous():
        shape, strides = tuple(t.shape), t.stride()
        layer.why_not = f"a block is not one run of memory (shape {shape}, strides {strides})"
        return
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    es = t.element_size()
    first = t.storage_offset() * es
    layer.flat = memoryview(base.numpy())
    if layer.kv_split:
        layer.planes = (first, first + t.stride(0) * es)
        layer.stride = t.stride(1) * es
    else:
        layer.planes = (first,)
        layer.stride = t.stride(0) * es


def block_parts(layers: list[_Layer], idx: list[list[int]], row: int) -> list[memoryview]:
    """Row ``row`` of a transfer as the list of its parts in the cache: every layer
    in order (the stored byte order), block ``idx[layer.group][row]`` of each."""
    return [v for layer in layers for v in layer.parts(idx[layer.group][row])]


def _ids(groups: list[list[int]]) -> list[Any]:
    return [torch.tensor(g, dtype=torch.long) for g in groups]


@dataclass
class _PendingLoad:
    transfer: Transfer
    staging: Any
    state_staging: Any
    nbytes: int
    future: cf.Future[list[bool]]
    state_future: cf.Future[list[bool]] | None
    started: float

    def done(self) -> bool:
        return self.future.done() and (self.state_future is None or self.state_future.done())


@dataclass
class _StepSave:
    """One step's saves: staging rows (staging path) or, zero copy, the block ids
    the background writer reads straight from the cache (``staging`` None)."""

    refs: list[tuple[str, int, bytes]]  # (req_id, index, hash), row order
    ids: list[list[int]]  # per attention group, the block ids of the rows
    staging: Any
    state_refs: list[tuple[str, int, bytes]]
    state_ids: list[list[int]]
    state_staging: Any
    nbytes: int
    layers_done: set[str] = field(default_factory=set)
    idx: list[Any] = field(default_factory=list)  # ``ids`` as index tensors (staging)

    def requests(self) -> list[str]:
        return [r for r, _, _ in self.refs] + [r for r, _, _ in self.state_refs]


class WorkerSide:
    """One per worker process (TP / PP rank)."""

    def __init__(self, setup: Setup, kv_cache_config: Any, interval: Counters,
                 ranks: tuple[int, int, int, int]) -> None:  # fmt: skip
        self.s = setup
        self._interval = interval
        tp, _, pp, _ = ranks
        self.ns = setup.ns(tp, pp)
        self.state_ns = setup.ns(tp, pp, STATE_KIND)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._group_of: dict[str, tuple[str, int]] = {}
        for j, g in enumerate(setup.attn_groups):
            for name in kv_cache_config.kv_cache_groups[g].layer_names:
                self._group_of[name] = ("kv", j)
        for j, g in enumerate(setup.state_groups):
            for name in kv_cache_config.kv_cache_groups[g].layer_names:
                self._group_of[name] = ("state", j)
        self._holder = ClientHolder(setup.cfg.master, setup.cfg.timeout_s)
        self._layers: dict[str, _Layer] = {}
        self._state_layers: dict[str, _Layer] = {}
        self._block_bytes = 0
        self._state_bytes = 0
        self._budget = StagingBudget(setup.cfg.max_pending_load_mb << 20)
        self._queued: deque[Transfer] = deque()
        self._loads: dict[str, _PendingLoad] = {}
        self._invalid: set[int] = set()
        self._meta = KVStoreWorkerMetadata()
        self._meta_lock = threading.Lock()
        self._step: _StepSave | None = None
        self._step_seen = False
        self._save_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        self._save_futs: list[cf.Future[None]] = []
        self._pending_save_bytes = 0
        self._save_lock = threading.Lock()
        # Delayed freeing (zero-copy saves read the cache after the step): requests
        # that had saves planned, their saves not yet written, and those finished.
        self._saving: dict[str, int] = {}
        self._had_saves: set[str] = set()
        self._finishing: set[str] = set()
        self._zero_copy = False
        self.staging_allocs = 0  # staging buffers made (0 in steady state, zero copy)
        self._holder.start()

    # ---- set-up ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Once: the paged cache tensors, one per layer (in model order); a state
        layer may hold several tensors (e.g. conv and SSM state)."""
        if not self.s.active:
            return
        off = {"kv": 0, "state": 0}
        for name, value in kv_caches.items():
            kind, group = self._group_of.get(name, ("kv", 0))
            tensors = list(value) if isinstance(value, list | tuple) else [value]
            for i, t in enumerate(tensors):
                layer = describe_layer(t, self._num_blocks, off[kind], group)
                key = name if len(tensors) == 1 else f"{name}#{i}"
                (self._layers if kind == "kv" else self._state_layers)[key] = layer
                off[kind] += layer.nbytes
        self._block_bytes, self._state_bytes = off["kv"], off["state"]
        every = [*self._layers.items(), *self._state_layers.items()]
        why = next((f"layer {n}: {ly.why_not}" for n, ly in every if ly.flat is None), "")
        if not self.s.cfg.zero_copy:
            why = "zero_copy is off in the connector's config"
        self._zero_copy = not why
        if why:
            log.warning("kvstore connector: blocks go through a staging copy: %s", why)
        log.info("kvstore connector: %d KV layers (%d bytes per block), %d state tensors "
                 "(%d bytes per state), namespace %s", len(self._layers), off["kv"],
                 len(self._state_layers), off["state"], self.ns)  # fmt: skip

    def _staging(self, n: int, width: int) -> Any:
        self.staging_allocs += 1
        return torch.empty((n, width), dtype=torch.uint8)

    def _parts(self, state: bool, ids: list[list[int]], n: int) -> list[list[memoryview]]:
        layers = list((self._state_layers if state else self._layers).values())
        return [block_parts(layers, ids, row) for row in range(n)]

    # ---- loads --------------------------------------------------------------------

    def _get(self, ns: str, hashes: list[bytes], dest: Any) -> cf.Future[list[bool]]:
        """The one store read: blocks ``hashes`` into ``dest`` (a future): the
        staging rows (a tensor), or zero copy, per block the list of its parts in
        the cache (one multi-part read)."""
        client = self._holder.get()
        if client is None:
            fut: cf.Future[list[bool]] = cf.Future()
            fut.set_result([False] * len(hashes))
            return fut
        if isinstance(dest, list):
            return client.batch_get_into_parts(ns, hashes, dest)
        bufs = [memoryview(dest[i].numpy()) for i in range(len(hashes))]
        return client.batch_get_into(ns, hashes, bufs)

    def start_load_kv(self, meta: Any) -> None:
        """Each step: queue this step's loads and start those the staging cap allows.
        Never blocks on the store, except with ``load_mode: sync``: then it returns
        once every load of the step is in the cache (or failed: its blocks are
        reported by :meth:`block_ids_with_load_errors` and vLLM recomputes them)."""
        if isinstance(meta, KVStoreConnectorMetadata):
            self._queued.extend(meta.loads)
            self.note_saves(meta)
        self._start_queued()
        if self.s.cfg.load_mode == "sync":
            self._finish_all_loads()

    def _finish_all_loads(self) -> None:
        """``load_mode: sync``: wait for every started and queued load and copy it
        into the cache. Each wait is bounded by the client's deadline (``timeout_s``);
        these requests are running, so they are never reported as finished
        receiving, only their failed blocks."""
        while self._loads or self._queued:
            for rid in list(self._loads):
                pl = self._loads.pop(rid)
                self._finish_load(pl)  # waits for its futures
                record(NAME, self._interval, "sync_loaded_blocks", len(pl.transfer.hashes))
            self._start_queued()

    def _start_queued(self) -> None:
        while self._queued:
            tr = self._queued[0]
            hybrid = tr.state_hash is not None
            nbytes = len(tr.hashes) * self._block_bytes + (self._state_bytes if hybrid else 0)
            if not self._budget.admit(nbytes):
                return
            self._queued.popleft()
            state_hash = self._fault(tr)
            n = len(tr.hashes)
            staging, st_staging, st_fut = None, None, None
            if self._zero_copy:
                fut = self._get(self.ns, tr.hashes, self._parts(False, tr.block_ids, n))
            else:
                staging = self._staging(n, self._block_bytes)
                fut = self._get(self.ns, tr.hashes, staging)
            if state_hash is not None and tr.state_ids is not None:
                sids = [[b] for b in tr.state_ids]
                if self._zero_copy:
                    st_fut = self._get(self.state_ns, [state_hash], self._parts(True, sids, 1))
                else:
                    st_staging = self._staging(1, self._state_bytes)
                    st_fut = self._get(self.state_ns, [state_hash], st_staging)
            self._loads[tr.req_id] = _PendingLoad(
                tr, staging, st_staging, nbytes, fut, st_fut, time.perf_counter()
            )

    def _fault(self, tr: Transfer) -> bytes | None:
        """Tests only (``test_fault_file``, a JSON object read before each load):
        ``remove_from_block: k`` removes the load's blocks from k on from the store,
        so they really miss; ``state_from_index: i`` loads the state stored with the
        load's i-th hash instead of the right one (a wrong-state control).
        Returns the state hash to load."""
        path = self.s.cfg.test_fault_file
        state_hash = tr.state_hash
        if not path:
            return state_hash
        try:
            with open(path) as f:
                fault = json.load(f)
        except (OSError, ValueError):
            return state_hash
        client = self._holder.get()
        k = fault.get("remove_from_block")
        if client is not None and isinstance(k, int) and tr.hashes[k:]:
            client.remove(self.ns, tr.hashes[k:])
        i = fault.get("state_from_index")
        if state_hash is not None and isinstance(i, int) and 0 <= i < len(tr.hashes):
            state_hash = tr.hashes[i]
        return state_hash

    def _result(self, fut: cf.Future[list[bool]] | None, n: int, rid: str) -> list[bool]:
        if fut is None:
            return []
        try:
            return fut.result()
        except Exception as e:
            log.warning("kvstore load for %s failed: %s", rid, e)
            return [False] * n

    def _finish_load(self, pl: _PendingLoad) -> bool:
        """Copy what arrived into the cache; False when some of it did not. A hybrid
        load is all or nothing: KV blocks without their state are never used."""
        tr = pl.transfer
        flags = self._result(pl.future, len(tr.hashes), tr.req_id)
        ok = leading_run(flags)
        state_ok = pl.state_future is None or all(self._result(pl.state_future, 1, tr.req_id))
        if pl.state_future is not None and not (state_ok and ok == len(flags)):
            ok, state_ok = 0, False
        if ok and pl.staging is not None:  # zero copy: the blocks are in place
            rows = pl.staging[:ok]
            idx = _ids([ids[:ok] for ids in tr.block_ids])
            for layer in self._layers.values():
                layer.scatter(idx, rows)
        if pl.state_future is not None and state_ok and tr.state_ids is not None:
            if pl.state_staging is not None:
                sidx = _ids([[b] for b in tr.state_ids])
                for layer in self._state_layers.values():
                    layer.scatter(sidx, pl.state_staging)
            record(NAME, self._interval, "loaded_states", 1)
        self._budget.release(pl.nbytes)
        secs = time.perf_counter() - pl.started
        nbytes = ok * self._block_bytes
        record(NAME, self._interval, "loaded_blocks", ok)
        record(NAME, self._interval, "loaded_bytes", nbytes)
        record(NAME, self._interval, "load_seconds", secs)
        lost = ok < len(flags) or not state_ok
        with self._meta_lock:
            self._meta.load_samples.append((nbytes, secs))
            if lost:
                self._meta.failed[tr.req_id] = tr.indices[ok:] or tr.indices[-1:]
        if lost:
            record(NAME, self._interval, "load_failed_blocks", len(flags) - ok)
            for ids in tr.block_ids:
                self._invalid.update(ids[ok:])
            return False
        return True

    def done_loads(self) -> tuple[set[str], set[str]]:
        """Non-blocking: (requests whose loads are complete, those of them that
        lost blocks). Starts queued loads as staging frees up."""
        done = {rid for rid, pl in self._loads.items() if pl.done()}
        failed = {rid for rid in done if not self._finish_load(self._loads.pop(rid))}
        if done:
            self._start_queued()
        return done, failed

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_meta(self) -> KVStoreWorkerMetadata | None:
        with self._meta_lock:
            wm = self._meta
            if wm.empty():
                return None
            self._meta = KVStoreWorkerMetadata()
        return wm

    # ---- saves --------------------------------------------------------------------

    def _report_saves(self, refs: list[tuple[str, int, bytes]], ok: list[bool]) -> None:
        with self._meta_lock:
            for (rid, index, _), good in zip(refs, ok, strict=True):
                d = self._meta.saved if good else self._meta.save_failed
                d.setdefault(rid, []).append(index)

    def note_saves(self, meta: Any) -> None:
        """Each step (idempotent): remember the requests this step saves for, whose
        blocks the scheduler holds after they finish until :meth:`finished_sends`
        reports them (see SchedulerSide.request_finished)."""
        if isinstance(meta, KVStoreConnectorMetadata):
            self._had_saves.update(t.req_id for t in meta.saves)
            self._had_saves.update(x.req_id for x in meta.state_saves)

    def finished_sends(self, finished_req_ids: set[str]) -> set[str]:
        """Each step, non-blocking: finished requests that had saves, once none of
        their writes is still reading the cache (their blocks may then be freed)."""
        self._finishing.update(r for r in finished_req_ids if r in self._had_saves)
        with self._save_lock:
            out = {r for r in self._finishing if not self._saving.get(r)}
        self._finishing -= out
        self._had_saves -= out
        return out

    def handle_preemptions(self, meta: Any) -> None:
        """Before a step's forward: a preempted request's blocks are freed at once
        and may be overwritten by this step, so wait for writes still reading them
        (zero copy only; rare, bounded by ``timeout_s``)."""
        gone = getattr(meta, "preempted", None) or ()
        with self._save_lock:
            busy = any(self._saving.get(r) for r in gone)
        if busy and not self.drain_saves(self.s.cfg.timeout_s):
            log.warning("kvstore connector: saves of preempted requests still running")

    def _begin_save(self, meta: Any) -> _StepSave | None:
        self._step_seen = True
        if not isinstance(meta, KVStoreConnectorMetadata):
            return None
        self.note_saves(meta)
        saves = meta.saves
        states = meta.state_saves if self._state_layers else []
        if not saves and not states:
            return None
        refs = [(t.req_id, i, h) for t in saves for i, h in zip(t.indices, t.hashes, strict=True)]
        groups = max(1, len(self.s.attn_groups))
        ids = [[b for t in saves for b in t.block_ids[j]] for j in range(groups)]
        srefs = [(x.req_id, x.index, x.hash) for x in states]
        sids = [[x.block_ids[j] for x in states] for j in range(len(self.s.state_groups))]
        need = len(refs) * self._block_bytes + len(srefs) * self._state_bytes
        limit = self.s.cfg.max_pending_save_mb << 20
        with self._save_lock:
            over = self._pending_save_bytes + need > limit
        if over or not self._layers:
            record(NAME, self._interval, "dropped_save_blocks", len(refs) + len(srefs))
            self._report_saves(refs, [False] * len(refs))
            return None
        if self._zero_copy:  # the writer reads the cache itself: nothing to gather
            self._step = _StepSave(refs, ids, None, srefs, sids, None, need)
        else:
            self._step = _StepSave(
                refs, ids, self._staging(len(refs), self._block_bytes),
                srefs, sids, self._staging(len(srefs), self._state_bytes) if srefs else None,
                need,
            )  # fmt: skip
            self._step.idx = _ids(ids)
        return self._step

    def save_kv_layer(self, layer_name: str, meta: Any) -> None:
        """After each attention layer: gather this layer's new blocks from the
        registered KV tensor (the only time the forward waits)."""
        step = self._step if self._step_seen else self._begin_save(meta)
        if step is None or step.staging is None or not step.refs:
            return
        layer = self._layers.get(layer_name)
        if layer is not None and layer_name not in step.layers_done:
            layer.gather(step.idx, step.staging)
            step.layers_done.add(layer_name)

    def wait_for_save(self, meta: Any) -> None:
        """Once per step: gather the layers the forward did not report and this
        step's boundary states, and hand them to the background writer; returns
        without waiting for the store."""
        step = self._step if self._step_seen else self._begin_save(meta)
        self._step, self._step_seen = None, False
        if step is None:
            return
        if step.refs and step.staging is not None:
            for name, layer in self._layers.items():
                if name not in step.layers_done:
                    layer.gather(step.idx, step.staging)
        if step.state_refs and step.state_staging is not None:
            sidx = _ids(step.state_ids)
            for layer in self._state_layers.values():
                layer.gather(sidx, step.state_staging)
        with self._save_lock:
            self._pending_save_bytes += step.nbytes
            for r in step.requests():
                self._saving[r] = self._saving.get(r, 0) + 1
        fut = self._save_pool.submit(self._put, step)
        self._save_futs = [f for f in self._save_futs if not f.done()]
        self._save_futs.append(fut)

    def _put_rows(self, client: Any, ns: str, hashes: list[bytes], src: Any) -> list[bool]:
        """The one store write: one batched put of ``src`` (the staging rows, or zero
        copy, per block the list of its parts in the cache); True per block that is
        in the store afterwards (written now, or already there by another writer)."""
        if isinstance(src, list):
            ok = list(client.batch_put_parts(ns, hashes, src))
        else:
            views = [memoryview(src[row].numpy()) for row in range(len(hashes))]
            ok = list(client.batch_put(ns, hashes, views))
        rest = [i for i, s in enumerate(ok) if not s]
        if rest:  # already there (another writer), or its worker was down?
            there = client.batch_exists(ns, [hashes[i] for i in rest])
            for i, t in zip(rest, there, strict=True):
                ok[i] = t
        return ok

    def _put(self, step: _StepSave) -> None:
        """Background writer: the store writes of a step (KV blocks, then states)."""
        t0 = time.perf_counter()
        hashes = [h for _, _, h in step.refs]
        ok = [False] * len(hashes)
        try:
            client = self._holder.get(wait=self.s.cfg.timeout_s)
            if client is not None:
                if hashes:
                    src = step.staging
                    if src is None:
                        src = self._parts(False, step.ids, len(hashes))
                    ok = self._put_rows(client, self.ns, hashes, src)
                    record(NAME, self._interval, "stored_blocks", sum(ok))
                    record(NAME, self._interval, "stored_bytes", sum(ok) * self._block_bytes)
                if step.state_refs:
                    ssrc = step.state_staging
                    if ssrc is None:
                        ssrc = self._parts(True, step.state_ids, len(step.state_refs))
                    st = self._put_rows(client, self.state_ns, [h for _, _, h in step.state_refs],
                                        ssrc)  # fmt: skip
                    record(NAME, self._interval, "stored_states", sum(st))
            record(NAME, self._interval, "store_seconds", time.perf_counter() - t0)
        except Exception as e:  # a full store or a bug: the blocks are simply not cached
            log.warning("kvstore save of %d blocks failed: %s", len(hashes), e)
        finally:
            record(NAME, self._interval, "store_failed_blocks", ok.count(False))
            self._report_saves(step.refs, ok)
            with self._save_lock:
                self._pending_save_bytes -= step.nbytes
                for r in step.requests():
                    left = self._saving.get(r, 0) - 1
                    if left > 0:
                        self._saving[r] = left
                    else:
                        self._saving.pop(r, None)

    def drain_saves(self, timeout: float) -> bool:
        futs = list(self._save_futs)
        if not futs:
            return True
        _, not_done = cf.wait(futs, timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        self.drain_saves(self.s.cfg.timeout_s)
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        self._holder.close()
