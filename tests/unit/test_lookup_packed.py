"""Batch lookups of the DRAM index (find_packed), the store's prefix walk over DRAM,
staged copies and SSD, and the packed-hash helpers the lookup path uses."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers import slots
from kvstore.worker.tiers.budgets import Promoter
from kvstore.worker.tiers.dram import DramTier
from kvstore.worker.tiers.ssd import SsdStore
from kvstore_client.errors import InvalidArgument
from kvstore_client.keys import check_hashes, split_hashes
from kvstore_client.sharding import _mix, build_ring, key_positions, packed_positions

MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _model_tier(seed: int) -> tuple[DramTier, dict[tuple[str, bytes], int]]:
    """A tier grown and thinned at random (deletions shift probe runs back)."""
    rng = random.Random(seed)
    t = DramTier(64 * MiB, 1 * MiB)
    model: dict[tuple[str, bytes], int] = {}
    for step in range(5000):
        ns = f"n{rng.randrange(2)}"
        kk = k(rng.randrange(3000))
        if rng.random() < 0.7:
            b = t.reserve(ns, kk, 4000, step)
            if b is not None:
                t.commit(b)
                model[(ns, kk)] = step
        else:
            t.remove(ns, kk)
            model.pop((ns, kk), None)
    return t, model


@pytest.mark.parametrize("window", [1, 2, 16])
def test_find_packed_agrees_with_the_scalar_probe(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window of 1 or 2 sends most keys down the one-by-one fallback: both paths
    # must give the same slot for every key, present or not.
    monkeypatch.setattr(slots, "WINDOW", window)
    monkeypatch.setattr(slots, "_STEPS", np.arange(window, dtype=np.int64))
    t, model = _model_tier(window)
    probe = [k(i) for i in range(3000)] + [os.urandom(16) for _ in range(200)]
    packed = b"".join(probe)
    for ns in ("n0", "n1"):
        nsid = t._ns_ids[ns]
        got = t.find_packed(nsid, packed, probe)
        assert got.tolist() == [t.find(nsid, kk) for kk in probe]
        want = [(ns, kk) in model for kk in probe]
        assert t.ready_flags(ns, packed, probe).tolist() == want
        assert t.exists_many(ns, probe) == want
    assert not t.ready_flags("absent", packed, probe).any()


def test_ready_flags_takes_bytes_like_keys_and_never_matches_wrong_sizes() -> None:
    t = DramTier(1 * MiB, 1 * MiB)
    for i in range(40):
        b = t.reserve("ns", k(i), 100, i)
        assert b is not None
        t.commit(b)
    keys = [bytearray(k(i)) for i in range(40)]
    assert t.exists_many("ns", keys) == [True] * 40  # type: ignore[arg-type]
    # 15 + 17 bytes pack to 32, but neither key is a stored one.
    odd = [k(1)[:15], k(1) + b"x"] * 10
    assert t.exists_many("ns", odd) == [False] * 20
    assert t.find_packed(t._ns_ids["ns"], b"", []).size == 0


@pytest.fixture
def ssd_store(tmp_path: Path) -> Iterator[BlockStore]:
    arena = Arena(4 * MiB)
    st = BlockStore(arena, MiB, ssd=SsdStore(str(tmp_path / "ssd"), 64 * MiB),
                    promoter=Promoter("never"))  # fmt: skip
    try:
        yield st
    finally:
        st.close(demote_timeout=1)
        arena.close()


def test_prefix_and_exists_count_blocks_on_ssd(ssd_store: BlockStore) -> None:
    st = ssd_store
    keys = [k(i) for i in range(100)]
    assert all(st.put_bytes("ns", keys[:60], [b"v" * 100] * 60))
    st.demote(1 << 40, everything=True)
    assert not st.tier.contains("ns", keys[0]) and st.policy.on_ssd("ns", keys[0])
    assert all(st.put_bytes("ns", keys[60:80], [b"v" * 100] * 20))  # these stay in DRAM
    assert st.match_prefix("ns", keys) == 80
    assert st.exists("ns", keys) == [True] * 80 + [False] * 20
    assert st.match_prefix("ns", keys[80:] + keys) == 0, "a cold first key ends it at once"
    assert st.match_prefix("ns", keys[:5]) == 5, "short lookups go key by key"
    assert st.match_prefix("ns", []) == 0


def test_split_hashes_is_exact_for_every_length() -> None:
    for n in (0, 1, 2, 3, 7, 500, 1023, 1024, 1025, 3000):
        raw = os.urandom(16 * n)
        want = [raw[i : i + 16] for i in range(0, len(raw), 16)]
        assert split_hashes(raw) == want
        assert split_hashes(memoryview(bytearray(raw))) == want
        assert split_hashes(bytearray(raw)) == want
    with pytest.raises(InvalidArgument):
        split_hashes(b"x" * 17)


def test_check_hashes_rejects_what_it_did_before() -> None:
    check_hashes([os.urandom(16) for _ in range(10)])
    check_hashes([])
    for bad in ([b"x" * 15], [bytearray(16)], [b"x" * 16, b"y" * 17], ["s" * 16]):
        with pytest.raises(InvalidArgument):
            check_hashes(bad)  # type: ignore[arg-type]


def test_packed_positions_and_primary_match_the_list_forms() -> None:
    # 20,000 keys: some land past the ring's last point (they wrap to the first owner)
    hs = [os.urandom(16) for _ in range(20000)] + [k(i) for i in range(50)]
    packed = b"".join(hs)
    words = np.frombuffer(packed, dtype="<u8").reshape(-1, 2)
    assert (packed_positions(packed) == _mix(words[:, 0] ^ _mix(words[:, 1]))).all()
    assert (packed_positions(packed) == key_positions(hs)).all()
    ring = build_ring([("w1", 1 << 30), ("w2", 1 << 30), ("w3", 4 << 30)])
    pos = key_positions(hs)
    assert (pos > ring.points[-1]).any()
    assert (ring.primary_packed(packed) == ring.primary(hs)).all()
