"""What both sides of the vLLM connector share: the per-step metadata, the stats
class (and its Prometheus hook), and :class:`Setup` — the namespace, block size and
role decisions made the same way in the scheduler and in every worker."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ..config import ConnectorConfig
from ..naming import ModelIdentity, namespace, rank_namespaces
from ..planning import classify_groups, role_flags
from ..stats import COUNTER_NAMES, TIMER_NAMES, merge_stats, reduce_stats, stats_empty

log = logging.getLogger(__name__)
NAME = "vllm"


# ---- metadata --------------------------------------------------------------------


@dataclass
class Transfer:
    """Blocks of one request to load or save: parallel lists (``indices`` = the
    blocks' positions in the request; ``block_ids[j]`` = their ids in the j-th
    attention group). ``state`` (hybrid models, loads): the state block to fill,
    one id per state group, from the state stored under ``state_hash``."""

    req_id: str
    block_ids: list[list[int]]
    hashes: list[bytes]
    indices: list[int]
    state_ids: list[int] | None = None
    state_hash: bytes | None = None
    sync: bool = False  # loads: in the step that schedules the request (load_mode sync/auto)


@dataclass
class StateSave:
    """A boundary state vLLM offered this step: the state after block ``index``
    (hash ``hash``), in block ``block_ids[j]`` of the j-th state group."""

    req_id: str
    index: int
    hash: bytes
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    state_saves: list[StateSave] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests preempted this step


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once per step: failed loads, save outcomes (the save
    watermark moves only on ``saved``; ``save_failed`` blocks are planned again)
    and load bandwidth samples."""

    failed: dict[str, list[int]] = field(default_factory=dict)
    saved: dict[str, list[int]] = field(default_factory=dict)
    save_failed: dict[str, list[int]] = field(default_factory=dict)
    load_samples: list[tuple[int, float]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.failed or self.saved or self.save_failed or self.load_samples)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Across workers (TP ranks): a load failed if it failed on any rank; a save
        is done only when every rank saved it (any failure wins)."""
        if not isinstance(other, KVStoreWorkerMetadata):
            return self

        def union(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
            out = dict(a)
            for rid, idx in b.items():
                out[rid] = sorted({*out.get(rid, []), *idx})
            return out

        failed_saves = union(self.save_failed, other.save_failed)
        saved = union(self.saved, other.saved)
        saved = {
            r: [i for i in v if i not in set(failed_saves.get(r, []))] for r, v in saved.items()
        }
        return KVStoreWorkerMetadata(
            union(self.failed, other.failed),
            saved,
            failed_saves,
            [*self.load_samples, *other.load_samples],
        )


@dataclass
class KVStoreConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counters and latency samples of one interval (see stats.COUNTER_NAMES)."""

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


class KVStorePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The connector's counters on vLLM's own ``/metrics``: ``vllm:kvstore_<counter>``
    (counters) and ``vllm:kvstore_<op>_seconds`` (histograms), per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            n: self._counter_cls(
                name=f"vllm:kvstore_{n}",
                documentation=f"kvstore connector: {n}",
                labelnames=labelnames,
            )
            for n in COUNTER_NAMES
        }
        self._hists = {
            n: self._histogram_cls(
                name=f"vllm:kvstore_{n}",
                documentation=f"kvstore connector: {n}",
                labelnames=labelnames,
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
            )
            for n in TIMER_NAMES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, v in transfer_stats_data.items():
            if k in self._counters and v:
                self._counters[k].labels(*labels).inc(v)
            elif k in self._hists:
                h = self._hists[k].labels(*labels)
                for s in v:
                    h.observe(s)


# ---- set-up shared by both sides ----------------------------------------------------


def _ranks() -> tuple[int, int, int, int] | None:
    """This worker's (tp, tp_size, pp, pp_size) from vLLM's groups; None if unset."""
    try:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
            get_pp_group,
            get_tp_group,
        )

        tp, pp = get_tp_group(), get_pp_group()
        return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
    except (AssertionError, AttributeError, RuntimeError):  # groups not set up
        return None


def unsupported(vllm_config: Any) -> str | None:
    """Why this engine set-up cannot use the connector (None: it can)."""
    par = vllm_config.parallel_config
    dcp = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        return (
            f"context parallelism (decode {dcp}, prefill {pcp}) splits one block's tokens "
            "across ranks; the connector keys blocks per rank and does not support it"
        )
    return None


def identity(vllm_config: Any, cfg: ConnectorConfig) -> ModelIdentity:
    """The model's identity: ``model_id`` if set, else its full name or path with
    the revision; the quantization method either way."""
    mc = vllm_config.model_config
    quant = getattr(mc, "quantization", None)
    quant = str(quant) if quant else None
    if cfg.model_id:
        return ModelIdentity(cfg.model_id, None, quant)
    rev = getattr(mc, "revision", None)
    return ModelIdentity(str(mc.model), str(rev) if rev else None, quant)


