"""Server half of the tcp:// transfer plane (codec in kvstore_client.wire).

One thread per connection with blocking sockets: socket calls release the GIL,
payloads go from the socket straight into arena slots (``recv_into``) and out
of them with ``sendmsg`` of memoryviews. A malformed frame gets an error answer
where one can be framed, then the connection is closed and counted; every other
connection keeps being served.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import select
import socket
import ssl
import sys
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore_client import wire
from kvstore_client.errors import ProtocolError

from ...auth import Tenants
from ..requests import RequestCore
from ..store import BlockStore
from .frames import TCP_OPS, FrameCore, Peer, Refused, observe_frame, own_core
from .shm import Inboxes, ShmServer, ShmState

_CONNS = itertools.count(1)  # names budget accounts of connections that gave no identity
log = logging.getLogger(__name__)

SOCK_BUF = 4 << 20
SCRATCH = 1 << 20


@dataclass(slots=True)
class _Conn:
    """One served connection: its socket, the core's view of it, its shm holdings."""

    conn: socket.socket
    scratch: list[memoryview]  # allocated by the first PUT that must skip bytes
    peer: Peer
    shm: ShmState


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY and large buffers on a data connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


DRAIN_BYTES = 256 << 20
FIRST_BYTES = 256 << 10  # a put reserves a block once this much of it has arrived


def _arrived(sock: socket.socket, size: int, timeout: float) -> int:
    """Wait until min(``size``, FIRST_BYTES) payload bytes have arrived (or ``timeout``:
    TimeoutError); returns the bytes waiting in the socket. Plain sockets only (TLS
    cannot tell its buffered plaintext): those return ``size`` at once."""
    if isinstance(sock, ssl.SSLSocket) or size <= 0:
        return size
    want = min(size, FIRST_BYTES)
    buf = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    have = int.from_bytes(buf, sys.byteorder)
    if have < want:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        try:
            poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            if not poller.poll(int(timeout * 1000)):
                raise TimeoutError("a put's payload did not arrive")
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
        have = int.from_bytes(buf, sys.byteorder)
    return have


def _drain(sock: socket.socket, seconds: float, limit: int = DRAIN_BYTES) -> None:
    """Close a refused connection gracefully: stop sending (the error answer is out),
    then read and drop what the peer still sends (a refused frame's body) for up to
    ``seconds`` and ``limit`` bytes. Closing with unread bytes would reset the
    connection, and a client still sending its body would see the reset instead of
    the error it was sent."""
    deadline = time.monotonic() + seconds
    scratch = memoryview(bytearray(1 << 16))
    got = 0
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        while got < limit:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            n = sock.recv_into(scratch)
            if not n:
                return
            got += n


