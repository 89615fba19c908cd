"""The store's side of agent sessions: a hint and a prefetch run through a BlockStore.

The decisions live in the pure state machines (:mod:`kvstore.worker.sessions`, the
tier policy); these two functions only feed them events under the store's lock and
do the I/O they ask for outside it, like the rest of
:class:`~kvstore.worker.store.BlockStore`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from .sessions import check_hint
from .tiers.policy import SessionHint

if TYPE_CHECKING:
    from .store import BlockStore


def hint(
    store: BlockStore, ns: str, session: str, state: str, keys: Sequence[bytes], ttl: float | None
) -> int:
    """Apply a session hint (see :mod:`kvstore.worker.sessions`). For ``active``,
    returns how many leading blocks of the session's whole chain here (every key it
    listed so far, in order, not only this hint's: hints are incremental) are present,
    counted into its hit rate; 0 otherwise. InvalidArgument for a bad state, id or TTL
    (nothing changes). Any thread."""
    check_hint(session, state, ttl)
    if store._demoter is None and time.monotonic() >= store._next_tick:
        store.session_tick(time.monotonic())  # no demoter thread to expire sessions
    with store.lock:
        store._queue(
            store.policy.handle(SessionHint(ns, session, state, tuple(keys), ttl, time.monotonic()))
        )
        s = store.policy.sessions.get(ns, session)
        chain = list(s.keys) if state == "active" and s is not None else []
    store._execute()
    if not chain:
        return 0
    hits = store.match_prefix(ns, chain)
    with store.lock:
        store.policy.sessions.record(ns, session, hits, len(chain))
    return hits


def prefetch(store: BlockStore) -> None:
    """Copy the SSD-only blocks of resumed sessions into DRAM (the demoter thread):
    each verified against its checksum, committed only if still on SSD, and only
    while DRAM is below its low watermark (a prefetch never evicts: when the cache is
    full, promoting one session's blocks would push out another's)."""
    from .storerecords import Held

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
