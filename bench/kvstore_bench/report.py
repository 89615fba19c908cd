"""Benchmark output shared by the benches: number formats, rich tables, JSON and PNGs.

Everything a benchmark writes goes under one results directory (``bench/results/`` by
default, git-ignored), named ``<bench>-<YYYYmmdd-HHMMSS>[-<plot>].{json,png}``.
matplotlib is imported only when plotting and is optional: without it the tables and
JSON are still written and a note says the plots were skipped. What only one bench
prints lives next to it (the replay's in :mod:`kvstore_bench.replay.report`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.config import format_size

__all__ = [
    "GIB",
    "command_line",
    "gib",
    "log_ticks",
    "ms",
    "pct",
    "percentiles",
    "pyplot",
    "results_path",
    "save",
    "size_ticks",
    "stamp",
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


def log_ticks(ax: Any, axis: str = "x") -> None:
    """Plain numbers (1, 2, 5, 10, 20 ...) on a log axis instead of 2x10^1 labels that
    run together; minor ticks unlabelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.set_minor_formatter(NullFormatter())


# --------------------------------------------------------------------------- console


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
        + (
            f", verified copy (copy+xxh3) {ceil['copy_hash_gib_s']:.2f} GiB/s at"
            f" {ceil['copy_hash_cpu_s_per_gib']:.3f} CPU s/GiB"
            if ceil.get("copy_hash_gib_s")
            else ""
        )
        + "".join(
            f"; {n} streams {x['median']:.2f} ({min(x['runs']):.2f}..{max(x['runs']):.2f})"
            for n, x in (ceil.get("socket_streams") or {}).items()
        )
    )
    cols = ["system", "op", "block", "batch", "conc", "workers", "GiB/s", "x sock", "x sockN",
            "x memcpy",
            "CPU s/GiB", "x copy+hash CPU", "p50 ms", "p99 ms",
            "errors"] + (["x mooncake"] if mc else [])  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "system" else "right")
    order = sorted(points, key=lambda p: (p.workers, p.op != "put", p.block_bytes, p.batch,
                                          p.concurrency, p.system, p.transport))  # fmt: skip
    for p in order:
        row = [f"{p.system}/{p.transport}", p.op, format_size(p.block_bytes), str(p.batch),
               str(p.concurrency), str(p.workers), f"{p.gib_s:.3f}", f"{p.frac_socket:.2f}",
               f"{p.frac_socket_streams:.2f}", f"{p.frac_memcpy:.2f}", f"{p.cpu_s_per_gib:.2f}",
               f"{p.cpu_vs_copy_hash:.1f}", f"{p.p50_ms:.2f}", f"{p.p99_ms:.2f}",
               str(p.errors)]  # fmt: skip
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
            title="targets (concurrency 1, one worker): network paths against the bare "
            "socket (median, range over its runs), same-host paths against memcpy"
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
    fewest = min((p.workers for p in points), default=1)  # 1 unless a running cluster's
    single = [p for p in points if p.workers == fewest and p.concurrency == 1]
    if not single:
        return "no plot: no point at concurrency 1"
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
        ax.set_title(f"{op}: client process to {_workers(fewest)}")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GiB/s")
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=7, loc="center left")
    fig.suptitle(
        f"kvstore bench transfer: batches of {batch} blocks, 1 client thread, "
        f"{_workers(fewest)} (tcp:// over loopback, shm:// through the worker's arena)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _workers(n: int) -> str:
    return "one worker on this host" if n == 1 else f"{n} workers"


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
