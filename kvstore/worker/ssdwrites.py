"""The SSD tier's writes, as streams of stimuli: staged copies of evicted blocks,
demotion of the least recently used DRAM blocks, and making room on SSD first.

Each function hands the tier state (:mod:`.tiers.state`) one bounded stimulus at a time
through the store (:class:`~.storehost.StoreHost`: the store takes its lock for each)
and does the LMDB I/O between them, with no lock held.
"""

from __future__ import annotations

import logging

from kvstore_client.errors import ResourceExhausted

from .storehost import StoreHost
from .tiers.policy import NeedSsdRoom, SsdWriteFailed
from .tiers.stimuli import (
    DemoteDone,
    DemotePick,
    ForceSsdRoom,
    StageBatch,
    StageWritten,
)

log = logging.getLogger(__name__)

DEMOTE_BATCH_BYTES = 64 << 20


def write_staged(host: StoreHost) -> None:
    """Write the staged copies of evicted blocks to LMDB (outside the lock)."""
    batch = host.apply(StageBatch())
    if not batch:
        return
    items = [(ns, key, memoryview(c.data), c.checksum) for (ns, key), c in batch]
    written, booked = write_ssd(host, items)
    host.apply(StageWritten(batch, written, booked))
    host.execute()


def write_ssd(
    host: StoreHost, items: list[tuple[str, bytes, memoryview, int]]
) -> tuple[list[tuple[str, bytes, int, int]] | None, int]:
    """Write to LMDB (outside the lock), making room first; returns what was written
    (None when it failed) and the bytes booked for it, which the caller gives back in
    the :class:`StageWritten` / :class:`DemoteDone` it hands the tier state."""
    assert host.ssd is not None
    need = sum(host.ssd.footprint(len(v)) for _, _, v, _ in items)
    host.tell(NeedSsdRoom(need))  # books ``need`` as in flight until the write is accounted
    try:
        return _write_with_room(host, items, need), need
    except BaseException:
        host.tell(SsdWriteFailed((), False, need))
        raise


def _write_with_room(
    host: StoreHost, items: list[tuple[str, bytes, memoryview, int]], need: int
) -> list[tuple[str, bytes, int, int]] | None:
    ssd = host.ssd
    assert ssd is not None
    freed = False
    for attempt in range(3):
        if attempt:  # LMDB said full: evict whatever the watermarks say
            freed = host.apply(ForceSsdRoom(max(need, ssd.size // 10)))
        host.execute_deletes()
        if attempt and not freed:
            return None  # nothing left to evict: the disk is full of pinned blocks
        try:
            return [(ns, key, n, stored) for ns, key, n, stored in ssd.put_many(items)]
        except ResourceExhausted:
            continue
        except Exception:
            log.exception("SSD write failed")
            return None
    return None


def demote(host: StoreHost, nbytes: int, *, everything: bool = False) -> int:
    """Move up to ``nbytes`` of least recently used DRAM blocks to SSD; returns bytes.

    ``everything`` includes pinned namespaces (shutdown: nothing may be lost).
    """
    if host.ssd is None:
        return 0
    moved = 0
    while moved < nbytes and not host.stopping():
        batch = host.apply(DemotePick(min(nbytes - moved, DEMOTE_BATCH_BYTES), everything))
        if not batch.blocks:
            break
        rows = [(b.ns, b.key, host.view(b), b.checksum) for b in batch.todo]
        written, booked = write_ssd(host, rows) if batch.todo else ([], 0)
        moved += host.apply(DemoteDone(batch, written, booked))
        host.execute()
        if written is None:
            break
    return moved
