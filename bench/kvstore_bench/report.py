"""Benchmark output: headline figures, rich tables, JSON and matplotlib PNGs.

Everything a benchmark writes goes under one results directory (``bench/results/`` by
default, git-ignored), named ``<bench>-<YYYYmmdd-HHMMSS>[-<plot>].{json,png}``.
matplotlib is imported only when plotting and is optional: without it the tables and
JSON are still written and a note says the plots were skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.config import format_size

if TYPE_CHECKING:
    from .replay import ReplayResult

__all__ = [
    "GIB",
    "command_line",
    "gib",
    "load_model",
    "ms",
    "pct",
    "percentiles",
    "progress",
    "pyplot",
    "replay_outputs",
    "results_path",
    "save",
    "size_ticks",
    "stamp",
    "summarize",
    "table",
    "transfer_plot",
    "transfer_tables",
    "write_json",
]

Summary = dict[str, Any]
GIB = float(1 << 30)


# --------------------------------------------------------------------------- figures


def percentiles(xs: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> list[float]:
    """The ``qs`` percentiles of ``xs`` (NaN each when empty)."""
    if not len(xs):
        return [math.nan] * len(qs)
    return [float(v) for v in np.percentile(np.asarray(xs, dtype=float), qs)]


def pct(x: object) -> str:
    """0.1234 -> '12.3%'; '-' for None or NaN."""
    if not isinstance(x, (int, float)) or math.isnan(x):
        return "-"
    return f"{100 * x:.1f}%"


def ms(x: object) -> str:
    """Seconds -> milliseconds text; '-' for None or NaN."""
    if not isinstance(x, (int, float)) or math.isnan(x):
        return "-"
    return f"{1e3 * x:.2f}" if x < 1 else f"{1e3 * x:.0f}"


def gib(x: object) -> str:
    """Bytes -> GiB text (3 decimals below 0.1 GiB)."""
    if not isinstance(x, (int, float)) or math.isnan(x):
        return "-"
    v = float(x) / GIB
    return f"{v:.3f}" if 0 < v < 0.1 else f"{v:.2f}"


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


# --------------------------------------------------------------------------- output


def results_path(out: Path, bench: str, stamp: str, suffix: str) -> Path:
    """``out/<bench>-<stamp><suffix>``, creating ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{bench}-{stamp}{suffix}"


