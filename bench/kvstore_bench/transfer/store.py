"""`kvstore bench store`: put / get / exists throughput and latency by block and batch size.

For each backend (kvstore, Mooncake Store over TCP, Redis; servers started once per
backend with the same memory) and each (block size, batch size) cell: fresh random keys
are put in batches, checked with ``exists``, read back with ``get_into`` into a
pre-faulted buffer (the first batch is compared byte for byte) and removed. Every call
is timed; a cell reports blocks/s, GiB/s and p50/p99 latency per call.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console

from kvstore.console import make_console

from .. import report
from ..peers import BACKENDS, Backend, ClusterSpec, open_backend, unavailable_reason

__all__ = ["Cell", "measure", "store_cmd"]

OPS = ("put", "exists", "get")


@dataclass(slots=True)
class Cell:
    """One measured (backend, block size, batch size, op)."""

    backend: str
    block_bytes: int
    batch: int
    op: str
    blocks: int
    seconds: float
    p50_s: float
    p99_s: float
    errors: int = 0

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.blocks_per_s * self.block_bytes if self.op != "exists" else 0.0


def measure(b: Backend, block_bytes: int, batch: int, cell_bytes: int) -> list[Cell]:
    """Put, check and read back about ``cell_bytes`` of fresh blocks in batches of
    ``batch``, then remove them. Returns one :class:`Cell` per op; ``errors`` counts
    failed puts, keys not found and mismatched bytes in the first batch read."""
    rounds = max(3, min(cell_bytes // (block_bytes * batch), 20_000 // batch))
    src = np.frombuffer(os.urandom(batch * block_bytes), dtype=np.uint8).reshape(batch, -1)
    src = src.copy()  # writable, page-faulted
    dst = np.empty_like(src)
    dst.fill(0)
    b.register(src)
    b.register(dst)
    src_v = [r.data for r in src]
    dst_v = [r.data for r in dst]
    keys = [[os.urandom(16) for _ in range(batch)] for _ in range(rounds)]
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    errors = dict.fromkeys(OPS, 0)
    try:
        for ks in keys:
            t = time.perf_counter()
            _, failed = b.put(ks, src_v)
            lat["put"].append(time.perf_counter() - t)
            errors["put"] += failed
        for ks in keys:
            t = time.perf_counter()
            found = b.exists(ks)
            lat["exists"].append(time.perf_counter() - t)
            errors["exists"] += found.count(False)
        for i, ks in enumerate(keys):
            t = time.perf_counter()
            ok = b.get_into(ks, dst_v)
            lat["get"].append(time.perf_counter() - t)
            errors["get"] += ok.count(False)
            if i == 0:
                errors["get"] += sum(
                    1 for j in range(batch) if ok[j] and not np.array_equal(src[j], dst[j])
                )
    finally:
        for ks in keys:
            b.remove(ks)
        b.unregister(src)
        b.unregister(dst)
    out: list[Cell] = []
    for op in OPS:
        p50, p99 = report.percentiles(lat[op], (50, 99))
        out.append(
            Cell(b.name, block_bytes, batch, op, rounds * batch, sum(lat[op]), p50, p99, errors[op])
        )
    return out


def _sizes(text: str) -> list[int]:
    from kvstore.config import parse_size

    try:
        out = [parse_size(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    if not out or min(out) <= 0:
        raise click.BadParameter(f"want sizes like 4KiB,1MiB, got {text!r}")
    return out


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise click.BadParameter(f"want positive integers like 1,32, got {text!r}")
    return out


@click.command("store")
@click.option("--backend", type=click.Choice([*BACKENDS, "all"]), default="all", show_default=True)
@click.option("--block-sizes", default=None, help="[4KiB,16KiB,64KiB,256KiB,1MiB,4MiB]")
@click.option("--batch-sizes", default=None, help="[1,8,64,256]")
@click.option("--cell-size", default=None, help="Bytes put per (block, batch) cell [128MiB].")
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--dram-size", default=None, help="Per worker / Mooncake segment [512MiB].")
@click.option("--transport", type=click.Choice(["auto", "tcp", "shm"]), default="auto")
@click.option("--quick", is_flag=True, help="4KiB,64KiB,1MiB x 1,32, 16 MiB per cell.")
@click.option("--out", default="bench/results", show_default=True)
@click.option(
    "--tier",
    type=click.Choice(["ssd"]),
    default=None,
    help="Tier mode: SSD tier write/read GiB/s beside the raw disk (dd), same run.",
)
@click.option("--ssd-dir", default=None, help="Tier mode: directory on the disk to test [tmp].")
@click.option("--tier-size", default=None, help="Tier mode: bytes to write [2GiB; quick 512MiB].")
@click.option(
    "--master",
    default=None,
    help="kvstore: measure the running cluster at this master (HOST:PORT) instead of one "
    "the bench starts; the peers still start their own servers.",
)
def store_cmd(
    backend: str,
    block_sizes: str | None,
    batch_sizes: str | None,
    cell_size: str | None,
    workers: int,
    dram_size: str | None,
    transport: str,
    quick: bool,
    out: str,
    tier: str | None,
    ssd_dir: str | None,
    tier_size: str | None,
    master: str | None,
) -> None:
    """Put / get / exists throughput and p50/p99 latency of kvstore, Mooncake and Redis,
    by block size and batch size, on the same memory; JSON and a PNG go to --out.
    With --tier ssd: the SSD tier against the raw speed of its disk instead."""
    from kvstore.config import parse_size

    console = make_console()
    if tier == "ssd" and master:
        raise click.UsageError("--tier ssd measures a worker it starts; drop --master")
    if tier == "ssd":
        from .tier import run_tier

        total = parse_size(tier_size or ("512MiB" if quick else "2GiB"))
        run_tier(ssd_dir, total, 1 << 20, "64MiB", out, console)
        return
    blocks = _sizes(
        block_sizes or ("4KiB,64KiB,1MiB" if quick else "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB")
    )
    batches = _ints(batch_sizes or ("1,32" if quick else "1,8,64,256"))
    cell = parse_size(cell_size or ("16MiB" if quick else "128MiB"))
    dram = parse_size(dram_size or ("128MiB" if quick else "512MiB"))
    if cell * 2 > dram * workers:
        raise click.UsageError("--cell-size must be at most half of workers x --dram-size")
    spec = ClusterSpec(
        workers=workers,
        dram_bytes=dram,
        max_value_bytes=max(1 << 20, 2 * max(blocks)),
        transport=transport,
        master=master,
    )
    cells: list[Cell] = []
    descriptions: dict[str, str] = {}
    for kind in list(BACKENDS) if backend == "all" else [backend]:
        reason = unavailable_reason(kind)
        if reason is not None:
            console.print(f"[yellow]skipping {kind}[/]: {reason}")
            continue
        with console.status(f"{kind}: starting"):
            try:
                with open_backend(kind, spec, f"bench-store/{uuid.uuid4().hex[:8]}") as b:
                    descriptions[kind] = b.description
                    for bs in blocks:
                        for n in batches:
                            console.log(f"{kind}: {bs >> 10} KiB x {n}")
                            cells += measure(b, bs, n, cell)
            except Exception as e:
                raise click.ClickException(f"{kind}: {type(e).__name__}: {e}") from e
    if not cells:
        raise click.ClickException("no backend could run")
    _print(console, cells, descriptions)
    st = report.stamp()
    doc = {"command": "kvstore bench store", "stores": descriptions, "cells": _rows(cells)}
    paths = [report.write_json(report.results_path(Path(out), "store", st, ".json"), doc)]
    paths += _plot(cells, Path(out), st)
    for p in paths:
        console.print(f"wrote {p}")


def _rows(cells: list[Cell]) -> list[dict[str, Any]]:
    return [dict(asdict(c), blocks_per_s=c.blocks_per_s, bytes_per_s=c.bytes_per_s) for c in cells]


def _print(console: Console, cells: list[Cell], descriptions: dict[str, str]) -> None:
    kinds = list(descriptions)
    rows: list[list[str]] = []
    keys = dict.fromkeys((c.block_bytes, c.batch, c.op) for c in cells)
    by = {(c.backend, c.block_bytes, c.batch, c.op): c for c in cells}
    for bs, n, op in keys:
        row = [f"{bs >> 10} KiB", str(n), op]
        for k in kinds:
            c = by.get((k, bs, n, op))
            if c is None:
                row.append("-")
                continue
            rate = (
                f"{c.blocks_per_s:,.0f}/s"
                if op == "exists"
                else f"{report.gib(c.bytes_per_s)} GiB/s"
            )
            err = f" [red]{c.errors} err[/]" if c.errors else ""
            row.append(f"{rate}  {report.ms(c.p50_s)}/{report.ms(c.p99_s)} ms{err}")
        rows.append(row)
    cols = ["block", "batch", "op", *(f"{k} (rate, p50/p99 per call)" for k in kinds)]
    console.print(report.table("store: throughput and latency per call", cols, rows))
    for d in descriptions.values():
        console.print(f"  {d}")


def _plot(cells: list[Cell], out: Path, st: str) -> list[Path]:
    plt = report.pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.3))
    series = dict.fromkeys((c.backend, c.batch) for c in cells)
    # One colour per system, one line style per batch size, so systems compare at a glance.
    colours = {k: f"C{i}" for i, k in enumerate(dict.fromkeys(c.backend for c in cells))}
    batches = sorted({c.batch for c in cells})
    styles = {n: ("o--", "o-", "s-.", "^:")[i % 4] for i, n in enumerate(batches)}
    for ax, op in zip(axes, OPS, strict=True):
        for kind, n in series:
            cs = [c for c in cells if c.backend == kind and c.batch == n and c.op == op]
            ys = [c.blocks_per_s if op == "exists" else c.bytes_per_s / report.GIB for c in cs]
            ax.plot([c.block_bytes for c in cs], ys, styles.get(n, "o-"), color=colours[kind],
                    label=f"{kind}, batches of {n}")  # fmt: skip
        ax.set(xscale="log", xlabel="block size", title=op)
        report.size_ticks(ax, [c.block_bytes for c in cells])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("keys/s" if op == "exists" else "GiB/s")
    axes[0].legend(fontsize=7)
    fig.suptitle("kvstore bench store: throughput per call, one client thread")
    return [report.save(fig, report.results_path(out, "store", st, ".png"))]
