"""`kvstore bench transfer --quick` end to end with tiny sizes: real daemons, JSON checked.

The Mooncake variant runs when the mooncake wheel is installed and is skipped
with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.cluster import LocalCluster
from kvstore_bench.peers import PeerUnavailable, mooncake_master_binary
from kvstore_bench.transfer.run import Plan, Point, evaluate_targets
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.conftest import MakeCluster

TINY = [
    "--quick",
    "--block-sizes", "4KiB,64KiB",
    "--batch-sizes", "1,4",
    "--concurrency", "1,2",
    "--total-bytes", "1MiB",
    "--max-seconds", "0.05",
    "--dram-size", "256MiB",
    "--aggregate-workers", "2",
]  # fmt: skip


def run_bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "transfer", *TINY, "--out", str(tmp_path),
         "--log-dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = sorted(tmp_path.glob("transfer-*.json"))
    assert len(files) == 1, out.stdout[-2000:]
    assert "kvstore bench transfer" in out.stdout and "batch_exists" in out.stdout
    result: dict[str, Any] = json.loads(files[0].read_text())
    return result


def check_points(result: dict[str, Any], series: list[tuple[str, str]]) -> None:
    """Every grid point and the aggregate point, for every series, with sane numbers."""
    cfg = result["config"]
    want = {
        (s, tr, op, block, batch, conc, 1)
        for s, tr in series
        for op in ("put", "get")
        for block in cfg["blocks"]
        for batch in cfg["batches"]
        for conc in cfg["concurrency"]
    }
    want |= {(s, tr, op, 1 << 20, 64, 1, 2) for s, tr in series for op in ("put", "get")}
    got = {
        (p["system"], p["transport"], p["op"], p["block_bytes"], p["batch"], p["concurrency"],
         p["workers"]): p
        for p in result["points"]
    }  # fmt: skip
    assert want <= set(got), sorted(want - set(got))
    for k in want:
        p = got[k]
        assert p["errors"] == 0, p
        assert p["bytes"] > 0 and p["batches"] > 0, p
        assert 0 < p["gib_s"] < 1000, p
        assert p["seconds"] > 0 and p["p99_ms"] >= p["p50_ms"] > 0, p
        assert p["cpu_s_per_gib"] > 0 and p["cpu_client_s"] >= 0, p
        assert p["frac_socket"] == pytest.approx(p["gib_s"] / result["ceilings"]["socket_gib_s"])
    exists = {(e["system"], e["transport"], e["workers"]): e for e in result["exists"]}
    for s, tr in series:
        for w in (1, 2):
            e = exists[(s, tr, w)]
            assert e["all_found"] and e["keys"] == 1024 and e["keys_per_s"] > 0, e
    ceil = result["ceilings"]
    assert 0 < ceil["socket_gib_s"] < 1000 and 0 < ceil["memcpy_gib_s"] < 1000
    # N bare streams at once for every N = workers x concurrency above 1 (here 2: two
    # client threads on one worker, and the aggregate point's two workers), 3 runs each.
    many = ceil["socket_streams"]
    assert set(many) == {"2"}, many
    assert len(many["2"]["runs"]) == 3 and all(0 < x < 1000 for x in many["2"]["runs"])
    for p in result["points"]:
        if p["workers"] * p["concurrency"] == 2:
            assert p["frac_socket_streams"] == pytest.approx(p["gib_s"] / many["2"]["median"])
        else:
            assert p["frac_socket_streams"] == pytest.approx(p["frac_socket"])


def test_quick_kvstore(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--transport", "tcp,shm")
    skipped = [n for n in result["notes"] if "shm" in n]
    series = [("kvstore", "tcp")] + ([] if skipped else [("kvstore", "shm")])
    check_points(result, series)
    assert result["excluded"] == []
    assert not any(p["system"] == "mooncake" for p in result["points"])
    # Without Mooncake only the bare-socket goals can be judged.
    assert {t["name"] for t in result["targets"]} >= {"get 1 MiB x32 vs bare socket"} or (
        1 << 20 not in result["config"]["blocks"]
    )
    pytest.importorskip("matplotlib")
    assert list(tmp_path.glob("transfer-*.png"))


def _keys_held(cluster: LocalCluster) -> int:
    """Keys in every worker's DRAM, asked of each worker (not the master's last heartbeat)."""
    n = 0
    for w in cluster.worker_procs:
        with grpc.insecure_channel(w.ready["grpc"]) as ch:
            st = store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=5)
        n += st.keys
    return n


def test_running_cluster_names_its_workers_writes_here_and_cleans_up(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    """`--master` against a running 2-worker cluster, from a directory of its own and
    without --out: the results land under that directory (not in the installed
    package), every point and exists row names both workers, and the cluster holds
    no key the bench wrote (3,072 were left before: the exists working set)."""
    cluster = make_cluster(workers=2, dram_size="256MiB")
    ids = sorted(cluster.live_worker_ids())
    assert len(ids) == 2
    before = _keys_held(cluster)
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "transfer", "--master", cluster.address,
         "--transport", "tcp", "--block-sizes", "4KiB,64KiB", "--batch-sizes", "1,4",
         "--concurrency", "1", "--total-bytes", "16MiB", "--max-seconds", "0.05"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = list((tmp_path / "bench" / "results").glob("transfer-*.json"))
    assert len(files) == 1, (out.stdout[-2000:], list(tmp_path.rglob("*")))
    result = json.loads(files[0].read_text())
    assert result["points"] and result["exists"]
    for p in [*result["points"], *result["exists"]]:
        assert p["workers"] == 2 and p["worker_ids"] == ids, p
    assert any("spreads over its 2 workers" in n for n in result["notes"]), result["notes"]
    assert _keys_held(cluster) == before == 0


def _mooncake_missing() -> str | None:
    """Why Mooncake cannot run here, or None. The library loads in a child process."""
    try:
        mooncake_master_binary()
    except PeerUnavailable as e:
        return str(e)
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        return f"mooncake.store does not load: {probe.stderr.strip()[-300:]}"
    return None


MOONCAKE_MISSING = _mooncake_missing()


def test_quick_ucx(tmp_path: Path) -> None:
    """--transport ucx is measured in the same grid as tcp:// (the worker serves it)."""
    pytest.importorskip("ucxx")
    result = run_bench(tmp_path, "--transport", "tcp,ucx")
    assert not [n for n in result["notes"] if "ucx" in n], result["notes"]
    check_points(result, [("kvstore", "tcp"), ("kvstore", "ucx")])


