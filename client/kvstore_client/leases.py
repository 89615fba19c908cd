"""Leases on same-host workers' arenas, across the owners of a batch: blocks pinned
in place to copy from (:func:`pin`) and slots reserved to write into (:func:`reserve`),
for engines that move bytes by DMA between their device memory and the arena. The
per-worker halves are in :mod:`kvstore_client.transport.pins`; the Client's
``pin_local`` / ``reserve_local`` route a batch here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import PeerError
from .routing import View
from .transport.pins import ArenaPins, ArenaSlots


def pin(
    view: View, groups: list[tuple[int, np.ndarray]], timeout: float, ns: bytes,
    hashes: Sequence[bytes],
) -> ArenaPins:  # fmt: skip
    """Per owner, pin what a same-host worker holds; the rest stays None. A worker
    that fails is a miss for its blocks."""
    out = ArenaPins([None] * len(hashes))
    for w, idx in groups:
        try:
            got = view.workers[w].via.pin(timeout, ns, [hashes[i] for i in idx])
        except PeerError:
            continue
        if got is None:
            continue
        out.adopt(got, idx.tolist())
    return out


def reserve(
    view: View, groups: list[tuple[int, np.ndarray]], timeout: float, ns: bytes,
    hashes: Sequence[bytes], sizes: Sequence[int], flags: int = 0,
) -> ArenaSlots:  # fmt: skip
    """Per owner, reserve slots on a same-host worker; the rest stays None.
    ``flags``: request flags of the reservations (FLAG_SESSION)."""
    out = ArenaSlots([None] * len(hashes), [False] * len(hashes))
    for w, idx in groups:
        ids = [int(i) for i in idx]
        try:
            got = view.workers[w].via.reserve(
                timeout, ns, [hashes[i] for i in ids], [sizes[i] for i in ids], flags
            )
        except PeerError:
            continue
        if got is None:
            continue
        out.adopt(got, ids)
    return out
