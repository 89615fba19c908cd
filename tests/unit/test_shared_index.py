"""The same-host index without processes: the DRAM tier mirrors its ready blocks into
the shared index, a client (the real reader and hazard page, over the same memfds)
probes and pins them, and the tier honours the pins: it never frees or reuses a
pinned slot, withdraws before it checks, and reclaims pins a client drops or scribbles."""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.dram import DramTier
from kvstore.worker.tiers.shared import SharedIndex
from kvstore_client.transport import shmindex
from kvstore_client.transport.shmindex import NHAZ, HazardPage, IndexView

MiB = 1 << 20
NS = "ns/a"
SIZE = 64 << 10


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"k{i}".encode())


class Rig:
    """A tier with its shared index, and one client's view of it."""

    def __init__(self, capacity: int = 4 * MiB, *, ssd: bool = False) -> None:
        self.tier = DramTier(capacity, 1 * MiB)
        self.index = SharedIndex(self.tier.capacity, 0x1234, ssd=ssd)
        self.tier.shared = self.index
        self.view = IndexView(self.index.ro_fd, self.index.size, 0x1234)
        self.cid, fd = self.index.add_client()
        self.page = HazardPage(fd)

    def put(self, i: int, ns: str = NS) -> int:
        b = self.tier.reserve(ns, key(i), SIZE, i)
        assert b is not None
        self.tier.commit(b)
        return b.offset

    def probe(self, keys: list[bytes], ns: str = NS) -> shmindex.Probe:
        return self.view.probe(ns.encode(), b"".join(keys))

    def pin(self, keys: list[bytes]) -> int:
        """Pin every key (all must be found and still); the hazard range's start."""
        p = self.probe(keys)
        assert p.found.all()
        rows = np.arange(len(keys))
        start = self.page.take(len(keys))
        self.page.publish(start, p.slots(rows))
        assert self.view.still(p, rows).all()
        return start

    def upkeep(self) -> None:
        """What the store's upkeep does (BlockStore.shared_upkeep), in one thread."""
        self.tier.apply_reads(self.index.drain())
        self.index.reap(self.tier.release)

    def close(self) -> None:
        self.index.close()


@pytest.fixture
def rig() -> Rig:
    r = Rig()
    yield r  # type: ignore[misc]
    r.close()


def test_ready_blocks_are_mirrored_and_withdrawn(rig: Rig) -> None:
    off = rig.put(1)
    pending = rig.tier.reserve(NS, key(2), SIZE, 2)  # reserved, not committed
    p = rig.probe([key(1), key(2), key(3)])
    assert p.found.tolist() == [True, False, False]
    assert p.unsure.tolist() == [False, False, False]  # no overflow, no SSD: misses
    w = p.words[0]
    assert int(w[shmindex.W_OFF]) == off and int(w[shmindex.W_SUM]) == 1
    assert int(w[shmindex.W_SIZESLOT]) & 0xFFFFFFFF == SIZE
    assert not rig.probe([key(1)], "ns/other").found[0]  # namespaces apart
    assert pending is not None
    rig.tier.commit(pending)
    assert rig.probe([key(2)]).found[0]
    rig.tier.remove(NS, key(1))
    assert not rig.probe([key(1)]).found[0]


def test_a_pinned_block_is_kept_through_eviction_until_released(rig: Rig) -> None:
    rig.put(0)
    start = rig.pin([key(0)])
    for i in range(1, 200):  # four times the arena: key 0 is the oldest throughout
        rig.put(i)
    assert rig.tier.contains(NS, key(0))  # kept, as a reader's pin keeps a block
    rig.page.give(start, 1)
    rig.upkeep()
    for i in range(200, 400):
        rig.put(i)
    assert not rig.tier.contains(NS, key(0))


def test_a_removal_racing_a_pin_never_frees_the_slot_until_released(rig: Rig) -> None:
    off = rig.put(0)
    start = rig.pin([key(0)])
    assert rig.tier.remove(NS, key(0))
    assert not rig.probe([key(0)]).found[0]  # withdrawn for everyone else
    offsets = [rig.put(i) for i in range(1, 200)]
    assert off not in offsets  # the slot stayed out of reach while pinned
    rig.page.give(start, 1)
    rig.upkeep()
    assert off in [rig.put(i) for i in range(200, 300)]  # and comes back after


def test_a_pin_published_after_the_withdrawal_fails_its_recheck(rig: Rig) -> None:
    rig.put(0)
    p = rig.probe([key(0)])
    rig.tier.remove(NS, key(0))  # between the client's probe and its pin
    rows = np.arange(1)
    start = rig.page.take(1)
    rig.page.publish(start, p.slots(rows))
    assert not rig.view.still(p, rows)[0]  # the client must not use it
    rig.page.give(start, 1)


