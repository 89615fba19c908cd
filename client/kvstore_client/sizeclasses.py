"""The DRAM tier's slot sizes, as one pure function both sides use.

A worker's DRAM arena is cut into slabs of ``max_value_size`` bytes; each slab holds
slots of one size class. The worker's allocator (``kvstore.worker.tiers.dram``) uses
:func:`size_classes` to pick a block's slot; a client or bench that wants to know how
many blocks of a size fit (:func:`blocks_that_fit`) uses the same arithmetic, so there
is one copy of it.
"""

from __future__ import annotations

__all__ = ["ALIGN", "MIN_CLASS", "blocks_that_fit", "size_classes"]

ALIGN = 64  # every slot size is a multiple of this many bytes
MIN_CLASS = 64  # the smallest slot


def size_classes(slab_size: int) -> list[int]:
    """Slot sizes: 1, 1.25, 1.5 and 1.75 times each power of two, up to slab_size."""
    out: set[int] = set()
    p = MIN_CLASS
    while p <= slab_size:
        for num in (4, 5, 6, 7):
            s = -(-(p * num // 4) // ALIGN) * ALIGN
            if s <= slab_size:
                out.add(s)
        p *= 2
    out.add(slab_size)
    return sorted(out)


def blocks_that_fit(capacity: int, slab_size: int, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` an arena of ``capacity`` bytes in slabs of
    ``slab_size`` holds when every slab serves that one size (0 when a block is larger
    than a slab, or sizes are not positive)."""
    if block_bytes <= 0 or slab_size <= 0 or block_bytes > slab_size:
        return 0
    slot = next(s for s in size_classes(slab_size) if s >= block_bytes)
    return (capacity // slab_size) * (slab_size // slot)
