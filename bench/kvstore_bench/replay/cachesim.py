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

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..traces import Request

__all__ = ["HitStats", "distinct_blocks", "ideal_hit_rate", "lru_hit_rate", "opt_hit_rate"]


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


def opt_hit_rate(requests: Sequence[Request], capacity_blocks: int) -> HitStats:
    """Hits of Belady's offline cache of ``capacity_blocks`` blocks: the same lookups and
    writes as :func:`lru_hit_rate`, but when full it evicts the block whose next request
    is furthest away (or never comes), the newly written one included (so a block no
    one reads again is never kept at another's expense). Among blocks next wanted by the
    same request it evicts the deepest in its chain first: a prefix hit stops at the first
    gap, so a chain's head is worth more than its tail (breaking those ties any other
    way, e.g. by id, drops heads, and the reference reads below what a store can reach).
    The best order for per-block hits, and the reference for the store's retention. Raises
    ValueError for a negative capacity. O(total ids * log)."""
    if type(capacity_blocks) is not int or capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be a non-negative int, got {capacity_blocks!r}")
    never = len(requests)
    uses: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        for bid in r.block_ids:
            lst = uses.setdefault(bid, [])
            if not lst or lst[-1] != i:
                lst.append(i)
    cursor = dict.fromkeys(uses, 0)

    def next_use(bid: int, after: int) -> int:
        lst = uses[bid]
        k = cursor[bid]
        while k < len(lst) and lst[k] <= after:
            k += 1
        cursor[bid] = k
        return lst[k] if k < len(lst) else never

    cache: dict[int, int] = {}  # block -> its next use when last scored
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale ones skipped
    acc = _Counter()
    for i, r in enumerate(requests):
        ids = r.block_ids
        hit = 0
        for bid in ids:
            if bid not in cache:
                break
            hit += 1
        acc.add(r, hit)
        if capacity_blocks == 0:
            continue
        for depth, bid in enumerate(ids):  # every id is now read or written: rescore it
            nu = next_use(bid, i)
            cache[bid] = nu
            heapq.heappush(heap, (-nu, -depth, bid))
        while len(cache) > capacity_blocks:
            neg, _, bid = heapq.heappop(heap)
            if cache.get(bid) == -neg:
                del cache[bid]
    return acc.result(capacity_blocks)


def distinct_blocks(requests: Iterable[Request]) -> int:
    """Number of distinct block ids over ``requests`` (the size an ideal cache reaches)."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.block_ids)
    return len(seen)
