"""shm:// reads send their one-way RELEASE before the call returns: pins never outlive
the read that took them (a client stopped right after a read holds none), and a
closed pool releases everything."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.transfer.tcp import TcpTransferServer
from kvstore_client.transport import shm
from kvstore_client.transport.tcp import TcpPool

NS = b"m/bf16/b16/tp0of1"
SIZE = 64 * 1024


def pins(store: BlockStore) -> int:
    with store.lock:
        return sum(store.tier.pins)


def wait_for(cond: object, timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.001)
    return False


@pytest.fixture
def served() -> Iterator[tuple[BlockStore, TcpPool, shm.ShmArena]]:
    arena = Arena(16 << 20)
    store = BlockStore(arena, 1 << 20)
    server = TcpTransferServer(store, "127.0.0.1", 0)
    server.start()
    mapped = shm.ShmArena(os.dup(arena.fd), arena.id, arena.size)
    pool = TcpPool("127.0.0.1", server.port)
    try:
        yield store, pool, mapped
    finally:
        pool.close()
        server.stop(grace=1.0)
        store.close()
        mapped.close()
        arena.close()


def test_a_read_releases_its_pins_before_it_returns(
    served: tuple[BlockStore, TcpPool, shm.ShmArena],
) -> None:
    store, pool, mapped = served
    keys = [os.urandom(16) for _ in range(8)]
    values = [os.urandom(SIZE) for _ in keys]
    assert store.put_bytes(NS.decode(), keys, values) == [True] * len(keys)
    bufs = [memoryview(bytearray(SIZE)) for _ in keys]
    for _ in range(3):  # each read's RELEASE is on the wire when the call returns
        got = pool.call(5.0, shm.get, mapped, NS, keys, bufs)
        assert got.found == [True] * len(keys)
        assert [bytes(b) for b in bufs] == values
        assert wait_for(lambda: pins(store) == 0)
    # A read whose connection is closed (pool closed) is released by the worker.
    pool.call(5.0, shm.get, mapped, NS, keys, bufs)
    pool.close()
    assert wait_for(lambda: pins(store) == 0)
