"""Server half of the shm:// transport: hand the arena over, pin for readers, publish
what writers put in their inboxes.

The arena is an anonymous memfd (worker/arena.py), sealed so that only the worker's
own mapping can write it. :class:`ArenaShare` listens on a Unix socket (mode 0600, in
the shm directory). A same-host client connects and speaks first
(``wire.SHM_REQUEST``: its identity and token); the worker answers with
``wire.SHM_HELLO`` and descriptors attached (SCM_RIGHTS): the arena, read-only; when
the same-host index is attached (:mod:`kvstore.worker.tiers.shared`) the index
(read-only) and a hazard page of the client's own; and the client's *inbox*, memory
only it and the worker share, into which it writes the blocks it puts. The worker
closes its own descriptors of the page and the inbox once handed over (it keeps the
mappings), so no other process can reopen them through /proc. The connection then
stays open: it is how the worker learns the client is gone, and drops its page (which
releases what it pinned) and its inbox.

Readers copy out of their read-only mapping and verify in their own buffer (a pin's
views point at published slots, which nobody can write). Writers never write the
arena: a PUT_INBOX names blocks in the writer's inbox with the checksums it took over
its source; the worker reserves slots, copies each block into its slot, hashes its own
copy and publishes only a match (:meth:`ShmServer.put_inbox`). A mismatch (a forged
sum, bytes that changed while the worker copied) aborts that block: the key stays
absent, and the next correct writer stores it. docs/SECURITY.md states what this
holds against.

A worker with tenants shares nothing (a client of one tenant would map blocks of
every tenant): its same-host clients use tcp://.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from kvstore_client import verified, wire
from kvstore_client.errors import InvalidArgument, ProtocolError, ResourceExhausted, Unavailable
from kvstore_client.keys import split_hashes
from kvstore_client.verified import copy_sum

from ...procs import pid_alive
from ..arena import SHM_PREFIX, Arena
from ..requests import Holder, RequestCore, put_status
from ..store import BlockStore
from ..storerecords import Reading
from ..tiers.blocks import Block
from ..tiers.shared import SharedIndex
from .frames import Buffers, Refused, ok_answer, refusing

Bytes = bytes | bytearray | memoryview

log = logging.getLogger(__name__)


class Inboxes:
    """The same-host clients' inboxes, by client identity: memfds of ``size`` bytes
    that the client writes and the worker copies from. Thread-safe. A client has at
    most one; its pages are charged to whoever touches them first (the client, which
    writes them), and go when both sides let go of the mapping."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._by: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._by)

    def add(self, identity: bytes) -> int | None:
        """A new inbox for ``identity``: its descriptor (the caller hands it over and
        closes it), or None when this identity has one already."""
        with self._lock:
            if identity in self._by:
                return None
            fd = os.memfd_create("kvstore-inbox", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.size)
                mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
            except BaseException:
                os.close(fd)
                raise
            self._by[identity] = np.frombuffer(mm, dtype=np.uint8)
            return fd

    def get(self, identity: bytes) -> np.ndarray | None:
        with self._lock:
            return self._by.get(identity)

    def drop(self, identity: bytes) -> None:
        """The client is gone: its inbox goes once no copy in flight holds it."""
        with self._lock:
            self._by.pop(identity, None)


@dataclass(slots=True)
class _Pending:
    """A hand-over connection whose request is not all in yet."""

    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    need: int = wire.SHM_REQUEST.size


@dataclass(slots=True)
class _Client:
    """A client that got its descriptors: its page (0: none) and identity."""

    cid: int
    identity: bytes
    inbox: bool


