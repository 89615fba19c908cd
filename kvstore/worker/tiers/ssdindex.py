"""What a worker's SSD tier holds, in LRU order, with byte accounting (no I/O).

:class:`SsdIndex` is the tier policy's book of the SSD (:mod:`.policy` owns it and
feeds it under the store's lock); LMDB itself is :mod:`.ssd`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SPARE_SCAN = 1 << 16  # SSD keys examined, newest first, for the paused sessions' share


@dataclass(slots=True)
class SsdEntry:
    size: int  # payload bytes
    stored: int  # bytes on disk (header + payload)


class SsdIndex:
    """What the SSD holds, in LRU order, with byte accounting and pinned namespaces."""

    def __init__(self, capacity: int, pinned: Iterable[str] = ()) -> None:
        self.capacity = capacity
        self.pinned = set(pinned)
        self.entries: OrderedDict[tuple[str, bytes], SsdEntry] = OrderedDict()
        self.used_bytes = 0
        self.pending = 0  # bytes writers were given room for and have not yet accounted
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, k: tuple[str, bytes]) -> bool:
        return k in self.entries

    def get(self, ns: str, key: bytes) -> SsdEntry | None:
        return self.entries.get((ns, key))

    def add(self, ns: str, key: bytes, size: int, stored: int) -> None:
        k = (ns, key)
        old = self.entries.pop(k, None)
        if old is not None:
            self.used_bytes -= old.stored
        self.entries[k] = SsdEntry(size, stored)
        self.used_bytes += stored

    def unbook(self, nbytes: int) -> None:
        """A writer's room is accounted (written or failed): no longer in flight."""
        self.pending = max(0, self.pending - nbytes)

    def touch(self, ns: str, key: bytes) -> None:
        k = (ns, key)
        if k in self.entries:
            self.entries.move_to_end(k)

    def remove(self, ns: str, key: bytes) -> SsdEntry | None:
        e = self.entries.pop((ns, key), None)
        if e is not None:
            self.used_bytes -= e.stored
        return e

    def keys_of(self, ns: str) -> list[bytes]:
        return [k for n, k in self.entries if n == ns]

    def namespaces(self) -> set[str]:
        return {n for n, _ in self.entries}

    def victims(
        self,
        nbytes: int,
        keep: Callable[[str, bytes], bool] | None = None,
        keep_bytes: int = 0,
    ) -> list[tuple[str, bytes]]:
        """Least recently used unpinned keys whose removal frees at least ``nbytes``.

        The most recently used ``keep_bytes`` of keys for which ``keep(ns, key)`` holds
        (a paused session's; its chain ordered tail first, so these are the chain's
        leading blocks) are passed over, and taken, least recently used first, only
        if the others are not enough. Finding them looks at most SPARE_SCAN keys from
        the most recently used end."""
        spared: set[tuple[str, bytes]] = set()
        if keep is not None and keep_bytes > 0:
            held = 0
            for n, (k, e) in enumerate(reversed(self.entries.items())):
                if held >= keep_bytes or n >= SPARE_SCAN:
                    break
                if k[0] not in self.pinned and held + e.stored <= keep_bytes and keep(*k):
                    spared.add(k)
                    held += e.stored
        out: list[tuple[str, bytes]] = []
        kept: list[tuple[str, bytes]] = []
        freed = 0
        for k, e in self.entries.items():
            if freed >= nbytes:
                return out
            if k[0] in self.pinned:
                continue
            if k in spared:
                kept.append(k)
                continue
            out.append(k)
            freed += e.stored
        for k in kept:
            if freed >= nbytes:
                break
            out.append(k)
            freed += self.entries[k].stored
        return out

    def make_oldest(self, ns: str, key: bytes) -> None:
        """Move a key to the evicting end of the LRU order."""
        if (ns, key) in self.entries:
            self.entries.move_to_end((ns, key), last=False)
