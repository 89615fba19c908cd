"""Issue 23's findings (trust, round three) against real worker processes: what a
careless or hostile client could do with request ids, replicas, frozen processes and
malformed frames. Each test failed on the code before the fix it names."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, wire
from kvstore_client.errors import Code, InvalidArgument, PermissionDenied
from tests.conftest import MakeCluster, arena_files
from tests.helpers import key, value_for

MiB = 1 << 20
NS = "round3"


def tcp_addr(c: LocalCluster, i: int = 0) -> tuple[str, int]:
    with Client(c.address) as cl:
        url = next(e for e in cl.workers()[i].endpoints if e.startswith("tcp://"))
    host, port = url[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def header(op: int, count: int, req_id: int, ns: str = NS) -> bytes:
    return wire.encode_request_header(op, ns.encode(), count, req_id)


def answer(s: socket.socket) -> wire.Header:
    return wire.decode_header(wire.recv_exact(s, wire.HEADER_LEN), wire.ANS_MAGIC)


def get_loc(s: socket.socket, keys: list[bytes], req_id: int) -> wire.Header:
    s.sendall(header(wire.OP_GET_LOC, len(keys), req_id) + b"".join(keys))
    h = answer(s)
    if h.flags_or_code == 0:
        wire.recv_exact(s, h.count * wire.LOC_ENTRY.size)
    return h


# ---- 1: a reused request id must not orphan pins or reservations ---------------------------


def test_reused_shm_request_ids_leak_no_pins(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    addr = tcp_addr(c)
    old = [key(i, "pinned") for i in range(44)]
    with Client(c.address, transport="tcp", timeout=10.0) as cl:
        for i in range(0, 44, 11):
            assert all(
                cl.batch_put(NS, old[i : i + 11], [value_for(k, MiB) for k in old[i : i + 11]])
            )
    for n in range(4):
        with socket.create_connection(addr) as s:
            # Pin 11 blocks under id 1, then send another GET_LOC under the same id.
            get_loc(s, old[n * 11 : (n + 1) * 11], 1)
            get_loc(s, old[:1], 1)
    time.sleep(0.3)  # the worker sees the closes
    fresh = [key(i, "fresh") for i in range(60)]
    stored = 0
    with Client(c.address, transport="tcp", timeout=10.0) as cl:
        for i in range(0, 60, 6):
            part = fresh[i : i + 6]
            stored += sum(cl.batch_put(NS, part, [value_for(k, MiB) for k in part]))
    assert stored == 60, f"closed connections left pins behind: {stored} of 60 stored"


def test_a_reused_request_id_is_refused_and_closes_the_connection(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    k = key(0, "dup")
    with Client(c.address, transport="tcp") as cl:
        assert cl.batch_put(NS, [k], [value_for(k, 4096)]) == [True]
    with socket.create_connection(tcp_addr(c)) as s:
        assert get_loc(s, [k], 9).flags_or_code == 0
        h = get_loc(s, [k], 9)
        assert h.flags_or_code == Code.INVALID_ARGUMENT
        s.settimeout(5)
        wire.recv_exact(s, h.count)  # the message, then the worker closes
        assert s.recv(1) == b""


# ---- 2: removal removes every copy a put wrote ----------------------------------------------


def test_remove_removes_copies_written_with_per_call_replicas(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=3, dram_size="64MiB", max_value_size="1MiB", worker_ttl="1s")
    keys = [key(i, "copies") for i in range(64)]
    vals = [value_for(k, 4096) for k in keys]
    with Client(c.address, transport="tcp", timeout=5.0) as cl:
        assert all(cl.batch_put(NS, keys, vals, replicas=3))
        assert cl.remove(NS, keys) == 3 * 64
        assert cl.batch_get(NS, keys) == [None] * 64
    dead = c.worker_procs[0]
    dead.kill()
    for f in arena_files(dead.pid):
        os.unlink(f)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with Client(c.address, transport="tcp", timeout=5.0) as probe:
            if len(probe.workers()) == 2:
                break
        time.sleep(0.2)
    with Client(c.address, transport="tcp", timeout=5.0) as cl:
        assert len(cl.workers()) == 2
        back = sum(v is not None for v in cl.batch_get(NS, keys))
    assert back == 0, f"{back} of 64 removed values came back"


def test_reads_consult_copies_written_with_per_call_replicas(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=2, dram_size="64MiB", max_value_size="1MiB")
    keys = [key(i, "percall") for i in range(32)]
    vals = [value_for(k, 4096) for k in keys]
    with Client(c.address, transport="tcp", timeout=5.0) as cl:
        assert all(cl.batch_put(NS, keys, vals, replicas=2))
        # Drop the copy on one worker only (a raw REMOVE to it): the other still has it.
        with socket.create_connection(tcp_addr(c, 0)) as s:
            s.sendall(header(wire.OP_REMOVE, len(keys), 1) + b"".join(keys))
            assert answer(s).flags_or_code == 0
        assert cl.batch_get(NS, keys) == vals
        assert all(cl.batch_exists(NS, keys))
        assert cl.match_prefix(NS, keys) == len(keys)


# ---- 7: a frozen reader does not block its host's puts --------------------------------------

FROZEN_READER = """
import os, signal, sys
from kvstore_client import Client
master, n = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, "tests")
from helpers import key
cl = Client(master, transport="shm", timeout=10.0)
keys = [key(i, "frozen") for i in range(n)]
bufs = [memoryview(bytearray(1 << 20)) for _ in keys]
hits = cl.batch_get_into("round3", keys, bufs).result()
print(sum(hits), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, a checkpoint, a long GC pause
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_frozen_reader_keeps_no_pins(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    keys = [key(i, "frozen") for i in range(30)]
    with Client(c.address, transport="tcp", timeout=10.0) as cl:
        for i in range(0, 30, 10):
            assert all(
                cl.batch_put(NS, keys[i : i + 10], [value_for(k, MiB) for k in keys[i : i + 10]])
            )
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(FROZEN_READER), c.address, "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "30"
        deadline = time.monotonic() + 10
        while not _stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stopped(proc.pid)
        new = [key(i, "neighbour") for i in range(8)]
        with Client(c.address, transport="tcp", timeout=10.0) as cl:
            stored = cl.batch_put(NS, new, [value_for(k, MiB) for k in new])
        assert all(stored), f"a frozen reader blocked its host's puts: {stored}"
    finally:
        proc.kill()
        proc.send_signal(signal.SIGCONT)
        proc.wait(10)


# ---- 9: refusals arrive as errors, pins stay within the worker's bound, no overlaps ----------


def test_a_refused_frame_with_an_unread_body_gets_its_error(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text(
        "tenants:\n"
        "  - {name: a, token: tok-a, namespaces: [a]}\n"
        "  - {name: b, token: tok-b, namespaces: [b]}\n"
    )
    c = make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_worker_args=["--tenants-file", str(f)],
    )
    ks = [key(i, "not-mine") for i in range(16)]
    for transport in ("tcp", "shm"):
        # Tenant a writes 16 MiB into b's namespace: refused after the header, while
        # the body is still on its way; a must learn why, not see a reset.
        with (
            Client(c.address, token="tok-a", transport=transport, timeout=5.0) as a,
            pytest.raises(PermissionDenied),
        ):
            a.batch_put("b", ks, [value_for(k, MiB) for k in ks])


def test_one_get_loc_never_pins_more_than_the_worker_bound(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    keys = [key(i, "big-read") for i in range(56)]
    with Client(c.address, transport="tcp", timeout=10.0) as cl:
        for i in range(0, 56, 8):
            assert all(
                cl.batch_put(NS, keys[i : i + 8], [value_for(k, MiB) for k in keys[i : i + 8]])
            )
    with socket.create_connection(tcp_addr(c)) as s:
        # hold_per_worker is three quarters of the 64 MiB arena: 56 MiB is over it.
        h = get_loc(s, keys, 1)
    assert h.flags_or_code == Code.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_overlapping_buffers_are_refused(make_cluster: MakeCluster, transport: str) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    ks = [key(i, "overlap") for i in range(2)]
    vals = [value_for(k, 8192) for k in ks]
    with Client(c.address, transport=transport, timeout=5.0) as cl:
        assert all(cl.batch_put(NS, ks, vals))
        arena = np.zeros(12288, dtype=np.uint8)
        mv = memoryview(arena)
        with pytest.raises(InvalidArgument, match="overlap"):
            cl.batch_get_into_parts(NS, ks, [[mv[0:4096], mv[4096:8192]], [mv[4096:12288]]])
        with pytest.raises(InvalidArgument, match="overlap"):
            cl.batch_get_into(NS, ks, [mv[0:8192], mv[4096:12288]])
        with pytest.raises(InvalidArgument, match="overlap"):
            cl.batch_get_into_parts(NS, ks[:1], [[mv[0:4096], mv[2048:6144]]])
        # Adjacent, not overlapping: fine.
        out = np.zeros(16384, dtype=np.uint8)
        o = memoryview(out)
        got = cl.batch_get_into_parts(NS, ks, [[o[0:4096], o[4096:8192]], [o[8192:16384]]])
        assert got.result() == [True, True]
        assert bytes(out) == vals[0] + vals[1]


# ---- 3: a full session declines only its own writers' blocks --------------------------------


def test_clients_without_hints_are_admitted_past_a_full_session(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(
        workers=1,
        dram_size="4MiB",
        max_value_size="64KiB",
        extra_worker_args=["--session-share", "0.5"],
    )
    size = 64 << 10
    big = [key(i, "listed") for i in range(64)]  # 4 MiB listed: the whole worker
    with Client(c.address) as hinted, Client(c.address) as plain:
        hinted.session_hint(NS, "greedy", "active", hashes=big)
        stored = hinted.batch_put(NS, big[:40], [value_for(k, size) for k in big[:40]])
        assert stored == [True] * 32 + [False] * 8, "the session's own blocks past its share"
        # Blocks the session lists but never wrote, from a client that sends no hints.
        late = big[56:64]
        got = plain.batch_put(NS, late, [value_for(k, size) for k in late])
        assert got == [True] * 8, f"a client without hints was declined: {got}"
        assert plain.batch_get(NS, late) == [value_for(k, size) for k in late]
    # An engine's save path that hints through another client opts in: declined.
    with Client(c.address, session_writer=True) as saver:
        more = big[40:48]
        assert saver.batch_put(NS, more, [value_for(k, size) for k in more]) == [False] * 8


# ---- 4: one tenant's sessions cannot push out another's -------------------------------------


def test_one_tenants_session_flood_keeps_anothers_retention(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text(
        "tenants:\n"
        "  - {name: a, token: tok-a, namespaces: [a]}\n"
        "  - {name: b, token: tok-b, namespaces: [b]}\n"
    )
    c = make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="64KiB",
        extra_worker_args=["--tenants-file", str(f), "--max-sessions", "16"],
    )
    size = 64 << 10
    kb = [key(i, "b-chain") for i in range(32)]
    with Client(c.address, token="tok-a") as a, Client(c.address, token="tok-b") as b:
        b.session_hint("b", "b1", "active", hashes=kb)
        assert all(b.batch_put("b", kb, [value_for(k, size) for k in kb]))
        b.session_hint("b", "b1", "paused", ttl=300)
        assert b.sessions()[0].retained_bytes == 32 * size
        # Tenant a: more sessions than the table holds, each listing made-up hashes,
        # together more (session, block) pairs than the worker keeps (262,144).
        for s in range(20):
            fake = [os.urandom(16) for _ in range(16384)]
            a.session_hint("a", f"flood-{s}", "active", hashes=fake)
        mine = b.sessions(limit=100)[0]
        assert mine.retained_bytes == 32 * size, "b's paused session was pushed out"
        assert [(s.session_id, s.state, s.blocks) for s in mine.sessions] == [("b1", "paused", 32)]
        kb2 = [key(i, "b-next") for i in range(32)]
        b.session_hint("b", "b2", "active", hashes=kb2)
        got = {s.session_id: s.blocks for s in b.sessions(limit=100)[0].sessions}
    assert got == {"b1": 32, "b2": 32}, f"b's next session was starved: {got}"


# ---- 6: KV-event replay peers that never read cost bounded memory ---------------------------


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_replay_peers_that_never_read_cost_bounded_memory(make_cluster: MakeCluster) -> None:
    import zmq

    from kvstore.cluster import free_port

    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    c = make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_worker_args=["--kv-events", pub, "--kv-events-replay", rep],
    )
    pid = c.worker_procs[0].pid
    keys = [key(i, "history") for i in range(1 << 16)]
    vals = [b"x" * 64] * len(keys)
    with Client(c.address, transport="tcp", timeout=30.0) as cl:
        for _ in range(10):  # about 1.3 M block events: some 20-25 MiB of history
            cl.batch_put("ev/b16", keys, vals)
            cl.remove("ev/b16", keys)
    time.sleep(1.0)
    before = rss(pid)
    ctx = zmq.Context()
    peers = []
    try:
        for _ in range(10):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.connect(rep)
            s.send_multipart((b"", (0).to_bytes(8, "big")))  # everything, never read
            peers.append(s)
        time.sleep(3.0)
        grown = rss(pid) - before
    finally:
        for s in peers:
            s.close(0)
        ctx.term()
    assert grown < 48 * MiB, f"10 replay peers that never read cost {grown / MiB:.0f} MiB"
    # Once they hang up, a peer that reads gets the whole history, in order.
    time.sleep(0.5)
    seqs = replay_seqs(rep)
    assert seqs[0] == 0 and seqs == list(range(len(seqs))) and len(seqs) > 100


def replay_seqs(endpoint: str) -> list[int]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        out = []
        while sock.poll(10_000):
            _, _, seq, _ = sock.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            out.append(n)
        raise AssertionError("the replay did not end")
    finally:
        sock.close(0)
        ctx.term()


# ---- seen while measuring: a big shm:// batch_get without buffers ---------------------------


def test_a_big_shm_batch_get_without_buffers_finds_every_block(make_cluster: MakeCluster) -> None:
    # It was cut into 32-key GET_LOC requests all sent at once: past 64 of them (the
    # worker's open-request bound) the connection was closed and every block missed.
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    keys = [key(i, "many") for i in range(4096)]
    vals = [value_for(k, 256) for k in keys]
    with Client(c.address, transport="shm", timeout=10.0) as cl:
        assert all(cl.batch_put(NS, keys, vals))
        assert cl.batch_get(NS, keys) == vals


# ---- 5 (trickle): PUT headers whose bytes do not come reserve nothing -----------------------


def test_trickled_put_headers_evict_nothing_and_refuse_no_puts(make_cluster: MakeCluster) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    known = [key(i, "cached") for i in range(40)]
    with Client(c.address, transport="tcp") as cl:
        for i in range(0, 40, 8):
            part = known[i : i + 8]
            assert all(cl.batch_put(NS, part, [value_for(k, MiB) for k in part]))
    addr = tcp_addr(c)
    socks = []
    try:
        for j in range(16):  # 16 connections x 16 MiB declared, a few bytes each
            evil = [key(1000 + 16 * j + i, "trickle") for i in range(16)]
            entries = b"".join(wire.PUT_ENTRY.pack(e, MiB, 0) for e in evil)
            s = socket.create_connection(addr)
            s.sendall(header(wire.OP_PUT, 16, 7) + entries + b"x" * 1000)
            socks.append(s)
        time.sleep(1.5)
        with Client(c.address, transport="tcp", timeout=10.0) as cl:
            still = sum(cl.batch_exists(NS, known))
            new = [key(i, "after-trickle") for i in range(8)]
            stored = cl.batch_put(NS, new, [value_for(k, MiB) for k in new])
    finally:
        for s in socks:
            s.close()
    assert still == len(known), f"trickled headers evicted {len(known) - still} of 40"
    assert all(stored), f"trickled headers refused other puts: {stored}"
