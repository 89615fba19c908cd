"""The DRAM tier state machine: allocation, first writer wins, LRU, slabs, pins."""

from __future__ import annotations

import pytest

from kvstore.worker.tiers.dram import DramTier
from kvstore_client.errors import InvalidArgument, ResourceExhausted
from kvstore_client.sizeclasses import size_classes

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
    assert got == b and got.size == 1000 and got.checksum == 42
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


# ---- issue 11 item 2: pinned blocks never stop eviction of the others ----------------


def test_many_read_pinned_blocks_at_the_old_end_do_not_stop_eviction() -> None:
    t = DramTier(1 * MiB, 1 * MiB)  # one slab: 256 slots of 4 KiB
    for i in range(256):
        assert put(t, i, 4 * KiB)
    held = [t.acquire("ns", k(i)) for i in range(100)]  # 100 readers hold the oldest ones
    assert all(h is not None for h in held)
    for i in range(1000, 1300):  # every later put evicts the oldest unpinned block
        assert put(t, i, 4 * KiB)
    assert all(t.contains("ns", k(i)) for i in range(100)), "pinned blocks stay"
    assert not any(t.contains("ns", k(i)) for i in [*range(100, 256), *range(1000, 1144)])
    assert all(t.contains("ns", k(i)) for i in range(1144, 1300))
    for h in held:
        assert h is not None
        t.release(h)
    assert put(t, 5000, 4 * KiB)
    assert t.counters.evictions == 301


def test_pinned_namespace_filling_the_old_end_does_not_stop_eviction() -> None:
    t = DramTier(1 * MiB, 1 * MiB, pinned=["sys"])
    for i in range(200):
        assert put(t, i, 4 * KiB, "sys")
    for i in range(1000, 1500):
        assert put(t, i, 4 * KiB)
    assert all(t.contains("sys", k(i)) for i in range(200))
    assert all(t.contains("ns", k(i)) for i in range(1444, 1500))
    with pytest.raises(ResourceExhausted):  # only pinned blocks left in the only slab
        for i in range(200, 300):
            assert put(t, i, 4 * KiB, "sys")


def test_a_wholly_pinned_class_takes_a_movable_slab_from_another_class() -> None:
    t = DramTier(4 * MiB, 1 * MiB)
    for i in range(16):  # slab A: 16 x 64 KiB, all pinned by readers
        assert put(t, i, 64 * KiB)
    held = [t.acquire("ns", k(i)) for i in range(16)]
    for i in range(100, 100 + 3 * 256):  # 3 slabs of 4 KiB blocks
        assert put(t, i, 4 * KiB)
    old = t.acquire("ns", k(100))  # a reader in the oldest 4 KiB slab: it cannot move
    assert old is not None
    assert put(t, 50, 64 * KiB), "a 64 KiB put takes one of the two movable 4 KiB slabs"
    assert t.counters.slab_moves == 1
    assert t.contains("ns", k(100)) and all(t.contains("ns", k(i)) for i in range(16))
    for h in [*held, old]:
        assert h is not None
        t.release(h)


# ---- issue 11 item 7: flat slot arrays, handles, batch lookups -----------------------


def test_index_agrees_with_a_dict_model_through_growth_and_deletions() -> None:
    import random

    rng = random.Random(7)
    t = DramTier(64 * MiB, 1 * MiB)  # 16,384 slots of 4 KiB: no eviction below that
    model: dict[tuple[str, bytes], int] = {}
    for step in range(6000):
        ns = f"n{rng.randrange(3)}"
        kk = k(rng.randrange(4000))
        if rng.random() < 0.65:
            b = t.reserve(ns, kk, 4000, step)
            assert (b is None) == ((ns, kk) in model)
            if b is not None:
                if rng.random() < 0.1:
                    t.abort(b)
                else:
                    t.commit(b)
                    model[(ns, kk)] = step
        else:
            assert t.remove(ns, kk) == ((ns, kk) in model)
            model.pop((ns, kk), None)
    assert t.keys == len(model) and t.counters.evictions == 0
    probe = [k(i) for i in range(4000)]
    for ns in ("n0", "n1", "n2", "absent"):
        want = [(ns, kk) in model for kk in probe]
        assert t.exists_many(ns, probe) == want
        assert [t.contains(ns, kk) for kk in probe] == want
        assert sorted(t.keys_of(ns)) == sorted(kk for n, kk in model if n == ns)
    for (ns, kk), c in model.items():
        b = t.peek(ns, kk)
        assert b is not None and b.checksum == c and b.key == kk and b.ns == ns
    assert {(b.ns, b.key) for b in t.blocks()} == set(model)
    assert t.remove_namespace("n1") == sum(1 for n, _ in model if n == "n1")
    assert t.keys_of("n1") == [] and not t.exists_many("n1", probe)[0]


def test_a_stale_handle_never_acts_on_a_reused_slot() -> None:
    t = DramTier(1 * MiB, 1 * MiB)
    assert put(t, 1, 1 * MiB)
    old = t.acquire("ns", k(1))
    assert old is not None and old.pins == 1 and old.ready
    assert t.remove("ns", k(1)) and old.doomed and not old.ready
    t.release(old)  # the slot is freed here ...
    assert not old.doomed and old.pins == 0
    new = t.reserve("ns", k(2), 1 * MiB, 0)  # ... and reused
    assert new is not None and new.offset == old.offset and new != old
    t.release(old)
    t.commit(old)
    t.abort(old)
    assert not t.pin(old)
    assert t.peek("ns", k(2)) is None and new.live, "the stale handle did nothing"
    t.commit(new)
    assert t.contains("ns", k(2)) and t.peek("ns", k(2)) == new


def test_slot_sizes_tags_pins_and_eviction_callback() -> None:
    seen: list[tuple[bytes, bool, int]] = []
    t = DramTier(1 * MiB, 1 * MiB, on_evict=lambda b: seen.append((b.key, b.ready, b.slot_size)))
    b = t.reserve("ns", k(1), 1000, 5)
    assert b is not None and b.slot_size == 1024
    assert t.used_bytes == 1000 and t.slot_bytes_used == 1024
    t.set_tag(b, 77)
    t.commit(b)
    assert t.tag_of(b) == 77 and t.tag_of(t.peek("ns", k(1)) or b) == 77
    assert t.pin(b) and b.pins == 1
    assert t.oldest(1 << 30) == [], "a pinned block is not offered for demotion"
    t.release(b)
    assert t.oldest(1 << 30) == [b]
    for i in range(2, 1026):  # 1024 slots of 1 KiB: the last put evicts block 1
        assert put(t, i, 1000)
    assert seen == [(k(1), True, 1024)], "on_evict sees the block before its slot is reused"
    assert t.slot_bytes_used == 1 * MiB and t.keys == 1024
    assert t.exists_many("ns", [k(i) for i in range(1, 20)]) == [False] + [True] * 18


def test_lookups_accept_any_bytes_like_key() -> None:
    t = DramTier(1 * MiB, 1 * MiB)
    assert put(t, 1, 100)
    for kk in (bytearray(k(1)), memoryview(bytearray(k(1)))):
        assert t.contains("ns", kk)  # type: ignore[arg-type]
        assert t.exists_many("ns", [kk] * 10) == [True] * 10  # type: ignore[list-item]
    assert t.reserve("ns", bytearray(k(1)), 100, 0) is None  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        t.reserve("ns", b"short", 100, 0)
    assert not t.contains("ns", b"short") and t.exists_many("ns", [b"short"] * 9) == [False] * 9