@dataclass(slots=True)
class Setup:
    """Decisions both sides make alike from the engine's config.

    ``attn_groups``: the KV cache groups whose blocks are stored as KV (a value is
    one block of every layer of these groups, group after group); ``state_groups``:
    the recurrent-state groups whose boundary blocks go to the state namespace
    (empty for attention-only models); ``block``: tokens per block, vLLM's resolved
    size (enlarged for hybrid models), not ``cache_config.block_size``."""

    cfg: ConnectorConfig
    ident: ModelIdentity
    dtype: str
    layout: str
    block: int
    attn_groups: list[int]
    state_groups: list[int]
    may_load: bool
    may_save: bool
    active: bool
    tp_size: int
    pp_size: int
    mla: bool = False  # every TP rank holds the same latent cache: one shared namespace

    @property
    def hybrid(self) -> bool:
        return bool(self.state_groups)

    @property
    def _tp_shards(self) -> int:
        return 1 if self.mla else self.tp_size

    def ns(self, tp: int, pp: int, kind: str = "kv") -> str:
        """This rank's namespace; with MLA every TP rank shares ``tp0of1``."""
        return namespace(self.ident, self.dtype, self.layout, self.block,
                         tp_rank=0 if self.mla else tp, tp_size=self._tp_shards,
                         pp_rank=pp, pp_size=self.pp_size, kind=kind)  # fmt: skip

    def all_ns(self, kind: str = "kv") -> list[str]:
        return rank_namespaces(self.ident, self.dtype, self.layout, self.block,
                               self._tp_shards, self.pp_size, kind)  # fmt: skip


def make_setup(vllm_config: Any, kv_cache_config: Any, kv_transfer_config: Any) -> Setup:
    """Read the engine's config; raises ValueError on settings the connector cannot
    serve correctly (unknown keys, context parallelism, a bad ``kv_role``,
    ``load_mode: sync`` with several KV cache groups). Models
    whose cache groups it cannot serve run with it switched off (one warning)."""
    from vllm.platforms import current_platform  # type: ignore[import-not-found, unused-ignore]

    cfg = ConnectorConfig.from_dict(dict(kv_transfer_config.kv_connector_extra_config or {}))
    why = unsupported(vllm_config)
    if why:
        raise ValueError(f"kvstore connector: {why}")
    may_load, may_save = role_flags(getattr(kv_transfer_config, "kv_role", None))
    groups = list(kv_cache_config.kv_cache_groups)
    specs = [
        (type(g.kv_cache_spec).__name__, int(g.kv_cache_spec.block_size),
         getattr(g.kv_cache_spec, "mamba_cache_mode", None),
         int(getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0))
        for g in groups
    ]  # fmt: skip
    attn, state, why = classify_groups(specs)
    parts: list[str] = []
    layers = 0
    for g in groups:
        spec = g.kv_cache_spec
        layers += len(g.layer_names)
        heads = getattr(spec, "num_kv_heads", None)
        head = getattr(spec, "head_size", None)
        if heads is not None and head is not None:
            parts.append(f"{type(spec).__name__[:4].lower()}{len(g.layer_names)}x{heads}x{head}")
        else:
            shapes = "x".join(str(n) for sh in getattr(spec, "shapes", ()) for n in sh)
            parts.append(f"{type(spec).__name__[:5].lower()}{len(g.layer_names)}s{shapes}")
    layout = f"l{layers}-{'-'.join(parts)}-{current_platform.device_type}"
    if getattr(vllm_config.model_config, "use_mla", False):
        layout += "-mla"
    if why:
        log.warning("kvstore connector: switched off for this model: %s; the engine runs as "
                    "without the connector (never a wrong hit)", why)  # fmt: skip
    if why is None and cfg.load_mode == "sync" and len(groups) > 1:
        raise ValueError(
            "kvstore connector: load_mode sync is not supported for models with several KV "
            "cache groups (hybrid): vLLM cannot recompute a failed synchronous load there "
            '(it needs per-request failures, which only asynchronous loads report); use "async"'
        )
    block = specs[attn[0]][1] if attn else 1
    mc = vllm_config.model_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = str(mc.dtype) if cache_dtype == "auto" else cache_dtype
    par = vllm_config.parallel_config
    return Setup(
        cfg=cfg,
        ident=identity(vllm_config, cfg),
        dtype=dtype,
        layout=layout,
        block=block,
        attn_groups=attn,
        state_groups=state,
        may_load=may_load,
        may_save=may_save,
        active=why is None,
        tp_size=int(par.tensor_parallel_size),
        pp_size=int(par.pipeline_parallel_size),
        mla=bool(getattr(mc, "use_mla", False)),
    )
