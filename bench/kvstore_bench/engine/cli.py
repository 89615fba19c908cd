"""`kvstore bench engine`: real vLLM engines serving agent sessions, per KV backing.

Agent sessions (agentic trace files, or ``--synth N`` generated ones) are replayed as
token-id requests against ``--engines`` real vLLM CPU engine processes, once per
configuration, each on fresh engines: ``prefix`` (each engine's own prefix cache),
``kvstore`` (the kvstore connector + a local cluster), ``mooncake`` (vLLM's
MooncakeStoreConnector + Mooncake Store over TCP), ``lmcache`` (LMCacheMPConnector + an
``lmcache server``) and ``offload`` (vLLM's OffloadingConnector). Turns of a session are
routed round-robin over the engines, so a turn usually lands on another engine than the
last. ``--ablate`` adds kvstore variants. The bench itself runs in the project venv; the
engines run with ``--engine-python`` (the e2e venv that ``make e2e`` builds).

Output: a progress display, a table, plots (TTFT CDF, hit rate by turn, throughput) and
``--json PATH``. Modules of this package: workload (traces -> prompts, ideal hits), proc
(one engine process), peers (backings), run (one configuration), report (numbers),
models (model presets).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.config import parse_size
from kvstore.console import make_console

from .. import synth
from ..traces import load_agentic
from .groups import parse_group, pick_group
from .memory import kv_bytes_per_block, reference_hit_rates, working_set_blocks
from .models import (
    MAX_LEN,
    VOCAB,
    block_size,
    engine_block_size,
    model_config,
    preset_unavailable,
)
from .paired import by_engine_line
from .peers import ABLATIONS, CONFIGS, DEFAULT_CONFIGS, KVSTORE_WORKERS, Context
from .repeat import REPEAT_COLUMNS, median_run, repeat_rows, rotations
from .report import (
    TABLE_COLUMNS,
    Summary,
    failed,
    plot,
    summarize,
    table_rows,
    timed_requests,
    to_json,
)
from .run import ConfigRun, EngineSpec, Result, run_config
from .saturate import DEFAULT_IN_FLIGHT
from .sweep import SWEEP_COLUMNS, Point, parse_fractions, sweep_json, sweep_plots, sweep_rows
from .workload import Script, WorkloadShape, build_scripts

__all__ = ["engine_cmd"]

ROOT = Path(__file__).resolve().parents[3]
# --quick with --memory-sweep: synthetic sessions whose own contexts, not the prompt
# they share, make the working set
QUICK_SWEEP_SESSIONS = 16
QUICK_SWEEP_TURNS = 6
QUICK_SWEEP_TOKEN_SCALE = 0.06
QUICK_SWEEP_TIME_SCALE = 10.0
QUICK_SWEEP_SHAPE = synth.SynthShape(tool_tokens=600, system_tokens=200)


def _engine_python(path: str | None) -> Path:
    p = Path(path) if path else ROOT / ".venv-e2e" / "bin" / "python"
    if not p.exists():
        raise click.ClickException(
            f"engine python {p} does not exist: run `make e2e` first (it builds .venv-e2e "
            "with vLLM), or pass --engine-python"
        )
    return p


def _model(py: Path, preset: str, cache: Path) -> str:
    out = cache / f"model-{preset}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [str(py), "-m", "kvstore_bench.engine.models", preset, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if r.returncode != 0:
        raise click.ClickException(f"could not write the {preset} model:\n{r.stderr[-2000:]}")
    return str(out)


def _prefill_speed(run: ConfigRun) -> float | None:
    done = [r for r in run.results if not r.error and r.ttft_s > 0]
    secs = sum(r.ttft_s for r in done)
    toks = sum(r.prompt_tokens - r.cached_tokens for r in done)
    return toks / secs if secs > 0 and toks > 0 else None


@click.command("engine")
@click.argument("traces", nargs=-1, type=click.Path(exists=True))
@click.option("--format", "fmt", type=click.Choice(["agentic"]), default="agentic")
@click.option("--synth", "n_synth", type=int, default=None, help="N synthetic sessions.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed for --synth.")
@click.option("--engines", type=int, default=2, show_default=True)
@click.option("--model", "preset", default="tiny", show_default=True, help="tiny | larger | lfm2")
@click.option("--engine-python", default=None, help="Python of the e2e venv [.venv-e2e]")
@click.option(
    "--configs",
    default=",".join(DEFAULT_CONFIGS),
    show_default=True,
    help=f"Comma-separated configurations, of {', '.join(CONFIGS)} and the ablations.",
)
@click.option("--ablate", is_flag=True, help="Add kvstore ablation variants.")
@click.option("--token-scale", type=float, default=0.05, show_default=True)
@click.option("--time-scale", type=float, default=50.0, show_default=True)
@click.option(
    "--max-pause",
    type=float,
    default=10.0,
    show_default=True,
    help="Cap on a scaled pause between turns, seconds; 0 = none.",
)
@click.option("--max-turns", type=int, default=8, show_default=True, help="0 = all")
@click.option("--max-sessions", type=int, default=0, help="First N sessions (0 = all).")
@click.option(
    "--trace-group",
    default=None,
    help="I/N: every N-th trace file from the I-th (N runs cover every trace once; "
    "`kvstore bench engine-groups` gives mean and spread over their --json files).",
)
@click.option("--max-output", type=int, default=32, show_default=True)
@click.option("--memory", default="512MiB", show_default=True, help="Store memory per config")
@click.option(
    "--memory-sweep",
    default=None,
    help="Fractions of the working set, e.g. 0.125,0.25,0.5,1.0: every config at each.",
)
@click.option(
    "--sessions-aware",
    type=click.Choice(["on", "off"]),
    default="on",
    show_default=True,
    help="kvstore configs: send session hints (paused between turns, ended at the last).",
)
@click.option(
    "--ssd",
    is_flag=True,
    help="kvstore: half of each store's memory as DRAM, half as an SSD tier (peers: all "
    "in their memory tier).",
)
@click.option(
    "--kvstore-workers",
    type=click.IntRange(1, 16),
    default=KVSTORE_WORKERS,
    show_default=True,
    help="kvstore configs: workers sharing the store memory evenly (default one, as one "
    "host runs one worker; the peers run one store process).",
)
@click.option(
    "--engine-kv",
    default=None,
    help="Each engine's own KV cache [256MiB; with --memory-sweep: two of the longest turn].",
)
@click.option(
    "--quick",
    is_flag=True,
    help="2 sessions x 4 turns, small prompts (with --memory-sweep: 16 sessions x 6 turns, "
    "a short shared prompt, pauses at --time-scale 10).",
)
@click.option(
    "--repeat",
    type=click.IntRange(1, 50),
    default=1,
    show_default=True,
    help="Run every configuration N times, in turn, and report its median run.",
)
@click.option(
    "--saturate",
    is_flag=True,
    help="Keep --in-flight sessions per engine busy (sessions start when there is room, "
    "not on the trace's clock; a session's turns stay in order with their pauses): "
    "input tok/s is then throughput, not the arrival rate.",
)
@click.option(
    "--in-flight",
    type=click.IntRange(1, 64),
    default=DEFAULT_IN_FLIGHT,
    show_default=True,
    help="--saturate: sessions kept busy per engine.",
)
@click.option("--json", "json_path", default=None, help="Write the numbers here.")
@click.option("--out", default="bench/results", show_default=True, help="Plots go here.")
@click.option("--work-dir", default=None, help="Logs of every process [a temp dir].")
@click.option("--progress/--no-progress", default=True, show_default=True)
def engine_cmd(
    traces: tuple[str, ...],
    fmt: str,
    n_synth: int | None,
    seed: int,
    engines: int,
    preset: str,
    engine_python: str | None,
    configs: str,
    ablate: bool,
    token_scale: float,
    time_scale: float,
    max_pause: float,
    max_turns: int,
    max_sessions: int,
    trace_group: str | None,
    max_output: int,
    memory: str,
    memory_sweep: str | None,
    sessions_aware: str,
    engine_kv: str | None,
    kvstore_workers: int,
    ssd: bool,
    quick: bool,
    repeat: int,
    saturate: bool,
    in_flight: int,
    json_path: str | None,
    out: str,
    work_dir: str | None,
    progress: bool,
) -> None:
    """Replay agent sessions on real vLLM engines, per KV backing configuration."""
    console = make_console(stderr=True)
    why = preset_unavailable(preset)
    if why:
        raise click.BadParameter(why, param_hint="--model")
    block = block_size(preset)  # the engine's tokens per KV block: the ideal's unit
    try:
        fractions = parse_fractions(memory_sweep) if memory_sweep else []
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--memory-sweep") from e
    py = _engine_python(engine_python)
    synth_shape = None
    if quick and fractions:
        # Enough sessions and turns that memory binds, and a short shared prompt: the
        # engines' own caches hold a long one, which would measure them, not the stores.
        max_sessions = max_sessions or QUICK_SWEEP_SESSIONS
        if n_synth is None and not traces:
            n_synth = QUICK_SWEEP_SESSIONS
            synth_shape = QUICK_SWEEP_SHAPE
    if quick:
        max_sessions = max_sessions or 2
        turns = QUICK_SWEEP_TURNS if fractions else 4
        max_turns = min(max_turns or turns, turns)
        token_scale = min(token_scale, QUICK_SWEEP_TOKEN_SCALE if fractions else 0.03)
        max_output = min(max_output, 8)
        # a sweep keeps the agents' pauses (tool calls), where session hints pay
        time_scale = QUICK_SWEEP_TIME_SCALE if fractions else max(time_scale, 100.0)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    for c in names:
        if c not in CONFIGS and c not in ABLATIONS:
            raise click.BadParameter(f"unknown configuration {c!r}", param_hint="--configs")
    if ablate:
        names += [a for a in ABLATIONS if a not in names]
    if "prefix" in names:  # the reference for output checks runs first
        names.remove("prefix")
        names.insert(0, "prefix")
    wdir = Path(work_dir or tempfile.mkdtemp(prefix="kvstore-bench-engine-"))
    wdir.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("KVSTORE_BENCH_CACHE", Path.home() / ".cache" / "kvstore-bench"))

    if n_synth is None and not traces:
        n_synth = 2
    if n_synth is not None:
        paths: list[str | os.PathLike[str]] = list(
            synth.write(wdir / "synth", n_synth, seed, shape=synth_shape)
        )
    else:
        paths = list(traces)
    if trace_group:
        try:
            paths = pick_group(paths, parse_group(trace_group))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--trace-group") from e
        if not paths:
            raise click.BadParameter("no trace in this group", param_hint="--trace-group")
    sessions = load_agentic(paths)
    if max_sessions:
        sessions = sessions[:max_sessions]
    shape = WorkloadShape(
        token_scale=token_scale,
        time_scale=time_scale,
        max_pause_s=max_pause,
        max_turns=max_turns,
        max_output=max_output,
        max_len=MAX_LEN,
        engines=engines,
        vocab=VOCAB,
    )
    scripts = build_scripts(sessions, shape)
    n_turns = sum(len(s.turns) for s in scripts)
    if not n_turns:
        raise click.ClickException("no turn fits the engine's context; lower --token-scale")
    console.print(
        f"[bold]engine bench[/]: {len(scripts)} scripts, {n_turns} turns, "
        f"{sum(len(t.prompt) for s in scripts for t in s.turns):,} prompt tokens, "
        f"{engines} engines, model {preset}, configs {', '.join(names)}; logs in {wdir}"
    )
    block_bytes = kv_bytes_per_block(model_config(preset), block)
    ws_blocks = working_set_blocks(scripts, block)
    ws_bytes = ws_blocks * block_bytes
    console.print(
        f"working set: {ws_blocks:,} blocks of {block_bytes:,} B = {ws_bytes / (1 << 20):.1f} MiB"
    )
    engine_len = MAX_LEN
    if fractions:
        # The engines' own caches must not hold the working set themselves (a GPU's
        # memory is smaller than the agents' working set): context = the longest turn,
        # KV cache = two such turns unless --engine-kv says otherwise.
        longest = max(len(t.prompt) + t.max_tokens for sc in scripts for t in sc.turns)
        engine_len = min(MAX_LEN, -(-longest // block) * block + block)
    if engine_kv:
        kv_cache = parse_size(engine_kv)
    elif fractions:
        kv_cache = 2 * engine_len * block_bytes // block
    else:
        kv_cache = 256 << 20
    console.print("writing the model ...")
    spec = EngineSpec(
        python=py,
        model=_model(py, preset, cache),
        block_size=engine_block_size(preset),
        expect_block_size=block,
        max_len=engine_len,
        kv_cache_bytes=kv_cache,
        # a hybrid's cache also holds its convolution state: its blocks are not counted
        block_bytes=block_bytes if engine_block_size(preset) is not None else 0,
    )
    ctx = Context(
        py,
        wdir,
        parse_size(memory),
        block,
        block_bytes=block_bytes,
        session_hints=sessions_aware == "on",
        ssd=ssd,
        kvstore_workers=kvstore_workers,
        saturate=engines * in_flight if saturate else 0,
    )
    stem = f"engine-{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    meta: dict[str, Any] = {
        "model": preset,
        "engines": engines,
        "scripts": len(scripts),
        "turns": n_turns,
        "token_scale": token_scale,
        "time_scale": time_scale,
        "max_pause_s": max_pause,
        "max_turns": max_turns,
        "max_output": max_output,
        "memory_bytes": ctx.memory_bytes,
        "block_size": block,
        "block_bytes": block_bytes,
        "working_set_blocks": ws_blocks,
        "working_set_bytes": ws_bytes,
        "engine_kv_cache_bytes": kv_cache,
        "engine_max_len": engine_len,
        "sessions_aware": sessions_aware,
        "kvstore_ssd": ssd,
        "kvstore_workers": kvstore_workers,
        "repeat": repeat,
        "trace_group": trace_group,
        "saturate": saturate,
        "sessions_in_flight": ctx.saturate,
        "traces": [str(p) for p in paths],
        "work_dir": str(wdir),
    }
    if fractions:
        points = _sweep(
            names, fractions, ws_bytes, ctx, spec, scripts, engines, console, progress, repeat
        )
        _print_sweep(console, points)
        _print_repeats(
            [
                (f"{p.fraction:g} ({p.memory_bytes / (1 << 20):.2f} MiB)", p.summaries)
                for p in points
            ]
        )
        try:
            for p in sweep_plots(points, Path(out), stem):
                console.print(f"plot: {p}")
        except ImportError as e:
            console.print(f"[yellow]no plots ({e}); pip install matplotlib[/]")
        if json_path:
            doc: dict[str, Any] = (
                to_json(points[-1].summaries, meta) if points else {"meta": meta, "configs": {}}
            )
            doc["sweep"] = sweep_json(points)
            Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
            console.print(f"json: {json_path}")
        _fail_loudly(console, [s for p in points for s in p.summaries])
        return

    runs = _repeated(names, repeat, ctx, spec, scripts, engines, console, progress)
    ref = runs["prefix"][0] if "prefix" in runs else None
    summaries = [
        median_run([_summary(r, scripts, block, ref, ctx) for r in runs[n]]) for n in names
    ]
    _print_table(console, summaries)
    _print_repeats([("-", summaries)])
    try:
        for p in plot(summaries, Path(out), stem):
            console.print(f"plot: {p}")
    except ImportError as e:
        console.print(f"[yellow]no plots ({e}); pip install matplotlib[/]")
    if json_path:
        Path(json_path).write_text(json.dumps(to_json(summaries, meta), indent=2) + "\n")
        console.print(f"json: {json_path}")
    _fail_loudly(console, summaries)


def _summary(
    run: ConfigRun, scripts: list[Script], block: int, ref: ConfigRun | None, ctx: Context
) -> Summary:
    """:func:`summarize` plus the memory and the offline references at that memory."""
    s = summarize(run, scripts, block, ref)
    s.memory_bytes = 0 if run.name == "prefix" else ctx.memory_bytes
    if run.ran and run.name != "prefix" and ctx.block_bytes:
        refs = reference_hit_rates(
            timed_requests(run, scripts), block, ctx.memory_bytes // ctx.block_bytes
        )
        s.ref_lru_hit_rate, s.ref_opt_hit_rate = refs.lru, refs.opt
        ok = [r for r in run.results if not r.error]
        if s.own_cache_tokens is not None and s.prompt_tokens:
            own = [max(0, r.local_cached_tokens) for r in ok]
            s.ref_lru_store_rate, s.ref_opt_store_rate = refs.beyond(own, s.prompt_tokens)
    return s


def _fail_loudly(console: Console, summaries: list[Summary]) -> None:
    """Every failed run, in red, then exit 1: a peer that did not run (or whose requests
    failed) is a failed bench, not a comparison against the peers that did."""
    bad = [s for s in summaries if failed(s)]
    if not bad:
        return
    for s in bad:
        console.print(f"[bold red]FAILED[/] {s.name}: {failed(s)}")
    raise click.exceptions.Exit(1)


def _sweep(
    names: list[str],
    fractions: list[float],
    ws_bytes: int,
    ctx: Context,
    spec: EngineSpec,
    scripts: list[Script],
    engines: int,
    console: Console,
    show: bool,
    repeat: int = 1,
) -> list[Point]:
    """Every configuration at each fraction of the working set (prefix once, or
    ``repeat`` times, before the first point)."""
    prefix: list[ConfigRun] = []
    if "prefix" in names:
        prefix = _repeated(["prefix"], repeat, ctx, spec, scripts, engines, console, show)["prefix"]
    ref = prefix[0] if prefix else None
    stores = [n for n in names if n != "prefix"]
    points: list[Point] = []
    for f in fractions:
        ctx.memory_bytes = max(1, int(f * ws_bytes))
        console.print(
            f"[bold]memory {f:g} x working set = {ctx.memory_bytes / (1 << 20):.2f} MiB[/]"
        )
        runs = _repeated(stores, repeat, ctx, spec, scripts, engines, console, show)
        if prefix:
            runs = {"prefix": prefix, **runs}
        points.append(
            Point(
                f,
                ctx.memory_bytes,
                [
                    median_run([_summary(r, scripts, ctx.block_size, ref, ctx) for r in rs])
                    for rs in runs.values()
                ],
            )
        )
    return points


def _repeated(
    names: list[str],
    repeat: int,
    ctx: Context,
    spec: EngineSpec,
    scripts: list[Script],
    engines: int,
    console: Console,
    show: bool,
) -> dict[str, list[ConfigRun]]:
    """Each configuration's runs, ``repeat`` rounds of all of them (:func:`rotations`)."""
    n_turns = sum(len(s.turns) for s in scripts)
    out: dict[str, list[ConfigRun]] = {n: [] for n in names}
    for r, order in enumerate(rotations(names, repeat)):
        if repeat > 1:
            console.print(f"round {r + 1} of {repeat}: {', '.join(order)}")
        for run in _run_all(order, ctx, spec, scripts, engines, n_turns, console, show):
            out[run.name].append(run)
    return out


