"""Session hints from a real vLLM engine (``kv_transfer_params``): a paused session's
blocks survive traffic that evicts everything else under LRU, and its next turn hits;
the same sequence without hints misses.

One worker with a small DRAM tier and no SSD; the engine runs without its own prefix
cache, so every hit comes from the store."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client

from .conftest import REPORT
from .engines import Engine

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
DRAM = 32 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(workers=1, dram_size=f"{DRAM >> 20}MiB",
                     log_dir=str(tmp_path_factory.mktemp("cluster")))  # fmt: skip
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(
    cluster: LocalCluster, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    e = Engine("S", tiny_model, tmp_path_factory.mktemp("engines"), master=cluster.address,
               engine={"enable_prefix_caching": False}, warmup_seed=5)  # fmt: skip
    try:
        e.start()
        e.wait_ready()
        yield e
    finally:
        e.stop()


def test_paused_session_is_retained_across_traffic(engine: Engine, cluster: LocalCluster) -> None:
    rng = random.Random(16)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    hinted, plain = toks(1024), toks(1024)
    first = engine.generate(hinted, 1, params={"session_id": "s1", "session_state": "paused"})
    engine.generate(plain, 1)  # the same turn, no hint
    st = first["stats"]
    block_bytes = st["stored_bytes"] // st["stored_blocks"]
    # Let the hint reach the worker (sent after the turn's writes, off the scheduler).
    with Client(cluster.address) as cl:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            top = [s for r in cl.sessions(5) for s in r.sessions if s.session_id == "s1"]
            if top and top[0].state == "paused":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the paused hint never reached the worker")
    # Other traffic: 1.5x the worker's DRAM, written by 2,048-token prompts.
    written = 0
    while written < 1.5 * DRAM:
        r = engine.generate(toks(2048), 1)
        written += r["stats"]["stored_blocks"] * block_bytes
    # Next turns: the hinted session resumes and hits; the plain one was evicted.
    resumed = engine.generate(hinted + toks(256), 1, params={"session_id": "s1"})
    again = engine.generate(plain + toks(256), 1)
    hit, miss = resumed["stats"]["hit_tokens"], again["stats"]["hit_tokens"]
    REPORT.append(
        f"sessions: after {written / 2**20:.0f} MiB of other traffic into {DRAM >> 20} MiB "
        f"of DRAM, the paused session's next turn loaded {hit}/1024 prefix tokens; "
        f"without hints {miss}/1024"
    )
    assert hit == 1024, f"the paused session's prefix was not retained ({hit} tokens hit)"
    assert miss < 1024 // 2, f"LRU kept the unhinted prefix ({miss} tokens): test too weak"


def test_a_sessions_last_turn_saves_nothing(engine: Engine) -> None:
    """A request whose hint says ``ended`` is its session's last turn: no later turn
    reads its blocks, so the connector writes none of them (``save_ended`` false, the
    default), where each would have pushed a live session's block out of a full
    store. The same prompt without the hint is written, and then found."""
    rng = random.Random(17)
    prompt = [rng.randrange(3, 1000) for _ in range(512)]
    last = engine.generate(prompt, 1, params={"session_id": "s-end", "session_state": "ended"})
    assert last["stats"]["stored_blocks"] == 0, "the last turn's blocks were written"
    plain = engine.generate(prompt, 1)  # no prefix cache in the engine: a hit is the store's
    assert plain["stats"]["hit_tokens"] == 0, "a block of the last turn was in the store"
    assert plain["stats"]["stored_blocks"] == 512 // BLOCK
    again = engine.generate([*prompt, 5, 6, 7], 1)
    assert again["stats"]["hit_tokens"] == 512
