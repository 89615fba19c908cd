"""The writer side of the same-host index: the DRAM tier's ready blocks mirrored in a
sealed memfd that same-host clients map read-only, and the clients' hazard pages.

Layout, hashing and the client's half: :mod:`kvstore_client.transport.shmindex`.
The DRAM tier calls :meth:`SharedIndex.publish` when a block becomes ready and
:meth:`SharedIndex.withdraw` when it leaves the index; before it frees a withdrawn
slot it asks :meth:`SharedIndex.hazarded` (after the withdrawal's fence), and holds
a hazarded slot (a pin of its own) until :meth:`SharedIndex.reap` finds no client
page naming it any more. Bookkeeping over memory; the caller serialises the tier
calls with the store lock. Client pages come and go from the hand-over thread.

Bounds (a client writes its page as it likes, so nothing here may cost more because
of what it wrote): each page belongs to one client identity and may hold at most its
``budget`` bytes of withdrawn slots; a page found naming more is *revoked*: its words
are ignored from then on (the client library never goes over it, so only a hostile or
broken client is revoked, and it loses only its own pins; its copies are still
verified in its own buffers). The upkeep's log drain reads at most ``limit`` entries
per call, round robin over the pages, and its reap scans pages outside the store lock
(:meth:`SharedIndex.reap_plan`), then releases under it.
"""

from __future__ import annotations

import contextlib
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

from ..arena import seal

log = logging.getLogger(__name__)

KEY = struct.Struct("<QQ")
# An index entry after its seq word (the ENTRY layout: gen, lx, hi, ns, off, size,
# slot, sum, live), and the live words of one bucket's WAYS entries: written and read
# with struct on the mapping (a numpy scalar access per field cost ~16 us a publish).
BODY = struct.Struct("<IQQQQIIQQ")
LIVE_WAYS = struct.Struct("<" + "56xQ" * WAYS)
WORD = struct.Struct("<Q")
LIVE_AT = 56  # the live word's offset in an entry
assert BODY.size == ENTRY.itemsize - 4 and ENTRY.fields is not None
assert ENTRY.fields["gen"][1] == 4 and ENTRY.fields["live"][1] == LIVE_AT
# Buckets for this many bytes of arena each (two such blocks per 8-way bucket): smaller
# blocks overflow buckets, whose extra keys clients then ask the worker for.
BYTES_PER_BUCKET = 128 << 10
MIN_BUCKETS = 256


@dataclass(slots=True)
class _Page:
    """One client's hazard page as the worker sees it."""

    mm: mmap.mmap
    atomic: Any
    haz: np.ndarray
    ring: np.ndarray
    identity: bytes  # the client's (kvstore_client.security), b"" if it gave none
    budget: int  # bytes of withdrawn slots its words may hold
    tail: int = 0
    revoked: bool = False  # named more than its budget: its words are ignored

    def words(self) -> np.ndarray:
        """The hazard words in use (the client's high-water count, at most NHAZ)."""
        if self.revoked:
            return _NONE
        n = min(int(self.atomic.load_u64(0, atomicshm.ACQUIRE)), NHAZ)
        return self.haz[:n]


_NONE = np.empty(0, np.uint64)