def _print_repeats(groups: list[tuple[str, list[Summary]]]) -> None:
    rows = [row for memory, summaries in groups for row in repeat_rows(memory, summaries)]
    if not rows:
        return
    t = Table(title="engine bench: every run (--repeat); the rows above are the median runs")
    for c in REPEAT_COLUMNS:
        t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(*row)
    make_console(min_width=120).print(t)


def _print_sweep(console: Console, points: list[Point]) -> None:
    t = Table(title="engine bench: memory sweep")
    for c in SWEEP_COLUMNS:
        t.add_column(c, overflow="fold")
    for row in sweep_rows(points):
        t.add_row(*row)
    make_console(min_width=200).print(t)
    console.print(
        "  hit rate: prompt tokens the engines took from a cache (their own or the store); "
        "LRU / OPT ref: an offline shared cache of that memory (LRU, Belady), in the order "
        "the requests ran; ideal (inf): unlimited memory; hit TTFT: p50 of requests with "
        "cached tokens, as wait before their first-token step + that step, and p50 steps"
    )
    for p in points:
        _print_engines(console, p.summaries)


def _run_all(
    names: list[str],
    ctx: Context,
    spec: EngineSpec,
    scripts: list[Script],
    engines: int,
    n_turns: int,
    console: Console,
    show: bool,
) -> list[ConfigRun]:
    runs: list[ConfigRun] = []
    cols = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*cols, console=console, disable=not show) as bar:
        for name in names:
            task = bar.add_task(f"{name}: starting", total=n_turns)

            def event(text: str, task: Any = task) -> None:
                bar.update(task, description=text)

            def done(r: Result, task: Any = task) -> None:
                bar.advance(task)

            run = run_config(name, ctx, spec, scripts, engines, event, done)
            if name == "prefix" and run.ran:
                ctx.extra["prefill_tokens_per_s"] = _prefill_speed(run)
            bar.update(
                task,
                description=f"{name}: " + ("done" if run.ran else f"not run: {run.why_not[:60]}"),
            )
            runs.append(run)
    return runs