class ArenaShare:
    """Hands the arena (read-only), the index, a hazard page and an inbox to same-host
    clients over a Unix socket.

    The socket file is ``DIR/kvstore-PID-ID.sock`` with mode 0600 (the worker's user
    only; the peer's uid is checked again with SO_PEERCRED). Requests are read without
    blocking (a client that connects and says nothing is dropped after
    ``REQUEST_TIMEOUT`` and holds up nobody); at most ``MAX_PENDING`` wait at once. At
    most ``MAX_CLIENTS`` pages exist, ``MAX_PAGES_PER_CLIENT`` per identity; a client
    beyond gets the arena and its inbox only (its reads ask the worker). The same thread
    runs the index's upkeep every ``UPKEEP`` seconds. :meth:`close` removes the socket.
    """

    UPKEEP = 0.02
    MAX_CLIENTS = 256
    MAX_PAGES_PER_CLIENT = 4
    MAX_PENDING = 64
    REQUEST_TIMEOUT = 2.0

    def __init__(
        self, arena: Arena, directory: str, inboxes: Inboxes | None = None, budget: int = 0
    ) -> None:
        if not arena.sealed:
            raise OSError("the arena is not sealed: it cannot be handed over")
        self.arena = arena
        self.inboxes = inboxes
        self.budget = budget or arena.size // 2  # bytes a client's hazard words may hold
        self.index: SharedIndex | None = None
        self._upkeep: Callable[[], None] | None = None
        sweep_stale(directory)
        self._ro = arena.read_only_fd()
        self.path = os.path.join(directory, f"{SHM_PREFIX}{os.getpid()}-{arena.id}.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(self.path)
        except BaseException:
            self._sock.close()
            os.close(self._ro)
            raise
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, _Pending] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shm-share", daemon=True)
        self._thread.start()

    def attach(self, index: SharedIndex, upkeep: Callable[[], None]) -> None:
        """Hand ``index`` to clients from now on; ``upkeep`` (the store's) runs on this
        thread every UPKEEP seconds and when a client leaves. An index the kernel
        would not seal is never handed over."""
        self._upkeep = upkeep
        if index.sealed:
            self.index = index
        else:
            log.warning("the same-host index could not be sealed: not handed to clients")

    def _loop(self) -> None:
        me = os.getuid()
        next_upkeep = 0.0
        while not self._stopping.is_set():
            try:
                ready = self._sel.select(self.UPKEEP)
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            for key, _ in ready:
                conn, data = key.fileobj, key.data
                if data is None:
                    self._accept(me)
                elif isinstance(data, _Pending):
                    self._read_request(conn, data)  # type: ignore[arg-type]
                else:
                    self._gone(conn, data)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn, p in list(self._pending.items()):
                if now > p.deadline:  # said nothing (or too little) in time
                    self._forget(conn)
            if self._upkeep is not None and now >= next_upkeep:
                next_upkeep = now + self.UPKEEP
                try:
                    self._upkeep()
                except Exception as e:  # the hand-over must go on
                    log.warning("same-host index upkeep failed: %s", e)

    def _accept(self, me: int) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        try:
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(cred[4:8], "little")
            if uid not in (me, 0) or len(self._pending) >= self.MAX_PENDING:
                conn.close()
                return
            conn.setblocking(False)
            p = _Pending(time.monotonic() + self.REQUEST_TIMEOUT)
            self._pending[conn] = p
            self._sel.register(conn, selectors.EVENT_READ, p)
        except OSError:
            conn.close()

    def _forget(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn)
        conn.close()

    def _read_request(self, conn: socket.socket, p: _Pending) -> None:
        try:
            got = conn.recv(p.need - len(p.buf))
        except BlockingIOError:
            return
        except OSError:
            got = b""
        if not got:  # closed before its request was in
            self._forget(conn)
            return
        p.buf += got
        if len(p.buf) < p.need:
            return
        head = bytes(p.buf[: wire.SHM_REQUEST.size])
        try:
            version, identity, tlen = wire.decode_shm_request(head)
        except ProtocolError:
            self._forget(conn)
            return
        if p.need == wire.SHM_REQUEST.size and tlen:
            p.need += tlen  # the token follows
            return
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn)
        if version != wire.SHM_VERSION:
            conn.close()
            return
        self._hand_over(conn, identity)

    def _hand_over(self, conn: socket.socket, identity: bytes) -> None:
        """Send the descriptors; keep the connection while the client holds a page or
        an inbox (its close tells the worker the client is gone)."""
        cid = 0
        inbox = False
        owned: list[int] = []  # descriptors made for this client: closed once sent
        flags = 0
        fds = [self._ro]
        try:
            index = self.index
            if (
                index is not None
                and len(index.pages) < self.MAX_CLIENTS
                and index.client_pages(identity) < self.MAX_PAGES_PER_CLIENT
            ):
                cid, page = index.add_client(identity, self.budget)
                owned.append(page)
                fds += [index.ro_fd, page]
                flags |= wire.SHM_HAS_INDEX
            size = 0
            if self.inboxes is not None and any(identity):
                fd = self.inboxes.add(identity)
                if fd is not None:
                    inbox = True
                    owned.append(fd)
                    fds.append(fd)
                    flags |= wire.SHM_HAS_INBOX
                    size = self.inboxes.size
            hello = wire.encode_shm_hello(self.arena.id, self.arena.size, size, self.budget, flags)
            conn.setblocking(True)
            conn.settimeout(self.REQUEST_TIMEOUT)
            socket.send_fds(conn, [hello], fds)
            if not cid and not inbox:
                conn.close()
                return
            conn.setblocking(False)
            self._sel.register(conn, selectors.EVENT_READ, _Client(cid, identity, inbox))
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as e:
            # A peer that only checked the socket is alive (another worker's
            # sweep_stale at its start) and left: routine, not worth a log line.
            log.debug("shm hand-over: the peer left first (%s)", e)
            self._drop(conn, _Client(cid, identity, inbox))
        except Exception as e:  # one client must not stop the hand-over for others
            log.warning("shm hand-over failed: %s", e)
            self._drop(conn, _Client(cid, identity, inbox))
        finally:
            for fd in owned:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _gone(self, conn: socket.socket, client: _Client) -> None:
        """A client's connection is readable: it closed (or sent garbage, which
        nothing asks for): either way it is done."""
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn)
        self._drop(conn, client)
        if self._upkeep is not None:
            self._upkeep()  # release what it held now, not at the next tick

    def _drop(self, conn: socket.socket, client: _Client) -> None:
        if client.cid and self.index is not None:
            self.index.drop_client(client.cid)
        if client.inbox and self.inboxes is not None:
            self.inboxes.drop(client.identity)
        conn.close()

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=2)
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, _Client):
                self._drop(key.fileobj, key.data)  # type: ignore[arg-type]
            elif isinstance(key.data, _Pending):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        with contextlib.suppress(OSError):
            os.close(self._ro)


