"""The tier policy as a pure state machine: ``policy.handle(event) == [instructions]``,
and BlockStore races that used to bring removed keys back (real arena, real LMDB)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.worker.arena import Arena
from kvstore.worker.requests import Budget, Limits
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.budgets import Promoter, QuotaBook, Watermarks
from kvstore.worker.tiers.policy import (
    Aborted,
    DeleteSsd,
    Demote,
    Evicted,
    NeedSsdRoom,
    Promote,
    Removed,
    Reserved,
    SsdBad,
    SsdHit,
    SsdWriteFailed,
    SsdWritten,
    Tick,
    TierPolicy,
    WriteSsd,
)
from kvstore.worker.tiers.ssd import SsdStore
from tests.helpers import key, value_for

MiB = 1 << 20


def slot64(n: int) -> int:
    return max(64, -(-n // 64) * 64)


def policy(*, ssd: bool = True, quota: int = 1 << 30, dram: set[tuple[str, bytes]] | None = None):
    held = dram if dram is not None else set()
    book = QuotaBook({"t": quota}, key_of=lambda ns: ns.split("/")[0])
    p = TierPolicy(
        has_ssd=ssd,
        ssd_capacity=1000,
        dram_marks=Watermarks(0.9, 0.5),
        ssd_marks=Watermarks(0.9, 0.5),
        promoter=Promoter("second-hit", window=10),
        books=[book],
        charge_of=slot64,
        in_dram=lambda ns, k: (ns, k) in held,
    )
    return p, book, held


def test_reserve_charges_slot_bytes_and_abort_refunds() -> None:
    p, book, _ = policy(quota=128)
    assert p.handle(Reserved("t/x", 0)) == []
    assert book.used["t"] == 64, "an empty value still occupies a 64-byte slot"
    assert p.admits("t/x", 64) and not p.admits("t/x", 65)
    p.handle(Aborted("t/x", 0))
    assert book.used["t"] == 0


def test_eviction_without_ssd_refunds_and_with_ssd_writes_it() -> None:
    p, book, _ = policy(ssd=False)
    p.handle(Reserved("t/x", 100))
    assert p.handle(Evicted("t/x", b"k", 100)) == []
    assert book.used["t"] == 0, "an evicted block gives its quota back"
    p, book, _ = policy(ssd=True)
    p.handle(Reserved("t/x", 100))
    assert p.handle(Evicted("t/x", b"k", 100)) == [WriteSsd("t/x", b"k")]
    assert book.used["t"] == 128, "on its way to SSD it still occupies space"
    p.handle(SsdWritten((("t/x", b"k", 100, 132, True),)))
    assert p.on_ssd("t/x", b"k")
    # Evicted again while on SSD: nothing to write.
    assert p.handle(Evicted("t/x", b"k", 100)) == []


def test_failed_ssd_write_of_an_evicted_block_refunds() -> None:
    p, book, _ = policy()
    p.handle(Reserved("t/x", 100))
    p.handle(Evicted("t/x", b"k", 100))
    p.handle(SsdWriteFailed((("t/x", b"k", 100),), evicted=True))
    assert book.used["t"] == 0 and p.counters.evicted_lost == 1


def test_removed_while_being_written_is_deleted_not_indexed() -> None:
    p, _, _ = policy()
    p.handle(Reserved("t/x", 100))
    out = p.handle(SsdWritten((("t/x", b"k", 100, 132, False),)))
    assert out == [DeleteSsd((("t/x", b"k"),))]
    assert not p.on_ssd("t/x", b"k")


def test_removal_refunds_once_across_tiers() -> None:
    p, book, held = policy()
    p.handle(Reserved("t/x", 100))
    p.handle(SsdWritten((("t/x", b"k", 100, 132, True),)))
    held.add(("t/x", b"k"))  # inclusive tiers: in DRAM and on SSD
    assert p.handle(Removed("t/x", b"k", True, 100)) == [DeleteSsd((("t/x", b"k"),))]
    assert book.used["t"] == 0


def test_ssd_room_evicts_lru_and_refunds_blocks_only_on_ssd() -> None:
    p, book, held = policy()
    for i in range(6):
        p.handle(Reserved("t/x", 100))
        p.handle(SsdWritten((("t/x", bytes([i]), 100, 150, True),)))
    held.add(("t/x", bytes([0])))  # block 0 also lives in DRAM
    out = p.handle(NeedSsdRoom(100))  # 900 + 100 > 0.9 * 1000: free 500 (4 x 150)
    assert out == [DeleteSsd(tuple(("t/x", bytes([i])) for i in range(4)))]
    assert book.used["t"] == 128 * 3, "block 0 is still in DRAM: still charged"
    assert p.handle(NeedSsdRoom(300, force=True)) == [
        DeleteSsd((("t/x", b"\x04"), ("t/x", b"\x05")))
    ]


def test_room_asked_by_concurrent_ssd_writers_counts_the_writes_in_flight() -> None:
    """Writers ask for SSD room under the lock and write outside it: room granted to one
    writer is booked until its write is accounted, so three writers that each fit under
    the high mark alone cannot overfill the SSD together (a clean-clone CI run saw the
    SSD index at 1,025 x 8 KiB against an 8 MiB SSD)."""
    p, _, _ = policy()
    for i in range(5):
        p.handle(Reserved("t/x", 100))
        p.handle(SsdWritten((("t/x", bytes([i]), 100, 150, True),)))
    assert p.ssd.used_bytes == 750
    outs = [p.handle(NeedSsdRoom(150)) for _ in range(3)]  # 750 + 150 <= 0.9 * 1000 alone
    assert outs[0] == [], "the first writer fits under the high mark"
    assert outs[1], "the second counts the first's 150 bytes in flight: over the mark"
    for w in range(3):
        p.handle(SsdWritten((("t/x", bytes([10 + w]), 100, 150, True),), reserved=150))
        assert p.ssd.used_bytes + p.ssd.pending <= 1000
    assert p.ssd.pending == 0, "every booking is given back when its write is accounted"
    p.handle(NeedSsdRoom(150))
    p.handle(SsdWriteFailed((("t/x", b"z", 100),), evicted=False, reserved=150))
    assert p.ssd.pending == 0, "a failed write gives its booking back too"


def test_ssd_hit_promotes_on_second_hit_and_bad_entries_are_dropped() -> None:
    p, book, _ = policy()
    p.handle(Reserved("t/x", 100))
    p.handle(SsdWritten((("t/x", b"k", 100, 132, True),)))
    assert p.handle(SsdHit("t/x", b"k", 0.0)) == []
    assert p.handle(SsdHit("t/x", b"k", 1.0)) == [Promote("t/x", b"k")]
    assert p.handle(SsdBad("t/x", b"k")) == [DeleteSsd((("t/x", b"k"),))]
    assert book.used["t"] == 0


def test_tick_demotes_above_the_high_mark_only_with_ssd() -> None:
    p, _, _ = policy()
    assert p.handle(Tick(80, 100)) == []
    assert p.handle(Tick(95, 100)) == [Demote(45)]
    p, _, _ = policy(ssd=False)
    assert p.handle(Tick(95, 100)) == []


def test_budget_bounds_connections_clients_and_the_worker() -> None:
    b = Budget(Limits(hold_per_connection=100, hold_per_client=150, hold_per_worker=250))
    c1, c2 = b.holder("a"), b.holder("a")
    assert c1.take(80) and not c1.take(30), "per connection"
    assert c2.take(60) and not c2.take(20), "per client address (80 + 60 + 20 > 150)"
    c3 = b.holder("b")
    assert c3.take(100) and not b.holder("c").take(20), "per worker"
    c1.close()
    assert b.holder("c").take(20)


# ---- BlockStore races (real arena, real LMDB) ---------------------------------------------


@pytest.fixture
def ssd_store(tmp_path: Path) -> Iterator[BlockStore]:
    arena = Arena(4 * MiB)
    st = BlockStore(
        arena,
        MiB,
        ssd=SsdStore(str(tmp_path / "ssd"), 64 * MiB),
        promoter=Promoter("always"),
    )
    try:
        yield st
    finally:
        st.close(demote_timeout=1)
        arena.close()


def _on_ssd_only(st: BlockStore, k: bytes, v: bytes) -> None:
    assert st.put_bytes("ns", [k], [v]) == [True]
    st.demote(1 << 40, everything=True)
    assert not st.tier.contains("ns", k) and st.policy.on_ssd("ns", k)


def test_key_removed_during_an_ssd_read_stays_removed(ssd_store: BlockStore) -> None:
    k, v = key(1, "ssd-read"), value_for(key(1, "ssd-read"), 100_000)
    _on_ssd_only(ssd_store, k, v)
    r = ssd_store.read("ns", [k])
    assert r.held[0] is not None and bytes(r.held[0].view) == v
    assert ssd_store.remove("ns", [k]) == 1
    ssd_store.done(r)
    assert ssd_store.exists("ns", [k]) == [False], "a removed key must not come back"
    assert ssd_store.get_bytes("ns", [k]) == [None]


def test_ended_read_transaction_then_remove_does_not_promote_garbage(
    ssd_store: BlockStore,
) -> None:
    k, v = key(2, "early-end"), value_for(key(2, "early-end"), 100_000)
    _on_ssd_only(ssd_store, k, v)
    r = ssd_store.read("ns", [k])
    ssd_store.end_txn(r)  # what the shm server does after sending SSD bytes inline
    ssd_store.remove("ns", [k])
    ssd_store.done(r)
    assert ssd_store.exists("ns", [k]) == [False]
    assert ssd_store.counters.checksum_errors == 0


def test_quota_is_refunded_when_dram_evicts_without_ssd() -> None:
    arena = Arena(2 * MiB)
    try:
        st = BlockStore(arena, MiB, tenant_quota=QuotaBook({"t": 3 * MiB}, key_of=lambda n: "t"))
        for i in range(8):  # 8 MiB through a 2 MiB arena under a 3 MiB quota
            k = key(i, "evict")
            assert st.put_bytes("t", [k], [value_for(k, MiB)]) == [True]
    finally:
        arena.close()
