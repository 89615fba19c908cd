"""The worker side of the vLLM connector: moves block bytes between vLLM's paged KV
cache and the store.

Loads: ``start_load_kv`` starts one batched asynchronous get per request into a
staging buffer (bytes of staging in flight are capped by ``max_pending_load_mb``;
later loads wait in a queue); ``get_transfer_results`` copies the leading run of
blocks that arrived into the KV cache with one ``index_copy_`` per layer and
reports the request. Saves: ``save_kv_layer`` gathers the step's new blocks of a
layer with one ``index_select`` into a staging buffer; ``wait_for_save`` hands the
buffer to a background writer (one batched put). The two store calls live in
:meth:`WorkerSide._get` and :meth:`WorkerSide._put`, one function each.
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
from ..planning import StagingBudget
from ..stats import Counters, record
from .common import NAME, KVStoreConnectorMetadata, KVStoreWorkerMetadata, Setup, Transfer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Layer:
    """One layer's KV tensor and where its part of a block sits in a stored value."""

    tensor: Any
    offset: int
    nbytes: int
    kv_split: bool  # (2, num_blocks, ...) instead of (num_blocks, ...)

    def typed(self, staging: Any) -> Any:
        """The layer's part of each staging row, typed and shaped like its blocks
        (one row per block; K/V-split layers as (rows, 2, ...))."""
        t = self.tensor
        part = staging[:, self.offset : self.offset + self.nbytes].view(t.dtype)
        inner = (2, *t.shape[2:]) if self.kv_split else tuple(t.shape[1:])
        return part.view(staging.shape[0], *inner)

    def gather(self, idx: Any, staging: Any) -> None:
        """Blocks ``idx`` of the KV cache -> staging rows (one index_select)."""
        t = self.tensor
        if self.kv_split:
            self.typed(staging).copy_(t.index_select(1, idx).transpose(0, 1))
        else:
            self.typed(staging).copy_(t.index_select(0, idx))

    def scatter(self, idx: Any, staging: Any) -> None:
        """Staging rows -> blocks ``idx`` of the KV cache (one index_copy_)."""
        if self.kv_split:
            self.tensor.index_copy_(1, idx, self.typed(staging).transpose(0, 1))
        else:
            self.tensor.index_copy_(0, idx, self.typed(staging))


def describe_layer(t: Any, num_blocks: int, offset: int) -> _Layer:
    """How a layer's KV tensor holds blocks: block-major or K/V-split."""
    if t.shape[0] == num_blocks:
        split = False
        per = math.prod(t.shape[1:])
    elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        split = True
        per = 2 * math.prod(t.shape[2:])
    else:
        raise ValueError(f"unknown KV cache layout {tuple(t.shape)} for {num_blocks} blocks")
    return _Layer(t, offset, per * t.element_size(), split)


@dataclass
class _PendingLoad:
    transfer: Transfer
    staging: Any
    nbytes: int
    future: cf.Future[list[bool]]
    started: float


@dataclass
class _StepSave:
    refs: list[tuple[str, int, bytes, int]]  # (req_id, index, hash, block_id), row order
    staging: Any
    idx: Any
    layers_done: set[str] = field(default_factory=set)


