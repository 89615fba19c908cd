"""The same-host index: a worker's DRAM index mirrored in shared memory, and the
hazard page through which one client pins slots without a round trip.

A worker that hands its arena to a same-host client (see :mod:`.shm`) hands over two
more descriptors with it:

- **the index** (mapped read-only here; the worker seals it against new writable
  mappings): a header, then ``nbuckets`` buckets of ``WAYS`` entries of 64 bytes, one
  per ready DRAM block: its key, namespace tag, slot id and generation, arena offset,
  size and xxh3-64. Each entry is a seqlock: the worker makes ``seq`` odd, writes,
  makes it even again. A bucket whose ways are all taken counts its extra blocks in
  an overflow word; a key missing from a bucket with overflow (or from a worker with
  an SSD tier) is "unsure" and asked for over the socket.
- **the client's hazard page** (read-write, this client's alone): ``NHAZ`` hazard
  words and a ring of ``NRING`` touched-slot words. To pin slot ``s`` of generation
  ``g`` the client writes ``(s + 1) << 32 | g`` into a hazard word, fences, and
  re-reads the entry: if its ``seq`` is unchanged the block is pinned. The worker
  withdraws an entry (seq bump), fences, and only then checks every hazard page
  before it frees or reuses the slot; a hazarded slot is held until no page names it
  (hazard pointers: one of the two always sees the other). A client that scribbles
  on its page can only hold slots (at most ``NHAZ``) or lose its own pins; the page
  goes away with the client's hand-over connection, so a dead client's pins are
  reclaimed.

Reads through the index are still verified by the reader against the entry's xxh3-64.
Layout and hashing live here, shared by the worker (writer) and clients (readers).
"""

from __future__ import annotations

import mmap
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import atomicshm  # the fences and atomic words of the hazard protocol
import numpy as np
import numpy.typing as npt
import xxhash

MAGIC = 0x31584449564B  # "KVIDX1"
VERSION = 1
WAYS = 8
HEADER = struct.Struct("<QIIQQII")  # magic, version, ways, nbuckets, seed, tag, flags
HEADER_BYTES = 64
FLAGS = struct.Struct("<I")
FLAG_SSD = 1  # the worker has an SSD tier: a DRAM miss is not a miss
FLAG_ASK_LOOKUPS = 2  # lookups (exists, prefix) go to the worker: a session is paused
FLAGS_AT = 36  # byte offset of the header's flags word
MIX = 0x9E3779B97F4A7C15
M64 = (1 << 64) - 1

ENTRY = np.dtype(
    [
        ("seq", "<u4"),
        ("gen", "<u4"),
        ("lx", "<u8"),  # the key's first 8 bytes xor the namespace tag
        ("hi", "<u8"),
        ("ns", "<u8"),
        ("off", "<u8"),
        ("size", "<u4"),
        ("slot", "<u4"),
        ("sum", "<u8"),
        ("live", "<u8"),
    ]
)
# The same entry as eight little-endian 64-bit words (how probes read it).
W_SEQGEN, W_LX, W_HI, W_NS, W_OFF, W_SIZESLOT, W_SUM, W_LIVE = range(8)
assert ENTRY.itemsize == 64

# The hazard page: count (high-water mark of hazard words in use), ring head, then
# NHAZ hazard words, then NRING ring words.
NHAZ = 8192
NRING = 4096
PAGE_HEADER = 64
HAZ_AT = PAGE_HEADER
RING_AT = HAZ_AT + 8 * NHAZ
PAGE_BYTES = RING_AT + 8 * NRING

U64 = npt.NDArray[np.uint64]


def regions(nbuckets: int) -> tuple[slice, slice, slice]:
    """Byte ranges of an index of ``nbuckets`` buckets after its header: the key words
    (per bucket its WAYS ``lx`` words in one 64-byte line, so a probe reads one line
    per key), the entries, and the per-bucket overflow counts."""
    a = HEADER_BYTES
    b = a + nbuckets * WAYS * 8
    c = b + nbuckets * WAYS * ENTRY.itemsize
    return slice(a, b), slice(b, c), slice(c, c + 4 * nbuckets)


def index_bytes(nbuckets: int) -> int:
    """Size of an index of ``nbuckets`` buckets."""
    return int(regions(nbuckets)[2].stop)


def ns_tag(ns: str | bytes, seed: int) -> int:
    """A namespace's 64-bit tag in an index drawn with ``seed`` (never 0)."""
    raw = ns.encode() if isinstance(ns, str) else ns
    return xxhash.xxh3_64_intdigest(raw, seed) | 1


