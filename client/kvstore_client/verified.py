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
run these at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import xxhash

# Big enough that per-chunk Python costs vanish, small enough that a chunk copied is
# still in L2 when it is hashed.
CHUNK = 256 << 10
# Below this a block is copied and hashed in one pass each (it stays in cache anyway).
SMALL = 2 * CHUNK

Bytes = bytes | bytearray | memoryview


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
    at = 0
    for p in parts:
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
