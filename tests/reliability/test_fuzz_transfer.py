"""Hostile input on a worker's tcp:// transfer port.

Random bytes, header-shaped garbage, truncated frames of every op, declared lengths far
beyond the limits, valid headers with absurd counts, silent and idle connections and
slow-loris senders. Each must end with the connection closed (malformed frames counted
in the worker's ``bad_frames``), the daemon up, its memory bounded, nothing half-written
visible or leaked (arena bytes back to where they were), and other clients served
throughout (their latency is measured during the attacks).

The module's worker runs with short timeouts (frame 2 s, idle 2 s), at most 128
connections and 64 per client address, set through the environment (KVSTORE_WORKER_*),
so the timeouts can be observed in seconds. Attackers connect from other loopback
addresses (127.0.0.2...) than the good client (127.0.0.1), as they would from other hosts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.cluster import LocalCluster
from kvstore_client import Client, ResourceExhausted, wire
from kvstore_client.proto import store_pb2
from tests.conftest import assert_no_leaks
from tests.reliability.loadgen import block_value, proc_status, session_key, store_stats

NS = "fuzz/tcp/b16/tp0of1"
NSB = NS.encode()
FRAME_TIMEOUT = 2.0
IDLE_TIMEOUT = 2.0
MAX_CONNECTIONS = 128
PER_CLIENT = 64
MAX_VALUE = 1 << 20
DEFAULT_EXAMPLES = 60
SLOW_EXAMPLES = 1000
MiB = 1 << 20


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        worker_ttl="2s",
        log_dir=str(tmp_path_factory.mktemp("fuzz-tcp")),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTORE_WORKER_FRAME_TIMEOUT", f"{FRAME_TIMEOUT}s")
        mp.setenv("KVSTORE_WORKER_IDLE_TIMEOUT", f"{IDLE_TIMEOUT}s")
        mp.setenv("KVSTORE_WORKER_MAX_CONNECTIONS", str(MAX_CONNECTIONS))
        mp.setenv("KVSTORE_WORKER_MAX_CONNECTIONS_PER_CLIENT", str(PER_CLIENT))
        try:
            c.start()
        except BaseException:
            c.stop()
            raise
    try:
        yield c
    finally:
        c.stop()
        assert_no_leaks(c)


def addr(worker: LocalCluster) -> tuple[str, int]:
    host, port = worker.worker_procs[0].ready["tcp"][len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def stats(worker: LocalCluster) -> store_pb2.StatsResponse:
    return store_stats(worker.worker_procs[0].ready["grpc"])


def rss_anon(worker: LocalCluster) -> int:
    return proc_status(worker.worker_procs[0].pid)["RssAnon"]


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool, float]:
    """Read until the server closes: (bytes it sent, closed?, seconds waited)."""
    t0 = time.monotonic()
    data = b""
    while time.monotonic() - t0 < timeout:
        sock.settimeout(max(0.01, timeout - (time.monotonic() - t0)))
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return data, True, time.monotonic() - t0
        except TimeoutError:
            break
        if not chunk:
            return data, True, time.monotonic() - t0
        data += chunk
    return data, False, time.monotonic() - t0


def send_and_close(worker: LocalCluster, data: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data``, end our side (EOF), and wait for the server to close."""
    with socket.create_connection(addr(worker), timeout=5) as s:
        with contextlib.suppress(OSError):  # the server may close before we finish
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        got, closed, _ = read_until_closed(s, timeout)
    return got, closed


def header(
    op: int, count: int, ns: bytes = NSB, req_id: int = 1, ns_len: int | None = None
) -> bytes:
    n = len(ns) if ns_len is None else ns_len
    return wire.HEADER.pack(wire.REQ_MAGIC, op, 0, n, count, req_id) + ns


