"""Replicas with real processes (over tcp, shm and ucx): R copies on distinct workers,
reads that fall back to a surviving copy, lazy repair on read, per-namespace counts
from the master."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore_client import Client
from kvstore_client.errors import InvalidArgument
from kvstore_client.replicas import (
    any_owner_groups,
    parse_namespace_replicas,
    repairs,
    replica_count,
)
from kvstore_client.sharding import build_ring
from kvstore_client.transport import ucx
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS2 = "rep/m/bf16/b16/tp0of1"  # the cluster default: 2 copies
NS1 = "r1/m/bf16/b16/tp0of1"  # --namespace-replicas r1/=1
SIZE = 4096
GiB = 1 << 30


# ---- pure parts ---------------------------------------------------------------------


def test_replica_count_precedence_and_validation() -> None:
    by = parse_namespace_replicas(["sys/=3", "sys/short/=1", "=2"])
    assert by == {"sys/": 3, "sys/short/": 1, "": 2}
    assert replica_count("sys/x", None, 1, by) == 3
    assert replica_count("sys/short/x", None, 1, by) == 1, "the longest prefix wins"
    assert replica_count("other", None, 1, {"sys/": 3}) == 1
    assert replica_count("sys/x", 2, 1, by) == 2, "the call's own count wins"
    for bad in (0, 9, -1, True):
        with pytest.raises(InvalidArgument):
            replica_count("x", bad, 1, {})
    for entry in ("sys/", "sys/=x", "sys/=0"):
        with pytest.raises(InvalidArgument):
            parse_namespace_replicas([entry])


def test_ring_owners_are_distinct_and_prefer_distinct_hosts() -> None:
    ws = [(f"w{i}", GiB) for i in range(6)]
    hosts = {f"w{i}": f"h{i // 2}" for i in range(6)}  # 3 hosts, 2 workers each
    ring = build_ring(ws, replicas=1, hosts=hosts)
    keys = [key(i) for i in range(2000)]
    own = ring.lookup(keys, 3)  # beyond the table: walked per key
    assert own.shape == (2000, 3)
    host_idx = np.array([int(hosts[ring.worker_ids[w]][1:]) for w in own.reshape(-1)])
    assert all(len(set(row)) == 3 for row in host_idx.reshape(-1, 3)), "3 distinct hosts"
    full = build_ring(ws, replicas=3, hosts=hosts)
    assert np.array_equal(full.lookup(keys), own), "the table and the walk agree"
    assert np.array_equal(own[:, 0], ring.primary(keys))
    same_host = build_ring(ws, replicas=4, hosts=hosts).lookup(keys)
    assert all(len(set(r)) == 4 for r in same_host.tolist()), "fewer hosts: distinct workers"


def test_any_owner_groups_and_repairs() -> None:
    owners = np.array([[0, 1], [1, 2], [2, 0]])
    groups = {w: sorted(idx.tolist()) for w, idx in any_owner_groups(owners)}
    assert groups == {0: [0, 2], 1: [0, 1], 2: [1, 2]}
    found_at = np.array([1, -1, 2])
    present = {0: {0: False, 2: True}, 1: {0: True}}
    fix = [(w, idx.tolist()) for w, idx in repairs(owners, found_at, present)]
    assert fix == [(0, [0])], "only an owner that answered 'absent' is repaired"


# ---- real processes -----------------------------------------------------------------


def copies(c: Client, ns: str, hashes: list[bytes]) -> np.ndarray:
    """How many live workers of the client's map hold each key."""
    view = c._view
    assert view is not None
    total = np.zeros(len(hashes), dtype=int)
    for w in view.workers:
        total += np.array(w.via.exists(5.0, ns.encode(), hashes), dtype=int)
    return total


