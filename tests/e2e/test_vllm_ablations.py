"""The connector's ablation settings on real vLLM CPU engines (tiny Llama), no mocks.

Engine A (defaults) stores a 2,000-token prompt; engine B runs with
``load_mode: sync`` (the hit loads in the step that schedules the request, the
worker waiting for it before the forward), ``save_policy: all`` (the loaded blocks
are sent again) and ``lookup: prefix`` (one ``match_prefix`` per rank). B's output
for prompt + 200 tokens must match engine R's, which has no connector.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvstore.cluster import LocalCluster

from .conftest import REPORT
from .engines import Engine, running

pytestmark = pytest.mark.timeout(600)

BLOCK = 32
LOGPROB_TOL = 0.05


@pytest.fixture(scope="module")
def engines(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("ablations")
    c = LocalCluster(workers=2, dram_size="256MiB", log_dir=str(logs))
    c.start()
    sync = {"load_mode": "sync", "save_policy": "all", "lookup": "prefix"}
    es = {
        "A": Engine("A", tiny_model, logs, master=c.address, warmup_seed=1),
        "B": Engine("B", tiny_model, logs, master=c.address, extra=sync, warmup_seed=2),
        "R": Engine("R", tiny_model, logs, master=None, warmup_seed=3),
    }
    try:
        with running(es):
            yield es
    finally:
        c.stop()


def test_sync_load_of_a_2000_token_hit_matches(engines: dict[str, Engine]) -> None:
    A, B, R = engines["A"], engines["B"], engines["R"]
    rng = random.Random(15)
    prompt = [rng.randrange(3, 1000) for _ in range(2000)]
    more = [rng.randrange(3, 1000) for _ in range(200)]
    out = 16
    A.generate(prompt, out)
    rb = B.generate(prompt + more, out)
    shared = len(prompt) // BLOCK
    st = rb["stats"]
    assert rb["num_cached_tokens"] == shared * BLOCK
    assert st["hit_tokens"] == shared * BLOCK and st["loaded_blocks"] == shared
    assert st["sync_loaded_blocks"] == shared and st["load_failed_blocks"] == 0
    # save_policy all: the loaded blocks are written too (the store keeps its copy).
    assert st["skipped_present_blocks"] == 0
    assert st["stored_blocks"] == (len(prompt) + len(more) + out - 1) // BLOCK
    R.generate(prompt, out)
    ref = R.generate(prompt + more, out)
    assert rb["tokens"] == ref["tokens"], "engine B (sync load): tokens differ from R's"
    lps = zip(rb["logprobs"], ref["logprobs"], strict=True)
    diff = max(abs(a - b) for a, b in lps)
    assert diff <= LOGPROB_TOL, f"logprobs differ by {diff:.4f}"
    REPORT.append(
        f"load_mode sync: engine B loaded {st['loaded_blocks']} blocks "
        f"({rb['num_cached_tokens']}/{len(prompt)} tokens) before the forward, "
        f"{st['stored_blocks']} written (save_policy all), max |logprob diff| {diff:.4f}"
    )
