"""A master, two workers and clients in separate processes sharing blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, InvalidArgument
from tests.helpers import key, run_client_process, value_for

NS = "llama3-8b/bf16/b16/tp0of1"
N = 1000
SIZE = 64 * 1024

WRITER = """
from kvstore_client import Client
from helpers import key, value_for
keys = [key(i) for i in range(PARAMS["n"])]
with Client(PARAMS["master"]) as c:
    stored = []
    for s in range(0, len(keys), 250):
        part = keys[s:s + 250]
        stored += c.batch_put(PARAMS["ns"], part, [value_for(k, PARAMS["size"]) for k in part])
    first = keys[:100]
    again = c.batch_put(PARAMS["ns"], first, [value_for(k, PARAMS["size"]) for k in first])
    workers = len(c.workers())
RESULT = {"stored": sum(stored), "again": sum(again), "workers": workers}
"""

READER = """
from kvstore_client import Client
from helpers import key, value_for
keys = [key(i) for i in range(PARAMS["n"])]
extra = [key(i, "absent") for i in range(10)]
with Client(PARAMS["master"]) as c:
    got = c.batch_get(PARAMS["ns"], keys + extra)
    exact = sum(g == value_for(k, PARAMS["size"]) for k, g in zip(keys, got))
    misses = sum(g is None for g in got[len(keys):])
    flags = c.batch_exists(PARAMS["ns"], keys + extra)
    prefix = c.match_prefix(PARAMS["ns"], keys + extra + keys)
RESULT = {"exact": exact, "misses": misses, "exists": sum(flags[:len(keys)]),
          "absent_exists": sum(flags[len(keys):]), "prefix": prefix}
"""


def test_two_client_processes_share_blocks(cluster: LocalCluster) -> None:
    p = {"master": cluster.address, "ns": NS, "n": N, "size": SIZE}
    w = run_client_process(WRITER, **p)
    assert w == {"stored": N, "again": 0, "workers": 2}, "rewrites are all skipped"
    r = run_client_process(READER, **p)
    assert r["exact"] == N, "every block reads back byte-exact in another process"
    assert r["misses"] == 10 and r["absent_exists"] == 0, "misses are misses"
    assert r["exists"] == N
    assert r["prefix"] == N, "match_prefix stops at the first absent hash"


def test_blocks_spread_over_both_workers(cluster: LocalCluster) -> None:
    keys = [key(i, "spread") for i in range(200)]
    with Client(cluster.address) as c:
        c.batch_put(NS, keys, [value_for(k, 4096) for k in keys])
        st = c.cluster_status()
    # Heartbeats carry stats every ttl/4 (0.5 s here); wait for one round.
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with Client(cluster.address) as c:
            st = c.cluster_status()
        if sum(w.stats.keys for w in st.workers) == 200:
            break
        time.sleep(0.2)
    per_worker = [w.stats.keys for w in st.workers]
    assert sum(per_worker) == 200 and min(per_worker) > 50


def test_get_into_buffers_and_remove(cluster: LocalCluster) -> None:
    keys = [key(i, "into") for i in range(64)]
    vals = [value_for(k, 256 * 1024) for k in keys]
    with Client(cluster.address) as c:
        assert all(c.batch_put(NS, keys, vals))
        out = np.zeros((65, 256 * 1024), dtype=np.uint8)
        fut = c.batch_get_into(NS, [*keys, key(999, "none")], [r.data for r in out])
        hits = fut.result(timeout=10)
        assert hits == [True] * 64 + [False]
        assert all(out[i].tobytes() == vals[i] for i in range(64))
        small = np.zeros(100, dtype=np.uint8)
        assert c.batch_get_into(NS, keys[:1], [small.data]).result() == [False], (
            "a buffer of the wrong size is a miss, never a truncated block"
        )
        assert c.remove(NS, keys[:10]) == 10
        assert c.remove(NS, keys[:10]) == 0
        assert c.batch_exists(NS, keys[:12]) == [False] * 10 + [True] * 2
        assert c.batch_get(NS, keys[:1]) == [None]


def test_invalid_arguments_raise_clear_errors(cluster: LocalCluster) -> None:
    with Client(cluster.address) as c:
        with pytest.raises(InvalidArgument, match="16 bytes"):
            c.batch_put(NS, [b"short"], [b"v"])
        with pytest.raises(InvalidArgument, match="namespace"):
            c.batch_exists("bad namespace!", [key(1)])
        with pytest.raises(InvalidArgument, match="limit"):
            c.batch_put(NS, [key(1)], [bytes(16 * 1024 * 1024 + 1)])
        with pytest.raises(InvalidArgument, match="values"):
            c.batch_put(NS, [key(1), key(2)], [b"v"])
        assert c.batch_exists(NS, []) == [] and c.match_prefix(NS, []) == 0


def test_match_prefix_with_state_namespace_needs_kv_and_state(cluster: LocalCluster) -> None:
    """Hybrid models: k blocks hit only if all k KV blocks and the state at k are there."""
    keys = [key(i, "hybrid") for i in range(10)]
    state = "llama3-8b/bf16/b16/tp0of1/state"
    with Client(cluster.address) as c:
        c.batch_put(NS, keys, [b"kv"] * 10)
        assert c.match_prefix(NS, keys, state_ns=state) == 0, "no state stored: no hit"
        c.batch_put(state, [keys[3], keys[7]], [b"s3", b"s7"])
        assert c.match_prefix(NS, keys, state_ns=state) == 8, "state at boundary 8"
        c.remove(NS, [keys[5]])  # a KV block lost: only the prefix up to the state at 4
        assert c.match_prefix(NS, keys, state_ns=state) == 4
        assert c.match_prefix(NS, keys) == 5