class TcpTransferServer:
    """Serves PUT/GET/EXISTS/REMOVE frames and the shm:// control frames against a
    BlockStore: every check and decision is the frame core's (:mod:`.frames`); this
    class reads and sends bytes."""

    def __init__(
        self,
        store: BlockStore,
        host: str,
        port: int,
        *,
        max_connections: int = 1024,
        idle_timeout: float = 300.0,
        frame_timeout: float = 30.0,
        max_per_client: int = 256,
        on_bytes: Callable[[str, str, int], None] | None = None,
        on_request: Callable[[str, str, float], None] | None = None,
        on_bad_frame: Callable[[str], None] | None = None,
        tenants: Tenants | None = None,
        ssl_context: ssl.SSLContext | None = None,
        core: RequestCore | None = None,
        inboxes: Inboxes | None = None,
    ) -> None:
        self.store = store
        # Admission, limits and budgets: the worker passes the one core all its servers
        # share (its tenants with it); a server built alone (tests) makes its own.
        self.core = own_core(store, core, tenants)
        self.tenants = self.core.tenants
        self.frames = FrameCore(store, self.core, TCP_OPS, "tcp")
        self.shm = ShmServer(store, self.core, inboxes)  # inboxes: same-host writers
        self.ssl_context = ssl_context
        self.max_per_client = max_per_client
        self._per_client: dict[str, int] = {}
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self.on_bytes = on_bytes  # (transport, direction, payload bytes)
        self.on_request = on_request  # (op, status code name, seconds) per served frame
        self.on_bad_frame = on_bad_frame  # (transport) per connection closed for a bad frame
        self._sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        # Per connection: (in a frame?, since when). A frame (and the TLS handshake and
        # AUTH) must end within frame_timeout: a reaper enforces it, as socket timeouts
        # restart with every byte. At the connection limit, the connection that has
        # waited longest for its next frame makes room for a new one.
        self._since: dict[socket.socket, tuple[bool, float]] = {}
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True)
        self._reaper = threading.Thread(target=self._reap_loop, name="tcp-reaper", daemon=True)
        self.rejected_connections = 0

    def start(self) -> None:
        self._thread.start()
        self._reaper.start()

    def healthy(self) -> bool:
        """True while the accept loop runs: a worker whose data plane stopped serving
        must stop heartbeating, so that it leaves the map instead of timing out clients."""
        return self._thread.is_alive() and not self._stopping.is_set()

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let frames in flight finish for ``grace`` seconds, then close."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:  # wake idle readers; a frame in progress still completes its send
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RD)
        self._thread.join(timeout=grace)

    # ---- connections ---------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept connections until stopped; no exception ends this loop (a peer that
        resets before it is accepted, fd exhaustion, a thread that cannot start)."""
        while not self._stopping.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError as e:
                if self._stopping.is_set():
                    return
                # EMFILE/ENFILE/ENOBUFS/ECONNABORTED...: back off a moment, keep serving.
                log.warning("accept failed: %s", e)
                self._stopping.wait(0.05)
                continue
            try:
                self._admit(conn, str(addr[0]) if addr else "")
            except Exception:
                log.exception("could not admit a transfer connection")
                with contextlib.suppress(OSError):
                    conn.close()

    def _admit(self, conn: socket.socket, peer: str) -> None:
        with self._conns_lock:
            full = len(self._conns) >= self.max_connections
            victim = self._longest_idle() if full else None
            if (full and victim is None) or self._per_client.get(peer, 0) >= self.max_per_client:
                self.rejected_connections += 1
                conn.close()
                return
            if victim is not None:  # its thread sees EOF, cleans up and leaves
                self._since.pop(victim, None)
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)
            self._conns.add(conn)
            self._since[conn] = (True, time.monotonic())
            self._per_client[peer] = self._per_client.get(peer, 0) + 1
        try:
            threading.Thread(
                target=self._serve, args=(conn, peer), name="tcp-conn", daemon=True
            ).start()
        except BaseException:
            self._forget(conn, peer)
            raise

    def _forget(self, raw: socket.socket, peer: str) -> None:
        with self._conns_lock:
            self._conns.discard(raw)
            self._since.pop(raw, None)
            left = self._per_client.get(peer, 1) - 1
            if left:
                self._per_client[peer] = left
            else:
                self._per_client.pop(peer, None)

    def _serve(self, raw: socket.socket, peer: str) -> None:
        # Its own budget account until AUTH names the client (never the address).
        p = self.frames.peer(f"conn:{peer}:{raw.fileno()}:{next(_CONNS)}")
        st = _Conn(raw, [], p, self.shm.state(p.holder))
        conn = raw
        try:
            tune_socket(raw)
            if self.ssl_context is not None:
                raw.settimeout(self.frame_timeout)
                conn = st.conn = self.ssl_context.wrap_socket(raw, server_side=True)
            if self.tenants is not None:  # AUTH within frame_timeout (the reaper's clock)
                conn.settimeout(self.frame_timeout)
                self._frame(st, wire.recv_exact(conn, wire.HEADER_LEN))
            while not self._stopping.is_set():
                self._mark(raw, busy=False)
                conn.settimeout(self.idle_timeout)
                first = conn.recv(wire.HEADER_LEN)
                if not first:
                    return
                self._mark(raw, busy=True)
                conn.settimeout(self.frame_timeout)
                head = bytearray(first)
                if len(head) < wire.HEADER_LEN:
                    head += wire.recv_exact(conn, wire.HEADER_LEN - len(head))
                self._frame(st, head)
        except ProtocolError as e:
            self._bad_frame()
            log.info("closing connection after a bad frame: %s", e)
            if isinstance(e, Refused):
                with contextlib.suppress(OSError):
                    wire.send_buffers(conn, e.answer())
            if conn is raw:
                _drain(raw, min(2.0, self.frame_timeout))
        except (TimeoutError, ConnectionError, OSError):
            pass  # idle, stalled or gone: just close
        except Exception:  # never let one connection take the daemon down
            log.exception("transfer connection failed")
        finally:
            self.shm.close(st.shm)
            p.holder.close()
            self._forget(raw, peer)
            with contextlib.suppress(OSError):
                conn.close()

    def _mark(self, conn: socket.socket, *, busy: bool) -> None:
        # No lock: a set lookup and a dict store are atomic, and only this connection's
        # thread marks it. Racing the reaper or a connection-limit eviction (both pop the
        # entry, then shut the socket down) can at worst put an entry back for a socket
        # that is already shut: its thread sees the error and _forget removes it.
        if conn in self._conns:
            self._since[conn] = (busy, time.monotonic())

    def _longest_idle(self) -> socket.socket | None:
        """The connection waiting longest for its next frame (caller holds the lock)."""
        idle = [(t, c) for c, (busy, t) in self._since.items() if not busy]
        return min(idle, key=lambda x: x[0])[1] if idle else None

    def _reap_loop(self) -> None:
        """Close connections whose current frame outlived frame_timeout (slow senders
        and slow readers alike): their blocked recv or send returns and the thread ends."""
        step = min(1.0, max(0.05, self.frame_timeout / 4))
        while not self._stopping.wait(step):
            now = time.monotonic()
            with self._conns_lock:
                late = [
                    c
                    for c, (busy, t) in self._since.items()
                    if busy and now - t > self.frame_timeout
                ]
                for c in late:
                    self._since.pop(c, None)
            for c in late:
                log.info("closing a connection whose frame took over %.1fs", self.frame_timeout)
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)

    def _frame(self, st: _Conn, head: bytearray | bytes) -> None:
        """Serve one frame whose header was read (checks in the frame core's order)."""
        conn = st.conn
        h = self.frames.header(st.peer, head)
        if h.op == wire.OP_AUTH:
            token = wire.recv_exact(conn, h.count)
            conn.sendall(self.frames.authenticate(st.peer, h, token))
            return
        ns_raw = wire.recv_exact(conn, h.ns_len)
        if h.op == wire.OP_RELEASE:
            # One-way, and it only ever gives back what this connection holds (by its
            # request id): no namespace to admit, nothing to answer. It sits between a
            # client's reads, so it is kept off the per-frame accounting.
            self.shm.release(st.shm, h)
            return
        ns = self.frames.admit(st.peer, h, ns_raw)
        with observe_frame(self.on_request, h.op):
            if h.op == wire.OP_PUT:
                self._put(st, h, ns)
                return
            body = wire.recv_exact(conn, self.frames.body_len(h))
            if h.op == wire.OP_GET:
                self._get(conn, h, ns, body)
            elif h.op == wire.OP_EXISTS:
                wire.send_buffers(conn, self.frames.exists(h, ns, body))
            elif h.op == wire.OP_REMOVE:
                wire.send_buffers(conn, self.frames.remove(h, ns, body))
            elif h.op == wire.OP_GET_LOC:
                loc = self.shm.get_loc(st.shm, h, ns, body)
                try:
                    wire.send_buffers(conn, loc.buffers)
                finally:
                    loc.sent()
                self._count("shm", "tx", loc.inline)
            else:  # OP_PUT_INBOX
                answer, n = self.shm.put_inbox(st.shm, st.peer.identity, h, ns, body)
                wire.send_buffers(conn, answer)
                self._count("shm", "rx", n)

    def _bad_frame(self) -> None:
        self.store.counters.bad_frames += 1
        if self.on_bad_frame is not None:
            self.on_bad_frame("tcp")

    def _count(self, transport: str, direction: str, n: int) -> None:
        if self.on_bytes is not None and n:
            self.on_bytes(transport, direction, n)

    def _put(self, st: _Conn, h: wire.Header, ns: str) -> None:
        conn = st.conn
        plan = self.frames.put_plan(st.peer, h, ns, wire.recv_exact(conn, self.frames.body_len(h)))
        ahead_limit = self.core.limits.reserve_ahead
        wait = max(0.0, min(1.0, self.frame_timeout / 4))
        try:
            while not plan.done:
                # Reserve only for bytes that are coming: wait for the next block's
                # first FIRST_BYTES, then take the blocks that the bytes already here
                # plus FIRST_BYTES cover (at least one, at most reserve_ahead), within
                # the connection's, the client address's and the worker's budget. A
                # sender that declares blocks and sends nothing (or trickles) holds and
                # evicts nothing; one that stalls later holds about what it sent.
                size = plan.sizes[plan.next]
                in_hand = _arrived(conn, size, self.frame_timeout)
                end = plan.cut(min(ahead_limit, max(size, in_hand + FIRST_BYTES)))
                start = plan.next
                for i, dest in enumerate(plan.reserve(end, wait=wait)):
                    if dest is None:
                        if not st.scratch:
                            st.scratch.append(memoryview(bytearray(SCRATCH)))
                        wire.discard(conn, plan.sizes[start + i], st.scratch[0])
                    else:
                        wire.recv_into_exact(conn, dest)
                        plan.landed(i, dest)
                # Every block of this run is in: each becomes visible on its own.
                plan.finish()
        except BaseException:
            # The sender vanished mid-frame: blocks whose bytes did not all arrive are dropped.
            plan.abort()
            raise
        self._count("tcp", "rx", plan.total)
        wire.send_buffers(conn, plan.answer())

    def _get(self, conn: socket.socket, h: wire.Header, ns: str, body: bytearray) -> None:
        answer = self.frames.get_answer(h, ns, body)
        try:
            wire.send_buffers(conn, answer.buffers)
        finally:
            answer.close()
        self._count("tcp", "tx", answer.nbytes)