def test_a_dead_clients_pins_are_reclaimed(rig: Rig) -> None:
    rig.put(0)
    rig.pin([key(0)])
    for i in range(1, 100):
        rig.put(i)
    assert rig.tier.contains(NS, key(0))
    rig.index.drop_client(rig.cid)  # its connection closed
    rig.upkeep()
    for i in range(100, 300):
        rig.put(i)
    assert not rig.tier.contains(NS, key(0))


def test_a_scribbling_client_can_only_hold_slots_and_cannot_break_the_tier(rig: Rig) -> None:
    offs = {rig.put(i): i for i in range(60)}
    words = rig.probe([key(i) for i in range(60)]).slots(np.arange(60))
    rng = np.random.default_rng(7)
    page = rig.page
    # Garbage everywhere: hazard words (some naming real slots), a wild count, a wild ring.
    page.haz[:] = rng.integers(0, 2**63, NHAZ, dtype=np.uint64)
    page.haz[:30] = words[:30]
    struct.pack_into("<QQ", page._mm, 0, 2**64 - 1, 2**63)  # count and ring head
    page.ring[:] = rng.integers(0, 2**63, len(page.ring), dtype=np.uint64)
    for r in range(5):
        rig.upkeep()
        for i in range(100 + 100 * r, 200 + 100 * r):
            rig.put(i)
    held = [k for k in range(60) if rig.tier.contains(NS, key(k))]
    assert held == list(range(30))  # exactly what it named, nothing more
    assert len(offs) == 60
    page.haz[:] = 0
    rig.upkeep()
    for i in range(1000, 1200):
        rig.put(i)
    assert not any(rig.tier.contains(NS, key(k)) for k in range(60))


def test_a_full_bucket_makes_its_misses_unsure_and_an_ssd_makes_every_miss_unsure() -> None:
    rig = Rig(64 * MiB)
    try:
        tag = shmindex.ns_tag(NS, rig.index.seed)
        # Keys that all land in bucket 0: more than its ways.
        same: list[bytes] = []
        n = 0
        while len(same) < shmindex.WAYS + 2:
            k = xxhash.xxh3_128_digest(os.urandom(8) + n.to_bytes(4, "little"))
            n += 1
            lo = int.from_bytes(k[:8], "little")
            if shmindex.bucket_of(lo ^ tag, rig.index.bits) == 0:
                same.append(k)
        for i, k in enumerate(same):
            b = rig.tier.reserve(NS, k, 64, i)
            assert b is not None
            rig.tier.commit(b)
        p = rig.view.probe(NS.encode(), b"".join(same))
        assert p.found.sum() == shmindex.WAYS
        assert (p.unsure == ~p.found).all()  # overflowed: ask the worker
        for k in same:
            rig.tier.remove(NS, k)
        assert int(rig.view.overflow[0]) == 0
    finally:
        rig.close()
    ssd = Rig(ssd=True)
    try:
        assert ssd.probe([key(5)]).unsure[0]
    finally:
        ssd.close()


def test_the_index_reaches_clients_read_only() -> None:
    rig = Rig()
    try:
        with pytest.raises(PermissionError):
            import mmap

            mmap.mmap(rig.index.ro_fd, rig.index.size, mmap.MAP_SHARED)
        # Reopening the memory read-write is refused too (sealed against new writers).
        with pytest.raises(PermissionError):
            fd = os.open(f"/proc/self/fd/{rig.index.ro_fd}", os.O_RDWR)
            try:
                mmap.mmap(fd, rig.index.size, mmap.MAP_SHARED)
            finally:
                os.close(fd)
    finally:
        rig.close()


def test_reads_through_the_index_count_in_the_lru_before_the_next_eviction(rig: Rig) -> None:
    """Found by the replay test: same-host reads reached the LRU only at the next
    upkeep tick, so a put right after a read could evict what was just read."""
    for i in range(64):  # the arena is full: 64 slots of 64 KiB
        rig.put(i)
    hits = rig.tier.counters.hits
    words = rig.probe([key(0)]).slots(np.arange(1))
    rig.page.touched(words)  # key 0 read through the index
    rig.put(64)  # no upkeep in between: the eviction itself must apply the read first
    assert rig.tier.contains(NS, key(0)) and not rig.tier.contains(NS, key(1))
    assert rig.tier.counters.hits == hits + 1


def test_lookups_go_to_the_worker_while_it_asks_for_them(rig: Rig) -> None:
    """A lookup may resume a paused session on the worker: while one is paused the
    worker asks for lookups (reads still go through the index)."""
    from kvstore_client.transport import shmlocal

    rig.put(0)
    loc = shmlocal.Local(np.zeros(1, np.uint8), memoryview(b""), rig.view, rig.page)
    packed = key(0)
    assert shmlocal.prefix(loc, NS.encode(), packed) == 1
    rig.index.ask_lookups(True)
    assert shmlocal.prefix(loc, NS.encode(), packed) is None
    assert shmlocal.exists(loc, NS.encode(), packed) is None
    rig.index.ask_lookups(False)
    assert shmlocal.exists(loc, NS.encode(), packed) is not None


