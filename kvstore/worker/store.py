"""The worker's block store: the DRAM tier's bookkeeping, the arena's bytes, and the SSD tier.

One lock serialises the bookkeeping (the DRAM tier and the tier policy, both pure
state machines); everything else runs outside it: copies, checksums and all LMDB
I/O. The policy (:class:`~kvstore.worker.tiers.policy.TierPolicy`) decides
placement and quotas; this class feeds it events under the lock and executes the
instructions it returns after the lock is released:

- an on-demand DRAM eviction copies the victim's bytes under the lock into a
  *staged* copy that readers can still hit, and writes it to LMDB outside the lock;
- the background demoter pins the blocks it moves, writes them outside the lock,
  and drops their DRAM copies only if nobody removed them meanwhile;
- a promotion copies an SSD hit into DRAM while the read transaction is live and
  commits it only if the block is still on SSD (a removal in between wins).

Big requests are cut into slices of ``slice_keys`` keys, each under its own hold of
the lock (first come, first served, :mod:`.fairlock`): one client's 65,536-key
batch cannot stall everyone else's lookups.

Reads look in DRAM, the staged copies, then SSD. A read pins what it returns until
:meth:`BlockStore.done`: DRAM blocks by a pin count, SSD blocks by an open LMDB
read transaction whose memory-mapped views go straight to the socket.

CHAIN ORDER. A batch of keys is a run of one prefix chain, head first (the
connector and the client's prefix calls send them so), and a prefix match stops at
the first gap: a chain whose head is evicted is worth nothing. So every batch
touches its keys last one first (reads unpin, SSD hits and commits run in reverse),
leaving the block nearest the head the most recently used in both tiers: eviction
shortens a chain from its tail. A paused session's chain is reordered the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import xxhash

from kvstore_client.errors import QuotaExceeded, ResourceExhausted, SessionShareFull

from . import session_ops, ssdwrites, storerecords
from .arena import Arena
from .events import DRAM, SSD, EventSink
from .fairlock import FairLock
from .sessions import SessionTable
from .ssdwrites import DEMOTE_BATCH_BYTES
from .storerecords import Held, Reading, StoreCounters, StoreStats, _Staged, _Todo, snapshot
from .tiers.blocks import Block
from .tiers.budgets import Promoter, QuotaBook, Watermarks
from .tiers.dram import DramTier
from .tiers.policy import (
    Aborted,
    DeleteSsd,
    Demote,
    Drop,
    Event,
    Evicted,
    EvictFirst,
    Instruction,
    Lookup,
    Prefetch,
    Promote,
    Release,
    Removed,
    Reserved,
    Retain,
    SessionTick,
    SsdBad,
    SsdHit,
    TailFirst,
    Tick,
    TierPolicy,
    WriteSsd,
)
from .tiers.ssd import SsdStore

log = logging.getLogger(__name__)

SLICE_KEYS = 256
_UPKEEP_SLICE = 1024  # logged same-host reads applied per hold of the lock
_SCALAR_KEYS = 16  # shorter lookups probe key by key (cheaper than one numpy pass)


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
        slice_keys: int = SLICE_KEYS,
        sessions: SessionTable | None = None,
        retain_budget: int = 0,
        session_share: int = 0,
        session_order: str = "per-session",
        events: EventSink | None = None,
    ) -> None:
        self.arena = arena
        self.quota = QuotaBook(pins or {})
        self.tier = DramTier(
            arena.size, slab_size, on_evict=self._on_evict, pinned=self.quota.quotas
        )
        self.policy = TierPolicy(
            has_ssd=ssd is not None,
            ssd_capacity=ssd.size if ssd else 0,
            dram_marks=dram_marks,
            ssd_marks=ssd_marks,
            promoter=promoter,
            books=[self.quota, *([tenant_quota] if tenant_quota else [])],
            pinned=self.quota.quotas,
            charge_of=self.tier.slot_size_for,
            in_dram=self._held_outside_ssd,
            sessions=sessions,
            retain_budget=retain_budget,
            ssd_retain_budget=(ssd.size * retain_budget) // max(arena.size, 1) if ssd else 0,
            dram_size=self.tier.size_of,
            session_share=session_share,
            session_order=session_order,
        )
        self.events = events  # KV events (stored / removed per tier), or None
        self.ssd_index = self.policy.ssd
        self.slice_keys = max(1, slice_keys)
        self.lock = FairLock()  # first come, first served: slices let others in
        self.counters = StoreCounters()
        self.ssd = ssd
        self._staged: dict[tuple[str, bytes], _Staged] = {}
        self._todo = _Todo()
        self._next_tick = 0.0  # next session expiry (without a demoter thread)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._demoter: threading.Thread | None = None
        self._cut_walker = threading.Lock()  # one thread walks chain cuts at a time
        if ssd is not None:
            self._rebuild()
            self._demoter = threading.Thread(target=self._demote_loop, name="demoter", daemon=True)
            self._demoter.start()

    @property
    def max_value_size(self) -> int:
        return self.tier.max_value_size

    def _slices(self, n: int) -> Iterator[slice]:
        for i in range(0, n, self.slice_keys):
            yield slice(i, min(n, i + self.slice_keys))

    def _lookup_slices(self, n: int) -> Iterator[slice]:
        """Slices for exists / match_prefix: LOOKUP_SLICES times bigger, as one
        vectorised probe of 2,048 keys costs about what one of 256 does."""
        step = self.slice_keys * storerecords.LOOKUP_SLICES
        for i in range(0, n, step):
            yield slice(i, min(n, i + step))

    def _held_outside_ssd(self, ns: str, key: bytes) -> bool:
        """DRAM or a staged copy holds it (the policy's 'is it still stored elsewhere')."""
        return self.tier.contains(ns, key) or (ns, key) in self._staged

    # ---- metadata ------------------------------------------------------------

    def _present_many(self, ns: str, keys: Sequence[bytes]) -> np.ndarray:
        """Per key: held in DRAM, a staged copy or on SSD (bool array); under the lock."""
        if len(keys) < _SCALAR_KEYS:
            return np.array([self._present(ns, k) for k in keys], dtype=bool)
        flags = self.tier.ready_flags(ns, b"".join(keys), keys)
        if (len(self.ssd_index) or self._staged) and not flags.all():
            for i in np.flatnonzero(~flags).tolist():
                flags[i] = self._present(ns, keys[i])
        return flags

    def _present(self, ns: str, key: bytes) -> bool:
        if type(key) is not bytes:
            key = bytes(key)  # any bytes-like key (the SSD and staged maps hash it)
        return (
            self.tier.contains(ns, key)
            or (ns, key) in self.ssd_index.entries
            or (ns, key) in self._staged
        )

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for s in self._lookup_slices(len(keys)):
            with self.lock:
                out += self._present_many(ns, keys[s]).tolist()
        self._looked(ns, keys)
        return out

    def _looked(self, ns: str, keys: Sequence[bytes]) -> None:
        """A lookup may resume a paused session (and prefetch its blocks)."""
        if self.policy.sessions.paused:
            self.handle(Lookup(ns, tuple(keys), time.monotonic()))

    def handle(self, ev: Event) -> None:
        """Feed the policy one event under the lock and execute what it says."""
        with self.lock:
            self._queue(self.policy.handle(ev))
        self._execute()

    def session_hint(
        self,
        ns: str,
        session: str,
        state: str,
        keys: Sequence[bytes],
        ttl: float | None,
        depths: Sequence[int] = (),
        cuts: Sequence[tuple[str, int, int]] = (),
        client: bytes = b"",
        whole: bool = False,
    ) -> session_ops.HintAnswer:
        """Apply a session hint; see :func:`kvstore.worker.session_ops.hint`."""
        return session_ops.hint(self, ns, session, state, keys, ttl, depths, cuts, client, whole)

    def take_cuts(self, ns: str, client: bytes = b"") -> list[tuple[str, int, int]]:
        """``client``'s sessions of ``ns`` cut here since its last call: (session,
        depth, turn)."""
        with self.lock:
            return self.policy.take_cuts(ns, client)

    def match_prefix(self, ns: str, keys: Sequence[bytes], state_ns: str = "") -> int:
        """Leading run of present keys; with ``state_ns`` the state at the last one too."""
        n = 0
        for s in self._lookup_slices(len(keys)):
            size = s.stop - s.start
            with self.lock:
                # A cold chain misses its first key, and short lookups go key by key:
                # neither needs a batch probe.
                if size < _SCALAR_KEYS or not self._present(ns, keys[s.start]):
                    run = next((i for i, k in enumerate(keys[s]) if not self._present(ns, k)), size)
                else:
                    flags = self._present_many(ns, keys[s])
                    run = size if flags.all() else int(np.argmin(flags))
            n += run
            if run < size:
                break
        self._looked(ns, keys)
        if state_ns and n:
            # Walk back to the last boundary whose state is present (one slice at a time).
            while n:
                lo = max(0, n - self.slice_keys)
                with self.lock:
                    flags = self._present_many(state_ns, keys[lo:n])
                hits = np.flatnonzero(flags)
                if len(hits):
                    return lo + int(hits[-1]) + 1
                n = lo
        return n

    def remove(self, ns: str, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns how many were present. A removed key
        stays removed: reads and demotions in flight cannot bring it back."""
        n = 0
        for s in self._slices(len(keys)):
            with self.lock:
                for k in keys[s]:
                    b = self.tier.peek(ns, k)
                    staged = self._staged.pop((ns, k), None)
                    in_dram = b is not None or staged is not None
                    size = b.size if b is not None else len(staged.data) if staged else 0
                    if b is not None:
                        self.tier.remove(ns, k)
                        self._ev(False, DRAM, [(ns, k)])
                    present = in_dram or self.policy.on_ssd(ns, k)
                    if present:
                        n += 1
                        self._queue(self.policy.handle(Removed(ns, k, in_dram, size)))
            self._execute()
        return n

    # ---- writes (two-phase) --------------------------------------------------

    def reserve_many(
        self,
        ns: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        checksums: Sequence[int],
        *,
        hinted: bool = False,
    ) -> list[Block | ResourceExhausted | None]:
        """Reserve slots; per key a Block, None (already present) or ResourceExhausted
        (QuotaExceeded: quota full; SessionShareFull: only when ``hinted``, a writer
        that sends session hints, wire.FLAG_SESSION, and the block's session is full)."""
        out: list[Block | ResourceExhausted | None] = []
        for s in self._slices(len(keys)):
            with self.lock:
                if self.policy.charges(ns):
                    for k, size, c in zip(keys[s], sizes[s], checksums[s], strict=True):
                        out.append(self._reserve_one(ns, k, size, c, hinted))
                else:
                    out += self._reserve_free(ns, keys[s], sizes[s], checksums[s], hinted)
            self._execute()
        if self._demoter is not None:
            with self.lock:
                tick = self.policy.handle(Tick(self.tier.used_bytes, self.tier.capacity))
            if tick:
                self._wake.set()
        return out

    def _reserve_one(
        self, ns: str, k: bytes, size: int, c: int, hinted: bool
    ) -> Block | ResourceExhausted | None:
        if self.policy.on_ssd(ns, k) or (ns, k) in self._staged:
            self.tier.counters.skipped += 1
            return None
        if not self.policy.admits(ns, size):
            return QuotaExceeded(f"namespace {ns!r} is over its quota")
        if hinted and self._over_share(ns, k, size):
            return SessionShareFull(f"its session holds its share of worker memory ({ns!r})")
        try:
            b = self.tier.reserve(ns, k, size, c)
        except ResourceExhausted as e:
            r = session_ops.reserve_yielding(self, ns, k, size, c, e)
            if not isinstance(r, Block):
                return r
            b = r
        if b is not None:
            self.policy.handle(Reserved(ns, size))
        return b

    def _reserve_free(
        self,
        ns: str,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        checksums: Sequence[int],
        hinted: bool,
    ) -> list[Block | ResourceExhausted | None]:
        """:meth:`_reserve_one` of each key of a namespace no quota counts (caller holds
        the lock): no quota to check or charge, the rest the same."""
        on_ssd, staged, reserve = self.policy.ssd, self._staged, self.tier.reserve
        share = hinted and self.policy.session_share and self.policy.sessions.owner
        skipped = 0
        out: list[Block | ResourceExhausted | None] = []
        for k, size, c in zip(keys, sizes, checksums, strict=True):
            if (ns, k) in on_ssd or (ns, k) in staged:
                skipped += 1
                out.append(None)
                continue
            if share and self._over_share(ns, k, size):
                out.append(SessionShareFull(f"its session holds its share ({ns!r})"))
                continue
            try:
                out.append(reserve(ns, k, size, c))
            except ResourceExhausted as e:  # retained session blocks may yield room
                out.append(session_ops.reserve_yielding(self, ns, k, size, c, e))
        self.tier.counters.skipped += skipped
        return out

    def _over_share(self, ns: str, k: bytes, size: int) -> bool:
        """Is a new block declined because its session holds its share (see
        TierPolicy.session_admits)? A block already here is never counted."""
        return (
            bool(self.policy.session_share and self.policy.sessions.owner)
            and not self.tier.contains(ns, k)
            and not self.policy.session_admits(ns, k, size)
        )

    def view(self, b: Block) -> memoryview:
        return self.arena.slot(b.offset, b.size)

    def finish_many(
        self, blocks: Sequence[Block], ok: Sequence[bool], checksums: Sequence[int] | None = None
    ) -> list[bool]:
        """Commit the blocks whose bytes arrived intact, abort the others;
        ``checksums``: the blocks' checksums, given only now (FLAG_LATE_SUM).
        Returns, per block, whether it was committed."""
        # Committed last block first (slices from the end, each one in reverse): a batch
        # is a chain's run, and the block nearest the chain's head must be the most
        # recently used (see CHAIN ORDER above). KV events keep the batch's order
        # within each slice, sent under the same hold of the lock as the commits.
        good = list(ok)
        for s in reversed(list(self._slices(len(blocks)))):
            with self.lock:
                live = self.policy.sessions.refs  # hinted sessions retain their new blocks
                for i in range(s.stop - 1, s.start - 1, -1):
                    b = blocks[i]
                    if good[i] and checksums is not None:
                        good[i] = self.tier.set_checksum(b, checksums[i])
                    if good[i]:
                        self.tier.commit(b)
                        if live:
                            self._queue(self.policy.committed(b.ns, b.key))
                    else:
                        self.tier.abort(b)
                        self.policy.handle(Aborted(b.ns, b.size))
                if self.events is not None:
                    self._ev(
                        True,
                        DRAM,
                        [(b.ns, b.key) for b, g in zip(blocks[s], good[s], strict=True) if g],
                    )
        return good

    def put_bytes(self, ns: str, keys: Sequence[bytes], values: Sequence[bytes]) -> list[bool]:
        """Inline put (gRPC path): True = stored now, False = already present."""
        res = self.reserve_many(
            ns, keys, [len(v) for v in values], [xxhash.xxh3_64_intdigest(v) for v in values]
        )
        blocks = [r for r in res if isinstance(r, Block)]
        err = next(
            (
                r
                for r in res
                if isinstance(r, ResourceExhausted) and not isinstance(r, SessionShareFull)
            ),
            None,
        )
        if err is not None:
            self.finish_many(blocks, [False] * len(blocks))
            raise err
        for r, v in zip(res, values, strict=True):
            if isinstance(r, Block):
                self.view(r)[:] = v
        self.finish_many(blocks, [True] * len(blocks))
        return [isinstance(r, Block) for r in res]

    # ---- reads ---------------------------------------------------------------

    def sizes(self, ns: str, keys: Sequence[bytes]) -> int:
        """Payload bytes a read of ``keys`` would return (duplicates counted), without
        pinning anything: what the request core checks before an inline answer."""
        total = 0
        for s in self._slices(len(keys)):
            with self.lock:
                for k in keys[s]:
                    b = self.tier.peek(ns, k)
                    if b is not None:
                        total += b.size
                        continue
                    st = self._staged.get((ns, k))
                    if st is not None:
                        total += len(st.data)
                        continue
                    e = self.ssd_index.get(ns, k)
                    if e is not None:
                        total += e.size
        return total

    def read(self, ns: str, keys: Sequence[bytes], *, verify_dram: bool = True) -> Reading:
        """Pin and verify blocks from DRAM, staged copies or SSD; corrupt ones are missed.

        SSD blocks are always verified. ``verify_dram=False`` skips the check of DRAM
        blocks for transfer-plane readers, which verify every block end to end
        against the checksum sent with it (one pass over the bytes instead of two).
        The views stay valid until :meth:`done`, which every caller must call.
        """
        held: list[Held | None] = []
        on_ssd: list[int] = []
        slot = self.arena.slot
        for s in self._slices(len(keys)):
            with self.lock:
                blocks = self.tier.acquire_many(ns, keys[s])
                for i, b in zip(range(s.start, s.stop), blocks, strict=True):
                    if b is not None:
                        held.append(Held(slot(b.offset, b.size), b.checksum, b))
                        continue
                    k = keys[i]
                    st = self._staged.get((ns, k))
                    if st is not None:
                        self._count_hit()
                        held.append(Held(memoryview(st.data), st.checksum, None))
                        continue
                    held.append(None)
                    if self.policy.on_ssd(ns, k):
                        on_ssd.append(i)
        reading = Reading(held)
        promote: set[int] = set()
        if on_ssd and self.ssd is not None:
            reading.txn = self.ssd.begin_read()
            now = time.monotonic()
            for i in reversed(on_ssd):  # touched last block first (chain order)
                got = self.ssd.view(reading.txn, ns, keys[i])
                if got is None:
                    self._bad_ssd(ns, keys[i])
                    continue
                header, view = got
                held[i] = Held(view, header.checksum, None)
                with self.lock:
                    self._count_hit()
                    self.counters.ssd_hits += 1
                    if self.policy.handle(SsdHit(ns, keys[i], now)):
                        promote.add(i)
        for i, h in enumerate(held):
            if h is None or (h.block is not None and not verify_dram):
                continue
            if xxhash.xxh3_64_intdigest(h.view) != h.checksum:
                held[i] = None
                self._corrupt(ns, keys[i], h)
            elif i in promote:
                # Promote while the read transaction (and so the view) is live.
                self._promote(ns, keys[i], h)
        return reading

    def count_inbox_mismatches(self, n: int) -> None:
        """Blocks a same-host writer sent whose bytes did not match their checksum (not
        stored: a writer's fault, not this host's memory)."""
        with self.lock:
            self.counters.inbox_mismatches += n

    def _count_hit(self) -> None:
        """A DRAM miss (already counted) that was found elsewhere."""
        self.tier.counters.hits += 1
        self.tier.counters.misses -= 1

    def done(self, reading: Reading) -> None:
        """Release a read: unpin DRAM blocks, end the LMDB transaction. Idempotent."""
        if reading.released:
            return
        reading.released = True
        if reading.txn is not None:
            reading.txn.abort()
            reading.txn = None
        # Unpinned last block first, so the chain's head is the most recently used.
        pinned = [h.block for h in reversed(reading.held) if h is not None and h.block is not None]
        for s in self._slices(len(pinned)):
            with self.lock:
                self.tier.release_many(pinned[s])

    def end_txn(self, reading: Reading) -> None:
        """End the LMDB read transaction early (its views were sent); DRAM pins stay."""
        if reading.txn is not None:
            reading.txn.abort()
            reading.txn = None
        for i, h in enumerate(reading.held):
            if h is not None and h.block is None:
                reading.held[i] = None

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
                self._ev(False, DRAM, [(ns, key)])
                self.tier.release(h.block)
                self._queue(self.policy.handle(Removed(ns, key, True, h.block.size)))
                h.block = None
            elif self._staged.pop((ns, key), None) is not None:
                self._queue(self.policy.handle(Removed(ns, key, True, len(h.view))))
            else:
                self._queue(self.policy.handle(SsdBad(ns, key)))
        self._execute()

    def _bad_ssd(self, ns: str, key: bytes) -> None:
        with self.lock:
            self.counters.checksum_errors += 1
            self._queue(self.policy.handle(SsdBad(ns, key)))
        self._execute()

    def _promote(self, ns: str, key: bytes, h: Held) -> bool:
        with self.lock:
            if self.tier.contains(ns, key) or not self.policy.on_ssd(ns, key):
                return False
            try:
                b = self.tier.reserve(ns, key, len(h.view), h.checksum)
            except ResourceExhausted:
                b = None
        self._execute()
        if b is None:
            return False
        self.view(b)[:] = h.view
        with self.lock:
            if self.policy.on_ssd(ns, key):  # still stored: not removed meanwhile
                self.tier.commit(b)
                self.counters.promotions += 1
                self._ev(True, DRAM, [(ns, key)])
                return True
            self.tier.abort(b)
        return False

    # ---- instructions --------------------------------------------------------

    def _on_evict(self, b: Block) -> None:
        """DRAM evicts on demand (under the lock, before the slot is reused)."""
        self._ev(False, DRAM, [(b.ns, b.key)])
        for ins in self.policy.handle(Evicted(b.ns, b.key, b.size)):
            if isinstance(ins, WriteSsd):
                # Copy now: the slot is handed to the new block as soon as this returns.
                self._staged[(b.ns, b.key)] = _Staged(bytes(self.view(b)), b.checksum)
                self._todo.write_staged = True
            elif isinstance(ins, Drop):  # not in the middle of a reservation: later
                self._todo.drops.append((ins.ns, ins.keys))

    def _ev(self, stored: bool, medium: str, items: Sequence[tuple[str, bytes]]) -> None:
        """Report blocks stored in / removed from a tier to the KV-event publisher
        (an append under the lock; encoding and sending happen on its own thread)."""
        if self.events is not None and items:
            self.events.add(stored, medium, items)

    def _queue(self, instructions: Sequence[Instruction]) -> None:
        """Keep instructions for :meth:`_execute` (caller holds the lock); session
        instructions on DRAM bookkeeping run now (each is a few array operations)."""
        for ins in instructions:
            if isinstance(ins, DeleteSsd):
                self._todo.deletes.extend(ins.keys)
                self._ev(False, SSD, ins.keys)
            elif isinstance(ins, Demote):
                self._wake.set()
            elif isinstance(ins, Retain | Release):
                for k in ins.keys:
                    self.tier.retain(ins.ns, k, isinstance(ins, Retain))
            elif isinstance(ins, EvictFirst | TailFirst):
                move = self.tier.make_oldest if isinstance(ins, EvictFirst) else self.tier.touch
                for k in ins.keys:
                    move(ins.ns, k)
            elif isinstance(ins, Prefetch):
                self._todo.prefetch.append((ins.ns, ins.keys))
                self._wake.set()
            elif isinstance(ins, Drop):
                self._todo.drops.append((ins.ns, ins.keys))
            elif isinstance(ins, WriteSsd | Promote):  # pragma: no cover - not queued
                raise AssertionError(f"{ins} is handled where it is produced")

    def _execute(self) -> None:
        """Run queued SSD work outside the lock (any thread may drain the queue)."""
        with self.lock:
            deletes, self._todo.deletes = self._todo.deletes, []
            write = self._todo.write_staged
            self._todo.write_staged = False
            drops, self._todo.drops = self._todo.drops, []
        if deletes and self.ssd is not None:
            self.ssd.delete_many(deletes)
        if write:
            self._write_staged()
        for ns, keys in drops:
            self.remove(ns, keys)
        if self.policy.sessions.cutting:  # chains cut by blocks lost meanwhile
            session_ops.walk_cuts(self)

    def _write_staged(self) -> None:
        ssdwrites.write_staged(self)

    # ---- SSD tier: demotion, recovery ------------------------------------------

    def demote(self, nbytes: int, *, everything: bool = False) -> int:
        """Move up to ``nbytes`` of least recently used DRAM blocks to SSD; returns bytes.

        ``everything`` includes pinned namespaces (shutdown: nothing may be lost).
        """
        return ssdwrites.demote(self, nbytes, everything=everything)

    def _demote_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.05)
            self._wake.clear()
            if time.monotonic() >= self._next_tick:
                self.session_tick(time.monotonic())
            session_ops.prefetch(self)
            with self.lock:
                todo = self.policy.handle(Tick(self.tier.used_bytes, self.tier.capacity))
            for ins in todo:
                if isinstance(ins, Demote):
                    try:
                        self.demote(ins.nbytes)
                    except Exception:
                        log.exception("demotion failed")

    def session_tick(self, now: float) -> None:
        """Expire sessions (called every second by the demoter, or by a caller)."""
        self._next_tick = now + 1.0
        self.handle(SessionTick(now))
        session_ops.drain(self)

    def _rebuild(self) -> None:
        """Index what LMDB holds (headers only); drop malformed entries."""
        assert self.ssd is not None
        bad: list[bytes] = []
        t0 = time.monotonic()
        for raw, ns, key, header, _ in self.ssd.scan():
            if header is None:
                bad.append(raw)
                continue
            self.policy.rebuilt(ns, key, header.size, self.ssd.footprint(header.size))
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

    # ---- stats and shutdown ----------------------------------------------------

    def shared_upkeep(self, elsewhere: Callable[[bytes], int] | None = None) -> dict[bytes, int]:
        """Apply what same-host clients did through the index (tiers.shared): their
        logged reads move blocks up the LRU and count as hits and misses, and slots held
        for their pins are freed once no live page names them (``elsewhere``: what a
        client identity holds by other means, counted against its page's budget).
        Returns the bytes each identity's pages still hold. The logs are read and the
        pages scanned outside the store lock, the results applied under it a slice at a
        time: what clients write into their pages never holds the lock longer."""
        sh = self.tier.shared
        if sh is None:
            return {}
        logged = sh.drain()
        for i in range(0, len(logged), _UPKEEP_SLICE):
            with self.lock:
                self.tier.apply_reads(logged[i : i + _UPKEEP_SLICE])
        with self.lock:
            held = list(sh.held)
        if not held:
            return {}
        plan = sh.reap_plan(held, elsewhere)
        if plan.free.any():
            with self.lock:
                sh.reap_apply(plan, self.tier.release)
        return plan.held

    def stats(self) -> StoreStats:
        """The counters now. Reads same-host clients made through the shared index
        (tiers.shared) are logged there and applied by the index upkeep; they are
        applied first, so a read already answered is always in ``hits``."""
        self.shared_upkeep()
        return snapshot(self.tier, self.policy, self.counters, self.ssd.size if self.ssd else None)

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
                self._write_staged()
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
