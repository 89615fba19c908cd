"""match_prefix over the tcp:// plane: EXISTS with FLAG_PREFIX (each owner answers how
many of its keys lead its list, stopping at its first miss), exactness against the
bitmap path, an old worker's bitmap answer, and hostile prefix frames."""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, Keys, wire
from kvstore_client.errors import InvalidArgument
from kvstore_client.keys import leading_run, to_bitmap
from kvstore_client.transport.tcp import TcpConnection
from tests.helpers import key

NS = "prefix/test/b16/tp0of1"
NSB = NS.encode()


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        workers=3, dram_size="64MiB", worker_ttl="2s",
        log_dir=str(tmp_path_factory.mktemp("prefix")),
    )  # fmt: skip
    try:
        yield c.start()
    finally:
        c.stop()


def _tcp(cluster: LocalCluster, i: int = 0) -> tuple[str, int]:
    host, port = cluster.worker_procs[i].ready["tcp"][len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def test_prefix_is_exactly_the_leading_run_of_present_blocks(three: LocalCluster) -> None:
    rng = random.Random(3)
    keys = [key(i, "chain") for i in range(600)]
    with Client(three.address) as c:
        stored = set(rng.sample(range(600), 560))
        assert all(c.batch_put(NS, [keys[i] for i in sorted(stored)], [b"v"] * len(stored)))
        for trial in range(40):
            lo = rng.randrange(0, 300)
            chain = keys[lo : lo + rng.randrange(1, 300)]
            want = leading_run(c.batch_exists(NS, chain))
            assert c.match_prefix(NS, chain) == want, trial
            assert c.match_prefix(NS, Keys(chain)) == want, trial
        full = [keys[i] for i in sorted(stored)]
        assert c.match_prefix(NS, full) == len(full)
        assert c.match_prefix(NS, [key(0, "absent"), *full]) == 0
        assert c.match_prefix(NS, [*full, key(0, "absent")]) == len(full)
        c.remove(NS, full)


def test_a_worker_answers_prefix_frames_with_the_run_in_the_header(three: LocalCluster) -> None:
    keys = [key(i, "hdr") for i in range(50)]
    with Client(three.address) as c:
        c.batch_put(NS, keys[:30], [b"v"] * 30)
    host, port = _tcp(three, 0)
    conn = TcpConnection(host, port, 5.0)
    try:
        # Every key goes to worker 0 here: it holds those of them it owns.
        conn.send_exists(NSB, b"".join(keys), len(keys), wire.FLAG_PREFIX)
        run = conn.recv_prefix(len(keys))
        conn.send_exists(NSB, b"".join(keys), len(keys))
        mine = conn.recv_exists().tolist()
        assert run == leading_run(mine)
        conn.send_exists(NSB, b"", 0, wire.FLAG_PREFIX)
        assert conn.recv_prefix(0) == 0
    finally:
        conn.close()


def _old_worker(flags: list[bool]) -> tuple[socket.socket, threading.Thread]:
    """A server that speaks EXISTS as workers did before FLAG_PREFIX: it ignores the
    flags and answers the bitmap."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            while True:
                raw = conn.recv(wire.HEADER_LEN, socket.MSG_WAITALL)
                if len(raw) < wire.HEADER_LEN:
                    return
                h = wire.decode_header(raw, wire.REQ_MAGIC)
                wire.recv_exact(conn, h.ns_len + 16 * h.count)
                head = wire.encode_answer_header(h.op, 0, h.count, h.req_id)
                conn.sendall(head + to_bitmap(flags[: h.count]))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_an_old_workers_bitmap_answer_still_gives_the_run() -> None:
    flags = [True] * 9 + [False] + [True] * 5
    srv, t = _old_worker(flags)
    conn = TcpConnection("127.0.0.1", srv.getsockname()[1], 5.0)
    try:
        for n in (15, 9, 1):
            conn.send_exists(NSB, b"k" * 16 * n, n, wire.FLAG_PREFIX)
            assert conn.recv_prefix(n) == min(n, 9)
    finally:
        conn.close()
        t.join(5)
        srv.close()


def _raw(cluster: LocalCluster) -> socket.socket:
    s = socket.create_connection(_tcp(cluster), timeout=5)
    return s


def _answer(s: socket.socket) -> tuple[wire.Header, bytes]:
    h = wire.decode_header(wire.recv_exact(s, wire.HEADER_LEN), wire.ANS_MAGIC)
    body = bytes(wire.recv_exact(s, h.count)) if h.flags_or_code else b""
    return h, body


def _closed(s: socket.socket) -> bool:
    """The worker closed the connection (a reset when it left our bytes unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_hostile_prefix_frames_get_a_clear_error_and_the_worker_keeps_serving(
    three: LocalCluster,
) -> None:
    keys = [key(i, "hostile") for i in range(20)]
    # Unknown flag bits: InvalidArgument, connection closed.
    with _raw(three) as s:
        s.sendall(wire.encode_request_header(wire.OP_EXISTS, NSB, 1, 7, flags=0x82) + keys[0])
        h, body = _answer(s)
        assert h.flags_or_code == InvalidArgument.code and b"flags" in body
        assert _closed(s)
    # A count over the batch limit: refused before any body is read.
    with _raw(three) as s:
        head = wire.encode_request_header(
            wire.OP_EXISTS, NSB, wire.MAX_BATCH + 1, 8, wire.FLAG_PREFIX
        )
        s.sendall(head)
        h, body = _answer(s)
        assert h.flags_or_code == InvalidArgument.code and body
        assert _closed(s)
    # Truncated: 20 hashes declared, 5 sent, then the sender goes away.
    with _raw(three) as s:
        head = wire.encode_request_header(wire.OP_EXISTS, NSB, 20, 9, wire.FLAG_PREFIX)
        s.sendall(head + b"".join(keys[:5]))
        s.shutdown(socket.SHUT_WR)
        assert _closed(s), "no answer to a truncated frame, just a close"
    # A body that is not a whole number of hashes cannot be declared: the count is in
    # hashes. The worker is still up and answers a good prefix frame right away.
    with Client(three.address) as c:
        c.batch_put(NS, keys[:10], [b"v"] * 10)
        assert c.match_prefix(NS, keys) == 10
        c.remove(NS, keys)


def test_a_killed_owner_ends_the_prefix_at_its_first_key(cluster: LocalCluster) -> None:
    keys = [key(i, "killed") for i in range(200)]
    with Client(cluster.address, timeout=2.0) as c:
        assert all(c.batch_put(NS, keys, [b"v"] * len(keys)))
        assert c.match_prefix(NS, keys) == len(keys)
        view = c._view
        assert view is not None and len(view.workers) == 2
        owner = view.ring.primary(keys)
        victim = cluster.worker_procs[0]
        w = next(i for i, x in enumerate(view.workers) if x.info.id == victim.ready["id"])
        first_lost = int(np.flatnonzero(owner == w)[0])
        victim.signal(signal.SIGKILL)
        victim.proc.wait(5)
        # Before and after the map drops it, its keys are misses, never an error: the
        # prefix ends at the first of them (after the drop they route to the survivor,
        # which does not hold them).
        assert c.match_prefix(NS, keys) == first_lost
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and len(c.workers()) > 1:
            time.sleep(0.1)
        assert len(c.workers()) == 1
        assert c.match_prefix(NS, keys) == first_lost