def _print_table(console: Console, summaries: list[Summary]) -> None:
    t = Table(title="engine bench")
    for c in TABLE_COLUMNS:
        t.add_column(c, overflow="fold")
    for row in table_rows(summaries):
        t.add_row(*row)
    make_console(min_width=160).print(t)
    for s in summaries:
        if s.ran and s.failed:
            console.print(f"[yellow]{s.name}: {s.failed} requests failed[/]")
        if s.ran and s.hit_rate_by_turn:
            curve = ", ".join(f"{k}:{100 * v:.0f}%" for k, v in s.hit_rate_by_turn.items())
            console.print(f"{s.name} hit rate by turn: {curve}")
    _print_engines(console, summaries)


def _print_engines(console: Console, summaries: list[Summary]) -> None:
    """Each engine's hit rate and TTFT p50: a run whose engines differ a lot (one misses
    and queues, the other hits) has a TTFT p50 that is the fast engine's."""
    for s in summaries:
        line = by_engine_line(s.name, s.per_request) if s.ran else None
        if line:
            console.print(f"  {line}")
        if s.ran and s.engine_kv_blocks:
            console.print(
                f"  {s.name}: engines' own KV caches as allocated: "
                + ", ".join(
                    f"{b:,} blocks ({t:,} tokens)"
                    for b, t in zip(s.engine_kv_blocks, s.engine_kv_tokens, strict=False)
                )
                + (
                    f"; busy {100 * s.engine_busy_share:.0f}% of the wall time"
                    if s.engine_busy_share is not None
                    else ""
                )
            )
        n = s.load_failed_requests
        if s.ran and n:
            console.print(
                f"  {s.name}: {n} request{'s' if n != 1 else ''} recomputed after a failed "
                f"load ({s.load_failed_tokens:,} tokens)"
            )
