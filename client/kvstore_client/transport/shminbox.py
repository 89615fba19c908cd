"""Same-host writes: this client's inbox at a worker, and the puts that go through it.

A worker hands each same-host client an *inbox* (see :mod:`.shm`): memory that only
this client and the worker share, mapped read-write here. A put copies each block into
the inbox, taking its xxh3-64 over the caller's bytes as it copies
(:func:`kvstore_client.verified.gather_sum`), then sends one PUT_INBOX frame naming
where each block lies and its checksum. The worker reserves slots, copies the blocks
into its arena and publishes only those whose copy matches the checksum: a block whose
inbox bytes changed meanwhile, or whose checksum was wrong, is refused (PUT_CORRUPT)
and its key stays absent. One round trip per piece, and no slot is held by this client
between frames. A batch is cut into pieces of at most a quarter of the inbox, all sent
before the first answer is read, so the worker copies piece k while this client copies
piece k+1.

:func:`reserve` hands out inbox regions for a GPU's DMA to fill (see :mod:`.pins`);
the lease's commit takes the checksums over the inbox then and sends the PUT_INBOX.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from .. import verified, wire
from ..errors import Unavailable
from ..verified import checksum, gather_sum
from .tcp import TcpConnection

PAGE = 4096
# Blocks start this far past a 4 KiB boundary: arena slots start on one, and a copy
# whose source and destination share their address modulo 4 KiB ran 2.5x slower here
# (4K aliasing: 1.4 against 3.6 GiB/s for 1 MiB copies into the arena).
SKEW = 256
# Smaller put frames cost more per byte (a round trip each, ~50-100 us) than they gain
# in overlap.
MIN_PIECE = 1 << 20


def _span(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of blocks of ``sizes`` laid out from a page boundary (each at SKEW past
    one), and the bytes the run takes."""
    offs: list[int] = []
    at = 0
    for n in sizes:
        offs.append(at + SKEW)
        at += -(-(SKEW + n) // PAGE) * PAGE
    return offs, at


class Inbox:
    """This client's inbox at one worker: the mapping (``array``, ``view``) and a
    first-fit allocator of page-aligned regions over it. Thread-safe. ``id`` and
    ``view`` make it a :class:`~.pins.Mapped` (to register it for DMA once)."""

    def __init__(self, fd: int, size: int, arena_id: str) -> None:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self.id = f"{arena_id}/inbox"
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.view = memoryview(mm)
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, size - size % PAGE)]

    def piece(self, total: int) -> int:
        """Bytes of blocks one put frame of a ``total``-byte batch carries at most: a
        quarter of the batch (several frames in flight, so the worker copies one while
        this client copies the next), at least MIN_PIECE, at most a quarter of the inbox."""
        return max(MIN_PIECE, min(self.size // 4, -(-total // 4)))

    def take(self, nbytes: int, timeout: float = 0.0) -> int:
        """The start of a free region of ``nbytes`` (a multiple of PAGE), waiting up to
        ``timeout`` seconds for other puts to give some back; -1 if none."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, (a, k) in enumerate(self._free):
                    if k >= nbytes:
                        if k == nbytes:
                            del self._free[i]
                        else:
                            self._free[i] = (a + nbytes, k - nbytes)
                        return a
                left = deadline - time.monotonic()
                if left <= 0:
                    return -1
                self._cond.wait(left)

    def give(self, start: int, nbytes: int) -> None:
        """Give back a region :meth:`take` returned."""
        with self._cond:
            free = self._free
            free.append((start, nbytes))
            free.sort()
            merged: list[tuple[int, int]] = []
            for a, k in free:
                if merged and merged[-1][0] + merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + k)
                else:
                    merged.append((a, k))
            self._free = merged
            self._cond.notify_all()

    def close(self) -> None:
        """Drop the references; the mapping goes when no view of it is left."""
        self.array = np.empty(0, dtype=np.uint8)
        self.view = memoryview(b"")


class PartialPut(Unavailable):
    """The inbox went away under a put (this client's mapping was closed, so the
    worker dropped the inbox; or the worker restarted): the statuses of the frames the
    worker answered, and the blocks it never took (``left``: send them another way).
    The connection is done (the pool closes it)."""

    def __init__(self, status: bytearray, left: list[int], cause: Exception) -> None:
        super().__init__(f"the inbox went away under a put: {cause}")
        self.status = status
        self.left = left


def _frame(
    conn: TcpConnection,
    ns: bytes,
    hashes: Sequence[bytes],
    sizes: Sequence[int],
    sums: Sequence[int],
    offs: Sequence[int],
    flags: int,
) -> int:
    """Send one PUT_INBOX; returns its request id (answer read later, in order)."""
    n = len(hashes)
    entries = bytearray(n * wire.INBOX_ENTRY.size)
    for j in range(n):
        wire.INBOX_ENTRY.pack_into(
            entries, j * wire.INBOX_ENTRY.size, hashes[j], sizes[j], sums[j], offs[j]
        )
    req = conn.next_req()
    head = wire.encode_request_header(wire.OP_PUT_INBOX, ns, n, req, flags)
    wire.send_buffers(conn.sock, [head, entries])
    return req


def _answer(conn: TcpConnection, req: int, n: int, tag: int) -> bytes:
    h = conn.answer(wire.OP_PUT_INBOX, req)
    if h.ns_len != tag or h.count != n:
        conn.close()  # the body is unread: this connection is done
        raise Unavailable("the worker's arena changed (restarted?) under a put")
    return bytes(wire.recv_exact(conn.sock, n))


def put(
    conn: TcpConnection,
    inbox: Inbox,
    tag: int,
    ns: bytes,
    hashes: Sequence[bytes],
    values: Sequence[wire.Block],
    skip: Sequence[bool],
    flags: int = 0,
    wait: float = 1.0,
) -> tuple[bytearray, list[int]]:
    """Put ``values`` through ``inbox`` (``tag``: the worker's arena tag; ``skip[i]``:
    the index says block i is present: no copy, PUT_PRESENT). Returns (a wire.PUT_*
    status per block, the blocks that found no room in the inbox within ``wait``
    seconds: the caller sends those another way)."""
    n = len(hashes)
    sizes = [wire.block_size(v) for v in values]
    # Not stored until an answer says so (0 would read as PUT_STORED).
    status = bytearray([wire.PUT_FULL]) * n
    left: list[int] = []
    dst = inbox.array  # held for the whole call: a close() meanwhile cannot unmap it
    if not len(dst):  # closed before this call: nothing sent, all of it another way
        for i in range(n):
            if skip[i]:
                status[i] = wire.PUT_PRESENT
        raise PartialPut(status, [i for i in range(n) if not skip[i]], Unavailable("closed"))
    # (request id, region start, region bytes, the batch indices it carries)
    flight: deque[tuple[int, int, int, list[int]]] = deque()

    def settle() -> None:
        req, start, nbytes, idx = flight[0]
        got = _answer(conn, req, len(idx), tag)  # raising: still in flight, see below
        flight.popleft()
        inbox.give(start, nbytes)
        for i, s in zip(idx, got, strict=True):
            status[i] = s

    runs = wire.runs(sizes, inbox.piece(sum(sizes)))
    sent = 0
    try:
        for a, b in runs:
            idx = [i for i in range(a, b) if not skip[i]]
            for i in range(a, b):
                if skip[i]:
                    status[i] = wire.PUT_PRESENT
            if not idx:
                sent = b
                continue
            offs, nbytes = _span([sizes[i] for i in idx])
            start = inbox.take(nbytes)
            while start < 0 and flight:
                settle()
                start = inbox.take(nbytes)
            if start < 0:  # other puts of this client hold the inbox
                start = inbox.take(nbytes, wait)
            if start < 0:
                left += idx
                sent = b
                continue
            try:
                # Copied over the copy pool when the piece is big (kvstore_client.verified).
                jobs = [
                    partial(gather_sum, dst[start + o : start + o + sizes[i]], _parts(values[i]))
                    for i, o in zip(idx, offs, strict=True)
                ]
                sums = verified.run(jobs, nbytes)
                req = _frame(
                    conn,
                    ns,
                    [hashes[i] for i in idx],
                    [sizes[i] for i in idx],
                    sums,
                    [start + o for o in offs],
                    flags,
                )
            except BaseException:
                inbox.give(start, nbytes)
                raise
            flight.append((req, start, nbytes, idx))
            sent = b
        while flight:
            settle()
    except Unavailable as e:
        # The worker answered this frame UNAVAILABLE (no inbox any more) and closed the
        # connection: it took none of the frames from this one on.
        rest = [i for _, _, _, idx in flight for i in idx]
        rest += [i for i in range(sent, n) if not skip[i]]
        raise PartialPut(status, sorted(left + rest), e) from e
    finally:
        for _, start, nbytes, _ in flight:  # an error left answers unread: the
            inbox.give(start, nbytes)  # connection is closed by the caller
    return status, left


def _parts(v: wire.Block) -> Sequence[wire.Buffer]:
    return v if isinstance(v, list) else [v]


def reserve(
    inbox: Inbox, sizes: Sequence[int], skip: Sequence[bool]
) -> tuple[list[memoryview | None], Callable[[], None], list[int]]:
    """Regions of ``inbox`` for the blocks not ``skip``ped, to be filled by the caller
    (a GPU's DMA): (a writable view per block or None, the give-back, their offsets).
    None views everywhere when the inbox has no room now."""
    n = len(sizes)
    idx = [i for i in range(n) if not skip[i]]
    views: list[memoryview | None] = [None] * n
    offsets = [0] * n
    if not idx:
        return views, lambda: None, offsets
    offs, nbytes = _span([sizes[i] for i in idx])
    start = inbox.take(nbytes)
    if start < 0:
        return views, lambda: None, offsets
    mv = inbox.view
    for i, o in zip(idx, offs, strict=True):
        views[i] = mv[start + o : start + o + sizes[i]]
        offsets[i] = start + o
    done = threading.Event()

    def give() -> None:
        if not done.is_set():
            done.set()
            inbox.give(start, nbytes)

    return views, give, offsets


def commit(
    conn: TcpConnection,
    tag: int,
    ns: bytes,
    hashes: Sequence[bytes],
    views: Sequence[memoryview],
    offsets: Sequence[int],
    flags: int = 0,
) -> bytes:
    """Publish reserved regions the caller filled: checksums taken over them now, one
    PUT_INBOX; a wire.PUT_* status per block."""
    sums = [checksum(v) for v in views]
    req = _frame(conn, ns, hashes, [v.nbytes for v in views], sums, offsets, flags)
    return _answer(conn, req, len(hashes), tag)


__all__ = ["Inbox", "commit", "put", "reserve"]