def bucket_of(lx: int, bits: int) -> int:
    """The bucket of a key whose first 8 bytes, read little-endian and xor the
    namespace tag, are ``lx``."""
    return ((lx * MIX) & M64) >> (64 - bits)


def buckets_of(lx: U64, bits: int) -> npt.NDArray[np.int64]:
    """:func:`bucket_of` for many keys at once."""
    mixed = lx * np.uint64(MIX)  # wraps mod 2**64 (numpy warns on overflow of scalars only)
    mixed >>= np.uint64(64 - bits)
    out: npt.NDArray[np.int64] = mixed.view(np.int64)  # below 2**bits: no copy
    return out


def hazard_word(slot: int, gen: int) -> int:
    return ((slot + 1) << 32) | gen


@dataclass(slots=True)
class Probe:
    """What a probe of many keys found: per key ``found`` (a ready entry), ``unsure``
    (not found, but the worker may hold it: ask it), and per key the entry's eight
    words as read (``words``, meaningful where found) with its position (``pos``,
    for the re-check)."""

    found: npt.NDArray[np.bool_]
    unsure: npt.NDArray[np.bool_]
    words: U64
    pos: npt.NDArray[np.int64]
    whole: bool = False  # every key found

    def slots(self, rows: npt.NDArray[np.int64]) -> U64:
        """Hazard words, ``(slot + 1) << 32 | gen``, of the entries at ``rows``."""
        return slot_words(self.words[rows])


def slot_words(w: U64) -> U64:
    """Hazard words, ``(slot + 1) << 32 | gen``, of entries given as rows of words."""
    slot = (w[:, W_SIZESLOT] >> np.uint64(32)) + np.uint64(1)
    out: U64 = (slot << np.uint64(32)) | (w[:, W_SEQGEN] >> np.uint64(32))
    return out


