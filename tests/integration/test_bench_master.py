"""`kvstore bench transfer` and `kvstore bench store` against a running cluster
(``--master``), and `--vs mooncake` refused at once when Mooncake cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from kvstore.cluster import LocalCluster
from kvstore_bench.transfer.store import store_cmd

TINY = [
    "--quick",
    "--block-sizes", "64KiB",
    "--batch-sizes", "4",
    "--concurrency", "1",
    "--total-bytes", "1MiB",
    "--max-seconds", "0.05",
]  # fmt: skip


def test_transfer_measures_the_running_cluster_and_starts_none(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "transfer", *TINY, "--transport", "tcp",
         "--master", cluster.address, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [js] = tmp_path.glob("transfer-*.json")
    result = json.loads(js.read_text())
    assert result["config"]["master"] == cluster.address
    assert (
        result["config"]["aggregate_workers"] == 1
    )  # no servers added to a cluster it did not start
    pts = result["points"]
    # the points spread over the running cluster's 2 workers, and say so (issue 43)
    assert {(p["op"], p["workers"]) for p in pts} == {("put", 2), ("get", 2)}
    assert all(sorted(p["worker_ids"]) == sorted(cluster.live_worker_ids()) for p in pts)
    assert all(p["gib_s"] > 0 and p["system"] == "kvstore" for p in pts)
    assert any("running cluster at" in n and "this host" in n for n in result["notes"])
    assert cluster.master is not None and cluster.master.proc.poll() is None  # still ours


def test_store_measures_the_running_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    args = ["--backend", "kvstore", "--master", cluster.address, "--block-sizes", "4KiB",
            "--batch-sizes", "8", "--cell-size", "1MiB", "--out", str(tmp_path)]  # fmt: skip
    r = CliRunner().invoke(store_cmd, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    [js] = tmp_path.glob("store-*.json")
    doc = json.loads(js.read_text())
    assert doc["stores"]["kvstore"].startswith(f"kvstore at {cluster.address}")
    cells = doc["cells"]
    assert {c["op"] for c in cells} >= {"put", "get", "exists"}
    assert all(c["backend"] == "kvstore" and c["blocks_per_s"] > 0 for c in cells)


def test_vs_mooncake_without_mooncake_fails_at_once_with_the_install_line(
    tmp_path: Path,
) -> None:
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
        "from kvstore.cli import main\n"
        f"main(['bench', 'transfer', '--quick', '--vs', 'mooncake', '--out', {str(tmp_path)!r}],"
        " prog_name='kvstore')\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "pip install mooncake-transfer-engine-non-cuda" in out.stderr
    assert "ceilings" not in out.stdout  # nothing was measured first
    assert not list(tmp_path.glob("transfer-*.json"))
    assert took < 60
