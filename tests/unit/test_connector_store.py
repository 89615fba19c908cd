"""Connector pieces against a real cluster on loopback (no engine): the hybrid hit
rule through the client API, and the lazily made store client."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvstore_client import Client, block_hashes
from kvstore_client.connectors.holder import ClientHolder
from kvstore_client.connectors.lookup import kv_lookup
from kvstore_client.connectors.naming import STATE_KIND, namespace
from kvstore_client.connectors.planning import hybrid_hit_blocks


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


def test_lookup_modes_through_the_client_api(make_cluster: Any) -> None:
    """The scheduler's ``lookup`` modes on a real cluster: "batch" reports blocks
    present after a gap, "per_block" and "prefix" stop at the first miss; a block
    counts only when every rank's namespace holds it, in every mode."""
    c = make_cluster(workers=2)
    ns0 = namespace("org/m", "bfloat16", "l2", 16, tp_rank=0, tp_size=2)
    ns1 = namespace("org/m", "bfloat16", "l2", 16, tp_rank=1, tp_size=2)
    hs = block_hashes(list(range(16 * 6)), 16)
    with Client(c.address) as cl:
        assert all(cl.batch_put(ns0, hs, [bytes([i]) * 64 for i in range(6)]))
        assert all(cl.batch_put(ns1, [hs[i] for i in (0, 1, 2, 4, 5)], [b"x" * 64] * 5))
        want = {
            "batch": [True, True, True, False, True, True],
            "per_block": [True, True, True, False, False, False],
            "prefix": [True, True, True, False, False, False],
        }
        for mode, flags in want.items():
            assert kv_lookup(cl, [ns0, ns1], hs, mode) == flags, mode
            assert kv_lookup(cl, [ns0], hs, mode) == [True] * 6, mode
            assert kv_lookup(cl, [ns0, ns1], [], mode) == []
        cl.remove(ns0, [hs[0]])
        assert kv_lookup(cl, [ns0, ns1], hs, "batch") == [False, True, True, False, True, True]
        for mode in ("per_block", "prefix"):  # a miss at block 0: nothing past it is asked
            assert kv_lookup(cl, [ns0, ns1], hs, mode) == [False] * 6, mode
        with pytest.raises(ValueError, match="unknown lookup mode"):
            kv_lookup(cl, [ns0], hs, "sometimes")