@contextlib.contextmanager
def _store_read_through_index() -> Iterator[tuple[BlockStore, SharedIndex, int, int]]:
    """A BlockStore with its shared index and one client that has read three of its
    four blocks through the index (logged, not yet drained): (store, index, the
    client's id, the store's hits before the reads)."""
    arena = Arena(4 * MiB)
    store = BlockStore(arena, 1 * MiB)
    index = SharedIndex(store.tier.capacity, 0x4321, ssd=False)
    store.tier.shared = index
    cid, fd = index.add_client()
    view = IndexView(index.ro_fd, index.size, 0x4321)
    page = HazardPage(fd)
    try:
        keys = [key(i) for i in range(4)]
        assert all(store.put_bytes(NS, keys, [bytes([i]) * SIZE for i in range(4)]))
        before = store.stats().hits
        probe = view.probe(NS.encode(), b"".join(keys[:3]))
        assert probe.found.all()
        page.touched(probe.slots(np.arange(3)))  # three blocks read through the index
        yield store, index, cid, before
    finally:
        store.tier.shared = None
        index.close()
        store.close()
        arena.close()


def test_stats_count_a_read_through_the_index_at_once() -> None:
    """Bug (a clean-clone CI run, tests/integration/test_ssd_tier.py): a Stats call
    right after a same-host client's reads reported 480 hits for 512 blocks read, as
    the last batch's reads waited in the index's log for the next upkeep tick."""
    with _store_read_through_index() as (store, _index, _cid, before):
        assert store.stats().hits == before + 3


def test_reads_a_client_logged_count_after_it_closed() -> None:
    """Bug (a clean-clone CI run, tests/integration/test_ssd_tier.py, again 480 hits for
    512 blocks read): the client closed right after its last reads, its page went with
    its connection, and the reads it had logged there since the last drain were lost."""
    with _store_read_through_index() as (store, index, cid, before):
        index.drop_client(cid)  # its connection closed before the worker drained
        assert store.stats().hits == before + 3
        assert store.stats().hits == before + 3, "counted once"


@pytest.mark.parametrize("size", [SIZE, 200 << 10, MiB])  # one pass, chunked, the pool
def test_reads_through_the_index_land_exact_bytes_and_refuse_what_does_not_verify(
    size: int,
) -> None:
    """shmlocal.read, small batches on the caller's thread and big ones over the copy
    pool: hits land byte for byte; a block whose arena bytes no longer match the
    checksum the worker verified, and a buffer of another size, are misses; a key the
    index lacks is a sure miss (not left for the socket)."""
    from kvstore_client.transport import shmlocal

    tier = DramTier(16 * MiB, 1 * MiB)
    index = SharedIndex(tier.capacity, 0x77, ssd=False)
    tier.shared = index
    try:
        view = IndexView(index.ro_fd, index.size, 0x77)
        _, fd = index.add_client()
        arena = np.zeros(tier.capacity, dtype=np.uint8)
        values = [os.urandom(size) for _ in range(5)]
        for i, v in enumerate(values):
            b = tier.reserve(NS, key(i), size, xxhash.xxh3_64_intdigest(v))
            assert b is not None
            arena[b.offset : b.offset + size] = np.frombuffer(v, np.uint8)
            tier.commit(b)
            if i == 2:  # a stray write after the worker verified it
                arena[b.offset + size // 2] ^= 0xFF
        loc = shmlocal.Local(arena, memoryview(arena), view, HazardPage(fd))
        keys = [key(i) for i in range(6)]  # key 5 was never stored
        bufs = [memoryview(bytearray(size)) for _ in range(6)]
        bufs[3] = memoryview(bytearray(size - 1))
        found = [False] * 6
        got: list[bytearray | None] = [None] * 6
        sizes = [b.nbytes for b in bufs]

        def bounce(n: int) -> tuple[np.ndarray, memoryview]:
            a = np.empty(n, np.uint8)
            return a, memoryview(a)

        left, total = shmlocal.read(
            loc, NS.encode(), b"".join(keys), bufs, sizes, found, got, bounce
        )
        assert found == [True, True, False, False, True, False]
        assert left == [] and total == 3 * size
        for i in (0, 1, 4):
            assert bytes(bufs[i]) == values[i]
        found = [False] * 6
        left, _ = shmlocal.read(loc, NS.encode(), b"".join(keys), None, [], found, got, bounce)
        assert found == [True, True, False, True, True, False] and left == []
        assert [bytes(v) if v is not None else None for v in got] == [
            values[0], values[1], None, values[3], values[4], None
        ]  # fmt: skip
    finally:
        tier.shared = None
        index.close()
