"""Issue 47: a worker killed while a request's blocks load. The lookup finds the
whole prefix; the worker holding part of it is SIGKILLed as the load starts (the
tests' fault-injecting connector, tests/e2e/faults.py). The blocks it held fail,
reach vLLM through ``get_block_ids_with_load_errors`` and are recomputed; the output
equals the reference engine's: never another request's KV, never garbage. On both
load paths: host zero copy (a CPU cache) and the block mover's rows (a CUDA cache's
path). The loaders run ``load_mode: async`` so that every hit is loaded (``auto``
may judge a load slower than recomputing after the earlier tests' failures)."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cluster import LocalCluster
from tests.conftest import unlink_killed_arenas

from .conftest import REPORT
from .engines import Engine, running
from .test_vllm_connector import assert_same_output, full_blocks, tokens

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(workers=3, dram_size="256MiB", worker_ttl="8s",
                     log_dir=str(tmp_path_factory.mktemp("cluster")))  # fmt: skip
    c.start()
    yield c
    c.stop()
    unlink_killed_arenas(c)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "fault.json"


@pytest.fixture(scope="module")
def engines(
    cluster: LocalCluster, tiny_model: str, fault_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Engine]]:  # fmt: skip
    logs = tmp_path_factory.mktemp("engines")
    loads = {"load_mode": "async"}
    es = {
        "W": Engine("W", tiny_model, logs, master=cluster.address, warmup_seed=1),
        "zero_copy": Engine(
            "Z",
            tiny_model,
            logs,
            master=cluster.address,
            extra=loads,
            warmup_seed=2,
            fault_file=fault_file,
        ),
        "mover": Engine(
            "M",
            tiny_model,
            logs,
            master=cluster.address,
            extra={**loads, "zero_copy": False},
            warmup_seed=3,
            fault_file=fault_file,
        ),
        "R": Engine("R", tiny_model, logs, master=None, warmup_seed=4),
    }
    with running(es):
        yield es


@pytest.mark.parametrize(("path", "victim", "seed"), [("zero_copy", 0, 23), ("mover", 1, 29)])
def test_a_worker_killed_while_the_blocks_load(
    engines: dict[str, Engine], cluster: LocalCluster, fault_file: Path,
    path: str, victim: int, seed: int,
) -> None:  # fmt: skip
    W, L, R = engines["W"], engines[path], engines["R"]
    # A worker killed by the case before is out of the map first, and the engines'
    # clients have the new map: else the writer's blocks for it are lost, and the
    # hit ends there before the load.
    cluster.wait_for_workers(sum(w.proc.poll() is None for w in cluster.worker_procs), timeout=40)
    time.sleep(1.0)
    rng = random.Random(seed)
    prompt, more, out = tokens(rng, 1200), tokens(rng, 100), 8
    W.generate(prompt, out)
    dead = cluster.worker_procs[victim]
    assert dead.proc.poll() is None
    fault_file.write_text(json.dumps({"kill_pid": dead.pid}))
    try:
        got = L.generate(prompt + more, out)
    finally:
        fault_file.unlink()
    assert dead.proc.wait(10) == -signal.SIGKILL, "the load never started"
    assert_same_output(got, R.generate(prompt + more, out), f"{path} after a worker died")
    st = got["stats"]
    hit_blocks = full_blocks(len(prompt))
    assert st["load_failed_blocks"] > 0, "none of the load's blocks was on the killed worker?"
    assert st["loaded_blocks"] + st["load_failed_blocks"] == hit_blocks
    REPORT.append(
        f"worker killed during a {path} load: {st['load_failed_blocks']} of {hit_blocks} "
        f"blocks failed, reported to vLLM and recomputed; output correct"
    )
