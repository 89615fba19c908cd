"""The worker's block store: the only holder of the store lock.

The bookkeeping is one pure state machine, :class:`~kvstore.worker.tiers.state.TierState`
(the DRAM tier, the staged copies, the SSD index, quotas, sessions, retention: what
lives where). This class holds one lock around every call to it (:meth:`BlockStore.apply`,
one bounded stimulus at a time) and has its executor (:mod:`.executor`) carry out the
instructions it returns after the lock is released; everything else runs outside it:
copies, checksums and all LMDB I/O. The policy inside the state
(:class:`~kvstore.worker.tiers.policy.TierPolicy`) decides placement and quotas:

- an on-demand DRAM eviction copies the victim's bytes under the lock into a
  *staged* copy that readers can still hit, and writes it to LMDB outside the lock;
- the background demoter pins the blocks it moves, writes them outside the lock,
  and drops their DRAM copies only if nobody removed them meanwhile;
- a promotion copies an SSD hit into DRAM while the read transaction is live and
  commits it only if the block is still on SSD (a removal in between wins).

Big requests are cut into slices of ``slice_keys`` keys, each under its own hold of
the lock (first come, first served, :mod:`.fairlock`): one client's 65,536-key
batch cannot stall everyone else's lookups. Long work elsewhere (SSD writes,
:mod:`.ssdwrites`; session hints and prefetches, :mod:`.session_ops`; namespace
removal, :mod:`.removal`) is a stream of stimuli through :meth:`BlockStore.apply` too:
no other module takes this lock.

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
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import xxhash

from kvstore_client.errors import ResourceExhausted, SessionShareFull

from . import removal, session_ops, ssdwrites, storerecords
from .arena import Arena
from .events import EventSink
from .executor import Executor
from .fairlock import FairLock
from .sessions import SessionTable
from .ssdwrites import DEMOTE_BATCH_BYTES
from .storerecords import Held, Reading, StoreCounters, StoreStats, snapshot
from .tiers.blocks import Block
from .tiers.budgets import Promoter, QuotaBook, Watermarks
from .tiers.dram import DramTier
from .tiers.policy import Event, Lookup, SessionTick, TierPolicy
from .tiers.shared import SharedIndex
from .tiers.ssd import SsdStore
from .tiers.ssdindex import SsdIndex
from .tiers.state import TierState
from .tiers.stimuli import (
    ApplyReads,
    Commit,
    Corrupt,
    DramTick,
    HazardHeld,
    InboxMismatches,
    LeadingRun,
    Pin,
    Present,
    PromoteCommit,
    PromoteReserve,
    Publishing,
    Reap,
    Rebuilt,
    Remove,
    Reserve,
    SessionsReport,
    SessionsView,
    ShareIndex,
    Sizes,
    SsdCorrupt,
    SsdFound,
    SsdKeys,
    Stimulus,
    TakeClosedRates,
    TakeCuts,
    Unpin,
    Where,
)

log = logging.getLogger(__name__)

R = TypeVar("R")

SLICE_KEYS = 256
_UPKEEP_SLICE = 1024  # logged same-host reads applied per hold of the lock
_REBUILD_SLICE = 4096  # SSD entries indexed per hold of the lock at start-up


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
        self.state = TierState(
            arena.size,
            slab_size,
            arena.slot,
            ssd_size=ssd.size if ssd is not None else None,
            dram_marks=dram_marks,
            ssd_marks=ssd_marks,
            promoter=promoter,
            pins=pins,
            tenant_quota=tenant_quota,
            sessions=sessions,
            retain_budget=retain_budget,
            session_share=session_share,
            session_order=session_order,
            publish=events is not None,
        )
        self.slice_keys = max(1, slice_keys)
        self.lock = FairLock()  # first come, first served: slices let others in
        self.ssd = ssd
        self._next_tick = 0.0  # next session expiry (without a demoter thread)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._demoter: threading.Thread | None = None
        self.executor = Executor(self, events, self._wake.set)
        if ssd is not None:
            self._rebuild()
            self._demoter = threading.Thread(target=self._demote_loop, name="demoter", daemon=True)
            self._demoter.start()

    # ---- the state's parts, for reading (change them through apply) -------------------

    @property
    def tier(self) -> DramTier:
        return self.state.dram

    @property
    def policy(self) -> TierPolicy:
        return self.state.policy

    @property
    def quota(self) -> QuotaBook:
        return self.state.quota

    @property
    def counters(self) -> StoreCounters:
        return self.state.counters

    @property
    def ssd_index(self) -> SsdIndex:
        return self.state.ssd_index

    @property
    def session_share(self) -> int:
        return self.state.policy.session_share

    @property
    def max_value_size(self) -> int:
        return self.state.dram.max_value_size

    # ---- the one door to the state ---------------------------------------------------

    def apply(self, stim: Stimulus[R]) -> R:
        """Hand the tier state one stimulus under the lock and return its reply; its
        instructions wait for :meth:`execute` (KV events are published at once)."""
        with self.lock:
            reply, todo = self.state.handle(stim)
            if todo:
                self.executor.queue(todo)
        return reply

    def publish_events(self, sink: EventSink | None) -> None:
        """Report blocks stored in / removed from each tier to ``sink`` (KV events)
        from now on; None: stop."""
        self.executor.publish_to(sink)
        self.apply(Publishing(sink is not None))

    def tell(self, ev: Event) -> None:
        """:meth:`apply` for one of the tier policy's events (no reply)."""
        with self.lock:
            _, todo = self.state.handle(ev)
            if todo:
                self.executor.queue(todo)

    def handle(self, ev: Event) -> None:
        """Feed the policy one event under the lock and execute what it says."""
        self.tell(ev)
        self.execute()

    def execute(self) -> None:
        """Run queued SSD work outside the lock (any thread may drain the queue)."""
        self.executor.run()

    def execute_deletes(self) -> None:
        self.executor.run_deletes()

    def walk_cuts(self) -> None:
        self.executor.walk_cuts()

    def stopping(self) -> bool:
        return self._stop.is_set()

    def _slices(self, n: int) -> Iterator[slice]:
        for i in range(0, n, self.slice_keys):
            yield slice(i, min(n, i + self.slice_keys))

    def _lookup_slices(self, n: int) -> Iterator[slice]:
        """Slices for exists / match_prefix: LOOKUP_SLICES times bigger, as one
        vectorised probe of 2,048 keys costs about what one of 256 does."""
        step = self.slice_keys * storerecords.LOOKUP_SLICES
        for i in range(0, n, step):
            yield slice(i, min(n, i + step))

    # ---- metadata ------------------------------------------------------------

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for s in self._lookup_slices(len(keys)):
            out += self.apply(Present(ns, keys[s])).tolist()
        self._looked(ns, keys)
        return out

    def where(self, ns: str, keys: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """:meth:`exists` telling the tiers apart: per key a ``wire.WHERE_*`` code,
        WHERE_DRAM (in the arena), WHERE_SSD (evicted: on SSD or staged on its way
        there) or WHERE_ABSENT; the same slices and cost as :meth:`exists`."""
        parts = [self.apply(Where(ns, keys[s])) for s in self._lookup_slices(len(keys))]
        out = parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, np.uint8), *parts])
        self._looked(ns, keys)
        return out

    def _looked(self, ns: str, keys: Sequence[bytes]) -> None:
        """A lookup may resume a paused session (and prefetch its blocks)."""
        if self.state.policy.sessions.paused:
            self.handle(Lookup(ns, tuple(keys), time.monotonic()))

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
        return self.apply(TakeCuts(ns, client))

    def take_closed_rates(self) -> list[float]:
        """Hit ratios of the sessions that left the table since the last call."""
        return self.apply(TakeClosedRates())

    def sessions_report(
        self, owns: Callable[[str], bool] | None, limit: int, now: float
    ) -> SessionsView:
        """Up to ``limit`` sessions (of namespaces ``owns`` accepts; None: any), those
        that asked about the most blocks first, and the session counters."""
        return self.apply(SessionsReport(owns, limit, now))

    def match_prefix(self, ns: str, keys: Sequence[bytes], state_ns: str = "") -> int:
        """Leading run of present keys; with ``state_ns`` the state at the last one too."""
        n = 0
        for s in self._lookup_slices(len(keys)):
            run = self.apply(LeadingRun(ns, keys[s]))
            n += run
            if run < s.stop - s.start:
                break
        self._looked(ns, keys)
        if state_ns and n:
            # Walk back to the last boundary whose state is present (one slice at a time).
            while n:
                lo = max(0, n - self.slice_keys)
                hits = np.flatnonzero(self.apply(Present(state_ns, keys[lo:n])))
                if len(hits):
                    return lo + int(hits[-1]) + 1
                n = lo
        return n

    def remove(self, ns: str, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns how many were present. A removed key
        stays removed: reads and demotions in flight cannot bring it back."""
        n = 0
        for s in self._slices(len(keys)):
            n += self.apply(Remove(ns, keys[s]))
            self.execute()
        return n

    def remove_tree(self, ns: str) -> int:
        """Remove ``ns`` and every namespace below it; see :mod:`.removal`."""
        return removal.remove_tree(self, ns)

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
            stim = Reserve(ns, keys[s], sizes[s], checksums[s], hinted, time.monotonic())
            out += self.apply(stim)
            self.execute()
        if self._demoter is not None and self.apply(DramTick()) > 0:
            self._wake.set()
        return out

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
            sums = checksums[s] if checksums is not None else None
            good[s] = self.apply(Commit(blocks[s], good[s], sums))
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
        return sum(self.apply(Sizes(ns, keys[s])) for s in self._slices(len(keys)))

    def read(self, ns: str, keys: Sequence[bytes], *, verify_dram: bool = True) -> Reading:
        """Pin and verify blocks from DRAM, staged copies or SSD; corrupt ones are missed.

        SSD blocks are always verified. ``verify_dram=False`` skips the check of DRAM
        blocks for transfer-plane readers, which verify every block end to end
        against the checksum sent with it (one pass over the bytes instead of two).
        The views stay valid until :meth:`done`, which every caller must call.
        """
        held: list[Held | None] = []
        on_ssd: list[int] = []
        for s in self._slices(len(keys)):
            pinned = self.apply(Pin(ns, keys[s]))
            held += pinned.held
            on_ssd += [s.start + i for i in pinned.on_ssd]
        reading = Reading(held)
        promote: set[int] = set()
        if on_ssd and self.ssd is not None:
            reading.txn = self.ssd.begin_read()
            now = time.monotonic()
            for i in reversed(on_ssd):  # touched last block first (chain order)
                got = self.ssd.view(reading.txn, ns, keys[i])
                if got is None:
                    self.bad_ssd(ns, keys[i])
                    continue
                header, view = got
                held[i] = Held(view, header.checksum, None)
                if self.apply(SsdFound(ns, keys[i], now)):
                    promote.add(i)
        for i, h in enumerate(held):
            if h is None or (h.block is not None and not verify_dram):
                continue
            if xxhash.xxh3_64_intdigest(h.view) != h.checksum:
                held[i] = None
                self._corrupt(ns, keys[i], h)
            elif i in promote:
                # Promote while the read transaction (and so the view) is live.
                self.promote(ns, keys[i], h)
        return reading

    def count_inbox_mismatches(self, n: int) -> None:
        """Blocks a same-host writer sent whose bytes did not match their checksum (not
        stored: a writer's fault, not this host's memory)."""
        self.apply(InboxMismatches(n))

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
            self.apply(Unpin(pinned[s]))

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
        self.apply(Corrupt(ns, key, h))
        self.execute()

    def bad_ssd(self, ns: str, key: bytes) -> None:
        """An SSD entry failed its header or checksum check: dropped, counted."""
        self.apply(SsdCorrupt(ns, key))
        self.execute()

    def promote(self, ns: str, key: bytes, h: Held, prefetched: bool = False) -> bool:
        """Copy an SSD block's verified bytes (``h``, a live view) into DRAM; committed
        only if it is still on SSD. ``prefetched``: a resumed session's prefetch."""
        b = self.apply(PromoteReserve(ns, key, len(h.view), h.checksum))
        self.execute()
        if b is None:
            return False
        self.view(b)[:] = h.view
        return self.apply(PromoteCommit(b, prefetched))

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
            session_ops.prefetch(self, self.executor.take_prefetch())
            nbytes = self.apply(DramTick())
            if nbytes > 0:
                try:
                    self.demote(nbytes)
                except Exception:
                    log.exception("demotion failed")

    def session_tick(self, now: float) -> None:
        """Expire sessions (called every second by the demoter, or by a caller)."""
        self._next_tick = now + 1.0
        self.handle(SessionTick(now))
        session_ops.drain(self)

    def expire_due(self, now: float) -> None:
        """Without a demoter thread, expire sessions when a second has passed."""
        if self._demoter is None and now >= self._next_tick:
            self.session_tick(now)

    def _rebuild(self) -> None:
        """Index what LMDB holds (headers only); drop malformed entries."""
        assert self.ssd is not None
        bad: list[bytes] = []
        items: list[tuple[str, bytes, int, int]] = []
        t0 = time.monotonic()
        for raw, ns, key, header, _ in self.ssd.scan():
            if header is None:
                bad.append(raw)
                continue
            items.append((ns, key, header.size, self.ssd.footprint(header.size)))
            if len(items) >= _REBUILD_SLICE:
                self.apply(Rebuilt(items))
                items = []
        if bad:
            self.ssd.delete_raw(bad)
        self.apply(Rebuilt(items, len(bad)))
        log.info(
            "SSD tier: %d blocks (%d bytes) indexed in %.2fs, %d malformed dropped",
            len(self.ssd_index),
            self.ssd_index.used_bytes,
            time.monotonic() - t0,
            len(bad),
        )

    def hot_blocks(self) -> list[tuple[str, bytes, int]]:
        """(namespace, key, size) of every DRAM block, most recently used first (one
        snapshot under the lock; a drained worker's hand-off, worker/handoff.py)."""
        with self.lock:
            oldest = self.state.dram.oldest(1 << 62, include_pinned_ns=True)
        return [(b.ns, b.key, b.size) for b in reversed(oldest)]

    def ssd_keys(self) -> list[tuple[str, bytes]]:
        """Every key the SSD tier holds (one copy under the lock)."""
        return self.apply(SsdKeys())

    # ---- the same-host index ---------------------------------------------------

    def attach_shared(self, index: SharedIndex | None) -> None:
        """Mirror ready blocks into the same-host index (tiers.shared), or stop (None)."""
        self.apply(ShareIndex(index))

    def shared_upkeep(self, elsewhere: Callable[[bytes], int] | None = None) -> dict[bytes, int]:
        """Apply what same-host clients did through the index (tiers.shared): their
        logged reads move blocks up the LRU and count as hits and misses, and slots held
        for their pins are freed once no live page names them (``elsewhere``: what a
        client identity holds by other means, counted against its page's budget).
        Returns the bytes each identity's pages still hold. The logs are read and the
        pages scanned outside the store lock, the results applied under it a slice at a
        time: what clients write into their pages never holds the lock longer."""
        sh = self.state.dram.shared
        if sh is None:
            return {}
        logged = sh.drain()
        for i in range(0, len(logged), _UPKEEP_SLICE):
            self.apply(ApplyReads(logged[i : i + _UPKEEP_SLICE]))
        held = self.apply(HazardHeld())
        if not held:
            return {}
        plan = sh.reap_plan(held, elsewhere)
        if plan.free.any():
            self.apply(Reap(plan))
        return plan.held

    # ---- stats and shutdown ----------------------------------------------------

    def stats(self) -> StoreStats:
        """The counters now. Reads same-host clients made through the shared index
        (tiers.shared) are logged there and applied by the index upkeep; they are
        applied first, so a read already answered is always in ``hits``."""
        self.shared_upkeep()
        return snapshot(self.state)

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
                ssdwrites.write_staged(self)
                while time.monotonic() < deadline and self.state.dram.keys:
                    if not self.demote(DEMOTE_BATCH_BYTES, everything=True):
                        break
            except Exception:  # a failing disk must not keep the worker from exiting
                log.exception("shutdown: demotion to SSD failed")
            finally:
                self._stop.set()
                left = self.state.dram.keys
                if left:
                    log.warning("shutdown: %d DRAM blocks could not be demoted", left)
                self.ssd.close()
