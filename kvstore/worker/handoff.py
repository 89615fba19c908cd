"""Hand a draining worker's hot blocks to their next owners (``Store.HandOff``).

``kvstore drain`` (``Master.Drain``) first takes the worker out of the map, so every
client routes the worker's keys to their next owners, then asks the worker to hand
over what it holds in DRAM. The worker does it as any client would: it opens a
:class:`kvstore_client.Client` on the master, waits for a map without itself, and puts
its DRAM blocks, most recently used first, in batches; the client routes each to its
owner in that map (first writer wins: a block an engine wrote meanwhile stays). The
bytes go straight from the worker's arena (verified against their checksums by
``BlockStore.read``, which counts them as hits) to the wire. Blocks on SSD are left
where they are: they are the cold ones. Until it is stopped the worker keeps serving
what it holds to clients that still have an older map.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore_client import Client
from kvstore_client.errors import KVStoreError, Unavailable

from .store import BlockStore

log = logging.getLogger("kvstore.worker.handoff")

BATCH_BYTES = 32 << 20  # one put batch: bounded staging on the way out
DEFAULT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class HandOffResult:
    moved_blocks: int = 0  # stored at their next owner, or already there
    moved_bytes: int = 0
    kept_blocks: int = 0  # not moved: no owner took them, or the time ran out
    seconds: float = 0.0


def _batches(blocks: list[tuple[str, bytes, int]]) -> list[tuple[str, list[bytes], int]]:
    """Runs of one namespace, each at most BATCH_BYTES (one block at least), in order."""
    out: list[tuple[str, list[bytes], int]] = []
    for ns, key, size in blocks:
        if out and out[-1][0] == ns and out[-1][2] + size <= BATCH_BYTES:
            out[-1][1].append(key)
            out[-1] = (ns, out[-1][1], out[-1][2] + size)
        else:
            out.append((ns, [key], size))
    return out


def hand_off(
    store: BlockStore,
    open_client: Callable[[], Client],
    worker_id: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> HandOffResult:
    """Put every DRAM block of ``store`` to its owner in a map without ``worker_id``
    (the client from ``open_client`` routes it), hottest first, within ``timeout_s``.
    Unavailable when the master's map still lists this worker after the whole time."""
    t0 = time.monotonic()
    deadline = t0 + (timeout_s if timeout_s > 0 else DEFAULT_TIMEOUT_S)
    res = HandOffResult()
    blocks = store.hot_blocks()
    with open_client() as c:
        while any(w.id == worker_id for w in c.workers()):
            if time.monotonic() > deadline:
                raise Unavailable(f"the map still lists worker {worker_id!r}: not drained")
            time.sleep(0.05)
        if not c.workers():
            res.kept_blocks = len(blocks)
            res.seconds = time.monotonic() - t0
            log.warning("hand-off: no other worker in the map; %d blocks kept", len(blocks))
            return res
        for i, (ns, keys, _) in enumerate(batches := _batches(blocks)):
            if time.monotonic() > deadline:
                res.kept_blocks += sum(len(k) for _, k, _ in batches[i:])
                break
            reading = store.read(ns, keys)
            try:
                have = [(k, h.view) for k, h in zip(keys, reading.held, strict=True) if h]
                res.kept_blocks += len(keys) - len(have)  # gone or corrupt since listed
                if not have:
                    continue
                try:
                    stored = c.batch_put(ns, [k for k, _ in have], [v for _, v in have])
                    # False: already there (moved all the same), or not taken
                    again = [k for (k, _), ok in zip(have, stored, strict=True) if not ok]
                    there = dict(zip(again, c.batch_exists(ns, again), strict=True))
                except KVStoreError as e:  # a full owner: these stay here
                    log.info("hand-off of %d blocks of %s failed: %s", len(have), ns, e)
                    res.kept_blocks += len(have)
                    continue
                for (k, v), ok in zip(have, stored, strict=True):
                    if ok or there.get(k):
                        res.moved_blocks += 1
                        res.moved_bytes += len(v)
                    else:
                        res.kept_blocks += 1
            finally:
                store.done(reading)
    res.seconds = time.monotonic() - t0
    log.info(
        "hand-off: %d blocks (%d bytes) moved to their next owners, %d kept, in %.2fs",
        res.moved_blocks,
        res.moved_bytes,
        res.kept_blocks,
        res.seconds,
    )
    return res
