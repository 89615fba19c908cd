"""The writer side of the same-host index: the DRAM tier's ready blocks mirrored in a
sealed memfd that same-host clients map read-only, and the clients' hazard pages.

Layout, hashing and the client's half: :mod:`kvstore_client.transport.shmindex`.
The DRAM tier calls :meth:`SharedIndex.publish` when a block becomes ready and
:meth:`SharedIndex.withdraw` when it leaves the index; before it frees a withdrawn
slot it asks :meth:`SharedIndex.hazarded` (after the withdrawal's fence), and holds
a hazarded slot (a pin of its own) until :meth:`SharedIndex.reap` finds no client
page naming it any more. Bookkeeping over memory; the caller serialises the tier
calls with the store lock. Client pages come and go from the hand-over thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import atomicshm
import numpy as np

from kvstore_client.transport.shmindex import (
    ENTRY,
    FLAG_ASK_LOOKUPS,
    FLAG_SSD,
    FLAGS_AT,
    HAZ_AT,
    HEADER,
    MAGIC,
    NHAZ,
    NRING,
    PAGE_BYTES,
    RING_AT,
    VERSION,
    WAYS,
    bucket_of,
    hazard_word,
    index_bytes,
    ns_tag,
    regions,
)

log = logging.getLogger(__name__)

KEY = struct.Struct("<QQ")
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1: no new writable mappings, ours stays
# Buckets for this many bytes of arena each (two such blocks per 8-way bucket): smaller
# blocks overflow buckets, whose extra keys clients then ask the worker for.
BYTES_PER_BUCKET = 128 << 10
MIN_BUCKETS = 256


@dataclass(slots=True)
class _Page:
    """One client's hazard page as the worker sees it."""

    mm: mmap.mmap
    fd: int
    atomic: Any
    haz: np.ndarray
    ring: np.ndarray
    tail: int = 0


