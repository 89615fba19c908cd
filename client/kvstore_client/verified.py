"""Copies that checksum what they move: the one copy-and-verify routine of kvstore.

Every path that moves a block's bytes also takes its xxh3-64, so the bytes are read
once and hashed while they are still in cache: the copy runs in chunks of ``CHUNK``
bytes, each hashed right after it is copied (a streaming xxh3 gives the same digest
as one pass over the whole block). Which side of the copy is hashed is the point:

- a reader hashes the *destination* (:func:`copy_sum` with ``over="dst"``): the bytes
  it hands on are exactly the bytes it verified, whatever happens to the source after
  (a slot reused under it, another process writing shared memory);
- a writer hashes its *source* (``over="src"``, :func:`gather_sum` for a block given as
  parts): the checksum says what the writer meant, and whoever copies the bytes on
  (the worker, from a client's inbox into its arena) checks its own copy against it.

Every transport's get lands and verifies its hits through one :class:`Landing`: where
each hit goes (a new buffer, the caller's own, or nowhere when the sizes differ), and
the check of what landed against the block's xxh3-64 (a mismatch is a miss).

numpy's copies and xxhash release the GIL for large buffers, so several threads can
run these at once: :func:`run` spreads a batch's copies over a small process-wide pool
(``KVSTORE_COPY_THREADS``, default the cores, at most 4) when the batch is big enough to
pay for the hand-offs (``PARALLEL_MIN`` bytes), and :func:`later` hands one job to it
(a reader verifies block k while it receives block k+1).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Literal, TypeVar

import numpy as np
import xxhash

from . import wire

# Big enough that per-chunk Python costs vanish, small enough that a chunk copied is
# still in L2 when it is hashed.
CHUNK = 256 << 10
# Below this a block is copied and hashed in one pass each (it stays in cache anyway).
SMALL = 2 * CHUNK
# Up to this a copy is one memoryview slice assignment: numpy.copyto costs ~2 us more
# a call (32 copies and hashes of 64 KiB: 269 us against 331 on a 2-core VM), and the
# two ran even at 128-256 KiB there.
SMALL_COPY = 128 << 10

Bytes = bytes | bytearray | memoryview
T = TypeVar("T")

# A received block at least this big is verified on the copy pool (Landing.check with
# its size),
# overlapping the next block's receive; smaller ones on the receiving thread (a
# hand-off costs more than their hash).
VERIFY_LATER = 256 << 10

# A batch of fewer bytes runs on the caller's thread: handing a job to another thread
# costs ~20-50 us, a 1 MiB copy and hash ~100 us.
PARALLEL_MIN = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """Threads a batch's copies may use (the caller's included)."""
    raw = os.environ.get("KVSTORE_COPY_THREADS", "")
    if raw.strip().isdigit() and int(raw) > 0:
        return int(raw)
    return max(1, min(os.cpu_count() or 1, 4))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, threads() - 1), thread_name_prefix="kvstore-copy")
        return _pool


def run(jobs: Sequence[Callable[[], T]], nbytes: int) -> list[T]:
    """Run ``jobs`` (copies of ``nbytes`` in all) and return their results in order:
    split over :func:`threads` threads (the caller runs one share) when the batch is
    big enough, else one after another here."""
    if nbytes < PARALLEL_MIN or len(jobs) < 2:  # before threads(): it reads the env
        return [j() for j in jobs]
    n = threads()
    if n <= 1:
        return [j() for j in jobs]
    n = min(n, len(jobs))
    cuts = [len(jobs) * i // n for i in range(n + 1)]
    groups = [jobs[cuts[i] : cuts[i + 1]] for i in range(n)]
    pool = _executor()
    futs = [pool.submit(_all, g) for g in groups[1:]]
    out = _all(groups[0])
    for f in futs:
        out += f.result()
    return out


def _all(jobs: Sequence[Callable[[], T]]) -> list[T]:
    return [j() for j in jobs]


def later(job: Callable[[], T]) -> Future[T]:
    """Run ``job`` on the pool (its result when the caller needs it)."""
    return _executor().submit(job)


def check_all(bufs: Sequence[Bytes], sums: Sequence[int]) -> list[bool]:
    """Whether each buffer's xxh3-64 is its checksum: on :func:`threads` threads when
    the batch is big enough (xxhash releases the GIL), so verifying the slots a DMA
    will read is not bound to one core's hashing speed."""
    digest = xxhash.xxh3_64_intdigest
    nbytes = sum(len(memoryview(b)) for b in bufs)
    jobs = [partial(_matches, digest, b, c) for b, c in zip(bufs, sums, strict=True)]
    return run(jobs, nbytes)


def _matches(digest: Callable[[Bytes], int], buf: Bytes, checksum: int) -> bool:
    return digest(buf) == checksum


def as_array(buf: Bytes | np.ndarray) -> np.ndarray:
    """A flat uint8 array over ``buf`` (no copy)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def checksum(buf: Bytes | np.ndarray) -> int:
    """xxh3-64 of a buffer."""
    return xxhash.xxh3_64_intdigest(buf.data if isinstance(buf, np.ndarray) else buf)


def copy_sum(dst: np.ndarray, src: np.ndarray, over: Literal["dst", "src"] = "dst") -> int:
    """Copy ``src`` into ``dst`` (uint8 arrays of one length) and return the xxh3-64 of
    the bytes ``over`` names, taken chunk by chunk right after each chunk's copy."""
    n = len(src)
    if len(dst) != n:
        raise ValueError(f"copy of {n} bytes into {len(dst)}")
    side = dst if over == "dst" else src
    if n <= SMALL_COPY:
        d = dst.data
        d[:] = src.data
        return xxhash.xxh3_64_intdigest(d if over == "dst" else src.data)
    if n <= SMALL:
        np.copyto(dst, src)
        return xxhash.xxh3_64_intdigest(side.data)
    h = xxhash.xxh3_64()
    for i in range(0, n, CHUNK):
        j = min(i + CHUNK, n)
        np.copyto(dst[i:j], src[i:j])
        h.update(side[i:j].data)
    return h.intdigest()


