"""The DRAM tier state machine: allocation, first writer wins, LRU, slabs, pins."""

from __future__ import annotations

import pytest

from kvstore.worker.tiers.dram import DramTier, size_classes
from kvstore_client.errors import InvalidArgument, ResourceExhausted

KiB = 1024
MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(t: DramTier, i: int, size: int, ns: str = "ns") -> bool:
    b = t.reserve(ns, k(i), size, checksum=i)
    if b is None:
        return False
    t.commit(b)
    return True


def test_size_classes_cover_common_block_sizes_exactly() -> None:
    classes = size_classes(16 * MiB)
    for s in (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB):
        assert s in classes
    assert classes == sorted(set(classes))
    assert all(c % 64 == 0 for c in classes)


def test_reserve_commit_lookup_and_first_writer_wins() -> None:
    t = DramTier(4 * MiB, 1 * MiB)
    b = t.reserve("ns", k(1), 1000, 42)
    assert b is not None
    assert t.peek("ns", k(1)) is None, "a pending block must not be visible"
    assert t.reserve("ns", k(1), 1000, 42) is None, "second writer of a pending key skips"
    t.commit(b)
    got = t.acquire("ns", k(1))
    assert got is b and got.size == 1000 and got.checksum == 42
    t.release(got)
    assert t.reserve("ns", k(1), 1000, 42) is None
    assert t.counters.skipped == 2
    assert t.keys == 1 and t.used_bytes == 1000


def test_abort_frees_the_slot_and_leaves_no_key() -> None:
    t = DramTier(1 * MiB, 1 * MiB)
    b = t.reserve("ns", k(1), 1 * MiB, 0)
    assert b is not None
    t.abort(b)
    assert t.peek("ns", k(1)) is None
    assert t.used_bytes == 0
    assert put(t, 2, 1 * MiB), "the aborted slot is reusable"


def test_namespaces_are_separate() -> None:
    t = DramTier(2 * MiB, 1 * MiB)
    assert put(t, 1, 100, "a")
    assert put(t, 1, 100, "b")
    assert t.contains("a", k(1)) and t.contains("b", k(1))
    assert t.remove_namespace("a") == 1
    assert not t.contains("a", k(1)) and t.contains("b", k(1))


def test_lru_evicts_least_recently_used_first() -> None:
    t = DramTier(1 * MiB, 1 * MiB)  # one slab: 16 slots of 64 KiB
    for i in range(16):
        assert put(t, i, 64 * KiB)
    b = t.acquire("ns", k(0))  # 0 becomes most recently used
    assert b is not None
    t.release(b)
    assert put(t, 100, 64 * KiB)
    assert not t.contains("ns", k(1)), "block 1 was least recently used"
    assert t.contains("ns", k(0))
    assert t.counters.evictions == 1


def test_pinned_blocks_are_not_evicted_and_full_pins_exhaust() -> None:
    t = DramTier(1 * MiB, 1 * MiB)
    pins = []
    for i in range(16):
        assert put(t, i, 64 * KiB)
        b = t.acquire("ns", k(i))
        assert b is not None
        pins.append(b)
    with pytest.raises(ResourceExhausted):
        t.reserve("ns", k(99), 64 * KiB, 0)
    t.release(pins[5])
    assert put(t, 99, 64 * KiB)
    assert not t.contains("ns", k(5))


def test_remove_while_pinned_frees_on_release() -> None:
    t = DramTier(1 * MiB, 1 * MiB)
    assert put(t, 1, 1 * MiB)
    b = t.acquire("ns", k(1))
    assert b is not None
    assert t.remove("ns", k(1))
    assert not t.contains("ns", k(1))
    assert t.used_bytes == 1 * MiB, "the slot stays allocated while a reader holds it"
    t.release(b)
    assert t.used_bytes == 0


def test_slabs_move_to_the_size_class_that_needs_them() -> None:
    t = DramTier(4 * MiB, 1 * MiB)
    for i in range(64):  # 4 slabs x 16 slots of 64 KiB
        assert put(t, i, 64 * KiB)
    assert t.used_bytes == 4 * MiB
    for i in range(4):  # 1 MiB blocks need whole slabs: the oldest small blocks give way
        assert put(t, 1000 + i, 1 * MiB)
    assert all(t.contains("ns", k(1000 + i)) for i in range(4))
    assert t.counters.slab_moves == 4
    assert not any(t.contains("ns", k(i)) for i in range(64))


def test_oversize_value_is_invalid() -> None:
    t = DramTier(2 * MiB, 1 * MiB)
    with pytest.raises(InvalidArgument):
        t.reserve("ns", k(1), 1 * MiB + 1, 0)


def test_emptied_slab_goes_to_another_size_class_without_evictions() -> None:
    t = DramTier(4 * MiB, 1 * MiB)
    for i in range(1024):  # every slab taken by 4 KiB blocks
        assert put(t, i, 4 * KiB)
    for i in range(1024):
        assert t.remove("ns", k(i))
    for i in range(4):  # the arena is empty: 1 MiB blocks must fit without evicting
        assert put(t, 5000 + i, 1 * MiB)
    assert t.counters.evictions == 0
    assert all(t.contains("ns", k(5000 + i)) for i in range(4))
