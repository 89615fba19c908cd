"""Flat per-slot arrays and the (namespace, key) -> slot hash table of the DRAM tier.

Everything the DRAM tier knows about a slot lives in typed arrays indexed by a
slot id (an int32), so a stored block costs about 80 bytes of heap instead of a
Python object, a dict entry and an LRU node (~490 bytes). The arrays grow as
slabs are carved into slots, never for the whole arena up front; ids of a slab
that leaves its size class are kept as spares for the next slab carved.

The index is an open-addressing hash table (linear probing, backward-shift
deletion, load at most 0.7) of slot ids; the keys live in the slot arrays. A
slot's 32-bit hash is the high half of Python's own ``hash()`` of the key bytes
(SipHash, keyed at random per process unless PYTHONHASHSEED pins it, so clients
cannot choose colliding keys; bytes cache it) xor a random salt per namespace.
Only this process's table uses it. Scalar lookups run in Python;
:meth:`SlotIndex.find_many` probes a whole batch with numpy.

Pure bookkeeping, no I/O, not thread-safe (the store serialises calls).
"""

from __future__ import annotations

import secrets
import struct
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvstore_client.keys import split_hashes

# Slot states. A zero-filled array reads as UNUSED.
UNUSED = 0  # id not in any slab
FREE = 1  # in a slab's free list
PENDING = 2  # reserved, bytes being written; indexed, not visible
READY = 3  # committed and visible; indexed
DOOMED = 4  # removed or evicted while pinned; freed on the last release

M64 = (1 << 64) - 1
U32 = (1 << 32) - 1
KEY = struct.Struct("<QQ")
MIN_TABLE_BITS = 10
MAX_LOAD = 0.7
VECTOR_ROUNDS = 3  # find_many probes this many positions per key with numpy
WINDOW = 16  # find_packed gathers this many table positions per key at once
_STEPS = np.arange(WINDOW, dtype=np.int64)

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]


