"""vLLM connector: KV-cache blocks to and from a kvstore cluster (KVConnectorBase_V1).

Load it out of tree::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_client.connectors.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"master": "HOST:PORT"}}'

Settings (``kv_connector_extra_config``) are those of
:class:`~kvstore_client.connectors._common.ConnectorConfig`.

How a request flows (process and blocking noted per call):

- Scheduler process. ``get_num_new_matched_tokens`` hashes the request's full
  blocks (chained xxh3-128 of token ids plus LoRA / cache salt / multimodal keys,
  see :mod:`kvstore_client.prefix`) and asks the store once, batched, which are
  present; the call has a tight deadline (``lookup_timeout_s``): past it the answer
  is "no hit", so a slow store never stalls the scheduler. A full hit is capped at
  ``num_tokens - 1``. Hits shorter than ``min_hit_tokens`` or slower to load than to
  recompute (measured load bandwidth against ``prefill_tokens_per_s``) are skipped
  and counted. Hits load asynchronously: the request waits in
  WAITING_FOR_REMOTE_KVS while the other requests run.
  ``update_state_after_alloc`` turns the hit into (block id, hash) pairs;
  ``build_connector_meta`` ships them, plus, for every scheduled request, the full
  blocks that this step completes past the request's saved watermark and that the
  store did not hold at lookup (write only new blocks).
- Worker process. ``start_load_kv`` issues one batched asynchronous get per request
  (all workers in parallel) into a staging buffer; ``get_finished`` (each step, never
  blocking) copies the leading run of blocks that arrived into the paged KV cache and
  reports the request; blocks that turned out missing go to
  ``get_block_ids_with_load_errors`` and vLLM recomputes them.
  ``save_kv_layer`` copies the new blocks of each layer out of the KV cache while the
  forward runs; ``wait_for_save`` hands them to a background writer and returns, so
  the forward pass waits only for that copy.

Hybrid models (``SupportsHMA``): a prefix of k blocks is a hit only when all k KV
blocks AND the state at boundary k (namespace ``.../state``, same hash) are present.
This connector does not yet write state blocks, so models with several KV cache
groups (hybrid, or mixed attention kinds) run with loads and saves off: never a
wrong hit (see docs/CONNECTORS.md).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorStats,
)

from ..keys import leading_run
from ._common import (
    STATE_KIND,
    BandwidthMeter,
    ClientHolder,
    ConnectorConfig,
    Counters,
    LoadPolicy,
    RequestTracker,
    extra_keys,
    hybrid_hit_blocks,
    merge_stats,
    namespace,
    record,
    reduce_stats,
    stats_empty,
)

log = logging.getLogger(__name__)
NAME = "vllm"

# Live worker-side connectors of this process, for wait_for_saves().
_LIVE: weakref.WeakSet[KVStoreConnector] = weakref.WeakSet()


def wait_for_saves(timeout: float = 30.0) -> bool:
    """Block until every write handed off by this process's connectors is done.

    For tests and graceful shutdown; the engine itself never waits for writes.
    Returns False if some were still running at the deadline."""
    deadline = time.monotonic() + timeout
    return all(c._drain_saves(max(0.0, deadline - time.monotonic())) for c in list(_LIVE))


# ---- metadata --------------------------------------------------------------------


@dataclass
class _Transfer:
    """Blocks of one request to load or save: parallel lists."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]
    indices: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once per step: failed loads and load bandwidth samples."""

    failed: dict[str, list[int]] = field(default_factory=dict)
    load_samples: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVStoreWorkerMetadata):
            failed = dict(self.failed)
            for rid, idx in other.failed.items():
                failed[rid] = sorted({*failed.get(rid, []), *idx})
            return KVStoreWorkerMetadata(failed, [*self.load_samples, *other.load_samples])
        return self


@dataclass
class KVStoreConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters and latency samples of one interval (see _common.COUNTER_NAMES)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and other.data:
            self.data = merge_stats(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(reduce_stats(self.data))

    def is_empty(self) -> bool:
        return stats_empty(self.data)


# ---- helpers ---------------------------------------------------------------------


def _layout(vllm_config: Any, kv_cache_config: Any) -> tuple[str, bool]:
    """A layout tag the same in scheduler and workers; and whether the model is hybrid."""
    from vllm.platforms import current_platform  # type: ignore[import-not-found, unused-ignore]

    parts: list[str] = []
    layers = 0
    hybrid = False
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        layers += len(g.layer_names)
        heads = getattr(spec, "num_kv_heads", None)
        head = getattr(spec, "head_size", None)
        if heads is not None and head is not None:
            parts.append(f"{type(spec).__name__[:4].lower()}{len(g.layer_names)}x{heads}x{head}")
        else:
            hybrid = True
            parts.append(f"{type(spec).__name__[:5].lower()}{len(g.layer_names)}")
    layout = f"l{layers}-{'-'.join(parts)}-{current_platform.device_type}"
    if getattr(vllm_config.model_config, "use_mla", False):
        layout += "-mla"
    return layout, hybrid


def _ranks() -> tuple[int, int, int, int]:
    try:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
            get_pp_group,
            get_tp_group,
        )

        tp, pp = get_tp_group(), get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except Exception:  # groups not set up (single process without distributed init)
        return 0, 1, 0, 1


def _request_extra(request: Any) -> bytes:
    lora = getattr(request, "lora_request", None)
    mm = getattr(request, "mm_features", None) or []
    return extra_keys(
        lora=getattr(lora, "lora_name", None) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm_hashes=[str(getattr(f, "identifier", "")) for f in mm],
    )


def _block_parts(t: Any, num_blocks: int, block_id: int) -> list[Any]:
    """The views of one block in one layer's KV tensor: [t[b]] for block-major
    layouts, [t[0, b], t[1, b]] for K/V-split ones."""
    if t.shape[0] == num_blocks:
        return [t[block_id]]
    if t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [t[0, block_id], t[1, block_id]]
    raise ValueError(f"unknown KV cache layout {tuple(t.shape)} for {num_blocks} blocks")


@dataclass
class _PendingLoad:
    transfer: _Transfer
    staging: Any
    future: cf.Future[list[bool]]
    started: float


@dataclass
class _StepSave:
    transfers: list[_Transfer]
    refs: list[tuple[int, str, bytes, int]]  # (row, req_id, hash, block_id)
    staging: Any
    layers_done: set[str] = field(default_factory=set)


# ---- the connector -----------------------------------------------------------------


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """See the module docstring. One instance per role (scheduler, each worker)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._cfg = ConnectorConfig.from_dict(
            dict(self._kv_transfer_config.kv_connector_extra_config or {})
        )
        self._block = int(vllm_config.cache_config.block_size)
        layout, self._hybrid = _layout(vllm_config, kv_cache_config)
        mc = vllm_config.model_config
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        dtype = str(mc.dtype) if cache_dtype == "auto" else cache_dtype
        if role == KVConnectorRole.WORKER:
            tp, tps, pp, pps = _ranks()
        else:  # the scheduler looks up rank 0's keys
            par = vllm_config.parallel_config
            tp, tps = 0, int(par.tensor_parallel_size)
            pp, pps = 0, int(par.pipeline_parallel_size)
        model = self._cfg.model_id or str(mc.model)
        self._ns = namespace(
            model, dtype, layout, self._block, tp_rank=tp, tp_size=tps, pp_rank=pp, pp_size=pps
        )
        self._state_ns = namespace(
            model,
            dtype,
            layout,
            self._block,
            tp_rank=tp,
            tp_size=tps,
            pp_rank=pp,
            pp_size=pps,
            kind=STATE_KIND,
        )
        self._num_blocks = int(kv_cache_config.num_blocks)
        total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        self._bytes_per_token = total / max(1, self._num_blocks) / self._block
        self._interval = Counters()
        self._holder = ClientHolder(self._cfg.master, self._cfg.timeout_s)
        min_hit = self._cfg.min_hit_tokens if self._cfg.min_hit_tokens is not None else self._block
        self._policy = LoadPolicy(min_hit, self._cfg.prefill_tokens_per_s)
        self._multi_group = len(kv_cache_config.kv_cache_groups) > 1
        # Several cache groups (hybrid state, or mixed attention kinds): a block of
        # one group is not the model's whole state at that boundary. Until state
        # blocks are written, such models neither load nor store (always correct).
        self._active = not self._multi_group
        if not self._active:
            log.warning(
                "kvstore connector: %d KV cache groups (%s): loads and saves are off for "
                "this model; it runs as without the connector",
                len(kv_cache_config.kv_cache_groups),
                "hybrid" if self._hybrid else "mixed attention",
            )
        self._kv_group = 0
        for i, g in enumerate(kv_cache_config.kv_cache_groups):
            if getattr(g.kv_cache_spec, "num_kv_heads", None) is not None:
                self._kv_group = i
                break
        # scheduler side
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, Any] = {}
        self._loads_out: list[_Transfer] = []
        self._meter = BandwidthMeter()
        self._lookup_pool: cf.ThreadPoolExecutor | None = None
        # worker side
        self._layers: dict[str, Any] = {}
        self._layer_off: dict[str, int] = {}
        self._block_bytes = 0
        self._loads: dict[str, _PendingLoad] = {}
        self._invalid: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._worker_meta = KVStoreWorkerMetadata()
        self._step_save: _StepSave | None = None
        self._save_pool: cf.ThreadPoolExecutor | None = None
        self._save_futs: list[cf.Future[None]] = []
        self._pending_save_bytes = 0
        self._save_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            # A block missing at load is a cache miss: recompute it rather than fail
            # the request (vLLM's default policy is "fail"; it reads the policy
            # after making the connector). "load_failure_policy": "fail" keeps it.
            kvt = self._kv_transfer_config
            if self._cfg.load_failure_policy == "recompute":
                kvt.kv_load_failure_policy = "recompute"
            self._lookup_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-lookup")
        else:
            self._save_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
            _LIVE.add(self)
        self._holder.start()
        log.info("kvstore connector (%s) namespace %s, master %s", role, self._ns, self._cfg.master)

    # ---- properties the engine reads ----------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a future miss, not a lost hand-off."""
        return False

    @property
    def namespace(self) -> str:
        return self._ns

    # ==== scheduler side ============================================================

    def _lookup(self, ns: str, hashes: list[bytes]) -> list[bool]:
        """Which hashes the store holds, within the lookup deadline (else: none)."""
        miss = [False] * len(hashes)
        client = self._holder.get(wait=self._cfg.lookup_timeout_s)
        if client is None or not hashes or self._lookup_pool is None:
            return miss
        t0 = time.perf_counter()
        fut = self._lookup_pool.submit(client.batch_exists, ns, hashes)
        try:
            flags = fut.result(timeout=self._cfg.lookup_timeout_s)
        except cf.TimeoutError:
            record(NAME, self._interval, "lookup_timeouts", 1)
            return miss
        except Exception as e:
            log.warning("kvstore lookup failed: %s", e)
            return miss
        record(NAME, self._interval, "lookup_seconds", time.perf_counter() - t0)
        return flags

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler, per waiting request; may be called again for the same request
        (the store is asked once per token count). Returns (tokens to load, async)."""
        if not self._active:
            return 0, False
        rid = request.request_id
        tr = self._trackers.get(rid)
        if tr is None:
            tr = self._trackers[rid] = RequestTracker(rid, self._block, _request_extra(request))
        self._requests[rid] = request
        tokens = request.all_token_ids
        if tr.looked_up_tokens != len(tokens):
            tr.extend_hashes(tokens)
            tr.present = self._lookup(self._ns, tr.hashes)
            if self._hybrid:
                tr.state_present = self._lookup(self._state_ns, tr.hashes)
                tr.hit_blocks = hybrid_hit_blocks(tr.present, tr.state_present)
            else:
                tr.hit_blocks = leading_run(tr.present)
            tr.looked_up_tokens = len(tokens)
            record(NAME, self._interval, "lookups", 1)
            record(NAME, self._interval, "lookup_tokens", len(tokens))
        ext = tr.plan_hit(
            request.num_tokens,
            num_computed_tokens,
            self._policy,
            self._bytes_per_token,
            self._meter.bytes_per_s,
        )
        return ext, ext > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler, after blocks were allocated; plans the load of the hit."""
        tr = self._trackers.get(request.request_id)
        if tr is None:
            return
        block_ids = blocks.get_block_ids()[self._kv_group]
        if num_external_tokens > 0:
            refs = tr.plan_load(block_ids, num_external_tokens)
            if refs:
                self._loads_out.append(
                    _Transfer(
                        tr.req_id,
                        [r.block_id for r in refs],
                        [r.hash for r in refs],
                        [r.index for r in refs],
                    )
                )
            record(NAME, self._interval, "hit_tokens", num_external_tokens)
            tr.decision = "loading"
        elif tr.decision in ("short_hit", "slow_load"):
            name = "skipped_short_blocks" if tr.decision == "short_hit" else "skipped_slow_blocks"
            record(NAME, self._interval, name, tr.skipped_blocks())
            tr.decision = "counted"

    def _plan_save(self, tr: RequestTracker, computed: int, meta: KVStoreConnectorMetadata) -> None:
        req = self._requests.get(tr.req_id)
        if req is None:
            return
        refs, skipped = tr.blocks_to_save(computed, req.all_token_ids)
        record(NAME, self._interval, "skipped_present_blocks", skipped)
        if refs:
            meta.saves.append(
                _Transfer(
                    tr.req_id,
                    [r.block_id for r in refs],
                    [r.hash for r in refs],
                    [r.index for r in refs],
                )
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Scheduler, once per step: this step's loads and saves."""
        meta = KVStoreConnectorMetadata(loads=self._loads_out)
        self._loads_out = []
        if not self._active:
            return meta
        g = self._kv_group
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            tr.block_ids = list(new.block_ids[g])
            self._plan_save(tr, new.num_computed_tokens + sched.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._trackers.get(rid)
            if tr is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                if nb is not None:
                    tr.block_ids = list(nb[g])
            elif nb is not None:
                tr.block_ids.extend(nb[g])
            self._plan_save(tr, cached.num_computed_tokens[i] + sched.get(rid, 0), meta)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler: learn failed loads (those blocks get written again) and bandwidth."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVStoreWorkerMetadata):
            return
        for rid, idx in wm.failed.items():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.mark_missing(idx)
        for nbytes, secs in wm.load_samples:
            self._meter.add(nbytes, secs)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per request. Saves were copied out during the steps, so
        the blocks can be freed now (False)."""
        self._trackers.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """Either side: this interval's counters (None when nothing happened)."""
        d = self._interval.take()
        return None if stats_empty(d) else KVStoreConnectorStats(data=d)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVStoreConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data) if data else {})

    # ==== worker side ===============================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Worker, once: the paged KV tensors, one per layer (in model order)."""
        if not self._active:
            return
        self._layers = dict(kv_caches)
        off = 0
        for name, t in self._layers.items():
            self._layer_off[name] = off
            off += sum(p.numel() * p.element_size() for p in _block_parts(t, self._num_blocks, 0))
        self._block_bytes = off
        log.info("kvstore connector: %d layers, %d bytes per block", len(self._layers), off)

    def _copy(self, layer: str, t: Any, block_id: int, row: Any, to_cache: bool) -> None:
        off = self._layer_off[layer]
        for p in _block_parts(t, self._num_blocks, block_id):
            n = p.numel() * p.element_size()
            typed = row[off : off + n].view(p.dtype).view(p.shape)
            if to_cache:
                p.copy_(typed)
            else:
                typed.copy_(p)
            off += n

    def _staging(self, n: int) -> Any:
        return torch.empty((n, self._block_bytes), dtype=torch.uint8)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Worker, each step: start one batched get per request with a planned load.
        Never blocks on the store."""
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        client = self._holder.get()
        for tr in meta.loads:
            staging = self._staging(len(tr.hashes))
            fut: cf.Future[list[bool]]
            if client is None:
                fut = cf.Future()
                fut.set_result([False] * len(tr.hashes))
            else:
                self._inject_fault(client, tr.hashes)
                bufs = [memoryview(staging[i].numpy()) for i in range(len(tr.hashes))]
                fut = client.batch_get_into(self._ns, tr.hashes, bufs)
            self._loads[tr.req_id] = _PendingLoad(tr, staging, fut, time.perf_counter())

    def _inject_fault(self, client: Any, hashes: list[bytes]) -> None:
        """Tests only (``test_fault_file``): make blocks really miss before a load."""
        path = self._cfg.test_fault_file
        if not path:
            return
        try:
            with open(path) as f:
                k = int(json.load(f)["remove_from_block"])
        except (OSError, ValueError, KeyError):
            return
        if hashes[k:]:
            client.remove(self._ns, hashes[k:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (between steps): nothing of this forward waits."""
        return

    def _finish_load(self, pl: _PendingLoad) -> None:
        tr = pl.transfer
        try:
            flags = pl.future.result()
        except Exception as e:
            log.warning("kvstore load for %s failed: %s", tr.req_id, e)
            flags = [False] * len(tr.hashes)
        ok = leading_run(flags)
        for i in range(ok):
            row = pl.staging[i]
            for name, t in self._layers.items():
                self._copy(name, t, tr.block_ids[i], row, to_cache=True)
        secs = time.perf_counter() - pl.started
        nbytes = ok * self._block_bytes
        record(NAME, self._interval, "loaded_blocks", ok)
        record(NAME, self._interval, "loaded_bytes", nbytes)
        record(NAME, self._interval, "load_seconds", secs)
        self._worker_meta.load_samples.append((nbytes, secs))
        if ok < len(flags):
            failed = len(flags) - ok
            record(NAME, self._interval, "load_failed_blocks", failed)
            self._invalid.update(tr.block_ids[ok:])
            self._worker_meta.failed[tr.req_id] = tr.indices[ok:]
            self._failed_reqs.add(tr.req_id)

    def _done_loads(self) -> set[str]:
        done = {rid for rid, pl in self._loads.items() if pl.future.done()}
        for rid in done:
            self._finish_load(self._loads.pop(rid))
        return done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, each step, non-blocking: requests whose loads are complete (their
        blocks are in the KV cache now). Saves never hold blocks: (None, recving)."""
        done = self._done_loads()
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = self._done_loads()
        failed: set[str] = set()
        if self._multi_group:  # block ids are per group: report failures per request
            failed, self._failed_reqs = self._failed_reqs & done, self._failed_reqs - done
            self._invalid.clear()
        else:
            self._failed_reqs -= done
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker: block ids that were hits at lookup but did not arrive (recompute)."""
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        wm = self._worker_meta
        if not wm.failed and not wm.load_samples:
            return None
        self._worker_meta = KVStoreWorkerMetadata()
        return wm

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Worker, after each attention layer: copy this layer's new full blocks out of
        the KV cache into this step's staging buffer (the only time the forward waits)."""
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        step = self._step_save
        if step is None:
            step = self._begin_save(meta.saves)
            if step is None:
                return
        if layer_name in step.layers_done or layer_name not in self._layer_off:
            return
        for row, _, _, block_id in step.refs:
            self._copy(layer_name, kv_layer, block_id, step.staging[row], to_cache=False)
        step.layers_done.add(layer_name)

    def _begin_save(self, saves: list[_Transfer]) -> _StepSave | None:
        pairs = [
            (t.req_id, h, b) for t in saves for h, b in zip(t.hashes, t.block_ids, strict=True)
        ]
        refs = [(i, rid, h, b) for i, (rid, h, b) in enumerate(pairs)]
        limit = self._cfg.max_pending_save_mb << 20
        with self._save_lock:
            over = self._pending_save_bytes + len(refs) * self._block_bytes > limit
        if over or not self._layers:
            record(NAME, self._interval, "dropped_save_blocks", len(refs))
            self._step_save = _StepSave(saves, [], None, set(self._layers))
            return None
        self._step_save = _StepSave(saves, refs, self._staging(len(refs)))
        return self._step_save

    def wait_for_save(self) -> None:
        """Worker, once per step: finish the copy (layers the forward did not report)
        and hand the blocks to the background writer; returns without waiting."""
        meta = self._connector_metadata
        if self._step_save is None and isinstance(meta, KVStoreConnectorMetadata) and meta.saves:
            self._begin_save(meta.saves)
        step, self._step_save = self._step_save, None
        if step is None:
            return
        if not step.refs:
            return
        for name, t in self._layers.items():
            if name not in step.layers_done:
                for row, _, _, block_id in step.refs:
                    self._copy(name, t, block_id, step.staging[row], to_cache=False)
        nbytes = len(step.refs) * self._block_bytes
        with self._save_lock:
            self._pending_save_bytes += nbytes
        assert self._save_pool is not None
        fut = self._save_pool.submit(self._write, step, nbytes)
        self._save_futs = [f for f in self._save_futs if not f.done()]
        self._save_futs.append(fut)

    def _write(self, step: _StepSave, nbytes: int) -> None:
        """Background writer thread: one batched put for the step's blocks."""
        t0 = time.perf_counter()
        try:
            client = self._holder.get(wait=self._cfg.timeout_s)
            hashes = [h for _, _, h, _ in step.refs]
            if client is None:
                stored = [False] * len(hashes)
            else:
                views = [memoryview(step.staging[row].numpy()) for row, _, _, _ in step.refs]
                stored = client.batch_put(self._ns, hashes, views)
            n = sum(stored)
            record(NAME, self._interval, "stored_blocks", n)
            record(NAME, self._interval, "stored_bytes", n * self._block_bytes)
            record(NAME, self._interval, "store_failed_blocks", len(stored) - n)
            record(NAME, self._interval, "store_seconds", time.perf_counter() - t0)
        except Exception as e:  # a full store or a bug: the blocks are simply not cached
            log.warning("kvstore save of %d blocks failed: %s", len(step.refs), e)
            record(NAME, self._interval, "store_failed_blocks", len(step.refs))
        finally:
            with self._save_lock:
                self._pending_save_bytes -= nbytes

    def _drain_saves(self, timeout: float) -> bool:
        futs = list(self._save_futs)
        if not futs:
            return True
        _, not_done = cf.wait(futs, timeout=timeout)
        return not not_done

    def shutdown(self) -> None:
        """Either side: let queued writes finish (bounded), then close the client."""
        if self._save_pool is not None:
            self._drain_saves(self._cfg.timeout_s)
            self._save_pool.shutdown(wait=False, cancel_futures=True)
        if self._lookup_pool is not None:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._holder.close()