def put_frame(
    keys: list[bytes], vals: list[bytes], op: int = wire.OP_PUT, req_id: int = 1
) -> bytes:
    entries = b"".join(
        wire.PUT_ENTRY.pack(k, len(v), xxhash.xxh3_64_intdigest(v))
        for k, v in zip(keys, vals, strict=True)
    )
    body = entries + (b"".join(vals) if op == wire.OP_PUT else b"")
    return header(op, len(keys), req_id=req_id) + body


def good_client_round(c: Client, keys: list[bytes], vals: list[bytes]) -> float:
    """One verified get of known blocks; returns its latency. Asserts exact bytes."""
    t0 = time.monotonic()
    got = c.batch_get(NS, keys)
    dt = time.monotonic() - t0
    assert got == vals, "a good client must get every block, exact, during the attack"
    return dt


@dataclass
class GoodClient:
    """A well-behaved client in a thread: verified gets (and puts) with latencies."""

    master: str
    keys: list[bytes]
    vals: list[bytes]
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        with Client(self.master, timeout=5.0, transport="tcp") as c:
            while not self.stop.is_set():
                try:
                    self.latencies.append(good_client_round(c, self.keys, self.vals))
                    k = session_key(7, i, f"good-{id(self)}")
                    if c.batch_put(NS, [k], [block_value(k, 4096)]) != [True]:
                        self.failures.append(f"put {i} not stored")
                    i += 1
                except Exception as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                self.stop.wait(0.02)

    @contextlib.contextmanager
    def running(self) -> Iterator[GoodClient]:
        t = threading.Thread(target=self.run, name="good-client", daemon=True)
        t.start()
        try:
            yield self
        finally:
            self.stop.set()
            t.join(30)

    def p99(self) -> float:
        return float(np.percentile(self.latencies, 99)) if self.latencies else float("inf")


@pytest.fixture
def known(worker: LocalCluster) -> tuple[list[bytes], list[bytes]]:
    """Blocks a good client wrote before the attack; they must stay readable.
    (Written again for each test: an earlier attack may have evicted them.)"""
    keys = [session_key(1, i, "known") for i in range(16)]
    vals = [block_value(k, 64 << 10) for k in keys]
    with Client(worker.address, transport="tcp") as c:
        deadline = time.monotonic() + 10
        while True:  # an earlier attack's reservations may take a moment to go
            try:
                c.batch_put(NS, keys, vals)
                break
            except ResourceExhausted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert all(c.batch_exists(NS, keys)), "the good client's blocks are in"
    return keys, vals


