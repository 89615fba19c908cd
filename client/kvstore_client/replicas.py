"""Replicas: how many copies a namespace gets, which workers hold them, in which
order a reader asks them, and what a reader repairs. Pure functions, no I/O; the
client (:mod:`kvstore_client.client`) executes them.

- Count: a call's ``replicas=`` argument, else the longest namespace prefix in the
  map's ``namespace_replicas`` (the master's ``--namespace-replicas``), else the
  map's ``replicas`` (the master's ``--replicas``); clamped to the live workers.
- Placement: the R distinct owners of a key along the ring (capacity-weighted,
  on distinct hosts when the map has enough hosts; :mod:`kvstore_client.sharding`).
  The first is the primary: a put is "stored" when the primary stored it; the
  other copies are best effort and counted in :class:`ReplicaStats`.
- A client that wrote into a namespace with a per-call ``replicas=`` above the
  namespace's count reads (get, exists, match_prefix) as many owners from then on;
  a removal asks every worker of the map, so no copy, whoever wrote it, survives.
- Reads: the key's owners, those reachable over shm:// (same host) first, then in
  ring order; a miss or an unreachable worker moves the key to its next owner in
  the next round, so a read costs one round trip per round and one call per worker
  per round.
- Repair (lazy, on read): with R > 1 the first read round also asks the key's
  other owners whether they hold it (one batched EXISTS per worker); owners that
  answered "absent" get the value written back, in the background. After a worker
  loss the ring's new owners are filled by the first reads, and the replica count
  recovers without a background scan.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgument

MAX_REPLICAS = 8


def parse_namespace_replicas(items: Iterable[str]) -> dict[str, int]:
    """["sys/=3", "chat/=2"] -> {"sys/": 3, "chat/": 2}; InvalidArgument when malformed."""
    out: dict[str, int] = {}
    for item in items:
        prefix, sep, count = item.rpartition("=")
        if not sep or not count.strip().isdigit():
            raise InvalidArgument(f"bad namespace replica entry {item!r}: want PREFIX=COUNT")
        r = int(count)
        check_replicas(r)
        out[prefix] = r
    return out


def check_replicas(r: int) -> int:
    """``r`` when it is a sane copy count (1..8), else InvalidArgument."""
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be an integer from 1 to {MAX_REPLICAS}, not {r!r}")
    return r


def replica_count(
    ns: str, requested: int | None, default: int, by_prefix: Mapping[str, int]
) -> int:
    """Copies for namespace ``ns``: ``requested``, else the longest matching prefix,
    else ``default`` (at least 1)."""
    if requested is not None:
        return check_replicas(requested)
    best = -1
    r = max(1, default)
    for prefix, count in by_prefix.items():
        if ns.startswith(prefix) and len(prefix) > best:
            best, r = len(prefix), max(1, count)
    return r


def read_order(owners: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Each row of ``owners`` (ring order) reordered so that workers with
    ``local[w]`` (shm-mapped, same host) come first; otherwise ring order."""
    if owners.shape[1] < 2 or not local.any():
        return owners
    rank = (~local[owners]).astype(np.int8)
    return np.take_along_axis(owners, np.argsort(rank, axis=1, kind="stable"), axis=1)


def by_worker(cands: np.ndarray, rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(worker, positions) for ``rows`` grouped by ``cands`` (one worker per row)."""
    return [(int(w), rows[cands == w]) for w in np.unique(cands)]


def any_owner_groups(owners: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(worker, positions of the keys it owns a copy of), for one batched call per
    worker that covers every copy."""
    n, r = owners.shape
    flat = owners.reshape(-1)
    pos = np.repeat(np.arange(n), r)
    order = np.argsort(flat, kind="stable")
    flat, pos = flat[order], pos[order]
    cut = np.flatnonzero(np.diff(flat)) + 1
    return [
        (int(ws[0]), ps) for ws, ps in zip(np.split(flat, cut), np.split(pos, cut), strict=True)
    ]


def repairs(
    owners: np.ndarray, found_at: np.ndarray, present: dict[int, dict[int, bool]]
) -> list[tuple[int, np.ndarray]]:
    """(worker, positions) of the copies to write back after a read.

    ``found_at[i]``: the worker the value of key i was read from (-1: a miss);
    ``present[w][i]``: what worker w answered about key i (absent when w did not
    answer). A copy is written where an owner answered "absent".
    """
    todo: dict[int, list[int]] = {}
    for i in np.flatnonzero(found_at >= 0):
        for w in owners[i]:
            w = int(w)
            if w != found_at[i] and present.get(w, {}).get(int(i)) is False:
                todo.setdefault(w, []).append(int(i))
    return [(w, np.array(ps, dtype=np.int64)) for w, ps in sorted(todo.items())]


@dataclass(slots=True)
class ReplicaStats:
    """Counters of one client (thread-safe): copies written beyond the primary, copies
    that failed, reads served by a non-primary owner, copies repaired on read."""

    copies_written: int = 0
    copies_failed: int = 0
    fallback_reads: int = 0
    repaired: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "copies_written": self.copies_written,
                "copies_failed": self.copies_failed,
                "fallback_reads": self.fallback_reads,
                "repaired": self.repaired,
            }
