"""Physical ceilings measured in the same run as a benchmark.

- :func:`memcpy_gib_s`: one core copying between two pre-faulted buffers larger
  than the caches (``numpy.copyto``), the bound of the shared-memory transport.
- :func:`socket_stream_gib_s`: one bare Python TCP stream on loopback between
  two processes (``sendall`` of 1 MiB memoryviews, ``recv_into`` pre-faulted
  memory), the bound of any TCP transport written in Python.

- :func:`copy_hash`: one core copying 1 MiB blocks between pre-faulted buffers larger
  than the caches and taking each block's xxh3-64 as it goes (the fused routine every
  verified path uses, ``kvstore_client.verified.copy_sum``): its GiB/s, and its CPU
  seconds per GiB moved, the least any verified transfer can cost.
- :func:`socket_streams_gib_s`: N such streams at once (one sender process each,
  one receiving thread each in this process), the bound of a client that keeps N
  connections busy (``workers x concurrency`` of a bench point).

All are best-of-``repeats`` so a neighbour's burst on a shared machine costs
less; ``python -m kvstore_bench.transfer.ceilings`` prints them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

GIB = float(1 << 30)
CHUNK = 1 << 20

# The sending half of the socket stream, run in a child process.
_SENDER = """
import socket, sys
host, port, total, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
buf = memoryview(bytearray(b"\\x5a" * chunk))
s = socket.create_connection((host, port))
s.recv(1)  # wait for "go": the receiver starts its clock first
sent = 0
while sent < total:
    n = min(chunk, total - sent)
    s.sendall(buf[:n])
    sent += n
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
"""


@dataclass(slots=True, frozen=True)
class Ceilings:
    """The measured limits, in GiB/s (1 GiB = 2**30 bytes)."""

    memcpy_gib_s: float
    socket_gib_s: float
    copy_hash_gib_s: float = 0.0
    copy_hash_cpu_s_per_gib: float = 0.0

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def memcpy_gib_s(nbytes: int = 256 << 20, seconds: float = 0.5, repeats: int = 3) -> float:
    """Single-thread ``numpy.copyto`` bandwidth between two pre-faulted buffers of
    ``nbytes`` each: best of ``repeats`` runs of about ``seconds`` each."""
    if nbytes <= 0 or seconds <= 0:
        raise ValueError("nbytes and seconds must be positive")
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # zeros() is lazily mapped: touch it first
    dst[::4096] = 1
    np.copyto(dst, src)
    best = 0.0
    for _ in range(max(1, repeats)):
        copied = 0
        t0 = time.perf_counter()
        while True:
            np.copyto(dst, src)
            copied += nbytes
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, copied / dt / GIB)
    return best


def copy_hash(
    nbytes: int = 256 << 20, seconds: float = 0.5, repeats: int = 3, block: int = 1 << 20
) -> tuple[float, float]:
    """(GiB/s, CPU s per GiB) of one thread's verified copy of ``block``-sized blocks
    between two pre-faulted buffers of ``nbytes``: best of ``repeats`` runs of about
    ``seconds`` each."""
    from kvstore_client.verified import copy_sum

    if nbytes < block or seconds <= 0:
        raise ValueError("nbytes must hold a block and seconds be positive")
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst[::4096] = 1
    best, cpu_best = 0.0, float("inf")
    for _ in range(max(1, repeats)):
        copied = 0
        c0, t0 = time.thread_time(), time.perf_counter()
        while True:
            for at in range(0, nbytes - block + 1, block):
                copy_sum(dst[at : at + block], src[at : at + block])
            copied += nbytes - nbytes % block
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, copied / dt / GIB)
        cpu_best = min(cpu_best, (time.thread_time() - c0) / (copied / GIB))
    return best, cpu_best


def socket_stream_gib_s(
    total_bytes: int = 1 << 30, repeats: int = 3, chunk: int = CHUNK, timeout: float = 60.0
) -> float:
    """Loopback TCP bandwidth of a bare Python stream: a child process ``sendall``s
    ``total_bytes`` in ``chunk``-byte memoryviews, this process ``recv_into``s a
    pre-faulted buffer. Best of ``repeats``; the child is ended by pid on any failure."""
    if total_bytes <= 0 or chunk <= 0:
        raise ValueError("total_bytes and chunk must be positive")
    landing = np.ones(max(chunk, min(total_bytes, 64 << 20)), dtype=np.uint8)
    view = landing.data.cast("B")
    best = 0.0
    for _ in range(max(1, repeats)):
        best = max(best, _one_stream(total_bytes, chunk, view, timeout))
    return best


def _receive(conn: socket.socket, view: memoryview, total: int, chunk: int) -> None:
    """Read ``total`` bytes in ``chunk``-sized reads, cycling through ``view``."""
    got, size = 0, len(view)
    while got < total:
        off = got % size
        n = conn.recv_into(view[off : min(size, off + chunk)])
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n


def _one_stream(total: int, chunk: int, view: memoryview, timeout: float) -> float:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(timeout)
        port = server.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-c", _SENDER, "127.0.0.1", str(port), str(total), str(chunk)],
            stdin=subprocess.DEVNULL,
        )
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout)
                t0 = time.perf_counter()
                conn.sendall(b"g")
                _receive(conn, view, total, chunk)
                dt = time.perf_counter() - t0
                conn.sendall(b"d")
            child.wait(timeout)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(5)
    return total / dt / GIB


def socket_streams_gib_s(
    streams: int,
    total_bytes: int = 1 << 30,
    repeats: int = 3,
    chunk: int = CHUNK,
    timeout: float = 60.0,
) -> float:
    """Aggregate loopback bandwidth of ``streams`` bare Python TCP streams at once:
    ``streams`` child processes each ``sendall`` ``total_bytes / streams`` bytes, one
    thread per stream here ``recv_into``s its own pre-faulted buffer; the clock runs
    from the first "go" to the last byte. Best of ``repeats``; one stream is
    :func:`socket_stream_gib_s`. Children are ended by pid on any failure."""
    if streams <= 0 or total_bytes <= 0 or chunk <= 0:
        raise ValueError("streams, total_bytes and chunk must be positive")
    if streams == 1:
        return socket_stream_gib_s(total_bytes, repeats, chunk, timeout)
    per = max(chunk, total_bytes // streams)
    landing = [np.ones(max(chunk, min(per, 16 << 20)), dtype=np.uint8) for _ in range(streams)]
    views = [a.data.cast("B") for a in landing]
    return max(_many_streams(per, chunk, views, timeout) for _ in range(max(1, repeats)))


def _many_streams(per: int, chunk: int, views: list[memoryview], timeout: float) -> float:
    n = len(views)
    children: list[subprocess.Popen[bytes]] = []
    conns: list[socket.socket] = []
    errors: list[BaseException] = []
    with socket.create_server(("127.0.0.1", 0), backlog=n) as server:
        server.settimeout(timeout)
        port = server.getsockname()[1]
        try:
            for _ in range(n):
                children.append(subprocess.Popen(
                    [sys.executable, "-c", _SENDER, "127.0.0.1", str(port), str(per), str(chunk)],
                    stdin=subprocess.DEVNULL,
                ))  # fmt: skip
            for _ in range(n):
                conn, _ = server.accept()
                conn.settimeout(timeout)
                conns.append(conn)
            start = threading.Barrier(n + 1, timeout=timeout)

            def receive(conn: socket.socket, view: memoryview) -> None:
                try:
                    start.wait()
                    conn.sendall(b"g")
                    _receive(conn, view, per, chunk)
                except BaseException as e:  # reported after the join
                    errors.append(e)

            threads = [threading.Thread(target=receive, args=(c, v), daemon=True)
                       for c, v in zip(conns, views, strict=True)]  # fmt: skip
            for t in threads:
                t.start()
            start.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join(timeout)
            dt = time.perf_counter() - t0
            if errors or any(t.is_alive() for t in threads):
                raise ConnectionError(f"a socket stream failed: {errors[:1] or 'timed out'}")
            for conn in conns:
                conn.sendall(b"d")
            for child in children:
                child.wait(timeout)
        finally:
            for conn in conns:
                conn.close()
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait(5)
    return n * per / dt / GIB


def client_streams(concurrency: list[int], aggregate_workers: int) -> list[int]:
    """The stream counts (above 1) a transfer grid's points keep busy at once:
    ``workers x concurrency`` per point (the sweep runs one worker at each
    concurrency; the aggregate point, ``aggregate_workers`` at concurrency 1)."""
    ns = set(concurrency) | ({aggregate_workers} if aggregate_workers > 1 else set())
    return sorted(n for n in ns if n > 1)


def measure(quick: bool = False) -> Ceilings:
    """The ceilings; ``quick`` moves less data (about a second in all)."""
    if quick:
        return Ceilings(
            memcpy_gib_s(64 << 20, 0.15, 2),
            socket_stream_gib_s(256 << 20, repeats=2),
            *copy_hash(64 << 20, 0.15, 2),
        )
    return Ceilings(memcpy_gib_s(), socket_stream_gib_s(), *copy_hash())


if __name__ == "__main__":
    print(json.dumps(measure("--quick" in sys.argv).to_json()))