@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))
def test_quick_vs_mooncake(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--transport", "tcp", "--vs", "mooncake")
    assert result["notes"] == []
    check_points(result, [("kvstore", "tcp"), ("mooncake", "tcp")])


def test_targets_and_plan_logic() -> None:
    def pt(system: str, op: str, block: int, gib_s: float) -> Point:
        return Point(system, "tcp", op, block, 32, 1, 1, 1, 1.0, gib_s, 1, 0, 1, 1, 0, 0, 0)

    points = [
        pt("kvstore", "get", 1 << 20, 3.0),
        pt("mooncake", "get", 1 << 20, 1.0),
        pt("kvstore", "put", 1 << 20, 2.0),
        pt("mooncake", "put", 1 << 20, 1.0),
    ]
    exists = [
        {"system": "kvstore", "transport": "tcp", "workers": 1, "keys_per_s": 3e6},
        {"system": "mooncake", "transport": "tcp", "workers": 1, "keys_per_s": 2e6},
    ]
    got = {
        t["name"]: (round(t["value"], 3), t["met"]) for t in evaluate_targets(points, exists, 4.0)
    }
    assert got == {
        "get 1 MiB x32 vs Mooncake": (3.0, True),
        "get 1 MiB x32 vs bare socket": (0.75, True),
        "put 1 MiB x32 vs Mooncake": (2.0, False),
        "put 1 MiB x32 vs bare socket": (0.5, False),
        "batch_exists x1024 vs batch_is_exist": (1.5, True),
    }
    # ucx:// is judged against tcp:// of the same run as well, at every target point.
    ucx = [
        Point("kvstore", "ucx", "get", 1 << 20, 32, 1, 1, 1, 1.0, 3.3, 1, 0, 1, 1, 0, 0, 0),
        Point("kvstore", "ucx", "put", 64 << 10, 32, 1, 1, 1, 1.0, 0.5, 1, 0, 1, 1, 0, 0, 0),
        pt("kvstore", "put", 64 << 10, 1.0),
    ]
    got = {
        t["name"]: (round(t["value"], 3), t["met"])
        for t in evaluate_targets(points + ucx, [], 4.0)
        if t["transport"] == "ucx"
    }
    assert got == {
        "get 1 MiB x32 vs Mooncake": (3.3, True),
        "get 1 MiB x32 vs bare socket": (0.825, True),
        "get 1 MiB x32 vs tcp://": (1.1, True),
        "put 64 KiB x32 vs tcp://": (0.5, False),
    }
    # shm:// (same host) is judged against memcpy, never against the socket.
    shm = [
        Point("kvstore", "shm", "get", 1 << 20, 32, 1, 1, 1, 1.0, 4.0, 1, 0, 1, 1, 0, 0, 0),
        Point("kvstore", "shm", "put", 64 << 10, 32, 1, 1, 1, 1.0, 2.0, 1, 0, 1, 1, 0, 0, 0),
    ]
    got = {
        t["name"]: (round(t["value"], 3), t["met"])
        for t in evaluate_targets(points + shm, [], 4.0, (3.0, 5.0), 10.0)
        if t["transport"] == "shm"
    }
    assert got == {
        "get 1 MiB x32 vs Mooncake": (4.0, True),
        "get 1 MiB x32 vs memcpy": (0.4, False),
        "put 64 KiB x32 vs memcpy": (0.2, False),
    }
    plan = Plan([4 << 10, 16 << 20], [1, 128], [1, 4], 1 << 30, 1.0, 1 << 30)
    assert plan.combos(4 << 10) == [(1, 1), (1, 4), (128, 1), (128, 4)]
    assert plan.combos(16 << 20) == [(1, 1), (1, 4)]
    assert len(plan.excluded()) == 2
