"""Tiering without a network: policy state machines, the LMDB tier, and BlockStore
with a real arena and a real LMDB on a temp dir."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.budgets import Promoter, QuotaBook, Watermarks, parse_pins
from kvstore.worker.tiers.ssd import HEADER_LEN, SsdStore, decode_header, encode_header
from kvstore.worker.tiers.ssdindex import SsdIndex
from kvstore_client.errors import InvalidArgument, ResourceExhausted
from tests.helpers import key, value_for

MiB = 1 << 20


def test_watermarks() -> None:
    w = Watermarks(0.9, 0.5)
    assert w.excess(89, 100) == 0
    assert w.excess(95, 100) == 45
    with pytest.raises(InvalidArgument):
        Watermarks(0.5, 0.9)


def test_promoter_modes() -> None:
    p = Promoter("second-hit", window=10)
    assert not p.on_hit("ns", b"k", now=0)
    assert p.on_hit("ns", b"k", now=5), "second hit within the window"
    assert not p.on_hit("ns", b"j", now=0) and not p.on_hit("ns", b"j", now=11)
    assert Promoter("always").on_hit("ns", b"k", 0)
    assert not Promoter("never").on_hit("ns", b"k", 0)
    with pytest.raises(InvalidArgument):
        Promoter("sometimes")


def test_ssd_index_lru_victims_skip_pinned() -> None:
    idx = SsdIndex(1000, pinned=["keep"])
    idx.add("a", b"1", 100, 132)
    idx.add("keep", b"2", 100, 132)
    idx.add("a", b"3", 100, 132)
    idx.touch("a", b"1")
    assert idx.victims(200) == [("a", b"3"), ("a", b"1")]
    assert idx.used_bytes == 396
    idx.remove("a", b"3")
    assert idx.used_bytes == 264 and len(idx) == 2


def test_pin_quota_and_parsing() -> None:
    q = QuotaBook(parse_pins(["sys=1KiB", "tools"]))
    tenants = QuotaBook({"a": 100}, key_of=lambda ns: ns.split("/")[0])
    assert tenants.admits("a/x", 100) and not tenants.admits("a/y", 101)
    tenants.charge("a/x", 60)
    assert not tenants.admits("a/y", 50), "one account for every namespace of a tenant"
    assert q.is_pinned("sys") and q.is_pinned("tools") and not q.is_pinned("x")
    assert q.admits("sys", 1024) and not q.admits("sys", 1025)
    q.charge("sys", 1000)
    assert not q.admits("sys", 100)
    q.refund("sys", 1000)
    assert q.admits("sys", 1024) and q.admits("x", 1 << 40)
    with pytest.raises(InvalidArgument):
        parse_pins(["bad ns"])


def test_header_roundtrip_and_rejection() -> None:
    payload = b"x" * 100
    raw = encode_header("ns", 100, 7) + payload
    h = decode_header("ns", raw)
    assert h is not None and h.size == 100 and h.checksum == 7
    assert decode_header("other", raw) is None, "a header names its namespace"
    assert decode_header("ns", raw[:-1]) is None, "a truncated value is rejected"
    assert decode_header("ns", b"junk" * 10) is None


def test_keys_with_zero_bytes_split_back() -> None:
    from kvstore.worker.tiers.ssd import lmdb_key, split_key

    h = b"\x00" * 7 + b"\x01" + b"\x00" * 8
    assert split_key(lmdb_key("a/b", h)) == ("a/b", h)
    with pytest.raises(ValueError):
        split_key(b"short")


def test_ssd_store_put_scan_view(tmp_path: Path) -> None:
    s = SsdStore(str(tmp_path / "db"), 64 * MiB)
    s.put_many([("ns", key(1), b"hello", 5), ("ns/2", key(2), b"world!", 6)])
    txn = s.begin_read()
    got = s.view(txn, "ns", key(1))
    assert got is not None and bytes(got[1]) == b"hello" and got[0].checksum == 5
    assert s.view(txn, "ns", key(2)) is None
    txn.abort()
    entries = sorted((ns, k, h.size if h else None, n) for _, ns, k, h, n in s.scan())
    assert entries == [("ns", key(1), 5, HEADER_LEN + 5), ("ns/2", key(2), 6, HEADER_LEN + 6)]
    s.close()


def test_ssd_store_map_full_is_resource_exhausted(tmp_path: Path) -> None:
    s = SsdStore(str(tmp_path / "db"), 2 * MiB)
    with pytest.raises(ResourceExhausted):
        s.put_many([("ns", key(i), bytes(256 * 1024), 0) for i in range(16)])
    s.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlockStore]:
    arena = Arena(4 * MiB)
    st = BlockStore(
        arena,
        1 * MiB,
        ssd=SsdStore(str(tmp_path / "ssd"), 64 * MiB),
        promoter=Promoter("second-hit", 60),
    )
    yield st
    st.close(demote_timeout=5)
    arena.close()


def put(st: BlockStore, ns: str, keys: list[bytes], size: int) -> list[bool]:
    return st.put_bytes(ns, keys, [value_for(k, size) for k in keys])


def read_all(st: BlockStore, ns: str, keys: list[bytes]) -> list[bytes | None]:
    return st.get_bytes(ns, keys)


def test_overflow_goes_to_ssd_and_reads_back(store: BlockStore) -> None:
    keys = [key(i) for i in range(24)]  # 24 MiB through a 4 MiB DRAM tier
    for k in keys:
        assert put(store, "ns", [k], MiB) == [True]
    got = read_all(store, "ns", keys)
    assert all(g == value_for(k, MiB) for g, k in zip(got, keys, strict=True))
    assert store.counters.demotions >= 20 and store.counters.ssd_hits >= 20
    assert put(store, "ns", keys[:3], MiB) == [False] * 3, "present on SSD counts as present"


def test_second_hit_promotes(store: BlockStore) -> None:
    keys = [key(i, "p") for i in range(8)]
    for k in keys:
        put(store, "ns", [k], MiB)
    assert store.demote(8 * MiB) > 0
    assert not store.tier.contains("ns", keys[0])
    read_all(store, "ns", keys[:1])
    assert not store.tier.contains("ns", keys[0]), "one hit is not enough"
    read_all(store, "ns", keys[:1])
    assert store.tier.contains("ns", keys[0]) and store.counters.promotions == 1


def test_background_demotion_keeps_dram_under_the_high_mark(store: BlockStore) -> None:
    for i in range(4):
        put(store, "ns", [key(i, "bg")], MiB)  # 100% of DRAM
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and store.tier.used_bytes > 0.85 * store.tier.capacity:
        time.sleep(0.02)
    assert store.tier.used_bytes <= 0.85 * store.tier.capacity
    assert store.counters.demotions >= 1


def test_corrupt_ssd_value_is_a_miss_and_dropped(store: BlockStore) -> None:
    k = key(1, "flip")
    put(store, "ns", [k], MiB)
    store.demote(4 * MiB)
    assert store.ssd is not None
    with store.ssd.env.begin(write=True) as txn:
        from kvstore.worker.tiers.ssd import lmdb_key

        raw = bytearray(txn.get(lmdb_key("ns", k)))
        raw[HEADER_LEN + 1000] ^= 0xFF
        txn.put(lmdb_key("ns", k), raw)
    assert read_all(store, "ns", [k]) == [None]
    assert store.counters.checksum_errors == 1
    assert store.exists("ns", [k]) == [False], "a corrupt block is dropped"


def test_rebuild_after_close(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    keys = [key(i, "rb") for i in range(10)]
    arena = Arena(4 * MiB)
    st = BlockStore(arena, MiB, ssd=SsdStore(path, 64 * MiB))
    for k in keys:  # one batch may not exceed DRAM: its blocks are all pending at once
        put(st, "ns", [k], 512 * 1024)
    st.close(demote_timeout=10)  # demotes everything, fsyncs
    arena.close()
    arena = Arena(4 * MiB)
    st = BlockStore(arena, MiB, ssd=SsdStore(path, 64 * MiB))
    try:
        assert st.exists("ns", keys) == [True] * 10
        assert read_all(st, "ns", keys) == [value_for(k, 512 * 1024) for k in keys]
    finally:
        st.close(demote_timeout=5)
        arena.close()


def test_pinned_namespace_is_never_evicted_and_has_a_quota(tmp_path: Path) -> None:
    arena = Arena(2 * MiB)
    st = BlockStore(arena, MiB, pins={"sys": 1 * MiB})
    try:
        assert put(st, "sys", [key(1, "pin")], MiB) == [True]
        with pytest.raises(ResourceExhausted, match="quota"):
            put(st, "sys", [key(2, "pin")], 1024)
        for i in range(10):  # churn the unpinned namespace through the other slab
            put(st, "other", [key(i, "churn")], MiB)
        assert st.exists("sys", [key(1, "pin")]) == [True]
        assert st.remove("sys", [key(1, "pin")]) == 1
        assert put(st, "sys", [key(2, "pin")], 1024) == [True], "removal refunds the quota"
    finally:
        st.close()
        arena.close()


def test_checksum_is_verified_on_dram_reads(store: BlockStore) -> None:
    k = key(5, "dram-flip")
    put(store, "ns", [k], 4096)
    b = store.tier.peek("ns", k)
    assert b is not None
    store.view(b)[0] ^= 0xFF  # corrupt the arena behind the store's back
    assert read_all(store, "ns", [k]) == [None]
    assert store.counters.checksum_errors == 1
    assert xxhash.xxh3_64_intdigest(b"") >= 0
