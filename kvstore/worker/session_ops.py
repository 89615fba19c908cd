"""The store's side of agent sessions: a hint and a prefetch run through a BlockStore.

The decisions live in the pure state machines (:mod:`kvstore.worker.sessions`, the
tier policy); these two functions only feed them events under the store's lock and
do the I/O they ask for outside it, like the rest of
:class:`~kvstore.worker.store.BlockStore`. They see the store through
:class:`SessionHost`, which BlockStore is structurally, so this module does not import
the store (the store imports it: no import circle).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

import xxhash

from kvstore_client.errors import InvalidArgument, ResourceExhausted

from .fairlock import FairLock
from .sessions import REFUSED, check_hint
from .storerecords import LOOKUP_SLICES, Held, StoreCounters, _Todo
from .tiers.blocks import Block
from .tiers.dram import DramTier
from .tiers.policy import (
    Instruction,
    NeedDramRoom,
    SessionAdvance,
    SessionCut,
    SessionCutStep,
    SessionDrain,
    SessionHint,
    SessionKeys,
    TierPolicy,
)
from .tiers.ssd import SsdStore


class SessionHost(Protocol):
    """What a hint and a prefetch need of a BlockStore: its lock, its state machines
    and tiers, and the two halves of its instruction loop (queue under the lock,
    execute outside it)."""

    lock: FairLock
    policy: TierPolicy
    tier: DramTier
    ssd: SsdStore | None
    slice_keys: int
    counters: StoreCounters
    _todo: _Todo
    _stop: threading.Event
    _cut_walker: threading.Lock
    _demoter: threading.Thread | None
    _next_tick: float

    def match_prefix(self, ns: str, keys: Sequence[bytes], state_ns: str = "") -> int: ...
    def session_tick(self, now: float) -> None: ...
    def _queue(self, instructions: Sequence[Instruction]) -> None: ...
    def _execute(self) -> None: ...
    def _bad_ssd(self, ns: str, key: bytes) -> None: ...
    def _promote(self, ns: str, key: bytes, h: Held) -> bool: ...


def reserve_yielding(
    store: SessionHost, ns: str, key: bytes, size: int, checksum: int, err: ResourceExhausted
) -> Block | ResourceExhausted | None:
    """After DRAM found no room for a new block (``err``): retained session blocks
    yield (TierPolicy, ``NeedDramRoom``) and the reservation is tried again, a few
    times with more room asked each time; ``err`` (or the last one) when nothing
    yields. Caller holds the lock."""
    want = store.policy.charge_of(size)
    for _ in range(8):
        if not store.policy.retained:
            return err
        store._queue(store.policy.handle(NeedDramRoom(want, time.monotonic())))
        try:
            return store.tier.reserve(ns, key, size, checksum)
        except ResourceExhausted as e:
            err, want = e, 2 * want
    return err


@dataclass(frozen=True, slots=True)
class HintAnswer:
    """What a hint did: ``matched`` leading blocks of the session's chain here are
    present (``active`` hints; 0 otherwise); ``resend``: the session is another
    client's here and this hint did not show its chain: send the whole chain
    (SessionTable.claim)."""

    matched: int = 0
    resend: bool = False


def hint(
    store: SessionHost,
    ns: str,
    session: str,
    state: str,
    keys: Sequence[bytes],
    ttl: float | None,
    depths: Sequence[int] = (),
    cuts: Sequence[tuple[str, int, int]] = (),
    client: bytes = b"",
    whole: bool = False,
) -> HintAnswer:
    """Apply a session hint from ``client`` (its identity; b"": an old client) (see
    :mod:`kvstore.worker.sessions`). For ``active``, ``matched`` is how many leading
    blocks of the session's whole chain here (every key it listed so far, in order,
    not only this hint's: hints are incremental) are present, counted into its hit
    rate. InvalidArgument for a bad state, id or TTL (nothing changes). Any thread.

    A session another client holds here changes hands only as SessionTable.claim
    says (``whole``: the hint carries the sender's whole chain); a refused hint
    changes nothing and answers ``resend``.

    A long hint runs in slices with the store lock released between them: its hashes
    but the last slice's are added in the session's current state, then the last
    slice comes with the state change; the session's room within its share is
    measured over its chain slice by slice, and the chain's prefix match is sliced
    too; a state change of a long chain (SessionTable.move_slice) moves its keys a
    slice at a time. Another client's lookup waits for one slice at most, not the
    whole chain.

    ``depths`` (empty, or one per key) are the keys' depths in the whole chain;
    ``cuts`` are other workers' cut notices the client carries, ``(session, depth,
    turn)`` of this namespace: recorded first (those of ``client``'s own sessions
    only, SessionTable.cut_from), then walked a slice per hold of the lock
    (:func:`walk_cuts`)."""
    check_hint(session, state, ttl)
    if depths and len(depths) != len(keys):
        raise InvalidArgument(f"{len(depths)} depths for {len(keys)} hashes")
    step = store.slice_keys * LOOKUP_SLICES
    for i in range(0, len(cuts), step):  # recording a cut is a few dictionary operations
        with store.lock:
            for name, depth, turn in cuts[i : i + step]:
                store._queue(store.policy.handle(SessionCut(ns, name, depth, turn, client)))
    walk_cuts(store)  # these, and those of blocks lost here since the last walk
    if store._demoter is None and time.monotonic() >= store._next_tick:
        store.session_tick(time.monotonic())  # no demoter thread to expire sessions
    if not _claim(store, ns, session, client, keys, depths, whole, step):
        return HintAnswer(resend=True)
    _advance(store, ns, session, step)  # an earlier change of this session, if pending
    now = time.monotonic()
    cut = max(0, len(keys) - step)
    if cut and state == "ended":
        with store.lock:
            known = store.policy.sessions.get(ns, session) is not None
        cut = cut if known else 0  # an unknown session's end does nothing
    for i in range(0, cut, step):
        with store.lock:
            j = min(i + step, cut)
            ev = SessionKeys(ns, session, tuple(keys[i:j]), now, tuple(depths[i:j]), client)
            store._queue(store.policy.handle(ev))
        store._execute()
    with store.lock:
        last = SessionHint(
            ns, session, state, tuple(keys[cut:]), ttl, now, False, tuple(depths[cut:]), client
        )
        store._queue(store.policy.handle(last))
    store._execute()
    _advance(store, ns, session, step)
    drain(store)  # sessions this hint pushed out of a full table
    chain = _chain(store, ns, session, client, step)
    if not chain:
        return HintAnswer()
    _measure_room(store, ns, session, chain, step)
    if state != "active":
        return HintAnswer()
    hits = store.match_prefix(ns, chain)
    with store.lock:
        store.policy.sessions.record(ns, session, hits, len(chain))
    return HintAnswer(hits)


def _claim(
    store: SessionHost,
    ns: str,
    session: str,
    client: bytes,
    keys: Sequence[bytes],
    depths: Sequence[int],
    whole: bool,
    step: int,
) -> bool:
    """May ``client``'s hint change the session (SessionTable.claim)? The hint's keys
    are indexed outside the lock, and only when another client holds the session; a
    pending state change of its chain moves first, ``step`` keys per hold of the lock
    (a session that starts over would finish it at once)."""
    with store.lock:
        holder = store.policy.sessions.client_of(ns, session)
    if holder is None or holder == client:
        return True
    _advance(store, ns, session, step)
    shown = dict(zip(keys, depths, strict=True)) if depths else dict.fromkeys(keys, -1)
    with store.lock:
        verdict, todo = store.policy.claim(ns, session, client, shown, whole)
        store._queue(todo)
    store._execute()
    drain(store)  # a long chain that started over leaves a slice at a time
    return verdict != REFUSED


def _chain(store: SessionHost, ns: str, session: str, client: bytes, step: int) -> list[bytes]:
    """The session's chain here, in order, copied ``step`` keys per hold of the lock
    ([] when it is gone, ended or another client's). A chain that grows meanwhile
    (another hint of it) is copied up to where it grew: what this hint measures."""
    with store.lock:
        s = store.policy.sessions.get(ns, session)
        if s is None or s.state == "ended" or s.client != client:
            return []
        keys = s.keys
        it = iter(keys)
    out: list[bytes] = []
    while True:
        with store.lock:
            try:
                part = list(islice(it, step))
            except RuntimeError:  # the chain grew (or ended) meanwhile
                return out
        out += part
        if len(part) < step:
            return out


def walk_cuts(store: SessionHost) -> None:
    """Walk the recorded chain cuts (SessionTable.cut_step), ``slice_keys *
    LOOKUP_SLICES`` keys per hold of the store lock, and drop the dead blocks they
    find (outside it). The store runs it after any instructions it executes (a cut
    is recorded where a block is lost: an eviction, an SSD eviction), a hint after
    the notices it carries; one thread walks at a time (another returns at once:
    the walking one goes on until no cut is left)."""
    if not store._cut_walker.acquire(blocking=False):
        return
    try:
        step = store.slice_keys * LOOKUP_SLICES
        while store.policy.sessions.cutting:
            with store.lock:
                store._queue(store.policy.handle(SessionCutStep(step)))
            store._execute()
    finally:
        store._cut_walker.release()


def drain(store: SessionHost) -> None:
    """Give up the keys of sessions that left the table with a long chain (expired
    or pushed out), a slice per hold of the store lock."""
    step = store.slice_keys * LOOKUP_SLICES
    while store.policy.sessions.dropping:
        with store.lock:
            store._queue(store.policy.handle(SessionDrain(step)))
        store._execute()


def _advance(store: SessionHost, ns: str, session: str, step: int) -> None:
    """Move a pending state change of the session to its end, ``step`` keys per hold
    of the store lock."""
    while True:
        with store.lock:
            if not store.policy.sessions.moving(ns, session):
                return
            store._queue(store.policy.handle(SessionAdvance(ns, session, step)))
        store._execute()


def _measure_room(
    store: SessionHost, ns: str, session: str, chain: Sequence[bytes], step: int
) -> None:
    """What the session may still add within its share: its chain's bytes counted
    slice by slice, in order, up to the share (TierPolicy.session_admits)."""
    share = store.policy.session_share
    if share <= 0:
        return
    held = 0
    for i in range(0, len(chain), step):
        with store.lock:
            held += store.policy.chain_bytes(ns, chain[i : i + step])
        if held >= share:
            break
    with store.lock:
        s = store.policy.sessions.get(ns, session)
        if s is not None and s.state != "ended":
            s.room = max(0, share - held)


def prefetch(store: SessionHost) -> None:
    """Copy the SSD-only blocks of resumed sessions into DRAM (the demoter thread):
    each verified against its checksum, committed only if still on SSD, and only
    while DRAM is below its low watermark (a prefetch never evicts: when the cache is
    full, promoting one session's blocks would push out another's)."""
    with store.lock:
        todo, store._todo.prefetch = store._todo.prefetch, []
    if not todo or store.ssd is None:
        return
    tier = store.tier
    room = int(store.policy.dram_marks.low * tier.capacity) - tier.used_bytes
    txn = store.ssd.begin_read()
    try:
        for ns, keys in todo:
            for k in keys:
                got = store.ssd.view(txn, ns, k)
                if got is None or store._stop.is_set():
                    continue
                header, view = got
                room -= len(view)
                if room < 0:  # a prefetch never evicts: only into free DRAM
                    return
                if xxhash.xxh3_64_intdigest(view) != header.checksum:
                    store._bad_ssd(ns, k)
                elif store._promote(ns, k, Held(view, header.checksum, None)):
                    store.counters.prefetched += 1
    finally:
        txn.abort()
