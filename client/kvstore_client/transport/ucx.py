"""Client half of the ucx:// transfer plane: UCX through the ``ucxx`` bindings.

Optional (``pip install 'kvstore-cache[ucx]'``): ``ucxx`` is imported on first use only,
so ``kvstore_client`` imports fine without it; :func:`available` tells whether it
loads. On RDMA hardware UCX moves the payloads with rc/dc verbs (zero-copy); without
it, over its tcp transport. See docs/UCX.md.

Framing. The frames are those of :mod:`kvstore_client.wire` (same headers, entries,
statuses), cut into UCX tag messages on one endpoint, in order:

    request = header (20 bytes)
              | namespace + body        (one message; its size follows from the header)
              | one message per payload (PUT; zero-length payloads are not sent)
    answer  = header (20 bytes)
              | body                    (one message, absent when empty; on an error
                                         answer, ``count`` bytes of UTF-8 message)
              | one message per payload (GET hits; zero-length payloads are not sent)

With tenants, an endpoint's first frame is AUTH: header (ns_len 0, count = token
length) | the token; the answer is a header (OK, or UNAUTHENTICATED and closed).

Every size is known before its message arrives, so the receiver posts a buffer of
exactly that size: payloads land straight in their destination (an arena slot on
the worker, the caller's buffer on the client), never in an intermediate copy.
Only PUT, GET, EXISTS and REMOVE are served; the shm:// ops are not.

Packed payloads (wire.FLAG_PACKED, :func:`packs`): a frame of many small payload
messages sends them back to back instead (a PUT with the flag; a GET answer tagged
TAG_PACKED when the client asked and the hits fit in wire.MAX_PACKED), as a stream of
PACK_CHUNK-byte messages (one message up to PACK_CHUNK bytes; :mod:`.ucxcodec`),
copied through chunk buffers leased from the process's :class:`StagingPool`
(:func:`send_packed`, :func:`recv_packed`): each message costs a rendezvous and the
event loop's hand-offs, a copy of a small block much less (docs/UCX.md).

Identity: a pool made with the client's identity (kvstore_client.security) sends AUTH
with wire.FLAG_IDENTITY on every endpoint, so the worker counts what the client holds
over all its endpoints (and transports) together, never per endpoint or address.

Threads. ucxx is asyncio-based; one daemon thread per process runs an event loop that
owns the UCX context (:class:`UcxRuntime`, shared by the client and the worker's server
in the same process). UCX progress defaults to ucxx's ``thread`` mode with Python
futures in client processes (nothing polls; about half the CPU per GiB of the other
modes here) and to ``blocking`` mode in a process that serves ucx:// (ucxx's thread
mode can crash when a listener closes); see :func:`progress_settings`. Blocking callers
hand coroutines to the loop and wait for them with a deadline.

Transfers. kvstore's UCP context uses UCX's ``put_zcopy`` rendezvous
(:data:`UCX_OPTIONS`; a ``UCX_*`` variable of the same name wins): a big message is
written from the sender's buffer straight into the receiver's. A receiver posts all
of a frame's payload receives at once and checks each block (xxh3) as soon as its
messages have landed, while the later ones still arrive (:func:`recv_blocks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

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
from ..keys import from_bitmap
from ..verified import GetResult, Landing
from .pins import Remote
from .registry import Credentials, Scheme, register
from .ucxcodec import (
    ERROR_MAX,
    MAX_PART_ENTRIES,
    PACK_BELOW,
    PACK_CHUNK,
    PACK_WINDOW,
    StagingPool,
    Unpacker,
    copy_into,
    packs,
    part_tables,
    read_part_counts,
    slices,
    split_sizes,
)
from .ucxruntime import (
    CONNECT_TIMEOUT,
    DOWN_FOR,
    SCHEME,
    UcxRuntime,
    abort,
    available,
    progress_settings,
    recv_all,
    recv_blocks,
    recv_packed,
    send_all,
    send_packed,
)
from .where import WhereSupport, unknown_tier, where_or_exists

R = TypeVar("R")
Buffer = bytes | bytearray | memoryview


# ---- the client -----------------------------------------------------------------------


class UcxConnection:
    """One UCX endpoint to a worker's ucx:// listener; one call at a time (the pool's).

    The methods are coroutines for the runtime's loop; their contracts are those of
    :class:`~kvstore_client.transport.tcp.TcpConnection`'s methods of the same names.
    """

    def __init__(self, ep: Any, staging: StagingPool) -> None:
        self.ep = ep
        self._req = 0
        self._scratch = bytearray(0)
        self._staging = staging

    @classmethod
    async def open(
        cls,
        rt: UcxRuntime,
        host: str,
        port: int,
        timeout: float,
        token: str = "",
        identity: bytes = b"",
    ) -> UcxConnection:
        """Connect (name lookup included) within ``timeout``, then authenticate with
        ``token`` and ``identity`` when given (AUTH, wire.FLAG_IDENTITY with an
        identity); OSError/TimeoutError/UCX errors on failure, the worker's error
        (Unauthenticated) when it refuses the token."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addr = str(infos[0][4][0])
        ep = await asyncio.wait_for(
            rt.ucxx.create_endpoint(addr, port, connect_timeout=timeout), timeout
        )
        conn = cls(ep, rt.staging)
        if token or identity:
            try:
                await asyncio.wait_for(conn.auth(token, identity), timeout)
            except BaseException:
                conn.abort()
                raise
        return conn

    async def auth(self, token: str, identity: bytes) -> None:
        """AUTH: the token, and with FLAG_IDENTITY the client's identity before it."""
        raw = identity + token.encode()
        flags = wire.FLAG_IDENTITY if identity else 0
        self._req += 1
        head = wire.HEADER.pack(wire.REQ_MAGIC, wire.OP_AUTH, flags, 0, len(raw), self._req)
        await self._exchange(wire.OP_AUTH, [head, raw])

    @property
    def closed(self) -> bool:
        try:
            return bool(self.ep.closed)
        except Exception:
            return True

    def abort(self) -> None:
        abort(self.ep)

    def _discard_buffer(self, size: int) -> memoryview:
        if len(self._scratch) < size:
            self._scratch = bytearray(size)
        return memoryview(self._scratch)[:size]

    async def _exchange(
        self,
        op: int,
        parts: Sequence[Buffer],
        packed: tuple[Sequence[Buffer], int] | None = None,
    ) -> wire.Header:
        """Send a request's messages (then, with ``packed``, its payloads and their
        total as a packed stream) and receive its answer header (posted first, so an
        error the worker answers before closing wins over the failed send it causes)."""
        answer = asyncio.ensure_future(self._answer(op, self._req))
        try:
            if packed is None:
                await send_all(self.ep, parts)
            else:
                await send_packed(self.ep, parts, packed[0], packed[1], self._staging)
        except asyncio.CancelledError:
            answer.cancel()
            raise
        except Exception:
            await asyncio.wait({answer}, timeout=0.5)
            if answer.done() and not answer.cancelled():
                err = answer.exception()
                if isinstance(err, KVStoreError):
                    raise err from None
            answer.cancel()
            raise
        return await answer

    async def _answer(self, op: int, req_id: int) -> wire.Header:
        head = bytearray(wire.HEADER_LEN)
        await self.ep.recv(head)
        h = wire.decode_header(head, wire.ANS_MAGIC)
        if h.req_id != req_id or h.op != op:
            raise ProtocolError(f"answer for request {h.req_id}/{h.op}, expected {req_id}/{op}")
        if h.flags_or_code:
            msg = bytearray(min(h.count, ERROR_MAX))
            await recv_all(self.ep, [msg])
            raise from_code(h.flags_or_code, msg.decode(errors="replace"))
        return h

    async def _body(self, n: int) -> bytearray:
        buf = bytearray(n)
        await recv_all(self.ep, [buf])
        return buf

    async def put(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        session: int = 0,
    ) -> bytes:
        """Send one PUT frame; returns one wire.PUT_* status byte per block. Blocks given
        as several parts go as one message per part (wire.FLAG_PARTS frame); many small
        messages (:func:`packs`) go packed into one instead (wire.FLAG_PACKED).
        ``session``: wire.FLAG_SESSION or 0."""
        self._req += 1
        entries = bytearray(len(hashes) * wire.PUT_ENTRY.size)
        for i, (key, v, c) in enumerate(zip(hashes, values, checksums, strict=True)):
            wire.PUT_ENTRY.pack_into(entries, i * wire.PUT_ENTRY.size, key, wire.block_size(v), c)
        payloads = wire.flat_buffers(values)
        if packs(payloads):  # many small messages: copied into a few big ones instead
            flags = wire.FLAG_PACKED | (session & wire.FLAG_SESSION)
            head = wire.HEADER.pack(
                wire.REQ_MAGIC, wire.OP_PUT, flags, len(ns), len(hashes), self._req
            )
            total = sum(wire.block_size(v) for v in values)
            h = await self._exchange(wire.OP_PUT, [head, ns + entries], (payloads, total))
        else:
            parts = wire.FLAG_PARTS if _has_parts(values) else 0
            flags = parts | (session & wire.FLAG_SESSION)
            head = wire.HEADER.pack(
                wire.REQ_MAGIC, wire.OP_PUT, flags, len(ns), len(hashes), self._req
            )
            msgs: list[Buffer] = [head, ns + entries]
            if parts:
                counts, sizes = part_tables(values)
                msgs = [head, ns + entries + counts, sizes]
            h = await self._exchange(wire.OP_PUT, [*msgs, *payloads])
        if h.count != len(hashes):
            raise ProtocolError(f"{h.count} statuses for {len(hashes)} blocks")
        return bytes(await self._body(h.count))

    async def get(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        """One GET frame. With ``buffers``, hits land in them (a hit whose size differs
        from its buffer is received and dropped, and reported as a miss). Blocks given
        as several parts: a FLAG_PARTS frame, so the worker sends a hit of the parts'
        total size as one message per part, landing in the parts directly. Many small
        blocks or parts (:func:`packs`): a FLAG_PACKED frame, whose hits the worker
        may send back to back in one message (TAG_PACKED), copied out here."""
        packed = wire.FLAG_PACKED if buffers is not None and packs(buffers) else 0
        if buffers is not None and _has_parts(buffers):
            self._req += 1
            counts, sizes = part_tables(buffers)
            flags = wire.FLAG_PARTS | packed  # the tables serve an answer not packed
            head = wire.HEADER.pack(
                wire.REQ_MAGIC, wire.OP_GET, flags, len(ns), len(hashes), self._req
            )
            body = b"".join([ns, *hashes, counts])
            h = await self._exchange(wire.OP_GET, [head, body, sizes])
        else:
            h = await self._simple(wire.OP_GET, ns, hashes, packed)
        if h.count != len(hashes):
            raise ProtocolError(f"{h.count} entries for {len(hashes)} hashes")
        meta = await self._body(h.count * wire.GET_ENTRY.size)
        if h.ns_len == wire.TAG_PACKED:
            return await self._unpack(list(wire.GET_ENTRY.iter_unpack(meta)), buffers)
        land = Landing(buffers, h.count)
        landing: list[Sequence[memoryview | bytearray]] = []  # per hit, its messages
        checks: list[tuple[int, wire.Block, int] | None] = []  # (index, block, xxh3)
        entries = list(wire.GET_ENTRY.iter_unpack(meta))
        biggest_drop = max(
            (
                size
                for i, (status, size, _) in enumerate(entries)
                if status == wire.GET_HIT
                and buffers is not None
                and wire.block_size(buffers[i]) != size
            ),
            default=0,
        )
        drop = self._discard_buffer(biggest_drop)
        for i, (status, size, checksum) in enumerate(entries):
            if status != wire.GET_HIT:
                continue
            dest = land.dest(i, size)
            if dest is None:
                landing.append([drop[:size]])  # dropped: concurrent landings do not matter
                checks.append(None)
            else:
                landing.append(dest if isinstance(dest, list) else [cast(bytearray, dest)])
                checks.append((i, dest, checksum))

        def landed(k: int) -> None:  # a hit is checked while the next ones arrive
            check = checks[k]
            if check is not None:
                land.check(*check)

        await recv_blocks(self.ep, landing, landed)
        return land.result()

    async def _unpack(
        self,
        entries: list[tuple[int, int, int]],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        """The hits of a TAG_PACKED answer: a packed stream, copied chunk by chunk into
        their buffers (a hit whose size differs from its buffer is dropped) and each
        verified there, in the caller's memory, once complete."""
        total = sum(size for status, size, _ in entries if status == wire.GET_HIT)
        if total > wire.MAX_PACKED:
            raise ProtocolError(f"a packed answer of {total} bytes")
        land = Landing(buffers, len(entries))
        dests: list[list[memoryview] | None] = []
        sizes: list[int] = []
        checks: list[tuple[int, wire.Block, int] | None] = []  # per hit: (index, block, xxh3)
        for i, (status, size, checksum) in enumerate(entries):
            if status != wire.GET_HIT:
                continue
            sizes.append(size)
            dest = land.dest(i, size)
            if dest is None:
                dests.append(None)  # dropped
                checks.append(None)
            else:
                dests.append([memoryview(p).cast("B") for p in wire.block_parts(dest)])
                checks.append((i, dest, checksum))

        def landed(k: int) -> None:  # a hit is checked while the next chunks arrive
            check = checks[k]
            if check is not None:
                land.check(*check)

        await recv_packed(self.ep, total, Unpacker(dests, sizes), self._staging, landed)
        return land.result()

    async def exists(self, ns: bytes, hashes: Sequence[bytes]) -> list[bool]:
        """One EXISTS frame: per hash, whether the worker holds it."""
        h = await self._simple(wire.OP_EXISTS, ns, hashes)
        if h.count != len(hashes):
            raise ProtocolError(f"{h.count} flags for {len(hashes)} hashes")
        bitmap = await self._body((h.count + 7) // 8)
        return from_bitmap(bytes(bitmap), h.count)

    async def where(self, ns: bytes, hashes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """One EXISTS frame with FLAG_WHERE: per hash a ``wire.WHERE_*`` code (a plain
        bitmap answer gives WHERE_UNKNOWN hits; see TcpConnection.recv_where)."""
        h = await self._simple(wire.OP_EXISTS, ns, hashes, wire.FLAG_WHERE)
        if h.count != len(hashes):
            raise ProtocolError(f"{h.count} flags for {len(hashes)} hashes")
        nb = (h.count + 7) // 8
        if h.ns_len == wire.TAG_WHERE:  # the two bitmaps come as one message
            return wire.decode_where(await self._body(2 * nb), h.count)
        return unknown_tier(from_bitmap(bytes(await self._body(nb)), h.count))

    async def remove(self, ns: bytes, hashes: Sequence[bytes]) -> int:
        """One REMOVE frame; returns how many of the hashes were present."""
        return (await self._simple(wire.OP_REMOVE, ns, hashes)).count

    async def _simple(
        self, op: int, ns: bytes, hashes: Sequence[bytes], flags: int = 0
    ) -> wire.Header:
        self._req += 1
        head = wire.HEADER.pack(wire.REQ_MAGIC, op, flags, len(ns), len(hashes), self._req)
        return await self._exchange(op, [head, b"".join([ns, *hashes])])


class UcxPool(Remote):
    """Endpoints to one worker's ucx:// listener, opened on demand and reused.

    Same contract as :class:`~kvstore_client.transport.tcp.TcpPool`: a failed or
    timed-out call closes its endpoint and raises Unavailable or DeadlineExceeded
    (the Client turns those into misses); errors the worker answers (InvalidArgument,
    Unauthenticated, PermissionDenied, ...) are raised as they are. With ``token``,
    every new endpoint authenticates first (AUTH frame). No TLS: UCX does not encrypt.
    Thread-safe.
    """

    def __init__(
        self, host: str, port: int, *, max_idle: int = 8, token: str = "", identity: bytes = b""
    ) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.identity = identity  # b"" once a worker that predates identities refused it
        self.where_support = WhereSupport()  # whether the worker is sent FLAG_WHERE
        self.max_idle = max_idle
        self._idle: list[UcxConnection] = []  # touched on the runtime's loop only
        self._closed = False
        self.down_until = 0.0  # after a connect failure, fail fast for a moment

    def call(self, timeout: float, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """Run ``await fn(connection, *args)`` on a pooled endpoint within ``timeout``."""
        if self._closed:
            raise Unavailable(f"ucx pool to {self.host}:{self.port} is closed")
        if time.monotonic() < self.down_until:
            raise Unavailable(f"worker {self.host}:{self.port} was unreachable a moment ago")
        rt = UcxRuntime.get()
        return rt.run(self._call(rt, max(timeout, 0.001), fn, args), timeout + 5.0)

    async def _call(
        self, rt: UcxRuntime, timeout: float, fn: Callable[..., Awaitable[R]], args: Any
    ) -> R:
        where = f"ucx://{self.host}:{self.port}"
        deadline = time.monotonic() + timeout
        conn = None
        while self._idle and conn is None:
            c = self._idle.pop()
            if c.closed:
                c.abort()
            else:
                conn = c
        if conn is None:
            try:
                conn = await self._open(rt, min(timeout, CONNECT_TIMEOUT))
            except KVStoreError as e:
                if isinstance(e, ProtocolError):
                    raise Unavailable(f"{where}: {e}") from e
                raise  # the worker refused the token: the caller's mistake, not a miss
            except Exception as e:  # refused, unreachable, name lookup, handshake
                self.down_until = time.monotonic() + DOWN_FOR
                raise Unavailable(f"cannot connect to {where}: {e!r}") from e
        try:
            result = await asyncio.wait_for(fn(conn, *args), max(deadline - time.monotonic(), 0))
        except BaseException as e:  # UCX errors, cancellation: the endpoint is unusable
            conn.abort()
            err = from_transport_error(e, where)
            if err is e:
                raise
            raise err from e
        if not self._closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.abort()
        return result

    async def _open(self, rt: UcxRuntime, wait: float) -> UcxConnection:
        try:
            return await UcxConnection.open(
                rt, self.host, self.port, wait, self.token, self.identity
            )
        except Unauthenticated:
            if not (self.identity and self.token):
                raise
        # A worker that predates identities reads the identity as part of the token
        # (with tenants: unknown). Its endpoints go without one (each its own account).
        conn = await UcxConnection.open(rt, self.host, self.port, wait, self.token)
        self.identity = b""
        return conn

    def put(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        flags: int = 0,
    ) -> bytes:
        """PUT one batch: one wire.PUT_* status byte per block (see TcpConnection.put)."""
        return self.call(timeout, UcxConnection.put, ns, hashes, values, checksums, flags)

    def get(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[memoryview | list[memoryview]] | None,
    ) -> GetResult:
        """GET one batch, into ``buffers`` when given (see TcpConnection.get)."""
        return self.call(timeout, UcxConnection.get, ns, hashes, buffers)

    def exists(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> list[bool]:
        """Per hash, whether the worker holds it."""
        return self.call(timeout, UcxConnection.exists, ns, hashes)

    def where(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """Per hash a ``wire.WHERE_*`` code; WHERE_UNKNOWN hits from a worker that
        predates FLAG_WHERE (see :mod:`.where`)."""
        return where_or_exists(
            self.where_support,
            lambda: self.call(timeout, UcxConnection.where, ns, hashes),
            lambda: self.call(timeout, UcxConnection.exists, ns, hashes),
        )

    def remove(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> int:
        """Remove blocks; returns how many were present."""
        return self.call(timeout, UcxConnection.remove, ns, hashes)

    def close(self) -> None:
        """Close idle endpoints; later calls raise Unavailable. Idempotent."""
        if self._closed:
            return
        self._closed = True
        rt = UcxRuntime.started()
        if rt is None:
            return

        async def drain() -> None:
            idle, self._idle = self._idle, []
            for c in idle:
                c.abort()

        with contextlib.suppress(Exception):
            rt.run(drain(), 5.0)


def _has_parts(blocks: Sequence[object]) -> bool:
    return any(isinstance(b, list) and len(b) != 1 for b in blocks)


def parse_ucx_url(url: str) -> tuple[str, int]:
    """``ucx://host:port`` -> (host, port); ValueError when malformed."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not a ucx:// URL: {url}")
    host, _, port = url[len(SCHEME) :].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad ucx:// URL {url!r}: want ucx://host:port")
    return host.strip("[]"), int(port)


def ucx_url(host: str, port: int) -> str:
    """The endpoint a worker advertises for its ucx:// listener."""
    return f"{SCHEME}[{host}]:{port}" if ":" in host else f"{SCHEME}{host}:{port}"


def find_ucx_url(endpoints: Sequence[str]) -> str:
    """The first ucx:// endpoint of a worker's advertised list, or ""."""
    return next((e for e in endpoints if e.startswith(SCHEME)), "")


def _open(url: str, endpoints: Sequence[str], creds: Credentials) -> UcxPool:
    host, port = parse_ucx_url(url)
    return UcxPool(host, port, token=creds.token, identity=creds.identity)


# Only when asked for (transport="ucx"); the pool is the worker's transfer.
register(Scheme("ucx", 2, lambda choice: choice == "ucx", _open, lambda pool, base, info: pool))


__all__ = [
    "ERROR_MAX",
    "MAX_PART_ENTRIES",
    "PACK_BELOW",
    "PACK_CHUNK",
    "PACK_WINDOW",
    "GetResult",
    "StagingPool",
    "UcxConnection",
    "UcxPool",
    "UcxRuntime",
    "Unpacker",
    "available",
    "copy_into",
    "find_ucx_url",
    "packs",
    "parse_ucx_url",
    "part_tables",
    "read_part_counts",
    "recv_all",
    "recv_blocks",
    "recv_packed",
    "send_all",
    "send_packed",
    "slices",
    "split_sizes",
    "ucx_url",
]


# The runtime's names that callers of this module use (kept importable from here).
__all__ = [
    "SCHEME",
    "UcxConnection",
    "UcxPool",
    "UcxRuntime",
    "abort",
    "available",
    "find_ucx_url",
    "parse_ucx_url",
    "progress_settings",
    "send_all",
    "ucx_url",
]
