"""`kvstore bench replay`'s command line: options, the plan of runs per backend (the
concurrency levels, the ablations, session hints off/on), one cluster per backend
emptied between runs, and the outputs. The replay itself is :mod:`.run`."""

from __future__ import annotations

import dataclasses
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from kvstore.console import make_console

from ..peers import BACKENDS, Backend, ClusterSpec, open_backend, unavailable_reason
from ..traces import Request, Session
from . import report as replayreport
from .cachesim import distinct_blocks, ideal_hit_rate, lru_hit_rate
from .run import (
    ReplayConfig,
    ReplayResult,
    load_sessions,
    request_hashes,
    run_replay,
    ssd_read_blocks,
)

__all__ = ["clear", "replay_cmd"]

# --quick: the first 8 requests of each session (a Mooncake file's first 2000), 512-token
# blocks of 32 bytes/token (16 KiB), and, without --dram-size, DRAM sized by quick_dram so
# that the run evicts: its figures and plot then tell the store's eviction apart from the
# ideal (infinite) cache and from an LRU of the same size, which at a size where nothing
# is evicted are one and the same line.
_QUICK: dict[str, Any] = {
    "block_tokens": 512,
    "bytes_per_token": 32,
    "max_requests": 8,
    "limit": 2000,
}
QUICK_LRU_SHARE = 0.75  # --quick sizes DRAM where an LRU reaches this share of the ideal
MIN_SLABS = 4  # per worker, whatever the size


def lookup_order(sessions: Sequence[Session], at_once: int) -> list[Request]:
    """The requests about as a replay of ``at_once`` sessions at a time looks them up:
    sessions in waves of ``at_once``, their requests taken in turn within a wave."""
    out: list[Request] = []
    for i in range(0, len(sessions), max(1, at_once)):
        lists = [[r for x in s.walk() for r in x.requests] for s in sessions[i : i + at_once]]
        for j in range(max((len(rs) for rs in lists), default=0)):
            out += [rs[j] for rs in lists if j < len(rs)]
    return out


