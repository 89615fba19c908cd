"""`kvstore bench replay` against real stores: hit rates against the offline figures,
content verification, the Mooncake and Redis backends, and the CLI with its ablations.

The trace is a small synthetic one (a few sessions with sub-agents, contexts compacted
at 6K tokens so no prompt is longer than the small cache), in 64-token blocks of 1 KiB.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.cluster import LocalCluster
from kvstore_bench.peers import ClusterSpec, KVStoreBackend, open_backend, unavailable_reason
from kvstore_bench.replay.cli import replay_cmd
from kvstore_bench.replay.run import (
    ReplayConfig,
    block_content,
    load_sessions,
    request_hashes,
    run_replay,
)
from kvstore_bench.synth import SynthShape, write
from kvstore_bench.traces import Session
from tests.conftest import MakeCluster, assert_no_leaks

SHAPE = SynthShape(
    turns_median=8,
    turn_tokens_mean=800,
    first_user_tokens=500,
    tool_tokens=1024,
    system_tokens=256,
    subagent_prob=0.3,
    subagent_turns_median=3,
    subagent_task_tokens=300,
    context_limit=6000,
    summary_tokens=1500,
)
BPT = 16  # bytes per token: 1 KiB blocks of 64 tokens
BLOCK = 64 * BPT
SLAB = 16 * BLOCK


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> list[Session]:
    d = tmp_path_factory.mktemp("synth")
    files = [str(p) for p in write(d, 6, 3, 64, SHAPE)]
    return load_sessions(files, "agentic")


def _add_workers(cluster: LocalCluster, workers: int) -> LocalCluster:
    """Add workers w0, w1, ... to a started cluster (stable ids: a reproducible ring)."""
    for i in range(workers):
        cluster.add_worker("--id", f"w{i}")
    cluster.wait_for_workers(workers)
    return cluster


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two workers of 1024 blocks each (more than the trace's blocks), shared by the
    tests of this module through separate namespaces."""
    logs = str(tmp_path_factory.mktemp("logs"))
    cluster = LocalCluster(workers=0, dram_size="1MiB", max_value_size=str(SLAB), log_dir=logs)
    try:
        yield _add_workers(cluster.start(), 2).address
    finally:
        cluster.stop()
        assert_no_leaks(cluster)


@pytest.fixture
def backend(big: str, request: pytest.FixtureRequest) -> Iterator[KVStoreBackend]:
    b = KVStoreBackend(big, f"test/replay/{request.node.name.replace('[', '-').strip(']')}")
    yield b
    b.close()


def test_big_cluster_hits_exactly_the_ideal_rate(
    sessions: list[Session], backend: KVStoreBackend
) -> None:
    res = run_replay(sessions, backend, ReplayConfig(bytes_per_token=BPT, sessions=1))
    s = res.summary()
    assert res.lru is not None and res.capacity_blocks == 2048
    assert res.ideal.blocks_total == s["blocks"] > 1000
    assert s["blocks_hit"] == res.ideal.blocks_hit
    assert s["tokens_hit"] == res.ideal.tokens_hit
    assert s["hit_rate_tokens"] == res.ideal.token_hit_rate > 0.5
    assert s["content_errors"] == s["load_misses"] == s["store_failures"] == 0
    # Write only new blocks: what missed is written, hits are not rewritten.
    assert s["bytes_written"] == (s["blocks"] - s["blocks_hit"]) * BLOCK
    assert s["bytes_skipped"] == s["bytes_loaded"] == s["blocks_hit"] * BLOCK


def test_max_pause_caps_the_traces_pauses(sessions: list[Session], backend: KVStoreBackend) -> None:
    """A synthetic session's turns are minutes apart on its clock; at --time-scale 1
    with --max-pause 0.01 each pause lasts at most 10 ms, so the replay takes seconds,
    hits as it does back to back, and no store does better than Belady's order."""
    gaps = sum(x.requests[-1].t - x.requests[0].t for y in sessions for x in y.walk())
    assert gaps > 600
    cfg = ReplayConfig(bytes_per_token=BPT, sessions=1, time_scale=1.0, max_pause=0.01)
    res = run_replay(sessions, backend, cfg)
    s = res.summary()
    assert res.wall_s < 120
    assert s["blocks_hit"] == res.ideal.blocks_hit
    assert res.opt is not None and res.opt.blocks_hit == res.ideal.blocks_hit  # room for all
    assert s["opt_hit_rate_tokens"] == s["ideal_hit_rate_tokens"]


def test_concurrent_sessions_lose_nothing(sessions: list[Session], backend: KVStoreBackend) -> None:
    res = run_replay(sessions, backend, ReplayConfig(bytes_per_token=BPT, sessions=4))
    s = res.summary()
    assert s["requests"] == sum(len(x.requests) for y in sessions for x in y.walk())
    assert s["content_errors"] == s["store_failures"] == 0
    assert s["blocks_hit"] <= res.ideal.blocks_hit
    # Four sessions at once: a block another session is still writing when this one
    # looks it up is a miss the sequential ideal does not have. That loss is 0.9
    # points here (0.80 against 0.79), 1.8 at times, and 2.03 in a clean-clone CI
    # run on a loaded machine (the old and the new client alike): a timing margin,
    # not lost blocks (content errors and store failures are zero above).
    assert s["hit_rate_tokens"] > res.ideal.token_hit_rate - 0.03


