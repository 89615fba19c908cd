"""vLLM on the CPU with kvstore_client.connectors.vllm:KVStoreConnector, no mocks.

Three engine processes share one kvstore cluster (3 workers): A and B carry the
connector (A on host zero copy, B on the block mover's path), R carries none and is
the reference (it runs each prompt with its own
local prefix cache). Prompts are token ids of the tiny Llama (tests/e2e/tiny_model.py);
sampling is greedy with logprobs. The tests run in file order; the last one kills a
worker.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, block_hashes
from tests.conftest import unlink_killed_arenas

from .conftest import REPORT
from .engines import Engine, running

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
LOGPROB_TOL = 0.05
LOOKUP_TIMEOUT_S = 1.0  # the engines' lookup deadline (engine_proc.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("cluster")
    c = LocalCluster(workers=2, dram_size="256MiB", worker_ttl="8s", log_dir=str(logs))
    c.start()
    # The third does not share its arena: the engines reach it as a remote worker
    # (tcp://), as the frozen-worker test needs (a same-host worker's shared index
    # answers lookups and loads without it).
    c.add_worker("--no-share-arena")
    c.wait_for_workers(3)
    yield c
    c.stop()
    unlink_killed_arenas(c)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "fault.json"


@pytest.fixture(scope="module")
def engines(
    cluster: LocalCluster,
    tiny_model: str,
    fault_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engines")
    # B moves blocks through the block mover's rows (the path a CUDA cache takes,
    # its loads copied from pinned arena slots), A through host zero copy: every
    # hit between them crosses the two paths. Both run the tests' fault-injecting
    # connector (tests/e2e/faults.py), idle until the fault file is written.
    mover = {"zero_copy": False}
    es = {
        "A": Engine(
            "A", tiny_model, logs, master=cluster.address, warmup_seed=1, fault_file=fault_file
        ),
        "B": Engine(
            "B",
            tiny_model,
            logs,
            master=cluster.address,
            extra=mover,
            warmup_seed=2,
            fault_file=fault_file,
        ),
        "R": Engine("R", tiny_model, logs, master=None, warmup_seed=3),
    }
    with running(es):
        yield es


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def full_blocks(computed_tokens: int) -> int:
    return computed_tokens // BLOCK


def assert_same_output(got: dict[str, Any], ref: dict[str, Any], what: str) -> float:
    assert got["tokens"] == ref["tokens"], f"{what}: tokens differ from the reference"
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"], strict=True))
    assert diff <= LOGPROB_TOL, f"{what}: logprobs differ by {diff:.4f} > {LOGPROB_TOL}"
    return diff


def test_engine_b_loads_the_prefix_engine_a_stored(engines: dict[str, Engine]) -> None:
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(2026)
    prompt, more = tokens(rng, 2000), tokens(rng, 200)
    out = 16

    ra = A.generate(prompt, out)
    # A computed the prompt and 15 sampled tokens: every full block of those is new.
    assert ra["stats"]["stored_blocks"] == full_blocks(len(prompt) + out - 1)
    assert ra["stats"]["hit_tokens"] == 0

    rb = B.generate(prompt + more, out)
    shared = full_blocks(len(prompt)) * BLOCK
    assert rb["num_cached_tokens"] >= 0.9 * len(prompt)
    assert rb["num_cached_tokens"] == shared
    st = rb["stats"]
    assert st["hit_tokens"] == shared and st["loaded_blocks"] == shared // BLOCK
    assert st["load_failed_blocks"] == 0
    # Write only new blocks: the loaded ones are skipped, the rest is stored.
    assert st["skipped_present_blocks"] == shared // BLOCK
    assert st["stored_blocks"] == full_blocks(len(prompt) + len(more) + out - 1) - shared // BLOCK

    R.generate(prompt, out)
    ref = R.generate(prompt + more, out)
    assert ref["num_cached_tokens"] == shared  # R's own prefix cache
    diff = assert_same_output(rb, ref, "engine B")

    # Time to first token of a 2,200-token prompt whose 2,000-token prefix another
    # engine stored, against the same length computed from scratch. Engine A stores all
    # three prefixes first and then runs one more short request, so none of its saves
    # is still in flight (competing for the CPU) while B's hits are timed.
    ttft: dict[str, list[float]] = {"hit": [], "miss": [], "bare": []}
    load_ms: list[float] = []  # the hit's load, the most layer-wise loading could hide
    prefixes = [tokens(rng, 2000) for _ in range(3)]
    for p2 in prefixes:
        A.generate(p2, 1)
    A.generate(tokens(rng, 8), 1)
    for p2 in prefixes:
        m2 = tokens(rng, 200)
        hit = B.generate(p2 + m2, 1)
        miss = B.generate(tokens(rng, 2200), 1)
        bare = R.generate(tokens(rng, 2200), 1)
        assert hit["num_cached_tokens"] == shared and miss["num_cached_tokens"] == 0
        for k, r in (("hit", hit), ("miss", miss), ("bare", bare)):
            ttft[k].append(r["seconds"] * 1000)
        load_ms.append(hit["stats"]["load_seconds"] * 1000)
    med = {k: sorted(v)[1] for k, v in ttft.items()}
    REPORT.append(
        f"engine B: {rb['num_cached_tokens']}/{len(prompt)} shared prompt tokens cached "
        f"({rb['num_cached_tokens'] / len(prompt):.1%}), {st['loaded_blocks']} blocks "
        f"({st['loaded_bytes'] / 2**20:.1f} MiB) loaded, {st['stored_blocks']} stored, "
        f"{st['skipped_present_blocks']} skipped as present; max |logprob diff| {diff:.4f}"
    )
    REPORT.append(
        f"TTFT of 2,200 tokens (median of 3): engine B {med['hit']:.0f} ms with a 2,000-token "
        f"store hit, {med['miss']:.0f} ms on a miss (connector on); {med['bare']:.0f} ms on an "
        f"engine without the connector; the hit's load took {sorted(load_ms)[1]:.1f} ms of "
        f"its TTFT (all that overlapping the load with compute, layer by layer, could save)"
    )


def conversation_turn(rng: random.Random, ctx: list[int], lo: int, hi: int, out: int) -> list[int]:
    """The next user message; its length keeps the context after the answer (``out``
    tokens) off a block boundary, so "the whole previous context, block-aligned" is one
    number (the answer's last token has no KV until the next turn)."""
    n = rng.randrange(lo, hi)
    while (len(ctx) + n + out) % BLOCK == 0:
        n += 1
    return tokens(rng, n)


def run_conversation(
    engines: dict[str, Engine], order: str, rng: random.Random, first: int, out: int
) -> list[dict[str, Any]]:
    ctx: list[int] = []
    rows = []
    for turn, name in enumerate(order, 1):
        lo, hi = (first, first + 50) if turn == 1 else (90, 150)
        prompt = ctx + conversation_turn(rng, ctx, lo, hi, out)
        res = engines[name].generate(prompt, out)
        ref = engines["R"].generate(prompt, out)
        diff = assert_same_output(res, ref, f"turn {turn} on {name}")
        rows.append(
            {
                "turn": turn,
                "engine": name,
                "prev": len(ctx),
                "prompt": len(prompt),
                "res": res,
                "diff": diff,
            }
        )
        ctx = prompt + res["tokens"]
    return rows


def test_multi_turn_alternating_engines(engines: dict[str, Engine]) -> None:
    rng = random.Random(7)
    out = 16
    rows = run_conversation(engines, "ABABA", rng, 700, out)
    for r in rows:
        st = r["res"]["stats"]
        prev_blocks = full_blocks(r["prev"] - 1) if r["prev"] else 0
        new_blocks = full_blocks(r["prompt"] + out - 1) - prev_blocks
        if r["turn"] > 1:
            # The hit covers the whole previous context (block-aligned).
            assert r["res"]["num_cached_tokens"] == full_blocks(r["prev"]) * BLOCK
            assert prev_blocks == full_blocks(r["prev"])
        assert st["stored_blocks"] == new_blocks, f"turn {r['turn']}"
        assert st["skipped_present_blocks"] == prev_blocks, f"turn {r['turn']}"
        cached = r["res"]["num_cached_tokens"]
        REPORT.append(
            f"multi-turn turn {r['turn']} on {r['engine']}: prompt {r['prompt']} tokens, "
            f"cached {cached} ({cached / r['prompt']:.1%}; {st['hit_tokens']} from the "
            f"store), stored {st['stored_blocks']} blocks, "
            f"skipped {st['skipped_present_blocks']} present, max |dlogprob| {r['diff']:.4f}"
        )


def test_blocks_missing_at_load_are_recomputed(
    engines: dict[str, Engine], fault_file: Path
) -> None:
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(11)
    prompt, more, out = tokens(rng, 1000), tokens(rng, 100), 8
    A.generate(prompt, out)
    # While the fault file exists, B's loads first remove their blocks from #10 on:
    # the lookup saw them, the get misses them.
    fault_file.write_text(json.dumps({"remove_from_block": 10}))
    try:
        rb = B.generate(prompt + more, out)
    finally:
        fault_file.unlink()
    ref = R.generate(prompt + more, out)
    assert_same_output(rb, ref, "engine B after failed loads")
    st = rb["stats"]
    hit_blocks = full_blocks(len(prompt))
    assert st["loaded_blocks"] == 10
    assert st["load_failed_blocks"] == hit_blocks - 10
    # The recomputed blocks are written again, with the new ones.
    assert st["stored_blocks"] == full_blocks(len(prompt) + len(more) + out - 1) - 10
    REPORT.append(
        f"load errors: {st['load_failed_blocks']} of {hit_blocks} hit blocks missing at load, "
        f"recomputed and re-stored; output equal to the reference"
    )


def test_the_hit_goes_on_past_the_engines_own_hit(
    engines: dict[str, Engine], cluster: LocalCluster
) -> None:
    """``hit_past_local``: B's own prefix cache holds a prompt's head that the store
    lost, and the store holds the blocks after it (A stored them). B takes the head
    from its cache and the rest from the store (the old rule took the store's run
    from the first block: nothing), and its output equals the reference."""
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(23)
    head, tail, more, out = tokens(rng, 20 * BLOCK), tokens(rng, 20 * BLOCK), tokens(rng, 64), 8
    B.generate(head, 1)  # B's cache, and the store, hold the head's 20 blocks
    ra = A.generate(head + tail, 1)  # A loads the head, stores the tail's 20 blocks
    assert ra["num_cached_tokens"] == len(head)
    ns = A.namespace
    assert ns is not None and ns == B.namespace
    hs = block_hashes(head + tail, BLOCK)
    with Client(cluster.address) as c:
        assert c.batch_exists(ns, hs) == [True] * 40
        assert c.remove(ns, hs[:20]) == 20  # the store loses the head
    rb = B.generate(head + tail + more, out)
    assert rb["num_cached_tokens"] == 40 * BLOCK, "20 blocks of B's own, then 20 of the store's"
    st = rb["stats"]
    assert st["hit_tokens"] == 20 * BLOCK and st["loaded_blocks"] == 20
    assert st["load_failed_blocks"] == 0
    ref = R.generate(head + tail + more, out)
    diff = assert_same_output(rb, ref, "engine B, its own head and the store's tail")
    REPORT.append(
        f"hit past the engine's own: B cached {rb['num_cached_tokens']} of "
        f"{len(head + tail + more)} tokens ({len(head)} its own, {st['loaded_blocks']} "
        f"blocks from the store after them); max |logprob diff| {diff:.4f}"
    )


def test_a_wrong_block_would_show(engines: dict[str, Engine], cluster: LocalCluster) -> None:
    """The control for the tests above: the tiny model's weights are large enough that a
    wrong KV block changes the logprobs by far more than the tolerance."""
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(17)
    prompt, more, out = tokens(rng, 1000), tokens(rng, 100), 8
    A.generate(prompt, out)
    ns = A.namespace
    assert ns is not None and ns == B.namespace
    hs = block_hashes(prompt, BLOCK)
    with Client(cluster.address) as c:  # block 6's KV stored as block 5's
        six = c.batch_get(ns, [hs[6]])[0]
        assert six is not None and c.remove(ns, [hs[5]]) == 1
        assert c.batch_put(ns, [hs[5]], [six]) == [True]
    rb = B.generate(prompt + more, out)
    ref = R.generate(prompt + more, out)
    assert rb["stats"]["loaded_blocks"] == full_blocks(len(prompt))
    diff = max(abs(a - b) for a, b in zip(rb["logprobs"], ref["logprobs"], strict=True))
    assert rb["tokens"] != ref["tokens"] or diff > 10 * LOGPROB_TOL
    REPORT.append(f"control: one wrong block moves the logprobs by up to {diff:.3f}")


def test_a_frozen_worker_costs_one_lookup_deadline(
    engines: dict[str, Engine], cluster: LocalCluster
) -> None:
    """A remote worker that stops answering (SIGSTOP: connections open, no replies)
    makes the scheduler's lookup miss its deadline: no hit, the prompt is computed, the
    output is right, and the request waits the lookup deadline, not the client's
    timeout. (A same-host worker would still answer through its shared index.)"""
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(19)
    prompt, more, out = tokens(rng, 1000), tokens(rng, 100), 8
    A.generate(prompt, out)
    frozen = cluster.worker_procs[2]  # the one reached over tcp://
    frozen.signal(signal.SIGSTOP)
    thaw = threading.Timer(3.0, frozen.signal, args=(signal.SIGCONT,))
    thaw.start()
    try:
        rb = B.generate(prompt + more, out)
    finally:
        thaw.join()
        frozen.signal(signal.SIGCONT)
    assert_same_output(rb, R.generate(prompt + more, out), "engine B with a frozen worker")
    assert rb["num_cached_tokens"] == 0 and rb["stats"]["lookup_timeouts"] == 1
    assert rb["seconds"] < LOOKUP_TIMEOUT_S + 3.5, rb["seconds"]  # client timeout: 5 s
    REPORT.append(
        f"frozen worker: lookup gave up after its {LOOKUP_TIMEOUT_S:.0f} s deadline, request "
        f"computed in full in {rb['seconds']:.2f} s with correct output"
    )


def test_killed_worker_between_turns(engines: dict[str, Engine], cluster: LocalCluster) -> None:
    rng = random.Random(13)
    out = 8
    A, B, R = engines["A"], engines["B"], engines["R"]
    p1 = tokens(rng, 1200)
    r1 = A.generate(p1, out)
    ctx = p1 + r1["tokens"]
    cluster.worker_procs[0].kill()
    # Next turn at once: the clients still route a third of the blocks to the dead
    # worker; those are misses, and vLLM recomputes from the first one.
    p2 = ctx + conversation_turn(rng, ctx, 100, 150, out)
    r2 = B.generate(p2, out)
    assert_same_output(r2, R.generate(p2, out), "turn 2 after a worker was killed")
    assert r2["stats"]["load_failed_blocks"] == 0
    lost = full_blocks(len(ctx)) * BLOCK - r2["num_cached_tokens"]
    assert lost > 0, "no block of a 1,200-token prefix lived on the killed worker?"
    # Once the master drops the worker, its keys belong to the others: they are
    # recomputed once more and written there, and the turn after hits in full.
    cluster.wait_for_workers(2, timeout=40)
    time.sleep(1.0)  # the engines' clients get the new map over their watch
    ctx = p2 + r2["tokens"]
    p3 = ctx + conversation_turn(rng, ctx, 100, 150, out)
    r3 = A.generate(p3, out)
    assert_same_output(r3, R.generate(p3, out), "turn 3 after the map changed")
    ctx = p3 + r3["tokens"]
    p4 = ctx + conversation_turn(rng, ctx, 100, 150, out)
    r4 = B.generate(p4, out)
    assert_same_output(r4, R.generate(p4, out), "turn 4")
    assert r4["num_cached_tokens"] == full_blocks(len(ctx)) * BLOCK
    REPORT.append(
        f"killed worker: turn 2 recomputed {lost} of {full_blocks(len(p1) + out) * BLOCK} "
        f"cached tokens, turn 3 re-stored {r3['stats']['stored_blocks']} blocks, "
        f"turn 4 hit {r4['num_cached_tokens']} tokens (whole previous context); outputs correct"
    )