def quick_dram(requests: Sequence[Request], block_bytes: int, workers: int, slab: int) -> int:
    """Per-worker DRAM for ``--quick`` without ``--dram-size``: the smallest cache in
    which an offline LRU, replaying ``requests`` one after the other, reaches
    :data:`QUICK_LRU_SHARE` of the ideal token hit rate (so the cache is full and
    evicts), spread over ``workers`` in whole MiB, at least :data:`MIN_SLABS` slabs of
    ``slab`` bytes each."""
    goal = QUICK_LRU_SHARE * ideal_hit_rate(requests).token_hit_rate
    lo, hi = 1, max(1, distinct_blocks(requests))
    while lo < hi:
        mid = (lo + hi) // 2
        if lru_hit_rate(requests, mid).token_hit_rate >= goal:
            hi = mid
        else:
            lo = mid + 1
    mib = 1 << 20
    share = -(-lo * block_bytes // max(1, workers))
    return max(MIN_SLABS * slab, -(-share // mib) * mib)


def _parse_sessions(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise click.BadParameter(f"want N or N1,N2,... (positive), got {text!r}")
    return out


@click.command("replay")
@click.argument("trace_files", nargs=-1, type=click.Path(exists=True, dir_okay=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["agentic", "mooncake"]),
    default="agentic",
    show_default=True,
)
@click.option(
    "--backend",
    type=click.Choice([*BACKENDS, "all"]),
    default="kvstore",
    show_default=True,
    help="Store to replay against; 'all' runs each in turn and prints one table.",
)
@click.option("--master", default=None, help="Use a running kvstore cluster (HOST:PORT).")
@click.option("--workers", type=int, default=2, show_default=True)
@click.option(
    "--dram-size",
    default=None,
    help="Per worker / Mooncake segment [256MiB; --quick: sized to evict, see --help].",
)
@click.option("--ssd-size", default=None, help="kvstore workers' SSD tier size (when given).")
@click.option("--max-value-size", default=None, help="kvstore slab size [16 blocks].")
@click.option("--sessions", "sessions_text", default="8", show_default=True, help="N or N1,N2,...")
@click.option(
    "--time-scale", type=float, default=0.0, show_default=True, help="Pause multiplier; 0: none."
)
@click.option(
    "--max-pause",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="Cap on a scaled pause between a session's requests, seconds; 0: none.",
)
@click.option("--block-tokens", type=int, default=None, help="Regroup ids into blocks of this.")
@click.option("--bytes-per-token", type=int, default=None, help="Replayed KV bytes [512].")
@click.option(
    "--model-bytes-per-token",
    type=int,
    default=131072,
    show_default=True,
    help="KV bytes per token to scale to (Llama-3-8B bf16).",
)
@click.option(
    "--prefill-tokens-per-s",
    type=float,
    default=10_000.0,
    show_default=True,
    help="Prefill speed a hit saves.",
)
@click.option("--max-requests", type=int, default=None, help="First N requests per session.")
@click.option("--limit", type=int, default=None, help="Mooncake: first N requests of a file.")
@click.option("--synth", type=int, default=None, help="Replay N synthetic sessions instead.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed for --synth.")
@click.option("--ablate", is_flag=True, help="Turn each optimization off in turn.")
@click.option("--quick", is_flag=True, help="A subset that runs in about a minute.")
@click.option("--out", default="bench/results", show_default=True)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option(
    "--mooncake-lease-ms",
    type=int,
    default=2000,
    show_default=True,
    help="Mooncake read lease (its default, 10 s, pins a small cache).",
)
@click.option(
    "--sessions-aware",
    type=click.Choice(["on", "off", "both"]),
    default="off",
    show_default=True,
    help="Send session hints from the trace (kvstore); both: off then on, one table.",
)
@click.option(
    "--transport",
    type=click.Choice(["auto", "tcp", "shm"]),
    default="auto",
    show_default=True,
    help="kvstore client transport (auto: shm on the same host).",
)
@click.option(
    "--replicas",
    "replicas_text",
    default=None,
    help="R or R1,R2,...: replay on a fresh cluster per replica count, SIGKILL worker w0 "
    "at --kill-worker-at, report memory and hit rate (kvstore only; see replay/replicas.py).",
)
@click.option(
    "--kill-worker-at",
    type=float,
    default=0.5,
    show_default=True,
    help="With --replicas: the fraction of requests after which w0 is killed.",
)
def replay_cmd(
    trace_files: tuple[str, ...],
    fmt: str,
    backend: str,
    master: str | None,
    workers: int,
    dram_size: str | None,
    ssd_size: str | None,
    max_value_size: str | None,
    sessions_text: str,
    time_scale: float,
    max_pause: float,
    block_tokens: int | None,
    bytes_per_token: int | None,
    model_bytes_per_token: int,
    prefill_tokens_per_s: float,
    max_requests: int | None,
    limit: int | None,
    synth: int | None,
    seed: int,
    ablate: bool,
    quick: bool,
    out: str,
    progress: bool,
    mooncake_lease_ms: int,
    transport: str,
    sessions_aware: str,
    replicas_text: str | None,
    kill_worker_at: float,
) -> None:
    """Replay TRACE_FILES against kvstore (and Mooncake, Redis) and score the cache.

    Reports hit rates against the offline ideal and LRU figures, bytes loaded / written /
    skipped, match/load/store latency percentiles, GiB/s, prefill time saved at
    --prefill-tokens-per-s and --model-bytes-per-token, and content errors; writes JSON
    and PNG plots under --out. --quick replays the first 8 requests of each session in
    512-token blocks of 32 bytes/token, and (without --dram-size) on the smallest DRAM
    where an offline LRU reaches 75% of the ideal hit rate: a quick run evicts.
    """
    from kvstore.config import parse_size

    console = make_console()
    q = _QUICK if quick else {}
    block_tokens = block_tokens or _opt_int(q, "block_tokens", fmt == "agentic")
    bytes_per_token = bytes_per_token or int(q.get("bytes_per_token", 512))
    max_requests = max_requests or _opt_int(q, "max_requests", fmt == "agentic")
    limit = limit or _opt_int(q, "limit", fmt == "mooncake")
    levels = _parse_sessions(sessions_text)

    with tempfile.TemporaryDirectory(prefix="kvbench-synth-") as tmp:
        files = list(trace_files)
        if synth is not None:
            from ..synth import write

            files = [str(p) for p in write(tmp, synth, seed)]
            fmt = "agentic"
        if not files:
            raise click.UsageError("give TRACE_FILES or --synth N")
        try:
            sessions = load_sessions(
                files, fmt, block_tokens=block_tokens, max_requests=max_requests, limit=limit
            )
        except (ValueError, OSError) as e:
            raise click.ClickException(str(e)) from e
    n_req = sum(len(x.requests) for s in sessions for x in s.walk())
    bt = next((r.block_tokens for s in sessions for x in s.walk() for r in x.requests), 64)
    block_bytes = bt * bytes_per_token
    if block_bytes % 64:
        raise click.UsageError(
            f"a block is {bt} tokens x {bytes_per_token} B = {block_bytes} B: "
            "--bytes-per-token must make it a multiple of 64 bytes"
        )
    slab = parse_size(max_value_size) if max_value_size else 16 * block_bytes
    if dram_size:
        dram = parse_size(dram_size)
    elif quick:
        dram = quick_dram(lookup_order(sessions, levels[0]), block_bytes, workers, slab)
    else:
        dram = parse_size("256MiB")
    spec = ClusterSpec(
        workers=workers,
        dram_bytes=dram,
        max_value_bytes=slab,
        ssd_size=ssd_size,
        master=master,
        mooncake_lease_ms=mooncake_lease_ms,
        transport=transport,
    )
    cfg = ReplayConfig(
        bytes_per_token=bytes_per_token,
        model_bytes_per_token=model_bytes_per_token,
        prefill_tokens_per_s=prefill_tokens_per_s,
        time_scale=time_scale,
        max_pause=max_pause,
        sessions=levels[0],
    )
    if replicas_text is not None:
        from .replicas import replicas_cmd_body

        replicas_cmd_body(console, sessions, cfg, spec, replicas_text, kill_worker_at, out)
        return
    kinds = list(BACKENDS) if backend == "all" else [backend]
    if master and kinds != ["kvstore"]:
        raise click.UsageError("--master applies to --backend kvstore only")
    console.print(replayreport.header(len(files), fmt, len(sessions), n_req, bt, bytes_per_token))
    results: list[ReplayResult] = []
    for kind in kinds:
        reason = unavailable_reason(kind)
        if reason is not None:
            console.print(f"[yellow]skipping {kind}[/]: {reason}")
            continue
        plan = _plan(kind, levels, ablate, cfg)
        if sessions_aware != "off" and kind in ("kvstore", "mooncake"):
            modes = [False, True] if sessions_aware == "both" else [True]
            plan = [
                (f"{lb}, sessions {'on' if m else 'off'}", dataclasses.replace(c, sessions_aware=m))
                for lb, c in plan
                for m in modes
            ]
        try:
            results += _run_backend(console, kind, plan, sessions, spec, n_req, progress)
        except click.ClickException as e:
            if len(kinds) == 1:
                raise
            console.print(f"[red]{kind} failed[/], going on without it: {e.message}")
    if not results:
        raise click.ClickException("no backend could run")
    replayreport.replay_outputs(console, results, Path(out), sweep=len(levels) > 1, ablate=ablate)


def _opt_int(q: dict[str, Any], key: str, applies: bool) -> int | None:
    v = q.get(key)
    return int(v) if applies and v is not None else None


def _plan(
    kind: str, levels: list[int], ablate: bool, cfg: ReplayConfig
) -> list[tuple[str, ReplayConfig]]:
    """(label, config) of every run against one backend, in order: the concurrency
    levels, then (with ``ablate``) each optimization off in turn."""
    rep = dataclasses.replace
    plan = [(f"{kind} x{n}" if len(levels) > 1 else kind, rep(cfg, sessions=n)) for n in levels]
    if ablate:
        plan += [
            (f"{kind}: write every block", rep(cfg, write_only_new=False)),
            (f"{kind}: one exists per block", rep(cfg, batched_lookup=False)),
            (f"{kind}: drop blocks at pauses", rep(cfg, retain=False)),
        ]
        if kind == "kvstore":  # the peers here are one server: nothing to parallelize
            plan.append(("kvstore: one worker at a time", rep(cfg, parallel_loads=False)))
    return plan


def _run_backend(
    console: Console,
    kind: str,
    plan: list[tuple[str, ReplayConfig]],
    sessions: Sequence[Session],
    spec: ClusterSpec,
    n_req: int,
    show: bool,
) -> list[ReplayResult]:
    """Start ``kind``'s servers once and run the plan, emptying the store between runs."""
    out: list[ReplayResult] = []
    try:
        with open_backend(kind, spec, f"bench-replay/{uuid.uuid4().hex[:12]}") as b:
            for i, (label, cfg) in enumerate(plan):
                if i:
                    clear(b, sessions)
                ssd0 = ssd_read_blocks(b)
                with replayreport.progress(console, label, n_req, show) as tick:
                    res = run_replay(sessions, b, cfg, label=label, on_request=tick)
                console.print(replayreport.run_line(res, ssd0, ssd_read_blocks(b)))
                out.append(res)
    except Exception as e:
        raise click.ClickException(f"{kind}: {type(e).__name__}: {e}") from e
    return out


def clear(backend: Backend, sessions: Sequence[Session]) -> None:
    """Remove every block the replay of ``sessions`` may have stored."""
    cache: dict[int, bytes] = {}
    keys = {
        h for s in sessions for x in s.walk() for r in x.requests for h in request_hashes(r, cache)
    }
    ordered = sorted(keys)
    for i in range(0, len(ordered), 4096):
        backend.remove(ordered[i : i + 4096])