@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx"])
def test_sigkill_under_verified_reads(make_cluster: MakeCluster, transport: str) -> None:
    if transport == "ucx" and not ucx.available():
        pytest.skip("ucxx is not importable: pip install 'kvstore-cache[ucx]'")
    c = make_cluster(
        workers=3,
        dram_size="64MiB",
        worker_ttl="2s",
        extra_master_args=["--replicas", "2", "--namespace-replicas", "r1/=1"],
        # ucx:// workers listen on a UCX port too (as in test_ucx.py)
        extra_worker_args=["--ucx-port", "0"] if transport == "ucx" else [],
    )
    hs2 = [key(i, "r2") for i in range(240)]
    hs1 = [key(i, "r1") for i in range(240)]
    with Client(c.address, transport=transport) as cl:
        assert all(cl.batch_put(NS2, hs2, [value_for(h, SIZE) for h in hs2]))
        assert all(cl.batch_put(NS1, hs1, [value_for(h, SIZE) for h in hs1]))
        assert copies(cl, NS2, hs2).tolist() == [2] * len(hs2), "R=2 from the master"
        assert copies(cl, NS1, hs1).tolist() == [1] * len(hs1), "r1/ prefix: one copy"
        assert cl.replica_stats.snapshot()["copies_written"] == len(hs2)
        hs3 = [key(i, "r3") for i in range(30)]
        assert all(cl.batch_put(NS1, hs3, [value_for(h, 64) for h in hs3], replicas=3))
        assert copies(cl, NS1, hs3).tolist() == [3] * len(hs3), "the call's count wins"

        view = cl._view
        assert view is not None
        dead_id = view.ring.worker_ids[0]
        dead_r1 = {h for h, o in zip(hs1, view.ring.primary(hs1), strict=True) if o == 0}
        assert 0 < len(dead_r1) < len(hs1)
        victim = next(w for w in c.worker_procs if cl.workers()[0].grpc == w.address)
        assert cl.workers()[0].id == dead_id
        victim.kill()

        wrong = misses_before = 0
        t0 = time.monotonic()
        while dead_id in c.live_worker_ids():
            got = cl.batch_get(NS2, hs2)
            misses_before += sum(v is None for v in got)
            wrong += sum(
                v is not None and v != value_for(h, SIZE) for h, v in zip(hs2, got, strict=True)
            )
            assert time.monotonic() - t0 < 20, "the master never dropped the dead worker"
        deadline = time.monotonic() + 5
        while cl.map_version and any(w.id == dead_id for w in cl.workers()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # once the map dropped it: every R=2 block is present and hits with the right bytes
        assert cl.batch_exists(NS2, hs2) == [True] * len(hs2)
        assert cl.match_prefix(NS2, hs2) == len(hs2)
        bufs = [bytearray(SIZE) for _ in hs2]
        assert cl.batch_get_into(NS2, hs2, [memoryview(b) for b in bufs]).result(10) == [
            True
        ] * len(hs2)
        assert all(bytes(b) == value_for(h, SIZE) for h, b in zip(hs2, bufs, strict=True))
        got = cl.batch_get(NS2, hs2)
        assert wrong == 0 and misses_before == 0
        assert all(v == value_for(h, SIZE) for h, v in zip(hs2, got, strict=True))
        # the reads repaired the copies on the new owners
        deadline = time.monotonic() + 10
        while copies(cl, NS2, hs2).min() < 2:
            assert time.monotonic() < deadline, cl.replica_stats.snapshot()
            cl.batch_get(NS2, hs2)
            time.sleep(0.1)
        assert copies(cl, NS2, hs2).max() == 2
        assert cl.replica_stats.snapshot()["repaired"] > 0
        # R=1: exactly the dead worker's share is lost
        got1 = cl.batch_get(NS1, hs1)
        lost = {h for h, v in zip(hs1, got1, strict=True) if v is None}
        assert lost == dead_r1
        assert all(v == value_for(h, SIZE) for h, v in zip(hs1, got1, strict=True) if v)
        assert cl.remove(NS2, hs2) == 2 * len(hs2), "remove drops every copy"
