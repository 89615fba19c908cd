"""The engine bench's memory axis: working set, offline references, the sweep's output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvstore_bench.engine.memory import (
    kv_bytes_per_block,
    reference_hit_rates,
    working_set_blocks,
)
from kvstore_bench.engine.models import model_config
from kvstore_bench.engine.peers import (
    Context,
    NotRunnable,
    kvstore_min_bytes,
    make_backing,
    ring_density,
)
from kvstore_bench.engine.report import Summary, timed_requests
from kvstore_bench.engine.run import ConfigRun, Result
from kvstore_bench.engine.sweep import Point, parse_fractions, sweep_json, sweep_rows
from kvstore_bench.engine.workload import Script, Timed, Turn, ideal_hits
from kvstore_client.sharding import vnode_count

B = 32


def _reqs() -> list[Timed]:
    a = tuple(range(3, 3 + 4 * B + 1))  # 4 full blocks
    b = a[: 4 * B] + tuple(range(500, 565))  # the same 4, then 2 of its own
    return [Timed(a, 0, 0.0, 1.0), Timed(b, 1, 2.0, 3.0), Timed(a, 0, 4.0, 5.0)]


def test_kv_bytes_per_block_of_the_presets() -> None:
    # tiny: 2 layers x (K, V) x 2 KV heads x 64 x 4 B = 2 KiB per token
    assert kv_bytes_per_block(model_config("tiny"), 32) == 2048 * 32
    assert kv_bytes_per_block(model_config("larger"), 32) == 16384 * 32
    # lfm2: only its 2 attention layers hold KV
    assert kv_bytes_per_block(model_config("lfm2"), 128) == 2 * 2 * 2 * 64 * 4 * 128


def test_working_set_counts_distinct_full_blocks() -> None:
    turns = tuple(Turn("s", i, r.prompt, 1, 0.0, r.engine) for i, r in enumerate(_reqs()))
    assert working_set_blocks([Script("s", 0.0, turns)], B) == 6


def test_references_lru_loses_the_chain_head_and_opt_keeps_it() -> None:
    reqs = _reqs()
    total = sum(len(r.prompt) for r in reqs)
    shared, _ = ideal_hits(reqs, B)
    big = reference_hit_rates(reqs, B, 100)
    assert big.lru == big.opt == pytest.approx(sum(shared) / total)  # room for all: ideal
    four = reference_hit_rates(reqs, B, 4)
    # LRU: b's save pushes out a's first two blocks, so the third request misses at once
    assert four.lru == pytest.approx(128 / total)
    # Belady keeps a's four blocks (asked for again) and drops b's own two
    assert four.opt == pytest.approx(256 / total)
    one = reference_hit_rates(reqs, B, 1)
    assert one.lru == 0.0 and one.opt == pytest.approx(64 / total)
    assert reference_hit_rates(reqs, B, 0).opt == 0.0


def test_belady_reference_drops_a_chain_from_its_tail() -> None:
    """Blocks of one chain are next wanted by the same lookup: the reference must drop
    the deepest first (a prefix hit stops at the first gap). Broken by hash, the tie
    dropped a random block of the chain, often its head, and the reference read far
    below what the store reached."""
    a = tuple(range(3, 3 + 6 * B + 1))  # 6 full blocks
    reqs = [Timed(a, 0, 0.0, 1.0), Timed(a, 0, 2.0, 3.0), Timed(a, 0, 4.0, 5.0)]
    total = sum(len(r.prompt) for r in reqs)
    three = reference_hit_rates(reqs, B, 3)
    assert three.opt_hits == (0, 3 * B, 3 * B)  # the chain's first three, twice
    assert three.opt == pytest.approx(6 * B / total)


def test_references_start_a_request_when_the_engine_schedules_it() -> None:
    """A request that waited in the engine's queue looks its prefix up when it is
    scheduled: the references count from there (start + wait), not from the send.
    Before, the LRU reference of a quarter of the working set gave 72% where the
    stores reached 23-28%: requests queued behind others whose saves it ignored."""
    reqs = _reqs()
    turns = tuple(Turn("s", i, r.prompt, 1, 0.0, r.engine) for i, r in enumerate(reqs))

    def result(i: int, start: float, wait: float, end: float) -> Result:
        return Result("s", i, 0, 1, 0, wait + 0.1, end - start, start, end, [], [], wait_s=wait)

    run = ConfigRun("x", True, results=[result(0, 0.0, 0.5, 1.0), result(1, 0.2, 2.0, 3.0)])
    timed = timed_requests(run, [Script("s", 0.0, turns)])
    assert [(t.start, t.end) for t in timed] == [(0.5, 1.0), (2.2, 3.0)]
    shared, _ = ideal_hits(timed, B)
    assert shared[1] == 4 * B, "the first finished before the second was scheduled"


def test_parse_fractions() -> None:
    assert parse_fractions("1.0,0.125, 0.25") == [0.125, 0.25, 1.0]
    for bad in ("", "0", "-1", "nan", "5"):
        with pytest.raises(ValueError):
            parse_fractions(bad)


def test_kvstore_below_one_slab_per_worker_is_not_run_and_says_its_least(tmp_path: Path) -> None:
    ctx = Context(Path("/nonexistent/python"), tmp_path, 200 << 10, 32, block_bytes=64 << 10)
    assert kvstore_min_bytes(64 << 10) == 256 << 10  # one worker by default
    with pytest.raises(NotRunnable) as e:
        make_backing("kvstore", ctx)
    assert e.value.min_bytes == 256 << 10 and "slab" in str(e.value)
    # two workers need a slab each, whether asked for by flag or by the ablation
    ctx = Context(
        Path("/nonexistent/python"), tmp_path, 300 << 10, 32, block_bytes=64 << 10,
        kvstore_workers=2,
    )  # fmt: skip
    least = kvstore_min_bytes(64 << 10, 2)
    assert least == 2 * (256 << 10)
    with pytest.raises(NotRunnable) as e:
        make_backing("kvstore", ctx)
    assert e.value.min_bytes == least and "slab" in str(e.value)
    ctx.kvstore_workers = 1
    with pytest.raises(NotRunnable) as e:
        make_backing("kvstore-two-workers", ctx)
    assert e.value.min_bytes == least


def test_sweep_rows_and_json_report_every_point_and_the_reason_a_config_did_not_run() -> None:
    ran = Summary("kvstore", True, requests=3, prompt_tokens=100, cached_tokens=40)
    ran.token_hit_rate, ran.ref_lru_hit_rate, ran.ref_opt_hit_rate = 0.4, 0.2, 0.5
    ran.ttft_ms = {"p50": 10.0, "p95": 20.0, "p99": 30.0}
    ran.ttft_breakdown = {
        "hit": {"count": 2, "ttft_p50_ms": 9.0, "wait_p50_ms": 4.0, "step_p50_ms": 5.0,
                "steps_p50": 2.0, "steps_mean": 2.5},
        "miss": {"count": 1},
    }  # fmt: skip
    skipped = Summary("mooncake", False, why_not="segment too small", min_bytes=4 << 20)
    points = [Point(0.25, 1 << 20, [ran, skipped])]
    rows = sweep_rows(points)
    assert rows[0][:5] == ["0.25 (1.00 MiB)", "kvstore", "40.0%", "20.0%", "50.0%"]
    assert rows[0][-1] == "9 (4+5, 2)"
    assert "segment too small" in rows[1][2] and "4.00 MiB" in rows[1][2]
    doc = json.loads(json.dumps(sweep_json(points)))
    assert doc[0]["fraction"] == 0.25 and doc[0]["memory_bytes"] == 1 << 20
    kv = doc[0]["configs"]["kvstore"]
    assert kv["token_hit_rate"] == 0.4 and kv["ref_opt_hit_rate"] == 0.5
    assert doc[0]["configs"]["mooncake"]["min_bytes"] == 4 << 20
    assert not math.isnan(kv["ttft_breakdown"]["hit"]["steps_mean"])


def test_the_bench_gives_its_small_workers_a_production_workers_ring_points() -> None:
    """9 MiB workers at the default density sit at the floor of 160 points (shares of
    two equal workers spread by several points); the bench asks the master for the
    1,024 points of a 64 GiB worker."""
    for capacity in (2 << 20, 9_699_328, 1 << 30, 64 << 30, 256 << 30):
        n = vnode_count(capacity, ring_density(capacity))
        assert n >= 1024, (capacity, n)
    assert ring_density(64 << 30) == 16 and ring_density(1 << 40) == 16
    assert ring_density(1) == 1 << 20
