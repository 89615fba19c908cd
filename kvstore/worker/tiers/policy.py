"""Tiering policy and SSD bookkeeping, as synchronous state machines with no I/O.

:class:`TierPolicy` is the only place that decides placement: the store feeds it
events (a block reserved, evicted, read from SSD, written to SSD, removed; a
tick) under its lock and gets instructions back (write to SSD, delete from SSD,
promote, demote), which it executes with the LMDB I/O outside the lock. It also
keeps the quota books (a block is charged once, by the slot bytes it occupies,
whichever tiers hold it, and refunded when it leaves the last tier) and the SSD
index. ``policy.handle(event) == [instructions]`` is tested without threads.

The worker alone decides where blocks live:
- DRAM above its high watermark (default 95%): demote least recently used blocks
  to SSD in background batches until DRAM is down to the low watermark (85%);
- SSD above its high watermark: evict its least recently used blocks down to
  the low watermark;
- a block read from SSD is promoted back to DRAM on its second hit within a
  window (``promote="second-hit"``), on every hit (``"always"``) or never.
Blocks of pinned namespaces are never demoted or evicted; each pinned namespace
has a byte quota.

Sessions (hints from the engine, bookkept by :class:`~kvstore.worker.sessions.SessionTable`):
- a paused session's blocks are *retained*: kept out of DRAM's LRU lists (so neither
  evicted nor demoted) within ``retain_budget`` bytes of DRAM, the leading blocks of
  its chain first; the rest are demoted to SSD like any block, and on SSD a paused
  session's blocks are evicted only when nothing else is left to evict;
- an ended session's blocks that no live session holds go to the evicting end of
  the DRAM and SSD LRU orders (first eviction candidates);
- an active session's blocks are retained too, as soon as they are written
  (:meth:`TierPolicy.committed`) or listed, within the same budget;
- retention yields to writes: when DRAM has no other room for a new block, retained
  blocks go back to the evicting end of the LRU list (``NeedDramRoom``), a session at
  a time, each from its tail, in :mod:`.retention`'s order (by default the session,
  running or paused, likely back last first), so a large ``retain_budget``
  never makes a put fail;
- a paused session's chain is reordered in DRAM's LRU, last block first, so that
  eviction takes its tail before its head (a prefix match stops at the first gap);
- when a paused session resumes (an ``active`` hint, or a lookup of its blocks) its
  blocks on SSD only are prefetched into DRAM (up to ``retain_budget`` bytes), and its
  retained blocks stay retained while its turn runs (the engine reads them after its
  lookup, often after waiting in its queue); they are released when it ends or expires.

The tiers are inclusive: a promoted block keeps its SSD copy, so demoting it
again costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..cutnotices import CutNotices
from ..sessions import MOVED, RESTARTED, Change, Session, SessionTable
from .budgets import Promoter, QuotaBook, Watermarks
from .retention import Retention
from .ssdindex import SsdIndex

# ---- the policy state machine ------------------------------------------------------
# Events (the store reports what happened) ...


@dataclass(frozen=True, slots=True)
class Reserved:
    """A DRAM slot was reserved for a new block (not a promotion): charge its quota."""

    ns: str
    size: int


@dataclass(frozen=True, slots=True)
class Aborted:
    """A reserved block's bytes never arrived: refund it."""

    ns: str
    size: int


@dataclass(frozen=True, slots=True)
class Evicted:
    """DRAM evicted a block on demand (its bytes are still in the arena, for now)."""

    ns: str
    key: bytes
    size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """A caller removed a block; ``in_dram``: the DRAM tier held it."""

    ns: str
    key: bytes
    in_dram: bool
    size: int


@dataclass(frozen=True, slots=True)
class SsdWritten:
    """Blocks reached LMDB: (ns, key, payload size, stored bytes, still live);
    ``reserved``: the bytes its :class:`NeedSsdRoom` booked, now given back."""

    items: tuple[tuple[str, bytes, int, int, bool], ...]
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class SsdWriteFailed:
    """Blocks could not be written to SSD; ``evicted``: DRAM had already let them go;
    ``reserved``: the bytes its :class:`NeedSsdRoom` booked, now given back."""

    items: tuple[tuple[str, bytes, int], ...]
    evicted: bool
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class SsdHit:
    ns: str
    key: bytes
    now: float


@dataclass(frozen=True, slots=True)
class SsdBad:
    """An SSD entry failed its checksum or header check."""

    ns: str
    key: bytes


