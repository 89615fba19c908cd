"""The engine-independent pieces of the connectors (kvstore_client.connectors._common),
and the hybrid-model hit rule proven through the client API on a real cluster.

None of this needs vLLM; it lives here because tests/e2e is skipped as a whole
where vLLM is missing (it can move to tests/unit as is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from kvstore_client import Client, block_hashes
from kvstore_client.connectors._common import (
    STATE_KIND,
    BandwidthMeter,
    ClientHolder,
    ConnectorConfig,
    Counters,
    LoadPolicy,
    RequestTracker,
    extra_keys,
    hybrid_hit_blocks,
    merge_stats,
    namespace,
    reduce_stats,
    stats_empty,
)
from kvstore_client.keys import check_namespace

pytestmark = pytest.mark.timeout(120)

_HASH_SCRIPT = """
import json, sys
from kvstore_client import block_hashes
from kvstore_client.connectors._common import extra_keys, namespace
x = extra_keys(lora="adapter-a", cache_salt="s1", mm_hashes=["img0"])
print(json.dumps({
    "ns": namespace("meta-llama/Llama-3-8B", "torch.bfloat16", "attn32x8x128-cuda", 16,
                    tp_rank=1, tp_size=2),
    "h": [h.hex() for h in block_hashes(list(range(100)), 16, extra=x)],
}))
"""


def test_keys_equal_across_processes_and_hash_seeds() -> None:
    outs = []
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
        outs.append(json.loads(r.stdout))
    assert all(o == outs[0] for o in outs)
    assert outs[0]["ns"] == "meta-llama--Llama-3-8B/bfloat16/attn32x8x128-cuda/b16/tp1of2/pp0of1"
    assert len(outs[0]["h"]) == 6  # only full blocks


def test_namespace_segments() -> None:
    ns = namespace("/models/tiny llama/", "float32", "l2", 32)
    assert ns == "tiny_llama/float32/l2/b32/tp0of1/pp0of1"
    assert namespace("m", "f", "l", 16, kind=STATE_KIND).endswith("/state")
    long = namespace("x" * 300, "f", "l" * 300, 16)
    assert check_namespace(long) == long and len(long) <= 255
    with pytest.raises(ValueError):
        namespace("m", "f", "l", 16, tp_rank=2, tp_size=2)


def test_extra_keys_change_every_hash_and_are_unambiguous() -> None:
    toks = list(range(64))
    plain = block_hashes(toks, 16, extra=extra_keys())
    assert plain == block_hashes(toks, 16)
    variants = [
        extra_keys(lora="a"),
        extra_keys(cache_salt="a"),
        extra_keys(mm_hashes=["a"]),
        extra_keys(lora="ab"),
        extra_keys(lora="a", cache_salt="b"),
    ]
    assert len(set(variants)) == len(variants)
    for x in variants:
        hs = block_hashes(toks, 16, extra=x)
        assert all(a != b for a, b in zip(hs, plain, strict=True))


def test_hybrid_hit_rule() -> None:
    kv = [True] * 6 + [False, True]
    assert hybrid_hit_blocks(kv, [False] * 8) == 0
    assert hybrid_hit_blocks(kv, [False, True, False, False, True, True, False, True]) == 6
    assert hybrid_hit_blocks(kv, [False, True, False, False, True, False, True, True]) == 5
    assert hybrid_hit_blocks(kv, [True]) == 1
    assert hybrid_hit_blocks([], []) == 0


def test_hybrid_rule_through_the_client_api(make_cluster: Any) -> None:
    """A prefix of k blocks is a hit only if all k KV blocks and the state at boundary
    k are in the store; a writer that died between its KV and its state never makes
    a wrong hit."""
    c = make_cluster(workers=2)
    kv_ns = namespace("org/hybrid", "bfloat16", "attn2x4x64-mamb2", 16)
    st_ns = namespace("org/hybrid", "bfloat16", "attn2x4x64-mamb2", 16, kind=STATE_KIND)
    hs = block_hashes(list(range(16 * 8)), 16)
    with Client(c.address) as cl:

        def hit() -> int:
            return hybrid_hit_blocks(cl.batch_exists(kv_ns, hs), cl.batch_exists(st_ns, hs))

        assert hit() == 0
        assert all(cl.batch_put(kv_ns, hs, [bytes([i]) * 256 for i in range(8)]))
        assert hit() == 0  # KV without any state: recompute
        assert all(cl.batch_put(st_ns, [hs[4], hs[7]], [b"s" * 64, b"t" * 64]))
        assert hit() == 8
        cl.remove(st_ns, [hs[7]])  # the state at 8 lost (or never written)
        assert hit() == 5
        cl.remove(kv_ns, [hs[2]])  # a KV block lost before the state at 5
        assert hit() == 0
        assert all(cl.batch_put(st_ns, [hs[1]], [b"u" * 64]))
        assert hit() == 2
        # The state of a prefix is its own key: same hash, other namespace.
        assert cl.batch_get(st_ns, [hs[1]]) == [b"u" * 64]
        assert cl.batch_get(kv_ns, [hs[1]]) == [bytes([1]) * 256]


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
    # First step computes up to token 22: blocks 3 (absent) is new; 4 is present.
    out, skipped = tr.blocks_to_save(22, toks)
    assert [(r.index, r.block_id) for r in out] == [(3, 13)] and skipped == 4
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


def test_full_hit_is_capped_below_the_prompt() -> None:
    tr = RequestTracker("r", 4, hit_blocks=4)
    tr.extend_hashes(list(range(16)))
    assert tr.plan_hit(16, 0, LoadPolicy(min_hit_tokens=4), 1.0, None) == 15
    # ... and the last block is still loaded whole.
    assert [r.index for r in tr.plan_load([0, 1, 2, 3], 15)] == [0, 1, 2, 3]


def test_unreachable_master_is_a_miss_without_waiting() -> None:
    h = ClientHolder("127.0.0.1:1", timeout=1.0, retry_s=60)
    t0 = time.monotonic()
    assert h.get() is None  # not there yet: the caller does not wait
    assert time.monotonic() - t0 < 0.5
    assert h.get(wait=5.0) is None  # the attempt failed within its own timeout
    t1 = time.monotonic()
    assert h.get(wait=5.0) is None  # no new attempt within retry_s: no wait at all
    assert time.monotonic() - t1 < 0.5
    h.close()


def test_client_holder_connects_in_the_background(make_cluster: Any) -> None:
    c = make_cluster(workers=1)
    h = ClientHolder(c.address, timeout=2.0)
    h.start()
    cl = h.get(wait=5.0)
    assert cl is not None and h.get() is cl
    h.close()


def test_config_parsing() -> None:
    with pytest.raises(ValueError):
        ConnectorConfig.from_dict({})
    c = ConnectorConfig.from_dict({"master": "h:1", "min_hit_tokens": "64",
                                   "prefill_tokens_per_s": 5000})  # fmt: skip
    assert c.min_hit_tokens == 64 and c.prefill_tokens_per_s == 5000.0
    assert c.lookup_timeout_s == 0.05 and c.load_failure_policy == "recompute"
    with pytest.raises(ValueError):
        ConnectorConfig.from_dict({"master": "h:1", "load_failure_policy": "ignore"})


def test_counters_interval_merge_and_reduce() -> None:
    c = Counters()
    c.add("stored_blocks", 3)
    c.observe("store_seconds", 0.002)
    c.observe("store_seconds", 0.004)
    d = c.take()
    assert d["stored_blocks"] == 3 and c.take()["stored_blocks"] == 0  # a new interval
    m = merge_stats(d, {**Counters().take(), "stored_blocks": 2, "store_seconds": [0.006]})
    assert m["stored_blocks"] == 5 and len(m["store_seconds"]) == 3
    r = reduce_stats(m)
    assert r["stored_blocks"] == 5 and r["store_count"] == 3
    assert r["store_mean_ms"] == 4.0 and r["store_max_ms"] == 6.0
    assert stats_empty(Counters().take()) and not stats_empty(m)