class SharedIndex:
    """The index memfd (written here, read-only elsewhere) and the hazard pages."""

    def __init__(self, capacity: int, tag: int, *, ssd: bool) -> None:
        nb = MIN_BUCKETS
        while nb * BYTES_PER_BUCKET < capacity:
            nb *= 2
        self.nbuckets = nb
        self.bits = nb.bit_length() - 1
        self.seed = secrets.randbits(63)
        self.size = index_bytes(nb)
        self.fd = os.memfd_create("kvstore-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE)
            except OSError:  # an older kernel: the read-only descriptor still holds
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            # What clients get: a read-only open of the same memory.
            self.ro_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.fd)
            raise
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, WAYS, nb, self.seed, tag, FLAG_SSD * ssd)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        keys, entries, over = regions(nb)
        self.lx = raw[keys].view("<u8")
        self._entries_at = entries.start
        self.flat = raw[entries].view(ENTRY)
        self.live = self.flat["live"]
        self.overflow = raw[over].view("<u4")
        self._atomic = atomicshm.AtomicView(self._mm)
        self._where: dict[int, int] = {}  # slot -> entry position, or -(bucket + 1)
        self._tags: dict[str, int] = {}
        self.pages: dict[int, _Page] = {}  # replaced whole (copy on write), never mutated
        # drain and drop_client read the pages' logs under it (different threads); reads
        # a closed client logged since the last drain wait here for the next drain
        self._logs = threading.Lock()
        self._left: list[tuple[int, int]] = []
        self._next_client = 1
        self.held: list[Any] = []  # Blocks the tier holds for hazards
        self.published = 0

    # ---- the index -------------------------------------------------------------

    def tag(self, ns: str) -> int:
        t = self._tags.get(ns)
        if t is None:
            if len(self._tags) > 65536:
                self._tags.clear()
            t = self._tags[ns] = ns_tag(ns, self.seed)
        return t

    def publish(
        self, slot: int, gen: int, ns: str, key: bytes, off: int, size: int, csum: int
    ) -> None:
        """Mirror a block that just became ready (a full bucket counts an overflow)."""
        lo, hi = KEY.unpack(key)
        t = self.tag(ns)
        lx = lo ^ t
        b = bucket_of(lx, self.bits)
        ways = self.live[b * WAYS : (b + 1) * WAYS]
        free = np.flatnonzero(ways == 0)
        if not len(free):
            self.overflow[b] += 1
            self._where[slot] = -(b + 1)
            return
        p = b * WAYS + int(free[0])
        at = self._entries_at + p * ENTRY.itemsize
        e = self.flat[p]
        seq = int(e["seq"])
        self._atomic.store_u32(at, (seq + 1) & 0xFFFFFFFF)  # odd: being written
        self.flat[p] = (seq + 1, gen, lx, hi, t, off, size, slot, csum, 1)
        self._atomic.store_u32(at, (seq + 2) & 0xFFFFFFFF, atomicshm.RELEASE)
        self.lx[p] = lx  # findable from now on (the entry is complete)
        self._where[slot] = p
        self.published += 1

    def withdraw(self, slot: int) -> None:
        """Take a block out of the mirror, then fence: a client that pins it after
        this sees the change on its re-check; one that pinned before is seen by
        :meth:`hazarded`."""
        p = self._where.pop(slot, None)
        if p is None:
            return
        if p < 0:
            self.overflow[-p - 1] -= 1
            return
        at = self._entries_at + p * ENTRY.itemsize
        seq = int(self.flat[p]["seq"])
        self._atomic.store_u32(at, (seq + 1) & 0xFFFFFFFF)
        self.live[p] = 0
        self.lx[p] = 0
        self._atomic.store_u32(at, (seq + 2) & 0xFFFFFFFF)
        self.published -= 1
        atomicshm.fence(atomicshm.SEQ_CST)

    def ask_lookups(self, on: bool) -> None:
        """Have clients send lookups to the worker (while sessions are paused: a lookup
        may resume one there) or answer them from the index."""
        old = self._atomic.load_u32(FLAGS_AT)
        new = old | FLAG_ASK_LOOKUPS if on else old & ~FLAG_ASK_LOOKUPS
        if new != old:
            self._atomic.store_u32(FLAGS_AT, new)

    # ---- hazards ---------------------------------------------------------------

    def hazarded(self, slot: int, gen: int) -> bool:
        """Whether some client's page names this slot generation (call after
        :meth:`withdraw`)."""
        w = np.uint64(hazard_word(slot, gen))
        for page in self.pages.values():
            n = min(page.atomic.load_u64(0), NHAZ)
            if n and bool((page.haz[:n] == w).any()):
                return True
        return False

    def hold(self, block: Any) -> None:
        """Keep ``block`` (pinned by the tier) until no page names it."""
        self.held.append(block)

    def reap(self, release: Callable[[Any], None]) -> int:
        """Release the held blocks no page names any more; returns how many."""
        if not self.held:
            return 0
        words = [p.haz[: min(p.atomic.load_u64(0), NHAZ)] for p in self.pages.values()]
        named = np.unique(np.concatenate(words)) if words else np.empty(0, np.uint64)
        keep = []
        gone = 0
        for b in self.held:
            w = np.uint64(hazard_word(b.slot, b.gen))
            i = int(np.searchsorted(named, w))
            if i < len(named) and named[i] == w:
                keep.append(b)
            else:
                release(b)
                gone += 1
        self.held = keep
        return gone

    def drain(self) -> list[tuple[int, int]]:
        """(slot, gen) of the reads clients logged since the last drain (the newest
        NRING of each page), those of clients closed since included; (-1, n) for n
        misses."""
        with self._logs:
            out, self._left = self._left, []
            for page in self.pages.values():
                _read_log(page, out)
        return out

    # ---- clients ---------------------------------------------------------------

    def add_client(self) -> tuple[int, int]:
        """A new hazard page: (client id, its descriptor to hand over)."""
        fd = os.memfd_create("kvstore-hazards", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            mm = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        raw = np.frombuffer(mm, dtype=np.uint8)
        page = _Page(
            mm,
            fd,
            atomicshm.AtomicView(mm),
            raw[HAZ_AT:RING_AT].view("<u8"),
            raw[RING_AT : RING_AT + 8 * NRING].view("<u8"),
        )
        cid = self._next_client
        self._next_client += 1
        self.pages = {**self.pages, cid: page}
        return cid, fd

    def drop_client(self, cid: int) -> None:
        """The client's connection closed: its page (and so its hazards) goes; held
        slots it named are released by the next :meth:`reap`."""
        with self._logs:
            pages = dict(self.pages)
            page = pages.pop(cid, None)
            self.pages = pages
            if page is not None:  # the reads it logged still count (at the next drain)
                _read_log(page, self._left)
                del self._left[: max(0, len(self._left) - 4 * NRING)]  # bounded
        if page is not None:
            with contextlib.suppress(OSError):
                os.close(page.fd)

    def close(self) -> None:
        for cid in list(self.pages):
            self.drop_client(cid)
        for fd in (self.ro_fd, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_log(page: _Page, out: list[tuple[int, int]]) -> None:
    """Append (slot, gen) of the reads ``page``'s client logged since the last read of
    its log (the newest NRING); (-1, n) for n misses."""
    head = page.atomic.load_u64(8, atomicshm.ACQUIRE)
    if head == page.tail:
        return
    if head < page.tail or head - page.tail > NRING:  # scribbled, or lapped
        page.tail = max(0, head - NRING) if head >= NRING else 0
    for i in range(page.tail, head):
        w = int(page.ring[i % NRING])
        out.append(((w >> 32) - 1, w & 0xFFFFFFFF))  # slot -1: that many misses
    page.tail = head
