"""`kvstore bench store` on real servers: every backend round-trips its blocks, and the
CLI writes its table, JSON and plot. Sizes are tiny: this checks the harness, not speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore_bench.peers import ClusterSpec, open_backend, unavailable_reason
from kvstore_bench.transfer.store import measure, store_cmd


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_peers_round_trip(kind: str) -> None:
    """The peers' adapters (kvstore's own run is in the CLI test below)."""
    reason = unavailable_reason(kind)
    if reason is not None:
        pytest.skip(f"{kind} is not installed here (.ci/run installs it): {reason}")
    spec = ClusterSpec(
        workers=2, dram_bytes=16 << 20, max_value_bytes=1 << 20
    )  # Mooncake: >= 16 MiB
    with open_backend(kind, spec, f"test-store-{kind}") as b:
        pids = list(b.pids)
        cells = [c for bs in (4096, 65536) for n in (1, 8) for c in measure(b, bs, n, 256 << 10)]
        assert b.exists([os.urandom(16)]) == [False]
    assert len(cells) == 2 * 2 * 3
    for c in cells:
        assert c.errors == 0, c
        assert c.blocks >= 3 * c.batch and c.blocks % c.batch == 0
        assert c.seconds > 0 and 0 < c.p50_s <= c.p99_s
        assert (c.bytes_per_s > 0) == (c.op != "exists")
    assert pids
    for pid in pids:  # every server it started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_cli_writes_table_json_and_plot(tmp_path: Path) -> None:
    """kvstore end to end: every cell round-trips without errors."""
    out = tmp_path / "results"
    args = ["--backend", "kvstore", "--block-sizes", "4KiB,64KiB", "--batch-sizes", "1,4"]
    args += ["--cell-size", "512KiB", "--dram-size", "8MiB", "--out", str(out)]
    r = CliRunner().invoke(store_cmd, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "store: throughput and latency per call" in r.output
    [js] = list(out.glob("store-*.json"))
    doc = json.loads(js.read_text())
    assert len(doc["cells"]) == 2 * 2 * 3
    assert {c["op"] for c in doc["cells"]} == {"put", "get", "exists"}
    assert all(c["errors"] == 0 and c["blocks"] >= 3 * c["batch"] for c in doc["cells"])
    assert all((c["bytes_per_s"] > 0) == (c["op"] != "exists") for c in doc["cells"])
    assert len(list(out.glob("store-*.png"))) == 1


def test_cli_rejects_a_cell_larger_than_the_store(tmp_path: Path) -> None:
    args = ["--backend", "kvstore", "--cell-size", "64MiB", "--dram-size", "16MiB"]
    r = CliRunner().invoke(store_cmd, [*args, "--out", str(tmp_path)])
    assert r.exit_code == 2 and "cell-size" in r.output


def test_tier_mode_reads_every_ssd_block_back(tmp_path: Path) -> None:
    from rich.console import Console

    from kvstore_bench.transfer.tier import run_tier

    r = run_tier(str(tmp_path), 160 << 20, 1 << 20, "32MiB", str(tmp_path / "out"), Console())
    st, raw = r["store"], r["raw"]
    assert st["ssd_blocks_read"] >= 90 and st["hits"] == st["ssd_blocks_read"]
    assert st["write_gib_s"] > 0 and st["read_gib_s"] > 0 and raw["write_gib_s"] > 0
    assert list((tmp_path / "out").glob("tier-*.json"))


def test_index_memory_reports_bytes_per_block(tmp_path: Path) -> None:
    """The DRAM tier's bookkeeping alone (no servers): a tiny fill, under the goal."""
    from tests.perf.index_memory import main

    out = tmp_path / "results"
    main(["--blocks", "20000", "--out", str(out)])
    [js] = list(out.glob("index-memory-*.json"))
    [row] = json.loads(js.read_text())["results"]
    assert row["blocks"] == 20000 and 0 < row["heap_bytes_per_block"] <= 128
    assert row["acquire_release_us"] > 0 and row["exists_many_1000_us"] > 0
