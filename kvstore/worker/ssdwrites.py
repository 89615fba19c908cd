"""The SSD tier's writes, outside the store's lock: staged copies of evicted blocks,
demotion of the least recently used DRAM blocks, and making room on SSD first.

Functions of :class:`~kvstore.worker.store.BlockStore` (it calls them; they take the
store's lock for its bookkeeping and do the LMDB I/O without it). They see the store as
an :class:`SsdHost`, which BlockStore is structurally, so this module does not import
the store (no import circle).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from kvstore_client.errors import ResourceExhausted

from .events import DRAM, SSD
from .fairlock import FairLock
from .storerecords import StoreCounters, _Staged, _Todo
from .tiers.blocks import Block
from .tiers.dram import DramTier
from .tiers.policy import (
    Evicted,
    Instruction,
    NeedSsdRoom,
    SsdWriteFailed,
    SsdWritten,
    TierPolicy,
)
from .tiers.ssd import SsdStore
from .tiers.ssdindex import SsdIndex


class SsdHost(Protocol):
    """What the SSD writes need of a BlockStore: its lock, state machines and tiers,
    its staged copies, and the two halves of its instruction loop."""

    lock: FairLock
    policy: TierPolicy
    tier: DramTier
    ssd: SsdStore | None
    ssd_index: SsdIndex
    counters: StoreCounters
    _staged: dict[tuple[str, bytes], _Staged]
    _todo: _Todo
    _stop: threading.Event

    def view(self, b: Block) -> memoryview: ...
    def _queue(self, instructions: Sequence[Instruction]) -> None: ...
    def _execute(self) -> None: ...
    def _ev(self, stored: bool, medium: str, items: Sequence[tuple[str, bytes]]) -> None: ...


log = logging.getLogger(__name__)

DEMOTE_BATCH_BYTES = 64 << 20


def write_staged(store: SsdHost) -> None:
    """Write the staged copies of evicted blocks to LMDB (outside the lock)."""
    with store.lock:
        batch = [(k, st) for k, st in store._staged.items() if not st.writing]
        for _, st in batch:
            st.writing = True
    if not batch:
        return
    items = [(ns, key, memoryview(st.data), st.checksum) for (ns, key), st in batch]
    written, booked = write_ssd(store, items)
    with store.lock:
        if written is None:
            failed = tuple((ns, k, len(st.data)) for (ns, k), st in batch)
            store._queue(store.policy.handle(SsdWriteFailed(failed, True, booked)))
            for (ns, key), st in batch:
                if store._staged.get((ns, key)) is st:
                    del store._staged[(ns, key)]
        else:
            done = []
            for (ns, key, size, stored), ((_, _), st) in zip(written, batch, strict=True):
                live = store._staged.get((ns, key)) is st
                if live:
                    del store._staged[(ns, key)]
                done.append((ns, key, size, stored, live))
            store._queue(store.policy.handle(SsdWritten(tuple(done), booked)))
            store._ev(True, SSD, [(d[0], d[1]) for d in done if d[4]])
            store.counters.demotions += len(done)
    store._execute()


def write_ssd(
    store: SsdHost, items: list[tuple[str, bytes, memoryview, int]]
) -> tuple[list[tuple[str, bytes, int, int]] | None, int]:
    """Write to LMDB (outside the lock), making room first; returns what was written
    (None when it failed) and the bytes booked for it, which the caller gives back in
    the :class:`SsdWritten` / :class:`SsdWriteFailed` it hands the policy."""
    assert store.ssd is not None
    need = sum(store.ssd.footprint(len(v)) for _, _, v, _ in items)
    with store.lock:  # books ``need`` as in flight until the caller accounts the write
        store._queue(store.policy.handle(NeedSsdRoom(need)))
    try:
        return _write_with_room(store, items, need), need
    except BaseException:
        with store.lock:
            store._queue(store.policy.handle(SsdWriteFailed((), False, need)))
        raise


def _write_with_room(
    store: SsdHost, items: list[tuple[str, bytes, memoryview, int]], need: int
) -> list[tuple[str, bytes, int, int]] | None:
    assert store.ssd is not None
    for attempt in range(3):
        if attempt:  # LMDB said full: evict whatever the watermarks say
            with store.lock:
                before = store.ssd_index.evictions
                room = NeedSsdRoom(max(need, store.ssd.size // 10), force=True)
                store._queue(store.policy.handle(room))
                freed = store.ssd_index.evictions > before
        execute_deletes(store)
        if attempt and not freed:
            return None  # nothing left to evict: the disk is full of pinned blocks
        try:
            return [(ns, key, n, stored) for ns, key, n, stored in store.ssd.put_many(items)]
        except ResourceExhausted:
            continue
        except Exception:
            log.exception("SSD write failed")
            return None
    return None


def execute_deletes(store: SsdHost) -> None:
    with store.lock:
        deletes, store._todo.deletes = store._todo.deletes, []
    if deletes and store.ssd is not None:
        store.ssd.delete_many(deletes)


def demote(store: SsdHost, nbytes: int, *, everything: bool = False) -> int:
    """Move up to ``nbytes`` of least recently used DRAM blocks to SSD; returns bytes.

    ``everything`` includes pinned namespaces (shutdown: nothing may be lost).
    """
    if store.ssd is None:
        return 0
    moved = 0
    while moved < nbytes and not store._stop.is_set():
        with store.lock:
            batch = store.tier.oldest(
                min(nbytes - moved, DEMOTE_BATCH_BYTES), include_pinned_ns=everything
            )
            batch = [b for b in batch if store.tier.pin(b)]
            dead = {b.slot for b in batch if store.policy.dead(b.ns, b.key)}  # no copy
            todo = [b for b in batch if not (b.slot in dead or store.policy.on_ssd(b.ns, b.key))]
        if not batch:
            break
        rows = [(b.ns, b.key, store.view(b), b.checksum) for b in todo]
        written, booked = write_ssd(store, rows) if todo else ([], 0)
        with store.lock:
            if written is None:
                failed = tuple((b.ns, b.key, b.size) for b in todo)
                store._queue(store.policy.handle(SsdWriteFailed(failed, False, booked)))
            else:
                live = [b.ready and not b.doomed for b in todo]
                done = tuple(
                    (ns, key, size, stored, ok)
                    for (ns, key, size, stored), ok in zip(written, live, strict=True)
                )
                store._queue(store.policy.handle(SsdWritten(done, booked)))
                store._ev(True, SSD, [(d[0], d[1]) for d in done if d[4]])
                store.counters.demotions += sum(live)
            for b in batch:
                store.tier.release(b)
                gone = b.slot in dead and store.policy.dead(b.ns, b.key)  # evict, no copy
                skip = not gone and (b.slot in dead or written is None)
                if skip or not b.ready or b.doomed:
                    continue
                if gone:
                    store._queue(store.policy.handle(Evicted(b.ns, b.key, b.size)))
                store.policy.forget(b.ns, b.key)
                store.tier.remove(b.ns, b.key)  # now on SSD (or dead): not a removal
                store._ev(False, DRAM, [(b.ns, b.key)])
                moved += b.size
        store._execute()
        if written is None:
            break
    return moved
