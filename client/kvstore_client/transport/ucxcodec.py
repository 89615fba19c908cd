"""The ucx:// frame codec that needs no UCX: part tables (wire.FLAG_PARTS) and packed
payloads (wire.FLAG_PACKED). Shared by the client half (:mod:`.ucx`) and the worker's
frame core and server half, so each format is defined once.

Packed payloads travel as a stream: the payloads back to back (``total`` bytes, known
to both sides from the frame's entries), cut into messages of ``PACK_CHUNK`` bytes
(the last one shorter; a stream of at most ``PACK_CHUNK`` bytes is one message). A
block may straddle two messages. Each side copies through at most ``PACK_WINDOW``
chunk buffers per frame at a time (one filled or drained while the other is on the
wire), leased from its process's :class:`StagingPool`, which bounds them all together
and gives them back to the system once idle.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import struct
from collections.abc import Iterable, Sequence

from .. import wire
from ..errors import ProtocolError

Buffer = bytes | bytearray | memoryview
ERROR_MAX = 4096  # bytes of an error message a peer may send

MAX_PART_ENTRIES = 1 << 20  # parts in one frame


def part_tables(blocks: Sequence[wire.Block | None]) -> tuple[bytes, bytes]:
    """The two part tables of a FLAG_PARTS frame: a u32 part count per block (ends the
    body), and the u32 size of every part (the message after the body). ``None`` (no
    destination) and a whole buffer count as one part."""
    counts = bytearray(len(blocks) * 4)
    sizes: list[int] = []
    for i, b in enumerate(blocks):
        if isinstance(b, list):
            wire.PART_COUNT.pack_into(counts, 4 * i, len(b))
            sizes.extend(p.nbytes for p in b)
        else:
            wire.PART_COUNT.pack_into(counts, 4 * i, 1)
            sizes.append(0 if b is None else wire.block_size(b))
    return bytes(counts), struct.pack(f"<{len(sizes)}I", *sizes)


def read_part_counts(raw: memoryview | bytes) -> list[int]:
    """Per block its part count (the tail of a FLAG_PARTS body); ProtocolError when a
    count is 0, above wire.MAX_PARTS, or the frame has too many parts in all."""
    counts = list(struct.unpack(f"<{len(raw) // 4}I", raw))
    if any(c < 1 or c > wire.MAX_PARTS for c in counts) or sum(counts) > MAX_PART_ENTRIES:
        raise ProtocolError("bad part counts in a FLAG_PARTS frame")
    return counts


def split_sizes(counts: Sequence[int], raw: bytes | bytearray) -> list[list[int]]:
    """Per block the sizes of its parts, from the part-size table."""
    sizes = struct.unpack(f"<{len(raw) // 4}I", raw)
    out: list[list[int]] = []
    at = 0
    for c in counts:
        out.append(list(sizes[at : at + c]))
        at += c
    return out


def slices(view: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """``view`` cut into consecutive slices of ``sizes`` (which add up to its size)."""
    out: list[memoryview] = []
    at = 0
    for n in sizes:
        out.append(view[at : at + n])
        at += n
    return out


PACK_BELOW = 256 << 10  # payload messages smaller than this on average go packed


def packs(blocks: Sequence[wire.Block]) -> bool:
    """Whether a frame's payloads go packed into one message (wire.FLAG_PACKED): more
    than one message, at most wire.MAX_PACKED bytes, averaging under PACK_BELOW. Each
    UCX message pays a rendezvous and the event loop's hand-offs (hundreds of
    microseconds over tcp), a copy of 64 KiB a few."""
    sizes = [b.nbytes if isinstance(b, memoryview) else len(b) for b in wire.flat_buffers(blocks)]
    messages = sum(1 for n in sizes if n)
    total = sum(sizes)
    return messages > 1 and total <= wire.MAX_PACKED and total < PACK_BELOW * messages


def copy_into(block: wire.Block, src: memoryview) -> None:
    """Copy ``src`` into ``block`` (one buffer, or its parts in order; sizes match)."""
    at = 0
    for part in wire.block_parts(block):
        view = memoryview(part).cast("B")
        view[:] = src[at : at + view.nbytes]
        at += view.nbytes


PACK_CHUNK = 4 << 20  # bytes of one message of a packed stream (the last one: the rest)
PACK_WINDOW = 2  # chunk buffers one frame copies through at once
STAGING_IDLE_S = 2.0  # a pool with nothing leased for this long gives its buffers back


def chunk_sizes(total: int) -> list[int]:
    """The message sizes of a packed stream of ``total`` bytes."""
    full, rest = divmod(total, PACK_CHUNK)
    return [PACK_CHUNK] * full + ([rest] if rest else [])


class Packer:
    """Copies consecutive bytes of ``sources`` (back to back) into chunk buffers."""

    __slots__ = ("_at", "_i", "_views")

    def __init__(self, sources: Iterable[Buffer]) -> None:
        self._views = [v for v in (memoryview(b).cast("B") for b in sources) if v.nbytes]
        self._i = 0  # the source being copied
        self._at = 0  # bytes of it copied

    def fill(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next ``len(dest)`` bytes (ValueError past the end)."""
        done = 0
        while done < len(dest):
            if self._i >= len(self._views):
                raise ValueError("the packed stream is shorter than its chunks")
            v = self._views[self._i]
            n = min(v.nbytes - self._at, len(dest) - done)
            dest[done : done + n] = v[self._at : self._at + n]
            done += n
            self._at += n
            if self._at == v.nbytes:
                self._i += 1
                self._at = 0


