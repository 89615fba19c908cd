"""The DRAM tier's slab allocator: which slots exist, which are free. No I/O.

The arena is cut into slabs of ``slab_size`` bytes; a slab is assigned to one size
class (:func:`kvstore_client.sizeclasses.size_classes`) on demand and carved into equal
slots, whose ids come from the slot arrays (:mod:`.slots`). A slot is taken from the
class's current slab, else from another of its slabs with room; a freed slot goes back
on its slab's free list, and a slab with every slot free can be given to another class.
Which block to evict when a class has no free slot is the cache's decision
(:class:`~.dram.DramTier`): this class only keeps count of each slab's evictable slots
so that it can say whether a slab could be moved.

Not thread-safe: the worker serialises calls with one lock.
"""

from __future__ import annotations

import bisect
from array import array

import numpy as np

from kvstore_client.sizeclasses import ALIGN, size_classes

from .slots import FREE, U32, UNUSED, SlotIndex


class SlabAllocator(SlotIndex):
    """Slabs of one arena of ``capacity`` bytes, carved into slots by size class."""

    def __init__(self, capacity: int, slab_size: int) -> None:
        if slab_size <= 0 or slab_size % ALIGN or slab_size > U32:
            raise ValueError(f"slab size must be a positive multiple of {ALIGN} under 4 GiB")
        if capacity < slab_size:
            raise ValueError(f"capacity {capacity} is smaller than one slab ({slab_size})")
        super().__init__()
        self.slab_size = slab_size
        self.nslabs = n = capacity // slab_size
        self.capacity = n * slab_size
        self.class_sizes = size_classes(slab_size)
        nc = len(self.class_sizes)
        self.slab_class = array("i", [-1]) * n
        self.slab_nslots = array("i", [0]) * n
        self.slab_nfree = array("i", [0]) * n
        self.slab_evictable = array("i", [0]) * n  # slots on an evictable LRU list
        self.slab_head = array("i", [-1]) * n  # free list of the slab's slots
        self._slab_ids: list[array[int] | None] = [None] * n
        self.free_slabs = list(range(n - 1, -1, -1))
        self.empty_slabs: set[int] = set()  # assigned to a class, no slot in use
        self._cur = [-1] * nc  # per class: the slab slots are taken from
        self._partial: list[set[int]] = [set() for _ in range(nc)]  # other slabs with room
        self._class_slabs = [0] * nc
        self._active: set[int] = set()  # classes holding slabs
        self.used_bytes = 0  # payload bytes of pending, ready and doomed blocks
        self.slot_bytes_used = 0  # slot bytes of the same blocks

    def slot_size_for(self, size: int) -> int:
        """Bytes of arena a value of ``size`` bytes occupies (its size class)."""
        return self.class_sizes[
            bisect.bisect_left(self.class_sizes, max(min(size, self.slab_size), 1))
        ]

    def _take(self, c: int) -> int:
        """A free slot of class ``c`` or -1."""
        slab = self._cur[c]
        if slab < 0 or self.slab_nfree[slab] == 0:
            part = self._partial[c]
            if not part:
                return -1
            slab = part.pop()
            self._cur[c] = slab
        s = self.slab_head[slab]
        self.slab_head[slab] = self.next[s]
        nfree = self.slab_nfree[slab]
        if nfree == self.slab_nslots[slab]:
            self.empty_slabs.discard(slab)
        self.slab_nfree[slab] = nfree - 1
        return s

    def _free(self, s: int) -> None:
        """Give slot ``s`` back to its slab (its block's bytes no longer count)."""
        slab = self.off[s] // self.slab_size
        c = self.slab_class[slab]
        self.used_bytes -= self.size[s]
        self.slot_bytes_used -= self.class_sizes[c]
        self.state[s] = FREE
        self.gen[s] = (self.gen[s] + 1) & U32
        self.pins[s] = 0
        self.next[s] = self.slab_head[slab]
        self.slab_head[slab] = s
        nfree = self.slab_nfree[slab] + 1
        self.slab_nfree[slab] = nfree
        if nfree == 1 and slab != self._cur[c]:
            self._partial[c].add(slab)
        if nfree == self.slab_nslots[slab]:
            self.empty_slabs.add(slab)

    def _movable(self, slab: int) -> bool:
        """Every block in the slab is evictable (ready, unpinned, not a pinned namespace)."""
        return self.slab_nslots[slab] - self.slab_nfree[slab] == self.slab_evictable[slab]

    def _any_movable_slab(self, c: int) -> int:
        """A slab of another class whose blocks are all evictable (fewest blocks), or -1."""
        cls = np.frombuffer(self.slab_class, dtype=np.int32)
        live = np.frombuffer(self.slab_nslots, dtype=np.int32) - np.frombuffer(
            self.slab_nfree, dtype=np.int32
        )
        ok = (cls >= 0) & (cls != c) & (live == np.frombuffer(self.slab_evictable, np.int32))
        cand = np.flatnonzero(ok)
        if not cand.size:
            return -1
        return int(cand[np.argmin(live[cand])])

    def _assign(self, slab: int, c: int) -> None:
        """Carve a slab into free slots of class ``c`` (ids taken before any view)."""
        size = self.class_sizes[c]
        n = self.slab_size // size
        ids = self.take_ids(n)
        ida = np.frombuffer(ids, dtype=np.int32)
        base = slab * self.slab_size
        np.frombuffer(self.off, dtype=np.uint64)[ida] = base + size * np.arange(n, dtype=np.uint64)
        np.frombuffer(self.state, dtype=np.uint8)[ida] = FREE
        nxt = np.frombuffer(self.next, dtype=np.int32)
        nxt[ida[:-1]] = ida[1:]
        nxt[ida[-1]] = -1
        del ida, nxt
        self.slab_head[slab] = ids[0]
        self.slab_nslots[slab] = n
        self.slab_nfree[slab] = n
        self.slab_evictable[slab] = 0
        self.slab_class[slab] = c
        self._slab_ids[slab] = ids
        self._class_slabs[c] += 1
        self._active.add(c)
        self._partial[c].add(slab)
        self.empty_slabs.add(slab)

    def _unassign(self, slab: int) -> None:
        """Give back the ids of a slab whose slots are all free."""
        c = self.slab_class[slab]
        ids = self._slab_ids[slab]
        assert ids is not None
        ida = np.frombuffer(ids, dtype=np.int32)
        np.frombuffer(self.state, dtype=np.uint8)[ida] = UNUSED
        np.frombuffer(self.gen, dtype=np.uint32)[ida] += np.uint32(1)
        del ida
        self.give_ids(ids)
        self._slab_ids[slab] = None
        self.slab_class[slab] = -1
        self.slab_nslots[slab] = self.slab_nfree[slab] = 0
        self.slab_head[slab] = -1
        self._partial[c].discard(slab)
        if self._cur[c] == slab:
            self._cur[c] = -1
        self.empty_slabs.discard(slab)
        self._class_slabs[c] -= 1
        if not self._class_slabs[c]:
            self._active.discard(c)
