"""`kvstore bench scale` on a tiny configuration: a real master (and HA masters on a
real etcd when it is installed), simulated workers and watchers, for seconds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_bench_scale_tiny(tmp_path: Path) -> None:
    ha = shutil.which("etcd") is not None
    out = subprocess.run(
        [
            *(sys.executable, "-m", "kvstore", "bench", "scale"),
            *("--workers", "50", "--watchers", "20", "--steady", "2", "--changes", "2"),
            *("--ring-keys", "20000", "--out", str(tmp_path), "--no-plots"),
            *("--json", str(tmp_path / "scale.json")),
            "--ha" if ha else "--no-ha",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "scale.json").read_text())
    runs = {r["mode"]: r for r in doc["runs"]}
    assert set(runs) == ({"single", "ha"} if ha else {"single"})
    for r in runs.values():
        assert r["map_workers"] == 50
        assert r["delivery_missed"] == 0, "every watcher got every map change"
        assert r["fail_map_workers"] == 49, "1% (one worker) expired"
        assert r["return_all_watchers_s"] is not None, "it came back"
        assert 0 < r["master_cpu_per_s"] < 2
        assert r["heartbeats_per_s"] > 25
    if ha:
        assert runs["ha"]["etcd_total"]["etcd_mvcc_txn_total"] > 0
    if not ha:
        pytest.skip("etcd is not installed: HA mode not run (scripts/install_etcd.sh)")
