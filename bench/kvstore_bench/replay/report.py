"""What the replay bench prints and writes: its headline figures, tables, JSON and plots.

:func:`summarize` (of :mod:`.results`) turns a :class:`~.results.ReplayResult` into flat
JSON-ready figures; :func:`replay_outputs` prints the tables and writes the JSON and PNGs
under the results directory (see :mod:`kvstore_bench.report` for the shared formats);
:func:`progress`, :func:`header` and :func:`run_line` are the console lines while it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from ..report import (
    GIB,
    Summary,
    command_line,
    gib,
    log_ticks,
    ms,
    pct,
    pyplot,
    results_path,
    save,
    stamp,
    table,
    write_json,
)
from .results import ReplayResult, load_model, summarize

__all__ = [
    "ablation_rows",
    "comparison_rows",
    "header",
    "load_model",
    "model_scale_note",
    "progress",
    "replay_outputs",
    "run_line",
    "summarize",
    "sweep_rows",
]


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
        row("  Belady at capacity", lambda s: pct(s.get("opt_hit_rate_tokens"))),
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
    command: str | None = None,
) -> list[Path]:
    """Print the replay tables, write JSON + PNGs and print their paths; returns them.
    ``command``: the command line to record (default: this process's)."""
    command = command or command_line()
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
    for p in paths:
        console.print(f"wrote {p}")
    return paths


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


def nothing_evicted(s: Summary) -> bool:
    """True when an LRU of the run's capacity hits as often as an infinite cache: at
    that size nothing is evicted, so the two references are one line."""
    lru = s["lru_hit_rate_tokens"]
    return lru is not None and abs(lru - s["ideal_hit_rate_tokens"]) < 1e-9


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
        if nothing_evicted(s):
            continue  # its LRU line would lie on the ideal's: the ideal's label says so
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
    same = [s["label"] for s in sums if nothing_evicted(s)]
    ax.axhline(
        ideal,
        ls="--",
        color="grey",
        lw=1.0,
        zorder=2,
        label=f"ideal, infinite cache ({pct(ideal)})"
        + (f"; = offline LRU of {', '.join(same)}: nothing evicted at its size" if same else ""),
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


# --------------------------------------------------------------------------- while running


def header(files: int, fmt: str, sessions: int, requests: int, bt: int, bpt: int) -> str:
    """The replay's first console line: what is replayed, in which blocks."""
    return (
        f"[bold]replay[/] {files} {fmt} file(s): {sessions} "
        f"session{'' if sessions == 1 else 's'}, {requests} "
        f"request{'' if requests == 1 else 's'}, blocks of {bt} tokens x {bpt} B "
        f"= {(bt * bpt) >> 10} KiB"
    )


def run_line(res: ReplayResult, ssd0: int | None, ssd1: int | None) -> str:
    """One run's console line: token hit rate beside the ideal and LRU, wall time, and
    the MiB served from SSD when the workers count it (``ssd0``/``ssd1``: blocks read
    from SSD before and after the run, None when unknown)."""
    s = res.summary()
    ssd = (
        f", {(ssd1 - ssd0) * res.block_bytes / 2**20:.1f} MiB read from SSD"
        if ssd0 is not None and ssd1 is not None
        else ""
    )
    return (
        f"  {res.label}: token hit rate {pct(s['hit_rate_tokens'])} (ideal "
        f"{pct(s['ideal_hit_rate_tokens'])}, LRU "
        f"{pct(s['lru_hit_rate_tokens'])}, Belady {pct(s.get('opt_hit_rate_tokens'))}), "
        f"{res.wall_s:.1f} s{ssd}"
    )
