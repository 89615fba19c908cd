"""Pinned blocks never stop eviction of the others (issue 11, item 2).

Through a real worker: the oldest positions of one size class are held by shm://
readers (GET_LOC without RELEASE) or belong to a ``--pin`` namespace; puts of that
size must keep evicting the unpinned blocks instead of failing as full.
"""

from __future__ import annotations

from kvstore_client import Client, wire
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"
SIZE = 16 * 1024  # 64 slots per 1 MiB slab; 8 MiB of DRAM = 512 slots


def put_all(c: Client, ns: str, keys: list[bytes]) -> None:
    for s in range(0, len(keys), 50):
        part = keys[s : s + 50]
        assert c.batch_put(ns, part, [value_for(k, SIZE) for k in part]) == [True] * len(part)


def test_blocks_held_by_shm_readers_do_not_stop_puts(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="8MiB", max_value_size="1MiB")
    held = [key(i, "held") for i in range(100)]
    with Client(cluster.address, transport="shm") as reader, Client(cluster.address) as writer:
        put_all(writer, NS, held)
        put_all(writer, NS, [key(i, "filler") for i in range(412)])  # the arena is full
        w = reader._view.workers[0]  # type: ignore[union-attr]
        assert w.arena is not None
        conn = w.pool.take(5)
        try:  # a GET_LOC left unreleased: the worker keeps the 100 blocks pinned
            head = wire.encode_request_header(wire.OP_GET_LOC, NS.encode(), len(held), 1)
            wire.send_buffers(conn.sock, [head, b"".join(held)])
            h = conn._answer(wire.OP_GET_LOC, 1)
            meta = wire.recv_exact(conn.sock, h.count * wire.LOC_ENTRY.size)
            assert all(e[0] == wire.LOC_ARENA for e in wire.LOC_ENTRY.iter_unpack(meta))
            # 1,000 more puts: the 412 fillers go, then the new blocks evict each other.
            put_all(writer, NS, [key(i, "fresh") for i in range(1000)])
            assert writer.batch_exists(NS, held) == [True] * 100
        finally:
            conn.close()


def test_a_pinned_namespace_at_the_old_end_does_not_stop_puts(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(
        workers=1, dram_size="8MiB", max_value_size="1MiB", extra_worker_args=["--pin", "sys"]
    )
    pinned = [key(i, "sys") for i in range(100)]
    with Client(cluster.address) as c:
        put_all(c, "sys", pinned)
        put_all(c, NS, [key(i, "fresh") for i in range(1000)])
        assert c.batch_exists("sys", pinned) == [True] * 100
