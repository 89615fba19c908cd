"""`kvstore bench engine --memory-sweep F1,F2,...`: every configuration at each point of
store memory, as a fraction of the measured working set (:mod:`.memory`).

Each point gives every store the same bytes: kvstore's DRAM (split over its workers),
Mooncake's segment, LMCache's L1. ``prefix`` has no store, so it runs once and stands at
every point. A configuration that cannot run with a point's memory is reported with its
reason and, where known, the least memory it accepts; the sweep goes on.

Output: a table (hit rate against the offline LRU and optimum of a shared cache of that
size, TTFT p50/p95/p99, input tokens/s, prefill tokens computed), the ``sweep`` list of
the JSON and two plots (hit rate against memory, TTFT p50 against memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .report import Summary, failed, sources_cell, to_json

__all__ = ["Point", "parse_fractions", "sweep_json", "sweep_markdown", "sweep_plots", "sweep_rows"]


@dataclass(slots=True)
class Point:
    fraction: float
    memory_bytes: int
    summaries: list[Summary] = field(default_factory=list)


def parse_fractions(text: str) -> list[float]:
    """``"0.125,0.25,1"`` -> [0.125, 0.25, 1.0]; ValueError unless every one is in (0, 4]."""
    out = [float(x) for x in text.split(",") if x.strip()]
    if not out or any(not (0 < f <= 4) or math.isnan(f) for f in out):
        raise ValueError(f"want fractions of the working set in (0, 4], e.g. 0.25,1.0: {text!r}")
    return sorted(set(out))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


SWEEP_COLUMNS = (
    "memory",
    "config",
    "hit rate",
    "LRU ref",
    "OPT ref",
    "ideal (inf)",
    "TTFT p50",
    "p95",
    "p99",
    "input tok/s",
    "prefill tok",
    "own / store",
    "store LRU / OPT ref",
    "hit TTFT p50 (wait+step, steps)",
)


def _hit_cell(s: Summary) -> str:
    h = s.ttft_breakdown.get("hit") or {}
    if not h.get("count"):
        return "-"
    return (
        f"{h['ttft_p50_ms']:.0f} ({h['wait_p50_ms']:.0f}+{h['step_p50_ms']:.0f}, "
        f"{h.get('steps_p50', h['steps_mean']):.0f})"
    )


def sweep_rows(points: Sequence[Point]) -> list[list[str]]:
    """One row per (point, configuration): :data:`SWEEP_COLUMNS`."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def ms(d: dict[str, float], k: str) -> str:
        return f"{d[k]:.0f}" if k in d else "-"

    rows: list[list[str]] = []
    for p in points:
        mem = f"{p.fraction:g} ({_mib(p.memory_bytes)})"
        for s in p.summaries:
            if failed(s):
                least = f"; least it accepts: {_mib(s.min_bytes)}" if s.min_bytes else ""
                why = failed(s) if len(failed(s)) <= 100 else failed(s)[:97] + "..."
                rows.append(
                    [mem, s.name, f"FAILED: {why}{least}"] + [""] * (len(SWEEP_COLUMNS) - 3)
                )
                continue
            rows.append(
                [
                    mem,
                    s.name,
                    pct(s.token_hit_rate),
                    pct(s.ref_lru_hit_rate),
                    pct(s.ref_opt_hit_rate),
                    pct(s.ideal_hit_rate),
                    ms(s.ttft_ms, "p50"),
                    ms(s.ttft_ms, "p95"),
                    ms(s.ttft_ms, "p99"),
                    f"{s.input_tokens_per_s:,.0f}",
                    f"{s.prefill_tokens_computed:,}",
                    sources_cell(s),
                    "-"
                    if s.ref_lru_store_rate is None
                    else f"{pct(s.ref_lru_store_rate)} / {pct(s.ref_opt_store_rate)}",
                    _hit_cell(s),
                ]
            )
    return rows


def sweep_markdown(points: Sequence[Point]) -> str:
    """The sweep table as GitHub markdown (for docs/BENCHMARKS.md)."""
    out = ["| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    out += ["| " + " | ".join(row) + " |" for row in sweep_rows(points)]
    return "\n".join(out)


def sweep_json(points: Sequence[Point]) -> list[dict[str, Any]]:
    """``[{fraction, memory_bytes, configs: {name: {per-configuration fields}}}]``."""
    return [
        {
            "fraction": p.fraction,
            "memory_bytes": p.memory_bytes,
            "configs": to_json(p.summaries, {})["configs"],
        }
        for p in points
    ]


def sweep_plots(points: Sequence[Point], out_dir: Path, stem: str) -> list[Path]:
    """Hit rate against memory and TTFT p50 against memory, one line per configuration
    (the references as dashed lines); returns the PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not points:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for p in points:
        names += [s.name for s in p.summaries if s.name not in names]

    def series(name: str, get: Any) -> tuple[list[float], list[float]]:
        xs: list[float] = []
        ys: list[float] = []
        for p in points:
            for s in p.summaries:
                if s.name == name and s.ran and s.requests:
                    v = get(s)
                    if v is not None and math.isfinite(v):
                        xs.append(p.memory_bytes / (1 << 20))
                        ys.append(v)
        return xs, ys

    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        xs, ys = series(
            name,
            lambda s: 100 * (s.token_hit_rate if s.median_hit_rate is None else s.median_hit_rate),
        )
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    for label, get in (
        ("LRU reference", lambda s: s.ref_lru_hit_rate),
        ("optimum reference", lambda s: s.ref_opt_hit_rate),
    ):
        ref = next((n for n in names if n != "prefix"), None)
        if ref is not None:
            xs, ys = series(ref, lambda s, g=get: None if g(s) is None else 100 * g(s))
            if xs:
                ax.plot(xs, ys, "--", color="grey" if "LRU" in label else "black", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("store memory (MiB)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title("Hit rate against memory")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    png = out_dir / f"{stem}-sweep-hit-rate.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    paths.append(png)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        xs, ys = series(name, lambda s: s.ttft_ms.get("p50"))
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("store memory (MiB)")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("TTFT p50 against memory")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    png = out_dir / f"{stem}-sweep-ttft.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    paths.append(png)
    return paths
