"""The tier policy's budgets: DRAM / SSD watermarks, when an SSD hit is promoted back
into DRAM, and byte quotas per pinned namespace or tenant (pure: no I/O).

:mod:`.policy` uses them and re-exports them.
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

    def tracks(self, ns: str) -> bool:
        """Is ``ns`` charged to an account of this book (else admits is always True and
        charge / refund do nothing)?"""
        k = self._key_of(ns)
        return k is not None and (k in self.quotas or k in self.used)

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
