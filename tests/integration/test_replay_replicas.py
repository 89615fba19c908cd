"""`kvstore bench replay --replicas 1,2 --kill-worker-at 0.5` on a small synthetic trace:
three real workers, worker w0 SIGKILLed half way. R=2 stores about twice the bytes and
keeps hitting after the kill; R=1 loses the dead worker's share; no wrong bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore_bench.peers import ClusterSpec
from kvstore_bench.replay.cli import replay_cmd
from kvstore_bench.replay.replicas import run_replica_replay
from kvstore_bench.replay.run import ReplayConfig, load_sessions
from kvstore_bench.synth import SynthShape, write
from kvstore_bench.traces import Session

SHAPE = SynthShape(
    turns_median=6,
    turn_tokens_mean=600,
    first_user_tokens=400,
    tool_tokens=512,
    system_tokens=256,
    subagent_prob=0.0,
    subagent_turns_median=2,
    subagent_task_tokens=200,
    context_limit=4000,
    summary_tokens=1000,
)
BLOCK = 64 * 16  # 64-token blocks of 16 bytes per token


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> list[Session]:
    d = tmp_path_factory.mktemp("synth")
    return load_sessions([str(p) for p in write(d, 3, 5, 64, SHAPE)], "agentic")


def test_two_copies_cost_twice_the_memory_and_survive_a_worker_kill(
    sessions: list[Session],
) -> None:
    spec = ClusterSpec(workers=3, dram_bytes=4 << 20, max_value_bytes=16 * BLOCK)
    cfg = ReplayConfig(bytes_per_token=16)
    r1 = run_replica_replay(sessions, cfg, spec, 1, 0.5)
    r2 = run_replica_replay(sessions, cfg, spec, 2, 0.5)
    for r in (r1, r2):
        assert r.content_errors == 0, "a killed worker costs misses, never wrong bytes"
        assert r.killed_after == round(0.5 * r.requests)
    assert r1.hit_before == pytest.approx(r2.hit_before), "same trace, same hits before"
    assert 1.8 <= r2.stored_blocks / r1.stored_blocks <= 2.05, (r1, r2)
    assert r2.stored_bytes > 1.5 * r1.stored_bytes
    assert r2.hit_after > r1.hit_after, "R=1 lost w0's blocks; R=2 reads their copies"


def test_cli_reports_replicas(tmp_path: Path, sessions: list[Session]) -> None:
    out = CliRunner().invoke(
        replay_cmd,
        [
            *("--synth", "2", "--seed", "5", "--max-requests", "4", "--block-tokens", "64"),
            *("--bytes-per-token", "16", "--workers", "3", "--dram-size", "4MiB"),
            *("--replicas", "2", "--kill-worker-at", "0.5", "--out", str(tmp_path)),
        ],
    )
    assert out.exit_code == 0, out.output
    assert "R=2" in out.output
    doc = json.loads(next(tmp_path.glob("replay-replicas*.json")).read_text())
    assert doc["runs"][0]["replicas"] == 2 and doc["runs"][0]["content_errors"] == 0
    bad = CliRunner().invoke(replay_cmd, ["--synth", "1", "--replicas", "2", "--workers", "2"])
    assert bad.exit_code != 0 and "--workers > 2" in bad.output
