"""Client half of the shm:// transport: map a same-host worker's arena and copy directly.

The worker advertises ``shm://SOCKET?host=HOSTID&arena=ID&size=N``: a Unix socket
(mode 0600) that hands out the arena's descriptor (a memfd). A client on the same
host (same host id) that may connect sends its identity and token
(``wire.SHM_REQUEST``) and receives the descriptors with SCM_RIGHTS, after checking
that the worker's message names the same arena id and size as the map, and that the
descriptor is a regular file of that size. The client never opens a path the map
names: a forged or stale entry only ever falls back to tcp://. Every answer carries
the arena's tag; a mismatch (the worker restarted behind the same address) is an error
for that call and the mapping is dropped.

The arena is mapped **read-only** (the worker seals it: no process but the worker can
write it). With it come the same-host index (read-only) and a hazard page of this
client's own (:mod:`.shmindex`, :mod:`.shmlocal`): lookups, gets and pins of the
blocks the index holds need no round trip at all; the hand-over connection stays open
so each side learns when the other is gone. What the index cannot answer (SSD blocks,
full buckets, entries that changed under the probe) goes the socket way: a get is one
GET_LOC round trip for the locations, one copy per block out of the mapping into the
caller's buffer, whose bytes are then checked against the block's xxh3-64 (a mismatch
is a miss), and a one-way RELEASE sent as soon as the copies are done, before the call
returns: a client stopped right after a read (a debugger, a checkpoint, a GC pause)
holds no pins. A block read into several parts is copied out of the mapping once, into
a per-thread bounce buffer, verified there and scattered from cache. A single
same-host worker's get runs on the caller's thread.

Writes go through this client's **inbox** (:mod:`.shminbox`): the client copies
blocks there with their checksums taken over its own bytes, the worker copies them
into its arena and publishes only what matches. Control frames travel over the tcp://
connection (codec in kvstore_client.wire), whose AUTH names this client's identity.
"""

from __future__ import annotations

import contextlib
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
from ..verified import GetResult, Landing, check_all
from . import pins, shminbox, shmindex, shmlocal
from .registry import Credentials, Scheme, register
from .shminbox import Inbox
from .tcp import TcpConnection, TcpPool, TcpTransfer, recv_block

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
    """A read-only mapping of a worker's arena, from the descriptor it handed over; and
    (when the worker handed them too) its same-host index and this client's hazard page
    (``local``; see :mod:`.shmlocal`) and this client's inbox (``inbox``; see
    :mod:`.shminbox`), kept with the hand-over connection: closing it tells the worker
    this client is gone. ``budget``: bytes of slots this client's hazard words may hold
    (the worker ignores a page that names more)."""

    def __init__(self, fd: int, arena_id: str, size: int, budget: int = 1 << 62) -> None:
        # MAP_POPULATE: fault the whole mapping in now, not one page per first touch.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        # Only the array and the view hold the mapping (and the descriptor mmap keeps):
        # it goes when the last of them does, see close().
        mm = mmap.mmap(fd, size, flags, mmap.PROT_READ)
        self.id = arena_id
        self.tag = int(arena_id[:4], 16)
        self.budget = budget
        self.array = np.frombuffer(mm, dtype=np.uint8)  # read-only
        self.view = memoryview(mm)  # read-only; small per-part copies: slice assignment
        self.stale = False
        self.local: shmlocal.Local | None = None
        self.inbox: Inbox | None = None
        self._link: socket.socket | None = None
        self._pins_lock = threading.Lock()
        self.socket_pinned = 0  # bytes of socket-path pin leases now held (see pin())

    def pinned(self, nbytes: int) -> None:
        """Socket-path pin leases of ``nbytes`` were taken (negative: released); the
        worker counts them with the hazard words against one budget."""
        with self._pins_lock:
            self.socket_pinned += nbytes

    def attach(self, index_fd: int, page_fd: int) -> None:
        """Map the index (read-only) and the hazard page; ValueError when they are not
        what they must be (then only the arena is used)."""
        st = os.fstat(index_fd)
        if not stat.S_ISREG(st.st_mode) or os.fstat(page_fd).st_size != shmindex.PAGE_BYTES:
            raise ValueError("not an index and a hazard page")
        index = shmindex.IndexView(index_fd, st.st_size, self.tag)
        page = shmindex.HazardPage(page_fd, self.budget, lambda: self.socket_pinned)
        self.local = shmlocal.Local(self.array, self.view, index, page)

    def keep(self, link: socket.socket) -> None:
        """Hold the hand-over connection (the worker's end closing means it is gone)."""
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
        loc = self.local
        if loc is None or not self.alive():
            return None
        return loc

    def alive(self) -> bool:
        """False once the worker that handed the mapping over is gone (or it was closed)."""
        link = self._link
        if link is None or self.stale:
            return False
        try:  # thread-safe and non-blocking: one syscall
            link.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: the worker is there
        except OSError:
            pass
        self.stale = True  # its end closed (or it broke the protocol)
        return False

    def check(self, tag: int) -> None:
        """An answer's arena tag must be ours: else the worker restarted behind its
        address, and reading through this mapping would be wrong."""
        if tag != self.tag:
            self.stale = True
            raise Unavailable("the worker's arena changed (restarted?): shm mapping dropped")

    def close(self) -> None:
        if self._link is not None:
            self._link.close()  # the worker drops our page and inbox: nothing stays pinned
            self._link = None
        # New calls take the socket path. The mappings (arena, index, hazard page,
        # inbox) and the descriptors mmap keeps for them go as soon as nothing holds
        # them: now, or when the calls in flight on other threads (and leases) let go
        # of the arrays and views they took. Releasing the view under them failed a
        # put with "operation forbidden on released memoryview".
        self.stale = True
        self.local = None
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None
        self.array = np.empty(0, dtype=np.uint8)
        self.view = memoryview(b"")


