"""A replay's records and their headline figures: what :mod:`.run` produces and
:mod:`.report` prints (both import this; neither imports the other).

:class:`ReplayConfig` says how to replay, :class:`RequestRecord` is what one request
measured, :class:`ReplayResult` a whole replay; :func:`summarize` turns one into flat
JSON-ready figures and :func:`load_model` fits its loads' cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..report import Summary, percentiles
from .cachesim import HitStats

__all__ = ["ReplayConfig", "ReplayResult", "RequestRecord", "load_model", "summarize"]


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """How to replay. Byte sizes: a block is ``block_tokens * bytes_per_token`` bytes.

    ``sessions``: top-level sessions replayed at once (1 = one after another, with
    sub-agents run inline: fully deterministic). ``time_scale``: a pause of x seconds
    in the trace lasts ``x * time_scale`` (0 = no pauses), at most ``max_pause`` seconds
    when that is above 0 (a session's later requests move up by what was cut). The four
    switches are the ablations: ``write_only_new`` (off: every block of each prompt is written),
    ``batched_lookup`` (off: one exists call per block), ``parallel_loads`` (off: one
    worker at a time), ``retain`` (off: a request's blocks are removed when it ends,
    as with no shared store). ``verify`` compares every loaded block with the bytes
    derived from its hash. ``buffer_bytes``: the pre-faulted buffer each running
    session loads into and stores from, in chunks of at most this many bytes.
    """

    bytes_per_token: int = 512
    model_bytes_per_token: int = 131072
    prefill_tokens_per_s: float = 10_000.0
    sessions: int = 8
    time_scale: float = 0.0
    max_pause: float = 0.0
    write_only_new: bool = True
    batched_lookup: bool = True
    parallel_loads: bool = True
    retain: bool = True
    verify: bool = True
    buffer_bytes: int = 32 << 20
    sessions_aware: bool = False  # send session hints (see _Hints)


@dataclass(slots=True)
class RequestRecord:
    """What one replayed request measured. Times are seconds; ``end`` is since start."""

    session: str
    end: float
    blocks: int
    matched: int
    hit: int
    tokens: int
    hit_tokens: int
    match_s: float
    load_s: float
    store_s: float
    loaded_bytes: int
    written_bytes: int
    skipped_bytes: int
    content_errors: int
    store_failed: int


@dataclass(slots=True)
class ReplayResult:
    """A replay's records, its offline reference figures and the store it ran against."""

    backend: str
    description: str
    config: ReplayConfig
    block_tokens: int
    block_bytes: int
    wall_s: float
    records: list[RequestRecord]
    ideal: HitStats
    lru: HitStats | None
    capacity_blocks: int | None
    label: str = ""
    opt: HitStats | None = None  # Belady's offline order at the same capacity

    def summary(self) -> dict[str, Any]:
        """The headline figures (see :func:`summarize`)."""
        return summarize(self)


# --------------------------------------------------------------------------- figures


def summarize(res: ReplayResult) -> Summary:
    """Headline figures of a replay, as a flat JSON-ready dict.

    Rates are fractions; latencies seconds (p50/p95/p99 over requests: match over all,
    load over those that loaded, store over those that wrote); bandwidths bytes/s
    (bytes over the summed time of the calls). Model scale: bytes times
    model_bytes_per_token / bytes_per_token, loaded in the time given by
    :func:`load_model` (a fixed cost per load plus bytes over the measured bandwidth).
    ``loads_not_worth_it`` counts requests whose lookup plus hit load at model scale
    took longer than recomputing the hit tokens at prefill_tokens_per_s.
    """
    cfg = res.config
    recs = res.records
    tok = sum(r.tokens for r in recs)
    tok_hit = sum(r.hit_tokens for r in recs)
    blocks = sum(r.blocks for r in recs)
    hit = sum(r.hit for r in recs)
    loaded = sum(r.loaded_bytes for r in recs)
    written = sum(r.written_bytes for r in recs)
    load_s = sum(r.load_s for r in recs)
    store_s = sum(r.store_s for r in recs)
    load_bw = loaded / load_s if load_s > 0 else math.nan
    store_bw = written / store_s if store_s > 0 else math.nan
    scale = cfg.model_bytes_per_token / cfg.bytes_per_token
    tps = cfg.prefill_tokens_per_s
    overhead, fit_bw = load_model(recs, load_bw)
    not_worth = 0
    model_load = 0.0
    for r in recs:
        if r.hit and fit_bw > 0:
            cost = overhead + r.loaded_bytes * scale / fit_bw
            model_load += cost
            not_worth += r.match_s + cost > r.hit_tokens / tps
    saved = tok_hit / tps
    out: Summary = {
        "label": res.label or res.backend,
        "backend": res.backend,
        "store": res.description,
        "sessions": cfg.sessions,
        "requests": len(recs),
        "wall_s": res.wall_s,
        "requests_per_s": len(recs) / res.wall_s if res.wall_s > 0 else math.nan,
        "block_tokens": res.block_tokens,
        "block_bytes": res.block_bytes,
        "capacity_blocks": res.capacity_blocks,
        "hit_rate_tokens": tok_hit / tok if tok else 0.0,
        "hit_rate_blocks": hit / blocks if blocks else 0.0,
        "ideal_hit_rate_tokens": res.ideal.token_hit_rate,
        "ideal_hit_rate_blocks": res.ideal.block_hit_rate,
        "lru_hit_rate_tokens": res.lru.token_hit_rate if res.lru else None,
        "lru_hit_rate_blocks": res.lru.block_hit_rate if res.lru else None,
        "opt_hit_rate_tokens": res.opt.token_hit_rate if res.opt else None,
        "opt_hit_rate_blocks": res.opt.block_hit_rate if res.opt else None,
        "tokens": tok,
        "tokens_hit": tok_hit,
        "blocks": blocks,
        "blocks_hit": hit,
        "bytes_loaded": loaded,
        "bytes_written": written,
        "bytes_skipped": sum(r.skipped_bytes for r in recs),
        "load_bytes_per_s": load_bw,
        "store_bytes_per_s": store_bw,
        "throughput_bytes_per_s": (loaded + written) / res.wall_s if res.wall_s > 0 else 0.0,
        "content_errors": sum(r.content_errors for r in recs),
        "load_misses": sum(r.matched - r.hit for r in recs),
        "store_failures": sum(r.store_failed for r in recs),
        "model_bytes_per_token": cfg.model_bytes_per_token,
        "model_bytes_loaded": loaded * scale,
        "model_load_s": model_load,
        "load_fit_bytes_per_s": fit_bw,
        "load_fit_overhead_s": overhead,
        "prefill_tokens_per_s": tps,
        "prefill_tokens_saved": tok_hit,
        "prefill_s_saved": saved,
        "prefill_s_saved_net": saved - model_load,
        "loads_not_worth_it": not_worth,
    }
    for name, xs in (
        ("match", [r.match_s for r in recs]),
        ("load", [r.load_s for r in recs if r.loaded_bytes]),
        ("store", [r.store_s for r in recs if r.written_bytes]),
    ):
        for q, v in zip((50, 95, 99), percentiles(xs), strict=True):
            out[f"{name}_p{q}_s"] = v
    return out


def load_model(recs: Sequence[Any], fallback_bw: float) -> tuple[float, float]:
    """(fixed seconds per load, bytes/s) fitted by least squares to the loads of
    ``recs`` (``load_s`` against ``loaded_bytes``). When the fit is degenerate (few or
    equal sizes, or a non-positive slope) it is (0, ``fallback_bw``)."""
    pts = [(r.loaded_bytes, r.load_s) for r in recs if r.loaded_bytes]
    xs = np.array([p[0] for p in pts], dtype=float)
    if len(pts) >= 3 and float(np.ptp(xs)) > 0:
        slope, icpt = np.polyfit(xs, [p[1] for p in pts], 1)
        if slope > 0:
            return max(0.0, float(icpt)), 1.0 / float(slope)
    return 0.0, fallback_bw if fallback_bw > 0 else 0.0