@dataclass(slots=True)
class ReapPlan:
    """What a reap found, outside the store lock: of the held blocks it looked at
    (``blocks``), which no live page names (``free``), the pages it revoked, and the
    bytes each client identity's live pages hold."""

    blocks: list[Any]
    free: np.ndarray  # bool per block
    revoked: list[int]
    held: dict[bytes, int]


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
            # Only the worker may write the index: a client that could would point a key
            # at another block's slot and checksum. Not handed over unless this holds.
            self.sealed = seal(self.fd, mmap.PAGESIZE)
            # What clients get: a read-only open of the same memory.
            self.ro_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.fd)
            raise
        HEADER.pack_into(self._mm, 0, MAGIC, VERSION, WAYS, nb, self.seed, tag, FLAG_SSD * ssd)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        keys, entries, over = regions(nb)
        self._keys_at = keys.start
        self._entries_at = entries.start
        self.overflow = raw[over].view("<u4")
        self._atomic = atomicshm.AtomicView(self._mm)
        # Per slot id: 0 (not mirrored), its entry's position + 1, or -(bucket + 1) when
        # it overflowed its bucket. An array, 8 bytes a slot (a dict cost ~120 B a block).
        self._where = np.zeros(1024, dtype=np.int64)
        self._tags: dict[str, int] = {}
        self.pages: dict[int, _Page] = {}  # replaced whole (copy on write), never mutated
        # drain and drop_client read the pages' logs under it (different threads); reads
        # a closed client logged since the last drain wait here for the next drain
        self._logs = threading.Lock()
        self._left: list[tuple[int, int]] = []
        self._next_client = 1
        self._turn = 0  # the page the next bounded drain starts at (round robin)
        self.held: list[Any] = []  # Blocks the tier holds for hazards
        self.published = 0
        self.revoked = 0  # pages revoked for naming more than their budget

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
        first = self._entries_at + b * WAYS * ENTRY.itemsize
        live = LIVE_WAYS.unpack_from(self._mm, first)
        if slot >= len(self._where):
            grown = np.zeros(max(2 * len(self._where), slot + 1), dtype=np.int64)
            grown[: len(self._where)] = self._where
            self._where = grown
        if 0 not in live:
            self.overflow[b] += 1
            self._where[slot] = -(b + 1)
            return
        way = live.index(0)
        p = b * WAYS + way
        at = first + way * ENTRY.itemsize
        atomic = self._atomic
        seq = atomic.load_u32(at)
        atomic.store_u32(at, (seq + 1) & 0xFFFFFFFF)  # odd: being written
        BODY.pack_into(self._mm, at + 4, gen, lx, hi, t, off, size, slot, csum, 1)
        atomic.store_u32(at, (seq + 2) & 0xFFFFFFFF, atomicshm.RELEASE)
        WORD.pack_into(self._mm, self._keys_at + 8 * p, lx)  # findable from now on
        self._where[slot] = p + 1
        self.published += 1

    def withdraw(self, slot: int) -> None:
        """Take a block out of the mirror, then fence: a client that pins it after
        this sees the change on its re-check; one that pinned before is seen by
        :meth:`hazarded`."""
        if slot >= len(self._where):
            return
        w = int(self._where[slot])
        if not w:
            return
        self._where[slot] = 0
        if w < 0:
            self.overflow[-w - 1] -= 1
            return
        p = w - 1
        at = self._entries_at + p * ENTRY.itemsize
        atomic = self._atomic
        seq = atomic.load_u32(at)
        atomic.store_u32(at, (seq + 1) & 0xFFFFFFFF)
        WORD.pack_into(self._mm, at + LIVE_AT, 0)
        WORD.pack_into(self._mm, self._keys_at + 8 * p, 0)
        atomic.store_u32(at, (seq + 2) & 0xFFFFFFFF)
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
        """Whether some client's live page names this slot generation (call after
        :meth:`withdraw`). One compare per word in use per page: a client that keeps
        few words costs little; a page costs at most NHAZ words."""
        w = np.uint64(hazard_word(slot, gen))
        for page in self.pages.values():
            words = page.words()
            if len(words) and bool((words == w).any()):
                return True
        return False

    def hold(self, block: Any) -> None:
        """Keep ``block`` (pinned by the tier) until no page names it."""
        self.held.append(block)

    def reap_plan(
        self, blocks: list[Any], elsewhere: Callable[[bytes], int] | None = None
    ) -> ReapPlan:
        """Which of ``blocks`` (held blocks, a snapshot taken under the store lock) no
        live page names any more; revokes the pages that name more than their budget
        less what their client holds ``elsewhere`` (its connections' pins, by
        identity). Needs no store lock: the blocks were withdrawn before they were
        held, so a client that names one now did not pin it (its re-check failed)."""
        if not blocks:
            return ReapPlan(blocks, np.zeros(0, dtype=bool), [], {})
        held = np.array([hazard_word(b.slot, b.gen) for b in blocks], dtype=np.uint64)
        sizes = np.array([b.size for b in blocks], dtype=np.int64)
        named = np.zeros(len(blocks), dtype=bool)
        revoked: list[int] = []
        by_client: dict[bytes, int] = {}
        for cid, page in list(self.pages.items()):
            words = page.words()
            if not len(words):
                continue
            mine = np.isin(held, words)
            nbytes = int(sizes[mine].sum())
            if not nbytes:
                continue
            other = elsewhere(page.identity) if elsewhere is not None and page.identity else 0
            if by_client.get(page.identity, 0) + nbytes + other > page.budget:
                page.revoked = True  # ignored from now on (see the module docstring)
                revoked.append(cid)
                continue
            by_client[page.identity] = by_client.get(page.identity, 0) + nbytes
            named |= mine
        if revoked:
            self.revoked += len(revoked)
            log.warning(
                "same-host index: %d client page(s) named more than their budget of held "
                "slots and were revoked (their pins no longer hold)",
                len(revoked),
            )
        return ReapPlan(blocks, ~named, revoked, by_client)

    def reap_apply(self, plan: ReapPlan, release: Callable[[Any], None]) -> int:
        """Release what :meth:`reap_plan` found free (under the store lock); returns how
        many. Blocks held since the plan was made stay for the next one."""
        if not plan.blocks:
            return 0
        free = {id(b) for b, f in zip(plan.blocks, plan.free.tolist(), strict=True) if f}
        keep = []
        for b in self.held:
            if id(b) in free:
                release(b)
            else:
                keep.append(b)
        gone = len(self.held) - len(keep)
        self.held = keep
        return gone

    def reap(self, release: Callable[[Any], None]) -> int:
        """Release the held blocks no live page names any more; returns how many."""
        return self.reap_apply(self.reap_plan(list(self.held)), release)

    def drain(self, limit: int = 1 << 14) -> list[tuple[int, int]]:
        """(slot, gen) of the reads clients logged since the last drain, those of
        clients closed since included; (-1, n) for n misses. At most about ``limit``
        entries, taken round robin from the pages (each keeps its newest NRING): what
        a client logs can never make one drain longer."""
        with self._logs:
            out, self._left = self._left, []
            pages = list(self.pages.values())
            if pages:
                per = max(1, limit // len(pages))
                start = self._turn % len(pages)
                self._turn += 1
                for page in pages[start:] + pages[:start]:
                    if len(out) >= limit:
                        break
                    _read_log(page, out, per)
        return out

    # ---- clients ---------------------------------------------------------------

    def add_client(self, identity: bytes = b"", budget: int = 1 << 62) -> tuple[int, int]:
        """A new hazard page for the client ``identity`` whose words may hold at most
        ``budget`` bytes of withdrawn slots: (client id, its descriptor, which the
        caller hands over and then closes: the worker keeps only the mapping, so no
        other process can reopen the page through /proc)."""
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
            atomicshm.AtomicView(mm),
            raw[HAZ_AT:RING_AT].view("<u8"),
            raw[RING_AT : RING_AT + 8 * NRING].view("<u8"),
            identity,
            budget,
        )
        cid = self._next_client
        self._next_client += 1
        self.pages = {**self.pages, cid: page}
        return cid, fd

    def client_pages(self, identity: bytes) -> int:
        """How many pages the client ``identity`` has now."""
        return sum(p.identity == identity for p in self.pages.values())

    def drop_client(self, cid: int) -> None:
        """The client's connection closed: its page (and so its hazards) goes; held
        slots it named are released by the next :meth:`reap`."""
        with self._logs:
            pages = dict(self.pages)
            page = pages.pop(cid, None)
            self.pages = pages
            if page is not None:  # the reads it logged still count (at the next drain)
                _read_log(page, self._left, NRING)
                del self._left[: max(0, len(self._left) - 4 * NRING)]  # bounded

    def close(self) -> None:
        for cid in list(self.pages):
            self.drop_client(cid)
        for fd in (self.ro_fd, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_log(page: _Page, out: list[tuple[int, int]], limit: int) -> None:
    """Append (slot, gen) of at most ``limit`` of the reads ``page``'s client logged
    since the last read of its log (of the newest NRING: older ones are lost); (-1, n)
    for n misses. The rest wait for the next call."""
    head = int(page.atomic.load_u64(8, atomicshm.ACQUIRE))
    if head == page.tail:
        return
    if head < page.tail or head - page.tail > NRING:  # scribbled, or lapped
        page.tail = max(0, head - NRING) if head >= NRING else 0
    end = min(head, page.tail + limit)
    if end <= page.tail:
        return
    idx = np.arange(page.tail, end, dtype=np.int64) % NRING
    w = page.ring[idx]
    slots = (w >> np.uint64(32)).astype(np.int64) - 1
    gens = (w & np.uint64(0xFFFFFFFF)).astype(np.int64)
    out.extend(zip(slots.tolist(), gens.tolist(), strict=True))  # slot -1: that many misses
    page.tail = end