def try_map(
    endpoints: Sequence[str], identity: bytes = b"", token: str = "", timeout: float = 2.0
) -> ShmArena | None:
    """Map the arena of a worker on this host if it hands it over, else None (tcp://).
    ``identity`` (this client's, kvstore_client.security) names its page and inbox."""
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
            return _receive(ep, identity or bytes(wire.IDENTITY), token, timeout)
        except (OSError, ValueError, KVStoreError):
            return None
    return None


def _receive(ep: ShmEndpoint, identity: bytes, token: str, timeout: float) -> ShmArena | None:
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
        sock.sendall(wire.encode_shm_request(identity, token))
        msg, fds, _, _ = socket.recv_fds(sock, wire.SHM_HELLO.size, 4)
        hello = wire.decode_shm_hello(msg)
        want = 1 + 2 * bool(hello.flags & wire.SHM_HAS_INDEX)
        want += bool(hello.flags & wire.SHM_HAS_INBOX)
        if len(fds) != want:
            return None
        st = os.fstat(fds[0])
        if hello.arena_id != ep.arena or hello.size != ep.size or not stat.S_ISREG(st.st_mode):
            return None
        if st.st_size != hello.size:
            return None
        arena = ShmArena(fds[0], hello.arena_id, hello.size, hello.budget)
        if hello.flags & wire.SHM_HAS_INDEX:
            with contextlib.suppress(OSError, ValueError):  # else every read asks the worker
                arena.attach(fds[1], fds[2])
        if hello.flags & wire.SHM_HAS_INBOX:
            fd = fds[-1]
            if os.fstat(fd).st_size == hello.inbox and hello.inbox >= shminbox.PAGE:
                arena.inbox = Inbox(fd, hello.inbox, hello.arena_id)
        arena.keep(sock)
        keep = True
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
        reqs.append(conn.next_req())
        out += [wire.encode_request_header(wire.OP_GET_LOC, ns, b - a, reqs[-1])]
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
    h = conn.answer(wire.OP_GET_LOC, req)
    try:
        arena.check(h.ns_len)
        if h.count != count:
            raise Unavailable(f"{h.count} locations for {count} hashes")
    except Unavailable:
        conn.close()  # the answer's body is unread: this connection is done
        raise
    meta = wire.recv_exact(sock, h.count * wire.LOC_ENTRY.size)
    entries = list(wire.LOC_ENTRY.iter_unpack(meta))
    try:
        # Inline payloads come first on the wire, in order: landed and verified as
        # any transport's (verified.Landing).
        land = Landing(buffers, count, found, values, first)
        for j, (status, size, checksum, _) in enumerate(entries):
            if status != wire.LOC_INLINE:
                continue
            dest = land.dest(j, size)
            if dest is None:
                wire.discard(sock, size, conn.scratch)
                continue
            recv_block(sock, dest)
            land.check(j, dest, checksum)
        total = land.total
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
    req = conn.next_req()
    head = wire.encode_request_header(wire.OP_GET_LOC, ns, len(hashes), req)
    wire.send_buffers(sock, [head, b"".join(hashes)])
    h = conn.answer(wire.OP_GET_LOC, req)
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
    at = [i for i, (status, size, _, off) in enumerate(entries)
          if status == wire.LOC_ARENA and off + size <= len(mv)]  # fmt: skip
    slots = [mv[entries[i][3] : entries[i][3] + entries[i][1]] for i in at]
    for i, slot, ok in zip(at, slots, check_all(slots, [entries[i][2] for i in at]), strict=True):
        if ok:  # checked at pin time: the slot is read-only and stays until released
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
    """Regions of this client's inbox for ``hashes`` to be written into (a GPU's DMA),
    with no round trip: blocks the index says the worker holds are ``present`` and get
    no region. The lease's commit takes each written block's checksum over its region
    and sends one PUT_INBOX on a pooled connection (``flags``, e.g. FLAG_SESSION);
    nothing is reserved at the worker until then."""
    n = len(hashes)
    inbox = arena.inbox
    present = [False] * n
    loc = arena.usable()
    if loc is not None:
        got = shmlocal.exists(loc, ns, b"".join(hashes), anyway=True)
        if got is not None:
            present = got.tolist()
    if inbox is None:
        return pins.ArenaSlots([None] * n, present, [])
    views, give, offsets = shminbox.reserve(inbox, sizes, present)

    def commit(written: list[bool]) -> list[bool]:
        idx = [j for j in range(n) if written[j] and views[j] is not None]
        try:
            if not idx:
                return [False] * n
            vs = [views[j] for j in idx]
            status = pool.call(
                timeout,
                shminbox.commit,
                arena.tag,
                ns,
                [hashes[j] for j in idx],
                vs,
                [offsets[j] for j in idx],
                flags,
            )
        except (KVStoreError, OSError):
            return [False] * n
        finally:
            give()
        out = [False] * n
        for j, s in zip(idx, status, strict=True):
            out[j] = s == wire.PUT_STORED
        return out

    out = pins.ArenaSlots(views, present, [inbox])
    out.on_commit(list(range(n)), commit)
    return out


