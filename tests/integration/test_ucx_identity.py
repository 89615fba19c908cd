"""ucx:// endpoints say which client they belong to (AUTH with wire.FLAG_IDENTITY, as on
tcp://), so what a client holds at the worker counts over all its endpoints together:
two endpoints of one client stalled mid-PUT use up that client's budget and its next
PUT is answered full, while another client's PUT is stored. Before, every ucx://
endpoint was an account of its own. A real UCX server process (tests/integration/
test_ucx.py's Server: 32 MiB arena, 1 MiB values, so 8 MiB per endpoint and 16 MiB per
client may be held) and real endpoints over loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import xxhash

from kvstore_client import wire
from kvstore_client.transport import ucx
from tests.helpers import key, value_for
from tests.integration.test_ucx import NS, Server

MIB = 1 << 20
T = 10.0
ME, OTHER = b"m" * 16, b"o" * 16  # two clients' identities


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.stop()


def stall_put(port: int, identity: bytes, tag: str) -> ucx.UcxConnection:
    """An endpoint of ``identity`` that sends a PUT of 8 x 1 MiB without its payloads:
    the worker holds 8 MiB for it until its frame timeout."""
    rt = ucx.UcxRuntime.get()
    conn = rt.run(ucx.UcxConnection.open(rt, "127.0.0.1", port, T, "", identity), T + 5)
    entries = b"".join(wire.PUT_ENTRY.pack(key(i, tag), MIB, 0) for i in range(8))
    head = wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_PUT, 0, len(NS), 8, 1)
    rt.run(ucx.send_all(conn.ep, [head, NS + entries]), T)
    return conn


def put_two(pool: ucx.UcxPool, tag: str) -> bytes:
    keys = [key(i, tag) for i in range(2)]
    vals = [value_for(k, MIB) for k in keys]
    return pool.put(T, NS, keys, vals, [xxhash.xxh3_64_intdigest(v) for v in vals])


def test_a_clients_ucx_endpoints_share_its_budget(server: Server) -> None:
    mine = ucx.UcxPool("127.0.0.1", server.port, identity=ME)
    other = ucx.UcxPool("127.0.0.1", server.port, identity=OTHER)
    stalled: list[ucx.UcxConnection] = []
    try:
        for p in (mine, other):  # connected (and authenticated) before the stall
            assert p.exists(T, NS, [key(0, "warm")]) == [False]
        stalled = [stall_put(server.port, ME, f"stall{i}") for i in range(2)]
        time.sleep(0.5)  # both reservations are held (the frame timeout is 3 s)
        assert put_two(mine, "mine") == bytes([wire.PUT_FULL] * 2), "over my client's budget"
        assert put_two(other, "other") == bytes([wire.PUT_STORED] * 2), "another client's"
        for c in stalled:
            c.abort()
        deadline = time.monotonic() + 8.0  # the stalled frames end: the budget is back
        while put_two(mine, "mine") != bytes([wire.PUT_STORED] * 2):
            assert time.monotonic() < deadline, "the budget never came back"
            time.sleep(0.2)
        assert server.alive()
    finally:
        for c in stalled:
            c.abort()
        mine.close()
        other.close()
