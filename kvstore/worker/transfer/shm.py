"""Server half of the shm:// transport: hand the arena over, hand out locations, pin, commit.

The arena is an anonymous memfd (worker/arena.py). :class:`ArenaShare` listens on a
Unix socket (mode 0600, in the shm directory) and hands the arena's descriptor to
same-host clients with SCM_RIGHTS, with the arena's identity and size; a client maps
only what the live worker handed it, never a path from the map. Such a client copies
bytes directly; the worker only answers where blocks live (over the tcp:// control
connection; every LOC answer carries the arena's 16-bit tag in its header) and keeps
them from being freed or reused while a copy is in flight. Blocks that are not in the
arena (SSD hits) come back inline.

The client is trusted with the checksums it reports for shm writes (it can
write the whole arena anyway); every read is verified by the reader.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore_client import wire
from kvstore_client.errors import (
    InvalidArgument,
    ProtocolError,
    ResourceExhausted,
)
from kvstore_client.keys import split_hashes

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


class ArenaShare:
    """Hands the arena's descriptor to same-host clients over a Unix socket.

    The socket file is ``DIR/kvstore-PID-ID.sock`` with mode 0600 (the worker's user
    only; the peer's uid is checked again with SO_PEERCRED). Each connection gets one
    message, ``wire.SHM_HELLO`` (magic, arena id, size), with the descriptors
    attached: the arena, and once :meth:`attach` gave it the same-host index
    (:mod:`kvstore.worker.tiers.shared`), the index (read-only) and a hazard page of
    the client's own. The connection then stays open: it is how the worker learns
    the client is gone (its end closes with its process), and drops its page, which
    releases whatever it pinned. The same thread runs the index's upkeep every
    ``UPKEEP`` seconds. :meth:`close` removes the socket file.
    """

    UPKEEP = 0.02
    MAX_CLIENTS = 1024  # more get the arena alone (no index, no pins of their own)

    def __init__(self, arena: Arena, directory: str) -> None:
        self.arena = arena
        self.index: SharedIndex | None = None
        self._upkeep: Callable[[], None] | None = None
        sweep_stale(directory)
        self.path = os.path.join(directory, f"{SHM_PREFIX}{os.getpid()}-{arena.id}.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(self.path)
        except BaseException:
            self._sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shm-share", daemon=True)
        self._thread.start()

    def attach(self, index: SharedIndex, upkeep: Callable[[], None]) -> None:
        """Hand ``index`` to clients from now on; ``upkeep`` (the store's, under its
        lock) runs on this thread every UPKEEP seconds and when a client leaves."""
        self._upkeep = upkeep
        self.index = index

    def _loop(self) -> None:
        hello = wire.encode_shm_hello(self.arena.id, self.arena.size)
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
                if key.data is None:
                    self._accept(hello, me)
                else:
                    self._gone(key.fileobj, key.data)  # type: ignore[arg-type]
            now = time.monotonic()
            if self._upkeep is not None and now >= next_upkeep:
                next_upkeep = now + self.UPKEEP
                try:
                    self._upkeep()
                except Exception as e:  # the hand-over must go on
                    log.warning("same-host index upkeep failed: %s", e)

    def _accept(self, hello: bytes, me: int) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        cid = 0
        try:
            conn.settimeout(2.0)
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(cred[4:8], "little")
            if uid not in (me, 0):
                conn.close()
                return
            fds = [self.arena.fd]
            index = self.index
            if index is not None and len(index.pages) < self.MAX_CLIENTS:
                cid, page = index.add_client()
                fds += [index.ro_fd, page]
            socket.send_fds(conn, [hello], fds)
            if not cid:
                conn.close()
                return
            conn.setblocking(False)
            self._sel.register(conn, selectors.EVENT_READ, cid)
        except (BrokenPipeError, ConnectionResetError) as e:
            # A peer that only checked the socket is alive (another worker's
            # sweep_stale at its start) and left: routine, not worth a log line.
            log.debug("shm hand-over: the peer left first (%s)", e)
            self._drop(conn, cid)
        except Exception as e:  # one client must not stop the hand-over for others
            log.warning("shm hand-over failed: %s", e)
            self._drop(conn, cid)

    def _gone(self, conn: socket.socket, cid: int) -> None:
        """A client's connection is readable: it closed (or sent garbage, which
        nothing asks for): either way it is done."""
        with contextlib.suppress(OSError):
            self._sel.unregister(conn)
        self._drop(conn, cid)
        if self._upkeep is not None:
            self._upkeep()  # release what it held now, not at the next tick

    def _drop(self, conn: socket.socket, cid: int) -> None:
        if cid and self.index is not None:
            self.index.drop_client(cid)
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
            if key.data:
                self._drop(key.fileobj, key.data)  # type: ignore[arg-type]
        self._sel.close()


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
    """One unreleased LOC request: what it pins or reserves, and the budget it holds."""

    reading: Reading | None
    slots: list[Block | ResourceExhausted | None]
    nbytes: int
    entries: int
    late: bool = False  # PUT_LOC with FLAG_LATE_SUM: the commit brings the checksums


@dataclass(slots=True)
class ShmState:
    """What one connection holds: pinned reads and reserved slots, by request id, within
    the connection's budget (bytes and entries, see worker.requests)."""

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
    """The server half of shm:// over a connection's frames: answers where blocks
    live (pinned until RELEASE), reserves slots for same-host writers and commits them.

    Pure bookkeeping over the frame core: the tcp:// server reads each frame's body,
    calls the op here and sends what it returns. Every LOC answer carries the arena's
    16-bit tag in its header. INVALID_ARGUMENT and RESOURCE_EXHAUSTED are answered
    (:class:`~kvstore.worker.transfer.frames.Refused`); a frame that breaks the
    protocol (an unknown commit, too many open requests) raises ProtocolError.
    """

    def __init__(self, store: BlockStore, core: RequestCore) -> None:
        self.store = store
        self.core = core

    def state(self, holder: Holder) -> ShmState:
        """What a new connection holds: nothing, within ``holder``'s budget."""
        return ShmState(holder)

    def close(self, st: ShmState) -> None:
        """The connection is gone: release its pins, abort its reservations."""
        for req in list(st.open):
            self._release(st, req)

    def release(self, st: ShmState, h: wire.Header) -> None:
        """RELEASE (one-way): give back the request ``h.req_id`` of this connection, if open."""
        self._release(st, h.req_id)

    def _release(self, st: ShmState, req: int) -> bool:
        o = st.open.pop(req, None)
        if o is None:
            return False
        if o.reading is not None:
            self.store.done(o.reading)
        blocks = [b for b in o.slots if isinstance(b, Block)]
        if blocks:
            self.store.finish_many(blocks, [False] * len(blocks))
        st.holder.give(o.nbytes, o.entries)
        return True

    def _check_new(self, st: ShmState, h: wire.Header) -> None:
        """At most max_open_requests per connection (ProtocolError); and a request id
        names one open request: a LOC request that reuses the id of one still open is
        refused (INVALID_ARGUMENT, then the connection closes and gives back everything
        it holds), so no pin or reservation is ever orphaned by an overwritten entry."""
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
        st.open[h.req_id] = _Open(reading, [], pinned, h.count)
        head = ok_answer(h, h.count, store.arena.tag)
        return LocAnswer(store, reading, [head, meta, *inline], sum(len(v) for v in inline))

    def put_loc(self, st: ShmState, h: wire.Header, ns: str, body: Bytes) -> Buffers:
        """PUT_LOC: reserve slots for a same-host writer, within the connection's budget:
        entries over it are answered full (the client writes them over tcp:// or not at all)."""
        self._check_new(st, h)
        entries = list(wire.PUT_ENTRY.iter_unpack(body))
        with refusing(h):
            self.core.check_sizes([e[1] for e in entries])
        nbytes = sum(e[1] for e in entries)
        slots: list[Block | ResourceExhausted | None]
        if st.holder.take(nbytes, h.count, wait=0.5):
            slots = self.store.reserve_many(
                ns,
                [e[0] for e in entries],
                [e[1] for e in entries],
                [e[2] for e in entries],
                hinted=bool(h.flags_or_code & wire.FLAG_SESSION),
            )
        else:
            nbytes = 0
            slots = [ResourceExhausted("shm reservation budget exhausted")] * h.count
            st.holder.take(0, h.count)
        answer = bytearray(h.count * wire.PUT_LOC_ENTRY.size)
        for i, s in enumerate(slots):
            off = i * wire.PUT_LOC_ENTRY.size
            if isinstance(s, Block):
                wire.PUT_LOC_ENTRY.pack_into(answer, off, wire.PUT_LOC_SLOT, s.offset)
            else:
                wire.PUT_LOC_ENTRY.pack_into(answer, off, put_status(s), 0)
        late = bool(h.flags_or_code & wire.FLAG_LATE_SUM)
        st.open[h.req_id] = _Open(None, slots, nbytes, h.count, late)
        return [ok_answer(h, h.count, self.store.arena.tag), answer]

    def put_commit(self, st: ShmState, h: wire.Header, body: Bytes) -> tuple[Buffers, int]:
        """PUT_COMMIT: commit the slots the client wrote; (the answer, payload bytes
        committed). ``body``: an ok byte per slot, then with FLAG_LATE_SUM (as on its
        PUT_LOC) the checksums. Until the body is in, the reservation stays with the
        connection, so a peer that vanishes before has it aborted by :meth:`close`."""
        o = st.open.get(h.req_id)
        late = bool(h.flags_or_code & wire.FLAG_LATE_SUM)
        if o is None or o.reading is not None or len(o.slots) != h.count or o.late != late:
            raise ProtocolError(f"PUT_COMMIT for unknown or mismatched request {h.req_id}")
        flags = bytes(body[: h.count])
        sums: list[int] | None = None
        if late:
            sums = [c for (c,) in wire.SUMS.iter_unpack(body[h.count :])]
        del st.open[h.req_id]
        blocks: list[Block] = []
        ok: list[bool] = []
        at: list[int] = []
        status = bytearray(h.count)
        for i, (s, f) in enumerate(zip(o.slots, flags, strict=True)):
            if isinstance(s, Block):
                blocks.append(s)
                ok.append(bool(f))
                at.append(i)
            else:
                status[i] = put_status(s)
        late_sums = None if sums is None else [sums[i] for i in at]
        ok = self.store.finish_many(blocks, ok, late_sums)
        for i, good in zip(at, ok, strict=True):
            status[i] = wire.PUT_STORED if good else wire.PUT_CORRUPT
        st.holder.give(o.nbytes, o.entries)
        head = ok_answer(h, h.count, self.store.arena.tag)
        return [head, status], sum(b.size for b, good in zip(blocks, ok, strict=True) if good)