def wait_reservations_gone(worker: LocalCluster, used_before: int) -> None:
    """After an attacker hung up: wait until its reservations are given back."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and stats(worker).used_bytes > used_before:
        time.sleep(0.05)


# ---- random and header-shaped bytes ------------------------------------------------

header_shaped = st.builds(
    lambda op, flags, ns_len, count, rid, tail: (
        wire.HEADER.pack(wire.REQ_MAGIC, op, flags, ns_len, count, rid) + tail
    ),
    st.one_of(st.integers(0, 255), st.integers(1, 8)),
    st.integers(0, 255),
    st.one_of(st.integers(0, 65535), st.integers(0, 300)),
    st.one_of(st.integers(0, 2**32 - 1), st.integers(0, wire.MAX_BATCH + 1), st.integers(0, 4)),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=400),
)
# Frames with a valid namespace and small counts: they reach every op's body parsing.
plausible = st.builds(
    lambda op, count, rid, body: header(op, count, req_id=rid) + body,
    st.integers(1, max(wire.OPS)),
    st.integers(0, 4),
    st.integers(0, 3),
    st.one_of(
        st.binary(max_size=300),
        st.lists(
            st.builds(
                wire.PUT_ENTRY.pack,
                st.binary(min_size=16, max_size=16),
                st.one_of(st.integers(0, 4096), st.integers(0, 2**32 - 1)),
                st.integers(0, 2**64 - 1),
            ),
            max_size=4,
        ).map(b"".join),
    ),
)
garbage = st.one_of(st.binary(max_size=400), header_shaped, plausible)


def must_count(data: bytes) -> bool:
    """True when the frame is malformed beyond doubt (bad magic or op in a full header)."""
    if len(data) < wire.HEADER_LEN:
        return False
    magic, op = data[:4], data[4]
    return magic != wire.REQ_MAGIC or op not in wire.OPS


def fuzz_transfer_port(worker: LocalCluster, examples: int) -> None:
    base = stats(worker)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(garbage)
    def one(data: bytes) -> None:
        before = stats(worker).bad_frames
        answer, closed = send_and_close(worker, data)
        assert closed, f"the worker kept the connection open after EOF: {data[:64]!r}"
        if len(answer) >= wire.HEADER_LEN:
            magic = answer[:4]
            assert magic == wire.ANS_MAGIC, f"the answer is not a frame: {answer[:40]!r}"
        if must_count(data):
            assert stats(worker).bad_frames > before, f"bad frame not counted: {data[:40]!r}"

    one()
    assert worker.worker_procs[0].alive()
    after = stats(worker)
    assert after.used_bytes == base.used_bytes, "a reservation of a dead connection leaked"
    assert after.keys == base.keys, "garbage became a visible block"


def test_random_bytes_and_frames_close_the_connection_and_leak_nothing(
    worker: LocalCluster, known: tuple[list[bytes], list[bytes]]
) -> None:
    fuzz_transfer_port(worker, DEFAULT_EXAMPLES)
    with Client(worker.address, transport="tcp") as c:
        good_client_round(c, *known)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_random_bytes_and_frames_long(
    worker: LocalCluster, known: tuple[list[bytes], list[bytes]]
) -> None:
    rss0 = rss_anon(worker)
    fuzz_transfer_port(worker, SLOW_EXAMPLES)
    with Client(worker.address, transport="tcp") as c:
        good_client_round(c, *known)
    grown = rss_anon(worker) - rss0
    assert grown < 32 * MiB, (
        f"worker heap grew by {grown / MiB:.1f} MiB over {SLOW_EXAMPLES} frames"
    )


# ---- truncated frames of every op --------------------------------------------------


def complete_frames() -> dict[str, bytes]:
    keys = [session_key(2, i, "trunc") for i in range(2)]
    vals = [block_value(k, 3000) for k in keys]
    hashes = b"".join(keys)
    return {
        "PUT": put_frame(keys, vals),
        "GET": header(wire.OP_GET, 2) + hashes,
        "EXISTS": header(wire.OP_EXISTS, 2) + hashes,
        "REMOVE": header(wire.OP_REMOVE, 2) + hashes,
        "GET_LOC": header(wire.OP_GET_LOC, 2) + hashes,
        "RELEASE": header(wire.OP_RELEASE, 0),
        "PUT_LOC": put_frame(keys, vals, op=wire.OP_PUT_LOC),
        # After a complete PUT_LOC (request 7), a commit frame naming it.
        "PUT_COMMIT": put_frame(keys, vals, op=wire.OP_PUT_LOC, req_id=7)
        + header(wire.OP_PUT_COMMIT, 2, req_id=7)
        + b"\x01\x01",
        "AUTH": wire.encode_request_header(wire.OP_AUTH, b"", 12, 1) + b"not-a-secret",
        "AUTH+identity": wire.encode_request_header(wire.OP_AUTH, b"", 28, 1, wire.FLAG_IDENTITY)
        + b"i" * 16
        + b"not-a-secret",
        "PUT_INBOX": header(wire.OP_PUT_INBOX, 2)
        + b"".join(wire.INBOX_ENTRY.pack(k, 3000, 0, 4096 * i) for i, k in enumerate(keys)),
    }


def cut_points(frame: bytes) -> list[int]:
    """Every byte of the header and namespace, then a spread over the body."""
    n = len(frame)
    head = list(range(1, min(n, wire.HEADER_LEN + len(NSB) + 1)))
    body = sorted({n * k // 16 for k in range(1, 16)} | {n - 1})
    return sorted({c for c in head + body if 0 < c < n})


@pytest.mark.parametrize(
    "op",
    complete_frames(),
)
def test_truncated_frame_of_each_op_closes_and_leaks_nothing(worker: LocalCluster, op: str) -> None:
    frame = complete_frames()[op]
    keys = [session_key(2, i, "trunc") for i in range(2)]
    base = stats(worker)
    for cut in cut_points(frame):
        _, closed = send_and_close(worker, frame[:cut])
        assert closed, f"{op} cut at {cut}/{len(frame)}: connection left open"
    assert worker.worker_procs[0].alive()
    after = stats(worker)
    assert after.used_bytes == base.used_bytes, f"{op}: truncated frames leaked arena bytes"
    with Client(worker.address, transport="tcp") as c:
        assert c.batch_exists(NS, keys) == [False, False], f"{op}: a half-written block is visible"


def test_put_commit_cut_before_its_flags_leaves_keys_writable(worker: LocalCluster) -> None:
    keys = [session_key(5, i, "commit-cut") for i in range(2)]
    vals = [block_value(k, 5000) for k in keys]
    base = stats(worker)
    with socket.create_connection(addr(worker)) as s:
        s.sendall(put_frame(keys, vals, op=wire.OP_PUT_LOC, req_id=3))
        s.sendall(header(wire.OP_PUT_COMMIT, 2, req_id=3))  # and no flags: the peer is gone
        s.shutdown(socket.SHUT_WR)
        read_until_closed(s, 5)
    assert stats(worker).used_bytes == base.used_bytes, "the reserved slots were not freed"
    with Client(worker.address, transport="tcp") as c:
        assert c.batch_put(NS, keys, vals) == [True, True], "the keys can be written again"


def test_unreleased_pins_die_with_the_connection(worker: LocalCluster) -> None:
    k = session_key(3, 0, "pins")
    v = block_value(k, 100_000)
    with Client(worker.address, transport="tcp") as c:
        assert c.batch_put(NS, [k], [v]) == [True]
    base = stats(worker)
    with socket.create_connection(addr(worker)) as s:
        # Pin it 10 times (GET_LOC without RELEASE).
        for rid in range(1, 11):
            s.sendall(header(wire.OP_GET_LOC, 1, req_id=rid) + k)
        time.sleep(0.3)
    # The connection is gone: pins released.
    with Client(worker.address, transport="tcp") as c:
        assert c.remove(NS, [k]) == 1
    assert stats(worker).used_bytes == base.used_bytes - 100_000, "a pin outlived its connection"


# ---- declared lengths far beyond the limits -----------------------------------------

ABSURD = {
    "ns_len 65535": header(wire.OP_GET, 1, ns=b"x" * 300, ns_len=65535),
    "count 2^32-1": header(wire.OP_GET, 2**32 - 1),
    "count max+1": header(wire.OP_EXISTS, wire.MAX_BATCH + 1),
    "put size 2^32-1": header(wire.OP_PUT, 1) + wire.PUT_ENTRY.pack(b"k" * 16, 2**32 - 1, 0),
    "put size limit+1": header(wire.OP_PUT, 1) + wire.PUT_ENTRY.pack(b"k" * 16, MAX_VALUE + 1, 0),
    "put_loc size 2^32-1": header(wire.OP_PUT_LOC, 1)
    + wire.PUT_ENTRY.pack(b"k" * 16, 2**32 - 1, 0),
    "commit of nothing": header(wire.OP_PUT_COMMIT, 3, req_id=12345) + b"\x01\x01\x01",
    "inbox size 2^32-1 at 2^64-1": header(wire.OP_PUT_INBOX, 1)
    + wire.INBOX_ENTRY.pack(b"k" * 16, 2**32 - 1, 0, 2**64 - 1),
    "inbox past the end": header(wire.OP_PUT_INBOX, 1)
    + wire.INBOX_ENTRY.pack(b"k" * 16, 1000, 0, 2**40),
    "identity too short": wire.encode_request_header(wire.OP_AUTH, b"", 3, 1, wire.FLAG_IDENTITY)
    + b"abc",
    "auth token 2^32-1": wire.encode_request_header(wire.OP_AUTH, b"", 2**32 - 1, 1),
    "bad namespace": header(wire.OP_GET, 1, ns=b"../../etc") + b"k" * 16,
    "non-utf8 namespace": header(wire.OP_GET, 1, ns=b"\xff\xfe") + b"k" * 16,
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_declared_lengths_beyond_limits_are_refused_and_counted(
    worker: LocalCluster, name: str
) -> None:
    before = stats(worker)
    rss0 = rss_anon(worker)
    answer, closed = send_and_close(worker, ABSURD[name])
    assert closed
    after = stats(worker)
    assert after.bad_frames == before.bad_frames + 1, f"{name}: the bad frame was not counted"
    if answer:
        _, _, code, _, count, _ = wire.HEADER.unpack(answer[: wire.HEADER_LEN])
        assert code == 3, f"{name}: error answer code {code}, expected INVALID_ARGUMENT"
        assert len(answer) == wire.HEADER_LEN + count
    assert after.used_bytes == before.used_bytes
    assert rss_anon(worker) - rss0 < 16 * MiB, f"{name}: the worker allocated what was declared"


def test_valid_headers_with_max_count_and_no_body_are_dropped_at_frame_timeout(
    worker: LocalCluster,
) -> None:
    ops = [wire.OP_GET, wire.OP_EXISTS, wire.OP_REMOVE, wire.OP_PUT, wire.OP_PUT_INBOX]
    socks = [socket.create_connection(addr(worker)) for _ in ops]
    try:
        for s, op in zip(socks, ops, strict=True):
            s.sendall(header(op, wire.MAX_BATCH))
        t0 = time.monotonic()
        for s, op in zip(socks, ops, strict=True):
            _, closed, _ = read_until_closed(s, FRAME_TIMEOUT + 5 - (time.monotonic() - t0))
            waited = time.monotonic() - t0
            assert closed, f"op {op}: a frame that never completes must be dropped"
            assert waited < FRAME_TIMEOUT + 3, f"op {op}: dropped after {waited:.1f}s"
    finally:
        for s in socks:
            s.close()


# ---- connections that say nothing, or very little -----------------------------------


def attacker(i: int) -> tuple[str, int]:
    """A source address for attacker ``i``: 127.0.0.2, 127.0.0.3, ..."""
    return (f"127.0.0.{2 + i}", 0)


@contextlib.contextmanager
def idle_connections(
    worker: LocalCluster, n: int, first_source: int = 0
) -> Iterator[list[socket.socket]]:
    """``n`` silent connections, PER_CLIENT from each attacker address in turn."""
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            src = attacker(first_source + i // PER_CLIENT)
            socks.append(socket.create_connection(addr(worker), source_address=src))
        yield socks
    finally:
        for s in socks:
            s.close()


def slow_loris(
    worker: LocalCluster, data: bytes, stop: threading.Event, give_up: float = 60.0
) -> Callable[[], float]:
    """Send ``data`` one byte per second in a thread (for at most ``give_up`` seconds);
    the result is when the server cut the connection (inf: it never did)."""
    cut: list[float] = []
    t0 = time.monotonic()

    def run() -> None:
        with socket.create_connection(addr(worker), source_address=attacker(5)) as s:
            for b in data:
                if stop.is_set() or time.monotonic() - t0 > give_up:
                    return
                try:
                    s.send(bytes([b]))
                    s.settimeout(1.0)
                    if s.recv(1) == b"":
                        break
                except TimeoutError:
                    continue  # still open: the next byte
                except OSError:
                    break
            cut.append(time.monotonic() - t0)

    t = threading.Thread(target=run, name="slow-loris", daemon=True)
    t.start()

    def result() -> float:
        t.join(timeout=min(len(data), give_up) + 5)
        return cut[0] if cut else float("inf")

    return result


def test_attack_mix_other_clients_served_memory_bounded(
    worker: LocalCluster, known: tuple[list[bytes], list[bytes]]
) -> None:
    """Idle sockets, silent sockets, garbage, truncated frames and slow-loris senders at
    once, while a good client reads and writes; its p99 must stay low."""
    good = GoodClient(worker.address, *known)
    with good.running():
        time.sleep(1.0)
    baseline_p99 = good.p99()
    assert not good.failures, good.failures
    # One warm-up round so the allocator's pools exist before measuring memory.
    with idle_connections(worker, 20):
        for frame in complete_frames().values():
            send_and_close(worker, frame[: len(frame) // 2])
    time.sleep(0.5)
    rss0 = rss_anon(worker)
    bad0 = stats(worker).bad_frames
    stop = threading.Event()
    good = GoodClient(worker.address, *known)
    with idle_connections(worker, 60) as idle, good.running():
        silent = socket.create_connection(addr(worker), source_address=attacker(6))
        loris = [slow_loris(worker, header(wire.OP_GET, 1), stop) for _ in range(5)]
        t_end = time.monotonic() + 4.0
        rounds = 0
        while time.monotonic() < t_end:
            send_and_close(worker, os.urandom(64))
            for frame in complete_frames().values():
                send_and_close(worker, frame[: len(frame) // 2])
            rounds += 1
        rss_during = rss_anon(worker)
        _, silent_closed, _ = read_until_closed(silent, 0.5)
        silent.close()
        stop.set()
        for r in loris:
            r()
        idle_open = sum(1 for s in idle if not read_until_closed(s, 0.01)[1])
    assert not good.failures, f"the good client failed during the attack: {good.failures[:5]}"
    attack_p99 = good.p99()
    assert attack_p99 < max(0.5, 5 * baseline_p99), (
        f"good client p99 {attack_p99 * 1e3:.1f} ms under attack vs {baseline_p99 * 1e3:.1f} ms"
    )
    assert silent_closed, f"a silent connection outlived the idle timeout ({IDLE_TIMEOUT}s)"
    assert idle_open == 0, f"{idle_open} idle connections outlived the idle timeout"
    assert stats(worker).bad_frames >= bad0 + rounds, "every garbage frame is counted"
    time.sleep(0.5)
    grown = rss_anon(worker) - rss0
    # Connections hold ~1 MiB each while open (see the xfail below); once they are closed
    # the worker must be back within a few MiB of allocator slack.
    assert grown < 16 * MiB, f"worker heap grew by {grown / MiB:.1f} MiB after the attack"
    print(
        f"\ngood client p99: {baseline_p99 * 1e3:.1f} ms idle, {attack_p99 * 1e3:.1f} ms under "
        f"attack ({len(good.latencies)} calls, {rounds} attack rounds); worker RssAnon "
        f"{rss0 / MiB:.0f} MiB before, {rss_during / MiB:.0f} MiB during, "
        f"{(rss0 + grown) / MiB:.0f} MiB after"
    )


def test_slow_loris_is_cut_off_at_the_frame_timeout(worker: LocalCluster) -> None:
    stop = threading.Event()
    frame = header(wire.OP_GET, 1) + b"k" * 16  # 55 bytes: 55 s at one byte per second
    cut = slow_loris(worker, frame, stop, give_up=FRAME_TIMEOUT + 2.5)()
    assert cut < FRAME_TIMEOUT + 2, f"slow-loris connection still open after {cut:.1f}s"


def test_idle_connections_at_the_limit_do_not_lock_out_clients(
    worker: LocalCluster, known: tuple[list[bytes], list[bytes]]
) -> None:
    with idle_connections(worker, MAX_CONNECTIONS):
        time.sleep(0.2)
        with Client(worker.address, transport="tcp", timeout=2) as c:
            assert c.batch_get(NS, known[0]) == known[1], "a good client is locked out"


def test_idle_connection_costs_little_memory(worker: LocalCluster) -> None:
    n = PER_CLIENT
    rss0 = rss_anon(worker)
    with idle_connections(worker, n):
        time.sleep(0.5)
        per_conn = (rss_anon(worker) - rss0) / n
    assert per_conn < 256 << 10, f"each idle connection costs {per_conn / 1024:.0f} KiB"


def test_pooled_connection_closed_by_idle_timeout_does_not_cost_a_miss(
    worker: LocalCluster, known: tuple[list[bytes], list[bytes]]
) -> None:
    with Client(worker.address, transport="tcp") as c:
        assert c.batch_get(NS, known[0]) == known[1]
        time.sleep(IDLE_TIMEOUT + 0.5)  # the worker closes the pooled connection
        assert c.batch_get(NS, known[0]) == known[1], "a quiet spell must not cost misses"


# ---- reservations that are never filled ----------------------------------------------
# Last in the module: after them the arena's slabs all belong to the 1 MiB size class (see
# test_fuzz_grpc's slab xfail), so the good client here writes and keeps 1 MiB blocks.


@pytest.fixture
def known_mib(worker: LocalCluster) -> tuple[list[bytes], list[bytes]]:
    keys = [session_key(1, i, "known-mib") for i in range(8)]
    vals = [block_value(k, MAX_VALUE) for k in keys]
    with Client(worker.address, transport="tcp") as c:
        c.batch_put(NS, keys, vals)
        assert all(c.batch_exists(NS, keys)), "the good client's blocks are in"
    return keys, vals


def test_put_header_without_payload_does_not_lock_the_arena(
    worker: LocalCluster, known_mib: tuple[list[bytes], list[bytes]]
) -> None:
    n = 64  # 64 x 1 MiB declared = the whole arena
    evil = [session_key(4, i, "evil") for i in range(n)]
    entries = b"".join(wire.PUT_ENTRY.pack(k, MAX_VALUE, 0) for k in evil)
    used = stats(worker).used_bytes
    try:
        with socket.create_connection(addr(worker), source_address=attacker(7)) as s:
            s.sendall(header(wire.OP_PUT, n) + entries + b"x")  # one byte of 64 MiB
            time.sleep(0.3)
            with Client(worker.address, transport="tcp") as c:
                k = session_key(4, 0, "good-during-evil")
                try:
                    stored = c.batch_put(NS, [k], [block_value(k, MAX_VALUE)])
                except ResourceExhausted as e:
                    raise AssertionError(f"a good write failed during the attack: {e}") from e
                still = c.batch_exists(NS, known_mib[0])
    finally:
        wait_reservations_gone(worker, used)
    assert stored == [True], "a good write must not fail because of a stalled header"
    assert all(still), "blocks must not be evicted for bytes that never arrived"


def test_put_loc_without_commit_does_not_lock_the_arena(
    worker: LocalCluster, known_mib: tuple[list[bytes], list[bytes]]
) -> None:
    n = 64  # 64 x 1 MiB declared = the whole arena
    evil = [session_key(6, i, "evil-loc") for i in range(n)]
    entries = b"".join(wire.PUT_ENTRY.pack(k, MAX_VALUE, 0) for k in evil)
    used = stats(worker).used_bytes
    try:
        with socket.create_connection(addr(worker), source_address=attacker(7)) as s:
            s.sendall(header(wire.OP_PUT_LOC, n, req_id=1) + entries)
            time.sleep(0.3)
            s.sendall(header(wire.OP_RELEASE, 0, req_id=999))  # keeps the connection fresh
            with Client(worker.address, transport="tcp") as c:
                k = session_key(6, 0, "good-during-evil-loc")
                try:
                    stored = c.batch_put(NS, [k], [block_value(k, MAX_VALUE)])
                except ResourceExhausted as e:
                    raise AssertionError(f"a good write failed during the attack: {e}") from e
                still = c.batch_exists(NS, known_mib[0])
    finally:
        wait_reservations_gone(worker, used)
    assert stored == [True], "a good write must not fail because of idle reservations"
    assert all(still), "blocks must not be evicted for slots that are never written"
