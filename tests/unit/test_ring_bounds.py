"""The ring's parameters are not trusted: whatever the map says (density, capacities,
replicas), a client's ring stays small and no worker takes more than its bounded share;
the master refuses an impossible capacity and says how the ring counts an outsized one.
Below the bounds placement is unchanged (tests/unit/test_sharding.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import MAX_VNODES_PER_GIB
from kvstore.master.membership import MAX_CAPACITY, Membership
from kvstore_client.errors import InvalidArgument
from kvstore_client.proto import master_pb2
from kvstore_client.replicas import MAX_REPLICAS
from kvstore_client.sharding import (
    MAX_RING_POINTS,
    MAX_WORKER_SHARE,
    build_ring,
    point_counts,
    vnode_count,
)
from tests.helpers import key

GiB = 1 << 30
LIAR = (1 << 64) - 1  # the most a registration's uint64 can claim
KEYS = [key(i, "bounds") for i in range(40_000)]


def exact_shares(ring) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Each worker's exact share of the ring (the arcs that end at its points)."""
    pts = ring.points.astype(np.float64)
    arcs = np.diff(np.concatenate([pts[-1:] - 2.0**64, pts]))
    out: np.ndarray = np.bincount(ring.owners[:, 0], weights=arcs) / 2.0**64
    return out


def test_the_densest_map_the_master_accepts_builds_a_bounded_ring() -> None:
    """80 workers of 64 GiB at the highest density: 5.2M points before (each at the
    per-worker maximum); at most MAX_RING_POINTS now, shared equally."""
    ws = [(f"w{i}", 64 * GiB) for i in range(80)]
    ring = build_ring(ws, vnodes_per_gib=MAX_VNODES_PER_GIB)
    assert len(ring.points) <= MAX_RING_POINTS
    per = np.bincount(ring.owners[:, 0])
    assert per.min() == per.max(), "equal workers keep equal points"
    shares = exact_shares(ring)
    assert shares.max() / shares.mean() < 1.05


def test_a_worker_claiming_the_largest_capacity_takes_a_bounded_share() -> None:
    honest = [(f"w{i}", 64 * GiB) for i in range(8)]
    ring = build_ring([*honest, ("liar", LIAR)])
    liar = ring.worker_ids.index("liar")
    share = float((ring.primary(KEYS) == liar).mean())
    # at most MAX_WORKER_SHARE median workers' worth: 8 / (8 + 8) of the keys
    assert share < 0.55, share
    assert np.bincount(ring.owners[:, 0])[liar] == MAX_WORKER_SHARE * vnode_count(64 * GiB)
    # small workers sit at the floor of 160 points; the liar gets 8 x 160
    tiny = [(f"t{i}", 1 << 20) for i in range(3)]
    ring = build_ring([*tiny, ("liar", LIAR)])
    share = float((ring.primary(KEYS) == ring.worker_ids.index("liar")).mean())
    assert share < 0.8, share


def test_a_worker_may_be_up_to_eight_median_workers() -> None:
    """Capacities within MAX_WORKER_SHARE of the median keep their exact points."""
    ws = [("a", 64 * GiB), ("b", 64 * GiB), ("c", 512 * GiB)]
    assert point_counts([c for _, c in ws]).tolist() == [vnode_count(c) for _, c in ws]


def test_above_the_cap_points_shrink_alike_and_a_join_moves_little() -> None:
    """520 workers at 8,192 points each would be 4.26M points: every worker is scaled
    down alike; 1% more workers move about 2% of the keys (their own share, plus the
    points every other worker gives up), never to a worker that was there before."""
    ws = [(f"w{i:04d}", 64 * GiB) for i in range(520)]
    before = build_ring(ws, vnodes_per_gib=128)
    assert len(before.points) <= MAX_RING_POINTS
    shares = exact_shares(before)
    assert shares.max() / shares.mean() < 1.1
    after = build_ring([*ws, *[(f"x{i}", 64 * GiB) for i in range(5)]], vnodes_per_gib=128)
    own_before = np.array(before.worker_ids)[before.primary(KEYS)]
    own_after = np.array(after.worker_ids)[after.primary(KEYS)]
    moved = own_before != own_after
    assert moved.mean() < 0.025, moved.mean()


def test_replicas_from_the_map_are_clamped() -> None:
    ring = build_ring([(f"w{i}", GiB) for i in range(12)], replicas=1 << 30)
    assert ring.replicas == MAX_REPLICAS


def info(i: str, capacity: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=i, grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=capacity
    )


def test_the_master_refuses_an_impossible_capacity_and_notes_an_outsized_one() -> None:
    m = Membership(ttl=10)
    for i in range(4):
        m.register(info(f"w{i}", 64 * GiB), "t" * 32 + str(i), now=0)
        assert m.ring_note(f"w{i}") == ""
    with pytest.raises(InvalidArgument, match=r"capacity of 18446744073709551615 bytes exceeds"):
        m.register(info("liar", LIAR), "l" * 32, now=0)
    assert "liar" not in m.members
    assert m.register(info("big", MAX_CAPACITY), "b" * 32, now=0)
    note = m.ring_note("big")
    assert "more than 8x the median worker" in note and "\n" not in note
    assert m.ring_note("w0") == ""