def stamp() -> str:
    """The current local time as YYYYmmdd-HHMMSS."""
    return time.strftime("%Y%m%d-%H%M%S")


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (NaN becomes null) and return ``path``."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    path.write_text(json.dumps(clean(obj), indent=1) + "\n", encoding="utf-8")
    return path


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A rich table; the first column left-aligned, the others right-aligned."""
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*r)
    return t


def _lat(s: Summary, name: str) -> str:
    return " / ".join(ms(s[f"{name}_p{q}_s"]) for q in (50, 95, 99))


def comparison_rows(sums: Sequence[Summary]) -> list[list[str]]:
    """Metric rows of the main replay table, one column per run."""

    def row(name: str, f: Any) -> list[str]:
        return [name, *(f(s) for s in sums)]

    mb = sums[0]["model_bytes_per_token"] >> 10
    tps = sums[0]["prefill_tokens_per_s"]
    return [
        row("requests / wall time", lambda s: f"{s['requests']} / {s['wall_s']:.1f} s"),
        row("token hit rate", lambda s: pct(s["hit_rate_tokens"])),
        row("  ideal (infinite cache)", lambda s: pct(s["ideal_hit_rate_tokens"])),
        row("  LRU at capacity", lambda s: pct(s["lru_hit_rate_tokens"])),
        row("block hit rate", lambda s: pct(s["hit_rate_blocks"])),
        row(
            "  ideal / LRU",
            lambda s: f"{pct(s['ideal_hit_rate_blocks'])} / {pct(s['lru_hit_rate_blocks'])}",
        ),
        row("capacity (blocks)", lambda s: str(s["capacity_blocks"])),
        row("GiB loaded", lambda s: gib(s["bytes_loaded"])),
        row("GiB written", lambda s: gib(s["bytes_written"])),
        row("GiB skipped (not rewritten)", lambda s: gib(s["bytes_skipped"])),
        row("match ms p50/p95/p99", lambda s: _lat(s, "match")),
        row("load ms p50/p95/p99", lambda s: _lat(s, "load")),
        row("store ms p50/p95/p99", lambda s: _lat(s, "store")),
        row("load GiB/s (per request)", lambda s: gib(s["load_bytes_per_s"])),
        row("store GiB/s (per request)", lambda s: gib(s["store_bytes_per_s"])),
        row("GiB/s moved (all sessions)", lambda s: gib(s["throughput_bytes_per_s"])),
        row(
            "load fit: fixed ms + GiB/s",
            lambda s: f"{ms(s['load_fit_overhead_s'])} + {gib(s['load_fit_bytes_per_s'])}",
        ),
        row(f"GiB loaded at {mb} KiB/token", lambda s: gib(s["model_bytes_loaded"])),
        row("prefill tokens saved", lambda s: f"{s['prefill_tokens_saved']:,}"),
        row(f"prefill s saved @{tps:,.0f} tok/s", lambda s: f"{s['prefill_s_saved']:,.1f}"),
        row(f"  net of loading at {mb} KiB/token", lambda s: f"{s['prefill_s_saved_net']:,.1f}"),
        row(
            "requests loading slower than recompute",
            lambda s: f"{s['loads_not_worth_it']} of {s['requests']}",
        ),
        row("content errors", lambda s: str(s["content_errors"])),
        row("matched but not loaded", lambda s: str(s["load_misses"])),
        row("store failures", lambda s: str(s["store_failures"])),
    ]


def model_scale_note(s: Summary) -> str:
    """Why 'net of loading' is what it is: the load speed measured here, scaled to the
    model's bytes per token, against the prefill speed it replaces."""
    bw = s["load_fit_bytes_per_s"]
    mbt = s["model_bytes_per_token"]
    tps = s["prefill_tokens_per_s"]
    load_tps = bw / mbt if mbt else math.inf
    verdict = "loading loses here" if load_tps < tps else "loading wins here"
    bench_bpt = s["block_bytes"] // max(1, s["block_tokens"])
    return (
        f"  {s['label']}: 'net of loading' charges each hit the load of {mbt >> 10} KiB/token "
        f"(a real model's; the bench stores {bench_bpt} B/token) at the {gib(bw)} GiB/s "
        f"measured here = {load_tps:,.0f} tokens/s, vs prefill at {tps:,.0f} tokens/s: "
        f"{verdict}. Break-even is {gib(tps * mbt)} GiB/s (docs/BENCHMARKS.md)."
    )


