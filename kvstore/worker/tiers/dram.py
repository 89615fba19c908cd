"""DRAM tier bookkeeping: slab allocator by size class, index and LRU. No I/O.

The tier hands out byte ranges (offsets) of one arena; the caller moves bytes.
A put is two-phase so a half-written block is never readable:

    blk = tier.reserve(ns, key, size, checksum)   # None: present (first writer wins)
    ... receive the payload into arena[blk.offset : blk.offset + size] ...
    tier.commit(blk)                               # now visible; or tier.abort(blk)

A read pins the block while its bytes are in flight, so eviction or removal
cannot recycle the slot underneath it:

    blk = tier.acquire(ns, key)                    # None: miss; counts hit/miss
    ... send arena[blk.offset : blk.offset + blk.size] ...
    tier.release(blk)

Memory is cut into slabs of ``slab_size`` bytes; a slab is assigned to one size
class on demand and carved into equal slots. When a class has no free slot, the
tier evicts the least recently used block of that class, or, when another
class's least recently used block is older, takes over that class's slab
(evicting the blocks in it), so memory follows the workload's size mix.

Not thread-safe: the worker serialises calls with one lock (each call is a few
dictionary operations).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore_client.errors import InvalidArgument, ResourceExhausted

ALIGN = 64
MIN_CLASS = 64


@dataclass(slots=True, eq=False)
class Block:
    """One stored value. Compared and hashed by identity."""

    ns: str
    key: bytes
    offset: int
    size: int
    checksum: int
    cls: int
    tick: int = 0
    pins: int = 0
    ready: bool = False
    doomed: bool = False  # removed while pinned: free the slot on the last release


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    skipped: int = 0
    evictions: int = 0
    slab_moves: int = 0
    removed: int = 0


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


@dataclass(slots=True)
class _Class:
    size: int
    free: set[int] = field(default_factory=set)
    lru: OrderedDict[Block, None] = field(default_factory=OrderedDict)
    slabs: int = 0


class DramTier:
    """Index, allocator and LRU of one arena of ``capacity`` bytes."""

    def __init__(
        self,
        capacity: int,
        slab_size: int,
        on_evict: Callable[[Block], None] | None = None,
        pinned: Iterable[str] = (),
    ) -> None:
        if slab_size <= 0 or slab_size % ALIGN:
            raise ValueError(f"slab size must be a positive multiple of {ALIGN}")
        if capacity < slab_size:
            raise ValueError(f"capacity {capacity} is smaller than one slab ({slab_size})")
        self.slab_size = slab_size
        self.nslabs = capacity // slab_size
        self.capacity = self.nslabs * slab_size
        self.classes = [_Class(s) for s in size_classes(slab_size)]
        self._class_sizes = [c.size for c in self.classes]
        self.slab_class = [-1] * self.nslabs
        self.free_slabs = list(range(self.nslabs - 1, -1, -1))
        self.slab_live = [0] * self.nslabs  # slots in use (pending or ready) per slab
        self.empty_slabs: set[int] = set()  # assigned to a class, no slot in use
        self.index: dict[str, dict[bytes, Block]] = {}
        self.owner: dict[int, Block] = {}  # offset -> block holding that slot
        self.counters = TierCounters()
        self.used_bytes = 0  # payload bytes of ready + pending blocks
        self.keys = 0  # ready blocks
        self._tick = 0
        self._on_evict = on_evict
        self.pinned = frozenset(pinned)  # namespaces whose blocks are never evicted

    @property
    def max_value_size(self) -> int:
        return self.slab_size

    # ---- lookups -------------------------------------------------------------

    def peek(self, ns: str, key: bytes) -> Block | None:
        """The ready block or None, without touching LRU order or counters."""
        b = self.index.get(ns, {}).get(key)
        return b if b is not None and b.ready else None

    def contains(self, ns: str, key: bytes) -> bool:
        return self.peek(ns, key) is not None

    def exists_many(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is a ready block stored? (No LRU or counter change.)"""
        space = self.index.get(ns)
        if not space:
            return [False] * len(keys)
        return [b is not None and b.ready for b in map(space.get, keys)]

    def keys_of(self, ns: str) -> list[bytes]:
        """The keys of the ready blocks of one namespace."""
        return [b.key for b in self.index.get(ns, {}).values() if b.ready]

    def slot_size_for(self, size: int) -> int:
        """Bytes of arena a value of ``size`` bytes occupies (its size class)."""
        return self._class_sizes[self._class_for(min(size, self.slab_size))]

    def pin(self, b: Block) -> None:
        """Keep a block from being evicted or freed (not a read: no LRU or counter change)."""
        b.pins += 1

    def acquire(self, ns: str, key: bytes) -> Block | None:
        """Pin a ready block for reading and mark it recently used; None on a miss."""
        b = self.peek(ns, key)
        if b is None:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        b.pins += 1
        self._touch(b)
        return b

    def release(self, b: Block) -> None:
        """Unpin a block taken by :meth:`acquire`."""
        b.pins -= 1
        if b.pins == 0 and b.doomed:
            self._free_slot(b)

    # ---- writes --------------------------------------------------------------

    def reserve(self, ns: str, key: bytes, size: int, checksum: int) -> Block | None:
        """Allocate a slot for a new block, or None if the key is present or pending.

        Raises InvalidArgument for a size over the limit and ResourceExhausted when
        every candidate slot is pinned.
        """
        if size < 0 or size > self.slab_size:
            raise InvalidArgument(f"value of {size} bytes exceeds the limit of {self.slab_size}")
        space = self.index.setdefault(ns, {})
        if key in space:
            self.counters.skipped += 1
            return None
        cls = self._class_for(size)
        offset = self._alloc(cls)
        b = Block(ns, key, offset, size, checksum, cls)
        space[key] = b
        self.owner[offset] = b
        self.used_bytes += size
        return b

    def commit(self, b: Block) -> None:
        """Make a reserved block visible (all its bytes are in and verified)."""
        if b.doomed:  # removed while being written
            self._free_slot(b)
            return
        b.ready = True
        self.keys += 1
        self.counters.puts += 1
        self._touch(b)

    def abort(self, b: Block) -> None:
        """Drop a reserved block whose bytes did not all arrive."""
        if not b.doomed:
            self._unindex(b)
        self._free_slot(b)

    def remove(self, ns: str, key: bytes) -> bool:
        """Remove a ready block; True if it was there. Pinned blocks go on release."""
        b = self.peek(ns, key)
        if b is None:
            return False
        self._drop(b)
        self.counters.removed += 1
        return True

    def remove_namespace(self, ns: str) -> int:
        """Remove every ready block of a namespace; returns how many."""
        blocks = [b for b in self.index.get(ns, {}).values() if b.ready]
        for b in blocks:
            self._drop(b)
        self.counters.removed += len(blocks)
        return len(blocks)

    def blocks(self) -> Iterator[Block]:
        """All ready blocks (for stats and shutdown demotion)."""
        for space in self.index.values():
            for b in space.values():
                if b.ready:
                    yield b

    # ---- internals -----------------------------------------------------------

    def _class_for(self, size: int) -> int:
        return bisect.bisect_left(self._class_sizes, max(size, 1))

    def _touch(self, b: Block) -> None:
        self._tick += 1
        b.tick = self._tick
        lru = self.classes[b.cls].lru
        if b in lru:
            lru.move_to_end(b)
        else:
            lru[b] = None

    def _unindex(self, b: Block) -> None:
        space = self.index.get(b.ns)
        if space is not None and space.get(b.key) is b:
            del space[b.key]
            if not space:
                del self.index[b.ns]

    def _drop(self, b: Block) -> None:
        """Take a ready block out of the index and LRU; free now or on release."""
        self._unindex(b)
        self.classes[b.cls].lru.pop(b, None)
        self.keys -= 1
        b.ready = False
        if b.pins:
            b.doomed = True
        else:
            self._free_slot(b)

    def _free_slot(self, b: Block) -> None:
        if self.owner.get(b.offset) is b:
            del self.owner[b.offset]
            self.used_bytes -= b.size
            self.classes[b.cls].free.add(b.offset)
            slab = b.offset // self.slab_size
            self.slab_live[slab] -= 1
            if self.slab_live[slab] == 0:
                self.empty_slabs.add(slab)

    def _evict(self, b: Block) -> None:
        if self._on_evict is not None:
            self._on_evict(b)
        self._drop(b)
        self.counters.evictions += 1

    def _lru_victim(self, c: _Class, limit: int = 64) -> Block | None:
        for i, b in enumerate(c.lru):
            if i >= limit:
                break
            if b.pins == 0 and b.ns not in self.pinned:
                return b
        return None

    def oldest(self, nbytes: int, *, include_pinned_ns: bool = False) -> list[Block]:
        """Least recently used unpinned blocks (all classes) adding up to ``nbytes``.

        Blocks of pinned namespaces are left out unless ``include_pinned_ns``.
        """
        out: list[Block] = []
        total = 0
        for b in heapq.merge(*(c.lru for c in self.classes), key=lambda b: b.tick):
            if total >= nbytes:
                break
            if b.pins or (b.ns in self.pinned and not include_pinned_ns):
                continue
            out.append(b)
            total += b.size
        return out

    def _assign_slab(self, slab: int, cls: int) -> None:
        c = self.classes[cls]
        self.slab_class[slab] = cls
        c.slabs += 1
        start = slab * self.slab_size
        c.free.update(range(start, start + self.slab_size - c.size + 1, c.size))

    def _alloc(self, cls: int) -> int:
        c = self.classes[cls]
        if not c.free and self.free_slabs:
            self._assign_slab(self.free_slabs.pop(), cls)
        if not c.free and self.empty_slabs:  # an emptied slab of another class: no eviction
            self._take_empty_slab(self.empty_slabs.pop(), cls)
        if not c.free:
            own = self._lru_victim(c)
            donor = self._oldest_other(cls)
            if donor is not None and (own is None or donor.tick < own.tick):
                if not self._move_slab(donor, cls) and own is not None:
                    self._evict(own)
            elif own is not None:
                self._evict(own)
        if not c.free:
            raise ResourceExhausted(
                f"no free {c.size}-byte slot: every candidate block is being read or written"
            )
        offset = c.free.pop()
        slab = offset // self.slab_size
        self.slab_live[slab] += 1
        self.empty_slabs.discard(slab)
        return offset

    def _take_empty_slab(self, slab: int, to_cls: int) -> None:
        from_c = self.classes[self.slab_class[slab]]
        start = slab * self.slab_size
        end = start + self.slab_size - from_c.size + 1
        from_c.free.difference_update(range(start, end, from_c.size))
        from_c.slabs -= 1
        self.counters.slab_moves += 1
        self._assign_slab(slab, to_cls)

    def _oldest_other(self, cls: int) -> Block | None:
        best: Block | None = None
        for i, c in enumerate(self.classes):
            if i == cls or not c.slabs:
                continue
            v = self._lru_victim(c)
            if v is not None and (best is None or v.tick < best.tick):
                best = v
        return best

    def _move_slab(self, victim: Block, to_cls: int) -> bool:
        """Evict every block in the victim's slab and give the slab to ``to_cls``."""
        slab = victim.offset // self.slab_size
        from_c = self.classes[self.slab_class[slab]]
        start = slab * self.slab_size
        offsets = range(start, start + self.slab_size - from_c.size + 1, from_c.size)
        holders = [self.owner[o] for o in offsets if o in self.owner]
        if any(b.pins or not b.ready or b.ns in self.pinned for b in holders):
            return False
        for b in holders:
            self._evict(b)
        self.empty_slabs.discard(slab)
        from_c.free.difference_update(offsets)
        from_c.slabs -= 1
        self.counters.slab_moves += 1
        self._assign_slab(slab, to_cls)
        return True
