"""Multi-part values over tcp:// and shm:// against real workers: a block written from
parts reads back whole and into any other split, byte-exact; bad part lists are refused
before anything is stored."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, InvalidArgument
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"


def split(value: bytes, n: int) -> list[bytearray]:
    """``value`` cut into ``n`` parts of uneven sizes (some may be empty)."""
    cuts = sorted({0, len(value), *np.linspace(0, len(value), n + 1, dtype=int)[1:-1].tolist()})
    if n > 2:
        cuts = sorted([*cuts, cuts[1]])  # an empty part too
    return [bytearray(value[a:b]) for a, b in itertools.pairwise(cuts)]


def empty_like(parts: list[bytearray]) -> list[memoryview]:
    return [memoryview(bytearray(len(p))) for p in parts]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("nparts", [1, 3, 80])
def test_parts_round_trip_and_mixed(
    shared_cluster: LocalCluster, transport: str, nparts: int
) -> None:
    size = 64 * 1024 + 7
    keys = [key(i, f"parts{transport}{nparts}") for i in range(12)]
    vals = [value_for(k, size) for k in keys]
    with Client(shared_cluster.address, transport=transport) as c:
        # Written in parts...
        assert c.batch_put_parts(NS, keys[:6], [split(v, nparts) for v in vals[:6]]) == [True] * 6
        assert c.batch_put_parts(NS, keys[:2], [split(v, nparts) for v in vals[:2]]) == [False] * 2
        # ...read whole,
        assert c.batch_get(NS, keys[:6]) == vals[:6]
        # written whole, read into parts of another split (with a miss and a wrong size).
        assert c.batch_put(NS, keys[6:], vals[6:]) == [True] * 6
        dest = [empty_like(split(v, nparts + 1)) for v in vals]
        absent = [memoryview(bytearray(size))]
        short = [memoryview(bytearray(10)), memoryview(bytearray(size - 11))]
        got = c.batch_get_into_parts(NS, [*keys, key(0, "absent"), keys[0]], [*dest, absent, short])
        assert got.result() == [True] * 12 + [False, False]
        assert [b"".join(bytes(p) for p in d) for d in dest] == vals
        # Numpy parts (per-layer views into one engine buffer) work as they are.
        layers = np.zeros((4, size), dtype=np.uint8)
        pieces = [[layers[j, : size // 2], layers[j, size // 2 :]] for j in range(4)]
        assert c.batch_get_into_parts(NS, keys[:4], pieces).result() == [True] * 4
        assert [layers[j].tobytes() for j in range(4)] == vals[:4]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bad_part_lists_store_nothing(shared_cluster: LocalCluster, transport: str) -> None:
    keys = [key(i, f"badparts{transport}") for i in range(2)]
    good = [bytearray(b"x" * 100)]
    with Client(shared_cluster.address, transport=transport) as c:
        limit = c._view.max_value  # type: ignore[union-attr]
        bad: list[object] = [
            [good],  # one part list for two hashes
            [good, []],  # a block with no parts
            [good, [bytearray(limit), bytearray(1)]],  # above the max value size
            [good, ["text"]],  # not bytes-like
            [good, b"flat bytes"],  # not a list of parts
            [good, [b"x"] * 4097],  # more parts than a block may have
        ]
        for parts in bad:
            with pytest.raises(InvalidArgument):
                c.batch_put_parts(NS, keys, parts)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument):
                c.batch_get_into_parts(NS, keys, parts)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="read-only"):
            c.batch_get_into_parts(NS, keys, [[bytearray(5)], [b"read-only"]])
        assert c.batch_exists(NS, keys) == [False, False], "nothing was stored"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_empty_values_are_values(shared_cluster: LocalCluster, transport: str) -> None:
    """One behaviour for b"": whole or in parts, it is stored and read back,
    and buffers of zero bytes in all are a hit for it."""
    keys = [key(i, f"empty{transport}") for i in range(3)]
    with Client(shared_cluster.address, transport=transport) as c:
        assert c.batch_put_parts(NS, keys[:2], [[b"", b""], [b""]]) == [True, True]
        assert c.batch_put(NS, keys[2:], [b""]) == [True]
        assert c.batch_get(NS, keys) == [b""] * 3
        bufs: list[list[bytearray]] = [[bytearray(0)], [bytearray(0), bytearray(0)], []]
        bufs[2] = [bytearray(0)]
        assert c.batch_get_into_parts(NS, keys, bufs).result() == [True] * 3
        assert c.batch_get_into(NS, keys, [bytearray(0)] * 3).result() == [True] * 3
        assert c.batch_get_into(NS, keys, [bytearray(1) for _ in keys]).result() == [False] * 3


def test_parts_with_replicas(make_cluster: MakeCluster) -> None:
    """R=2: parts go to both owners; a read into parts falls back to the second copy."""
    cluster = make_cluster(workers=2, dram_size="64MiB", extra_master_args=["--replicas", "2"])
    size = 32 * 1024
    keys = [key(i, "rparts") for i in range(8)]
    vals = [value_for(k, size) for k in keys]
    with Client(cluster.address, transport="shm") as c:
        assert c.batch_put_parts(NS, keys, [split(v, 5) for v in vals]) == [True] * 8
        assert c.replica_stats.copies_written == 8
    with Client(cluster.address, transport="tcp") as c:
        view = c._view
        assert view is not None
        # Drop every primary copy: reads must come from the other owner.
        owners = view.ring.lookup(keys, 2)
        for w in set(owners[:, 0].tolist()):
            idx = [i for i in range(8) if owners[i, 0] == w]
            view.workers[w].via.remove(5.0, NS.encode(), [keys[i] for i in idx])
        dest = [empty_like(split(v, 3)) for v in vals]
        assert c.batch_get_into_parts(NS, keys, dest).result() == [True] * 8
        assert [b"".join(bytes(p) for p in d) for d in dest] == vals
        assert c.replica_stats.fallback_reads == 8


def test_shm_pipelined_pieces(
    shared_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch cut into several pipelined location requests moves the same bytes."""
    from kvstore_client.transport import shm

    monkeypatch.setattr(shm, "PIECE_BYTES", 3 * 4096)
    keys = [key(i, "pieces") for i in range(40)]
    vals = [value_for(k, 4096) for k in keys]
    with Client(shared_cluster.address, transport="shm") as c:
        assert len(shm.pieces([4096] * 40)) == shm.PIECES
        assert c.batch_put_parts(NS, keys, [split(v, 3) for v in vals]) == [True] * 40
        assert c.batch_get(NS, keys) == vals
        dest = [empty_like(split(v, 2)) for v in vals]
        assert c.batch_get_into_parts(NS, keys, dest).result() == [True] * 40
        assert [b"".join(bytes(p) for p in d) for d in dest] == vals


def test_bench_points_run(shared_cluster: LocalCluster) -> None:
    """The bench's same-host points (kvstore bench transfer --parts / --match-prefix)."""
    from kvstore_bench.transfer import samehost

    pts = samehost.parts_points(shared_cluster, ["tcp", "shm"], [1, 8], 64 * 1024, 4, 1 << 20)
    assert {(p["transport"], p["op"], p["parts"]) for p in pts} == {
        (t, op, n) for t in ("tcp", "shm") for op in ("put", "get") for n in (1, 8)
    }
    assert all(p["gib_s"] > 0 and p["cpu_s_per_gib"] >= 0 for p in pts)
    lk = samehost.lookup_point(shared_cluster, blocks=100, calls=20)
    assert lk["workers"] == 2 and 0 < lk["p50_ms"] <= lk["p99_ms"]
