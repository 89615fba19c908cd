"""Memory as the engine bench's axis: the working set, and what a cache of a given size
could have served (offline references). Pure: no processes, no engines.

The working set is every distinct full KV block the scripts' prompts contain (chained
hashes, so equal blocks mean equal prefixes) times the bytes one block occupies in the
store (:func:`kv_bytes_per_block`). A sweep point ``f`` gives every store ``f`` times
that many bytes.

The references replay the requests in the order they really ran (a request looks its
prefix up when the engine schedules it, taken as the start of the step that produced
its first token, and its blocks are saved when it finishes; see
:func:`~kvstore_bench.engine.report.timed_requests`) against one cache shared by all
engines that holds ``capacity`` blocks:

- ``lru``: least recently used eviction (a lookup touches the hit prefix, a save every
  block of the prompt);
- ``opt``: Belady's offline rule (evict the block whose next lookup is furthest away,
  or never comes; among blocks next wanted by the same lookup, the deepest in its chain
  first, so a parent never goes before its child): the best any eviction order can do
  for per-block hits, an upper reference for prefix hits. (A block's parent is wanted
  whenever it is, so its next use is never later; without the depth rule ties fall by
  hash, a chain loses its head as often as its tail and the reference reads far lower.)

Hits are counted as an engine can take them: the leading run of cached blocks, never
the prompt's last token (:func:`~kvstore_bench.engine.workload.cacheable`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .workload import Script, Timed, cacheable, chain_hashes

__all__ = [
    "References",
    "kv_bytes_per_block",
    "reference_hit_rates",
    "working_set_blocks",
]


def kv_bytes_per_block(config: dict[str, Any], block_tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of K and V of every attention layer for ``block_tokens`` tokens: what one
    block weighs in a store (Llama-style configs; a hybrid's attention layers only)."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        layers = sum(1 for t in types if "attention" in str(t) and "linear" not in str(t))
    heads = int(config.get("num_key_value_heads", config["num_attention_heads"]))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return 2 * layers * heads * head_dim * dtype_bytes * block_tokens


def working_set_blocks(scripts: Iterable[Script], block: int) -> int:
    """Distinct full blocks over every prompt of ``scripts``."""
    seen: set[bytes] = set()
    for s in scripts:
        for t in s.turns:
            seen.update(chain_hashes(t.prompt, block))
    return len(seen)


@dataclass(frozen=True, slots=True)
class References:
    """Token hit rates of a shared cache of ``capacity`` blocks; ``lru_hits`` and
    ``opt_hits``: each request's hit tokens (in the order given)."""

    capacity_blocks: int
    lru: float
    opt: float
    lru_hits: tuple[int, ...] = ()
    opt_hits: tuple[int, ...] = ()

    def beyond(self, own: Sequence[int], total: int) -> tuple[float, float]:
        """What a store with these references would have served beyond ``own`` (each
        request's tokens from its engine's own cache), over ``total`` prompt tokens:
        (LRU, Belady). The store's own share (the connector's tokens) compares with it."""
        if not total:
            return 0.0, 0.0
        lru = sum(max(0, h - o) for h, o in zip(self.lru_hits, own, strict=True))
        opt = sum(max(0, h - o) for h, o in zip(self.opt_hits, own, strict=True))
        return lru / total, opt / total


def _events(requests: Sequence[Timed]) -> list[tuple[float, int, int]]:
    """(time, kind, request), kind 0 = the save when a request ends, 1 = the lookup when
    it starts; at equal times the save comes first (as :func:`ideal_hits` counts)."""
    ev = [(r.end, 0, i) for i, r in enumerate(requests)]
    ev += [(r.start, 1, i) for i, r in enumerate(requests)]
    ev.sort()
    return ev


def reference_hit_rates(requests: Sequence[Timed], block: int, capacity: int) -> References:
    """Offline LRU and Belady hit rates for ``requests`` with ``capacity`` blocks."""
    hashes = [chain_hashes(r.prompt, block) for r in requests]
    total = sum(len(r.prompt) for r in requests)
    if not total:
        return References(capacity, 0.0, 0.0)
    events = _events(requests)
    lru = _run_lru(requests, hashes, events, block, capacity)
    opt = _run_opt(requests, hashes, events, block, capacity)
    return References(capacity, sum(lru) / total, sum(opt) / total, tuple(lru), tuple(opt))


def _hit(chain: list[bytes], present: Any, cap_tokens: int, block: int) -> tuple[int, int]:
    n = 0
    for h in chain:
        if h not in present:
            break
        n += 1
    return n, min(cap_tokens, n * block)


def _run_lru(
    requests: Sequence[Timed],
    hashes: list[list[bytes]],
    events: list[tuple[float, int, int]],
    block: int,
    capacity: int,
) -> list[int]:
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = [0] * len(requests)
    for _, kind, i in events:
        chain = hashes[i]
        if kind == 1:  # lookup
            n, tok = _hit(chain, cache, cacheable(len(requests[i].prompt), block), block)
            hits[i] = tok
            for h in chain[:n]:
                cache.move_to_end(h)
            continue
        for h in chain:  # save
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _run_opt(
    requests: Sequence[Timed],
    hashes: list[list[bytes]],
    events: list[tuple[float, int, int]],
    block: int,
    capacity: int,
) -> list[int]:
    never = len(events) + 1
    # the positions (in event order) of every lookup that asks for each block
    uses: dict[bytes, list[int]] = {}
    for pos, (_, kind, i) in enumerate(events):
        if kind == 1:
            for h in hashes[i]:
                uses.setdefault(h, []).append(pos)
    cursor: dict[bytes, int] = {h: 0 for h in uses}

    def next_use(h: bytes, after: int) -> int:
        lst = uses.get(h)
        if not lst:
            return never
        k = cursor[h]
        while k < len(lst) and lst[k] <= after:
            k += 1
        cursor[h] = k
        return lst[k] if k < len(lst) else never

    cache: dict[bytes, int] = {}  # block -> its next use when last (re)scored
    heap: list[tuple[int, int, bytes]] = []  # (-next use, -depth, block); stale ones skipped
    hits = [0] * len(requests)
    for pos, (_, kind, i) in enumerate(events):
        chain = hashes[i]
        if kind == 1:
            _, tok = _hit(chain, cache, cacheable(len(requests[i].prompt), block), block)
            hits[i] = tok
            for depth, h in enumerate(chain):
                if h in cache:
                    nu = next_use(h, pos)
                    cache[h] = nu
                    heapq.heappush(heap, (-nu, -depth, h))
            continue
        if capacity <= 0:
            continue
        for depth, h in enumerate(chain):
            nu = next_use(h, pos)
            cache[h] = nu
            heapq.heappush(heap, (-nu, -depth, h))
        while len(cache) > capacity:
            neg, _, h = heapq.heappop(heap)
            if cache.get(h) == -neg:
                del cache[h]
    return hits
