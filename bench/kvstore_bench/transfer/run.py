"""`kvstore bench transfer`: remote put/get bandwidth against the ceilings and Mooncake.

The bench process is the client. It starts a real local cluster (master + one
worker, as processes) and, with ``--vs mooncake``, Mooncake Store over TCP (a
master + one segment host, see :mod:`kvstore_bench.peers`) next to it. Then for
each point of the sweep (block size x batch size x concurrency) it moves about
``--total-bytes`` (at most ``--max-seconds``) with ``batch_put`` and with
``batch_get_into``, on every system and kvstore transport (tcp, shm, ucx) in turn, point by
point, so that a neighbour's load on a shared machine hits all of them alike.
The points and the sweep are :mod:`.points`; the systems (and the cluster, which
serves ucx:// too when it is asked for) :mod:`.systems`; this module is the command.
Afterwards it adds workers (and segment hosts) for one aggregate point whose
batches span 4 of them, and loops ``batch_exists`` of 1,024 hashes.

Each point reports GiB/s (2**30 bytes per second of wall time), that as a
fraction of the ceilings measured in the same run (:mod:`kvstore_bench.transfer.ceilings`,
before and after the sweep, the better of the two),
batch latency p50/p99, and CPU seconds per GiB moved: this process plus the
servers' processes (``getrusage`` and /proc/PID/stat), counted only while the
point's clock runs. Each point names the workers its batches spread over (all of a
running cluster's with ``--master``). Results go to ``bench/results/transfer-<time>.json``
and ``.png`` under the current directory; the targets (goals per transport) are checked
at the end. Everything the bench writes into a cluster is removed before it ends.

Method: puts write fresh random keys; after at most half a worker's DRAM of
puts the clock stops and the keys are removed, so no system measures its
eviction or runs out of room. Gets read a working set stored beforehand (each
block starts with its key, and the last batch of every thread is checked).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.config import parse_size
from kvstore.console import make_console
from kvstore_client import Client
from kvstore_client.errors import KVStoreError

from ..peers import unavailable_reason
from ..report import transfer_plot, transfer_tables
from . import ceilings
from .points import EXISTS_KEYS, Plan, Point, Runner
from .systems import TRANSPORTS, systems
from .targets import evaluate_targets

__all__ = ["Plan", "Point", "evaluate_targets", "transfer_cmd"]

RESULTS = "bench/results"  # under the current directory, never inside the installed package
PEERS = ("mooncake",)

FULL_GRID = {
    "blocks": [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20],
    "batches": [1, 8, 32, 128],
    "concurrency": [1, 4],
}
QUICK_GRID = {"blocks": [4 << 10, 64 << 10, 1 << 20], "batches": [1, 32], "concurrency": [1]}


def _socket_runs(quick: bool, n: int = 3, streams: int = 1) -> list[float]:
    """``n`` separate bare-socket runs (GiB/s) of ``streams`` streams at once, to report
    a median and a spread."""
    total = (256 << 20) if quick else (1 << 30)
    return [ceilings.socket_streams_gib_s(streams, total, repeats=1) for _ in range(n)]


# ---- command -------------------------------------------------------------------------


def _ceiling_note(master: str) -> str:
    """What the ceilings mean against a running cluster: they are measured on this host
    (a memcpy, and socket streams over loopback), which bounds a worker on this host;
    for workers on other hosts, the network between is not measured here."""
    local = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with contextlib.suppress(OSError):
        local.update(socket.gethostbyname_ex(socket.gethostname())[2])
    host = master.rsplit(":", 1)[0].strip("[]")
    where = "this host" if host in local else f"this host, not the network to {host}"
    return (
        f"running cluster at {master}: the ceilings are measured on {where} "
        "(memcpy on the client; socket streams over loopback)"
    )


def _running_workers(master: str) -> int:
    """The workers in the map of the running cluster at ``master``."""
    try:
        with Client(master, timeout=10.0) as c:
            n = len(c.workers())
    except KVStoreError as e:
        raise click.ClickException(f"--master {master}: {e}") from e
    if n == 0:
        raise click.ClickException(f"--master {master}: the cluster has no workers")
    return n


def _list(text: str, conv: Callable[[str], int]) -> list[int]:
    try:
        out = [conv(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, KVStoreError) as e:
        raise click.BadParameter(str(e)) from e
    if not out or min(out) <= 0:
        raise click.BadParameter(f"{text!r}: want a comma list of positive values")
    return out


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in allowed:
            raise click.BadParameter(f"unknown {what} {x!r}; choose from {', '.join(allowed)}")
    return out


@click.command("transfer")
@click.option(
    "--transport",
    "transports",
    default="tcp,shm",
    show_default=True,
    help="kvstore transports (comma list); an unavailable one is skipped with a note.",
)
@click.option("--vs", "peers", default="", help="Peers to run in the same run: mooncake.")
@click.option("--quick", is_flag=True, help="A small grid and budget (under a minute).")
@click.option("--total-bytes", default=None, help="Bytes per point [2GiB; quick 256MiB].")
@click.option(
    "--max-seconds",
    type=float,
    default=None,
    help="Clock seconds per point at most [4; quick 0.4].",
)
@click.option("--block-sizes", default=None, help="Comma list [4KiB,16KiB,...,16MiB].")
@click.option("--batch-sizes", default=None, help="Comma list [1,8,32,128; quick 1,32].")
@click.option("--concurrency", default=None, help="Client threads, comma list [1,4; quick 1].")
@click.option(
    "--repeat", type=int, default=1, show_default=True, help="Runs per point; the median is kept."
)
@click.option("--dram-size", default=None, help="Per worker and segment [1GiB; quick 256MiB].")
@click.option(
    "--aggregate-workers",
    type=int,
    default=4,
    show_default=True,
    help="Servers of the aggregate point (1 = no aggregate point).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=RESULTS,
    show_default=True,
    help="Directory of the JSON and PNG (relative to the current directory).",
)
@click.option("--log-dir", default=None, help="Keep the daemons' logs here.")
@click.option("--parts", default=None, help="Only the multi-part points: part counts, e.g. 1,8,80.")
@click.option("--match-prefix", is_flag=True, help="Only match_prefix latency (1,000 blocks).")
@click.option(
    "--master",
    default=None,
    help="Measure the running cluster at this master (HOST:PORT) instead of starting one.",
)
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default=None,
    help="Only the engine's data path: the vLLM connector's saves and loads of a "
    "FlashAttention cache on this device (cpu: the same path, host mover).",
)
def transfer_cmd(
    transports: str, peers: str, quick: bool, total_bytes: str | None, max_seconds: float | None,
    block_sizes: str | None, batch_sizes: str | None, concurrency: str | None, repeat: int,
    dram_size: str | None, aggregate_workers: int, out_dir: str, log_dir: str | None,
    parts: str | None, match_prefix: bool, master: str | None, device: str | None,
) -> None:  # fmt: skip
    """Remote put/get bandwidth per block size, batch and concurrency, against the
    ceilings (bare socket, memcpy) and optionally Mooncake Store over TCP."""
    if "mooncake" in _names(peers, PEERS, "peer"):
        why = unavailable_reason("mooncake")
        if why:  # at once, not after the sweep
            raise click.ClickException(f"--vs mooncake: {why}; scripts/install_peers.sh does both")
    if master and (parts or match_prefix):
        raise click.UsageError(
            "--master measures the grid; --parts and --match-prefix start their own cluster"
        )
    if device:
        from .device import main as device_main

        blocks = _list(batch_sizes, int)[0] if batch_sizes else (8 if quick else 64)
        layers = 4 if quick else 32
        return device_main(device, layers, blocks, 1 if quick else 5, 256, out_dir, master)
    if parts or match_prefix:
        blk = _list(block_sizes, parse_size)[0] if block_sizes else 1 << 20
        bat = _list(batch_sizes, int)[0] if batch_sizes else 32
        total = _list(total_bytes or "1GiB", parse_size)[0]
        from .samehost import main as same_host

        counts = _list(parts, int) if parts else []
        trs = _names(transports, TRANSPORTS, "transport")
        vs_ = _names(peers, PEERS, "peer")
        return same_host(trs, counts, match_prefix, blk, bat, total, dram_size, out_dir, vs_)
    grid = QUICK_GRID if quick else FULL_GRID
    dram = dram_size or ("256MiB" if quick else "1GiB")
    plan = Plan(
        blocks=_list(block_sizes, parse_size) if block_sizes else grid["blocks"],
        batches=_list(batch_sizes, int) if batch_sizes else grid["batches"],
        concurrency=_list(concurrency, int) if concurrency else grid["concurrency"],
        total_bytes=_list(total_bytes or ("256MiB" if quick else "2GiB"), parse_size)[0],
        max_seconds=max_seconds if max_seconds is not None else (0.4 if quick else 4.0),
        capacity=_list(dram, parse_size)[0],
        aggregate_workers=aggregate_workers,
        repeat=repeat,
    )
    kv_transports = _names(transports, TRANSPORTS, "transport")
    vs = _names(peers, PEERS, "peer")
    console = make_console()
    started = time.strftime("%Y%m%d-%H%M%S")
    notes: list[str] = []
    running = 1  # the workers every sweep point spreads over
    if master:
        if plan.aggregate_workers > 1:
            notes.append(
                f"running cluster at {master}: no aggregate point (the bench adds servers "
                "only to a cluster it started); worker CPU is not counted"
            )
        plan.aggregate_workers = 1
        running = _running_workers(master)
        notes.append(_ceiling_note(master))
        if running != 1:
            notes.append(
                f"running cluster at {master}: every point spreads over its {running} "
                "workers; the targets are set for one worker and are not judged"
            )
    console.print("measuring the ceilings (bare socket, 1 and N streams; memcpy) ...")
    first = ceilings.measure(quick).to_json()
    socket_runs = _socket_runs(quick)
    streams = ceilings.client_streams(
        [c * running for c in plan.concurrency], plan.aggregate_workers
    )
    stream_runs = {n: _socket_runs(quick, streams=n) for n in streams}
    progress = Progress(TextColumn("{task.description:<44}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=console, auto_refresh=False)  # fmt: skip
    with progress:
        task = progress.add_task("starting the cluster", total=None)
        runner = Runner(plan, progress, task)
        with systems(plan, kv_transports, vs, dram, log_dir, notes, master) as (targets, grow):
            progress.update(task, total=Runner.count(plan, len(targets)))
            runner.sweep(targets)
            if plan.aggregate_workers > 1:
                runner.say(f"growing to {plan.aggregate_workers} servers each")
                grow()
                runner.aggregate(targets, plan.aggregate_workers)
            runner.say("stopping")
    notes.extend(runner.notes)
    console.print("measuring the ceilings again; each is the better of the two runs ...")
    last = ceilings.measure(quick).to_json()
    socket_runs += _socket_runs(quick)
    # memcpy: the better of the two (it is steady); the socket: the median of its runs
    # with their spread, because one noisy run must not decide the targets.
    ceil: dict[str, Any] = {
        "memcpy_gib_s": max(first["memcpy_gib_s"], last["memcpy_gib_s"]),
        # one thread's verified copy (copy + xxh3 in cache-sized chunks): its speed, and
        # the CPU it costs per GiB, the least any verified transfer can cost
        "copy_hash_gib_s": max(first["copy_hash_gib_s"], last["copy_hash_gib_s"]),
        "copy_hash_cpu_s_per_gib": min(
            first["copy_hash_cpu_s_per_gib"], last["copy_hash_cpu_s_per_gib"]
        ),
        "socket_gib_s": float(np.median(socket_runs)),
        "socket_runs": socket_runs,
        # N streams at once (3 runs each, N = workers x concurrency of some point)
        "socket_streams": {
            str(n): {"runs": r, "median": float(np.median(r))} for n, r in stream_runs.items()
        },
    }
    for p in runner.points:
        p.frac_socket = p.gib_s / ceil["socket_gib_s"]
        p.frac_memcpy = p.gib_s / ceil["memcpy_gib_s"]
        many = ceil["socket_streams"].get(str(p.workers * p.concurrency))
        p.frac_socket_streams = p.gib_s / many["median"] if many else p.frac_socket
        # CPU (client and servers) per GiB moved, against one bare verified copy's
        p.cpu_vs_copy_hash = p.cpu_s_per_gib / max(ceil["copy_hash_cpu_s_per_gib"], 1e-9)
    result: dict[str, Any] = {
        "benchmark": "transfer", "version": 1, "started": started,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "load": os.getloadavg()},
        "config": {"quick": quick, "master": master, "transports": kv_transports, "vs": vs,
                   "blocks": plan.blocks,
                   "batches": plan.batches, "concurrency": plan.concurrency,
                   "total_bytes": plan.total_bytes, "max_seconds": plan.max_seconds,
                   "dram_bytes": plan.capacity, "aggregate_workers": plan.aggregate_workers,
                   "repeat": plan.repeat},
        "ceilings": ceil, "ceilings_runs": [first, last],
        "points": [asdict(p) for p in runner.points],
        "exists": runner.exists,
        "excluded": plan.excluded(),
        "notes": notes,
        "targets": evaluate_targets(
            runner.points,
            runner.exists,
            ceil["socket_gib_s"],
            (min(socket_runs), max(socket_runs)),
            ceil["memcpy_gib_s"],
        ),
    }  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"transfer-{started}.json", out / f"transfer-{started}.png"
    json_path.write_text(json.dumps(result, indent=1))
    transfer_tables(console, result, runner.points, EXISTS_KEYS)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    plot_note = transfer_plot(png_path, runner.points, ceil)
    console.print(f"results: {json_path}" + (f" ({plot_note})" if plot_note else f", {png_path}"))