def sweep_stale(directory: str) -> int:
    """Remove what dead workers left in ``directory``: hand-over sockets nobody listens
    on, and arena files of earlier versions whose process is gone. Returns the count."""
    gone = 0
    for path in glob.glob(os.path.join(directory, f"{SHM_PREFIX}*")):
        name = os.path.basename(path)
        try:
            if name.endswith(".sock"):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.settimeout(0.5)
                    probe.connect(path)
                    continue  # a live worker's socket
                except OSError as e:
                    if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                        continue
                finally:
                    probe.close()
            else:  # an arena file of an older version: kvstore-PID-...
                pid = int(name[len(SHM_PREFIX) :].split("-")[0])
                if pid == os.getpid() or pid_alive(pid):
                    continue
            os.unlink(path)
            gone += 1
        except (OSError, ValueError):
            continue
    if gone:
        log.info("removed %d stale kvstore files from %s", gone, directory)
    return gone


@dataclass(slots=True)
class _Open:
    """One unreleased GET_LOC: what it pins, and the budget it holds."""

    reading: Reading
    nbytes: int
    entries: int


@dataclass(slots=True)
class ShmState:
    """What one connection holds: pinned reads by request id, within the connection's
    budget (bytes and entries, see worker.requests)."""

    holder: Holder
    open: dict[int, _Open] = field(default_factory=dict)