def test_small_cluster_is_within_two_points_of_lru(
    sessions: list[Session], make_cluster: MakeCluster
) -> None:
    # 2 workers x 64 blocks: about a tenth of the trace's blocks.
    cluster = make_cluster(workers=0, dram_size=str(4 * SLAB), max_value_size=str(SLAB))
    _add_workers(cluster, 2)
    with contextlib.closing(KVStoreBackend(cluster.address, "test/replay/lru")) as b:
        res = run_replay(sessions, b, ReplayConfig(bytes_per_token=BPT, sessions=1))
    s = res.summary()
    assert res.capacity_blocks == 128 and res.lru is not None
    longest = max(r.blocks for r in res.records)
    assert longest < res.capacity_blocks  # no prompt is longer than the cache
    assert res.lru.token_hit_rate < res.ideal.token_hit_rate - 0.01  # the cache is too small
    assert abs(s["hit_rate_tokens"] - res.lru.token_hit_rate) <= 0.02
    assert abs(s["hit_rate_blocks"] - res.lru.block_hit_rate) <= 0.02
    assert s["content_errors"] == 0


def test_a_planted_wrong_block_is_counted(sessions: list[Session], backend: KVStoreBackend) -> None:
    h = request_hashes(sessions[0].requests[0])
    wrong = block_content([h[1]], BLOCK)[0]  # the right size, another block's bytes
    assert backend.client.batch_put(backend.ns, [h[0]], [wrong.data]) == [True]
    res = run_replay(sessions, backend, ReplayConfig(bytes_per_token=BPT, sessions=1))
    s = res.summary()
    # Every request starts with the shared prompt's first block: each one finds the
    # planted block, rejects it and recomputes everything.
    assert s["content_errors"] == s["requests"] > 0
    assert s["blocks_hit"] == 0
    assert res.ideal.blocks_hit > 0


def test_block_content_is_checked_word_by_word() -> None:
    from kvstore_bench.replay.run import _pattern, _verify

    hs = [bytes([i]) * 16 for i in range(3)]
    rows = block_content(hs, 256)
    rows[1, 100] ^= 1  # one flipped bit
    rows[2] = block_content([hs[0]], 256)[0]  # a whole wrong block
    assert _verify(rows, hs, _pattern(256)).tolist() == [True, False, False]


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_peer_backends_replay_the_same_way(sessions: list[Session], kind: str) -> None:
    reason = unavailable_reason(kind)
    if reason is not None:
        pytest.skip(f"{kind} is not installed here (.ci/run installs it): {reason}")
    spec = ClusterSpec(workers=2, dram_bytes=16 << 20)
    with open_backend(kind, spec, f"test-replay-{kind}") as b:
        pids = list(b.pids)
        res = run_replay(sessions, b, ReplayConfig(bytes_per_token=BPT, sessions=1))
    s = res.summary()
    assert s["content_errors"] == s["store_failures"] == 0
    assert s["blocks_hit"] == res.ideal.blocks_hit > 0
    for pid in pids:  # every server it started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_cli_sweep_and_ablation(tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = ["--synth", "2", "--seed", "5", "--quick", "--sessions", "1,2", "--ablate"]
    args += ["--workers", "2", "--dram-size", "32MiB", "--no-progress", "--out", str(out)]
    r = CliRunner().invoke(replay_cmd, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "load sweep" in r.output and "ablation" in r.output
    [js] = list(out.glob("replay-*.json"))
    assert {p.name.rsplit("-", 1)[1] for p in out.glob("*.png")} == {
        "hitrate.png",
        "latency.png",
        "sweep.png",
    }
    runs = {x["label"]: x["summary"] for x in json.loads(js.read_text())["runs"]}
    base = runs["kvstore x1"]
    assert runs["kvstore x2"]["content_errors"] == base["content_errors"] == 0
    every = runs["kvstore: write every block"]
    assert every["bytes_written"] == base["bytes_written"] + base["bytes_skipped"]
    assert every["hit_rate_tokens"] == base["hit_rate_tokens"] > 0.5
    assert runs["kvstore: one exists per block"]["hit_rate_tokens"] == base["hit_rate_tokens"]
    assert runs["kvstore: one worker at a time"]["hit_rate_tokens"] == base["hit_rate_tokens"]
    dropped = runs["kvstore: drop blocks at pauses"]
    assert dropped["hit_rate_tokens"] < 0.05 and dropped["bytes_loaded"] < base["bytes_loaded"]


def _make_run_replay_args() -> list[str]:
    """The `bench replay` arguments of `make run` (the Makefile's, continuation lines
    joined), so this test runs what a newcomer runs."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text().replace("\\\n", " ")
    line = next(
        x for x in text.splitlines() if "kvstore" in x and " bench replay " in x and "echo" not in x
    )
    args = shlex.split(line.split("bench replay", 1)[1])
    assert "--quick" in args, line
    return args


def test_make_run_replay_evicts(tmp_path: Path) -> None:
    """The quick replay of `make run` runs where its cache evicts: an LRU of its size
    hits clearly less than the ideal cache, so the plot's three lines (the store, the
    LRU, the ideal) are apart. With the old `--dram-size 1GiB` nothing was evicted and
    all three were one line at 91%."""
    args = [*_make_run_replay_args(), "--no-progress", "--out", str(tmp_path)]
    r = CliRunner().invoke(replay_cmd, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    [js] = list(tmp_path.glob("replay-*.json"))
    [run] = json.loads(js.read_text())["runs"]
    s = run["summary"]
    assert s["content_errors"] == 0
    assert s["lru_hit_rate_tokens"] < s["ideal_hit_rate_tokens"] - 0.05, s
    assert s["hit_rate_tokens"] < s["ideal_hit_rate_tokens"] - 0.05, s
