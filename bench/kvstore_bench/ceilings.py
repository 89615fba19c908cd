"""Physical ceilings measured in the same run as a benchmark.

- :func:`memcpy_gib_s`: one core copying between two pre-faulted buffers larger
  than the caches (``numpy.copyto``), the bound of the shared-memory transport.
- :func:`socket_stream_gib_s`: one bare Python TCP stream on loopback between
  two processes (``sendall`` of 1 MiB memoryviews, ``recv_into`` pre-faulted
  memory), the bound of any TCP transport written in Python.

Both are best-of-``repeats`` so a neighbour's burst on a shared machine costs
less; ``python -m kvstore_bench.ceilings`` prints them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
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
                got = 0
                size = len(view)
                t0 = time.perf_counter()
                conn.sendall(b"g")
                while got < total:
                    off = got % size
                    n = conn.recv_into(view[off : min(size, off + chunk)])
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    got += n
                dt = time.perf_counter() - t0
                conn.sendall(b"d")
            child.wait(timeout)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(5)
    return total / dt / GIB


def measure(quick: bool = False) -> Ceilings:
    """Both ceilings; ``quick`` moves less data (about a second in all)."""
    if quick:
        return Ceilings(memcpy_gib_s(64 << 20, 0.15, 2), socket_stream_gib_s(256 << 20, repeats=2))
    return Ceilings(memcpy_gib_s(), socket_stream_gib_s())


if __name__ == "__main__":
    print(json.dumps(measure("--quick" in sys.argv).to_json()))
