"""Client half of the shm:// transport: map a same-host worker's arena and copy directly.

The worker advertises ``shm://SOCKET?host=HOSTID&arena=ID&size=N``: a Unix socket
(mode 0600) that hands out the arena's descriptor (a memfd). A client on the same
host (same host id) that may connect receives the descriptor with SCM_RIGHTS and
maps it once, after checking that the worker's message names the same arena id and
size as the map, and that the descriptor is a regular file of that size. The client
never opens a path the map names: a forged or stale entry only ever falls back to
tcp://. Every LOC answer carries the arena's tag; a mismatch (the worker restarted
behind the same address) is an error for that call and the mapping is dropped.

With the arena the worker hands over its same-host index (read-only) and a hazard
page of this client's own (:mod:`.shmindex`, :mod:`.shmlocal`): lookups, gets and pins
of the blocks the index holds need no round trip at all; the hand-over connection
stays open so each side learns when the other is gone. What the index cannot answer
(SSD blocks, full buckets, entries that changed under the probe) goes the socket way:
a get is one GET_LOC round trip for the locations, one numpy copy per block out
of the mapping into the caller's buffer, whose bytes are then checked against the
block's xxh3-64 (a mismatch is a miss), and a one-way RELEASE sent as soon as the
copies are done, before the call returns: a client stopped right after a read (a
debugger, a checkpoint, a GC pause) holds no pins. A block read into several parts is copied
out of the mapping once, into a per-thread bounce buffer, verified there and scattered
from cache. A single same-host worker's get runs on the caller's thread. A put is a
PUT_LOC round trip for reserved slots, copies into them (each slot's xxh3-64 taken
right after its copy), and a PUT_COMMIT round trip.
Control frames travel over the tcp:// connection (codec in kvstore_client.wire).
"""

from __future__ import annotations

import mmap
import os
import socket
import stat
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from .. import wire
from ..errors import KVStoreError, Unavailable, from_transport_error
from . import pins, shmindex, shmlocal
from .tcp import GetResult, TcpConnection, TcpPool, TcpTransfer

SOCKET_PREFIX = "kvstore-"


def host_id() -> str:
    """This machine, boot and network namespace: equal ids mean the same kernel (hence
    shared /dev/shm) and the same network, so a worker that is cut off from this
    process's network (another namespace: another host, as far as the cluster can
    tell) is never read through shared memory behind the cut."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{socket.gethostname()}/{boot}/{net}"


def shm_url(path: str, arena_id: str = "", size: int = 0) -> str:
    """The endpoint a worker advertises for its hand-over socket at ``path``."""
    q = urllib.parse.urlencode({"host": host_id(), "arena": arena_id, "size": size})
    return f"shm://{path}?{q}"


@dataclass(frozen=True, slots=True)
class ShmEndpoint:
    path: str
    host: str
    arena: str
    size: int


def parse_shm_url(url: str) -> ShmEndpoint:
    """``shm://PATH?host=ID&arena=ID&size=N``; ValueError when malformed."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "shm":
        raise ValueError(f"not an shm:// URL: {url}")
    q = urllib.parse.parse_qs(u.query)
    return ShmEndpoint(
        u.path, q.get("host", [""])[0], q.get("arena", [""])[0], int(q.get("size", ["0"])[0])
    )


class ArenaClosed(Unavailable):
    """The mapping was closed (or went stale) before a call used it: nothing was sent,
    the call can go over tcp://."""