def log_ticks(ax: Any, axis: str = "x") -> None:
    """Plain numbers (1, 2, 5, 10, 20 ...) on a log axis instead of 2x10^1 labels that
    run together; minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.set_minor_formatter(NullFormatter())


def sweep_rows(sums: Sequence[Summary]) -> list[list[str]]:
    """One row per (backend, concurrency) run of a load sweep."""
    return [
        [
            s["label"],
            str(s["sessions"]),
            pct(s["hit_rate_tokens"]),
            f"{s['requests_per_s']:.1f}",
            gib(s["throughput_bytes_per_s"]),
            _lat(s, "match"),
            _lat(s, "load"),
            _lat(s, "store"),
        ]
        for s in sums
    ]


def ablation_rows(sums: Sequence[Summary]) -> list[list[str]]:
    """One row per ablation variant."""
    return [
        [
            s["label"],
            pct(s["hit_rate_tokens"]),
            gib(s["bytes_written"]),
            gib(s["bytes_loaded"]),
            _lat(s, "match"),
            _lat(s, "load"),
            f"{s['prefill_s_saved']:,.1f}",
        ]
        for s in sums
    ]


def replay_outputs(
    console: Console,
    results: Sequence[ReplayResult],
    out: Path,
    *,
    sweep: bool,
    ablate: bool,
    command: str,
) -> list[Path]:
    """Print the replay tables and write JSON + PNGs; returns the written paths."""
    sums = [r.summary() for r in results]
    st = stamp()
    variants = [s for s in sums if ":" in s["label"]]
    main = [s for s in sums if ":" not in s["label"]]
    if sweep:
        cols = ["run", "sessions", "token hit", "req/s", "GiB/s", "match ms p50/95/99"]
        cols += ["load ms p50/95/99", "store ms p50/95/99"]
        console.print(table("load sweep", cols, sweep_rows(main)))
    else:
        first = main[0] if main else sums[0]
        n_sessions = len({r.session for r in results[sums.index(first)].records})
        title = (
            f"replay: {first['requests']} requests, up to "
            f"{min(first['sessions'], n_sessions)} sessions at once; "
            f"{first['block_tokens']}-token blocks of {first['block_bytes'] >> 10} KiB"
        )
        console.print(table(title, ["", *(s["label"] for s in main)], comparison_rows(main)))
        for s in main:
            console.print(f"  {s['store']}")
        for s in main:
            console.print(model_scale_note(s))
    if ablate:
        base = [s for s in main if s["backend"] in {v["backend"] for v in variants}]
        cols = ["variant", "token hit", "GiB written", "GiB read", "lookup ms p50/95/99"]
        cols += ["load ms p50/95/99", "prefill s saved"]
        rows = ablation_rows([dict(s, label=f"{s['label']}: all on") for s in base[:1]])
        console.print(table("ablation", cols, rows + ablation_rows(variants)))
    console.print(f"command: {command}")
    runs = [
        {
            "label": s["label"],
            "summary": s,
            "config": dataclasses.asdict(r.config),
            "records": [dataclasses.asdict(x) for x in r.records],
        }
        for s, r in zip(sums, results, strict=True)
    ]
    paths = [
        write_json(results_path(out, "replay", st, ".json"), {"command": command, "runs": runs})
    ]
    paths += _replay_plots(results, sums, out, st, sweep)
    return paths


# --------------------------------------------------------------------------- console


@contextlib.contextmanager
def progress(
    console: Console, label: str, total: int, show: bool
) -> Iterator[Callable[[Any], None]]:
    """A rich progress bar (in a terminal, and ``show``) with the running token hit rate;
    yields the tick to call with each :class:`replay.RequestRecord`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("  {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit {task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not (show and console.is_terminal),
    )
    task = bar.add_task(label, total=total, rate="  0.0%")
    lock = threading.Lock()
    acc = [0, 0]

    def tick(rec: Any) -> None:
        with lock:
            acc[0] += rec.tokens
            acc[1] += rec.hit_tokens
            rate = acc[1] / acc[0] if acc[0] else 0.0
        bar.update(task, advance=1, rate=f"{100 * rate:5.1f}%")

    with bar:
        yield tick


def command_line() -> str:
    """This command line, a directory's full set of *.json traces shown as DIR/*.json."""
    import shlex
    import sys

    args = ["kvstore", *sys.argv[1:]]
    by_dir: dict[Path, list[str]] = {}
    for a in args:
        p = Path(a)
        if p.suffix == ".json" and p.is_file():
            by_dir.setdefault(p.parent, []).append(a)
    out: list[str] = []
    for a in args:
        p = Path(a)
        group = by_dir.get(p.parent) if p.suffix == ".json" else None
        if (
            group
            and a in group
            and len(group) > 3
            and len(group) == len(list(p.parent.glob("*.json")))
        ):
            if a == group[0]:
                out.append(str(p.parent / "*.json"))
            continue
        out.append(shlex.quote(a))
    return " ".join(out)