class WorkerSide:
    """One per worker process (TP / PP rank)."""

    def __init__(self, setup: Setup, kv_cache_config: Any, interval: Counters,
                 ranks: tuple[int, int, int, int]) -> None:  # fmt: skip
        self.s = setup
        self._interval = interval
        tp, _, pp, _ = ranks
        self.ns = setup.ns(tp, pp)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._holder = ClientHolder(setup.cfg.master, setup.cfg.timeout_s)
        self._layers: dict[str, _Layer] = {}
        self._block_bytes = 0
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
        self._holder.start()

    # ---- set-up ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Once: the paged KV tensors, one per layer (in model order)."""
        if not self.s.active:
            return
        off = 0
        for name, t in kv_caches.items():
            layer = describe_layer(t, self._num_blocks, off)
            self._layers[name] = layer
            off += layer.nbytes
        self._block_bytes = off
        log.info("kvstore connector: %d layers, %d bytes per block, namespace %s",
                 len(self._layers), off, self.ns)  # fmt: skip

    def _staging(self, n: int) -> Any:
        return torch.empty((n, self._block_bytes), dtype=torch.uint8)

    # ---- loads --------------------------------------------------------------------

    def _get(self, hashes: list[bytes], staging: Any) -> cf.Future[list[bool]]:
        """The one store read: blocks ``hashes`` into the staging rows (a future)."""
        client = self._holder.get()
        if client is None:
            fut: cf.Future[list[bool]] = cf.Future()
            fut.set_result([False] * len(hashes))
            return fut
        self._inject_fault(client, hashes)
        bufs = [memoryview(staging[i].numpy()) for i in range(len(hashes))]
        return client.batch_get_into(self.ns, hashes, bufs)

    def start_load_kv(self, meta: Any) -> None:
        """Each step: queue this step's loads and start those the staging cap allows.
        Never blocks on the store."""
        if isinstance(meta, KVStoreConnectorMetadata):
            self._queued.extend(meta.loads)
        self._start_queued()

    def _start_queued(self) -> None:
        while self._queued:
            tr = self._queued[0]
            nbytes = len(tr.hashes) * self._block_bytes
            if not self._budget.admit(nbytes):
                return
            self._queued.popleft()
            staging = self._staging(len(tr.hashes))
            fut = self._get(tr.hashes, staging)
            self._loads[tr.req_id] = _PendingLoad(tr, staging, nbytes, fut, time.perf_counter())

    def _inject_fault(self, client: Any, hashes: list[bytes]) -> None:
        """Tests only (``test_fault_file``): make blocks really miss before a load."""
        path = self.s.cfg.test_fault_file
        if not path:
            return
        try:
            with open(path) as f:
                k = int(json.load(f)["remove_from_block"])
        except (OSError, ValueError, KeyError):
            return
        if hashes[k:]:
            client.remove(self.ns, hashes[k:])

    def _finish_load(self, pl: _PendingLoad) -> bool:
        """Copy what arrived into the KV cache; False when some blocks did not."""
        tr = pl.transfer
        try:
            flags = pl.future.result()
        except Exception as e:
            log.warning("kvstore load for %s failed: %s", tr.req_id, e)
            flags = [False] * len(tr.hashes)
        ok = leading_run(flags)
        if ok:
            idx = torch.tensor(tr.block_ids[:ok], dtype=torch.long)
            rows = pl.staging[:ok]
            for layer in self._layers.values():
                layer.scatter(idx, rows)
        self._budget.release(pl.nbytes)
        secs = time.perf_counter() - pl.started
        nbytes = ok * self._block_bytes
        record(NAME, self._interval, "loaded_blocks", ok)
        record(NAME, self._interval, "loaded_bytes", nbytes)
        record(NAME, self._interval, "load_seconds", secs)
        with self._meta_lock:
            self._meta.load_samples.append((nbytes, secs))
            if ok < len(flags):
                self._meta.failed[tr.req_id] = tr.indices[ok:]
        if ok < len(flags):
            record(NAME, self._interval, "load_failed_blocks", len(flags) - ok)
            self._invalid.update(tr.block_ids[ok:])
            return False
        return True

    def done_loads(self) -> tuple[set[str], set[str]]:
        """Non-blocking: (requests whose loads are complete, those of them that
        lost blocks). Starts queued loads as staging frees up."""
        done = {rid for rid, pl in self._loads.items() if pl.future.done()}
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

    def _report_saves(self, refs: list[tuple[str, int, bytes, int]], ok: list[bool]) -> None:
        with self._meta_lock:
            for (rid, index, _, _), good in zip(refs, ok, strict=True):
                d = self._meta.saved if good else self._meta.save_failed
                d.setdefault(rid, []).append(index)

    def _begin_save(self, meta: Any) -> _StepSave | None:
        self._step_seen = True
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return None
        refs = [
            (t.req_id, i, h, b)
            for t in meta.saves
            for i, h, b in zip(t.indices, t.hashes, t.block_ids, strict=True)
        ]
        limit = self.s.cfg.max_pending_save_mb << 20
        with self._save_lock:
            over = self._pending_save_bytes + len(refs) * self._block_bytes > limit
        if over or not self._layers:
            record(NAME, self._interval, "dropped_save_blocks", len(refs))
            self._report_saves(refs, [False] * len(refs))
            return None
        idx = torch.tensor([b for *_, b in refs], dtype=torch.long)
        self._step = _StepSave(refs, self._staging(len(refs)), idx)
        return self._step

    def save_kv_layer(self, layer_name: str, meta: Any) -> None:
        """After each attention layer: gather this layer's new blocks from the
        registered KV tensor (the only time the forward waits)."""
        step = self._step if self._step_seen else self._begin_save(meta)
        if step is None or layer_name in step.layers_done:
            return
        layer = self._layers.get(layer_name)
        if layer is not None:
            layer.gather(step.idx, step.staging)
            step.layers_done.add(layer_name)

    def wait_for_save(self, meta: Any) -> None:
        """Once per step: gather the layers the forward did not report and hand the
        blocks to the background writer; returns without waiting for the store."""
        step = self._step if self._step_seen else self._begin_save(meta)
        self._step, self._step_seen = None, False
        if step is None:
            return
        for name, layer in self._layers.items():
            if name not in step.layers_done:
                layer.gather(step.idx, step.staging)
        nbytes = len(step.refs) * self._block_bytes
        with self._save_lock:
            self._pending_save_bytes += nbytes
        fut = self._save_pool.submit(self._put, step, nbytes)
        self._save_futs = [f for f in self._save_futs if not f.done()]
        self._save_futs.append(fut)

    def _put(self, step: _StepSave, nbytes: int) -> None:
        """Background writer: the one store write for a step's blocks. A block counts
        as saved when it is in the store afterwards (written now, or already there)."""
        t0 = time.perf_counter()
        hashes = [h for _, _, h, _ in step.refs]
        ok = [False] * len(hashes)
        try:
            client = self._holder.get(wait=self.s.cfg.timeout_s)
            if client is not None:
                views = [memoryview(step.staging[row].numpy()) for row in range(len(hashes))]
                stored = client.batch_put(self.ns, hashes, views)
                n = sum(stored)
                record(NAME, self._interval, "stored_blocks", n)
                record(NAME, self._interval, "stored_bytes", n * self._block_bytes)
                ok = list(stored)
                rest = [i for i, s in enumerate(stored) if not s]
                if rest:  # already there (another writer), or its worker was down?
                    there = client.batch_exists(self.ns, [hashes[i] for i in rest])
                    for i, t in zip(rest, there, strict=True):
                        ok[i] = t
            record(NAME, self._interval, "store_seconds", time.perf_counter() - t0)
        except Exception as e:  # a full store or a bug: the blocks are simply not cached
            log.warning("kvstore save of %d blocks failed: %s", len(hashes), e)
        finally:
            record(NAME, self._interval, "store_failed_blocks", ok.count(False))
            self._report_saves(step.refs, ok)
            with self._save_lock:
                self._pending_save_bytes -= nbytes

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