class ShmArena:
    """A read-write mapping of a worker's arena, from the descriptor it handed over,
    and (when the worker handed them too) its same-host index and this client's
    hazard page (``local``; see :mod:`.shmlocal`), kept with the hand-over
    connection: closing it tells the worker this client is gone."""

    def __init__(self, fd: int, arena_id: str, size: int) -> None:
        # MAP_POPULATE: fault the whole mapping in now, not one page per first touch.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        # Only the array and the view hold the mapping (and the descriptor mmap keeps):
        # it goes when the last of them does, see close().
        mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.id = arena_id
        self.tag = int(arena_id[:4], 16)
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.view = memoryview(mm)  # small per-part copies: slice assignment
        self.stale = False
        self.local: shmlocal.Local | None = None
        self._link: socket.socket | None = None

    def attach(self, index_fd: int, page_fd: int, link: socket.socket) -> None:
        """Map the index (read-only) and the hazard page handed over on ``link``;
        ValueError when they are not what they must be (then only the arena is used)."""
        st = os.fstat(index_fd)
        if not stat.S_ISREG(st.st_mode) or os.fstat(page_fd).st_size != shmindex.PAGE_BYTES:
            raise ValueError("not an index and a hazard page")
        index = shmindex.IndexView(index_fd, st.st_size, self.tag)
        self.local = shmlocal.Local(self.array, self.view, index, shmindex.HazardPage(page_fd))
        link.setblocking(False)
        self._link = link

    def maps(self) -> tuple[np.ndarray, memoryview]:
        """The mapping as an array and a view, for one call to copy through; raises
        ArenaClosed once :meth:`close` ran (it marks the arena stale before it drops
        them, so what this returns while not stale is the live mapping)."""
        arr, mv = self.array, self.view
        if self.stale:
            raise ArenaClosed("the shm mapping was closed: use tcp://")
        return arr, mv

    def usable(self) -> shmlocal.Local | None:
        """The index and hazard page while the worker that handed them is alive (it
        sends nothing after the hand-over: anything readable on the link is its end
        closing). When it is gone the mapping is stale: calls go over tcp://."""
        loc, link = self.local, self._link
        if loc is None or link is None or self.stale:
            return None
        try:  # thread-safe and non-blocking: one syscall
            link.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return loc  # nothing to read: the worker is there
        except OSError:
            pass
        self.stale = True  # its end closed (or it broke the protocol)
        return None

    def check(self, tag: int) -> None:
        """An answer's arena tag must be ours: else the worker restarted behind its
        address, and writing or reading through this mapping would be wrong."""
        if tag != self.tag:
            self.stale = True
            raise Unavailable("the worker's arena changed (restarted?): shm mapping dropped")

    def close(self) -> None:
        if self._link is not None:
            self._link.close()  # the worker drops our hazard page: nothing stays pinned
            self._link = None
        # New calls take the socket path. The mappings (arena, index, hazard page) and
        # the descriptors mmap keeps for them go as soon as nothing holds them: now,
        # or when the calls in flight on other threads (and leases) let go of the
        # arrays and views they took. Releasing the view under them failed a put with
        # "operation forbidden on released memoryview".
        self.stale = True
        self.local = None
        self.array = np.empty(0, dtype=np.uint8)
        self.view = memoryview(b"")


def try_map(endpoints: Sequence[str], timeout: float = 2.0) -> ShmArena | None:
    """Map the arena of a worker on this host if it hands it over, else None (tcp://)."""
    me = host_id()
    for url in endpoints:
        if not url.startswith("shm://"):
            continue
        try:
            ep = parse_shm_url(url)
        except ValueError:
            return None
        if ep.host != me or not ep.arena or ep.size <= 0:
            return None
        try:
            return _receive(ep, timeout)
        except (OSError, ValueError, KVStoreError):
            return None
    return None


def _receive(ep: ShmEndpoint, timeout: float) -> ShmArena | None:
    name = os.path.basename(ep.path)
    if not (name.startswith(SOCKET_PREFIX) and name.endswith(".sock")):
        return None
    if not stat.S_ISSOCK(os.lstat(ep.path).st_mode):
        return None  # only ever a socket: never open a file the map names
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    keep = False
    try:
        sock.settimeout(timeout)
        sock.connect(ep.path)
        msg, fds, _, _ = socket.recv_fds(sock, wire.SHM_HELLO.size, 3)
        if len(fds) not in (1, 3):
            return None
        arena_id, size = wire.decode_shm_hello(msg)
        st = os.fstat(fds[0])
        if arena_id != ep.arena or size != ep.size or not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size != size:
            return None
        arena = ShmArena(fds[0], arena_id, size)
        if len(fds) == 3:
            try:
                arena.attach(fds[1], fds[2], sock)
                keep = True
            except (OSError, ValueError):
                pass  # the arena alone: every call asks the worker
        return arena
    finally:
        for fd in fds:
            os.close(fd)  # the mappings keep the memory; the descriptors are not needed
        if not keep:
            sock.close()


