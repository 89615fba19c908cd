"""kv_role end to end: a prefill engine (kv_producer) and a decode engine
(kv_consumer) share KV through the store; the producer never looks up, the
consumer never writes."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvstore.cluster import LocalCluster

from .conftest import REPORT
from .engines import Engine

pytestmark = pytest.mark.timeout(900)

BLOCK = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(workers=2, dram_size="256MiB", log_dir=str(tmp_path_factory.mktemp("c")))
    c.start()
    yield c
    c.stop()


def test_producer_saves_and_consumer_loads(
    cluster: LocalCluster, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    logs = tmp_path_factory.mktemp("engines")
    P = Engine("P", tiny_model, logs, master=cluster.address, kv_role="kv_producer", warmup_seed=4)
    C = Engine("C", tiny_model, logs, master=cluster.address, kv_role="kv_consumer", warmup_seed=5)
    try:
        P.start()
        C.start()
        P.wait_ready()
        C.wait_ready()
        rng = random.Random(7)
        prompt = [rng.randrange(3, 1000) for _ in range(1000)]
        more = [rng.randrange(3, 1000) for _ in range(100)]
        rp = P.generate(prompt, 4)
        assert rp["stats"]["lookups"] == 0 and rp["stats"]["hit_tokens"] == 0
        assert rp["stats"]["stored_blocks"] == (len(prompt) + 3) // BLOCK
        rc = C.generate(prompt + more, 4)
        shared = len(prompt) // BLOCK * BLOCK
        assert rc["num_cached_tokens"] == shared
        assert rc["stats"]["loaded_blocks"] == shared // BLOCK
        assert rc["stats"]["stored_blocks"] == 0  # a consumer never writes
        # The consumer's computed blocks stay out of the store: the producer,
        # which never looks up, computes the longer prompt itself.
        ref = P.generate(prompt + more, 4)
        assert ref["stats"]["lookups"] == 0
        assert rc["tokens"] == ref["tokens"]
        diff = max(abs(a - b) for a, b in zip(rc["logprobs"], ref["logprobs"], strict=True))
        assert diff <= 0.05
        REPORT.append(
            f"kv_role: consumer loaded {shared} tokens the producer stored; wrote 0 blocks; "
            f"max |logprob diff| {diff:.4f}"
        )
    finally:
        P.stop()
        C.stop()
