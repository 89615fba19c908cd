"""Issue 11's hostile-input findings against real worker processes (each failed before
the request core, the policy state machine and the memfd arena landed)."""

from __future__ import annotations

import glob
import os
import socket
import stat
import struct
import time
from pathlib import Path

import grpc
import pytest

from kvstore.cluster import LocalCluster, free_port
from kvstore_client import Client, wire
from kvstore_client.errors import QuotaExceeded
from kvstore_client.proto import store_pb2, store_pb2_grpc
from kvstore_client.transport import shm
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

MiB = 1 << 20
NS = "hostile"


def tcp_addr(c: LocalCluster, i: int = 0) -> tuple[str, int]:
    url = next(e for e in Client(c.address).workers()[i].endpoints if e.startswith("tcp://"))
    host, port = url[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def grpc_addr(c: LocalCluster) -> str:
    with Client(c.address) as cl:
        return cl.workers()[0].grpc


def header(op: int, count: int, ns: str = NS, req_id: int = 1) -> bytes:
    return wire.encode_request_header(op, ns.encode(), count, req_id)


# ---- 1: a reset connection must not end the accept loop ----------------------------------


def test_connections_reset_at_once_do_not_stop_the_transfer_port(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    addr = tcp_addr(c)
    for _ in range(300):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.connect(addr)
        s.close()  # RST, probably before the worker's accept() returned
    time.sleep(0.3)
    k = key(1, "after-reset")
    with Client(c.address, transport="tcp", timeout=5.0) as cl:
        assert cl.batch_put(NS, [k], [value_for(k, 4096)]) == [True]
        assert cl.batch_get(NS, [k]) == [value_for(k, 4096)]


# ---- 3: quotas count slot bytes and are refunded on eviction -----------------------------


def tenants_cluster(make_cluster: MakeCluster, tmp_path: Path, quota: str) -> LocalCluster:
    f = tmp_path / "tenants.yaml"
    f.write_text(
        "tenants:\n"
        f"  - {{name: a, token: tok-a, namespaces: [a], quota: {quota}}}\n"
        "  - {name: b, token: tok-b, namespaces: [b]}\n"
        "  - {name: ops, token: tok-ops, admin: true}\n"
    )
    return make_cluster(
        workers=1,
        dram_size="32MiB",
        max_value_size="1MiB",
        extra_worker_args=["--tenants-file", str(f), "--token", "tok-ops"],
    )


def test_quota_is_refunded_when_a_tenants_blocks_are_evicted(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    c = tenants_cluster(make_cluster, tmp_path, "24MiB")
    with Client(c.address, token="tok-a") as a, Client(c.address, token="tok-b") as b:
        ka = [key(i, "a-first") for i in range(20)]
        assert all(a.batch_put("a", ka, [value_for(k, MiB) for k in ka]))
        kb = [key(i, "b-flood") for i in range(64)]  # twice the arena: evicts a's blocks
        for i in range(0, 64, 8):
            b.batch_put("b", kb[i : i + 8], [value_for(k, MiB) for k in kb[i : i + 8]])
        assert not any(a.batch_exists("a", ka)), "a's blocks were evicted"
        again = [key(i, "a-again") for i in range(8)]
        stored = a.batch_put("a", again, [value_for(k, MiB) for k in again])
    assert all(stored), "evicted blocks must give their quota back"


def test_quota_counts_the_slot_bytes_a_value_occupies(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    c = tenants_cluster(make_cluster, tmp_path, "64KiB")
    keys = [key(i, "empty") for i in range(4096)]
    with Client(c.address, token="tok-a") as a:
        with pytest.raises(QuotaExceeded):
            a.batch_put("a", keys, [b""] * len(keys))
        present = sum(a.batch_exists("a", keys))
    # An empty value still occupies a 64-byte slot: 64 KiB of quota is 1,024 of them.
    assert 0 < present <= 1024


# ---- 5, 10, 14: the arena is a memfd handed over a socket ---------------------------------


def test_a_killed_worker_leaves_no_arena_in_dev_shm(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    w = c.worker_procs[0]
    w.kill()
    left = [
        p
        for p in glob.glob(f"/dev/shm/kvstore-{w.pid}-*")
        if not stat.S_ISSOCK(os.lstat(p).st_mode)
    ]
    assert not left, f"a SIGKILLed worker left its arena behind: {left}"


def test_restarted_worker_same_id_and_ports_never_loses_a_stored_put(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(workers=0, dram_size="64MiB", max_value_size="1MiB", worker_ttl="1s")
    # Fixed id and ports, so the restarted worker is reachable at the same address.
    ports = [free_port(), free_port()]
    c.add_worker("--id", "fixed", "--grpc-port", str(ports[0]), "--tcp-port", str(ports[1]))
    c.wait_for_workers(1)
    with Client(c.address, transport="shm", timeout=3.0) as a:
        k0 = key(0, "before")
        assert a.batch_put(NS, [k0], [value_for(k0, 4096)]) == [True]
        c.restart_worker(0, kill=True)
        time.sleep(0.2)
        ks = [key(i, "after-restart") for i in range(16)]
        stored = a.batch_put(NS, ks, [value_for(k, 4096) for k in ks])
        c.wait_for_workers(1)
        time.sleep(1.5)
    with Client(c.address, transport="tcp", timeout=3.0) as b:
        got = b.batch_get(NS, ks)
    for k, s, g in zip(ks, stored, got, strict=True):
        if s:
            assert g == value_for(k, 4096), "a put reported stored must be readable"


def test_client_never_maps_a_file_a_map_entry_names(tmp_path: Path) -> None:
    me = shm.host_id()
    target = tmp_path / "kvstore-1-victim.sock"  # a regular file with a socket's name
    target.write_bytes(b"precious")
    empty = tmp_path / "kvstore-2-empty.sock"
    empty.write_bytes(b"")
    for path in (target, empty, Path("/etc/passwd")):
        url = shm.shm_url(str(path), "0123456789abcdef", 8)
        assert me in shm.parse_shm_url(url).host
        assert shm.try_map([url]) is None
    assert target.read_bytes() == b"precious"


# ---- 6: bounded per answer, per connection, per client address ---------------------------


def test_inline_get_repeating_one_big_hash_is_refused(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    k = key(7, "big")
    with Client(c.address) as cl:
        cl.batch_put(NS, [k], [value_for(k, MiB)])
    with grpc.insecure_channel(grpc_addr(c)) as ch:
        stub = store_pb2_grpc.StoreStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Get(store_pb2.GetRequest(namespace=NS, hashes=k * 100), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # One copy is fine.
        r = stub.Get(store_pb2.GetRequest(namespace=NS, hashes=k), timeout=30)
        assert r.values[0] == value_for(k, MiB)


def test_get_loc_pins_held_without_release_are_bounded(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    k = key(8, "pinned")
    with Client(c.address) as cl:
        cl.batch_put(NS, [k], [value_for(k, 4096)])
    n = 65536
    with socket.create_connection(tcp_addr(c)) as s:
        s.settimeout(20)
        codes = []
        for req in (1, 2):
            s.sendall(header(wire.OP_GET_LOC, n, req_id=req) + k * n)
            h = wire.decode_header(wire.recv_exact(s, wire.HEADER_LEN), wire.ANS_MAGIC)
            codes.append(h.flags_or_code)
            if h.flags_or_code:
                break
            wire.recv_exact(s, n * wire.LOC_ENTRY.size)
    assert codes[0] == 0, "one full batch of pins is fine"
    assert codes[-1] == 8, "a second unreleased batch is RESOURCE_EXHAUSTED"  # grpc code 8
    with Client(c.address, timeout=5.0) as cl:
        assert cl.batch_get(NS, [k]) == [value_for(k, 4096)]


def test_stalled_puts_from_one_address_cannot_evict_the_whole_arena(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    known = [key(i, "known") for i in range(48)]
    with Client(c.address, transport="tcp") as cl:
        cl.batch_put(NS, known, [value_for(k, MiB) for k in known])
        assert all(cl.batch_exists(NS, known))
    addr = tcp_addr(c)
    socks = []
    try:
        for j in range(8):  # 8 connections x 16 MiB declared, one byte sent
            evil = [key(1000 + 16 * j + i, "evil") for i in range(16)]
            entries = b"".join(wire.PUT_ENTRY.pack(e, MiB, 0) for e in evil)
            s = socket.create_connection(addr)
            s.sendall(header(wire.OP_PUT, 16) + entries + b"x")
            socks.append(s)
        time.sleep(1.5)
        with Client(c.address, transport="tcp") as cl:
            still = sum(cl.batch_exists(NS, known))
    finally:
        for s in socks:
            s.close()
    # One address may hold half the arena at most (hold_per_client): some blocks survive.
    assert still >= len(known) // 4, f"stalled headers evicted {len(known) - still} of 48"