class ShmTransfer(TcpTransfer):
    """The :class:`~kvstore_client.transport.Transfer` of a same-host worker whose arena
    is mapped: gets and puts copy through the mapping (control over a pooled tcp://
    connection); exists and remove are plain tcp:// frames. Once the mapping is stale
    (the worker restarted), every call goes over tcp://."""

    def __init__(self, pool: TcpPool, arena: ShmArena, max_value: int) -> None:
        super().__init__(pool)
        self.arena = arena

    @property
    def local(self) -> bool:
        """True while the arena is mapped: a read is copies on the calling thread
        (the client runs it there, with no hop through its pool)."""
        return not self.arena.stale

    @property
    def same_host(self) -> bool:
        """True: the worker's arena is (or was, until it went stale) mapped here."""
        return True

    def put(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        flags: int = 0,
    ) -> bytes:
        """Through this client's inbox while the worker is alive (``checksums`` are
        not used: they are taken while copying; a local client passes zeros); what
        finds no room there, and everything once the mapping is stale, over tcp://
        (checksums computed here)."""
        inbox = self.arena.inbox
        if inbox is None or not self.arena.alive():
            return self._tcp_put(timeout, ns, hashes, values, flags)
        vs = [v if isinstance(v, list | memoryview) else memoryview(v) for v in values]
        skip = [False] * len(vs)
        loc = self.arena.local  # the worker was alive a moment ago (no second syscall)
        if loc is not None:  # blocks the worker holds: no copy at all
            got = shmlocal.exists(loc, ns, b"".join(hashes), anyway=True)
            if got is not None:
                skip = got.tolist()
        try:
            status, left = self.pool.call(
                timeout, shminbox.put, inbox, self.arena.tag, ns, hashes, vs, skip, flags
            )
        except shminbox.PartialPut as e:  # the mapping closed meanwhile: the rest over tcp://
            status, left = e.status, e.left
        if left:
            rest = self._tcp_put(
                timeout, ns, [hashes[i] for i in left], [values[i] for i in left], flags
            )
            for i, st in zip(left, rest, strict=True):
                status[i] = st
        return bytes(status)

    def _tcp_put(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        flags: int,
    ) -> bytes:
        sums = [wire.block_checksum(v) for v in values]
        return super().put(timeout, ns, hashes, values, sums, flags)

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

    def where(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """Per hash a ``wire.WHERE_*`` code: from the worker's index when it can tell
        for every key (a hit there is in the arena: WHERE_DRAM), else over tcp://."""
        flags = self.present(ns, b"".join(hashes))
        if flags is not None:
            return flags.astype(np.uint8)  # WHERE_DRAM for a hit, WHERE_ABSENT else
        return super().where(timeout, ns, hashes)

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
            held = sum(v.nbytes for v in rest.views if v is not None)
            if loc.hazards.room() < held:  # over this client's budget: not pinned
                rest.release()
                return out
            self.arena.pinned(held)
            out.adopt(rest, left)
            out.on_release(lambda: self.arena.pinned(-held))
        return out

    def reserve(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        flags: int = 0,
    ) -> pins.ArenaSlots | None:
        """Regions of this client's inbox to write into directly (see :mod:`.pins`);
        None once the mapping is stale or without an inbox."""
        if self.arena.inbox is None or not self.arena.alive():
            return None
        return reserve(self.pool, self.arena, timeout, ns, hashes, sizes, flags)


def _open(url: str, endpoints: Sequence[str], creds: Credentials) -> ShmArena | None:
    return try_map(endpoints, creds.identity, creds.token)


# Same host: the worker's arena mapped, when it hands it over (else tcp://).
register(
    Scheme(
        "shm",
        1,
        lambda choice: choice in ("auto", "shm"),
        _open,
        lambda arena, base, info: ShmTransfer(base, arena, info.max_value_bytes),
    )
)