def gather_sum(dst: np.ndarray, parts: Sequence[Bytes]) -> int:
    """Copy ``parts`` back to back into ``dst`` (exactly their total length) and return
    the xxh3-64 of the parts (the writer's source), taken as each part is copied."""
    if len(parts) == 1:
        p = parts[0]
        if type(p) is memoryview and p.nbytes <= SMALL_COPY and p.nbytes == len(dst):
            if p.format != "B" or p.ndim != 1:
                p = p.cast("B")  # raises for a non-contiguous view, as numpy would
            dst.data[:] = p
            return xxhash.xxh3_64_intdigest(p)
        return copy_sum(dst, as_array(p), "src")
    h = xxhash.xxh3_64()
    out = dst.data
    at = 0
    for p in parts:
        if isinstance(p, memoryview) and p.nbytes <= SMALL and p.c_contiguous:
            # a small part: one slice assignment (a numpy view and copyto per part cost
            # 4x more for 64 parts of 16 KiB) and its hash over the caller's own bytes
            k = p.nbytes
            out[at : at + k] = p.cast("B") if p.format != "B" or p.ndim != 1 else p
            h.update(p)
            at += k
            continue
        a = as_array(p)
        k = len(a)
        for i in range(0, k, CHUNK):
            j = min(i + CHUNK, k)
            np.copyto(dst[at + i : at + j], a[i:j])
            h.update(a[i:j].data)
        at += k
    if at != len(dst):
        raise ValueError(f"parts of {at} bytes into {len(dst)}")
    return h.intdigest()


def scatter_sum(parts: Sequence[memoryview], src: np.ndarray) -> int:
    """Copy ``src`` into ``parts`` in order (exactly their total length) and return the
    xxh3-64 of what landed in the parts (the reader's own buffers)."""
    h = xxhash.xxh3_64()
    at = 0
    for p in parts:
        a = as_array(p)
        k = len(a)
        for i in range(0, k, CHUNK):
            j = min(i + CHUNK, k)
            np.copyto(a[i:j], src[at + i : at + j])
            h.update(a[i:j].data)
        at += k
    if at != len(src):
        raise ValueError(f"{len(src)} bytes into parts of {at}")
    return h.intdigest()


@dataclass(slots=True)
class GetResult:
    """Per hash: found, and (when the caller gave no buffer) the bytes."""

    found: list[bool]
    values: list[bytearray | None]
    bytes_received: int


class Landing:
    """One get answer's hits, landed and verified: the receive-and-verify routine every
    transport's get shares (tcp://, ucx://, and shm:// for blocks sent inline).

    The transport walks the answer's entries; for hit ``j`` of ``size`` bytes,
    :meth:`dest` says where it lands: a new buffer when the caller gave none (kept in
    ``values``), the caller's buffer ``buffers[j]`` when its size is the hit's, or
    None when it is not (the transport receives and drops the bytes: a miss). Once the
    bytes are in, :meth:`check` (on the copy pool for big blocks, given their size)
    verifies them there against the block's xxh3-64: a mismatch is a miss, and
    a buffer made for it is dropped. :meth:`result` waits for the checks still running.

    ``found`` and ``values`` may be the caller's lists, of which this answer fills
    positions ``first`` onwards (a get cut into pieces).
    """

    __slots__ = ("_buffers", "_first", "_later", "found", "total", "values")

    def __init__(
        self,
        buffers: Sequence[wire.Block] | None,
        n: int,
        found: list[bool] | None = None,
        values: list[bytearray | None] | None = None,
        first: int = 0,
    ) -> None:
        self._buffers = buffers
        self._first = first
        self._later: list[Future[None]] = []
        self.found = found if found is not None else [False] * n
        self.values: list[bytearray | None] = values if values is not None else [None] * n
        self.total = 0  # payload bytes of the hits

    def dest(self, j: int, size: int) -> wire.Block | None:
        """Where hit ``j`` of ``size`` bytes lands; None: receive and drop it."""
        self.total += size
        if self._buffers is None:
            buf = self.values[self._first + j] = bytearray(size)
            return buf
        d = self._buffers[self._first + j]
        if type(d) is memoryview:  # the common case, without a call
            return d if d.nbytes == size else None
        return d if wire.block_size(d) == size else None

    def check(self, j: int, block: wire.Block, checksum: int, size: int = 0) -> None:
        """Hit ``j`` landed in ``block``: found when its bytes there match ``checksum``
        (read ``found`` after :meth:`result`). ``size`` (the hit's, when known): a big
        block is checked on the copy pool, the caller's thread going on with the next one
        meanwhile."""
        if size >= VERIFY_LATER:
            self._later.append(later(lambda: self.check(j, block, checksum)))
            return
        if isinstance(block, list):
            ok = wire.block_checksum(block) == checksum
        else:
            ok = xxhash.xxh3_64_intdigest(block) == checksum
        self.found[self._first + j] = ok
        if not ok:
            self.values[self._first + j] = None

    def result(self) -> GetResult:
        for f in self._later:
            f.result()
        self._later = []
        return GetResult(self.found, self.values, self.total)


__all__ = [
    "CHUNK",
    "GetResult",
    "Landing",
    "as_array",
    "checksum",
    "copy_sum",
    "gather_sum",
    "scatter_sum",
]
