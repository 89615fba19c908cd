"""kvstore_client.sizeclasses: the one copy of the DRAM tier's slot arithmetic.

The benches size their offline references with :func:`blocks_that_fit`; it must say
exactly how many blocks the worker's DRAM tier holds, since the tier uses the same
:func:`size_classes`.
"""

from __future__ import annotations

import pytest

from kvstore.worker.tiers import slabs
from kvstore.worker.tiers.dram import DramTier
from kvstore_client.sizeclasses import blocks_that_fit, size_classes

KiB = 1024
MiB = 1 << 20


def test_the_tier_uses_the_shared_function() -> None:
    assert slabs.size_classes is size_classes  # the DRAM tier's allocator


@pytest.mark.parametrize("block", [1000, 4 * KiB, 5 * KiB + 1, 96 * KiB, 1 * MiB])
def test_blocks_that_fit_is_what_the_tier_holds(block: int) -> None:
    t = DramTier(8 * MiB, 1 * MiB)
    n = blocks_that_fit(8 * MiB, 1 * MiB, block)
    for i in range(2 * n + 3):  # past full: each reserve evicts the oldest
        b = t.reserve("ns", i.to_bytes(16, "little"), block, checksum=i)
        assert b is not None
        t.commit(b)
    assert sum(1 for _ in t.blocks()) == n


def test_blocks_that_fit_edges() -> None:
    assert blocks_that_fit(8 * MiB, 1 * MiB, 1 * MiB + 1) == 0  # larger than a slab
    assert blocks_that_fit(8 * MiB, 1 * MiB, 0) == 0
    assert blocks_that_fit(8 * MiB + 5, 1 * MiB, 1 * MiB) == 8  # a partial slab holds none
