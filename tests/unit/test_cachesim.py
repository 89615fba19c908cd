"""Offline reference hit rates (kvstore_bench.cachesim)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvstore_bench.replay.cachesim import (
    HitStats,
    distinct_blocks,
    ideal_hit_rate,
    lru_hit_rate,
    opt_hit_rate,
)
from kvstore_bench.traces import Request, iter_requests, load_agentic, load_mooncake


def _traces_dir() -> Path | None:
    here = Path(__file__).resolve().parents[2]
    env = os.environ.get("KVSTORE_TRACES")
    for cand in (env, here / "shared" / "traces", here.parent / "shared" / "traces"):
        if cand and (Path(cand) / "mooncake").is_dir():
            return Path(cand)
    return None


TRACES = _traces_dir()
needs_traces = pytest.mark.skipif(TRACES is None, reason="shared/traces not found")


def _r(ids: list[int], tin: int | None = None, bs: int = 10) -> Request:
    return Request(
        session="s",
        t=0.0,
        input_tokens=tin if tin is not None else bs * len(ids),
        output_tokens=1,
        block_ids=tuple(ids),
        block_tokens=bs,
        model="m",
    )


def test_ideal_counts_leading_runs_only() -> None:
    reqs = [_r([1, 2, 3]), _r([1, 2, 4]), _r([1, 9, 3]), _r([1, 2, 4, 5])]
    s = ideal_hit_rate(reqs)
    # hits: 0, 2 (4 is new), 1 (9 is new; 3 after it does not count), 3
    assert (s.requests, s.blocks_hit, s.blocks_total) == (4, 6, 13)
    assert (s.tokens_hit, s.tokens_total) == (60, 130)
    assert s.block_hit_rate == pytest.approx(6 / 13) and s.capacity_blocks is None


def test_partial_last_block_counts_as_a_block_but_not_as_tokens() -> None:
    # 25 tokens in 10-token blocks: ids for 3 blocks, the last one partial (Mooncake style)
    reqs = [_r([1, 2, 3], tin=25), _r([1, 2, 3], tin=25)]
    s = ideal_hit_rate(reqs)
    assert (s.blocks_hit, s.blocks_total) == (3, 6)
    assert (s.tokens_hit, s.tokens_total) == (20, 50)
    # Agentic style: only full blocks listed, the tail is never a hit.
    s = ideal_hit_rate([_r([1, 2], tin=25), _r([1, 2], tin=25)])
    assert (s.tokens_hit, s.tokens_total) == (20, 50)


def test_empty_input_gives_zero_rates() -> None:
    for s in (ideal_hit_rate([]), lru_hit_rate([], 5)):
        assert s == HitStats(0, 0, 0, 0, 0, s.capacity_blocks)
        assert s.block_hit_rate == 0.0 and s.token_hit_rate == 0.0


def test_lru_touches_hits_and_evicts_least_recent() -> None:
    reqs = [
        _r([1, 2, 3]),  # miss x3; cache (LRU first): 1 2 3
        _r([1]),  # hit 1; order: 2 3 1
        _r([4]),  # miss, evicts 2: 3 1 4
        _r([1, 2]),  # hit 1, miss 2 (evicts 3): 4 1 2
        _r([3, 1]),  # 3 gone: miss; inserting 3 evicts 4; 1 (behind the miss) touched: 2 3 1
        _r([4]),  # 4 gone: miss; evicts 2: 3 1 4
        _r([2, 3, 1]),  # 2 gone: miss (3 and 1 behind it do not count)
    ]
    s = lru_hit_rate(reqs, 3)
    assert s.capacity_blocks == 3
    assert s.blocks_hit == 2 and s.blocks_total == 13
    per_request = [lru_hit_rate(reqs[: i + 1], 3).blocks_hit for i in range(len(reqs))]
    assert np.diff([0, *per_request]).tolist() == [0, 1, 0, 1, 0, 0, 0]


def test_lru_zero_capacity_never_hits_and_negative_is_rejected() -> None:
    reqs = [_r([1, 2]), _r([1, 2])]
    assert lru_hit_rate(reqs, 0).blocks_hit == 0
    with pytest.raises(ValueError):
        lru_hit_rate(reqs, -1)


def test_lru_matches_ideal_when_large_and_grows_with_capacity() -> None:
    rng = np.random.default_rng(3)
    reqs: list[Request] = []
    chains = [[int(x) for x in rng.choice(10_000, size=40, replace=False)] for _ in range(30)]
    for _ in range(400):
        c = chains[int(rng.integers(len(chains)))]
        n = int(rng.integers(1, len(c) + 1))
        reqs.append(_r(c[:n], tin=n * 10 - int(rng.integers(0, 10))))
    ideal = ideal_hit_rate(reqs)
    total = distinct_blocks(reqs)
    big = lru_hit_rate(reqs, total)
    assert (big.blocks_hit, big.tokens_hit) == (ideal.blocks_hit, ideal.tokens_hit)
    rates = [lru_hit_rate(reqs, c).blocks_hit for c in (0, 50, 200, 600, total)]
    assert rates == sorted(rates) and rates[0] == 0 and rates[-1] == ideal.blocks_hit


def test_belady_keeps_the_block_needed_soonest() -> None:
    reqs = [
        _r([1]),  # miss; cache 1
        _r([2]),  # miss; cache 1 2
        _r([3]),  # miss; next uses: 1 -> 3, 2 -> 4, 3 never: 3 is the one not kept
        _r([1]),  # hit
        _r([2]),  # hit
    ]
    opt = opt_hit_rate(reqs, 2)
    assert opt.capacity_blocks == 2 and opt.blocks_hit == 2
    assert lru_hit_rate(reqs, 2).blocks_hit == 0  # 3 evicts 1, 1 evicts 2
    per_request = [opt_hit_rate(reqs[: i + 1], 2).blocks_hit for i in range(len(reqs))]
    assert np.diff([0, *per_request]).tolist() == [0, 0, 0, 1, 1]


def test_belady_drops_a_chain_from_its_tail() -> None:
    # 1 heads the chain 1 5 7; all three are next wanted by the same request: keep the
    # head (ties broken by id instead would drop 1 and the last request would miss)
    reqs = [_r([1, 5]), _r([1, 5, 7]), _r([1, 5, 7])]
    opt = opt_hit_rate(reqs, 2)
    per_request = [opt_hit_rate(reqs[: i + 1], 2).blocks_hit for i in range(len(reqs))]
    assert np.diff([0, *per_request]).tolist() == [0, 2, 2]
    assert opt.blocks_hit == 4 and lru_hit_rate(reqs, 2).blocks_hit == 2


def test_belady_bounds_lru_and_ideal() -> None:
    rng = np.random.default_rng(5)
    chains = [[int(x) for x in rng.choice(10_000, size=30, replace=False)] for _ in range(20)]
    reqs = []
    for _ in range(300):
        c = chains[int(rng.integers(len(chains)))]
        reqs.append(_r(c[: int(rng.integers(1, len(c) + 1))]))
    ideal = ideal_hit_rate(reqs)
    total = distinct_blocks(reqs)
    for cap in (0, 10, 60, 200, total):
        lru, opt = lru_hit_rate(reqs, cap), opt_hit_rate(reqs, cap)
        assert lru.blocks_hit <= opt.blocks_hit <= ideal.blocks_hit
    assert opt_hit_rate(reqs, 0).blocks_hit == 0
    assert opt_hit_rate(reqs, total).blocks_hit == ideal.blocks_hit
    assert opt_hit_rate([], 3) == HitStats(0, 0, 0, 0, 0, 3)
    with pytest.raises(ValueError):
        opt_hit_rate(reqs, -1)


@needs_traces
def test_mooncake_reference_figures() -> None:
    """The figures published with the traces (traces/README.md)."""
    assert TRACES is not None
    reqs = list(iter_requests(load_mooncake(TRACES / "mooncake" / "conversation_trace.jsonl")))
    ideal = ideal_hit_rate(reqs)
    assert round(ideal.block_hit_rate, 3) == 0.366
    cap = distinct_blocks(reqs) // 10
    lru = lru_hit_rate(reqs, cap)
    assert 0.27 <= lru.token_hit_rate <= 0.29
    assert lru.blocks_hit < ideal.blocks_hit


@needs_traces
def test_agentic_sessions_mostly_hit() -> None:
    assert TRACES is not None
    reqs = list(iter_requests(load_agentic(TRACES / "agentic")))
    ideal = ideal_hit_rate(reqs)
    # Coding-agent turns re-send the whole history: almost everything is a prefix hit.
    assert 0.9 < ideal.block_hit_rate < 1.0
    assert 0.9 < ideal.token_hit_rate < 1.0