# --------------------------------------------------------------------------- plots


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _replay_plots(
    results: Sequence[ReplayResult], sums: Sequence[Summary], out: Path, st: str, sweep: bool
) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r, s in zip(results, sums, strict=True):
        recs = sorted(r.records, key=lambda x: x.end)
        tok = np.cumsum([x.tokens for x in recs])
        hit = np.cumsum([x.hit_tokens for x in recs])
        line = ax.plot([x.end for x in recs], hit / np.maximum(tok, 1), label=s["label"])[0]
        if s["lru_hit_rate_tokens"] is not None:
            ax.axhline(
                s["lru_hit_rate_tokens"],
                ls=":",
                color=line.get_color(),
                lw=1.6,
                zorder=3,
                label=f"{s['label']}: offline LRU at its capacity "
                f"({pct(s['lru_hit_rate_tokens'])})",
            )
    ideal = sums[0]["ideal_hit_rate_tokens"]
    ax.axhline(
        ideal,
        ls="--",
        color="grey",
        lw=1.0,
        zorder=2,
        label=f"ideal, infinite cache ({pct(ideal)})",
    )
    ax.set(xlabel="replay time (s)", ylabel="cumulative token hit rate", ylim=(0, 1.02))
    ax.set_title("token hit rate over the replay, with the offline references")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    paths.append(save(fig, results_path(out, "replay", st, "-hitrate.png")))

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, name, attr in zip(
        axes, ("match", "load", "store"), ("match_s", "load_s", "store_s"), strict=True
    ):
        for r, s in zip(results, sums, strict=True):
            xs = np.sort([getattr(x, attr) * 1e3 for x in r.records if getattr(x, attr) > 0])
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=s["label"])
        ax.set(xscale="log", xlabel=f"{name} latency (ms, log scale)", ylim=(0, 1))
        ax.set_title(f"{name}", fontsize=10)
        log_ticks(ax, "x")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("fraction of requests at or below")
    axes[0].legend(fontsize=7)
    fig.suptitle("replay: latency per request (CDF): lookup, load of the hits, store of new blocks")
    paths.append(save(fig, results_path(out, "replay", st, "-latency.png")))

    if sweep:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for backend in dict.fromkeys(s["backend"] for s in sums):
            ss = [s for s in sums if s["backend"] == backend and ":" not in s["label"]]
            n = [s["sessions"] for s in ss]
            axes[0].plot(n, [s["hit_rate_tokens"] for s in ss], "o-", label=backend)
            axes[1].plot(n, [s["throughput_bytes_per_s"] / GIB for s in ss], "o-", label=backend)
            for q, style in ((95, "o-"), (99, "s--")):
                axes[2].plot(
                    n, [s[f"load_p{q}_s"] * 1e3 for s in ss], style, label=f"{backend} p{q}"
                )
        axes[0].set(xlabel="sessions at once", ylabel="token hit rate", ylim=(0, 1))
        axes[1].set(xlabel="sessions at once", ylabel="GiB/s (loaded + written)")
        axes[1].set_ylim(bottom=0)
        axes[2].set(xlabel="sessions at once", ylabel="load latency (ms, log)", yscale="log")
        log_ticks(axes[2], "y")
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

        levels = sorted({s["sessions"] for s in sums})
        for ax, title in zip(axes, ("hit rate", "bandwidth", "load latency"), strict=True):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(levels))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle("replay load sweep: more sessions at once")
        paths.append(save(fig, results_path(out, "replay", st, "-sweep.png")))
    return paths