class LocAnswer:
    """A GET_LOC answer: :attr:`buffers` to send; :attr:`inline` payload bytes among
    them. :meth:`sent` once they are out (or the send failed): it ends the SSD read
    transaction of the inline blocks early; the DRAM pins stay until RELEASE."""

    def __init__(self, store: BlockStore, reading: Reading, buffers: Buffers, inline: int) -> None:
        self._store = store
        self._reading = reading
        self.buffers = buffers
        self.inline = inline

    def sent(self) -> None:
        if self.inline:
            self._store.end_txn(self._reading)


class ShmServer:
    """The server half of shm:// over a connection's frames: answers where blocks live
    (pinned until RELEASE) and publishes what same-host writers put in their inboxes.

    Pure bookkeeping over the frame core: the tcp:// server reads each frame's body,
    calls the op here and sends what it returns. Every answer carries the arena's
    16-bit tag in its header. INVALID_ARGUMENT and RESOURCE_EXHAUSTED are answered
    (:class:`~kvstore.worker.transfer.frames.Refused`); a frame that breaks the
    protocol (too many open requests) raises ProtocolError.
    """

    def __init__(
        self, store: BlockStore, core: RequestCore, inboxes: Inboxes | None = None
    ) -> None:
        self.store = store
        self.core = core
        self.inboxes = inboxes
        self._arena = np.frombuffer(store.arena.view, dtype=np.uint8)

    def state(self, holder: Holder) -> ShmState:
        """What a new connection holds: nothing, within ``holder``'s budget."""
        return ShmState(holder)

    def close(self, st: ShmState) -> None:
        """The connection is gone: release its pins."""
        for req in list(st.open):
            self._release(st, req)

    def release(self, st: ShmState, h: wire.Header) -> None:
        """RELEASE (one-way): give back the request ``h.req_id`` of this connection, if open."""
        self._release(st, h.req_id)

    def _release(self, st: ShmState, req: int) -> bool:
        o = st.open.pop(req, None)
        if o is None:
            return False
        self.store.done(o.reading)
        st.holder.give(o.nbytes, o.entries)
        return True

    def _check_new(self, st: ShmState, h: wire.Header) -> None:
        """At most max_open_requests per connection (ProtocolError); and a request id
        names one open request: a GET_LOC that reuses the id of one still open is
        refused (INVALID_ARGUMENT, then the connection closes and gives back everything
        it holds), so no pin is ever orphaned by an overwritten entry."""
        if len(st.open) >= self.core.limits.max_open_requests:
            raise ProtocolError("too many unreleased shm requests on one connection")
        if h.req_id in st.open:
            raise Refused(
                h,
                InvalidArgument(
                    f"request id {h.req_id} is already open on this connection: release it first"
                ),
            )

    def get_loc(self, st: ShmState, h: wire.Header, ns: str, body: Bytes) -> LocAnswer:
        """GET_LOC: locations (pinned) or inline bytes.

        Entries a connection may hold pinned are bounded (worker.requests.Budget): over
        the budget, the request is answered RESOURCE_EXHAUSTED and nothing is pinned.
        """
        self._check_new(st, h)
        store = self.store
        reading = store.read(ns, split_hashes(body), verify_dram=False)
        # One pass: the answer's entries, and the bytes of distinct pinned slots (a hash
        # repeated pins one slot, not more memory).
        size = wire.LOC_ENTRY.size
        pack = wire.LOC_ENTRY.pack_into
        meta = bytearray(h.count * size)
        inline: list[memoryview] = []
        slots: dict[int, int] = {}
        for i, held in enumerate(reading.held):
            if held is None:
                continue  # zeroed: GET_MISS
            b = held.block
            if b is not None:
                pack(meta, i * size, wire.LOC_ARENA, b.size, b.checksum, b.offset)
                slots[b.offset] = b.size
            else:
                pack(meta, i * size, wire.LOC_INLINE, len(held.view), held.checksum, 0)
                inline.append(held.view)
        pinned = sum(slots.values())
        # Entries and pinned bytes are taken from the budget together, after the pins (a
        # refused request unpins at once: nothing stays pinned).
        if not st.holder.take(pinned, h.count, whole=True):
            store.done(reading)
            raise Refused(
                h, ResourceExhausted("too many shm entries or bytes held open: release some first")
            )
        st.open[h.req_id] = _Open(reading, pinned, h.count)
        head = ok_answer(h, h.count, store.arena.tag)
        return LocAnswer(store, reading, [head, meta, *inline], sum(len(v) for v in inline))

    def put_inbox(
        self, st: ShmState, identity: bytes, h: wire.Header, ns: str, body: Bytes
    ) -> tuple[Buffers, int]:
        """PUT_INBOX: publish blocks the client wrote into its inbox; (the answer,
        payload bytes stored). Each block is copied into a reserved slot and hashed
        there, in the worker's own copy, and committed only if that matches the sum
        the writer sent; otherwise aborted (PUT_CORRUPT, the key stays absent). The
        slots are held only while this frame is served, within the connection's budget."""
        entries = list(wire.INBOX_ENTRY.iter_unpack(body))
        sizes = [e[1] for e in entries]
        most = self.inboxes.size if self.inboxes is not None else 0
        with refusing(h):  # a malformed frame is INVALID_ARGUMENT, whoever sent it
            self.core.check_sizes(sizes)
            for i, (_, size, _, off) in enumerate(entries):
                if off + size > most:
                    raise InvalidArgument(f"block {i} lies outside the inbox ({most} bytes)")
        inbox = self.inboxes.get(identity) if self.inboxes is not None and identity else None
        if inbox is None:  # never handed over, or its client closed the hand-over since
            raise Refused(
                h,
                Unavailable(
                    "PUT_INBOX on a connection without an inbox (its AUTH identity has none:"
                    " the client's hand-over closed?): put over tcp://"
                ),
            )
        status = bytearray(h.count)
        nbytes = sum(sizes)
        if not st.holder.take(nbytes, h.count, wait=0.5, whole=True):
            status[:] = bytes([wire.PUT_FULL]) * h.count
            return [ok_answer(h, h.count, self.store.arena.tag), status], 0
        try:
            slots = self.store.reserve_many(
                ns,
                [e[0] for e in entries],
                sizes,
                [e[2] for e in entries],
                hinted=bool(h.flags_or_code & wire.FLAG_SESSION),
            )
            at = [i for i, s in enumerate(slots) if isinstance(s, Block)]
            blocks = [s for s in slots if isinstance(s, Block)]
            for i, s in enumerate(slots):
                if not isinstance(s, Block):
                    status[i] = put_status(s)
            arena = self._arena
            jobs = [
                partial(
                    copy_sum,
                    arena[b.offset : b.offset + entries[i][1]],
                    inbox[entries[i][3] : entries[i][3] + entries[i][1]],
                )
                for i, b in zip(at, blocks, strict=True)
            ]
            try:
                # Over the copy pool when the frame is big (kvstore_client.verified).
                sums = verified.run(jobs, sum(b.size for b in blocks))
                ok = [got == entries[i][2] for i, got in zip(at, sums, strict=True)]
            except BaseException:
                self.store.finish_many(blocks, [False] * len(blocks))  # nothing published
                raise
            good = self.store.finish_many(blocks, ok)
            bad = 0
            for i, g in zip(at, good, strict=True):
                status[i] = wire.PUT_STORED if g else wire.PUT_CORRUPT
                bad += not g
            if bad:
                self.store.count_inbox_mismatches(bad)
        finally:
            st.holder.give(nbytes, h.count)
        head = ok_answer(h, h.count, self.store.arena.tag)
        return [head, status], sum(b.size for b, g in zip(blocks, good, strict=True) if g)


__all__ = ["ArenaShare", "Inboxes", "LocAnswer", "ShmServer", "ShmState"]
