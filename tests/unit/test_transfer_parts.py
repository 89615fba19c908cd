"""The part codec shared by the client and the worker: checksums over parts equal the
whole value's, scatter reads fill parts exactly, and ucx:// part tables are checked."""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest
import xxhash

from kvstore_client import wire
from kvstore_client.errors import ProtocolError
from kvstore_client.transport import ucx


def cut(value: bytes, sizes: list[int]) -> list[memoryview]:
    out, at = [], 0
    for n in sizes:
        out.append(memoryview(bytearray(value[at : at + n])))
        at += n
    return out


def test_checksum_and_size_over_parts_equal_the_whole() -> None:
    value = os.urandom(100_003)
    for sizes in ([100_003], [1, 0, 100_002], [50_000, 50_000, 3], [1000] * 100 + [3]):
        parts = cut(value, sizes)
        assert wire.block_size(parts) == len(value)
        assert wire.block_checksum(parts) == xxhash.xxh3_64_intdigest(value)
    assert wire.flat_buffers([b"ab", cut(b"cdef", [1, 3])])[0] == b"ab"
    assert len(wire.flat_buffers([b"ab", cut(b"cdef", [1, 3])])) == 3


def test_recv_into_parts_scatters_across_partial_reads() -> None:
    value = os.urandom(3 << 20)
    sizes = [1, 4095, 0, 1 << 20, 7, 0]  # the last part takes the rest
    sizes[-1] = len(value) - sum(sizes[:-1])
    dest = [memoryview(bytearray(n)) for n in sizes]
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(
            target=lambda: [a.sendall(value[i : i + 999]) for i in range(0, len(value), 999)]
        )
        sender.start()
        wire.recv_into_parts(b, dest)
        sender.join()
    finally:
        a.close()
        b.close()
    assert b"".join(bytes(d) for d in dest) == value


def test_many_small_parts_round_trip_exactly() -> None:
    """More parts than IOV_MAX and more bytes than the socket buffers hold: sent with
    send_buffers in one split, received with recv_into_parts in another (empty parts
    included), the bytes come back exactly."""
    value = os.urandom((8 << 20) + 12_345)
    rng = random.Random(24)

    def split(n: int) -> list[int]:
        sizes: list[int] = []
        while sum(sizes) < n:
            sizes.append(min(rng.choice([0, 1, 100, 4096, 16384]), n - sum(sizes)))
        return sizes

    send_parts = cut(value, split(len(value)))
    dest = [memoryview(bytearray(n)) for n in split(len(value))]
    assert len(send_parts) > wire.IOV_MAX and len(dest) > wire.IOV_MAX
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(target=wire.send_buffers, args=(a, send_parts))
        sender.start()
        wire.recv_into_parts(b, dest)
        sender.join()
    finally:
        a.close()
        b.close()
    assert b"".join(bytes(d) for d in dest) == value


def test_recv_into_parts_reports_a_closed_peer() -> None:
    a, b = socket.socketpair()
    a.sendall(b"abc")
    a.close()
    with pytest.raises(ConnectionError):
        wire.recv_into_parts(b, [memoryview(bytearray(2)), memoryview(bytearray(5))])
    b.close()


def test_ucx_part_tables_round_trip_and_limits() -> None:
    blocks: list[wire.Block | None] = [cut(b"abcdef", [2, 4]), memoryview(b"xyz"), None]
    counts, sizes = ucx.part_tables(blocks)
    got = ucx.read_part_counts(counts)
    assert got == [2, 1, 1]
    assert ucx.split_sizes(got, sizes) == [[2, 4], [3], [0]]
    assert [bytes(s) for s in ucx.slices(memoryview(b"abcdef"), [2, 4])] == [b"ab", b"cdef"]
    for bad in ([0], [wire.MAX_PARTS + 1]):
        with pytest.raises(ProtocolError):
            ucx.read_part_counts(b"".join(wire.PART_COUNT.pack(c) for c in bad))
    too_many = wire.PART_COUNT.pack(wire.MAX_PARTS) * (ucx.MAX_PART_ENTRIES // wire.MAX_PARTS + 1)
    with pytest.raises(ProtocolError):
        ucx.read_part_counts(too_many)


@pytest.mark.parametrize("count", [2, 40, 300])  # below and above SORT_IN_PYTHON
def test_destination_overlaps_are_found_exactly(count: int) -> None:
    """check_disjoint refuses a read's destinations exactly when two share a byte
    (random layouts over one buffer, against a byte-by-byte oracle): nested, partial,
    the same view twice; views that only touch, and empty ones, are fine."""
    from kvstore_client.errors import InvalidArgument
    from kvstore_client.parts import check_disjoint

    rng = random.Random(count)
    buf = memoryview(bytearray(64 * count))
    for trial in range(60):
        spans = []
        for _ in range(count):
            a = rng.randrange(0, len(buf))
            spans.append((a, min(len(buf), a + rng.choice([0, 1, 7, 64, 200]))))
        if trial % 3 == 0:  # tiled: touching, never sharing
            spans = [(64 * i, 64 * i + 64) for i in range(count)]
            if trial % 2:
                j = rng.randrange(count)
                spans[j] = (spans[j][0] + 63, spans[j][1] + 1 if j + 1 < count else spans[j][1])
        rng.shuffle(spans)
        used = bytearray(len(buf))
        shared = False
        for a, b in spans:
            for x in range(a, b):
                shared = shared or used[x] == 1
                used[x] = 1
        views = [buf[a:b] for a, b in spans]
        if shared:
            with pytest.raises(InvalidArgument, match="overlap"):
                check_disjoint(views)
        else:
            check_disjoint(views)
    twice = [buf[0:8], buf[8:16]] * (count // 2 + 1)
    with pytest.raises(InvalidArgument, match="overlap"):
        check_disjoint(twice)
