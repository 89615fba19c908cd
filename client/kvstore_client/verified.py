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
from typing import Literal, TypeVar

import numpy as np
import xxhash

# Big enough that per-chunk Python costs vanish, small enough that a chunk copied is
# still in L2 when it is hashed.
CHUNK = 256 << 10
# Below this a block is copied and hashed in one pass each (it stays in cache anyway).
SMALL = 2 * CHUNK

Bytes = bytes | bytearray | memoryview
T = TypeVar("T")

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
    n = threads()
    if nbytes < PARALLEL_MIN or n <= 1 or len(jobs) < 2:
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
        return copy_sum(dst, as_array(parts[0]), "src")
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


__all__ = ["CHUNK", "as_array", "checksum", "copy_sum", "gather_sum", "scatter_sum"]
