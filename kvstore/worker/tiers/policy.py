"""Tiering policy and SSD bookkeeping, as synchronous state machines with no I/O.

The worker alone decides where blocks live:
- DRAM above its high watermark (default 95%): demote least recently used blocks
  to SSD in background batches until DRAM is down to the low watermark (85%);
- SSD above its high watermark: evict its least recently used blocks down to
  the low watermark;
- a block read from SSD is promoted back to DRAM on its second hit within a
  window (``promote="second-hit"``), on every hit (``"always"``) or never.
Blocks of pinned namespaces are never demoted or evicted; each pinned namespace
has a byte quota.

The tiers are inclusive: a promoted block keeps its SSD copy, so demoting it
again costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvstore_client.errors import InvalidArgument

PROMOTE_MODES = ("always", "second-hit", "never")


@dataclass(slots=True)
class Watermarks:
    high: float = 0.95
    low: float = 0.85

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high <= 1:
            raise InvalidArgument(
                f"watermarks need 0 < low <= high <= 1, got {self.low}/{self.high}"
            )

    def excess(self, used: int, capacity: int) -> int:
        """Bytes to move out now: 0 below the high mark, else down to the low mark."""
        if capacity <= 0 or used <= self.high * capacity:
            return 0
        return int(used - self.low * capacity)


@dataclass(slots=True)
class Promoter:
    """Decides whether an SSD hit is copied back into DRAM."""

    mode: str = "second-hit"
    window: float = 60.0
    max_tracked: int = 1 << 20
    _seen: OrderedDict[tuple[str, bytes], float] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.mode not in PROMOTE_MODES:
            raise InvalidArgument(f"promote must be one of {', '.join(PROMOTE_MODES)}")

    def on_hit(self, ns: str, key: bytes, now: float) -> bool:
        if self.mode == "always":
            return True
        if self.mode == "never":
            return False
        k = (ns, key)
        last = self._seen.pop(k, None)
        if last is not None and now - last <= self.window:
            return True
        self._seen[k] = now
        while len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        return False


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

    def victims(self, nbytes: int) -> list[tuple[str, bytes]]:
        """Least recently used unpinned keys whose removal frees at least ``nbytes``."""
        out: list[tuple[str, bytes]] = []
        freed = 0
        for k, e in self.entries.items():
            if freed >= nbytes:
                break
            if k[0] in self.pinned:
                continue
            out.append(k)
            freed += e.stored
        return out


class QuotaBook:
    """Byte quotas, counted once whichever tiers hold a block.

    ``key_of(ns)`` names the account a namespace is charged to (a pinned
    namespace itself, or the tenant that owns it), or None for no quota.
    """

    def __init__(
        self, quotas: dict[str, int], key_of: Callable[[str], str | None] | None = None
    ) -> None:
        self.quotas = dict(quotas)
        self.used: dict[str, int] = dict.fromkeys(quotas, 0)
        self._key_of = key_of or (lambda ns: ns if ns in self.quotas else None)

    def is_pinned(self, ns: str) -> bool:
        return ns in self.quotas

    def admits(self, ns: str, size: int) -> bool:
        k = self._key_of(ns)
        return k is None or k not in self.quotas or self.used[k] + size <= self.quotas[k]

    def charge(self, ns: str, size: int) -> None:
        k = self._key_of(ns)
        if k in self.used:
            self.used[k] += size

    def refund(self, ns: str, size: int) -> None:
        k = self._key_of(ns)
        if k in self.used:
            self.used[k] = max(0, self.used[k] - size)


def parse_pins(specs: Iterable[str]) -> dict[str, int]:
    """``["sys=1GiB", "tools"]`` -> {"sys": 1 GiB, "tools": unlimited}."""
    from kvstore_client.keys import check_namespace

    from ...config import parse_size

    out: dict[str, int] = {}
    for spec in specs:
        ns, _, quota = spec.partition("=")
        check_namespace(ns)
        out[ns] = parse_size(quota) if quota else 1 << 62
    return out
