"""Blocks pinned in place in a same-host worker's arena: the arena as a copy source.

A GPU connector copies a hit straight from the arena slot into its KV cache by DMA
(the mapping registered with ``cudaHostRegister``), with no host copy. For that the
slot must stay put until the copy is done, so a pin is a lease:
:func:`pin` sends one GET_LOC on a connection it takes out of the pool, verifies
each block's xxh3-64 over the slot itself (a mismatch is a miss), and returns the
slot views; :meth:`ArenaPins.release` sends the RELEASE on that same connection and
gives it back. Until then the worker never frees or reuses those slots; a client
that dies, or closes its Client with a lease unreleased, closes the connection,
which releases everything it held. Blocks the worker
holds outside the arena (SSD hits) come inline: their views are private copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from .. import wire
from ..errors import KVStoreError, Unavailable, from_transport_error

if TYPE_CHECKING:
    from .shm import ShmArena
    from .tcp import TcpConnection, TcpPool


@dataclass(slots=True)
class ArenaPins:
    """Per block, a view of its verified bytes (``None``: not pinned here, read it
    another way), held until :meth:`release` (idempotent, thread-safe). The views
    are only valid until then; never write through them. ``arenas``: the mappings
    the views point into (to register them for DMA once)."""

    views: list[memoryview | None]
    arenas: list[ShmArena] = field(default_factory=list)
    _releases: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def count(self) -> int:
        return sum(v is not None for v in self.views)

    def release(self) -> None:
        with self._lock:
            todo, self._releases = self._releases, []
        for r in todo:
            r()

    def __enter__(self) -> ArenaPins:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def pin(
    pool: TcpPool, arena: ShmArena, timeout: float, ns: bytes, hashes: Sequence[bytes]
) -> ArenaPins:
    """Pin ``hashes`` in ``arena`` (one GET_LOC). Raises a PeerError when the worker
    cannot be reached or answers wrongly (the connection is then closed, which
    releases what it held)."""
    conn = pool.lease(timeout)
    conn.sock.settimeout(max(timeout, 0.001))
    try:
        views, req = _locate(conn, arena, ns, hashes)
    except (KVStoreError, OSError) as e:
        pool.end_lease(conn, keep=False)
        err = from_transport_error(e, f"{pool.host}:{pool.port}")
        if err is e:
            raise
        raise err from e
    done = threading.Event()

    def release() -> None:
        if done.is_set():
            return
        done.set()
        try:
            wire.send_buffers(conn.sock, [wire.encode_request_header(wire.OP_RELEASE, ns, 0, req)])
        except OSError:
            pool.end_lease(conn, keep=False)
            return
        pool.end_lease(conn, keep=True)

    return ArenaPins(views, [arena], [release])


def _locate(
    conn: TcpConnection, arena: ShmArena, ns: bytes, hashes: Sequence[bytes]
) -> tuple[list[memoryview | None], int]:
    sock = conn.sock
    conn._req += 1
    req = conn._req
    head = wire.encode_request_header(wire.OP_GET_LOC, ns, len(hashes), req)
    wire.send_buffers(sock, [head, b"".join(hashes)])
    h = conn._answer(wire.OP_GET_LOC, req)
    arena.check(h.ns_len)
    if h.count != len(hashes):
        raise Unavailable(f"{h.count} locations for {len(hashes)} hashes")
    meta = wire.recv_exact(sock, h.count * wire.LOC_ENTRY.size)
    entries = list(wire.LOC_ENTRY.iter_unpack(meta))
    views: list[memoryview | None] = [None] * len(hashes)
    digest = xxhash.xxh3_64_intdigest
    for i, (status, size, checksum, _) in enumerate(entries):  # inline payloads first
        if status == wire.LOC_INLINE:
            buf = bytearray(size)
            wire.recv_into_exact(sock, memoryview(buf))
            if digest(buf) == checksum:
                views[i] = memoryview(buf)
    mv = arena.view
    for i, (status, size, checksum, off) in enumerate(entries):
        if status == wire.LOC_ARENA and off + size <= len(mv):
            slot = mv[off : off + size]
            if digest(slot) == checksum:
                views[i] = slot
    return views, req


@dataclass(slots=True)
class ArenaSlots:
    """Slots reserved in same-host workers' arenas for blocks to be written into
    them directly (a GPU's DMA). Per block: ``views[i]``, the slot to fill, or None
    (not reserved: ``present[i]`` when the store already holds it, else no room or
    not a same-host worker: write it another way). :meth:`commit` publishes the
    slots filled, with checksums taken over the slots then; until it (or
    :meth:`abort`), nobody can read them and the worker keeps them reserved.
    ``arenas``: the mappings the views point into (to register them for DMA)."""

    views: list[memoryview | None]
    present: list[bool]
    arenas: list[ShmArena] = field(default_factory=list)
    _commits: list[tuple[list[int], Callable[[list[bool]], list[bool]]]] = field(
        default_factory=list
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def count(self) -> int:
        return sum(v is not None for v in self.views)

    def commit(self, written: Sequence[bool]) -> list[bool]:
        """Publish the reserved slots whose ``written[i]`` is True (the others are
        dropped); True per block stored now. Once only; later calls return Falses."""
        out = [False] * len(self.views)
        with self._lock:
            todo, self._commits = self._commits, []
        for idx, commit in todo:
            for i, ok in zip(idx, commit([bool(written[i]) for i in idx]), strict=True):
                out[i] = ok
        return out

    def abort(self) -> None:
        """Drop every reservation (nothing is published)."""
        self.commit([False] * len(self.views))


def reserve(
    pool: TcpPool,
    arena: ShmArena,
    timeout: float,
    ns: bytes,
    hashes: Sequence[bytes],
    sizes: Sequence[int],
    flags: int = 0,
) -> ArenaSlots:
    """Reserve slots for ``hashes`` (one PUT_LOC with FLAG_LATE_SUM and ``flags``,
    e.g. FLAG_SESSION, on a leased connection). Raises a PeerError when the worker
    cannot be reached or answers wrongly (the connection is closed, which drops
    what it reserved)."""
    conn = pool.lease(timeout)
    conn.sock.settimeout(max(timeout, 0.001))
    n = len(hashes)
    try:
        conn._req += 1
        req = conn._req
        entries = bytearray(n * wire.PUT_ENTRY.size)
        for j in range(n):
            wire.PUT_ENTRY.pack_into(entries, j * wire.PUT_ENTRY.size, hashes[j], sizes[j], 0)
        head = wire.encode_request_header(wire.OP_PUT_LOC, ns, n, req, wire.FLAG_LATE_SUM | flags)
        wire.send_buffers(conn.sock, [head, entries])
        h = conn._answer(wire.OP_PUT_LOC, req)
        arena.check(h.ns_len)
        if h.count != n:
            raise Unavailable(f"{h.count} slots for {n} blocks")
        locs = list(wire.PUT_LOC_ENTRY.iter_unpack(wire.recv_exact(conn.sock, n * 16)))
    except (KVStoreError, OSError) as e:
        pool.end_lease(conn, keep=False)
        err = from_transport_error(e, f"{pool.host}:{pool.port}")
        if err is e:
            raise
        raise err from e
    mv = arena.view
    views: list[memoryview | None] = [None] * n
    for j, (status, off) in enumerate(locs):
        if status == wire.PUT_LOC_SLOT and off + sizes[j] <= len(mv):
            views[j] = mv[off : off + sizes[j]]
    present = [status == wire.PUT_PRESENT for status, _ in locs]

    def commit(written: list[bool]) -> list[bool]:
        flags = bytes(1 if w and v is not None else 0 for w, v in zip(written, views, strict=True))
        sums = bytearray(n * wire.SUMS.size)
        for j, v in enumerate(views):
            if flags[j] and v is not None:
                wire.SUMS.pack_into(sums, j * wire.SUMS.size, xxhash.xxh3_64_intdigest(v))
        try:
            head = wire.encode_request_header(wire.OP_PUT_COMMIT, ns, n, req, wire.FLAG_LATE_SUM)
            wire.send_buffers(conn.sock, [head, flags, sums])
            conn._answer(wire.OP_PUT_COMMIT, req)
            status = wire.recv_exact(conn.sock, n)
        except (KVStoreError, OSError):
            pool.end_lease(conn, keep=False)  # closing drops the reservations
            return [False] * n
        pool.end_lease(conn, keep=True)
        return [s == wire.PUT_STORED for s in status]

    out = ArenaSlots(views, present, [arena])
    out._commits.append((list(range(n)), commit))
    return out
