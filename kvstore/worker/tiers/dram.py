"""DRAM tier bookkeeping: index, LRU and eviction over a slab allocator. No I/O.

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
class on demand and carved into equal slots (the allocator, :mod:`.slabs`). When a
class has no free slot, the tier evicts the least recently used block of that class,
or, when another class's least recently used block is older, takes over that class's
slab (evicting the blocks in it), so memory follows the workload's size mix.

Pinned blocks (held by a reader or by :meth:`DramTier.pin`) and blocks of pinned
namespaces are kept OUT of the evictable LRU lists, so the victim is always the
head of a list: however many pinned blocks sit at the old end, eviction finds
the least recently used evictable block in O(1). A pinned block goes back to
the most recently used end on its last release. When a whole class is
unevictable, a slab whose every block is evictable is taken from another class.

Per block the state is a slot in flat typed arrays (:mod:`.slots`), about 80
bytes of heap; :class:`Block` is a short-lived handle onto a slot, checked by a
generation number so a handle never acts on a slot that was freed and reused.

Not thread-safe: the worker serialises calls with one lock (each call is a few
array operations).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from kvstore_client.errors import InvalidArgument, ResourceExhausted

from .blocks import Block, TierCounters
from .shared import SharedIndex
from .slabs import SlabAllocator
from .slots import DOOMED, M64, PENDING, READY, U32

_SCALAR_BATCH = 8  # exists_many probes shorter batches one key at a time


# Reads same-host clients logged that an eviction applies first (tiers.shared; the
# upkeep applies the rest off the store lock): a put right after a read must not evict
# what was just read, and junk in a client's log must not make an eviction long.
ROOM_READS = 1024


class DramTier(SlabAllocator):
    """Index and LRU of one arena of ``capacity`` bytes, over its slab allocator.

    ``on_evict(block)`` is called synchronously for every eviction (own class or
    slab move), before the slot is reused, while the block's bytes are still in the
    arena. Blocks of the ``pinned`` namespaces are never evicted.
    """

    def __init__(
        self,
        capacity: int,
        slab_size: int,
        on_evict: Callable[[Block], None] | None = None,
        pinned: Iterable[str] = (),
    ) -> None:
        super().__init__(capacity, slab_size)
        nc = len(self.class_sizes)
        if 2 * nc > 256:
            raise ValueError("too many size classes")  # a slot's list index is one byte
        # LRU lists, two per class: 2c evictable, 2c+1 blocks of pinned namespaces.
        self._head = [-1] * (2 * nc)
        self._tail = [-1] * (2 * nc)
        self._ns_ids: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._ns_live: list[int] = []  # indexed slots per namespace id
        self._ns_pinned: list[bool] = []
        self._ns_spare: list[int] = []
        self.counters = TierCounters()
        self.keys = 0  # ready blocks
        self._tick = 0
        self._on_evict = on_evict
        self.pinned = frozenset(pinned)  # namespaces whose blocks are never evicted
        # The same-host index (tiers.shared), when the worker shares one: ready blocks
        # are mirrored there and slots that clients pinned through it are held.
        self.shared: SharedIndex | None = None

    @property
    def max_value_size(self) -> int:
        return self.slab_size

    # ---- lookups -------------------------------------------------------------

    def _find(self, ns: str, key: bytes) -> int:
        nsid = self._ns_ids.get(ns)
        if nsid is None or len(key) != 16:
            return -1
        return self.find(nsid, key if type(key) is bytes else bytes(key))

    def peek(self, ns: str, key: bytes) -> Block | None:
        """The ready block or None, without touching LRU order or counters."""
        s = self._find(ns, key)
        if s < 0 or self.state[s] != READY:
            return None
        return self._handle(s, ns, key)

    def contains(self, ns: str, key: bytes) -> bool:
        s = self._find(ns, key)
        return s >= 0 and self.state[s] == READY

    def exists_many(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is it ready? Batch lookup (numpy); no counters, no LRU change."""
        nsid = self._ns_ids.get(ns)
        if nsid is None or not keys:
            return [False] * len(keys)
        if len(keys) < _SCALAR_BATCH:
            return [self.contains(ns, k) for k in keys]
        packed = b"".join(keys)
        if len(packed) != 16 * len(keys):  # some key is not 16 bytes: it never matches
            return [self.contains(ns, k) for k in keys]
        found: list[bool] = self.ready_flags(ns, packed, keys).tolist()
        return found

    def ready_flags(self, ns: str, packed: bytes, keys: Sequence[bytes]) -> np.ndarray:
        """Per key (also given packed, 16*N bytes): is it ready? A bool array; one
        numpy pass (:meth:`SlotIndex.find_packed`); no counters, no LRU change."""
        nsid = self._ns_ids.get(ns)
        if nsid is None or not keys:
            return np.zeros(len(keys), dtype=bool)
        if len(packed) != 16 * len(keys):
            raise ValueError("packed must hold the keys, 16 bytes each")
        try:
            slots = self.find_packed(nsid, packed, keys)
        except (TypeError, ValueError):  # bytearray or memoryview keys (unhashable): as bytes
            keys = [bytes(k) for k in keys]
            if any(len(k) != 16 for k in keys):  # wrong sizes never match
                return np.array([self.contains(ns, k) for k in keys], dtype=bool)
            slots = self.find_packed(nsid, packed, keys)
        st = np.frombuffer(self.state, dtype=np.uint8)
        flags: np.ndarray = (slots >= 0) & (st[np.maximum(slots, 0)] == READY)
        return flags

    def keys_of(self, ns: str, limit: int | None = None) -> list[bytes]:
        """Keys of the namespace's ready blocks (any order; at most ``limit``)."""
        nsid = self._ns_ids.get(ns)
        if nsid is None:
            return []
        return self.keys_at(self.slots_where(nsid, READY)[:limit])

    def acquire(self, ns: str, key: bytes) -> Block | None:
        """Pin a ready block for reading and mark it recently used; None on a miss.

        A pinned block is off the evictable LRU list until its last :meth:`release`,
        which puts it back at the most recently used end.
        """
        nsid = self._ns_ids.get(ns)
        s = -1
        if nsid is not None and len(key) == 16:
            # SlotIndex.find inlined: this runs once per block read, under the store lock.
            if type(key) is not bytes:
                key = bytes(key)
            h = ((hash(key) >> 32) ^ self.ns_salt[nsid]) & U32
            t, mask, h32, kb = self.table, self._tmask, self.h32, self.kb
            i = h >> self._tshift
            while True:
                s = t[i]
                if s < 0 or (
                    h32[s] == h and kb[16 * s : 16 * s + 16] == key and self.nsid[s] == nsid
                ):
                    break
                i = (i + 1) & mask
        state = self.state
        if s < 0 or state[s] != READY:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        p = self.pins[s]
        if p == 0:
            self._unlink(s)
        self.pins[s] = p + 1
        self._tick += 1
        self.tick[s] = self._tick
        return Block(
            ns,
            key,
            self.off[s],
            self.size[s],
            self.csum[s],
            self.class_sizes[self.lst[s] >> 1],
            s,
            self.gen[s],
            self,
        )

    def acquire_many(self, ns: str, keys: Sequence[bytes]) -> list[Block | None]:
        """:meth:`acquire` of each key in order, in one pass: the same pins, counters,
        LRU order and handles as one call per key (a key given twice is pinned twice).
        The probe is :meth:`acquire`'s, inlined (numpy's find_many measured 3x slower
        than this for batches of 32)."""
        nsid = self._ns_ids.get(ns)
        n = len(keys)
        if nsid is None:
            self.counters.misses += n
            return [None] * n
        salt = self.ns_salt[nsid]
        table, mask, shift = self.table, self._tmask, self._tshift
        h32, kb, nsids = self.h32, self.kb, self.nsid
        state, pins, tick, gen = self.state, self.pins, self.tick, self.gen
        off, size, csum, lst = self.off, self.size, self.csum, self.lst
        classes, unlink = self.class_sizes, self._unlink
        out: list[Block | None] = []
        hits = 0
        t = self._tick
        for key in keys:
            if len(key) != 16:
                out.append(None)
                continue
            if type(key) is not bytes:
                key = bytes(key)
            h = ((hash(key) >> 32) ^ salt) & U32
            i = h >> shift
            while True:
                s = table[i]
                if s < 0 or (h32[s] == h and kb[16 * s : 16 * s + 16] == key and nsids[s] == nsid):
                    break
                i = (i + 1) & mask
            if s < 0 or state[s] != READY:
                out.append(None)
                continue
            hits += 1
            p = pins[s]
            if p == 0:
                unlink(s)
            pins[s] = p + 1
            t += 1
            tick[s] = t
            out.append(
                Block(ns, key, off[s], size[s], csum[s], classes[lst[s] >> 1], s, gen[s], self)
            )
        self._tick = t
        self.counters.hits += hits
        self.counters.misses += n - hits
        return out

    def release_many(self, blocks: Iterable[Block]) -> None:
        """:meth:`release` of each block in order, in one pass (same effect)."""
        pins, gen, state = self.pins, self.gen, self.state
        for b in blocks:
            s = b.slot
            p = pins[s]
            if p == 0 or gen[s] != b.gen:
                continue
            if p > 1:
                pins[s] = p - 1
            elif state[s] == READY:
                pins[s] = 0
                self._link(s)
            else:  # doomed
                self._free(s)

    def namespaces(self) -> list[str]:
        """Namespaces that hold at least one (pending or ready) block."""
        return [n for n, live in zip(self._ns_names, self._ns_live, strict=True) if live > 0]

    def pin(self, b: Block) -> bool:
        """Pin a ready block without counting a read (e.g. while demoting it).

        False (nothing pinned) if the block is no longer ready. Undo with :meth:`release`.
        """
        s = b.slot
        if self.gen[s] != b.gen or self.state[s] != READY:
            return False
        p = self.pins[s]
        if p == 0:
            self._unlink(s)
        self.pins[s] = p + 1
        return True

    def release(self, b: Block) -> None:
        """Unpin a block taken by :meth:`acquire` or :meth:`pin`.

        On the last release a doomed block's slot is freed and a ready one goes back
        to the most recently used end of its LRU list. A stale handle does nothing.
        """
        s = b.slot
        p = self.pins[s]
        if p == 0 or self.gen[s] != b.gen:
            return
        if p > 1:
            self.pins[s] = p - 1
        elif self.state[s] == READY:
            self.pins[s] = 0
            self._link(s)
        else:  # doomed
            self._free(s)

    def set_tag(self, b: Block, tag: int) -> None:
        """Attach a small integer (0..2**32-1, e.g. a session id) to a live block."""
        if self.gen[b.slot] == b.gen:
            self.tag[b.slot] = tag & U32

    def tag_of(self, b: Block) -> int:
        """The block's tag; 0 when never set or the handle is stale."""
        return self.tag[b.slot] if self.gen[b.slot] == b.gen else 0

    def size_of(self, ns: str, key: bytes) -> int:
        """Payload bytes of a ready block, 0 when it is not here."""
        s = self._find(ns, key)
        return self.size[s] if s >= 0 and self.state[s] == READY else 0

    def retain(self, ns: str, key: bytes, on: bool) -> bool:
        """Keep a ready block off (``on``) or put it back on the evictable LRU list.

        A retained block is never evicted nor returned by :meth:`oldest` (like a
        block of a pinned namespace) until it is released, which puts it at the most
        recently used end. False when the block is not here.
        """
        s = self._find(ns, key)
        if s < 0 or self.state[s] != READY:
            return False
        x = self.lst[s]
        want = 1 if on or self._ns_pinned[self.nsid[s]] else 0
        if x & 1 == want:
            return True
        if self.pins[s]:
            self.lst[s] = (x & ~1) | want  # joins that list on its last release
        else:
            self._unlink(s)
            self.lst[s] = (x & ~1) | want
            self._link(s)
        return True

    def touch(self, ns: str, key: bytes) -> bool:
        """Move an evictable, unpinned block to the most recently used end of its list
        (False when it is not here, pinned by a reader or kept off the list)."""
        s = self._find(ns, key)
        if s < 0 or self.state[s] != READY or self.pins[s] or self.lst[s] & 1:
            return False
        self._unlink(s)
        self._link(s)
        return True

    def apply_reads(self, logged: Sequence[tuple[int, int]]) -> None:
        """Apply reads same-host clients logged in the index (tiers.shared): up the LRU,
        counted as hits / misses; (-1, n) is n misses. Entries naming a slot that is
        not that generation's ready block are ignored (a client writes its log freely)."""
        for s, g in logged:
            if s < 0:  # a count of misses
                self.counters.misses += min(g, 1 << 16)
            elif s < self.nslots and self.gen[s] == g and self.state[s] == READY:
                self.counters.hits += 1
                if not self.pins[s] and not self.lst[s] & 1:
                    self._unlink(s)
                    self._link(s)

    def make_oldest(self, ns: str, key: bytes) -> bool:
        """Move an evictable, unpinned block to the evicting end of its LRU list."""
        s = self._find(ns, key)
        if s < 0 or self.state[s] != READY or self.pins[s] or self.lst[s] & 1:
            return False
        self._unlink(s)
        x = self.lst[s]
        self.slab_evictable[self.off[s] // self.slab_size] += 1
        self.tick[s] = 0  # older than any use: LRU walks stay in tick order
        h = self._head[x]
        self.prev[s] = -1
        self.next[s] = h
        if h >= 0:
            self.prev[h] = s
        else:
            self._tail[x] = s
        self._head[x] = s
        return True

    # ---- writes --------------------------------------------------------------

    def reserve(self, ns: str, key: bytes, size: int, checksum: int) -> Block | None:
        """Allocate a slot for a new block, or None if the key is present or pending.

        Raises InvalidArgument for a size over the limit (or a key that is not 16
        bytes) and ResourceExhausted when no slot can be freed: every block of the
        size class is pinned and no other class has a slab it can give up. Evictions
        made here call ``on_evict`` first.
        """
        if size < 0 or size > self.slab_size:
            raise InvalidArgument(f"value of {size} bytes exceeds the limit of {self.slab_size}")
        if len(key) != 16:
            raise InvalidArgument(f"a key is 16 bytes, got {len(key)}")
        if type(key) is not bytes:
            key = bytes(key)
        if not 0 <= checksum <= M64:
            raise InvalidArgument("a checksum is an unsigned 64-bit integer")
        known = self._ns_ids.get(ns)
        if known is not None and self.find(known, key) >= 0:
            self.counters.skipped += 1
            return None
        cls = bisect.bisect_left(self.class_sizes, max(size, 1))
        s = self._alloc(cls)
        nsid = self._intern(ns)  # after _alloc: its evictions may retire namespace ids
        self.kb[16 * s : 16 * s + 16] = key
        self.h32[s] = self.hash32(nsid, key)
        self.nsid[s] = nsid
        self.lst[s] = 2 * cls + self._ns_pinned[nsid]
        self.size[s] = size
        self.csum[s] = checksum
        self.pins[s] = 0
        self.tag[s] = 0
        self.state[s] = PENDING
        self.index_insert(s)
        self._ns_live[nsid] += 1
        slot_size = self.class_sizes[cls]
        self.used_bytes += size
        self.slot_bytes_used += slot_size
        return Block(ns, key, self.off[s], size, checksum, slot_size, s, self.gen[s], self)

    def set_checksum(self, b: Block, checksum: int) -> bool:
        """Give a reserved (still pending) block the checksum of the bytes its
        writer put in, for writers that learn it only after writing (shm:// with
        FLAG_LATE_SUM); False when the block is no longer pending or the value is
        not an unsigned 64-bit integer."""
        s = b.slot
        if self.gen[s] != b.gen or self.state[s] != PENDING or not 0 <= checksum <= M64:
            return False
        self.csum[s] = checksum
        return True

    def commit(self, b: Block) -> None:
        """Make a reserved block visible (all its bytes are in and verified)."""
        s = b.slot
        if self.gen[s] != b.gen:
            return
        st = self.state[s]
        if st == PENDING:
            self.state[s] = READY
            self.keys += 1
            self.counters.puts += 1
            if self.pins[s] == 0:
                self._link(s)
            if self.shared is not None:
                self.shared.publish(s, b.gen, b.ns, b.key, self.off[s], self.size[s], self.csum[s])
        elif st == DOOMED and self.pins[s] == 0:
            self._free(s)

    def abort(self, b: Block) -> None:
        """Drop a reserved block whose bytes did not all arrive."""
        s = b.slot
        if self.gen[s] != b.gen:
            return
        st = self.state[s]
        if st == PENDING:
            self._unindex(s)
            self._free(s)
        elif st == DOOMED and self.pins[s] == 0:
            self._free(s)

    def remove(self, ns: str, key: bytes) -> bool:
        """Remove a ready block; True if it was there. Pinned blocks go on release."""
        s = self._find(ns, key)
        if s < 0 or self.state[s] != READY:
            return False
        self._drop(s)
        self.counters.removed += 1
        return True

    def remove_namespace(self, ns: str) -> int:
        """Remove every ready block of a namespace; returns how many."""
        nsid = self._ns_ids.get(ns)
        if nsid is None:
            return 0
        slots = self.slots_where(nsid, READY).tolist()
        for s in slots:
            self._drop(s)
        self.counters.removed += len(slots)
        return len(slots)

    def blocks(self) -> Iterator[Block]:
        """All ready blocks (for stats and shutdown demotion); skips ones gone since."""
        for s in self.slots_where(None, READY).tolist():
            if self.state[s] == READY:
                yield self._handle(s)

    def oldest(self, nbytes: int, *, include_pinned_ns: bool = False) -> list[Block]:
        """Least recently used unpinned blocks (all classes) adding up to ``nbytes``.

        Blocks of pinned namespaces are left out unless ``include_pinned_ns``.
        """
        lists = [2 * c + k for c in self._active for k in ((0, 1) if include_pinned_ns else (0,))]
        out: list[Block] = []
        total = 0
        for _, s in heapq.merge(*(self._walk(x) for x in lists)):
            if total >= nbytes:
                break
            out.append(self._handle(s))
            total += self.size[s]
        return out

    # ---- internals: handles, namespaces, LRU lists ---------------------------

    def _handle(self, s: int, ns: str | None = None, key: bytes | None = None) -> Block:
        if ns is None:
            ns = self._ns_names[self.nsid[s]]
        if key is None:
            key = bytes(self.kb[16 * s : 16 * s + 16])
        slot_size = self.class_sizes[self.lst[s] >> 1]
        return Block(
            ns, key, self.off[s], self.size[s], self.csum[s], slot_size, s, self.gen[s], self
        )

    def _intern(self, ns: str) -> int:
        i = self._ns_ids.get(ns)
        if i is not None:
            return i
        pinned = ns in self.pinned
        if self._ns_spare:
            i = self._ns_spare.pop()
            self._ns_names[i] = ns
            self._ns_live[i] = 0
            self._ns_pinned[i] = pinned
            self.new_salt(i)
        else:
            i = len(self._ns_names)
            self._ns_names.append(ns)
            self._ns_live.append(0)
            self._ns_pinned.append(pinned)
            self.new_salt(i)
        self._ns_ids[ns] = i
        return i

    def _unindex(self, s: int) -> None:
        if self.shared is not None:
            self.shared.withdraw(s)
        self.index_delete(s)
        nsid = self.nsid[s]
        self._ns_live[nsid] -= 1
        if self._ns_live[nsid] == 0:  # retire the id: namespaces cannot pile up
            del self._ns_ids[self._ns_names[nsid]]
            self._ns_names[nsid] = ""
            self._ns_spare.append(nsid)

    def _link(self, s: int) -> None:
        """Append a ready, unpinned slot at the most recently used end of its list."""
        x = self.lst[s]
        if not x & 1:
            self.slab_evictable[self.off[s] // self.slab_size] += 1
        self._tick = tick = self._tick + 1
        self.tick[s] = tick
        tail = self._tail
        p = tail[x]
        self.prev[s] = p
        self.next[s] = -1
        if p >= 0:
            self.next[p] = s
        else:
            self._head[x] = s
        tail[x] = s

    def _unlink(self, s: int) -> None:
        x = self.lst[s]
        if not x & 1:
            self.slab_evictable[self.off[s] // self.slab_size] -= 1
        nxt, prv = self.next, self.prev
        p = prv[s]
        n = nxt[s]
        if p >= 0:
            nxt[p] = n
        else:
            self._head[x] = n
        if n >= 0:
            prv[n] = p
        else:
            self._tail[x] = p

    def _walk(self, x: int) -> Iterator[tuple[int, int]]:
        s = self._head[x]
        tick, nxt = self.tick, self.next
        while s >= 0:
            yield tick[s], s
            s = nxt[s]

    # ---- internals: slots and slabs ------------------------------------------

    def _drop(self, s: int) -> None:
        """Take a ready block out of the index and LRU; free now or on the last release."""
        self._unindex(s)
        self.keys -= 1
        sh = self.shared
        if sh is not None and sh.hazarded(s, self.gen[s]):
            # A same-host client pinned it through the index before the withdrawal:
            # the tier holds it (a pin of its own) until the client lets go.
            if not self.pins[s]:
                self._unlink(s)
            self.pins[s] += 1
            sh.hold(self._handle(s, "", b""))
        if self.pins[s]:
            self.state[s] = DOOMED
        else:
            self._unlink(s)
            self._free(s)

    def _evict(self, s: int) -> None:
        sh = self.shared
        if sh is not None and sh.hazarded(s, self.gen[s]):
            # Pinned by a same-host client through the index: kept like a reader's
            # pin (off the LRU) until the client lets go; the caller looks further.
            self._unlink(s)
            self.pins[s] = 1
            sh.hold(self._handle(s))
            return
        if self._on_evict is not None:
            self._on_evict(self._handle(s))
        self._drop(s)
        self.counters.evictions += 1

    def _alloc(self, c: int) -> int:
        while True:  # each round frees a slot or a slab, or raises
            s = self._take(c)
            if s >= 0:
                return s
            self._make_room(c)

    def _make_room(self, c: int) -> None:
        """Free a slot of class ``c``, or a slab it can take (ResourceExhausted if none
        can be: every block that could make room is pinned or being written)."""
        if self.shared is not None:  # same-host reads count in the LRU before anything goes
            self.apply_reads(self.shared.drain(ROOM_READS))  # bounded, whatever is logged
        if self.free_slabs:
            self._assign(self.free_slabs.pop(), c)
        elif self.empty_slabs:  # an emptied slab of another class: no eviction
            slab = self.empty_slabs.pop()
            self._unassign(slab)
            self._assign(slab, c)
            self.counters.slab_moves += 1
        else:
            own = self._head[2 * c]
            donor = -1
            for o in self._active:  # the oldest evictable head among other classes
                h = self._head[2 * o]
                if o == c or h < 0 or (donor >= 0 and self.tick[h] >= self.tick[donor]):
                    continue
                if self._movable(self.off[h] // self.slab_size):
                    donor = h
            if donor >= 0 and (own < 0 or self.tick[donor] < self.tick[own]):
                self._move(self.off[donor] // self.slab_size, c)
            elif own >= 0:
                self._evict(own)
            else:
                slab = self._any_movable_slab(c)
                if slab < 0 and self.shared is not None and self.shared.reap(self.release):
                    return  # slots clients let go of since the last upkeep: try again
                if slab < 0:
                    raise ResourceExhausted(
                        f"no free {self.class_sizes[c]}-byte slot: every block that could "
                        "make room is pinned or being written"
                    )
                self._move(slab, c)

    def _move(self, slab: int, to: int) -> None:
        """Evict every block of a movable slab and give the slab to class ``to``."""
        ids = self._slab_ids[slab]
        assert ids is not None
        for s in ids.tolist():
            if self.state[s] == READY:
                self._evict(s)
        if self.slab_nfree[slab] != self.slab_nslots[slab]:
            return  # a client holds a block of it (tiers.shared): the slab stays
        self._unassign(slab)
        self._assign(slab, to)
        self.counters.slab_moves += 1
