"""Synthetic agentic traces (kvstore_bench.synth)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvstore_bench.replay.cachesim import ideal_hit_rate
from kvstore_bench.synth import SynthShape, generate, write
from kvstore_bench.traces import Session, iter_requests, load_agentic

REAL_TOP_KEYS = {
    "id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens",
    "requests", "totals",
}  # fmt: skip
REAL_REQUEST_KEYS = {
    "t", "type", "model", "in", "out", "hash_ids", "input_types", "output_types", "stop",
    "api_time", "think_time",
}  # fmt: skip
REAL_SUBAGENT_KEYS = {
    "t", "type", "agent_id", "subagent_type", "duration_ms", "total_tokens",
    "tool_use_count", "status", "requests", "models", "tool_tokens", "system_tokens",
}  # fmt: skip


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Session]]:
    out = tmp_path_factory.mktemp("synth")
    paths = write(out, sessions=50, seed=11)
    return paths, load_agentic(paths)


def test_written_files_use_the_real_fields(synth: tuple[list[Path], list[Session]]) -> None:
    paths, _ = synth
    assert len(paths) == 50 and all(p.suffix == ".json" for p in paths)
    doc = json.loads(paths[0].read_text())
    assert set(doc) == REAL_TOP_KEYS | {"hash_id_space"}
    assert doc["block_size"] == 64 and doc["hash_id_scope"] == "global"
    for p in paths:
        for r in json.loads(p.read_text())["requests"]:
            keys = REAL_SUBAGENT_KEYS if r["type"] == "subagent" else REAL_REQUEST_KEYS
            assert set(r) == keys
            if r["type"] == "subagent":
                assert all(set(q) == REAL_REQUEST_KEYS for q in r["requests"])


def test_shape_lands_near_the_targets(synth: tuple[list[Path], list[Session]]) -> None:
    _, sessions = synth
    turns = [len(s.requests) for s in sessions]
    assert 25 <= float(np.median(turns)) <= 42
    growth: list[int] = []
    think: list[float] = []
    at_turn_30: list[int] = []
    tin = tout = 0
    for s in sessions:
        rs = s.requests
        think += [r.think_time for r in rs[1:]]
        growth += [b.input_tokens - a.input_tokens for a, b in itertools.pairwise(rs)]
        if len(rs) >= 30:
            at_turn_30.append(rs[29].input_tokens)
        for sub in s.walk():
            tin += sum(r.input_tokens for r in sub.requests)
            tout += sum(r.output_tokens for r in sub.requests)
    grew = [g for g in growth if g > 0]  # drop context compactions
    assert 1800 <= float(np.mean(grew)) <= 2600
    assert 110 <= tin / tout <= 155
    assert 4.0 <= float(np.median(think)) <= 6.5
    assert 40 <= float(np.percentile(think, 99)) <= 160
    assert 50_000 <= float(np.median(at_turn_30)) <= 110_000
    assert max(r.input_tokens for r in iter_requests(sessions)) <= SynthShape().context_limit


def test_subagents_fork_from_the_parents_prefix(
    synth: tuple[list[Path], list[Session]],
) -> None:
    _, sessions = synth
    forks = 0
    for s in sessions:
        for child in s.children:
            before = [r for r in s.requests if r.t <= child.start]
            parent_ids = before[-1].block_ids
            first = child.requests[0]
            assert first.block_ids[: len(parent_ids)] == parent_ids
            assert len(first.block_ids) > len(parent_ids)  # then it diverges
            assert first.parent_session == s.id and first.model == before[-1].model
            forks += 1
    assert forks >= 5


def test_sessions_share_the_tool_and_system_prefix(
    synth: tuple[list[Path], list[Session]],
) -> None:
    _, sessions = synth
    n_shared = (SynthShape().tool_tokens + SynthShape().system_tokens) // 64
    heads = {s.requests[0].block_ids[:n_shared] for s in sessions}
    assert len(heads) == 1
    nexts = {s.requests[0].block_ids[n_shared] for s in sessions}
    assert len(nexts) == len(sessions)  # each session's own first message
    stats = ideal_hit_rate(iter_requests(sessions))
    assert stats.block_hit_rate > 0.9


def test_same_seed_same_output_other_seed_differs(tmp_path: Path) -> None:
    a = generate(6, seed=5)
    assert a == generate(6, seed=5)
    assert a != generate(6, seed=6)
    pa = write(tmp_path / "a", 3, seed=5)
    pb = write(tmp_path / "b", 3, seed=5)
    assert [p.read_bytes() for p in pa] == [p.read_bytes() for p in pb]


def test_block_size_and_shape_parameters(tmp_path: Path) -> None:
    shape = SynthShape(turns_median=4, subagent_prob=1.0, subagent_model="small", model="big")
    paths = write(tmp_path, 3, seed=1, block_size=16, shape=shape)
    sessions = load_agentic(paths)
    for s in sessions:
        for sub in s.walk():
            for r in sub.requests:
                assert r.block_tokens == 16 and len(r.block_ids) == r.input_tokens // 16
                assert r.model == ("big" if sub.parent is None else "small")
    assert any(s.children for s in sessions)
    assert generate(0, seed=1) == []
    with pytest.raises(ValueError):
        generate(-1, seed=1)
    with pytest.raises(ValueError):
        generate(1, seed=1, block_size=0)
