"""Connector decisions: hit rules, load-or-recompute, the save watermark, lookups in
flight, the staging cap, kv_role. Pure logic, no engine: these run in ``make test``."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore_client import block_hashes
from kvstore_client.connectors.planning import (
    BandwidthMeter,
    LoadPolicy,
    Lookups,
    RequestTracker,
    StagingBudget,
    StepClock,
    all_ranks,
    choose_load,
    classify_groups,
    hybrid_hit_blocks,
    pool_hit,
    role_flags,
)


def test_hybrid_hit_rule() -> None:
    kv = [True] * 6 + [False, True]
    assert hybrid_hit_blocks(kv, [False] * 8) == 0
    assert hybrid_hit_blocks(kv, [False, True, False, False, True, True, False, True]) == 6
    assert hybrid_hit_blocks(kv, [False, True, False, False, True, False, True, True]) == 5
    assert hybrid_hit_blocks(kv, [True]) == 1
    assert hybrid_hit_blocks([], []) == 0


def test_a_block_counts_only_when_every_rank_holds_it() -> None:
    """With TP > 1 each rank stores its own shard; rank 0 holding a block says
    nothing about rank 1 (a rank's write can fail alone), so the lookup asks all."""
    assert all_ranks([[True, True, True], [True, False, True]]) == [True, False, True]
    assert all_ranks([[True, True], [True]]) == [True]
    assert all_ranks([]) == []


def test_load_policy() -> None:
    p = LoadPolicy(min_hit_tokens=32, prefill_tokens_per_s=10_000)
    assert p.decide(16, 1000, None).reason == "short_hit"
    assert p.decide(64, 1000, None).load  # no bandwidth measured yet: load
    # 64 tokens x 1000 B = 64 KB: at 1 MB/s 64 ms to load, 6.4 ms to recompute.
    assert p.decide(64, 1000, 1e6).reason == "slow_load"
    assert p.decide(64, 1000, 1e9).load
    assert LoadPolicy(min_hit_tokens=32).decide(64, 1000, 1.0).load  # rule off
    m = BandwidthMeter(alpha=0.5, min_bytes=100)
    m.add(10, 1.0)  # too small: ignored
    assert m.bytes_per_s is None
    m.add(1000, 1.0)
    m.add(3000, 1.0)
    assert m.bytes_per_s == 2000


def test_tracker_plans_loads_and_saves_only_new_blocks() -> None:
    b = 4
    tr = RequestTracker("r", b)
    toks = list(range(22))  # 5 full blocks
    tr.extend_hashes(toks)
    assert tr.hashes == block_hashes(toks, b)
    tr.present = [True, True, True, False, True]
    tr.hit_blocks = 3
    policy = LoadPolicy(min_hit_tokens=b)
    # Local cache holds block 0; the store's hit adds blocks 1-2.
    assert tr.plan_hit(len(toks), 4, policy, 1.0, None) == 8
    refs = tr.plan_load([10, 11, 12, 13, 14, 15], 8)
    assert [(r.index, r.block_id) for r in refs] == [(1, 11), (2, 12)]
    # First step computes up to token 22: block 3 (absent) is new; 4 is present.
    out, skipped = tr.blocks_to_save(22, toks)
    assert [(r.index, r.block_id) for r in out] == [(3, 13)] and skipped == 4
    tr.save_done([3], ok=True)
    assert tr.saved_upto == 5
    # Decode: block 5 fills at token 24; nothing is written twice.
    toks += [7, 7]
    out, skipped = tr.blocks_to_save(23, toks)
    assert out == [] and skipped == 0
    toks += [8]
    out, _ = tr.blocks_to_save(24, toks)
    assert [r.index for r in out] == [5]
    # A block that failed to load is written after its recompute.
    tr2 = RequestTracker("r2", b, present=[True, True], hashes=[], block_ids=[1, 2])
    tr2.mark_missing([1])
    out, skipped = tr2.blocks_to_save(8, list(range(8)))
    assert [r.index for r in out] == [1] and skipped == 1


def test_the_store_run_goes_on_past_the_engines_own_hit() -> None:
    """Bug (old code): the hit was the store's leading run from block 0, so a store
    that had given up a session's oldest blocks gave nothing even when the engine's
    own cache held them: turns alternate engines, and the store's newer blocks (the
    previous turn's, saved by the other engine) were recomputed."""
    b = 4
    tr = RequestTracker("r", b)
    toks = list(range(26))  # 6 full blocks
    tr.extend_hashes(toks)
    tr.present = [False, False, True, True, False, True]
    tr.hit_blocks = 0
    policy = LoadPolicy(min_hit_tokens=b)
    # The engine holds blocks 0-1: the store's blocks 2-3 follow them; 4 is a gap.
    assert tr.plan_hit(len(toks), 8, policy, 1.0, None) == 8
    refs = tr.plan_load(list(range(10, 17)), 8)
    assert [(r.index, r.block_id, r.hash) for r in refs] == [
        (2, 12, tr.hashes[2]),
        (3, 13, tr.hashes[3]),
    ]
    # The engine holds block 0 only: block 1 is a gap, nothing to load.
    assert tr.plan_hit(len(toks), 4, policy, 1.0, None) == 0
    # A block that failed to load ends the run there.
    tr.mark_missing([3])
    assert tr.plan_hit(len(toks), 8, policy, 1.0, None) == 4
    # A hybrid model's hit needs the state at its end: no run past the engine's hit.
    hy = RequestTracker("h", b, past_local=False)
    hy.extend_hashes(toks)
    hy.present = [False, False, True, True, False, True]
    assert hy.plan_hit(len(toks), 8, policy, 1.0, None) == 0


def test_a_failed_load_shortens_the_hit_so_the_retry_does_not_load_it_again() -> None:
    """Bug (old code): a block evicted between lookup and load failed the load; vLLM
    scheduled the request again, the cached lookup still said 4 blocks, so the same
    load was planned and failed again, thousands of times a minute in a run whose
    store was a quarter of the working set."""
    b = 4
    tr = RequestTracker("r", b)
    toks = list(range(18))  # 4 full blocks
    tr.extend_hashes(toks)
    tr.present, tr.hit_blocks = [True] * 4, 4
    policy = LoadPolicy(min_hit_tokens=b)
    assert tr.plan_hit(len(toks), 0, policy, 1.0, None) == 16
    tr.plan_load(list(range(5)), 16)
    tr.mark_missing([2, 3])  # the worker: blocks 2 and 3 did not arrive
    assert tr.plan_hit(len(toks), 0, policy, 1.0, None) == 8, "only what did arrive"
    tr.mark_missing([0])
    assert tr.plan_hit(len(toks), 0, policy, 1.0, None) == 0


def test_failed_save_is_retried_and_the_watermark_waits_for_success() -> None:
    """Bug (old code): the watermark moved when a save was planned, so a save that
    was dropped (backpressure) or failed (worker down) was never tried again."""
    b = 4
    tr = RequestTracker("r", b, block_ids=list(range(10, 20)))
    toks = list(range(12))
    out, _ = tr.blocks_to_save(12, toks)
    assert [r.index for r in out] == [0, 1, 2]
    # In flight: the next step plans nothing twice.
    assert tr.blocks_to_save(12, toks)[0] == []
    assert tr.saved_upto == 0
    tr.save_done([0, 2], ok=True)
    tr.save_done([1], ok=False)
    assert tr.saved_upto == 1  # block 1 not confirmed: the watermark waits
    out, _ = tr.blocks_to_save(12, toks)
    assert [(r.index, r.block_id) for r in out] == [(1, 11)]  # retried
    tr.save_done([1], ok=True)
    assert tr.saved_upto == 3
    # A block that keeps failing is given up after max_save_attempts.
    tr3 = RequestTracker("r3", b, block_ids=[5], max_save_attempts=2)
    for _ in range(2):
        (ref,), _ = tr3.blocks_to_save(4, [1, 2, 3, 4])
        tr3.save_done([ref.index], ok=False)
    assert tr3.blocks_to_save(4, [1, 2, 3, 4])[0] == []


def test_full_hit_is_capped_below_the_prompt() -> None:
    tr = RequestTracker("r", 4, hit_blocks=4)
    tr.extend_hashes(list(range(16)))
    assert tr.plan_hit(16, 0, LoadPolicy(min_hit_tokens=4), 1.0, None) == 15
    # ... and the last block is still loaded whole.
    assert [r.index for r in tr.plan_load([0, 1, 2, 3], 15)] == [0, 1, 2, 3]


def test_lookups_answer_ask_again_and_run_side_by_side() -> None:
    """Bug (old code): one lookup at a time, and the scheduler waited for it (up to
    twice the deadline); a slow call starved the next request's lookup."""
    lk: Lookups[list[bool]] = Lookups(workers=2, deadline_s=5.0, wait_s=0.0)
    release = threading.Event()

    def slow() -> list[bool]:
        release.wait(10)
        return [True]

    t0 = time.monotonic()
    assert lk.poll(("a", 10), slow) == ("pending", None)  # never waits
    assert time.monotonic() - t0 < 2.5  # a blocking poll would wait out the 5 s deadline
    # A second request's lookup runs while the first is stuck.
    state = "pending"
    for _ in range(200):
        state, res = lk.poll(("b", 10), lambda: [False, True])
        if state != "pending":
            break
        time.sleep(0.01)
    assert (state, res) == ("done", [False, True])
    assert lk.poll(("a", 10), slow)[0] == "pending"  # the same lookup, not a new one
    release.set()
    for _ in range(200):
        state, res = lk.poll(("a", 10), slow)
        if state != "pending":
            break
        time.sleep(0.01)
    assert (state, res) == ("done", [True])
    assert lk.in_flight() == 0
    lk.shutdown()


def test_lookup_past_its_deadline_is_a_timeout_and_errors_are_reported() -> None:
    lk: Lookups[list[bool]] = Lookups(workers=1, deadline_s=0.05, wait_s=0.0)
    stop = threading.Event()
    assert lk.poll("x", lambda: [stop.wait(5)])[0] == "pending"
    time.sleep(0.1)
    assert lk.poll("x", lambda: [True]) == ("timeout", None)
    stop.set()

    def boom() -> list[bool]:
        raise ConnectionError("down")

    lk2: Lookups[list[bool]] = Lookups(workers=1, deadline_s=5.0, wait_s=1.0)
    state, err = lk2.poll("y", boom)  # wait_s: answered within the first poll
    assert state == "error" and isinstance(err, ConnectionError)
    lk2.poll(("r1", 5), lambda: [True])
    lk2.forget("r1")
    assert lk2.in_flight() == 0
    lk.shutdown()
    lk2.shutdown()


def test_staging_budget_caps_bytes_in_flight() -> None:
    b = StagingBudget(100)
    assert b.admit(60) and not b.admit(50) and b.admit(40)
    b.release(60)
    assert b.admit(50)
    b.release(90)
    assert b.used == 0
    assert b.admit(500)  # alone, a bigger load still runs
    assert not b.admit(1)


def test_kv_role() -> None:
    assert role_flags(None) == (True, True)
    assert role_flags("kv_both") == (True, True)
    assert role_flags("kv_producer") == (False, True)
    assert role_flags("kv_consumer") == (True, False)
    with pytest.raises(ValueError, match="kv_role"):
        role_flags("kv_sometimes")


def test_pool_hit_needs_the_state_at_the_prefix_end() -> None:
    """SGLang's hybrid pools: a prefix is usable when its KV pages are present and
    each extra pool allows it (trailing pages: the state at its end)."""
    kv = [True] * 6 + [False, True]
    mamba = [False, True, False, False, True, False, False, False]
    final, hits, restorable = pool_hit(kv, [("mamba", False, 1, mamba)])
    assert final == 5 and restorable == [2, 5] and hits == {"kv": 6, "mamba": 5}
    # no state anywhere: no hit, never KV without state
    assert pool_hit(kv, [("mamba", False, 1, [False] * 8)])[0] == 0
    # an all-pages pool cuts at its first gap
    assert pool_hit(kv, [("dsa", True, 0, [True, True, True, False, True, True])])[0] == 3
    # two pools: the prefix lengths both allow
    both = pool_hit(kv, [("mamba", False, 1, mamba), ("swa", False, 2, [True] * 3 + [False] * 5)])
    assert both[0] == 2
    assert pool_hit([], [])[0] == 0 and pool_hit([True, True], [])[0] == 2


def test_cache_groups_the_connector_serves_or_refuses() -> None:
    """Hybrid models: attention groups are KV, align-mode Mamba groups are state;
    anything else switches the connector off with a reason, never a wrong hit
    (old code: a pure Mamba model, one group, was written as if its state were KV)."""
    full = ("FullAttentionSpec", 128, None, 0)
    mamba = ("MambaSpec", 128, "align", 0)
    assert classify_groups([full]) == ([0], [], None)
    assert classify_groups([mamba, full]) == ([1], [0], None)  # LFM2 as vLLM makes it
    assert classify_groups([full, full, mamba]) == ([0, 1], [2], None)
    refused = {
        "pure state": [mamba],
        "no align": [full, ("MambaSpec", 128, "none", 0)],
        "speculative": [full, ("MambaSpec", 128, "align", 1)],
        "sliding window": [full, ("SlidingWindowSpec", 128, None, 0)],
        "block sizes": [("FullAttentionSpec", 64, None, 0), mamba],
    }
    for what, specs in refused.items():
        attn, state, why = classify_groups(specs)
        assert why and attn == [] and state == [], what
    assert "pure state" in str(classify_groups([mamba])[2])


def test_save_policy_all_sends_blocks_the_store_had() -> None:
    """``save_policy: all`` (save_known): blocks present at lookup, loaded or not,
    are planned for saving; each block still goes out once, and only a confirmed
    save moves the watermark."""
    b = 4
    toks = list(range(22))  # 5 full blocks
    new, every = RequestTracker("n", b), RequestTracker("a", b, save_known=True)
    for tr in (new, every):
        tr.extend_hashes(toks)
        tr.present = [True, True, True, False, True]
        tr.hit_blocks = 3
        tr.plan_hit(len(toks), 0, LoadPolicy(min_hit_tokens=b), 1.0, None)
        tr.plan_load([10, 11, 12, 13, 14, 15], 11)
    out, skipped = new.blocks_to_save(22, toks)
    assert [r.index for r in out] == [3] and skipped == 4
    out, skipped = every.blocks_to_save(22, toks)
    assert [(r.index, r.block_id) for r in out] == [(0, 10), (1, 11), (2, 12), (3, 13), (4, 14)]
    assert skipped == 0 and every.saved_upto == 0
    assert every.blocks_to_save(22, toks) == ([], 0)  # in flight: not sent twice
    every.save_done([0, 1, 2], ok=True)
    every.save_done([3, 4], ok=False)
    assert every.saved_upto == 3
    out, _ = every.blocks_to_save(22, toks)
    assert [r.index for r in out] == [3, 4]  # failed saves are retried, as for "new"


def test_step_clock_measures_steps_and_skips_idle_gaps() -> None:
    c = StepClock(alpha=0.5, max_gap=1.0)
    assert c.step_s is None
    c.tick(10.0)
    c.tick(10.2)  # a step of 0.2 s
    assert c.step_s == pytest.approx(0.2)
    c.tick(10.6)  # one of 0.4 s
    assert c.step_s == pytest.approx(0.3)
    c.tick(20.0)  # the engine was idle: not a step
    assert c.step_s == pytest.approx(0.3)
    c.tick(20.1)
    assert c.step_s == pytest.approx(0.2)


def test_auto_load_picks_the_cheapest_of_sync_async_and_recompute() -> None:
    # A 61 ms load of 1,000 tokens.
    assert choose_load(1000, 0.061, 0.1, None) == "sync"  # shorter than a 100 ms step
    assert choose_load(1000, 0.061, 0.05, None) == "async"  # longer than a 50 ms step
    assert choose_load(1000, 0.061, 0.1, 20_000) == "recompute"  # 50 ms of prefill < 61
    assert choose_load(1000, 0.061, 0.1, 10_000) == "sync"  # 100 ms of prefill > 61
    # async: 61 ms + a 50 ms step against a recompute of 100 ms (recompute) or 200 ms
    assert choose_load(1000, 0.061, 0.05, 10_000) == "recompute"
    assert choose_load(1000, 0.061, 0.05, 5_000) == "async"
    assert choose_load(1000, None, 0.1, 5_000) == "async"  # nothing measured yet
    assert choose_load(1000, 0.061, None, 5_000) == "async"


def test_load_time_from_bandwidth_and_small_loads() -> None:
    m = BandwidthMeter(alpha=1.0, min_bytes=1000)
    assert m.load_seconds(500) is None
    m.add(100, 0.004)  # a small load: 4 ms, all latency
    assert m.load_seconds(500) == pytest.approx(0.004)
    assert m.load_seconds(10_000) is None  # a big load needs a bandwidth
    m.add(1_000_000, 0.1)  # 10 MB/s
    assert m.load_seconds(10_000) == pytest.approx(0.004)  # never under a small load's time
    assert m.load_seconds(1_000_000) == pytest.approx(0.1)