@dataclass(frozen=True, slots=True)
class NeedSsdRoom:
    """About to write ``nbytes`` (headers included) to SSD; ``force``: LMDB said it is
    full, so evict ``nbytes`` of least recently used blocks whatever the watermarks say.

    Writers ask under the store's lock and write outside it, so an unforced request
    books its ``nbytes`` as in flight (:attr:`SsdIndex.pending`) and counts what other
    writers have booked; the writer's :class:`SsdWritten` or :class:`SsdWriteFailed`
    gives the booking back (its ``reserved``)."""

    nbytes: int
    force: bool = False


@dataclass(frozen=True, slots=True)
class NeedDramRoom:
    """DRAM could not find room for a new block of ``nbytes``: give up retained blocks
    (``now``: the clock of the session hints; None: the last hint's time)."""

    nbytes: int
    now: float | None = None


@dataclass(frozen=True, slots=True)
class Tick:
    """Periodic: how full DRAM is."""

    dram_used: int
    dram_capacity: int


@dataclass(frozen=True, slots=True)
class SessionHint:
    """A session hint (validated by the caller with :func:`check_hint`)."""

    ns: str
    session: str
    state: str
    keys: tuple[bytes, ...]
    ttl: float | None
    now: float
    measure: bool = True  # measure the session's room now (False: the caller does, in slices)
    depths: tuple[int, ...] = ()  # each key's depth in the whole chain (empty: not known)
    client: bytes = b""  # the sender's identity (b"": an old client that sends none)


@dataclass(frozen=True, slots=True)
class SessionAdvance:
    """Move up to ``n`` more keys of a session's pending state change."""

    ns: str
    session: str
    n: int


@dataclass(frozen=True, slots=True)
class SessionDrain:
    """Give up up to ``n`` more keys of sessions that left the table (SessionTable.drain)."""

    n: int


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """A slice of a long hint's hashes, added in the session's current state."""

    ns: str
    session: str
    keys: tuple[bytes, ...]
    now: float
    depths: tuple[int, ...] = ()
    client: bytes = b""


@dataclass(frozen=True, slots=True)
class SessionCut:
    """Another worker lost the session's block at ``depth`` during its ``turn``-th
    active hint (a cut notice ``client`` carried here): its deeper blocks here are
    dead, if the session is ``client``'s (SessionTable.cut_from). Only records the
    cut: :class:`SessionCutStep` walks it."""

    ns: str
    session: str
    depth: int
    turn: int
    client: bytes = b""


@dataclass(frozen=True, slots=True)
class SessionCutStep:
    """Walk up to ``n`` more keys of the recorded cuts (SessionTable.cut_step): the
    blocks found past a cut are dropped (:class:`Drop`)."""

    n: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Blocks were looked up (exists / match_prefix): may resume a paused session."""

    ns: str
    keys: tuple[bytes, ...]
    now: float


@dataclass(frozen=True, slots=True)
class SessionTick:
    """Periodic: expire sessions."""

    now: float


Event = (
    Reserved
    | Aborted
    | Evicted
    | Removed
    | SsdWritten
    | SsdWriteFailed
    | SsdHit
    | SsdBad
    | NeedSsdRoom
    | NeedDramRoom
    | Tick
    | SessionHint
    | SessionKeys
    | SessionAdvance
    | SessionDrain
    | SessionCut
    | SessionCutStep
    | Lookup
    | SessionTick
)

# ... and instructions (what the store must do, outside its lock).


@dataclass(frozen=True, slots=True)
class WriteSsd:
    """Copy this evicted block's bytes now (before the slot is reused), write them later."""

    ns: str
    key: bytes


@dataclass(frozen=True, slots=True)
class DeleteSsd:
    keys: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class Promote:
    ns: str
    key: bytes


@dataclass(frozen=True, slots=True)
class Demote:
    nbytes: int