class SlotIndex:
    """Per-slot arrays (one entry per slot id) and the key -> slot id hash table.

    A subclass (the DRAM tier) decides what the slots mean; this class only
    stores them, hands out ids and finds keys.
    """

    def __init__(self) -> None:
        self.kb = bytearray()  # key bytes, 16 per slot
        self.nsid = array("I")  # interned namespace id
        self.h32 = array("I")  # high 32 bits of the key's hash (table home, quick compare)
        self.size = array("I")  # payload bytes
        self.csum = array("Q")  # xxh3-64 of the payload
        self.pins = array("I")  # readers and other holders
        self.state = bytearray()  # UNUSED / FREE / PENDING / READY / DOOMED
        self.lst = bytearray()  # which LRU list the slot joins when ready and unpinned
        self.gen = array("I")  # bumped when the slot is freed: stale handles do nothing
        self.prev = array("i")  # LRU list links (free list: next only)
        self.next = array("i")
        self.tick = array("Q")  # last use, for LRU order across size classes
        self.off = array("Q")  # arena offset
        self.tag = array("I")  # caller's small integer (session tag)
        self.nslots = 0
        self._spare = array("i")  # ids not in any slab, reused first
        self.ns_salt: list[int] = []  # per namespace id, set by new_salt()
        self._set_table(array("i", [-1]) * (1 << MIN_TABLE_BITS), MIN_TABLE_BITS)
        self.indexed = 0

    # ---- slot ids ------------------------------------------------------------

    def take_ids(self, n: int) -> array[int]:
        """``n`` unused slot ids (spares first, then new ones at the end of the arrays)."""
        spare = self._spare
        k = min(n, len(spare))
        ids = spare[len(spare) - k :]
        del spare[len(spare) - k :]
        if n > k:
            start = self.nslots
            self._grow(n - k)
            ids.extend(range(start, start + n - k))
        return ids

    def give_ids(self, ids: array[int]) -> None:
        """Return ids (already marked UNUSED) for the next :meth:`take_ids`."""
        self._spare.extend(ids)

    def _grow(self, n: int) -> None:
        for a in (self.nsid, self.h32, self.size, self.pins, self.gen, self.tag):
            a.frombytes(bytes(4 * n))
        for a in (self.csum, self.tick, self.off):
            a.frombytes(bytes(8 * n))
        self.kb.extend(bytes(16 * n))
        self.prev.frombytes(bytes(4 * n))
        self.next.frombytes(bytes(4 * n))
        self.state.extend(bytes(n))
        self.lst.extend(bytes(n))
        self.nslots += n

    def heap_bytes(self) -> int:
        """Bytes held by the arrays and the table (allocated, including slack)."""
        arrays = [self.nsid, self.h32, self.size, self.csum, self.pins, self.gen]
        arrays += [self.prev, self.next, self.tick, self.off, self.tag, self._spare, self.table]
        return (
            sum(a.buffer_info()[1] * a.itemsize for a in arrays)
            + 2 * len(self.state)
            + len(self.kb)
        )

    # ---- hashing -------------------------------------------------------------

    def new_salt(self, nsid: int) -> None:
        """Draw the hash salt of a namespace id (new, or reused with no slot left)."""
        while len(self.ns_salt) <= nsid:
            self.ns_salt.append(0)
        self.ns_salt[nsid] = secrets.randbits(32)

    def hash32(self, nsid: int, key: bytes) -> int:
        return ((hash(key) >> 32) ^ self.ns_salt[nsid]) & U32

    def _set_table(self, table: array[int], bits: int) -> None:
        self.table = table
        self._bits = bits
        self._tmask = (1 << bits) - 1
        self._tshift = 32 - bits
        self._tcap = int((1 << bits) * MAX_LOAD)

    # ---- scalar lookups ------------------------------------------------------

    def find(self, nsid: int, key: bytes) -> int:
        """The indexed (pending or ready) slot of a 16-byte key, or -1."""
        h = ((hash(key) >> 32) ^ self.ns_salt[nsid]) & U32
        t = self.table
        mask = self._tmask
        i = h >> self._tshift
        h32 = self.h32
        while True:
            s = t[i]
            if s < 0:
                return -1
            if h32[s] == h and self.kb[16 * s : 16 * s + 16] == key and self.nsid[s] == nsid:
                return s
            i = (i + 1) & mask

    def index_insert(self, s: int) -> None:
        """Add slot ``s`` (key, namespace and h32 already set) to the table."""
        t = self.table
        mask = self._tmask
        i = self.h32[s] >> self._tshift
        while t[i] >= 0:
            i = (i + 1) & mask
        t[i] = s
        self.indexed += 1
        if self.indexed > self._tcap:
            self._rebuild(self._bits + 1)

    def index_delete(self, s: int) -> None:
        """Take slot ``s`` out of the table (backward-shift deletion, no tombstones)."""
        t = self.table
        mask = self._tmask
        shift = self._tshift
        h32 = self.h32
        i = h32[s] >> shift
        while t[i] != s:
            if t[i] < 0:
                raise KeyError(f"slot {s} is not indexed")
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            o = t[j]
            if o < 0:
                break
            home = h32[o] >> shift
            # o may move back to the hole at i unless its home lies cyclically in (i, j].
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                t[i] = o
                i = j
        t[i] = -1
        self.indexed -= 1

    def _rebuild(self, bits: int) -> None:
        """Rehash every indexed slot into a table of 2**bits entries (vectorised)."""
        st = np.frombuffer(self.state, dtype=np.uint8)
        ids = np.flatnonzero((st == PENDING) | (st == READY)).astype(np.int64)
        mask = (1 << bits) - 1
        pos = np.frombuffer(self.h32, dtype=np.uint32)[ids].astype(np.int64) >> (32 - bits)
        table = np.full(1 << bits, -1, dtype=np.int32)
        # Place in rounds: every key whose probe position is empty tries it (one wins
        # per position), the others move one step on. Slots are never emptied, so each
        # key ends at the first free position of its probe run, as linear probing needs.
        while ids.size:
            cand = np.flatnonzero(table[pos] < 0)
            table[pos[cand]] = ids[cand]
            won = np.zeros(ids.size, dtype=bool)
            won[cand] = table[pos[cand]] == ids[cand]
            ids = ids[~won]
            pos = (pos[~won] + 1) & mask
        new = array("i")
        new.frombytes(table.tobytes())
        self._set_table(new, bits)

    # ---- batch lookups -------------------------------------------------------

    def find_many(self, nsid: int, keys: list[bytes]) -> I64:
        """Slot ids (or -1) of many keys of one namespace, probed with numpy."""
        n = len(keys)
        buf = b"".join(keys)
        if len(buf) != 16 * n:
            return np.array([self.find(nsid, k) if len(k) == 16 else -1 for k in keys], np.int64)
        q = np.frombuffer(buf, dtype="<u8").reshape(n, 2).astype(np.uint64)
        lo, hi = q[:, 0], q[:, 1]
        try:
            hs = [hash(k) for k in keys]
        except (TypeError, ValueError):  # bytearray or writable memoryview keys
            keys = [bytes(k) for k in keys]
            hs = [hash(k) for k in keys]
        h = ((np.array(hs, dtype=np.int64) >> 32) ^ self.ns_salt[nsid]) & U32
        pos = h >> self._tshift
        out = np.full(n, -1, dtype=np.int64)
        table = np.frombuffer(self.table, dtype=np.int32)
        kw = np.frombuffer(self.kb, dtype="<u8")
        h32 = np.frombuffer(self.h32, dtype=np.uint32)
        ns = np.frombuffer(self.nsid, dtype=np.uint32)
        idx = np.arange(n)
        mask = self._tmask
        for _ in range(VECTOR_ROUNDS):  # most keys resolve at or next to their home
            s = table[pos].astype(np.int64)
            live = s >= 0
            idx, pos, s = idx[live], pos[live], s[live]
            m = (h32[s] == h[idx]) & (kw[2 * s] == lo[idx]) & (kw[2 * s + 1] == hi[idx])
            m &= ns[s] == nsid
            out[idx[m]] = s[m]
            idx, pos = idx[~m], (pos[~m] + 1) & mask
            if not idx.size:
                break
        for i in idx.tolist():  # the few on longer probe runs: cheaper one by one
            out[i] = self.find(nsid, keys[i])
        return out

    def find_packed(self, nsid: int, packed: bytes | memoryview, keys: Sequence[bytes]) -> I64:
        """Like :meth:`find_many` for ``keys`` given also as their packed 16*N bytes,
        in one pass: each key's next WINDOW table positions are gathered at once, the
        first whose 32-bit hash matches before an empty position is checked in full,
        and only keys whose probe run is longer than the window (or that meet another
        key with the same 32-bit hash first) are probed one by one.

        Exact: by linear probing a key lies between its home and the first empty
        position, so a key with no match before an empty position is absent.
        """
        n = len(keys)
        h32 = np.frombuffer(self.h32, dtype=np.uint32)
        if n == 0 or not len(h32):
            return np.full(n, -1, dtype=np.int64)
        hs = np.fromiter(map(hash, keys), dtype=np.int64, count=n)
        h = (hs >> 32).astype(np.uint32) ^ np.uint32(self.ns_salt[nsid])
        win = (h >> np.uint32(self._tshift)).astype(np.int64)[:, None] + _STEPS
        win &= self._tmask
        # np.take rather than fancy indexing: a fraction of the cost for these gathers.
        s = np.take(np.frombuffer(self.table, dtype=np.int32), win)
        live: npt.NDArray[np.bool_] = s >= 0
        cand = np.take(h32, s) == h[:, None]  # s = -1 reads the last slot's: masked next
        cand &= live
        first = cand.argmax(axis=1)
        rows = np.flatnonzero(np.take_along_axis(cand, first[:, None], axis=1)[:, 0])
        slot = np.take_along_axis(s[rows], first[rows, None], axis=1)[:, 0].astype(np.int64)
        q = np.frombuffer(packed, dtype="<u8").reshape(-1, 2)
        kw = np.frombuffer(self.kb, dtype="<u8").reshape(-1, 2)
        got = np.take(kw, slot, axis=0)
        good: npt.NDArray[np.bool_] = got[:, 0] == q[rows, 0]
        good &= got[:, 1] == q[rows, 1]
        good &= np.take(np.frombuffer(self.nsid, dtype=np.uint32), slot) == nsid
        out = np.full(n, -1, dtype=np.int64)
        out[rows[good]] = slot[good]
        # Unsure: no candidate and no empty position in the window (a probe run longer
        # than the window), or a first candidate that was another key (32-bit hash tie,
        # or one after an empty position: then absent, but the scalar probe says so).
        unsure: npt.NDArray[np.bool_] = np.asarray(live.all(axis=1))
        unsure[rows] = ~good
        for i in np.flatnonzero(unsure).tolist():
            out[i] = self.find(nsid, keys[i])
        return out

    def slots_where(self, nsid: int | None, state: int) -> I64:
        """Slot ids in ``state`` (of namespace ``nsid`` unless None), ascending."""
        mask = np.frombuffer(self.state, dtype=np.uint8) == state
        if nsid is not None:
            mask &= np.frombuffer(self.nsid, dtype=np.uint32) == nsid
        return np.flatnonzero(mask)

    def keys_at(self, ids: I64) -> list[bytes]:
        return split_hashes(np.frombuffer(self.kb, dtype=np.uint8).reshape(-1, 16)[ids].tobytes())