class Unpacker:
    """Copies a packed stream, chunk by chunk, into per-block destinations.

    ``blocks``: per block its buffers (parts, in order) or None when its ``size``
    bytes are to be skipped; ``sizes``: each block's bytes (a destination's buffers
    add up to it). :meth:`begin`, then :meth:`feed` per chunk, return the blocks
    completed, in order (every block exactly once over a whole stream)."""

    __slots__ = ("_at", "_blocks", "_i", "_left", "_part", "_sizes")

    def __init__(self, blocks: Sequence[Sequence[memoryview] | None], sizes: Sequence[int]) -> None:
        self._blocks = blocks
        self._sizes = sizes
        self._i = 0  # the block being filled
        self._part = 0  # its buffer being filled
        self._at = 0  # bytes of that buffer filled
        self._left = sizes[0] if sizes else 0  # bytes of the block still to come

    def begin(self) -> list[int]:
        """The leading blocks complete before any byte arrives (empty ones)."""
        return self._skip_empty()

    def _skip_empty(self) -> list[int]:
        done: list[int] = []
        while self._i < len(self._sizes) and self._left == 0:
            done.append(self._i)
            self._i += 1
            self._part = self._at = 0
            self._left = self._sizes[self._i] if self._i < len(self._sizes) else 0
        return done

    def feed(self, chunk: memoryview) -> list[int]:
        """Copy one chunk; the indices of the blocks it completed (ValueError when the
        stream is longer than the blocks)."""
        done: list[int] = []
        pos = 0
        while pos < len(chunk):
            if self._i >= len(self._sizes):
                raise ValueError("the packed stream is longer than its blocks")
            dest = self._blocks[self._i]
            if dest is None:  # skipped: consume the block's bytes in this chunk
                n = min(self._left, len(chunk) - pos)
            else:
                buf = dest[self._part]
                n = min(buf.nbytes - self._at, len(chunk) - pos)
                buf[self._at : self._at + n] = chunk[pos : pos + n]
                self._at += n
                if self._at == buf.nbytes:
                    self._part += 1
                    self._at = 0
            pos += n
            self._left -= n
            if self._left == 0:
                done.extend(self._skip_empty())
        return done

    @property
    def complete(self) -> bool:
        return self._i >= len(self._sizes)


def _chunk_buffer() -> mmap.mmap:
    """A PACK_CHUNK buffer of private anonymous memory (unmapped when dropped)."""
    return mmap.mmap(-1, PACK_CHUNK, flags=mmap.MAP_PRIVATE)


class StagingPool:
    """Chunk buffers for packed streams, bounded for the whole process (or server).

    At most ``limit_bytes // PACK_CHUNK`` buffers exist at once (at least one);
    :meth:`take` waits for the first buffer a frame needs and takes more only when
    they are free, so every frame makes progress with one. Buffers come back with
    :meth:`give` and are reused; once nothing has been leased for ``idle_s`` seconds
    the pool drops them all (anonymous memory maps: their pages go back to the system
    at once, whatever the allocator would keep). A frame that failed gives its buffers
    back with ``reuse=False``: a cancelled UCX request may still touch them, so they
    are not handed to another frame. Used on one event loop (the UCX runtime's).
    """

    def __init__(self, limit_bytes: int, *, idle_s: float = STAGING_IDLE_S) -> None:
        self.capacity = max(1, limit_bytes // PACK_CHUNK)
        self.idle_s = idle_s
        self.leased = 0
        self.peak = 0  # most buffers leased at once
        self.waits = 0  # takes that had to wait for a buffer
        self._free: list[mmap.mmap] = []
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._trim: asyncio.TimerHandle | None = None  # at most one, re-armed when it fires
        self._last = 0.0  # loop time of the last give

    @property
    def resident_bytes(self) -> int:
        """Bytes of the buffers this pool holds (leased or kept for reuse)."""
        return (self.leased + len(self._free)) * PACK_CHUNK

    async def take(self, want: int) -> list[mmap.mmap]:
        """Between 1 and ``want`` buffers of PACK_CHUNK bytes: waits for the first."""
        if self.leased >= self.capacity:
            self.waits += 1
        while self.leased >= self.capacity:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._wake(1)  # pass on the wake-up it got
                raise
        n = max(1, min(want, self.capacity - self.leased))
        self.leased += n
        self.peak = max(self.peak, self.leased)
        return [self._free.pop() if self._free else _chunk_buffer() for _ in range(n)]

    def give(self, bufs: Sequence[mmap.mmap], *, reuse: bool = True) -> None:
        """Return buffers from :meth:`take` (``reuse=False``: never hand them out again)."""
        self.leased -= len(bufs)
        if reuse:
            self._free.extend(bufs)
        self._wake(len(bufs))
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if self._free and self._trim is None:
            self._trim = loop.call_later(self.idle_s, self._drop)

    def _wake(self, n: int) -> None:
        while n and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    def _drop(self) -> None:
        """Drop the kept buffers once nothing was leased or given for ``idle_s``."""
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._last
        if not self.leased and idle >= self.idle_s:
            self._trim = None
            self._free.clear()
        else:  # in use since: look again when it may have been idle long enough
            self._trim = loop.call_later(max(self.idle_s - idle, 0.01), self._drop)


__all__ = [
    "ERROR_MAX",
    "MAX_PART_ENTRIES",
    "PACK_BELOW",
    "PACK_CHUNK",
    "PACK_WINDOW",
    "Packer",
    "StagingPool",
    "Unpacker",
    "chunk_sizes",
    "copy_into",
    "packs",
    "part_tables",
    "read_part_counts",
    "slices",
    "split_sizes",
]
