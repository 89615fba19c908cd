"""The worker's tier state, as one synchronous state machine with no I/O.

:class:`TierState` holds what lives where: the DRAM tier's slots, pins and LRU order
(:class:`~.dram.DramTier`), the staged copies of evicted blocks on their way to SSD,
the SSD index, quotas, sessions, retention and budgets (:class:`~.policy.TierPolicy`),
and the counters. It has no threads, no sockets, no locks and does no I/O; the memory
it copies is the arena's (a staged copy of a block about to be evicted).

Its one entry point, :meth:`TierState.handle`, takes a stimulus
(:mod:`.stimuli`: a put reserved, a copy finished, a read, an SSD write done, a
heartbeat tick, a hint, a removal slice, ...) and returns the reply for the caller and
the instructions for the store (:data:`~.stimuli.Todo`: publish KV events, delete or
write on SSD, drop blocks, prefetch, walk cuts). The store
(:class:`~kvstore.worker.store.BlockStore`) is the only caller: it holds its lock around
each call and has its executor carry out the instructions after releasing it, as
dask's worker state machine is driven by its worker. Tests drive it with scripted
stimuli (tests/unit/test_tier_state.py).

Decisions about placement live in the policy; this class is the glue the store used to
run under its lock: it feeds the policy events, applies the instructions that only
touch DRAM bookkeeping at once (retain, release, evict first, tail first), and hands
back the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from kvstore_client.errors import QuotaExceeded, ResourceExhausted, SessionShareFull
from kvstore_client.wire import WHERE_ABSENT, WHERE_DRAM, WHERE_SSD

from ..events import DRAM, SSD  # KV-event medium names
from ..sessions import SessionTable
from . import stimuli as st
from .blocks import Block, Held, Staged, StoreCounters
from .budgets import Promoter, QuotaBook, Watermarks
from .dram import DramTier
from .policy import (
    Aborted,
    DeleteSsd,
    Demote,
    Drop,
    Event,
    Evicted,
    EvictFirst,
    Instruction,
    NeedDramRoom,
    NeedSsdRoom,
    Prefetch,
    Promote,
    Release,
    Removed,
    Reserved,
    Retain,
    SessionAdvance,
    SessionCut,
    SessionCutStep,
    SessionDrain,
    SsdBad,
    SsdHit,
    SsdWriteFailed,
    SsdWritten,
    TailFirst,
    Tick,
    TierPolicy,
    WriteSsd,
)
from .ssdindex import SsdIndex

R = TypeVar("R")

_SCALAR_KEYS = 16  # shorter lookups probe key by key (cheaper than one numpy pass)
_YIELD_ROUNDS = 8
_WALK_CUTS = st.WalkCuts()  # retained blocks asked to yield room for one new block, at most


class TierState:
    """What lives where on one worker, changed only by :meth:`handle`.

    ``slot(offset, size)`` is a view of the arena's bytes (for the staged copy of an
    evicted block and the views a read hands out); ``ssd_size`` None: no SSD tier;
    ``publish``: KV events are wanted (:class:`~.stimuli.Publish` instructions).
    """

    def __init__(
        self,
        arena_size: int,
        slab_size: int,
        slot: Callable[[int, int], memoryview],
        *,
        ssd_size: int | None = None,
        dram_marks: Watermarks | None = None,
        ssd_marks: Watermarks | None = None,
        promoter: Promoter | None = None,
        pins: dict[str, int] | None = None,
        tenant_quota: QuotaBook | None = None,
        sessions: SessionTable | None = None,
        retain_budget: int = 0,
        session_share: int = 0,
        session_order: str = "per-session",
        publish: bool = False,
    ) -> None:
        self.slot = slot
        self.quota = QuotaBook(pins or {})
        self.dram = DramTier(
            arena_size, slab_size, on_evict=self._on_evict, pinned=self.quota.quotas
        )
        has_ssd = ssd_size is not None
        self.policy = TierPolicy(
            has_ssd=has_ssd,
            ssd_capacity=ssd_size or 0,
            dram_marks=dram_marks,
            ssd_marks=ssd_marks,
            promoter=promoter,
            books=[self.quota, *([tenant_quota] if tenant_quota else [])],
            pinned=self.quota.quotas,
            charge_of=self.dram.slot_size_for,
            in_dram=self._held_outside_ssd,
            sessions=sessions,
            retain_budget=retain_budget,
            ssd_retain_budget=((ssd_size or 0) * retain_budget) // max(arena_size, 1),
            dram_size=self.dram.size_of,
            session_share=session_share,
            session_order=session_order,
        )
        self._sessions = self.policy.sessions
        self.ssd_size = ssd_size
        self.ssd_index: SsdIndex = self.policy.ssd
        self.staged: dict[st.Key, Staged] = {}
        self.counters = StoreCounters()
        self.publish = publish
        self._out: list[st.Todo] = []
        self._staging = False  # a WriteStaged is in this call's instructions
        self._handlers: dict[type, Callable[[Any], Any]] = {
            st.Present: self._present_stim,
            st.Where: self._where_stim,
            st.LeadingRun: self._leading_run,
            st.Sizes: self._sizes,
            st.Reserve: self._reserve,
            st.Commit: self._commit,
            st.Pin: self._pin,
            st.Unpin: self._unpin,
            st.SsdFound: self._ssd_found,
            st.SsdCorrupt: self._ssd_corrupt,
            st.Corrupt: self._corrupt,
            st.PromoteReserve: self._promote_reserve,
            st.PromoteCommit: self._promote_commit,
            st.Remove: self._remove,
            st.InboxMismatches: self._inbox_mismatches,
            st.DramTick: self._dram_tick,
            st.Publishing: self._publishing,
            st.ShareIndex: self._share_index,
            st.ApplyReads: self._apply_reads,
            st.HazardHeld: self._hazard_held,
            st.Reap: self._reap,
            st.StageBatch: self._stage_batch,
            st.StageWritten: self._stage_written,
            st.ForceSsdRoom: self._force_ssd_room,
            st.DemotePick: self._demote_pick,
            st.DemoteDone: self._demote_done,
            st.Rebuilt: self._rebuilt,
            st.SsdKeys: lambda _: list(self.ssd_index.entries),
            st.PrefetchRoom: self._prefetch_room,
            st.DramNamespaces: lambda _: self.dram.namespaces(),
            st.OffDramKeys: lambda _: [*self.ssd_index.entries, *self.staged],
            st.DramKeys: lambda s: self.dram.keys_of(s.ns, s.n),
            st.RecordCuts: self._record_cuts,
            st.CutStep: self._cut_step,
            st.Drain: self._drain,
            st.Advance: self._advance,
            st.SessionOwner: lambda s: self.policy.sessions.client_of(s.ns, s.session),
            st.SessionKnown: lambda s: self.policy.sessions.get(s.ns, s.session) is not None,
            st.Claim: self._claim,
            st.ChainOpen: self._chain_open,
            st.ChainNext: self._chain_next,
            st.ChainBytes: lambda s: self.policy.chain_bytes(s.ns, s.keys),
            st.SetRoom: self._set_room,
            st.RecordHits: lambda s: self.policy.sessions.record(
                s.ns, s.session, s.hits, s.lookups
            ),
            st.TakeCuts: lambda s: self.policy.take_cuts(s.ns, s.client),
            st.TakeClosedRates: self._take_closed_rates,
            st.SessionsReport: self._sessions_report,
        }

    # ---- the entry point -------------------------------------------------------------

    @property
    def kinds(self) -> frozenset[type]:
        """The stimulus types :meth:`handle` answers (besides the policy's events)."""
        return frozenset(self._handlers)

    @overload
    def handle(self, stim: st.Stimulus[R]) -> tuple[R, list[st.Todo]]: ...

    @overload
    def handle(self, stim: Event) -> tuple[None, list[st.Todo]]: ...

    def handle(self, stim: st.Stimulus[Any] | Event) -> tuple[Any, list[st.Todo]]:
        """Apply one stimulus (or one of the policy's events, which has no reply);
        returns its reply and what the store must do (in order)."""
        out: list[st.Todo] = []
        self._out = out
        self._staging = False
        fn = self._handlers.get(type(stim))
        if fn is not None:
            reply = fn(stim)
        elif isinstance(stim, st.Stimulus):
            raise TypeError(f"no handler for {type(stim).__name__}")
        else:
            reply = None
            self._follow(self.policy.handle(stim))
        if self._sessions.cutting:  # chains cut by blocks lost meanwhile
            out.append(_WALK_CUTS)
        return reply, out

    # ---- what the instructions say ---------------------------------------------------

    def _ev(self, stored: bool, medium: str, items: Sequence[st.Key]) -> None:
        if self.publish and items:
            self._out.append(st.Publish(stored, medium, items))

    def _follow(self, instructions: Iterable[Instruction]) -> None:
        """The policy's instructions: those on DRAM bookkeeping run now (each is a few
        array operations), the others go to the store."""
        out = self._out
        for ins in instructions:
            if isinstance(ins, DeleteSsd):
                out.append(ins)
                self._ev(False, SSD, ins.keys)
            elif isinstance(ins, Retain | Release):
                for k in ins.keys:
                    self.dram.retain(ins.ns, k, isinstance(ins, Retain))
            elif isinstance(ins, EvictFirst | TailFirst):
                move = self.dram.make_oldest if isinstance(ins, EvictFirst) else self.dram.touch
                for k in ins.keys:
                    move(ins.ns, k)
            elif isinstance(ins, Demote | Prefetch | Drop):
                out.append(ins)
            elif isinstance(ins, WriteSsd | Promote):  # pragma: no cover - not queued
                raise AssertionError(f"{ins} is handled where it is produced")

    def _on_evict(self, b: Block) -> None:
        """DRAM evicts on demand (inside a reservation, before the slot is reused)."""
        self._ev(False, DRAM, [(b.ns, b.key)])
        for ins in self.policy.handle(Evicted(b.ns, b.key, b.size)):
            if isinstance(ins, WriteSsd):
                # Copy now: the slot is handed to the new block as soon as this returns.
                self.staged[(b.ns, b.key)] = Staged(bytes(self.slot(b.offset, b.size)), b.checksum)
                if not self._staging:
                    self._staging = True
                    self._out.append(st.WriteStaged())
            elif isinstance(ins, Drop):  # not in the middle of a reservation: later
                self._out.append(ins)

    # ---- queries ---------------------------------------------------------------------

    def _held_outside_ssd(self, ns: str, key: bytes) -> bool:
        """DRAM or a staged copy holds it (the policy's 'is it still stored elsewhere')."""
        return self.dram.contains(ns, key) or (ns, key) in self.staged

    def _present(self, ns: str, key: bytes) -> bool:
        if type(key) is not bytes:
            key = bytes(key)  # any bytes-like key (the SSD and staged maps hash it)
        return (
            self.dram.contains(ns, key)
            or (ns, key) in self.ssd_index.entries
            or (ns, key) in self.staged
        )

    def _present_many(self, ns: str, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        if len(keys) < _SCALAR_KEYS:
            return np.array([self._present(ns, k) for k in keys], dtype=bool)
        flags = self.dram.ready_flags(ns, b"".join(keys), keys)
        if (len(self.ssd_index) or self.staged) and not flags.all():
            for i in np.flatnonzero(~flags).tolist():
                flags[i] = self._present(ns, keys[i])
        return flags

    def _present_stim(self, s: st.Present) -> npt.NDArray[np.bool_]:
        return self._present_many(s.ns, s.keys)

    def _off_dram(self, ns: str, key: bytes) -> bool:
        """On SSD or staged on its way there (a key DRAM does not hold)."""
        if type(key) is not bytes:
            key = bytes(key)
        return (ns, key) in self.ssd_index.entries or (ns, key) in self.staged

    def _where_one(self, ns: str, key: bytes) -> int:
        if self.dram.contains(ns, key):
            return WHERE_DRAM
        return WHERE_SSD if self._off_dram(ns, key) else WHERE_ABSENT

    def _where_stim(self, s: st.Where) -> npt.NDArray[np.uint8]:
        """:meth:`_present_many` telling the tiers apart, at its cost: one numpy probe
        of DRAM, then the SSD and staged maps for the keys it missed."""
        ns, keys = s.ns, s.keys
        if len(keys) < _SCALAR_KEYS:
            return np.array([self._where_one(ns, k) for k in keys], dtype=np.uint8)
        flags = self.dram.ready_flags(ns, b"".join(keys), keys)
        out = flags.astype(np.uint8)  # WHERE_DRAM where found, WHERE_ABSENT elsewhere
        if (len(self.ssd_index) or self.staged) and not flags.all():
            for i in np.flatnonzero(~flags).tolist():
                if self._off_dram(ns, keys[i]):
                    out[i] = WHERE_SSD
        return out

    def _leading_run(self, s: st.LeadingRun) -> int:
        ns, keys = s.ns, s.keys
        size = len(keys)
        # A cold chain misses its first key, and short lookups go key by key: neither
        # needs a batch probe.
        if size < _SCALAR_KEYS or not self._present(ns, keys[0]):
            return next((i for i, k in enumerate(keys) if not self._present(ns, k)), size)
        flags = self._present_many(ns, keys)
        return size if flags.all() else int(np.argmin(flags))

    def _sizes(self, s: st.Sizes) -> int:
        total = 0
        ns = s.ns
        for k in s.keys:
            b = self.dram.peek(ns, k)
            if b is not None:
                total += b.size
                continue
            staged = self.staged.get((ns, k))
            if staged is not None:
                total += len(staged.data)
                continue
            e = self.ssd_index.get(ns, k)
            if e is not None:
                total += e.size
        return total

    # ---- writes ----------------------------------------------------------------------

    def _reserve(self, s: st.Reserve) -> list[Block | ResourceExhausted | None]:
        ns, now = s.ns, s.now
        if self.policy.charges(ns):
            return [
                self._reserve_one(ns, k, size, c, s.hinted, now)
                for k, size, c in zip(s.keys, s.sizes, s.checksums, strict=True)
            ]
        return self._reserve_free(ns, s.keys, s.sizes, s.checksums, s.hinted, now)

    def _reserve_one(
        self, ns: str, k: bytes, size: int, c: int, hinted: bool, now: float | None
    ) -> Block | ResourceExhausted | None:
        if self.policy.on_ssd(ns, k) or (ns, k) in self.staged:
            self.dram.counters.skipped += 1
            return None
        if not self.policy.admits(ns, size):
            return QuotaExceeded(f"namespace {ns!r} is over its quota")
        if hinted and self._over_share(ns, k, size):
            return SessionShareFull(f"its session holds its share of worker memory ({ns!r})")
        try:
            b = self.dram.reserve(ns, k, size, c)
        except ResourceExhausted as e:
            r = self._reserve_yielding(ns, k, size, c, e, now)
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
        now: float | None,
    ) -> list[Block | ResourceExhausted | None]:
        """:meth:`_reserve_one` of each key of a namespace no quota counts: no quota to
        check or charge, the rest the same."""
        on_ssd, staged, reserve = self.policy.ssd, self.staged, self.dram.reserve
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
                out.append(self._reserve_yielding(ns, k, size, c, e, now))
        self.dram.counters.skipped += skipped
        return out

    def _reserve_yielding(
        self,
        ns: str,
        key: bytes,
        size: int,
        checksum: int,
        err: ResourceExhausted,
        now: float | None,
    ) -> Block | ResourceExhausted | None:
        """After DRAM found no room for a new block (``err``): retained session blocks
        yield (TierPolicy, ``NeedDramRoom``) and the reservation is tried again, a few
        times with more room asked each time; ``err`` (or the last one) when nothing
        yields."""
        want = self.policy.charge_of(size)
        for _ in range(_YIELD_ROUNDS):
            if not self.policy.retained:
                return err
            self._follow(self.policy.handle(NeedDramRoom(want, now)))
            try:
                return self.dram.reserve(ns, key, size, checksum)
            except ResourceExhausted as e:
                err, want = e, 2 * want
        return err

    def _over_share(self, ns: str, k: bytes, size: int) -> bool:
        """Is a new block declined because its session holds its share (see
        TierPolicy.session_admits)? A block already here is never counted."""
        return (
            bool(self.policy.session_share and self.policy.sessions.owner)
            and not self.dram.contains(ns, k)
            and not self.policy.session_admits(ns, k, size)
        )

    def _commit(self, s: st.Commit) -> list[bool]:
        # Committed last block first: a batch is a chain's run, and the block nearest
        # the chain's head must be the most recently used (CHAIN ORDER, store.py). KV
        # events keep the slice's order.
        blocks, checksums, dram = s.blocks, s.checksums, self.dram
        good = list(s.ok)
        live = self.policy.sessions.refs  # hinted sessions retain their new blocks
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            if good[i] and checksums is not None:
                good[i] = dram.set_checksum(b, checksums[i])
            if good[i]:
                dram.commit(b)
                if live:
                    self._follow(self.policy.committed(b.ns, b.key))
            else:
                dram.abort(b)
                self.policy.handle(Aborted(b.ns, b.size))
        if self.publish:
            self._ev(True, DRAM, [(b.ns, b.key) for b, g in zip(blocks, good, strict=True) if g])
        return good

    # ---- reads -----------------------------------------------------------------------

    def _count_hit(self) -> None:
        """A DRAM miss (already counted) that was found elsewhere."""
        self.dram.counters.hits += 1
        self.dram.counters.misses -= 1

    def _pin(self, s: st.Pin) -> st.Pinned:
        ns, keys, slot, staged = s.ns, s.keys, self.slot, self.staged
        held: list[Held | None] = []
        on_ssd: list[int] = []
        for i, b in enumerate(self.dram.acquire_many(ns, keys)):
            if b is not None:
                held.append(Held(slot(b.offset, b.size), b.checksum, b))
                continue
            k = keys[i]
            copy = staged.get((ns, k))
            if copy is not None:
                self._count_hit()
                held.append(Held(memoryview(copy.data), copy.checksum, None))
                continue
            held.append(None)
            if self.policy.on_ssd(ns, k):
                on_ssd.append(i)
        return st.Pinned(held, on_ssd)

    def _unpin(self, s: st.Unpin) -> None:
        self.dram.release_many(s.blocks)

    def _ssd_found(self, s: st.SsdFound) -> bool:
        self._count_hit()
        self.counters.ssd_hits += 1
        return bool(self.policy.handle(SsdHit(s.ns, s.key, s.now)))

    def _ssd_corrupt(self, s: st.SsdCorrupt) -> None:
        self.counters.checksum_errors += 1
        self._follow(self.policy.handle(SsdBad(s.ns, s.key)))

    def _corrupt(self, s: st.Corrupt) -> None:
        ns, key, h = s.ns, s.key, s.held
        self.counters.checksum_errors += 1
        self.dram.counters.hits -= 1
        self.dram.counters.misses += 1
        if h.block is not None:
            self.dram.remove(ns, key)
            self._ev(False, DRAM, [(ns, key)])
            self.dram.release(h.block)
            self._follow(self.policy.handle(Removed(ns, key, True, h.block.size)))
            h.block = None
        elif self.staged.pop((ns, key), None) is not None:
            self._follow(self.policy.handle(Removed(ns, key, True, len(h.view))))
        else:
            self._follow(self.policy.handle(SsdBad(ns, key)))

    def _promote_reserve(self, s: st.PromoteReserve) -> Block | None:
        if self.dram.contains(s.ns, s.key) or not self.policy.on_ssd(s.ns, s.key):
            return None
        try:
            return self.dram.reserve(s.ns, s.key, s.size, s.checksum)
        except ResourceExhausted:
            return None

    def _promote_commit(self, s: st.PromoteCommit) -> bool:
        b = s.block
        if self.policy.on_ssd(b.ns, b.key):  # still stored: not removed meanwhile
            self.dram.commit(b)
            self.counters.promotions += 1
            if s.prefetched:
                self.counters.prefetched += 1
            self._ev(True, DRAM, [(b.ns, b.key)])
            return True
        self.dram.abort(b)
        return False

    def _remove(self, s: st.Remove) -> int:
        ns, n = s.ns, 0
        for k in s.keys:
            b = self.dram.peek(ns, k)
            staged = self.staged.pop((ns, k), None)
            in_dram = b is not None or staged is not None
            size = b.size if b is not None else len(staged.data) if staged else 0
            if b is not None:
                self.dram.remove(ns, k)
                self._ev(False, DRAM, [(ns, k)])
            if in_dram or self.policy.on_ssd(ns, k):
                n += 1
                self._follow(self.policy.handle(Removed(ns, k, in_dram, size)))
        return n

    def _inbox_mismatches(self, s: st.InboxMismatches) -> None:
        self.counters.inbox_mismatches += s.n

    def _publishing(self, s: st.Publishing) -> None:
        self.publish = s.on

    def _dram_tick(self, s: st.DramTick) -> int:
        todo = self.policy.handle(Tick(self.dram.used_bytes, self.dram.capacity))
        return sum(ins.nbytes for ins in todo if isinstance(ins, Demote))

    # ---- the same-host index ---------------------------------------------------------

    def _share_index(self, s: st.ShareIndex) -> None:
        self.dram.shared = s.index

    def _apply_reads(self, s: st.ApplyReads) -> None:
        self.dram.apply_reads(s.logged)

    def _hazard_held(self, s: st.HazardHeld) -> list[Any]:
        sh = self.dram.shared
        return list(sh.held) if sh is not None else []

    def _reap(self, s: st.Reap) -> None:
        if self.dram.shared is not None:
            self.dram.shared.reap_apply(s.plan, self.dram.release)

    # ---- the SSD tier ----------------------------------------------------------------

    def _stage_batch(self, s: st.StageBatch) -> list[tuple[st.Key, Staged]]:
        batch = [(k, c) for k, c in self.staged.items() if not c.writing]
        for _, c in batch:
            c.writing = True
        return batch

    def _stage_written(self, s: st.StageWritten) -> None:
        staged = self.staged
        if s.written is None:
            failed = tuple((ns, k, len(c.data)) for (ns, k), c in s.batch)
            self._follow(self.policy.handle(SsdWriteFailed(failed, True, s.booked)))
            for held, c in s.batch:
                if staged.get(held) is c:
                    del staged[held]
            return
        done = []
        for (ns, key, size, stored), (_, c) in zip(s.written, s.batch, strict=True):
            live = staged.get((ns, key)) is c
            if live:
                del staged[(ns, key)]
            done.append((ns, key, size, stored, live))
        self._follow(self.policy.handle(SsdWritten(tuple(done), s.booked)))
        self._ev(True, SSD, [(d[0], d[1]) for d in done if d[4]])
        self.counters.demotions += len(done)

    def _force_ssd_room(self, s: st.ForceSsdRoom) -> bool:
        before = self.ssd_index.evictions
        self._follow(self.policy.handle(NeedSsdRoom(s.nbytes, force=True)))
        return self.ssd_index.evictions > before

    def _demote_pick(self, s: st.DemotePick) -> st.DemoteBatch:
        dram, policy = self.dram, self.policy
        batch = dram.oldest(s.nbytes, include_pinned_ns=s.everything)
        batch = [b for b in batch if dram.pin(b)]
        dead = {b.slot for b in batch if policy.dead(b.ns, b.key)}  # no copy
        todo = [b for b in batch if not (b.slot in dead or policy.on_ssd(b.ns, b.key))]
        return st.DemoteBatch(batch, dead, todo)

    def _demote_done(self, s: st.DemoteDone) -> int:
        dram, policy, written, todo = self.dram, self.policy, s.written, s.batch.todo
        if written is None:
            failed = tuple((b.ns, b.key, b.size) for b in todo)
            self._follow(policy.handle(SsdWriteFailed(failed, False, s.booked)))
        else:
            live = [b.ready and not b.doomed for b in todo]
            done = tuple(
                (ns, key, size, stored, ok)
                for (ns, key, size, stored), ok in zip(written, live, strict=True)
            )
            self._follow(policy.handle(SsdWritten(done, s.booked)))
            self._ev(True, SSD, [(d[0], d[1]) for d in done if d[4]])
            self.counters.demotions += sum(live)
        moved = 0
        dead = s.batch.dead
        for b in s.batch.blocks:
            dram.release(b)
            gone = b.slot in dead and policy.dead(b.ns, b.key)  # evict, no copy
            skip = not gone and (b.slot in dead or written is None)
            if skip or not b.ready or b.doomed:
                continue
            if gone:
                self._follow(policy.handle(Evicted(b.ns, b.key, b.size)))
            policy.forget(b.ns, b.key)
            dram.remove(b.ns, b.key)  # now on SSD (or dead): not a removal
            self._ev(False, DRAM, [(b.ns, b.key)])
            moved += b.size
        return moved

    def _rebuilt(self, s: st.Rebuilt) -> None:
        for ns, key, size, stored in s.items:
            self.policy.rebuilt(ns, key, size, stored)
        self.counters.checksum_errors += s.malformed

    def _prefetch_room(self, s: st.PrefetchRoom) -> int:
        return int(self.policy.dram_marks.low * self.dram.capacity) - self.dram.used_bytes

    # ---- sessions --------------------------------------------------------------------

    def _record_cuts(self, s: st.RecordCuts) -> None:
        # recording a cut is a few dictionary operations
        for name, depth, turn in s.cuts:
            self._follow(self.policy.handle(SessionCut(s.ns, name, depth, turn, s.client)))

    def _cut_step(self, s: st.CutStep) -> bool:
        if not self.policy.sessions.cutting:
            return False
        self._follow(self.policy.handle(SessionCutStep(s.n)))
        return True

    def _drain(self, s: st.Drain) -> bool:
        if not self.policy.sessions.dropping:
            return False
        self._follow(self.policy.handle(SessionDrain(s.n)))
        return True

    def _advance(self, s: st.Advance) -> bool:
        if not self.policy.sessions.moving(s.ns, s.session):
            return False
        self._follow(self.policy.handle(SessionAdvance(s.ns, s.session, s.n)))
        return True

    def _claim(self, s: st.Claim) -> str:
        verdict, todo = self.policy.claim(s.ns, s.session, s.client, s.shown, s.whole)
        self._follow(todo)
        return verdict

    def _chain_open(self, s: st.ChainOpen) -> Any:
        found = self.policy.sessions.get(s.ns, s.session)
        if found is None or found.state == "ended" or found.client != s.client:
            return None
        return iter(found.keys)

    def _chain_next(self, s: st.ChainNext) -> list[bytes] | None:
        try:
            return list(islice(s.cursor, s.n))
        except RuntimeError:  # the chain grew (or ended) meanwhile
            return None

    def _set_room(self, s: st.SetRoom) -> None:
        found = self.policy.sessions.get(s.ns, s.session)
        if found is not None and found.state != "ended":
            found.room = s.room

    def _take_closed_rates(self, s: st.TakeClosedRates) -> list[float]:
        table = self.policy.sessions
        closed, table.closed_rates = table.closed_rates, []
        return closed

    def _sessions_report(self, s: st.SessionsReport) -> st.SessionsView:
        table, owns = self.policy.sessions, s.owns
        mine = [x for x in table.top(len(table)) if owns is None or owns(x.ns)]
        c = table.counters
        return st.SessionsView(
            sessions=[
                st.SessionInfo(
                    x.ns,
                    x.name,
                    x.state,
                    len(x.keys),
                    x.hit_blocks,
                    x.lookup_blocks,
                    max(0.0, x.expires - s.now),
                )
                for x in mine[: s.limit]
            ],
            live=len(mine),
            dropped=c.dropped,
            expired=c.expired,
            retained_bytes=self.policy.retained_bytes,
            retain_budget=self.policy.retain_budget,
            prefetched=self.counters.prefetched,
            blocks_refused=c.blocks_refused,
            cuts_refused=c.cuts_refused,
            hints_refused=c.hints_refused,
            moved=c.moved,
            restarted=c.restarted,
        )
