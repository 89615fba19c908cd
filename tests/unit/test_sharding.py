"""Placement: stable, balanced, weighted, deterministic."""

from __future__ import annotations

import numpy as np

from kvstore_client.sharding import build_ring
from tests.helpers import key

GiB = 1 << 30
KEYS = [key(i) for i in range(50_000)]


def owners(ring, keys=KEYS):  # type: ignore[no-untyped-def]
    return np.array(ring.worker_ids)[ring.primary(keys)]


def test_adding_a_worker_moves_only_its_share() -> None:
    before = owners(build_ring([("a", GiB), ("b", GiB), ("c", GiB)]))
    after = owners(build_ring([("a", GiB), ("b", GiB), ("c", GiB), ("d", GiB)]))
    moved = before != after
    assert np.all(after[moved] == "d"), "keys only move to the new worker"
    assert 0.18 < moved.mean() < 0.32  # about 1/4


def test_removing_a_worker_moves_only_its_keys() -> None:
    before = owners(build_ring([("a", GiB), ("b", GiB), ("c", GiB)]))
    after = owners(build_ring([("a", GiB), ("c", GiB)]))
    assert np.all((before == after) | (before == "b"))


def test_balance_and_capacity_weighting() -> None:
    share = np.bincount(build_ring([(f"w{i}", GiB) for i in range(4)]).primary(KEYS)) / len(KEYS)
    assert share.min() > 0.18 and share.max() < 0.32
    ring = build_ring([("small", 8 * GiB), ("big", 32 * GiB)])
    big = (owners(ring) == "big").mean()
    assert 0.72 < big < 0.88  # about 4/5


def test_same_map_same_placement_in_any_order() -> None:
    a = build_ring([("x", GiB), ("y", 2 * GiB)])
    b = build_ring([("y", 2 * GiB), ("x", GiB)])
    assert np.array_equal(owners(a), owners(b))


def test_replicas_are_distinct_workers() -> None:
    ring = build_ring([("a", GiB), ("b", GiB), ("c", GiB)], replicas=2)
    own = ring.lookup(KEYS[:1000])
    assert own.shape == (1000, 2)
    assert np.all(own[:, 0] != own[:, 1])
