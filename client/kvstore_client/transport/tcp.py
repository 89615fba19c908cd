"""Client half of the tcp:// transfer plane (codec in kvstore_client.wire).

A :class:`TcpPool` keeps a few connections to one worker; each call borrows one
for a whole batch (one round trip), so concurrent calls use several at once.
Any socket error or timeout closes that connection and raises Unavailable or
DeadlineExceeded; the Client turns those into misses.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .. import wire
from ..errors import (
    KVStoreError,
    ProtocolError,
    Unauthenticated,
    Unavailable,
    from_code,
    from_transport_error,
)
from ..keys import HASH_LEN, from_bitmap
from ..security import Tls, wrap_client_socket
from ..verified import GetResult, Landing
from .pins import Remote
from .registry import Credentials, Scheme, register
from .where import WhereSupport, unknown_tier, where_or_exists

SOCK_BUF = 4 << 20
R = TypeVar("R")


def recv_block(sock: socket.socket, dest: wire.Block) -> None:
    """Fill a block's buffer (or its parts, scattered) from the socket."""
    if isinstance(dest, list):
        wire.recv_into_parts(sock, dest)
    else:
        wire.recv_into_exact(sock, dest if isinstance(dest, memoryview) else memoryview(dest))


class TcpConnection:
    """One blocking connection; not thread-safe (the pool hands it to one caller)."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        tls: Tls | None = None,
        token: str = "",
        identity: bytes = b"",
    ) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        self._req = 0
        # a scratch buffer to read and drop unwanted payload bytes into
        self.scratch = memoryview(bytearray(1 << 16))
        try:
            self.sock = wrap_client_socket(sock, tls, host)
            if token or identity:
                self._auth(token, identity)
        except BaseException:
            sock.close()
            raise

    def _auth(self, token: str, identity: bytes) -> None:
        """AUTH: the token, and with FLAG_IDENTITY the client's identity before it."""
        raw = identity + token.encode()
        flags = wire.FLAG_IDENTITY if identity else 0
        self._req += 1
        head = wire.encode_request_header(wire.OP_AUTH, b"", len(raw), self._req, flags)
        wire.send_buffers(self.sock, [head, raw])
        self.answer(wire.OP_AUTH, self._req)

    def close(self) -> None:
        self.sock.close()

    def next_req(self) -> int:
        """A new request id on this connection (frames built elsewhere, e.g. the shm://
        and inbox codecs, number their requests here)."""
        self._req += 1
        return self._req

    @property
    def req(self) -> int:
        """The id of the last request sent."""
        return self._req

    def answer(self, op: int, req_id: int) -> wire.Header:
        """Read the header of the answer to request ``req_id`` (``op``); a worker's
        error code is raised as its :class:`~kvstore_client.errors.KVStoreError`."""
        head = wire.recv_exact(self.sock, wire.HEADER_LEN)
        h = wire.decode_header(head, wire.ANS_MAGIC)
        if h.req_id != req_id or h.op != op:
            raise ProtocolError(f"answer for request {h.req_id}/{h.op}, expected {req_id}/{op}")
        if h.flags_or_code:
            msg = wire.recv_exact(self.sock, min(h.count, 1 << 16)).decode(errors="replace")
            raise from_code(h.flags_or_code, msg)
        return h

    _answer = answer  # the name tests reading raw frames use

    def put(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        flags: int = 0,
    ) -> bytes:
        """Send one PUT frame; returns one wire.PUT_* status byte per block. A block given
        as parts goes out as one value (``sendmsg`` over the part list, no join).
        ``flags``: wire.FLAG_SESSION or 0."""
        self._req += 1
        entries = bytearray(len(hashes) * wire.PUT_ENTRY.size)
        for i, (key, v, c) in enumerate(zip(hashes, values, checksums, strict=True)):
            wire.PUT_ENTRY.pack_into(entries, i * wire.PUT_ENTRY.size, key, wire.block_size(v), c)
        head = wire.encode_request_header(wire.OP_PUT, ns, len(hashes), self._req, flags)
        wire.send_buffers(self.sock, [head, entries, *wire.flat_buffers(values)])
        h = self.answer(wire.OP_PUT, self._req)
        return bytes(wire.recv_exact(self.sock, h.count))

    def get(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        """One GET frame. With ``buffers`` (per block one view, or a list of part views),
        hits land in them (a hit whose size differs from its buffer's total is read and
        dropped, and reported as a miss); a block's checksum is checked over its parts."""
        self._req += 1
        head = wire.encode_request_header(wire.OP_GET, ns, len(hashes), self._req)
        wire.send_buffers(self.sock, [head, b"".join(hashes)])
        h = self.answer(wire.OP_GET, self._req)
        meta = wire.recv_exact(self.sock, h.count * wire.GET_ENTRY.size)
        # Big blocks are verified on the copy pool while the next one is received
        # (kvstore_client.verified); the answer is complete when every check is in.
        land = Landing(buffers, h.count)
        for i, (status, size, checksum) in enumerate(wire.GET_ENTRY.iter_unpack(meta)):
            if status != wire.GET_HIT:
                continue
            dest = land.dest(i, size)
            if dest is None:
                wire.discard(self.sock, size, self.scratch)
                continue
            recv_block(self.sock, dest)
            land.check(i, dest, checksum, size)
        return land.result()

    def exists(self, ns: bytes, hashes: Sequence[bytes]) -> list[bool]:
        self.send_exists(ns, b"".join(hashes), len(hashes))
        flags: list[bool] = self.recv_exists().tolist()
        return flags

    def send_exists(self, ns: bytes, packed: bytes, count: int, flags: int = 0) -> None:
        """First half of EXISTS (so one thread can have requests out to many workers);
        ``flags``: wire.FLAG_PREFIX to ask only for the leading run (see recv_prefix)."""
        self._req += 1
        head = wire.encode_request_header(wire.OP_EXISTS, ns, count, self._req, flags)
        wire.send_buffers(self.sock, [head, packed])

    def recv_prefix(self, count: int) -> int:
        """Second half of an EXISTS sent with FLAG_PREFIX for ``count`` hashes: how
        many leading ones the worker holds. A worker that predates the flag answers
        with the whole bitmap; its leading run is taken here."""
        h = self.answer(wire.OP_EXISTS, self._req)
        if h.ns_len == wire.TAG_RUN:
            if h.count > count:
                raise ProtocolError(f"prefix answer {h.count} for {count} hashes")
            return h.count
        if h.count != count:
            raise ProtocolError(f"EXISTS answer for {h.count} hashes, sent {count}")
        bitmap = wire.recv_exact(self.sock, (count + 7) // 8)
        flags = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=count, bitorder="little")
        return count if flags.all() else int(np.argmin(flags))

    def where(self, ns: bytes, hashes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """One EXISTS with FLAG_WHERE: per hash a ``wire.WHERE_*`` code (see
        :mod:`.where` for a worker that refuses the flag)."""
        self.send_exists(ns, b"".join(hashes), len(hashes), wire.FLAG_WHERE)
        return self.recv_where(len(hashes))

    def recv_where(self, count: int) -> npt.NDArray[np.uint8]:
        """Second half of an EXISTS for ``count`` hashes: per hash a ``wire.WHERE_*``
        code. A TAG_WHERE answer tells the tiers apart; a plain bitmap (an EXISTS sent
        without FLAG_WHERE, or a worker that ignored it) gives WHERE_UNKNOWN hits."""
        h = self.answer(wire.OP_EXISTS, self._req)
        if h.count != count:
            raise ProtocolError(f"EXISTS answer for {h.count} hashes, sent {count}")
        nb = (count + 7) // 8
        if h.ns_len == wire.TAG_WHERE:
            return wire.decode_where(wire.recv_exact(self.sock, 2 * nb), count)
        return unknown_tier(from_bitmap(bytes(wire.recv_exact(self.sock, nb)), count))

    def recv_exists(self) -> np.ndarray:
        """Second half of EXISTS: a bool array, one flag per hash sent."""
        h = self.answer(wire.OP_EXISTS, self._req)
        bitmap = wire.recv_exact(self.sock, (h.count + 7) // 8)
        return np.unpackbits(
            np.frombuffer(bitmap, dtype=np.uint8), count=h.count, bitorder="little"
        ).astype(bool)

    def remove(self, ns: bytes, hashes: Sequence[bytes]) -> int:
        self._req += 1
        head = wire.encode_request_header(wire.OP_REMOVE, ns, len(hashes), self._req)
        wire.send_buffers(self.sock, [head, b"".join(hashes)])
        return self.answer(wire.OP_REMOVE, self._req).count


class TcpPool:
    """Connections to one worker's tcp:// endpoint, opened on demand."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_idle: int = 8,
        tls: Tls | None = None,
        token: str = "",
        identity: bytes = b"",
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.token = token
        self.identity = identity  # b"" once a worker that predates identities refused it
        self.where_support = WhereSupport()  # whether the worker is sent FLAG_WHERE
        self.max_idle = max_idle
        self._idle: list[TcpConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.down_until = 0.0  # after a connect failure, fail fast for a moment
        self._leased: set[TcpConnection] = set()  # held by a lease (see transport.pins)

    def take(self, timeout: float) -> TcpConnection:
        """Borrow a connection (opened on demand); give it back with :meth:`give`.

        An idle connection with something to read before any request was closed by
        the worker (its idle timeout, a restart): it is dropped, not reused.
        """
        while True:
            with self._lock:
                if self._closed:
                    raise Unavailable(f"connection pool to {self.host}:{self.port} is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not _readable(conn.sock):
                return conn
            conn.close()
        if time.monotonic() < self.down_until:
            raise Unavailable(f"worker {self.host}:{self.port} was unreachable a moment ago")
        try:
            return self._connect(timeout)
        except OSError as e:
            self.down_until = time.monotonic() + 0.5
            raise Unavailable(f"cannot connect to {self.host}:{self.port}: {e}") from e

    def _connect(self, timeout: float) -> TcpConnection:
        try:
            return TcpConnection(self.host, self.port, timeout, self.tls, self.token, self.identity)
        except Unauthenticated:
            if not (self.identity and self.token):
                raise
        # A worker that predates identities reads the identity as part of the token
        # (with tenants: unknown). Its connections go without one (bounded per
        # connection there, as before).
        conn = TcpConnection(self.host, self.port, timeout, self.tls, self.token)
        self.identity = b""
        return conn

    def give(self, conn: TcpConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()  # closing releases on the worker whatever the connection held

    def call(self, timeout: float, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(connection, *args)`` on a pooled connection within ``timeout``."""
        conn = self.take(timeout)
        conn.sock.settimeout(max(timeout, 0.001))
        try:
            result = fn(conn, *args)
        except (KVStoreError, OSError) as e:  # TimeoutError is an OSError
            conn.close()
            err = from_transport_error(e, f"{self.host}:{self.port}")
            if err is e:
                raise
            raise err from e
        self.give(conn)
        return result

    def lease(self, timeout: float) -> TcpConnection:
        """Borrow a connection for longer than one call (a pin lease): closing the
        pool closes it too. End the lease with :meth:`end_lease`."""
        conn = self.take(timeout)
        with self._lock:
            self._leased.add(conn)
        return conn

    def end_lease(self, conn: TcpConnection, keep: bool) -> None:
        """The lease of ``conn`` is over: back to the pool (``keep``) or closed."""
        with self._lock:
            self._leased.discard(conn)
        if keep:
            self.give(conn)
        else:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            leased, self._leased = list(self._leased), set()
        for c in [*idle, *leased]:  # closing releases what a lease still holds
            c.close()


def _readable(sock: socket.socket) -> bool:
    """True if a read would not block: EOF, a reset, or bytes nobody asked for."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(0))


def parse_tcp_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port)."""
    if not url.startswith("tcp://"):
        raise ValueError(f"not a tcp:// URL: {url}")
    host, _, port = url[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


class TcpTransfer(Remote):
    """The :class:`~kvstore_client.transport.Transfer` of a tcp:// worker: one pooled
    connection per call."""

    def __init__(self, pool: TcpPool) -> None:
        self.pool = pool

    @property
    def control(self) -> TcpPool:
        """The worker's tcp:// pool: a fan-out sends lookups over it, every worker's
        request out before any answer is read."""
        return self.pool

    def put(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        flags: int = 0,
    ) -> bytes:
        return self.pool.call(timeout, TcpConnection.put, ns, hashes, values, checksums, flags)

    def get(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        return self.pool.call(timeout, TcpConnection.get, ns, hashes, buffers)

    def exists(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> list[bool]:
        return self.pool.call(timeout, TcpConnection.exists, ns, hashes)

    def where(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """Per hash a ``wire.WHERE_*`` code; WHERE_UNKNOWN hits from a worker that
        predates FLAG_WHERE (see :mod:`.where`)."""
        pool = self.pool
        return where_or_exists(
            pool.where_support,
            lambda: pool.call(timeout, TcpConnection.where, ns, hashes),
            lambda: pool.call(timeout, TcpConnection.exists, ns, hashes),
        )

    def remove(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> int:
        return self.pool.call(timeout, TcpConnection.remove, ns, hashes)


def _open(url: str, endpoints: Sequence[str], creds: Credentials) -> TcpPool:
    host, port = parse_tcp_url(url) if url else ("", 0)
    return TcpPool(host, port, tls=creds.tls, token=creds.token, identity=creds.identity)


# The base of every link: always opened; its transfer when no other scheme applies.
register(Scheme("tcp", 0, lambda choice: True, _open, lambda pool, base, info: TcpTransfer(pool)))

__all__ = ["HASH_LEN", "GetResult", "TcpConnection", "TcpPool", "TcpTransfer", "parse_tcp_url"]