def save(fig: Any, path: Path) -> Path:
    """Write a matplotlib figure as PNG, close it and return ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# --------------------------------------------------------------------------- transfer


def transfer_tables(
    console: Console, result: dict[str, Any], points: Sequence[Any], exists_keys: int
) -> None:
    """One row per point and system, then exists, then the targets."""
    ceil = result["ceilings"]
    mc = {p.key: p for p in points if p.system == "mooncake"}
    runs = ceil.get("socket_runs") or [ceil["socket_gib_s"]]
    t = Table(
        title=f"kvstore bench transfer: ceilings bare socket {ceil['socket_gib_s']:.2f} GiB/s"
        f" (median of {len(runs)} runs, {min(runs):.2f}..{max(runs):.2f}),"
        f" memcpy {ceil['memcpy_gib_s']:.2f} GiB/s"
    )
    cols = ["system", "op", "block", "batch", "conc", "workers", "GiB/s", "x sock", "x memcpy",
            "CPU s/GiB", "p50 ms", "p99 ms", "errors"] + (["x mooncake"] if mc else [])  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "system" else "right")
    order = sorted(points, key=lambda p: (p.workers, p.op != "put", p.block_bytes, p.batch,
                                          p.concurrency, p.system, p.transport))  # fmt: skip
    for p in order:
        row = [f"{p.system}/{p.transport}", p.op, format_size(p.block_bytes), str(p.batch),
               str(p.concurrency), str(p.workers), f"{p.gib_s:.3f}", f"{p.frac_socket:.2f}",
               f"{p.frac_memcpy:.2f}", f"{p.cpu_s_per_gib:.2f}", f"{p.p50_ms:.2f}",
               f"{p.p99_ms:.2f}", str(p.errors)]  # fmt: skip
        if mc:
            other = mc.get(p.key)
            ok = p.system != "mooncake" and other is not None and other.gib_s > 0
            row.append(f"{p.gib_s / other.gib_s:.2f}" if ok and other else "")
        t.add_row(*row)
    console.print(t)
    e = Table(title=f"batch_exists of {exists_keys} stored hashes in a loop")
    for c in ("system", "workers", "keys/s", "us/call", "all found"):
        e.add_column(c, justify="right")
    for x in result["exists"]:
        name, rate = f"{x['system']}/{x['transport']}", f"{x['keys_per_s']:,.0f}"
        e.add_row(name, str(x["workers"]), rate, f"{x['us_per_call']:.0f}", str(x["all_found"]))
    console.print(e)
    if result["targets"]:
        g = Table(
            title="targets of the issue (concurrency 1, one worker); against the bare socket: "
            "median ceiling, range over its runs"
        )
        for c in ("transport", "target", "value", "range", "goal", "met"):
            g.add_column(c, justify="right")
        colour = {"yes": "green", "no": "red", "within noise": "yellow"}
        for x in result["targets"]:
            lo, hi = x.get("range") or (x["value"], x["value"])
            verdict = x.get("verdict") or ("yes" if x["met"] else "no")
            g.add_row(x["transport"], x["name"], f"{x['value']:.2f}",
                      f"{lo:.2f}..{hi:.2f}" if hi > lo else "",
                      f"{x['goal']:.2f}", f"[{colour[verdict]}]{verdict}[/]")  # fmt: skip
        console.print(g)


def transfer_plot(path: Path, points: Sequence[Any], ceil: dict[str, Any]) -> str | None:
    """GiB/s against block size per op and system at the batch closest to 32,
    concurrency 1, one worker, with the ceilings; a note instead when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e} (pip install matplotlib)"
    single = [p for p in points if p.workers == 1 and p.concurrency == 1]
    if not single:
        return "no plot: no single-worker points"
    batch = min({p.batch for p in single}, key=lambda b: (abs(b - 32), b))
    series = list(dict.fromkeys((p.system, p.transport) for p in single))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("put", "get"), strict=True):
        for s in series:
            pts = [p for p in single if (p.system, p.transport, p.op, p.batch) == (*s, op, batch)]
            pts.sort(key=lambda p: p.block_bytes)
            ax.plot([p.block_bytes for p in pts], [p.gib_s for p in pts], marker="o",
                    label="/".join(s))  # fmt: skip
        runs = ceil.get("socket_runs") or [ceil["socket_gib_s"]]
        sock_label = f"bare socket stream (tcp:// ceiling), median of {len(runs)} runs"
        ax.axhline(ceil["socket_gib_s"], ls="--", color="grey", label=sock_label)
        if max(runs) > min(runs):
            ax.axhspan(min(runs), max(runs), color="grey", alpha=0.15, lw=0,
                       label="bare socket: range of its runs (a busy machine)")  # fmt: skip
        ax.axhline(ceil["memcpy_gib_s"], ls=":", color="black",
                   label="memcpy, 1 core (shm:// ceiling)")  # fmt: skip
        ax.set_xscale("log", base=2)
        sizes = sorted({p.block_bytes for p in single})
        size_ticks(ax, sizes)
        ax.set_xlabel("block size")
        ax.set_title(f"{op}: client process to one worker on this host")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GiB/s")
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=7, loc="center left")
    fig.suptitle(
        f"kvstore bench transfer: batches of {batch} blocks, 1 client thread, 1 worker "
        "(tcp:// over loopback, shm:// through the worker's arena)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def size_ticks(ax: Any, sizes: Sequence[float]) -> None:
    """Ticks at exactly ``sizes`` (bytes) on a log x axis, labelled "4 KiB", "1 MiB"."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.xaxis.set_major_locator(FixedLocator(sorted(set(sizes))))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_label(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _size_label(v: float) -> str:
    """4096 -> "4 KiB", 1048576 -> "1 MiB"."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= scale:
            return f"{v / scale:g} {unit}"
    return f"{v:g} B"