@dataclass(frozen=True, slots=True)
class Retain:
    """Keep these DRAM blocks out of the LRU lists (a paused session holds them)."""

    ns: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Release:
    """Put these retained DRAM blocks back on the LRU lists (most recently used end)."""

    ns: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class EvictFirst:
    """Move these DRAM blocks to the evicting end of their LRU list."""

    ns: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class TailFirst:
    """Touch these DRAM blocks in this order (a paused chain, last block first), so
    LRU eviction takes the chain's tail before its head."""

    ns: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Drop:
    """Remove these blocks from every tier (a live session's chain lost a shallower
    block: a prefix match cannot reach them; outside the lock)."""

    ns: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Copy these SSD-only blocks into DRAM (outside the lock)."""

    ns: str
    keys: tuple[bytes, ...]


Instruction = (
    WriteSsd
    | DeleteSsd
    | Promote
    | Demote
    | Retain
    | Release
    | EvictFirst
    | TailFirst
    | Prefetch
    | Drop
)


@dataclass(slots=True)
class PolicyCounters:
    ssd_write_errors: int = 0
    evicted_lost: int = 0  # DRAM evictions that left no SSD copy (ended sessions' too)
    retain_refused: int = 0  # paused sessions' DRAM blocks over the retain budget
    share_declined: int = 0  # new blocks of a session already holding its share
    retain_yielded: int = 0  # retained DRAM blocks given back to make room for writes
    cut_dropped: int = 0  # live sessions' blocks dropped: a shallower block was lost


class TierPolicy:
    """Placement and accounting for one worker's tiers (see the module docstring).

    ``charge_of(size)`` is what a block of ``size`` payload bytes costs (its DRAM slot
    size); ``in_dram(ns, key)`` asks the DRAM tier (both are pure and run under the
    store's lock, as does every :meth:`handle`).
    """

    def __init__(
        self,
        *,
        has_ssd: bool,
        ssd_capacity: int = 0,
        dram_marks: Watermarks | None = None,
        ssd_marks: Watermarks | None = None,
        promoter: Promoter | None = None,
        books: Sequence[QuotaBook] = (),
        pinned: Iterable[str] = (),
        charge_of: Callable[[int], int] = lambda n: n,
        in_dram: Callable[[str, bytes], bool] = lambda ns, key: False,
        sessions: SessionTable | None = None,
        retain_budget: int = 0,
        ssd_retain_budget: int = 0,
        dram_size: Callable[[str, bytes], int] = lambda ns, key: 0,
        session_share: int = 0,
        session_order: str = "per-session",
    ) -> None:
        self.has_ssd = has_ssd
        self.ssd = SsdIndex(ssd_capacity if has_ssd else 0, pinned=pinned)
        self.dram_marks = dram_marks or Watermarks()
        self.ssd_marks = ssd_marks or Watermarks()
        self.promoter = promoter or Promoter()
        self.books = list(books)
        self.charge_of = charge_of
        self.in_dram = in_dram
        self.counters = PolicyCounters()
        self.sessions = sessions if sessions is not None else SessionTable()
        self.retention = Retention(retain_budget, session_order)
        self.ssd_retain_budget = ssd_retain_budget  # SSD bytes of paused sessions spared
        self.dram_size = dram_size  # payload bytes of a block in DRAM, 0 when not there
        self.session_share = session_share  # bytes one hinted session may hold; 0: no limit
        self.orphans: set[tuple[str, bytes]] = set()  # ended sessions' DRAM-only blocks
        self.cut_notices = CutNotices()  # chains cut here, for their clients to carry

    # ---- queries -----------------------------------------------------------------

    @property
    def retain_budget(self) -> int:
        return self.retention.budget

    @property
    def retained(self) -> dict[tuple[str, bytes], int]:
        """DRAM blocks live sessions keep off the LRU lists -> their bytes."""
        return self.retention.blocks

    @property
    def retained_bytes(self) -> int:
        return self.retention.nbytes

    def admits(self, ns: str, size: int) -> bool:
        """Would a new block of ``size`` bytes in ``ns`` fit every quota?"""
        cost = self.charge_of(size)
        return all(q.admits(ns, cost) for q in self.books)

    def on_ssd(self, ns: str, key: bytes) -> bool:
        return (ns, key) in self.ssd

    def charges(self, ns: str) -> bool:
        """Does any quota book count ``ns``? When not, :meth:`admits` is True and
        ``Reserved`` / ``Aborted`` change nothing for it (callers may skip both)."""
        return any(q.tracks(ns) for q in self.books)

    # ---- events ------------------------------------------------------------------

    def handle(self, ev: Event) -> list[Instruction]:
        """Apply one event; returns what the store must do about it."""
        if isinstance(ev, Reserved):
            self._charge(ev.ns, ev.size, +1)
        elif isinstance(ev, Aborted):
            self._charge(ev.ns, ev.size, -1)
        elif isinstance(ev, Evicted):
            if (ev.ns, ev.key) in self.ssd:
                self.orphans.discard((ev.ns, ev.key))
                return []
            gone = self.dead(ev.ns, ev.key)  # an ended session's: drop, no SSD copy
            self.orphans.discard((ev.ns, ev.key))
            if self.has_ssd and not gone:
                return [WriteSsd(ev.ns, ev.key)]
            self.counters.evicted_lost += 1
            self._charge(ev.ns, ev.size, -1)
            return self._lost(ev.ns, ev.key)
        elif isinstance(ev, Removed):
            self._unretain(ev.ns, ev.key)
            self.orphans.discard((ev.ns, ev.key))
            e = self.ssd.remove(ev.ns, ev.key)
            if ev.in_dram or e is not None:
                self._charge(ev.ns, ev.size if ev.in_dram or e is None else e.size, -1)
            if e is not None:
                return [DeleteSsd(((ev.ns, ev.key),))]
        elif isinstance(ev, SsdWritten):
            dead: list[tuple[str, bytes]] = []
            for ns, key, size, stored, live in ev.items:
                if live:
                    self.ssd.add(ns, key, size, stored)
                else:  # removed while being written: must not come back
                    dead.append((ns, key))
            self.ssd.unbook(ev.reserved)
            return [DeleteSsd(tuple(dead))] if dead else []
        elif isinstance(ev, SsdWriteFailed):
            self.ssd.unbook(ev.reserved)
            self.counters.ssd_write_errors += 1
            if ev.evicted:
                for ns, key, size in ev.items:
                    if (ns, key) not in self.ssd and not self.in_dram(ns, key):
                        self.counters.evicted_lost += 1
                        self._charge(ns, size, -1)
        elif isinstance(ev, SsdHit):
            self.ssd.touch(ev.ns, ev.key)
            if self.promoter.on_hit(ev.ns, ev.key, ev.now):
                return [Promote(ev.ns, ev.key)]
        elif isinstance(ev, SsdBad):
            return self._drop_ssd([(ev.ns, ev.key)])
        elif isinstance(ev, NeedSsdRoom):
            if ev.force:
                excess = ev.nbytes
            else:
                ssd = self.ssd
                excess = self.ssd_marks.excess(
                    ssd.used_bytes + ssd.pending + ev.nbytes, ssd.capacity
                )
                ssd.pending += ev.nbytes
            if excess > 0:
                victims = self.ssd.victims(
                    excess, self.sessions.is_protected, self.ssd_retain_budget
                )
                self.ssd.evictions += len(victims)
                return self._drop_ssd(victims)
        elif isinstance(ev, NeedDramRoom):
            return self._yield_retained(ev.nbytes, ev.now)
        elif isinstance(ev, Tick) and self.has_ssd:
            excess = self.dram_marks.excess(ev.dram_used, ev.dram_capacity)
            if excess > 0:
                return [Demote(excess)]
        elif isinstance(ev, SessionHint):
            out = self._changes(
                self.sessions.hint(
                    ev.ns,
                    ev.session,
                    ev.state,
                    ev.keys,
                    ev.ttl,
                    ev.now,
                    ev.depths,
                    client=ev.client,
                )
            )
            if ev.measure:
                self._measure_room(ev.ns, ev.session)
            return out
        elif isinstance(ev, SessionKeys):
            return self._changes(
                self.sessions.add_keys(ev.ns, ev.session, ev.keys, ev.now, ev.depths, ev.client)
            )
        elif isinstance(ev, SessionCut):
            self.sessions.cut_from(ev.ns, ev.session, ev.depth, ev.turn, ev.client)
        elif isinstance(ev, SessionCutStep):
            ns, walked = self.sessions.cut_step(ev.n)
            ssd = self.ssd
            tails = tuple(k for k in walked if self.in_dram(ns, k) or (ns, k) in ssd)
            self.counters.cut_dropped += len(tails)
            return [Drop(ns, tails)] if tails else []
        elif isinstance(ev, SessionAdvance):
            return self._changes(self.sessions.advance(ev.ns, ev.session, ev.n))
        elif isinstance(ev, SessionDrain):
            return self._changes(self.sessions.drain(ev.n))
        elif isinstance(ev, Lookup):
            return self._changes(self.sessions.lookup(ev.ns, ev.keys, ev.now))
        elif isinstance(ev, SessionTick):
            return self._changes(self.sessions.tick(ev.now))
        return []

    def _lost(self, ns: str, key: bytes) -> list[Instruction]:
        """A block left the last tier: when one live session alone holds it, that
        session's deeper blocks are dead (a cut, walked by :class:`SessionCutStep`),
        and a notice is kept for the session's client to carry to the other workers
        (:meth:`take_cuts`)."""
        sessions = self.sessions
        if sessions.refs.get((ns, key), 0) != 1:
            return []
        s = sessions.by_sid.get(sessions.owner.get((ns, key), -1))
        depth = s.keys.get(key, -1) if s is not None else -1
        if s is None or depth < 0:
            return []
        self._cut(s, depth)
        return []

    def _cut(self, s: Session, depth: int) -> None:
        if depth < s.cut:
            self.cut_notices.add(s.ns, s.name, depth, s.turn, s.client)
        self.sessions.cut(s, depth)

    def take_cuts(self, ns: str, client: bytes) -> list[tuple[str, int, int]]:
        """The cut notices of namespace ``ns`` not taken yet whose sessions are
        ``client``'s: (session, depth, turn). Nobody else gets them."""
        return self.cut_notices.take(ns, client)

    def claim(
        self, ns: str, session: str, client: bytes, shown: Mapping[bytes, int], whole: bool
    ) -> tuple[str, list[Instruction]]:
        """May ``client``'s hint change the session (SessionTable.claim)? Its notice
        follows the session to its new client; a session that starts over has none."""
        verdict, changes = self.sessions.claim(ns, session, client, shown, whole)
        if verdict == MOVED:
            self.cut_notices.move(ns, session, client)
        elif verdict == RESTARTED:
            self.cut_notices.forget(ns, session)
        return verdict, self._changes(changes)

    def _yield_retained(self, nbytes: int, now: float | None = None) -> list[Instruction]:
        """Un-retain at least ``nbytes`` of DRAM blocks in :mod:`.retention`'s order
        (by default the session likely back last first, each chain from its tail);
        they go to the evicting end of the LRU order (Release, then EvictFirst, tail
        last so that it is evicted first)."""
        out: list[Instruction] = []
        for ns, keys in self.retention.give_way(nbytes, self.sessions, now).items():
            self.counters.retain_yielded += len(keys)
            out += [Release(ns, tuple(keys)), EvictFirst(ns, tuple(keys))]
        return out

    def committed(self, ns: str, key: bytes) -> list[Instruction]:
        """A new block is ready in DRAM: a live session that listed it retains it (a
        turn's new blocks are the next turn's prefix)."""
        sessions = self.sessions
        if (ns, key) not in sessions.refs or (ns, key) in self.retention:
            return []
        s = sessions.by_sid.get(sessions.owner.get((ns, key), -1))
        if s is None or s.state == "ended":
            return []
        kept = self._retain(ns, (key,), (s.ns, s.name))
        return [Retain(ns, tuple(kept))] if kept else []

    def _retain(self, ns: str, keys: Iterable[bytes], holder: tuple[str, str]) -> list[bytes]:
        """Retain those of ``keys`` in DRAM and not retained yet, within the budget."""
        kept: list[bytes] = []
        r = self.retention
        for k in keys:
            size = self.dram_size(ns, k)
            if not size or (ns, k) in r:
                continue
            if not r.fits(size):
                self.counters.retain_refused += 1
                continue
            r.keep((ns, k), size, holder)
            kept.append(k)
        return kept

    def _changes(self, changes: Sequence[Change]) -> list[Instruction]:
        """Session changes -> retain / release / evict-first / prefetch instructions."""
        out: list[Instruction] = []
        for ch in changes:
            ns = ch.ns
            # A resumed session keeps what it retained while its turn runs: the engine
            # reads the blocks after its lookup, often after waiting in its queue, and
            # on the LRU list meanwhile they would be the next writes' victims. They
            # go back when the session ends or expires (below), or yield to a write.
            running = set(ch.resumed)
            gone = set(ch.orphaned)
            released = [
                k
                for k in (*ch.unprotect, *ch.orphaned)
                if (k in gone or k not in running) and self._unretain(ns, k)
            ]
            if released:
                out.append(Release(ns, tuple(released)))
            keep = self._retain(ns, (*ch.protect, *ch.live), (ns, ch.session))
            if ch.tail_first:
                # The SSD order too: a prefix match stops at the first gap, so a
                # chain's tail must leave either tier before its head.
                for k in ch.tail_first:
                    self.ssd.touch(ns, k)
                out.append(TailFirst(ns, tuple(ch.tail_first)))
            if keep:
                out.append(Retain(ns, tuple(keep)))
            if ch.orphaned:
                for k in ch.orphaned:
                    self.ssd.make_oldest(ns, k)
                    if self.has_ssd and (ns, k) not in self.ssd and self.dram_size(ns, k):
                        self.orphans.add((ns, k))
                out.append(EvictFirst(ns, tuple(ch.orphaned)))
            fetch: list[bytes] = []
            room = self.retain_budget
            for k in ch.resumed:
                e = self.ssd.get(ns, k)
                if e is None or self.in_dram(ns, k):
                    continue
                if e.size > room:
                    break
                room -= e.size
                fetch.append(k)
            if fetch:
                out.append(Prefetch(ns, tuple(fetch)))
        return out

    def session_admits(self, ns: str, key: bytes, size: int) -> bool:
        """May a new block be stored? Not when the one live session that listed it
        already holds its share (``session_share`` bytes) of this worker's tiers: one
        session whose chain outgrows the worker would otherwise push every other
        session out, and itself too, from the head (its blocks are written head first).
        Declined blocks are the chain's deepest, so its head stays. Blocks no session
        listed, or shared by several live sessions, are always admitted."""
        if self.session_share <= 0:
            return True
        owners = self.sessions
        sid = owners.owner.get((ns, key))
        if sid is None or owners.refs.get((ns, key), 0) > 1:
            return True
        s = owners.by_sid.get(sid)
        if s is None or s.room < 0:
            return True
        if s.room < size:
            self.counters.share_declined += 1
            return False
        s.room -= size
        return True

    def chain_bytes(self, ns: str, keys: Sequence[bytes]) -> int:
        """Bytes these blocks of a chain occupy in DRAM, else on SSD."""
        held = 0
        for k in keys:
            size = self.dram_size(ns, k)
            if not size:
                e = self.ssd.get(ns, k)
                size = e.size if e is not None else 0
            held += size
        return held

    def _measure_room(self, ns: str, name: str) -> None:
        """After a hint: what the session may still add within its share. Counted over
        its chain, in order, up to the share (so a hint costs at most one pass)."""
        s = self.sessions.get(ns, name)
        if s is None or self.session_share <= 0 or s.state == "ended":
            return
        held = 0
        for k in s.keys:
            size = self.dram_size(ns, k)
            if not size:
                e = self.ssd.get(ns, k)
                size = e.size if e is not None else 0
            held += size
            if held >= self.session_share:
                break
        s.room = max(0, self.session_share - held)

    def dead(self, ns: str, key: bytes) -> bool:
        """Is this DRAM block an ended session's that no live session holds now? Its
        eviction drops it instead of writing it to SSD (nobody will ask for it; a copy
        would push live blocks off the SSD)."""
        return (ns, key) in self.orphans and (ns, key) not in self.sessions.refs

    def forget(self, ns: str, key: bytes) -> None:
        """The block left DRAM by demotion (its SSD copy was written or it was dropped)."""
        self.orphans.discard((ns, key))

    def _unretain(self, ns: str, key: bytes) -> bool:
        return self.retention.drop((ns, key))

    def _drop_ssd(self, keys: Sequence[tuple[str, bytes]]) -> list[Instruction]:
        gone: list[tuple[str, bytes]] = []
        out: list[Instruction] = []
        for ns, key in keys:
            e = self.ssd.remove(ns, key)
            if e is None:
                continue
            gone.append((ns, key))
            if not self.in_dram(ns, key):  # it left the last tier
                self._charge(ns, e.size, -1)
                out += self._lost(ns, key)
        return ([DeleteSsd(tuple(gone))] if gone else []) + out

    def _charge(self, ns: str, size: int, sign: int) -> None:
        cost = self.charge_of(size)
        for q in self.books:
            if sign > 0:
                q.charge(ns, cost)
            else:
                q.refund(ns, cost)

    def rebuilt(self, ns: str, key: bytes, size: int, stored: int) -> None:
        """Start-up: LMDB holds this block (charged once)."""
        if (ns, key) not in self.ssd:
            self.ssd.add(ns, key, size, stored)
            self._charge(ns, size, +1)
