"""The engine bench's numbers: per configuration summaries, the table, the JSON, the plots.

:func:`summarize` turns a :class:`~kvstore_bench.engine_run.ConfigRun` into a
:class:`Summary`: token hit rate beside the ideal (one cache shared by all engines) and
the per-engine ideal (each engine's own cache), prefill tokens computed, TTFT and
end-to-end percentiles, requests/s and input tokens/s, hit rate per turn number, the
requests where loading cost more than recomputing (compared with the same request in the
``prefix`` configuration: more tokens cached, yet a slower first token) and the output
check against ``prefix`` (first token's logprob within 0.05; share of equal greedy
outputs).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .paired import by_engine, compute_ms_per_token, paired
from .run import ConfigRun, Result
from .workload import Script, Timed, ideal_hits

__all__ = [
    "LOGPROB_TOL",
    "Summary",
    "busy_share",
    "failed",
    "failure_of",
    "plot",
    "sources_cell",
    "summarize",
    "table_rows",
    "to_json",
]

LOGPROB_TOL = 0.05


@dataclass(slots=True)
class Summary:
    name: str
    ran: bool
    why_not: str = ""
    note: str = ""
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_hit_rate: float = 0.0
    ideal_hit_rate: float = 0.0
    own_cache_ideal_hit_rate: float = 0.0
    prefill_tokens_computed: int = 0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    input_tokens_per_s: float = 0.0
    hit_rate_by_turn: dict[int, float] = field(default_factory=dict)
    ideal_by_turn: dict[int, float] = field(default_factory=dict)
    loads_slower_than_recompute: int | None = None
    first_logprob_within_tol: float | None = None
    equal_outputs: float | None = None
    # requests whose output differs from prefix's: where, how many tokens were cached in
    # each run, the first token's logprob difference, the first differing output position
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    # TTFT broken down, for requests with cached tokens ("hit") and without ("miss"):
    # count, p50 of TTFT, of the wait before the step that produced the first token
    # (lookup, waiting for remote KV, steps that did not schedule it) and of that step,
    # and the p50 and mean number of engine steps to the first token
    ttft_breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    # memory sweeps: the store memory of this point, the offline references of a shared
    # cache of that size (LRU and Belady's optimum, in the order this run's requests ran)
    # and, for a configuration that could not run with it, the least memory it accepts
    memory_bytes: int = 0
    ref_lru_hit_rate: float | None = None
    ref_opt_hit_rate: float | None = None
    # the store's share against the same references: what an LRU / Belady store of
    # that memory would have served beyond each request's own-cache tokens
    ref_lru_store_rate: float | None = None
    ref_opt_store_rate: float | None = None
    min_bytes: int = 0
    # --repeat N: every run's figures (ran, token_hit_rate, ttft_p50_ms,
    # input_tokens_per_s, wall_s) and the median hit rate; this summary is the run
    # whose TTFT p50 is the median (:mod:`.repeat`)
    repeats: list[dict[str, float]] = field(default_factory=list)
    median_hit_rate: float | None = None
    # every request as it ran, for comparisons of the same request across
    # configurations: script, turn, engine, prompt and cached tokens, the ideal's
    # tokens (one unlimited shared cache), arrival (s since the run started), TTFT and
    # its wait and step (ms), steps to the first token
    per_request: list[dict[str, Any]] = field(default_factory=list)
    # loads that failed and were recomputed (vLLM's "Recovered from KV load failure")
    load_failed_requests: int = 0
    load_failed_tokens: int = 0
    # why this run failed ("" if it did not): it did not run (a peer or its engines
    # did not start, or it refused the memory) or some of its requests failed. A failed
    # run is reported as such, never as a row of numbers, and the bench exits non-zero.
    failure: str = ""
    # the KV cache each engine allocated (as vLLM reported it when ready)
    engine_kv_blocks: list[int] = field(default_factory=list)
    engine_kv_tokens: list[int] = field(default_factory=list)
    # where the cached tokens came from (vLLM's prefill stats): the engines' own prefix
    # caches and the connector (the store); each over prompt tokens; None where vLLM
    # did not say for every request
    own_cache_tokens: int | None = None
    store_tokens: int | None = None
    own_cache_hit_rate: float | None = None
    store_hit_rate: float | None = None
    # the engines' busy share: wall time each engine had a request in flight, over
    # the run's wall time (mean over engines); 1.0 = never idle
    engine_busy_share: float | None = None


def failure_of(s: Summary) -> str:
    """Why the run of ``s`` counts as failed ("" if it does not)."""
    if not s.ran:
        return f"did not run: {s.why_not}"
    if s.failed:
        return f"{s.failed} of {s.requests + s.failed} requests failed"
    if not s.requests:
        return "no request completed"
    return ""


def failed(s: Summary) -> str:
    """Why ``s`` failed: its ``failure``, or that it did not run ("" if it ran well)."""
    return s.failure or ("" if s.ran else f"did not run: {s.why_not}")


def busy_share(spans: Sequence[tuple[int, float, float]], wall_s: float) -> float | None:
    """Mean over engines of the share of ``[0, wall_s]`` covered by that engine's
    ``(engine, start, end)`` request spans (their union); None without spans."""
    if wall_s <= 0 or not spans:
        return None
    by: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e, a, b in spans:
        by[e].append((max(0.0, a), min(wall_s, b)))
    shares: list[float] = []
    for iv in by.values():
        iv.sort()
        covered, cur_a, cur_b = 0.0, iv[0][0], iv[0][1]
        for a, b in iv[1:]:
            if a > cur_b:
                covered += max(0.0, cur_b - cur_a)
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        covered += max(0.0, cur_b - cur_a)
        shares.append(covered / wall_s)
    return sum(shares) / len(shares)


def percentiles(xs: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 (nearest rank) of the finite values of ``xs``; {} if none."""
    v = sorted(x for x in xs if math.isfinite(x))
    if not v:
        return {}

    def pick(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


def _key(r: Result) -> tuple[str, int]:
    return (r.script, r.turn)


def summarize(
    run: ConfigRun,
    scripts: Sequence[Script],
    block_size: int,
    reference: ConfigRun | None = None,
) -> Summary:
    """Numbers of one configuration; ``reference`` is the ``prefix`` run (if it ran)."""
    s = Summary(run.name, run.ran, run.why_not, run.note, min_bytes=run.min_bytes)
    s.engine_kv_blocks = list(run.engine_kv_blocks)
    s.engine_kv_tokens = list(run.engine_kv_tokens)
    s.failure = failure_of(s)
    if not run.ran:
        return s
    prompts = {(sc.id, t.index): t.prompt for sc in scripts for t in sc.turns}
    ok = [r for r in run.results if not r.error]
    s.requests = len(ok)
    s.failed = len(run.results) - len(ok)
    s.wall_s = run.wall_s
    s.load_failed_requests = run.load_failed_requests
    s.load_failed_tokens = run.load_failed_tokens
    s.failure = failure_of(s)
    if not ok:
        return s
    timed = [Timed(prompts[_key(r)], r.engine, r.start, r.end) for r in ok]
    shared, own = ideal_hits(timed, block_size)
    s.prompt_tokens = sum(r.prompt_tokens for r in ok)
    s.cached_tokens = sum(min(r.cached_tokens, r.prompt_tokens) for r in ok)
    s.token_hit_rate = s.cached_tokens / s.prompt_tokens
    s.ideal_hit_rate = sum(shared) / s.prompt_tokens
    s.own_cache_ideal_hit_rate = sum(own) / s.prompt_tokens
    s.prefill_tokens_computed = s.prompt_tokens - s.cached_tokens
    if all(r.local_cached_tokens >= 0 and r.external_cached_tokens >= 0 for r in ok):
        s.own_cache_tokens = sum(r.local_cached_tokens for r in ok)
        s.store_tokens = sum(r.external_cached_tokens for r in ok)
        s.own_cache_hit_rate = s.own_cache_tokens / s.prompt_tokens
        s.store_hit_rate = s.store_tokens / s.prompt_tokens
    s.engine_busy_share = busy_share([(r.engine, r.start, r.end) for r in ok], run.wall_s)
    s.ttfts_ms = [r.ttft_s * 1e3 for r in ok]
    s.ttft_ms = percentiles(s.ttfts_ms)
    s.ttft_breakdown = {
        k: _breakdown([r for r in ok if (r.cached_tokens > 0) == (k == "hit")])
        for k in ("hit", "miss")
    }
    s.e2e_ms = percentiles([r.e2e_s * 1e3 for r in ok])
    s.per_request = [_request(r, ideal) for r, ideal in zip(ok, shared, strict=True)]
    if run.wall_s > 0:
        s.requests_per_s = len(ok) / run.wall_s
        s.input_tokens_per_s = s.prompt_tokens / run.wall_s
    by_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r, ideal in zip(ok, shared, strict=True):
        acc = by_turn[r.turn]
        acc[0] += min(r.cached_tokens, r.prompt_tokens)
        acc[1] += ideal
        acc[2] += r.prompt_tokens
    s.hit_rate_by_turn = {k: v[0] / v[2] for k, v in sorted(by_turn.items())}
    s.ideal_by_turn = {k: v[1] / v[2] for k, v in sorted(by_turn.items())}
    if reference is not None and reference.ran and reference is not run:
        ref = {_key(r): r for r in reference.results if not r.error}
        pairs = [(r, ref[_key(r)]) for r in ok if _key(r) in ref]
        if pairs:
            s.loads_slower_than_recompute = sum(
                1 for r, p in pairs if r.cached_tokens > p.cached_tokens and r.ttft_s > p.ttft_s
            )
            close = [
                bool(
                    r.logprobs and p.logprobs and abs(r.logprobs[0] - p.logprobs[0]) <= LOGPROB_TOL
                )
                for r, p in pairs
            ]
            s.first_logprob_within_tol = sum(close) / len(close)
            s.equal_outputs = sum(1 for r, p in pairs if r.tokens == p.tokens) / len(pairs)
            s.mismatches = [_mismatch(r, p) for r, p in pairs if not _same(r, p)]
    return s


def timed_requests(run: ConfigRun, scripts: Sequence[Script]) -> list[Timed]:
    """The requests of ``run`` that succeeded, as they ran (for the references). A
    request starts when the engine began the step that produced its first token
    (``start + wait_s``), not when the bench sent it: with a small engine KV cache,
    requests wait in the engine's queue, and the engine looks a prefix up when it
    schedules the request; counted from the send, the references would see a store
    that had not yet taken the saves of every request that ran during the wait."""
    prompts = {(sc.id, t.index): t.prompt for sc in scripts for t in sc.turns}
    return [
        Timed(prompts[_key(r)], r.engine, r.start + max(0.0, r.wait_s), r.end)
        for r in run.results
        if not r.error
    ]


def _breakdown(rs: Sequence[Result]) -> dict[str, float]:
    if not rs:
        return {"count": 0}

    def p50(xs: list[float]) -> float:
        return percentiles(xs).get("p50", float("nan"))

    return {
        "count": len(rs),
        "ttft_p50_ms": p50([r.ttft_s * 1e3 for r in rs]),
        "wait_p50_ms": p50([r.wait_s * 1e3 for r in rs]),
        "step_p50_ms": p50([r.step_s * 1e3 for r in rs]),
        "steps_p50": p50([float(r.steps) for r in rs]),
        "steps_mean": sum(r.steps for r in rs) / len(rs),
    }


def _request(r: Result, ideal: int) -> dict[str, Any]:
    return {
        "script": r.script,
        "turn": r.turn,
        "engine": r.engine,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": min(r.cached_tokens, r.prompt_tokens),
        "ideal_tokens": ideal,
        "start_s": round(r.start, 4),
        "end_s": round(r.end, 4),
        "ttft_ms": round(r.ttft_s * 1e3, 3),
        "wait_ms": round(r.wait_s * 1e3, 3),
        "step_ms": round(r.step_s * 1e3, 3),
        "steps": r.steps,
        "own_cache_tokens": r.local_cached_tokens,
        "store_tokens": r.external_cached_tokens,
    }


def _same(r: Result, p: Result) -> bool:
    return r.tokens == p.tokens and _first_close(r, p)


def _mismatch(r: Result, p: Result) -> dict[str, Any]:
    diff = abs(r.logprobs[0] - p.logprobs[0]) if r.logprobs and p.logprobs else None
    pos = next(
        (i for i, (a, b) in enumerate(zip(r.tokens, p.tokens, strict=False)) if a != b), None
    )
    return {
        "script": r.script,
        "turn": r.turn,
        "engine": r.engine,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "prefix_cached_tokens": p.cached_tokens,
        "first_logprob_diff": diff,
        "first_differing_token": pos,
    }


def _first_close(r: Result, p: Result) -> bool:
    if not r.logprobs or not p.logprobs:
        return False
    return abs(r.logprobs[0] - p.logprobs[0]) <= LOGPROB_TOL


def to_json(summaries: Sequence[Summary], meta: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document: ``meta`` plus, per configuration name, its numbers."""
    configs: dict[str, Any] = {}
    for s in summaries:
        d = asdict(s)
        d.pop("ttfts_ms")
        d.pop("name")
        # the same requests side by side (:mod:`.paired`)
        d["compute_ms_per_token"] = compute_ms_per_token(s.per_request)
        d["by_engine"] = by_engine(s.per_request)
        d["paired"] = {
            o.name: paired(s.per_request, o.per_request)
            for o in summaries
            if o is not s and o.per_request and s.per_request
        }
        d["hit_rate_by_turn"] = {str(k): v for k, v in s.hit_rate_by_turn.items()}
        d["ideal_by_turn"] = {str(k): v for k, v in s.ideal_by_turn.items()}
        d["status"] = "failed" if failed(s) else "ok"
        d["failure"] = failed(s)
        configs[s.name] = d
    return {"meta": meta, "configs": configs}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _opt(x: int | None) -> str:
    return "-" if x is None else str(x)


def _ms(d: dict[str, float], k: str) -> str:
    return f"{d[k]:.0f}" if k in d else "-"


TABLE_COLUMNS = (
    "config",
    "hit rate",
    "ideal",
    "own-cache ideal",
    "prefill tok",
    "TTFT p50 ms",
    "p95",
    "p99",
    "e2e p50 ms",
    "req/s",
    "input tok/s",
    "own / store",
    "slow loads",
    "logprob ok",
    "equal out",
)


def table_rows(summaries: Sequence[Summary]) -> list[list[str]]:
    """One row of text cells per configuration (columns: :data:`TABLE_COLUMNS`)."""
    rows: list[list[str]] = []
    for s in summaries:
        if failed(s):
            why = failed(s) if len(failed(s)) <= 90 else failed(s)[:87] + "..."
            rows.append([s.name, f"FAILED: {why}"] + [""] * (len(TABLE_COLUMNS) - 2))
            continue
        rows.append(
            [
                s.name,
                _pct(s.token_hit_rate),
                _pct(s.ideal_hit_rate),
                _pct(s.own_cache_ideal_hit_rate),
                f"{s.prefill_tokens_computed:,}",
                _ms(s.ttft_ms, "p50"),
                _ms(s.ttft_ms, "p95"),
                _ms(s.ttft_ms, "p99"),
                _ms(s.e2e_ms, "p50"),
                f"{s.requests_per_s:.2f}",
                f"{s.input_tokens_per_s:,.0f}",
                sources_cell(s),
                "-"
                if s.loads_slower_than_recompute is None
                else str(s.loads_slower_than_recompute),
                _pct(s.first_logprob_within_tol),
                _pct(s.equal_outputs),
            ]
        )
    return rows


def sources_cell(s: Summary) -> str:
    """``own% / store%`` of prompt tokens ("-" where vLLM did not say)."""
    if s.own_cache_hit_rate is None or s.store_hit_rate is None:
        return "-"
    return f"{_pct(s.own_cache_hit_rate)} / {_pct(s.store_hit_rate)}"


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The table as GitHub markdown (for docs/BENCHMARKS.md)."""
    out = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(summaries)]
    return "\n".join(out)


def plot(summaries: Sequence[Summary], out_dir: Path, stem: str) -> list[Path]:
    """TTFT CDF per configuration, hit rate by turn, throughput bars; returns the PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [s for s in summaries if s.ran and s.requests]
    if not ran:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in ran:
        v = sorted(s.ttfts_ms)
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=s.name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("Time to first token")
    ax.legend()
    p = out_dir / f"{stem}-ttft-cdf.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in ran:
        ks = list(s.hit_rate_by_turn)
        ax.plot(ks, [100 * s.hit_rate_by_turn[k] for k in ks], marker="o", label=s.name)
    ideal = ran[0].ideal_by_turn
    ax.plot(list(ideal), [100 * v for v in ideal.values()], "k--", label="ideal (shared)")
    ax.set_xlabel("turn")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title("Hit rate by turn")
    ax.legend()
    p = out_dir / f"{stem}-hit-by-turn.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([s.name for s in ran], [s.input_tokens_per_s for s in ran])
    ax.set_ylabel("input tokens/s")
    ax.set_title("Throughput")
    p = out_dir / f"{stem}-throughput.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths
