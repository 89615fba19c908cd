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
from typing import Protocol

import xxhash

from kvstore_client.errors import InvalidArgument, ResourceExhausted

from .fairlock import FairLock
from .sessions import check_hint
from .storerecords import LOOKUP_SLICES, Held, StoreCounters, _Todo
from .tiers.blocks import Block
from .tiers.dram import DramTier
from .tiers.policy import (
    Instruction,
    NeedDramRoom,
    SessionAdvance,
    SessionCut,
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


def hint(
    store: SessionHost,
    ns: str,
    session: str,
    state: str,
    keys: Sequence[bytes],
    ttl: float | None,
    depths: Sequence[int] = (),
    cuts: Sequence[tuple[str, int, int]] = (),
) -> int:
    """Apply a session hint (see :mod:`kvstore.worker.sessions`). For ``active``,
    returns how many leading blocks of the session's whole chain here (every key it
    listed so far, in order, not only this hint's: hints are incremental) are present,
    counted into its hit rate; 0 otherwise. InvalidArgument for a bad state, id or TTL
    (nothing changes). Any thread.

    A long hint runs in slices with the store lock released between them: its hashes
    but the last slice's are added in the session's current state, then the last
    slice comes with the state change; the session's room within its share is
    measured over its chain slice by slice, and the chain's prefix match is sliced
    too; a state change of a long chain (SessionTable.move_slice) moves its keys a
    slice at a time. Another client's lookup waits for one slice at most, not the
    whole chain.

    ``depths`` (empty, or one per key) are the keys' depths in the whole chain;
    ``cuts`` are other workers' cut notices the client carries, ``(session, depth,
    turn)`` of this namespace, applied first (TierPolicy.take_cuts)."""
    check_hint(session, state, ttl)
    if depths and len(depths) != len(keys):
        raise InvalidArgument(f"{len(depths)} depths for {len(keys)} hashes")
    for name, depth, turn in cuts:
        with store.lock:
            store._queue(store.policy.handle(SessionCut(ns, name, depth, turn)))
    if cuts:
        store._execute()
    if store._demoter is None and time.monotonic() >= store._next_tick:
        store.session_tick(time.monotonic())  # no demoter thread to expire sessions
    step = store.slice_keys * LOOKUP_SLICES
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
            ev = SessionKeys(ns, session, tuple(keys[i:j]), now, tuple(depths[i:j]))
            store._queue(store.policy.handle(ev))
        store._execute()
    with store.lock:
        last = SessionHint(
            ns, session, state, tuple(keys[cut:]), ttl, now, False, tuple(depths[cut:])
        )
        store._queue(store.policy.handle(last))
    store._execute()
    _advance(store, ns, session, step)
    drain(store)  # sessions this hint pushed out of a full table
    with store.lock:
        s = store.policy.sessions.get(ns, session)
        chain = list(s.keys) if s is not None and s.state != "ended" else []
    if not chain:
        return 0
    _measure_room(store, ns, session, chain, step)
    if state != "active":
        return 0
    hits = store.match_prefix(ns, chain)
    with store.lock:
        store.policy.sessions.record(ns, session, hits, len(chain))
    return hits


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
