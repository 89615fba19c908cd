"""`kvstore bench scale`'s command line and output: the table (figures against the
goals of docs/SCALE.md), JSON and plots. The scenario is :mod:`.run`, the ring's
figures :mod:`.ring`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import numpy as np

from kvstore.console import make_console

from .. import report
from .ring import ring_figures
from .run import PROTOCOLS, ScaleConfig, run_scale

__all__ = ["scale_cmd"]


def _rows(runs: list[dict[str, Any]], ring: dict[str, Any]) -> list[list[str]]:
    def f(x: Any, fmt: str = "{:.3g}") -> str:
        return "-" if x is None or (isinstance(x, float) and x != x) else fmt.format(x)

    rows: list[list[str]] = []
    for r in runs:
        m = r["mode"]
        if m == "etcd-leases":
            rows += _lease_rows(r, f)
            continue
        if "error" in r:
            rows.append([m, r["error"], ""])
            continue
        rows += [
            [f"{m}: workers / watchers", f"{r['map_workers']} / {r['watchers']}", ""],
            [f"{m}: registration of all workers", f(r["register_s"], "{:.2f} s"), ""],
            [
                f"{m}: host load average 1 / 5 min (end)",
                " / ".join(f"{x:.1f}" for x in r.get("load_average", ())[:2]) or "-",
                "",
            ],
            [f"{m}: heartbeats/s", f(r["heartbeats_per_s"], "{:.0f}"), ""],
            [
                f"{m}: heartbeats sent as UDP datagrams",
                f(100 * r.get("datagrams_per_heartbeat", 0.0), "{:.1f}%"),
                "",
            ],
            [
                f"{m}: heartbeats served (by the master / sent)",
                f(100 * r.get("heartbeats_served_ratio", float("nan")), "{:.1f}%"),
                ">= 95%",
            ],
            [
                f"{m}: heartbeats sent / due at the interval",
                f(100 * r.get("heartbeats_sent_per_due", float("nan")), "{:.1f}%"),
                "",
            ],
            [
                f"{m}: workers in the map at the end",
                f"{r.get('workers_in_map_end', '-')} / {r['workers']}",
                "all",
            ],
            [
                f"{m}: simulator CPU (this process)",
                f(100 * r["simulator_cpu_per_s"], "{:.0f}%"),
                "",
            ],
            [
                f"{m}: master CPU (leader)",
                f(100 * r["master_cpu_per_s"], "{:.1f}% of a core"),
                "< 10% at 1 hb/s",
            ],
            [
                f"{m}: master CPU per heartbeat",
                f(1e6 * r["master_cpu_per_heartbeat_s"], "{:.0f} us"),
                "",
            ],
            [f"{m}: master RSS", f(r["master_rss_bytes"] / 2**20, "{:.0f} MiB"), ""],
            [f"{m}: map size", f(r["map_bytes"] / 1024, "{:.1f} KiB"), ""],
            [
                f"{m}: map change -> a watcher p50 / p99",
                f"{report.ms(r['delivery_p50_s'])} / {report.ms(r['delivery_p99_s'])} ms",
                "p99 < 1 s",
            ],
            [
                f"{m}: map change -> all watchers p50 / p99",
                f"{report.ms(r['delivery_all_p50_s'])} / {report.ms(r['delivery_all_p99_s'])} ms",
                "",
            ],
            [
                f"{m}: {r['fail_count']} fail -> all watchers",
                f(r["fail_all_watchers_s"], "{:.2f} s"),
                f"TTL {4 * r['heartbeat_s']:g} s",
            ],
            [f"{m}: they return -> all watchers", f(r["return_all_watchers_s"], "{:.2f} s"), ""],
        ]
        if "etcd_steady" in r:
            rows.append(
                [
                    f"{m}: etcd writes/s steady / whole run",
                    f"{r['etcd_steady']['etcd_server_proposals_committed_total']:.1f} / "
                    f"{r['etcd_writes_per_s_run']:.1f}",
                    "",
                ]
            )
            rows.append(
                [
                    f"{m}: standby CPU",
                    ", ".join(f"{100 * c:.1f}%" for c in r["standby_cpu_per_s"]),
                    "",
                ]
            )
    rows += [
        ["ring: points / memory", f"{ring['points']:,} / {ring['ring_bytes'] / 2**20:.0f} MiB", ""],
        [
            "ring: build R=1 / R=3",
            f"{1e3 * ring['build_r1_s']:.0f} / {1e3 * ring['build_r3_s']:.0f} ms",
            "",
        ],
        ["ring: lookup per key (batch 1000)", f"{1e9 * ring['lookup_per_key_s']:.0f} ns", ""],
        [
            "ring: max/mean load (exact / keys)",
            f"{ring['balance_exact_max_over_mean']:.3f} / {ring['balance_keys_max_over_mean']:.3f}",
            "<= 1.1",
        ],
        [
            f"ring: keys moved, {ring['left_workers']} workers leave",
            f"{100 * ring['moved_fraction']:.2f}% (their share "
            f"{100 * ring['left_capacity_share']:.2f}%)",
            "about 1%",
        ],
    ]
    return rows


def _lease_rows(r: dict[str, Any], f: Any) -> list[list[str]]:
    m = r["mode"]
    if "error" in r:
        return [[m, r["error"], ""]]
    return [
        [f"{m}: registration (grant + put)", f(r["register_s"], "{:.2f} s"), ""],
        [f"{m}: keep-alives/s", f(r["keepalives_per_s"], "{:.0f}"), ""],
        [f"{m}: keep-alives answered", f(100 * r["keepalives_answered_ratio"], "{:.1f}%"), ""],
        [f"{m}: etcd CPU", f(100 * r["etcd_cpu_per_s"], "{:.1f}% of a core"), ""],
        [f"{m}: etcd CPU per keep-alive", f(1e6 * r["etcd_cpu_per_keepalive_s"], "{:.0f} us"), ""],
        [f"{m}: simulator CPU", f(100 * r["simulator_cpu_per_s"], "{:.0f}%"), ""],
        [f"{m}: healthy leases expired", str(r["leases_expired_healthy"]), "0"],
        [
            f"{m}: {r['fail_count']} stop -> keys gone",
            f(r["fail_detected_s"], "{:.2f} s"),
            f"TTL {r['lease_ttl_s']} s",
        ],
    ]


def _plots(runs: list[dict[str, Any]], ring: dict[str, Any], out: Path, st: str) -> list[Path]:
    plt = report.pyplot()
    runs = [r for r in runs if r["mode"] != "etcd-leases" and "error" not in r]
    if plt is None or not runs:
        return []
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in runs:
        s = r["samples"]
        t = np.array([x["t"] for x in s])
        lead = r["leader"]
        cpu = np.array([x["cpu_s"][lead] for x in s])
        rate = np.diff(cpu) / np.maximum(np.diff(t), 1e-9)
        axes[0].plot(t[1:], 100 * rate, label=f"{r['mode']} (leader)")
        axes[1].plot(t, [x["rss"][lead] / 2**20 for x in s], label=f"{r['mode']} (leader)")
    axes[0].axhline(10, ls="--", color="k", lw=0.8, label="goal: 10% of a core")
    axes[0].set(xlabel="time since registration (s)", ylabel="master CPU (% of a core)")
    axes[0].set_title(
        f"master CPU: {runs[0]['map_workers']} workers at {1 / runs[0]['heartbeat_s']:g} hb/s, "
        f"{runs[0]['watchers']} watchers"
    )
    axes[1].set(xlabel="time since registration (s)", ylabel="master RSS (MiB)")
    for ax in axes:
        ax.legend(fontsize=7)
    paths.append(report.save(fig, report.results_path(out, "scale", st, "-master.png")))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in runs:
        xs = np.sort([x for e in r["changes"] for x in e["delivery_s"] if x == x]) * 1e3
        if len(xs):
            axes[0].plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r["mode"])
    axes[0].axvline(1000, ls="--", color="k", lw=0.8, label="goal: p99 < 1 s")
    axes[0].set(xlabel="map change -> watcher (ms)", ylabel="CDF", xscale="log", ylim=(0, 1))
    axes[0].set_title(f"map delivery to {runs[0]['watchers']} watchers")
    axes[0].legend(fontsize=7)
    load = np.array(ring["load_exact"])
    axes[1].hist(load / load.mean(), bins=50)
    axes[1].axvline(1.1, ls="--", color="k", lw=0.8, label="goal: max <= 1.1")
    axes[1].set(xlabel="worker load / mean (capacity-weighted)", ylabel="workers")
    axes[1].set_title(
        f"ring balance, {ring['workers']} workers (64/128/256 GiB), "
        f"max {ring['balance_exact_max_over_mean']:.3f}"
    )
    axes[1].legend(fontsize=7)
    paths.append(report.save(fig, report.results_path(out, "scale", st, "-delivery.png")))
    return paths


@click.command("scale")
@click.option("--workers", type=int, default=1000, show_default=True, help="Simulated workers.")
@click.option("--watchers", type=int, default=1000, show_default=True, help="Map watchers.")
@click.option(
    "--heartbeat",
    "heartbeat_s",
    type=float,
    default=1.0,
    show_default=True,
    help="Heartbeat interval in seconds (the master's TTL is 4 intervals).",
)
@click.option(
    "--steady",
    "steady_s",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds of steady state to measure.",
)
@click.option("--changes", type=int, default=20, show_default=True, help="Map changes to time.")
@click.option(
    "--ha/--no-ha",
    default=True,
    show_default=True,
    help="Also run with three HA masters on a real etcd.",
)
@click.option(
    "--ring-keys",
    type=int,
    default=4_000_000,
    show_default=True,
    help="Keys placed to measure balance and movement.",
)
@click.option(
    "--protocol",
    type=click.Choice(PROTOCOLS),
    default="beats",
    show_default=True,
    help="How simulated workers heartbeat: beats (one batched stream per connection, as "
    "kvstore worker does by default), datagrams (Beats streams that ask for UDP datagram "
    "beats, as kvstore worker --datagram-beats does), stream (one HeartbeatStream per "
    "worker) or unary (a call per heartbeat); the last two are the protocols before Beats.",
)
@click.option(
    "--per-connection",
    type=click.IntRange(1, 1024),
    default=10,
    show_default=True,
    help="Simulated workers per gRPC connection (1: one process per worker, as on separate hosts).",
)
@click.option(
    "--full-maps",
    is_flag=True,
    help="Watchers ask for full maps on every change (clients before map deltas).",
)
@click.option(
    "--background-load",
    type=click.IntRange(0, 64),
    default=0,
    show_default=True,
    help="Busy processes (CPU spinners) running beside the masters for the whole run.",
)
@click.option(
    "--etcd-leases",
    is_flag=True,
    help="Also measure the alternative design: worker leases kept alive in etcd, a "
    "master only watching (needs etcd).",
)
@click.option("--quick", is_flag=True, help="Shorter run: 8 s steady, 6 changes, 1M ring keys.")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench/results"), show_default=True
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the JSON here.",
)
@click.option("--no-plots", is_flag=True)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the masters' logs (and etcd's) here, one folder per mode (single, ha).",
)
def scale_cmd(
    workers: int, watchers: int, heartbeat_s: float, steady_s: float, changes: int, ha: bool,
    ring_keys: int, protocol: str, per_connection: int, full_maps: bool, background_load: int,
    etcd_leases: bool, quick: bool, out: Path, json_path: Path | None, no_plots: bool,
    log_dir: Path | None,
) -> None:  # fmt: skip
    """The control plane at scale: a real master, simulated workers and watchers."""
    if workers < 2 or watchers < 1 or heartbeat_s <= 0 or steady_s <= 0 or changes < 1:
        raise click.BadParameter("need workers >= 2, watchers >= 1 and positive durations")
    if quick:
        steady_s, changes, ring_keys = (
            min(steady_s, 8.0),
            min(changes, 6),
            min(ring_keys, 1_000_000),
        )
    cfg = ScaleConfig(
        workers, watchers, heartbeat_s, steady_s, changes, ring_keys=ring_keys, ha=ha,
        protocol=protocol, per_connection=per_connection, deltas=not full_maps,
        background_load=background_load, etcd_leases=etcd_leases,
        log_dir=str(log_dir.resolve()) if log_dir is not None else None,
    )  # fmt: skip
    console = make_console()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                   console=console, transient=True)  # fmt: skip
    with bar:
        task = bar.add_task("ring", total=None)

        def say(msg: str) -> None:
            bar.update(task, description=msg)

        say(f"ring: {workers} workers, {ring_keys:,} keys")
        ring = ring_figures(workers, ring_keys, cfg.fail_fraction)
        runs = run_scale(cfg, modes=("single", "ha") if ha else ("single",), say=say)
    for r in runs:
        r.update(heartbeat_s=heartbeat_s, watchers=watchers, workers=workers)
    st = report.stamp()
    console.print(report.table(f"kvstore bench scale ({report.command_line()})",
                               ["figure", "measured", "goal"], _rows(runs, ring)))  # fmt: skip
    doc = {"config": asdict(cfg), "runs": runs, "ring": ring, "command": report.command_line()}
    path = report.write_json(report.results_path(out, "scale", st, ".json"), doc)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        report.write_json(json_path, doc)
    console.print(f"JSON: {path}")
    if not no_plots:
        for p in _plots(runs, ring, out, st):
            console.print(f"plot: {p}")
