"""DramTier.acquire_many / release_many behave exactly like one acquire / release per key."""

from __future__ import annotations

import random

from kvstore.worker.tiers.blocks import Block
from kvstore.worker.tiers.dram import DramTier

KiB = 1024
MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def filled(n: int = 40) -> DramTier:
    t = DramTier(8 * MiB, 1 * MiB)
    for i in range(n):
        b = t.reserve("ns", k(i), 4 * KiB + i, checksum=i)
        assert b is not None
        t.commit(b)
    b = t.reserve("ns", k(999), 100, checksum=1)  # pending: not readable
    assert b is not None
    return t


def state(t: DramTier) -> tuple[object, ...]:
    lru = [s for _, s in t._walk(0)] + [s for x in range(1, len(t._head)) for _, s in t._walk(x)]
    return (
        list(t.pins),
        list(t.state),
        list(t.gen),
        lru,
        t.counters.hits,
        t.counters.misses,
        t.used_bytes,
        t.keys,
        [b.key for b in t.oldest(1 << 30)],
    )


def same(a: Block | None, b: Block | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.ns, a.key, a.offset, a.size, a.checksum, a.slot_size, a.slot, a.gen) == (
        b.ns, b.key, b.offset, b.size, b.checksum, b.slot_size, b.slot, b.gen
    )  # fmt: skip


def test_acquire_many_matches_acquire_per_key_pins_lru_counters_misses() -> None:
    rng = random.Random(7)
    for n in (1, 3, 8, 32, 100):
        keys = [k(rng.randrange(0, 50)) if rng.random() > 0.1 else k(999) for _ in range(n)]
        keys += [keys[0], b"short", bytearray(k(2)), memoryview(k(3))]  # type: ignore[list-item]
        one, many = filled(), filled()
        got_one = [one.acquire("ns", key) for key in keys]
        got_many = many.acquire_many("ns", keys)
        assert len(got_many) == len(keys)
        assert all(same(a, b) for a, b in zip(got_one, got_many, strict=True))
        assert state(one) == state(many)
        # Release in a different order than taken: same final state either way.
        order = list(range(len(keys)))
        rng.shuffle(order)
        for i in order:
            b = got_one[i]
            if b is not None:
                one.release(b)
        many.release_many(b for i in order if (b := got_many[i]) is not None)
        assert state(one) == state(many)
        assert all(p == 0 for p in many.pins)


def test_acquire_many_unknown_namespace_counts_misses() -> None:
    t = filled()
    assert t.acquire_many("other", [k(1), k(2)]) == [None, None]
    assert t.counters.misses == 2 and t.counters.hits == 0


def test_release_many_frees_doomed_blocks_on_the_last_release_and_ignores_stale() -> None:
    one, many = filled(), filled()
    a = [one.acquire("ns", k(i)) for i in (1, 1, 2)]
    b = many.acquire_many("ns", [k(1), k(1), k(2)])
    for t in (one, many):
        assert t.remove("ns", k(1)) and t.remove("ns", k(2))
    for x in a:
        assert x is not None
        one.release(x)
    many.release_many([x for x in b if x is not None])
    assert state(one) == state(many)
    assert many.peek("ns", k(1)) is None and all(x is not None and not x.live for x in b)
    # The slots are free (maybe reused): releasing the stale handles again does nothing.
    before = state(many)
    many.release_many([x for x in b if x is not None])
    assert state(many) == before


def test_a_block_pinned_by_acquire_many_is_not_evicted() -> None:
    t = DramTier(2 * MiB, 1 * MiB)
    for i in range(2):
        b = t.reserve("ns", k(i), 1 * MiB, checksum=i)
        assert b is not None
        t.commit(b)
    (held,) = t.acquire_many("ns", [k(0)])
    assert held is not None
    b = t.reserve("ns", k(5), 1 * MiB, checksum=5)  # evicts k(1), the only unpinned one
    assert b is not None and t.peek("ns", k(1)) is None and held.ready
    t.release_many([held])
    assert held.pins == 0 and t.oldest(1)[0].key == k(0)


def test_set_checksum_only_while_pending() -> None:
    """A writer that learns its block's checksum after writing (FLAG_LATE_SUM) sets it
    before the commit; a committed, aborted or stale block keeps what it has."""
    t = DramTier(8 * MiB, 1 * MiB)
    b = t.reserve("ns", k(1), 1000, 0)
    assert b is not None
    assert not t.set_checksum(b, -1) and not t.set_checksum(b, 1 << 64)
    assert t.set_checksum(b, 0xDEADBEEF)
    t.commit(b)
    got = t.acquire("ns", k(1))
    assert got is not None and got.checksum == 0xDEADBEEF
    t.release(got)
    assert not t.set_checksum(b, 7)  # committed: unchanged
    got = t.acquire("ns", k(1))
    assert got is not None and got.checksum == 0xDEADBEEF
    t.release(got)
    c = t.reserve("ns", k(2), 1000, 0)
    assert c is not None
    t.abort(c)
    assert not t.set_checksum(c, 5)  # the slot is free (maybe reused): stale handle
