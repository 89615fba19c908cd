"""A killed worker costs misses, never errors or wrong bytes; bad input never kills a daemon."""

from __future__ import annotations

import contextlib
import signal
import socket
import struct
import time

import grpc
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, wire
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.helpers import key, value_for

NS = "model/bf16/b16/tp0of1"


def test_sigkill_worker_turns_its_keys_into_misses(cluster: LocalCluster) -> None:
    keys = [key(i, "kill") for i in range(300)]
    vals = [value_for(k, 32 * 1024) for k in keys]
    with Client(cluster.address, timeout=2.0) as c:
        assert all(c.batch_put(NS, keys, vals))
        victim = cluster.worker_procs[0]
        victim_id = victim.ready["id"]
        victim.signal(signal.SIGKILL)
        victim.proc.wait(5)
        # Right away: no exception, the survivor's blocks are intact, the rest are misses.
        t0 = time.monotonic()
        got = c.batch_get(NS, keys)
        assert time.monotonic() - t0 < 2.5
        hits = [g for g in got if g is not None]
        assert 0 < len(hits) < len(keys)
        assert all(g == v for g, v in zip(got, vals, strict=True) if g is not None)
        assert c.batch_put(NS, keys[:10], vals[:10]) is not None
        # Within the TTL (2 s) the master drops it and the client's map follows.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and victim_id in {w.id for w in c.workers()}:
            time.sleep(0.1)
        assert victim_id not in {w.id for w in c.workers()}
        assert len(c.workers()) == 1
        # Now every key routes to the survivor: its own blocks hit, moved ones miss.
        flags = c.batch_exists(NS, keys)
        assert sum(flags) == len(hits)
        assert all(c.batch_put(NS, [key(9999, "new")], [b"x" * 100]))


def _grpc_store(cluster: LocalCluster) -> store_pb2_grpc.StoreStub:
    ch = grpc.insecure_channel(cluster.worker_procs[0].ready["grpc"])
    return store_pb2_grpc.StoreStub(ch)


def test_grpc_bad_input_gets_invalid_argument(cluster: LocalCluster) -> None:
    stub = _grpc_store(cluster)
    cases = [
        (stub.Exists, store_pb2.ExistsRequest(namespace=NS, hashes=b"x" * 15)),
        (stub.Exists, store_pb2.ExistsRequest(namespace="no spaces", hashes=b"x" * 16)),
        (stub.Put, store_pb2.PutRequest(namespace=NS, hashes=b"x" * 16, values=[])),
        (
            stub.Put,
            store_pb2.PutRequest(
                namespace=NS, hashes=b"x" * 16, values=[bytes(16 * 1024 * 1024 + 1)]
            ),
        ),
        (stub.Get, store_pb2.GetRequest(namespace="", hashes=b"")),
    ]
    for call, req in cases:
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
    # Inline put/get over gRPC still works for good input.
    k = key(1, "grpc")
    r = stub.Put(store_pb2.PutRequest(namespace=NS, hashes=k, values=[b"abc"]), timeout=5)
    assert r.stored_bitmap == b"\x01"
    g = stub.Get(store_pb2.GetRequest(namespace=NS, hashes=k + key(2, "grpc")), timeout=5)
    assert g.found_bitmap == b"\x01" and list(g.values) == [b"abc", b""]
    m = stub.MatchPrefix(store_pb2.MatchPrefixRequest(namespace=NS, hashes=k + k), timeout=5)
    assert m.matched == 2


def _tcp_addr(cluster: LocalCluster) -> tuple[str, int]:
    host, port = cluster.worker_procs[0].ready["tcp"][len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def _closed(sock: socket.socket) -> bytes:
    """Read until the server closes; returns what it sent."""
    sock.settimeout(10)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread: a reset is a close too
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize(
    "payload",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # garbage
        b"\x00" * 64,  # zeros: bad magic
        wire.HEADER.pack(wire.REQ_MAGIC, 99, 0, 3, 1, 1) + b"abc",  # unknown op
        wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_GET, 0, 0, 1, 1),  # empty namespace
        wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_GET, 0, 3, 1 << 30, 1) + b"abc",  # huge count
        wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_GET, 0, 6, 1, 1) + b"a b c!",  # bad namespace
        wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_PUT, 0, 1, 1, 1)
        + b"m"
        + wire.PUT_ENTRY.pack(b"k" * 16, 1 << 31, 0),  # declared size far over the limit
    ],
)
def test_garbage_on_the_transfer_port_closes_only_that_connection(
    cluster: LocalCluster, payload: bytes
) -> None:
    addr = _tcp_addr(cluster)
    with socket.create_connection(addr) as s:
        s.sendall(payload)
        with contextlib.suppress(OSError):  # the worker may already have reset it
            s.shutdown(socket.SHUT_WR)
        answer = _closed(s)
    if answer:  # an error answer, when one could be framed, carries a code
        _, _, code, _, _, _ = wire.HEADER.unpack(answer[: wire.HEADER_LEN])
        assert code == int(wire_code_invalid())
    with Client(cluster.address) as c:
        k = key(7, "after-garbage")
        assert c.batch_put(NS, [k], [b"still serving"]) == [True]
        assert c.batch_get(NS, [k]) == [b"still serving"]
    assert cluster.worker_procs[0].alive()


def wire_code_invalid() -> int:
    from kvstore_client.errors import Code

    return int(Code.INVALID_ARGUMENT)


def test_truncated_put_never_becomes_visible(cluster: LocalCluster) -> None:
    addr = _tcp_addr(cluster)
    k = key(1, "truncated")
    ns = NS.encode()
    with socket.create_connection(addr) as s:
        head = wire.encode_request_header(wire.OP_PUT, ns, 1, 1)
        s.sendall(head + wire.PUT_ENTRY.pack(k, 1000, 0) + b"x" * 500)  # half the payload
        s.close()
    time.sleep(0.3)
    with Client(cluster.address) as c:
        assert c.batch_exists(NS, [k]) == [False]
        # And the slot was given back: the key can be written properly now.
        assert c.batch_put(NS, [k], [b"y" * 1000]) in ([True], [False])


def test_silent_and_idle_connections_do_not_block_others(cluster: LocalCluster) -> None:
    addr = _tcp_addr(cluster)
    idle = [socket.create_connection(addr) for _ in range(50)]
    try:
        half = socket.create_connection(addr)
        half.sendall(struct.pack("<4sB", wire.REQ_MAGIC, wire.OP_GET))  # a partial header
        with Client(cluster.address, timeout=2) as c:
            k = key(3, "idle")
            assert c.batch_put(NS, [k], [b"ok"]) == [True]
            assert c.batch_get(NS, [k]) == [b"ok"]
        half.close()
    finally:
        for s in idle:
            s.close()
