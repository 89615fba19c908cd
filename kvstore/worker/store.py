"""The worker's block store: DRAM tier bookkeeping, the arena's bytes, and the SSD tier.

This is where bytes meet bookkeeping: one lock serialises the state machines
(a few dict operations per block), while checksums, copies and LMDB I/O run
outside it wherever possible. The gRPC servicer and every transfer server go
through this class.

Reads look in DRAM, then SSD. A read pins what it returns until ``done()``:
DRAM blocks by a pin count, SSD blocks by an open LMDB read transaction whose
memory-mapped views go straight to the socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvstore_client.errors import QuotaExceeded, ResourceExhausted

from .arena import Arena
from .tiers.dram import Block, DramTier
from .tiers.policy import Promoter, QuotaBook, SsdIndex, Watermarks
from .tiers.ssd import SsdStore

log = logging.getLogger(__name__)

DEMOTE_BATCH_BYTES = 64 << 20


@dataclass(slots=True)
class StoreCounters:
    checksum_errors: int = 0
    bad_frames: int = 0
    demotions: int = 0
    promotions: int = 0
    ssd_hits: int = 0
    ssd_write_errors: int = 0


@dataclass(slots=True)
class Held:
    """A block being read: its bytes (zero-copy view) and stored checksum."""

    view: memoryview
    checksum: int
    block: Block | None  # the pinned DRAM block, or None when served from SSD


@dataclass(slots=True)
class Reading:
    """The result of :meth:`BlockStore.read`; give it back with :meth:`BlockStore.done`."""

    held: list[Held | None]
    txn: Any = None  # LMDB read transaction holding SSD views
    promote: list[tuple[str, bytes, int]] = field(default_factory=list)  # (ns, key, index)


class BlockStore:
    """Thread-safe block storage over one arena and an optional SSD tier."""

    def __init__(
        self,
        arena: Arena,
        slab_size: int,
        *,
        ssd: SsdStore | None = None,
        dram_marks: Watermarks | None = None,
        ssd_marks: Watermarks | None = None,
        promoter: Promoter | None = None,
        pins: dict[str, int] | None = None,
        tenant_quota: QuotaBook | None = None,
    ) -> None:
        self.arena = arena
        self.quota = QuotaBook(pins or {})
        self.books = [self.quota, *([tenant_quota] if tenant_quota else [])]
        self.tier = DramTier(
            arena.size, slab_size, on_evict=self._on_evict, pinned=self.quota.quotas
        )
        self.lock = threading.Lock()
        self.counters = StoreCounters()
        self.ssd = ssd
        self.ssd_index = SsdIndex(ssd.size if ssd else 0, pinned=self.quota.quotas)
        self.dram_marks = dram_marks or Watermarks()
        self.ssd_marks = ssd_marks or Watermarks()
        self.promoter = promoter or Promoter()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._demoter: threading.Thread | None = None
        if ssd is not None:
            self._rebuild()
            self._demoter = threading.Thread(target=self._demote_loop, name="demoter", daemon=True)
            self._demoter.start()

    @property
    def max_value_size(self) -> int:
        return self.tier.max_value_size

    # ---- metadata ------------------------------------------------------------

    def _present(self, ns: str, key: bytes) -> bool:
        return self.tier.contains(ns, key) or (ns, key) in self.ssd_index

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        with self.lock:
            flags = self.tier.exists_many(ns, keys)
            if len(self.ssd_index):
                ssd = self.ssd_index.entries
                flags = [f or (ns, k) in ssd for f, k in zip(flags, keys, strict=True)]
            return flags

    def match_prefix(self, ns: str, keys: Sequence[bytes], state_ns: str = "") -> int:
        """Leading run of present keys; with ``state_ns`` the state at the last one too."""
        with self.lock:
            n = 0
            for k in keys:
                if not self._present(ns, k):
                    break
                n += 1
            if state_ns:
                while n and not self._present(state_ns, keys[n - 1]):
                    n -= 1
        return n

    def remove(self, ns: str, keys: Sequence[bytes]) -> int:
        gone: list[tuple[str, bytes]] = []
        n = 0
        with self.lock:
            for k in keys:
                b = self.tier.peek(ns, k)
                in_dram = self.tier.remove(ns, k)
                e = self.ssd_index.remove(ns, k)
                if e is not None:
                    gone.append((ns, k))
                if in_dram or e is not None:
                    n += 1
                    self._refund(ns, b.size if b is not None else e.size if e else 0)
        if gone and self.ssd is not None:
            self.ssd.delete_many(gone)
        return n

    def remove_namespace(self, ns: str) -> int:
        with self.lock:
            keys = set(self.tier.keys_of(ns))
            keys.update(self.ssd_index.keys_of(ns))
        return self.remove(ns, sorted(keys))

    # ---- writes (two-phase) --------------------------------------------------

    def reserve_many(
        self, ns: str, keys: Sequence[bytes], sizes: Sequence[int], checksums: Sequence[int]
    ) -> list[Block | ResourceExhausted | None]:
        """Reserve slots; per key a Block, None (already present) or ResourceExhausted."""
        out: list[Block | ResourceExhausted | None] = []
        with self.lock:
            for k, s, c in zip(keys, sizes, checksums, strict=True):
                if (ns, k) in self.ssd_index:
                    self.tier.counters.skipped += 1
                    out.append(None)
                    continue
                if not all(q.admits(ns, s) for q in self.books):
                    out.append(QuotaExceeded(f"namespace {ns!r} is over its quota"))
                    continue
                try:
                    b = self.tier.reserve(ns, k, s, c)
                except ResourceExhausted as e:
                    out.append(e)
                    continue
                if b is not None:
                    self._charge(ns, s)
                out.append(b)
        if self._demoter is not None and self.dram_marks.excess(
            self.tier.used_bytes, self.tier.capacity
        ):
            self._wake.set()
        return out

    def _charge(self, ns: str, size: int) -> None:
        for q in self.books:
            q.charge(ns, size)

    def _refund(self, ns: str, size: int) -> None:
        for q in self.books:
            q.refund(ns, size)

    def view(self, b: Block) -> memoryview:
        return self.arena.slot(b.offset, b.size)

    def finish_many(self, blocks: Sequence[Block], ok: Sequence[bool]) -> None:
        """Commit the blocks whose bytes arrived intact, abort the others."""
        with self.lock:
            for b, good in zip(blocks, ok, strict=True):
                if good:
                    self.tier.commit(b)
                else:
                    self._refund(b.ns, b.size)
                    self.tier.abort(b)

    def put_bytes(self, ns: str, keys: Sequence[bytes], values: Sequence[bytes]) -> list[bool]:
        """Inline put (gRPC path): True = stored now, False = already present."""
        res = self.reserve_many(
            ns, keys, [len(v) for v in values], [xxhash.xxh3_64_intdigest(v) for v in values]
        )
        blocks = [r for r in res if isinstance(r, Block)]
        err = next((r for r in res if isinstance(r, ResourceExhausted)), None)
        if err is not None:
            self.finish_many(blocks, [False] * len(blocks))
            raise err
        for r, v in zip(res, values, strict=True):
            if isinstance(r, Block):
                self.view(r)[:] = v
        self.finish_many(blocks, [True] * len(blocks))
        return [isinstance(r, Block) for r in res]

    # ---- reads ---------------------------------------------------------------

    def read(self, ns: str, keys: Sequence[bytes], *, verify_dram: bool = True) -> Reading:
        """Pin and verify blocks from DRAM or SSD; corrupt ones are dropped and missed.

        SSD blocks are always verified. ``verify_dram=False`` skips the check of DRAM
        blocks for transfer-plane readers, which verify every block end to end
        against the checksum sent with it (one pass over the bytes instead of two).
        The views stay valid until :meth:`done`, which every caller must call.
        """
        with self.lock:
            blocks = [self.tier.acquire(ns, k) for k in keys]
            on_ssd = [
                i for i, b in enumerate(blocks) if b is None and (ns, keys[i]) in self.ssd_index
            ]
        held: list[Held | None] = [
            Held(self.view(b), b.checksum, b) if b is not None else None for b in blocks
        ]
        reading = Reading(held)
        if on_ssd and self.ssd is not None:
            reading.txn = self.ssd.begin_read()
            now = time.monotonic()
            for i in on_ssd:
                got = self.ssd.view(reading.txn, ns, keys[i])
                if got is None:
                    self._drop_ssd(ns, keys[i], corrupt=True)
                    continue
                header, view = got
                held[i] = Held(view, header.checksum, None)
                with self.lock:
                    self.ssd_index.touch(ns, keys[i])
                    self.tier.counters.hits += 1
                    self.tier.counters.misses -= 1
                    self.counters.ssd_hits += 1
                    if self.promoter.on_hit(ns, keys[i], now):
                        reading.promote.append((ns, keys[i], i))
        for i, h in enumerate(held):
            if h is None or (h.block is not None and not verify_dram):
                continue
            if xxhash.xxh3_64_intdigest(h.view) != h.checksum:
                held[i] = None
                self._corrupt(ns, keys[i], h)
        return reading

    def done(self, reading: Reading) -> None:
        """Release a read: unpin DRAM blocks, promote SSD hits, end the LMDB transaction."""
        for ns, key, i in reading.promote:
            h = reading.held[i]
            if h is not None:
                self._promote(ns, key, h)
        if reading.txn is not None:
            reading.txn.abort()
        with self.lock:
            for h in reading.held:
                if h is not None and h.block is not None:
                    self.tier.release(h.block)

    def get_bytes(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Inline get (gRPC path): copies of the values, None for misses."""
        r = self.read(ns, keys)
        try:
            return [bytes(h.view) if h is not None else None for h in r.held]
        finally:
            self.done(r)

    def _corrupt(self, ns: str, key: bytes, h: Held) -> None:
        log.warning("checksum mismatch on %s/%s: dropped", ns, key.hex())
        with self.lock:
            self.counters.checksum_errors += 1
            self.tier.counters.hits -= 1
            self.tier.counters.misses += 1
            if h.block is not None:
                self.tier.remove(ns, key)
                self.tier.release(h.block)
                h.block = None
        if h.block is None:
            self._drop_ssd(ns, key, corrupt=False)

    def _drop_ssd(self, ns: str, key: bytes, *, corrupt: bool) -> None:
        with self.lock:
            e = self.ssd_index.remove(ns, key)
            if corrupt:
                self.counters.checksum_errors += 1
            if e is not None:
                self._refund(ns, e.size)
        if self.ssd is not None:
            self.ssd.delete_many([(ns, key)])

    def _promote(self, ns: str, key: bytes, h: Held) -> None:
        with self.lock:
            if self.tier.contains(ns, key):
                return
            try:
                b = self.tier.reserve(ns, key, len(h.view), h.checksum)
            except ResourceExhausted:
                return
        if b is None:
            return
        self.view(b)[:] = h.view
        with self.lock:
            self.tier.commit(b)
            self.counters.promotions += 1

    # ---- SSD tier: demotion, eviction, recovery ------------------------------

    def _on_evict(self, b: Block) -> None:
        """Called under the lock when DRAM evicts on demand: keep the block on SSD."""
        if self.ssd is None or (b.ns, b.key) in self.ssd_index:
            return
        try:
            self._write_ssd([(b.ns, b.key, self.view(b), b.checksum)])
            self.counters.demotions += 1
        except ResourceExhausted:
            self.counters.ssd_write_errors += 1

    def _write_ssd(self, items: list[tuple[str, bytes, memoryview, int]]) -> None:
        """Write to LMDB, evicting SSD blocks first when over the mark. Caller holds the lock."""
        assert self.ssd is not None
        need = sum(len(v) + 32 for _, _, v, _ in items)
        self._evict_ssd(self.ssd_marks.excess(self.ssd_index.used_bytes + need, self.ssd.size))
        for attempt in range(3):
            try:
                for ns, key, n, stored in self.ssd.put_many(items):
                    self.ssd_index.add(ns, key, n, stored)
                return
            except ResourceExhausted:
                if attempt == 2 or not self._evict_ssd(max(need, self.ssd.size // 10)):
                    raise

    def _evict_ssd(self, nbytes: int) -> bool:
        if nbytes <= 0 or self.ssd is None:
            return False
        victims = self.ssd_index.victims(nbytes)
        for ns, key in victims:
            self.ssd_index.remove(ns, key)
        self.ssd_index.evictions += len(victims)
        if victims:
            self.ssd.delete_many(victims)
        return bool(victims)

    def demote(self, nbytes: int, *, everything: bool = False) -> int:
        """Move up to ``nbytes`` of least recently used DRAM blocks to SSD; returns bytes.

        ``everything`` includes pinned namespaces (shutdown: nothing may be lost).
        """
        if self.ssd is None:
            return 0
        moved = 0
        while moved < nbytes and not self._stop.is_set():
            with self.lock:
                batch = self.tier.oldest(
                    min(nbytes - moved, DEMOTE_BATCH_BYTES), include_pinned_ns=everything
                )
                for b in batch:
                    self.tier.pin(b)
            if not batch:
                break
            todo = [
                (b.ns, b.key, self.view(b), b.checksum)
                for b in batch
                if (b.ns, b.key) not in self.ssd_index
            ]
            try:
                with self.lock:
                    if todo:
                        self._write_ssd(todo)
                    for b in batch:
                        self.tier.release(b)
                        if b.ready and not b.doomed:
                            self.tier.remove(b.ns, b.key)
                            moved += b.size
                    self.counters.demotions += len(todo)
            except ResourceExhausted:
                with self.lock:
                    for b in batch:
                        self.tier.release(b)
                    self.counters.ssd_write_errors += 1
                break
        return moved

    def _demote_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.05)
            self._wake.clear()
            excess = self.dram_marks.excess(self.tier.used_bytes, self.tier.capacity)
            if excess:
                try:
                    self.demote(excess)
                except Exception:
                    log.exception("demotion failed")

    def _rebuild(self) -> None:
        """Index what LMDB holds (headers only); drop malformed entries."""
        assert self.ssd is not None
        bad: list[bytes] = []
        t0 = time.monotonic()
        for raw, ns, key, header, stored in self.ssd.scan():
            if header is None:
                bad.append(raw)
                continue
            self.ssd_index.add(ns, key, header.size, stored)
            self._charge(ns, header.size)
        if bad:
            self.ssd.delete_raw(bad)
            self.counters.checksum_errors += len(bad)
        log.info(
            "SSD tier: %d blocks (%d bytes) indexed in %.2fs, %d malformed dropped",
            len(self.ssd_index),
            self.ssd_index.used_bytes,
            time.monotonic() - t0,
            len(bad),
        )

    def close(self, demote_timeout: float = 30.0) -> None:
        """Stop the demoter; with an SSD, demote every DRAM block (bounded), then fsync."""
        self._stop.set()
        self._wake.set()
        if self._demoter is not None:
            self._demoter.join(timeout=5)
        if self.ssd is not None:
            self._stop.clear()
            deadline = time.monotonic() + demote_timeout
            try:
                while time.monotonic() < deadline and self.tier.keys:
                    if not self.demote(DEMOTE_BATCH_BYTES, everything=True):
                        break
            except Exception:  # a failing disk must not keep the worker from exiting
                log.exception("shutdown: demotion to SSD failed")
            finally:
                self._stop.set()
                left = self.tier.keys
                if left:
                    log.warning("shutdown: %d DRAM blocks could not be demoted", left)
                self.ssd.close()
