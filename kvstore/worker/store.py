"""The worker's block store: the DRAM tier's bookkeeping plus the arena's bytes.

This is where bytes meet bookkeeping: one lock serialises the tier's state
machine (a few dict operations per block), while checksums and byte copies run
outside it. The gRPC servicer and every transfer server go through this class.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
from kvstore_client.errors import ResourceExhausted

from .arena import Arena
from .tiers.dram import Block, DramTier


@dataclass(slots=True)
class StoreCounters:
    checksum_errors: int = 0
    bad_frames: int = 0


class BlockStore:
    """Thread-safe block storage over one arena."""

    def __init__(self, arena: Arena, slab_size: int) -> None:
        self.arena = arena
        self.tier = DramTier(arena.size, slab_size)
        self.lock = threading.Lock()
        self.counters = StoreCounters()

    @property
    def max_value_size(self) -> int:
        return self.tier.max_value_size

    # ---- metadata ------------------------------------------------------------

    def exists(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        space = self.tier.index.get(ns)
        if space is None:
            return [False] * len(keys)
        with self.lock:
            out = []
            for k in keys:
                b = space.get(k)
                out.append(b is not None and b.ready)
            return out

    def match_prefix(self, ns: str, keys: Sequence[bytes], state_ns: str = "") -> int:
        """Leading run of present keys; with ``state_ns`` the state at the last one too."""
        flags = self.exists(ns, keys)
        n = 0
        for f in flags:
            if not f:
                break
            n += 1
        if state_ns:
            states = self.exists(state_ns, keys[:n])
            while n and not states[n - 1]:
                n -= 1
        return n

    def remove(self, ns: str, keys: Sequence[bytes]) -> int:
        with self.lock:
            return sum(self.tier.remove(ns, k) for k in keys)

    def remove_namespace(self, ns: str) -> int:
        with self.lock:
            return self.tier.remove_namespace(ns)

    # ---- writes (two-phase) --------------------------------------------------

    def reserve_many(
        self, ns: str, keys: Sequence[bytes], sizes: Sequence[int], checksums: Sequence[int]
    ) -> list[Block | ResourceExhausted | None]:
        """Reserve slots; per key a Block, None (already present) or ResourceExhausted."""
        out: list[Block | ResourceExhausted | None] = []
        with self.lock:
            for k, s, c in zip(keys, sizes, checksums, strict=True):
                try:
                    out.append(self.tier.reserve(ns, k, s, c))
                except ResourceExhausted as e:
                    out.append(e)
        return out

    def view(self, b: Block) -> memoryview:
        return self.arena.slot(b.offset, b.size)

    def finish_many(self, blocks: Sequence[Block], ok: Sequence[bool]) -> None:
        """Commit the blocks whose bytes arrived intact, abort the others."""
        with self.lock:
            for b, good in zip(blocks, ok, strict=True):
                if good:
                    self.tier.commit(b)
                else:
                    self.tier.abort(b)

    def put_bytes(self, ns: str, keys: Sequence[bytes], values: Sequence[bytes]) -> list[bool]:
        """Inline put (gRPC path): True = stored now, False = already present."""
        res = self.reserve_many(
            ns, keys, [len(v) for v in values], [xxhash.xxh3_64_intdigest(v) for v in values]
        )
        blocks: list[Block] = []
        stored: list[bool] = []
        for r, v in zip(res, values, strict=True):
            if isinstance(r, ResourceExhausted):
                self.finish_many(blocks, [False] * len(blocks))
                raise r
            if r is not None:
                self.view(r)[:] = v
                blocks.append(r)
            stored.append(r is not None)
        self.finish_many(blocks, [True] * len(blocks))
        return stored

    # ---- reads ---------------------------------------------------------------

    def acquire_many(self, ns: str, keys: Sequence[bytes]) -> list[Block | None]:
        """Pin and verify blocks; a checksum mismatch is dropped and reported as a miss.

        Every non-None result must be given back with :meth:`release_many`.
        """
        with self.lock:
            blocks = [self.tier.acquire(ns, k) for k in keys]
        bad: list[Block] = []
        for i, b in enumerate(blocks):
            if b is not None and xxhash.xxh3_64_intdigest(self.view(b)) != b.checksum:
                bad.append(b)
                blocks[i] = None
        if bad:
            with self.lock:
                for b in bad:
                    self.counters.checksum_errors += 1
                    self.tier.counters.hits -= 1
                    self.tier.counters.misses += 1
                    self.tier.remove(b.ns, b.key)
                    self.tier.release(b)
        return blocks

    def release_many(self, blocks: Sequence[Block | None]) -> None:
        with self.lock:
            for b in blocks:
                if b is not None:
                    self.tier.release(b)

    def get_bytes(self, ns: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Inline get (gRPC path): copies of the values, None for misses."""
        blocks = self.acquire_many(ns, keys)
        try:
            return [bytes(self.view(b)) if b is not None else None for b in blocks]
        finally:
            self.release_many(blocks)
