"""Client.pin_local against a real worker: blocks pinned in place in the arena (the
DMA source of a GPU connector's loads) read byte-exact through their views, stay put
under eviction pressure and after a removal while pinned, and are given back by
release() or by closing the client; other transports and misses pin nothing."""

from __future__ import annotations

import time

import pytest

from kvstore_client import Client, InvalidArgument
from tests.conftest import MakeCluster
from tests.helpers import key, value_for
from tests.integration import test_pins

NS = test_pins.NS
SIZE = test_pins.SIZE  # 64 slots per 1 MiB slab; 8 MiB of DRAM = 512 slots


def put_all(c: Client, keys: list[bytes]) -> None:
    test_pins.put_all(c, NS, keys)


def test_pinned_blocks_read_in_place_and_stay_until_released(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    held = [key(i, "pin-held") for i in range(100)]
    with Client(cluster.address, transport="shm") as reader, Client(cluster.address) as writer:
        put_all(writer, held)
        put_all(writer, [key(i, "pin-filler") for i in range(412)])  # the arena is full
        pins = reader.pin_local(NS, [*held, key(0, "absent")])
        assert pins.count == 100 and pins.views[-1] is None and len(pins.arenas) == 1
        want = [value_for(k, SIZE) for k in held]
        assert [bytes(v) for v in pins.views[:100]] == want  # type: ignore[arg-type]
        writer.remove(NS, held[:10])  # removed while pinned: the slots are not reused
        put_all(writer, [key(i, "pin-fresh") for i in range(1000)])
        assert [bytes(v) for v in pins.views[:100]] == want  # type: ignore[arg-type]
        assert writer.batch_exists(NS, held[10:]) == [True] * 90
        assert writer.batch_exists(NS, held[:10]) == [False] * 10
        pins.release()
        pins.release()  # idempotent
        put_all(writer, [key(i, "pin-fresh2") for i in range(1000)])
        assert sum(writer.batch_exists(NS, held)) < 10  # evicted once released


def test_closing_the_client_gives_its_pins_back(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    held = [key(i, "close-held") for i in range(100)]
    with Client(cluster.address) as writer:
        put_all(writer, held)
        put_all(writer, [key(i, "close-filler") for i in range(412)])
        reader = Client(cluster.address, transport="shm")
        pins = reader.pin_local(NS, held)
        assert pins.count == 100
        reader.close()  # never released: closing its connections releases the pins
        put_all(writer, [key(i, "close-fresh") for i in range(1000)])
        assert sum(writer.batch_exists(NS, held)) < 10


def test_nothing_is_pinned_over_tcp_or_for_bad_input(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=2, dram_size="32MiB")
    ks = [key(i, "tcp-pin") for i in range(8)]
    with Client(cluster.address, transport="tcp") as c:
        put_all(c, ks)
        pins = c.pin_local(NS, ks)
        assert pins.count == 0 and pins.views == [None] * 8
        pins.release()
        try:
            c.pin_local(NS, [b"short"])
        except InvalidArgument:
            pass
        else:
            raise AssertionError("a 5-byte hash was accepted")
    with Client(cluster.address, transport="shm") as c:
        pins = c.pin_local(NS, ks)
        assert pins.count == 8 and len(pins.arenas) == 2  # both same-host workers
        assert [bytes(v) for v in pins.views] == [value_for(k, SIZE) for k in ks]  # type: ignore[arg-type]
        pins.release()


def test_reserved_slots_are_written_in_place_and_published_by_commit(
    make_cluster: MakeCluster,
) -> None:
    """reserve_local hands out arena slots; bytes written into them become a block
    only at commit (checksummed then), unwritten slots are dropped, blocks already
    stored are reported present, and an aborted or abandoned reservation leaves
    nothing behind."""
    cluster = make_cluster(workers=2, dram_size="32MiB")
    ks = [key(i, "slots") for i in range(6)]
    vals = [value_for(k, SIZE) for k in ks]
    with Client(cluster.address, transport="shm") as c, Client(cluster.address) as other:
        assert c.batch_put(NS, ks[:1], vals[:1]) == [True]
        slots = c.reserve_local(NS, ks, [SIZE] * 6)
        assert slots.views[0] is None and slots.present[0] and slots.count == 5
        for i in range(1, 6):
            v = slots.views[i]
            assert v is not None and v.nbytes == SIZE
            v[:] = vals[i]
        assert other.batch_exists(NS, ks[1:]) == [False] * 5  # nothing visible yet
        stored = slots.commit([True, True, True, True, True, False])
        assert stored == [False, True, True, True, True, False]
        assert slots.commit([True] * 6) == [False] * 6  # once only
        assert other.batch_get(NS, ks) == [*vals[:5], None]
        aborted = c.reserve_local(NS, [key(9, "slots")], [SIZE])
        assert aborted.count == 1
        aborted.abort()
        assert other.batch_exists(NS, [key(9, "slots")]) == [False]
        left = Client(cluster.address, transport="shm")
        gone = left.reserve_local(NS, [key(10, "slots")], [SIZE])
        assert gone.count == 1
        left.close()  # the connection's close drops its reservation (as the worker
        # notices the close: within a moment, not necessarily at once)
        deadline = time.monotonic() + 5
        while other.batch_put(NS, [key(10, "slots")], [vals[0]]) != [True]:
            assert time.monotonic() < deadline, "the dropped reservation still holds the key"
            time.sleep(0.05)
        try:
            c.reserve_local(NS, ks[:1], [0])
        except InvalidArgument:
            pass
        else:
            raise AssertionError("a 0-byte block was accepted")


def test_a_bad_inbox_put_closes_only_that_connection(make_cluster: MakeCluster) -> None:
    """A PUT_INBOX naming bytes past the inbox's end (INVALID_ARGUMENT), or sent on a
    connection that did not say who it is (no inbox: UNAVAILABLE, put over tcp://), and
    the retired shared-arena writes (PUT_LOC, INVALID_ARGUMENT): each is answered and
    closes that connection; the worker keeps serving and the key stays writable."""
    from kvstore_client import wire
    from kvstore_client.errors import InvalidArgument, Unavailable
    from kvstore_client.transport.tcp import TcpConnection

    cluster = make_cluster(workers=1, dram_size="32MiB")
    k = key(0, "mismatch")
    with Client(cluster.address, transport="shm") as c:
        w = c._view.workers[0]  # type: ignore[union-attr]
        assert w.arena is not None and w.arena.inbox is not None
        far = w.arena.inbox.size
        frames = [
            (
                w.pool.take(5),
                wire.OP_PUT_INBOX,
                wire.INBOX_ENTRY.pack(k, SIZE, 0, far - 1),
                InvalidArgument,
            ),
            (
                TcpConnection(w.pool.host, w.pool.port, 5),  # no AUTH: no identity
                wire.OP_PUT_INBOX,
                wire.INBOX_ENTRY.pack(k, SIZE, 0, 0),
                Unavailable,
            ),
            (w.pool.take(5), wire.OP_PUT_LOC, wire.PUT_ENTRY.pack(k, SIZE, 0), InvalidArgument),
        ]
        for conn, op, entry, error in frames:
            try:
                head = wire.encode_request_header(op, NS.encode(), 1, 1)
                wire.send_buffers(conn.sock, [head, entry])
                with pytest.raises(error):
                    conn._answer(op, 1)
                conn.sock.settimeout(5)
                try:  # then the worker closes the connection
                    while conn.sock.recv(1 << 16):
                        pass
                except ConnectionResetError:
                    pass
            finally:
                conn.close()
        # The worker drops the closed connections' reservations as it notices the
        # close: the key becomes writable within a moment, not necessarily at once.
        deadline = time.monotonic() + 5
        while c.batch_put(NS, [k], [value_for(k, SIZE)]) != [True]:
            assert time.monotonic() < deadline, "the dropped reservation still holds the key"
            time.sleep(0.05)
        assert c.batch_get(NS, [k]) == [value_for(k, SIZE)]