_local = threading.local()  # per thread: .array / .view, the bounce buffer of a parts read


# The bounce buffer starts this far past a 4 KiB boundary. Arena slots start on one,
# and a copy whose source and destination share their address modulo 4 KiB ran 2.5x
# slower here (4K aliasing: 1.4 against 3.6 GiB/s for 1 MiB copies out of the arena).
BOUNCE_SKEW = 256


def _bounce(size: int) -> tuple[np.ndarray, memoryview]:
    """This thread's bounce buffer, at least ``size`` bytes (grown on demand), as an
    array and a memoryview."""
    arr: np.ndarray | None = getattr(_local, "array", None)
    if arr is None or len(arr) < size:
        n = max(size, 1 << 20)
        raw = np.empty(n + 4096, dtype=np.uint8)
        start = (BOUNCE_SKEW - raw.ctypes.data) % 4096
        arr = raw[start : start + n]
        _local.array = arr
        _local.view = arr.data
    return arr, _local.view


def _as_array(buf: memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


# A batch is cut into pipelined pieces of about this many bytes (at most PIECES): all
# location requests go out at once, and the worker answers piece k+1 while the client
# copies piece k. Measured on a loaded 2-core host, pieces of 1 MiB made 64 KiB and
# 1 MiB batches slower (more frames for the worker, no idle core to overlap on), so
# only very large batches are cut (docs/BENCHMARKS.md).
PIECE_BYTES = 64 << 20
PIECES = 8
SMALL_PART = shmlocal.SMALL_PART


def pieces(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) runs of a batch for pipelining: about PIECE_BYTES each, at most
    PIECES of them (one for a small batch)."""
    total = sum(sizes)
    per = max(PIECE_BYTES, -(-total // PIECES))
    return wire.runs(sizes, per)


def get(
    conn: TcpConnection,
    arena: ShmArena,
    ns: bytes,
    hashes: Sequence[bytes],
    buffers: Sequence[memoryview | list[memoryview]] | None,
) -> GetResult:
    """Read blocks through the mapping (inline for blocks outside the arena); a block
    given as parts gets one copy per part. Pipelined: every piece's GET_LOC is sent at
    once, and each piece is released (one-way RELEASE) as soon as it is copied."""
    maps = arena.maps()  # before anything is sent
    n = len(hashes)
    sizes: list[int] = []
    if buffers is not None:
        sizes = [wire.block_size(b) for b in buffers]
        cuts = pieces(sizes)
    else:  # sizes unknown: at most PIECES pieces of at least 32 keys (a worker keeps
        # at most 64 requests of a connection open, Limits.max_open_requests)
        per = max(32, -(-n // PIECES))
        cuts = [(a, min(a + per, n)) for a in range(0, n, per)]
    sock = conn.sock
    reqs: list[int] = []
    out: list[bytes | bytearray | memoryview] = []
    for a, b in cuts:
        conn._req += 1
        reqs.append(conn._req)
        out += [wire.encode_request_header(wire.OP_GET_LOC, ns, b - a, conn._req)]
        out += [b"".join(hashes[a:b])]
    wire.send_buffers(sock, out)
    found = [False] * n
    values: list[bytearray | None] = [None] * n
    total = 0
    for (a, b), req in zip(cuts, reqs, strict=True):
        total += _get_piece(conn, arena, maps, ns, req, a, b - a, buffers, sizes, found, values)
    return GetResult(found, values, total)


def _get_piece(
    conn: TcpConnection,
    arena: ShmArena,
    maps: tuple[np.ndarray, memoryview],
    ns: bytes,
    req: int,
    first: int,
    count: int,
    buffers: Sequence[memoryview | list[memoryview]] | None,
    sizes: list[int],
    found: list[bool],
    values: list[bytearray | None],
) -> int:
    """Read one GET_LOC answer (blocks first..first+count), copy, release; returns the
    payload bytes found. The RELEASE (one-way) goes out at once: pins never outlive
    the call that took them, whatever the caller's process does next."""
    sock = conn.sock
    h = conn._answer(wire.OP_GET_LOC, req)
    try:
        arena.check(h.ns_len)
        if h.count != count:
            raise Unavailable(f"{h.count} locations for {count} hashes")
    except Unavailable:
        conn.close()  # the answer's body is unread: this connection is done
        raise
    meta = wire.recv_exact(sock, h.count * wire.LOC_ENTRY.size)
    entries = list(wire.LOC_ENTRY.iter_unpack(meta))
    total = 0
    try:
        # Inline payloads come first on the wire, in order.
        for j, (status, size, checksum, _) in enumerate(entries):
            if status != wire.LOC_INLINE:
                continue
            i = first + j
            total += size
            if buffers is None:
                buf = bytearray(size)
                wire.recv_into_exact(sock, memoryview(buf))
                if xxhash.xxh3_64_intdigest(buf) == checksum:
                    values[i], found[i] = buf, True
                continue
            dest = buffers[i]
            if sizes[i] != size:
                wire.discard(sock, size, conn._scratch)
            elif isinstance(dest, list):
                wire.recv_into_parts(sock, dest)
                found[i] = wire.block_checksum(dest) == checksum
            else:
                wire.recv_into_exact(sock, dest)
                found[i] = xxhash.xxh3_64_intdigest(dest) == checksum
        src, mv = maps
        limit = len(src)
        for j, (status, size, checksum, off) in enumerate(entries):
            if status != wire.LOC_ARENA or off + size > limit:
                continue
            i = first + j
            total += size
            out = buffers[i] if buffers is not None else None
            # Copy first, then verify what landed in the caller's buffer (the pass over
            # it reads cache-hot bytes, and it checks exactly the bytes handed back): a
            # mismatch is a miss, whatever the buffer holds.
            if out is None:
                buf = bytearray(mv[off : off + size])
                if xxhash.xxh3_64_intdigest(buf) == checksum:
                    values[i] = buf
                    found[i] = True
            else:
                found[i] = shmlocal.copy_block(src, mv, off, size, checksum, out, sizes[i], _bounce)
    finally:
        # One-way: the worker unpins; no answer to wait for.
        wire.send_buffers(sock, [wire.encode_request_header(wire.OP_RELEASE, ns, 0, req)])
    return total


def put(
    conn: TcpConnection,
    arena: ShmArena,
    ns: bytes,
    hashes: Sequence[bytes],
    values: Sequence[memoryview | list[memoryview]],
    flags: int = 0,
) -> bytes:
    """Write blocks through the mapping; returns one wire.PUT_* status per block
    (``flags``: wire.FLAG_SESSION or 0, on each PUT_LOC). A block given as parts gets
    one copy per part into its slot. The checksums are taken over the slots right
    after the copy, while their bytes are in cache (FLAG_LATE_SUM: they travel with
    the commit), so a put reads the caller's bytes once. Pipelined: every piece's
    PUT_LOC is sent at once; each piece is copied and committed as its slots arrive,
    and the commit answers are read at the end."""
    dst, mv = arena.maps()  # before anything is sent
    sizes = [wire.block_size(v) for v in values]
    cuts = pieces(sizes)
    sock = conn.sock
    reqs: list[int] = []
    out: list[bytes | bytearray | memoryview] = []
    late = flags | wire.FLAG_LATE_SUM
    for a, b in cuts:
        conn._req += 1
        reqs.append(conn._req)
        entries = bytearray((b - a) * wire.PUT_ENTRY.size)
        for j in range(a, b):
            wire.PUT_ENTRY.pack_into(entries, (j - a) * wire.PUT_ENTRY.size, hashes[j], sizes[j], 0)
        out += [wire.encode_request_header(wire.OP_PUT_LOC, ns, b - a, conn._req, late), entries]
    wire.send_buffers(sock, out)
    digest = xxhash.xxh3_64_intdigest
    all_locs: list[tuple[int, int]] = []
    for (a, b), req in zip(cuts, reqs, strict=True):
        h = conn._answer(wire.OP_PUT_LOC, req)
        try:
            arena.check(h.ns_len)
            if h.count != b - a:
                raise Unavailable(f"{h.count} slots for {b - a} blocks")
        except Unavailable:
            conn.close()
            raise
        locs = list(wire.PUT_LOC_ENTRY.iter_unpack(wire.recv_exact(sock, h.count * 16)))
        written = bytearray(h.count)
        sums = bytearray(h.count * wire.SUMS.size)
        for j, (status, off) in enumerate(locs):
            if status != wire.PUT_LOC_SLOT:
                continue
            v = values[a + j]
            n = sizes[a + j]
            if off + n > len(dst):
                continue
            if isinstance(v, list):
                at = off
                for p in v:
                    k = p.nbytes
                    if k < SMALL_PART:
                        mv[at : at + k] = p
                    else:
                        np.copyto(dst[at : at + k], _as_array(p))
                    at += k
            else:
                np.copyto(dst[off : off + n], _as_array(v))
            wire.SUMS.pack_into(sums, j * wire.SUMS.size, digest(mv[off : off + n]))
            written[j] = 1
        commit = wire.encode_request_header(
            wire.OP_PUT_COMMIT, ns, h.count, req, wire.FLAG_LATE_SUM
        )
        wire.send_buffers(sock, [commit, written, sums])
        all_locs += locs
    status = bytearray()
    for req in reqs:
        h = conn._answer(wire.OP_PUT_COMMIT, req)
        status += wire.recv_exact(sock, h.count)
    # Entries refused at PUT_LOC keep their PUT_LOC status (present / full).
    return bytes(
        s if loc[0] == wire.PUT_LOC_SLOT else loc[0]
        for s, loc in zip(status, all_locs, strict=True)
    )


# ---- leases (see .pins) -----------------------------------------------------------


def pin(
    pool: TcpPool, arena: ShmArena, timeout: float, ns: bytes, hashes: Sequence[bytes]
) -> pins.ArenaPins:
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

    return pins.ArenaPins(views, [arena], [release])


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


def reserve(
    pool: TcpPool,
    arena: ShmArena,
    timeout: float,
    ns: bytes,
    hashes: Sequence[bytes],
    sizes: Sequence[int],
    flags: int = 0,
) -> pins.ArenaSlots:
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

    out = pins.ArenaSlots(views, present, [arena])
    out._commits.append((list(range(n)), commit))
    return out


class ShmTransfer(TcpTransfer):
    """The :class:`~kvstore_client.transport.Transfer` of a same-host worker whose arena
    is mapped: gets and puts copy through the mapping (control over a pooled tcp://
    connection); exists and remove are plain tcp:// frames. Once the mapping is stale
    (the worker restarted), every call goes over tcp://."""

    def __init__(self, pool: TcpPool, arena: ShmArena, max_value: int) -> None:
        super().__init__(pool)
        self.arena = arena
        # A worker lets one connection hold at least two values' worth of shm
        # reservations at a time: a put is cut into requests that always fit.
        self.put_limit = 2 * max(max_value, 1)

    @property
    def local(self) -> bool:
        """True while the arena is mapped: a read is copies on the calling thread
        (the client runs it there, with no hop through its pool)."""
        return not self.arena.stale

    def put(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        flags: int = 0,
    ) -> bytes:
        """``checksums`` are not used while the arena is mapped (they are taken over
        the slots after the copy; a local client passes zeros); once it is stale they
        are computed here for tcp://."""
        if self.arena.stale:
            sums = [wire.block_checksum(v) for v in values]
            return super().put(timeout, ns, hashes, values, sums, flags)
        vs = [v if isinstance(v, list | memoryview) else memoryview(v) for v in values]
        out = bytearray()
        for a, b in wire.runs([wire.block_size(v) for v in vs], self.put_limit):
            try:
                out += self.pool.call(timeout, put, self.arena, ns, hashes[a:b], vs[a:b], flags)
            except ArenaClosed:  # closed meanwhile: the rest over tcp://
                return bytes(out) + self.put(timeout, ns, hashes[a:], values[a:], checksums, flags)
        return bytes(out)

    def get(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        loc = self.arena.usable()
        if loc is None:
            return self._socket_get(timeout, ns, hashes, buffers)
        # Through the index first (no round trip); the keys it cannot answer (and the
        # blocks that moved meanwhile) over the socket.
        n = len(hashes)
        found = [False] * n
        values: list[bytearray | None] = [None] * n
        sizes = [wire.block_size(b) for b in buffers] if buffers is not None else []
        left, total = shmlocal.read(
            loc, ns, b"".join(hashes), buffers, sizes, found, values, _bounce
        )
        if left:
            sub = self._socket_get(
                timeout,
                ns,
                [hashes[i] for i in left],
                [buffers[i] for i in left] if buffers is not None else None,
            )
            for j, i in enumerate(left):
                found[i] = sub.found[j]
                values[i] = sub.values[j]
            total += sub.bytes_received
        return GetResult(found, values, total)

    def _socket_get(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        """GET_LOC and copies through the mapping; tcp:// once it is stale or closed."""
        if not self.arena.stale:
            try:
                return self.pool.call(timeout, get, self.arena, ns, hashes, buffers)
            except ArenaClosed:
                pass  # closed meanwhile, before anything was sent
        return super().get(timeout, ns, hashes, buffers)

    def exists(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> list[bool]:
        flags = self.present(ns, b"".join(hashes))
        if flags is not None:
            out: list[bool] = flags.tolist()
            return out
        return super().exists(timeout, ns, hashes)

    def present(
        self, ns: bytes, packed: bytes, anyway: bool = False
    ) -> npt.NDArray[np.bool_] | None:
        """Per key, held, from the worker's index with no round trip; None when the
        index cannot tell for some key, or the worker wants lookups and not
        ``anyway`` (ask the worker)."""
        loc = self.arena.usable()
        return None if loc is None else shmlocal.exists(loc, ns, packed, anyway)

    @property
    def wants_lookups(self) -> bool:
        """True while the worker's index says it wants lookups sent to it."""
        loc = self.arena.local
        return loc is not None and not loc.index.lookups_here

    def prefix(self, ns: bytes, packed: bytes) -> int | None:
        """The leading run of ``packed``'s keys the worker holds, from its index with
        no round trip; None when the index cannot tell (ask the worker)."""
        loc = self.arena.usable()
        return None if loc is None else shmlocal.prefix(loc, ns, packed)

    def pin(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> pins.ArenaPins | None:
        """Pin blocks in place in the mapped arena (see :mod:`.pins`); None once the
        mapping is stale."""
        if self.arena.stale:
            return None
        loc = self.arena.usable()
        if loc is None:
            if self.arena.stale:
                return None
            return pin(self.pool, self.arena, timeout, ns, hashes)
        views, left, release = shmlocal.pin(loc, ns, b"".join(hashes))
        out = pins.ArenaPins(views, [self.arena], [release])
        if left:
            try:
                rest = pin(self.pool, self.arena, timeout, ns, [hashes[i] for i in left])
            except BaseException:
                release()
                raise
            for j, i in enumerate(left):
                out.views[i] = rest.views[j]
            out._releases += rest._releases
        return out

    def reserve(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        flags: int = 0,
    ) -> pins.ArenaSlots | None:
        """Reserve slots in the mapped arena to write into directly (see
        :mod:`.pins`); None once the mapping is stale."""
        if self.arena.stale:
            return None
        return reserve(self.pool, self.arena, timeout, ns, hashes, sizes, flags)
