"""`kvstore bench scale` on a tiny configuration: a real master (and HA masters on a
real etcd when it is installed), simulated workers and watchers, for seconds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore_bench.scale.ring import ring_figures
from kvstore_bench.scale.run import map_version
from kvstore_client.proto import master_pb2


def test_map_version_is_read_from_the_wire() -> None:
    for v in (0, 1, 300, 1 << 50):
        assert map_version(master_pb2.ShardMap(version=v, cluster_id="x").SerializeToString()) == v


def test_ring_figures_meet_the_goals_at_small_size() -> None:
    r = ring_figures(50, 200_000)
    assert r["balance_exact_max_over_mean"] < 1.15
    assert r["moved_only_from_leavers"], "only the leaving worker's keys move"
    assert abs(r["moved_fraction"] - r["left_capacity_share"]) < 0.01


def _scale(tmp_path: Path, *args: str) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "kvstore", "bench", "scale"),
            *("--watchers", "20", "--steady", "2", "--changes", "2"),
            *("--ring-keys", "20000", "--out", str(tmp_path), "--no-plots"),
            *("--json", str(tmp_path / "scale.json")),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "scale.json").read_text())
    return {r["mode"]: r for r in doc["runs"]}


def _check(r: dict[str, Any], workers: int) -> None:
    assert r["map_workers"] == workers
    assert r["delivery_missed"] == 0, "every watcher got every map change"
    assert r["fail_map_workers"] == workers - 1, "1% (one worker) expired"
    assert r["return_all_watchers_s"] is not None, "it came back"
    assert r["workers_in_map_end"] == workers
    assert 0 < r["master_cpu_per_s"] < 2
    assert r["heartbeats_per_s"] > workers / 2
    assert r["heartbeats_served_ratio"] > 0.9, "the master counted the beats it applied"
    # where a registration's time goes: the master's own, and as the workers saw it
    assert r["master_register_s"]["calls"] >= workers
    assert 0 < r["master_register_s"]["mean_s"] < 30
    for k in ("register_answer_s", "register_to_first_beat_s"):
        assert r["sim"][k]["n"] == workers and 0 < r["sim"][k]["p50"] <= r["sim"][k]["max"]


def test_bench_scale_tiny(tmp_path: Path) -> None:
    ha = shutil.which("etcd") is not None
    runs = _scale(
        tmp_path,
        *("--workers", "50", "--background-load", "1", "--log-dir", str(tmp_path / "logs")),
        *(("--ha", "--etcd-leases") if ha else ("--no-ha",)),
    )
    assert set(runs) == ({"single", "ha", "etcd-leases"} if ha else {"single"})
    for mode in ("single", "ha") if ha else ("single",):
        _check(runs[mode], 50)
        assert runs[mode]["load_average"][0] > 0
        kept = Path(runs[mode]["logs_kept"])
        assert kept == tmp_path / "logs" / mode and (kept / "master0.log").stat().st_size > 0
    if ha:
        assert runs["ha"]["etcd_total"]["etcd_mvcc_txn_total"] > 0
        lease = runs["etcd-leases"]
        assert lease["leases_expired_healthy"] == 0
        assert lease["keepalives_answered_ratio"] > 0.9
        assert lease["fail_detected_s"] is not None, "the stopped worker's key went"
    if not ha:
        pytest.skip("etcd is not installed: HA mode not run (scripts/install_etcd.sh)")


@pytest.mark.parametrize("protocol", ["stream", "unary"])
def test_workers_of_the_older_protocols_against_this_master(tmp_path: Path, protocol: str) -> None:
    """Workers older than Beats (a HeartbeatStream each, or unary calls) and watchers
    older than deltas (full maps) keep working against this master."""
    runs = _scale(
        tmp_path,
        *("--workers", "20", "--no-ha", "--protocol", protocol),
        *("--per-connection", "1", "--full-maps"),
    )
    _check(runs["single"], 20)


def test_simulated_workers_beat_by_datagram_one_per_connection(tmp_path: Path) -> None:
    """``--protocol datagrams``: each worker's bind asks for datagram beats, and once the
    master confirms them the beats are datagrams (the stream carries only news)."""
    runs = _scale(
        tmp_path,
        *("--workers", "20", "--no-ha", "--per-connection", "1", "--protocol", "datagrams"),
    )
    r = runs["single"]
    _check(r, 20)
    assert r["datagrams_per_heartbeat"] > 0.5  # (a loaded host confirms some late)