class IndexView:
    """A client's read-only view of a worker's index (see the module docstring)."""

    def __init__(self, fd: int, size: int, tag: int) -> None:
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        magic, version, ways, nbuckets, seed, itag, flags = HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC or version != VERSION or ways != WAYS or itag != tag:
            raise ValueError("not a kvstore index of this arena")
        if nbuckets <= 0 or nbuckets & (nbuckets - 1) or index_bytes(nbuckets) != size:
            raise ValueError("index size does not match its header")
        self.nbuckets = nbuckets
        self.bits = nbuckets.bit_length() - 1
        self.seed = seed
        self.ssd = bool(flags & FLAG_SSD)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        keys, entries, over = regions(nbuckets)
        self.lx: U64 = raw[keys].view("<u8").reshape(nbuckets, WAYS)
        self.words: U64 = raw[entries].view("<u8").reshape(-1, 8)
        self.overflow = raw[over].view("<u4")
        self._tags: dict[bytes, int] = {}

    @property
    def lookups_here(self) -> bool:
        """False while the worker wants lookups itself (a lookup may resume a paused
        session there; reads are unaffected)."""
        flags: int = FLAGS.unpack_from(self._mm, FLAGS_AT)[0]
        return not flags & FLAG_ASK_LOOKUPS

    def tag(self, ns: bytes) -> int:
        t = self._tags.get(ns)
        if t is None:
            t = self._tags[ns] = ns_tag(ns, self.seed)
        return t

    def probe(self, ns: bytes, packed: bytes) -> Probe:
        """Look ``packed`` (16 bytes a key) up: each key's bucket is gathered as one
        word per way (key xor tag), then only the matching way's entry."""
        q = np.frombuffer(packed, dtype="<u8").reshape(-1, 2)
        tag = np.uint64(self.tag(ns))
        lx = q[:, 0] ^ tag
        b = buckets_of(lx, self.bits)
        # np.take of whole rows: about a third of the cost of fancy indexing here.
        m = np.take(self.lx, b, axis=0) == lx[:, None]  # one 64-byte line per key
        way = m.argmax(axis=1)
        pos = b * WAYS + way
        w = np.take(self.words, pos, axis=0)  # and the one entry it points at
        # The entry must be the key's (the rest of the key, the namespace) and live.
        # Its seqlock is checked where it matters, when a read pins it (shmlocal._pin):
        # a lookup racing a change may go either way, as it would over the socket.
        found = w[:, W_LX] == lx  # the matched way (argmax of no match: way 0, checked)
        found &= w[:, W_HI] == q[:, 1]
        found &= w[:, W_NS] == tag
        found &= w[:, W_LIVE] == 1
        whole = bool(found.all())
        if whole:
            unsure = np.zeros(len(b), dtype=bool)
        else:
            unsure = ~found
            if not self.ssd:
                unsure &= self.overflow[b] > 0
        return Probe(found, unsure, w, pos, whole)

    def still(self, probe: Probe, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Which of the entries at ``rows`` are unchanged since the probe read them
        (same seq and generation, still live: the same block)."""
        return self.unchanged(probe.pos[rows], probe.words[rows])

    def unchanged(self, pos: npt.NDArray[np.int64], then: U64) -> npt.NDArray[np.bool_]:
        """Which entries at ``pos`` still hold what ``then`` (their words as a probe
        read them) held: same seq and generation, still live."""
        now = np.take(self.words, pos, axis=0)
        same: npt.NDArray[np.bool_] = (now[:, W_SEQGEN] == then[:, W_SEQGEN]) & (
            now[:, W_LIVE] == 1
        )
        return same


class HazardPage:
    """This client's hazard page (read-write, its own): ranges of hazard words for
    pins, and the ring of touched slots the worker drains (LRU order, hit counts).
    Thread-safe: a lock hands out ranges; each range belongs to one caller.

    ``budget``: bytes of slots the words may hold at once. The worker ignores a page
    found naming more (it revokes it), so ranges past the budget are refused here and
    those reads take the socket path, which the worker bounds itself. The count word
    (how many words the worker scans) falls again when the top ranges are given back,
    so a client that once pinned many blocks does not cost every later eviction."""

    def __init__(
        self, fd: int, budget: int = 1 << 62, elsewhere: Callable[[], int] | None = None
    ) -> None:
        self._mm = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        self.haz = raw[HAZ_AT:RING_AT].view("<u8")
        self.ring = raw[RING_AT:PAGE_BYTES].view("<u8")
        self._atomic = atomicshm.AtomicView(self._mm)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, NHAZ)]  # (start, length), by start
        self._high = 0
        self._head = 0
        self.budget = budget
        self.held = 0  # bytes the taken ranges may pin
        # bytes this client holds at the worker by other means (socket-path pins): the
        # worker counts them against the same budget
        self._elsewhere = elsewhere

    def room(self) -> int:
        """Bytes more the budget lets this client's words pin now."""
        other = self._elsewhere() if self._elsewhere is not None else 0
        return max(0, self.budget - self.held - other)

    def take(self, n: int, nbytes: int = 0) -> int:
        """The start of ``n`` free hazard words for pins of ``nbytes`` in all, or -1 (no
        words free, or over the budget: then use the socket path)."""
        other = self._elsewhere() if self._elsewhere is not None else 0
        with self._lock:
            if self.held + nbytes + other > self.budget:
                return -1
            for i, (a, k) in enumerate(self._free):
                if k >= n:
                    if k == n:
                        del self._free[i]
                    else:
                        self._free[i] = (a + n, k - n)
                    if a + n > self._high:
                        self._high = a + n
                        self._atomic.store_u64(0, self._high)
                    self.held += nbytes
                    return a
        return -1

    def publish(self, start: int, words: U64) -> None:
        """Write hazard words at ``start`` and fence: loads after this see them
        ordered after the stores (the worker's check and our re-check agree)."""
        self.haz[start : start + len(words)] = words
        atomicshm.fence(atomicshm.SEQ_CST)

    def give(self, start: int, n: int, nbytes: int = 0) -> None:
        """Clear and give back a range taken by :meth:`take` (with its ``nbytes``)."""
        self.haz[start : start + n] = 0
        with self._lock:
            self.held -= nbytes
            free = self._free
            free.append((start, n))
            free.sort()
            merged: list[tuple[int, int]] = []
            for a, k in free:
                if merged and merged[-1][0] + merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + k)
                else:
                    merged.append((a, k))
            self._free = merged
            last_start, last_len = merged[-1]
            if last_start + last_len == NHAZ and last_start < self._high:
                self._high = last_start  # the words above are all free: scanned no more
                self._atomic.store_u64(0, self._high)

    def touched(self, words: U64) -> None:
        """Log reads for the worker (it moves them up its LRU and counts the hits)."""
        with self._lock:
            h = self._head
            n = min(len(words), NRING)
            words = words[-n:]
            at = h % NRING
            first = min(n, NRING - at)
            self.ring[at : at + first] = words[:first]
            self.ring[: n - first] = words[first:]
            self._head = h + n
            self._atomic.store_u64(8, self._head)
