"""Offline reference hit rates: what an ideal or an LRU block cache would hit on a trace.

The replay tool compares the live store against these figures. Both simulations use the
store's rule: a request's hit is the longest leading run of its block ids that are
cached (a prefix match), never a block after the first miss.

Counting (the same for both): ``blocks_total`` is every id of every request,
``blocks_hit`` the leading run. ``tokens_total`` is every request's ``input_tokens``;
``tokens_hit`` is the hit blocks times ``block_tokens``, counting only blocks that are
full (a hit on a trailing partial block, as Mooncake chains end with, adds no tokens).
Requests are processed in the order given, normally :func:`traces.iter_requests`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ..traces import Request

__all__ = ["HitStats", "distinct_blocks", "ideal_hit_rate", "lru_hit_rate"]


@dataclass(frozen=True, slots=True)
class HitStats:
    """Hit counts of one simulation; ``capacity_blocks`` is None for the ideal cache."""

    requests: int
    blocks_hit: int
    blocks_total: int
    tokens_hit: int
    tokens_total: int
    capacity_blocks: int | None = None

    @property
    def block_hit_rate(self) -> float:
        """blocks_hit / blocks_total, 0.0 when there are no blocks."""
        return self.blocks_hit / self.blocks_total if self.blocks_total else 0.0

    @property
    def token_hit_rate(self) -> float:
        """tokens_hit / tokens_total, 0.0 when there are no tokens."""
        return self.tokens_hit / self.tokens_total if self.tokens_total else 0.0


class _Counter:
    __slots__ = ("blocks_hit", "blocks_total", "requests", "tokens_hit", "tokens_total")

    def __init__(self) -> None:
        self.requests = self.blocks_hit = self.blocks_total = 0
        self.tokens_hit = self.tokens_total = 0

    def add(self, r: Request, hit: int) -> None:
        self.requests += 1
        self.blocks_hit += hit
        self.blocks_total += len(r.block_ids)
        self.tokens_hit += min(hit, r.input_tokens // r.block_tokens) * r.block_tokens
        self.tokens_total += r.input_tokens

    def result(self, capacity: int | None) -> HitStats:
        return HitStats(
            self.requests,
            self.blocks_hit,
            self.blocks_total,
            self.tokens_hit,
            self.tokens_total,
            capacity,
        )


def ideal_hit_rate(requests: Iterable[Request]) -> HitStats:
    """Hits of an infinite cache: each request hits its leading run of ids seen before.

    After the lookup all of the request's ids are cached. O(total ids).
    """
    seen: set[int] = set()
    acc = _Counter()
    for r in requests:
        ids = r.block_ids
        hit = 0
        for bid in ids:
            if bid not in seen:
                break
            hit += 1
        seen.update(ids[hit:])
        acc.add(r, hit)
    return acc.result(None)


def lru_hit_rate(requests: Iterable[Request], capacity_blocks: int) -> HitStats:
    """Hits of a block-granular LRU cache holding at most ``capacity_blocks`` blocks.

    Per request: the leading run of cached ids is the hit and those blocks are touched
    (moved to most recently used, in chain order); then every later id is written: a new
    one is inserted as most recently used, evicting the least recently used block when
    full; one already cached (behind the first miss) is touched. Capacity 0 caches
    nothing. Raises ValueError for a negative capacity. O(total ids).
    """
    if type(capacity_blocks) is not int or capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be a non-negative int, got {capacity_blocks!r}")
    cache: OrderedDict[int, None] = OrderedDict()
    touch = cache.move_to_end
    evict = cache.popitem
    acc = _Counter()
    for r in requests:
        ids = r.block_ids
        hit = 0
        for bid in ids:
            if bid not in cache:
                break
            touch(bid)
            hit += 1
        acc.add(r, hit)
        if capacity_blocks == 0:
            continue
        for bid in ids[hit:]:
            if bid in cache:
                touch(bid)
            else:
                cache[bid] = None
                if len(cache) > capacity_blocks:
                    evict(last=False)
    return acc.result(capacity_blocks)


def distinct_blocks(requests: Iterable[Request]) -> int:
    """Number of distinct block ids over ``requests`` (the size an ideal cache reaches)."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.block_ids)
    return len(seen)
