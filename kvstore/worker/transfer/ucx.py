"""Server half of the ucx:// transfer plane: UCX through the ``ucxx`` bindings.

Framing and threading are described in :mod:`kvstore_client.transport.ucx`: wire.py
frames cut into UCX tag messages, served on the process's UCX event loop thread.
PUT payloads are received straight into reserved arena slots (``reserve_many`` ->
slot view -> UCX receive -> xxh3 check -> ``finish_many``); GET payloads are sent
from the zero-copy views ``store.read`` returns and released with ``store.done``
once UCX reports the sends complete (or the endpoint is aborted).

A malformed frame gets an error answer where one can be framed, then that endpoint
is closed and counted in ``store.counters.bad_frames``; every other endpoint keeps
being served. Optional: constructing a server raises Unavailable without ucxx.

UCX's listener binds every interface of the host (ucxx takes no bind address), so
``host`` is informational; restrict the interfaces UCX uses with ``UCX_NET_DEVICES``
and firewall the port (docs/UCX.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any

import xxhash

from kvstore_client import wire
from kvstore_client.errors import (
    InvalidArgument,
    KVStoreError,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore_client.keys import HASH_LEN, to_bitmap
from kvstore_client.transport.ucx import (
    ERROR_MAX,
    SERVED_OPS,
    UcxRuntime,
    abort,
    body_len,
    read_part_counts,
    recv_all,
    send_all,
    slices,
    split_sizes,
)

from ...auth import Tenant, Tenants
from ..requests import Holder, Limits, RequestCore, put_status
from ..store import BlockStore
from ..tiers.dram import Block
from .observe import observe_frame

log = logging.getLogger(__name__)


class UcxTransferServer:
    """Serves PUT/GET/EXISTS/REMOVE frames over UCX against a BlockStore.

    ``port`` 0 lets UCX pick a free port; :attr:`port` is the bound one, known once
    the constructor returns (which also starts listening; endpoints that connect
    before :meth:`start` wait for it). Timeouts, limits and ``tenants`` mean what they
    mean for :class:`~kvstore.worker.transfer.tcp.TcpTransferServer`: with tenants, an
    endpoint's first frame must be AUTH with a known token, and a frame for a namespace
    its tenant does not own is answered PERMISSION_DENIED and closes the endpoint. There
    is no TLS and no per-client connection limit (ucxx does not tell the peer's address).
    """

    def __init__(
        self,
        store: BlockStore,
        host: str,
        port: int,
        *,
        max_connections: int = 1024,
        idle_timeout: float = 300.0,
        frame_timeout: float = 30.0,
        max_batch: int = wire.MAX_BATCH,
        on_bytes: Callable[[str, str, int], None] | None = None,
        on_request: Callable[[str, str, float], None] | None = None,
        tenants: Tenants | None = None,
        core: RequestCore | None = None,
    ) -> None:
        self.store = store
        self.core = core or RequestCore(
            Limits.for_arena(store.tier.capacity, store.max_value_size, max_batch=max_batch),
            tenants,
        )
        self.tenants = self.core.tenants
        self.host = host
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self.on_bytes = on_bytes  # ("ucx", direction, payload bytes)
        self.on_request = on_request  # (op, status code name, seconds) per served frame
        self.rejected_connections = 0
        self._rt = UcxRuntime.get(server=True)
        if self._rt.mode.startswith("thread"):
            log.warning(
                "ucx:// server in a %r-mode UCX runtime: ucxx may crash when the listener "
                "closes while peers connect; start it first or set UCXPY_PROGRESS_MODE="
                "blocking",
                self._rt.mode,
            )
        self._truncated: type[Exception] = self._rt.ucxx.exceptions.UCXMessageTruncatedError
        self._eps: dict[Any, bool] = {}  # endpoint -> in the middle of a frame
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._scratch = memoryview(bytearray(0))
        # Budget per endpoint; ucxx does not tell the peer's address, so all ucx://
        # endpoints share one client account.
        self._holders: dict[Any, Holder] = {}
        self._started: asyncio.Event | None = None
        self._listener: Any = None
        try:
            self.port: int = self._rt.run(self._listen(port), 30.0)
        except Exception as e:  # port in use, no usable interface, ...
            raise Unavailable(f"cannot listen for ucx:// on port {port}: {e!r}") from e

    # ---- lifetime (called from any thread but the UCX loop) ------------------

    async def _listen(self, port: int) -> int:
        self._started = asyncio.Event()
        self._listener = self._rt.ucxx.create_listener(self._accept, port)
        return int(self._listener.port)

    def healthy(self) -> bool:
        """True while the listener is up (the worker stops heartbeating otherwise)."""
        return self._listener is not None and not self._stopping

    def start(self) -> None:
        """Begin serving frames."""

        async def go() -> None:
            assert self._started is not None
            self._started.set()

        self._rt.run(go(), 10.0)

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let frames in flight finish for ``grace`` seconds, then close
        every endpoint. Idempotent."""
        with contextlib.suppress(KVStoreError):
            self._rt.run(self._stop(grace), grace + 10.0)

    async def _stop(self, grace: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._started is not None:
            self._started.set()  # endpoints waiting for start() see _stopping and leave
        for ep, busy in list(self._eps.items()):
            if not busy:
                abort(ep)  # wakes the idle reader
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(self._eps.values()) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for ep in list(self._eps):
            abort(ep)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._listener is not None:
            deadline = loop.time() + 2.0  # let ucxx retire its handlers (and handshakes)
            while self._listener.active_clients and loop.time() < deadline:
                await asyncio.sleep(0.01)
            log.debug("ucx listener closing, %d handlers left", self._listener.active_clients)
            self._listener.close()
            self._listener = None
            # Endpoints accepted by the listener keep it alive until they are collected
            # (ucxx's finalizers hold them); collect now so the port closes now.
            gc.collect()
            await asyncio.sleep(0.05)

    # ---- endpoints (on the UCX loop) -----------------------------------------

    async def _accept(self, ep: Any) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._serve(ep)
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _serve(self, ep: Any) -> None:
        if self._stopping or len(self._eps) >= self.max_connections:
            self.rejected_connections += 1
            abort(ep)
            return
        self._eps[ep] = False
        self._holders[ep] = self.core.budget.holder("ucx://")
        try:
            assert self._started is not None
            await self._started.wait()
            tenant = None
            if self.tenants is not None:
                tenant = await asyncio.wait_for(self._authenticate(ep), self.frame_timeout)
            first = tenant is None
            while not self._stopping:
                head = bytearray(wire.HEADER_LEN)
                await asyncio.wait_for(ep.recv(head), self.idle_timeout)
                self._eps[ep] = True
                await asyncio.wait_for(self._frame(ep, head, tenant, first), self.frame_timeout)
                self._eps[ep] = False
                first = False
        except ProtocolError as e:
            self.store.counters.bad_frames += 1
            log.info("closing ucx endpoint after a bad frame: %s", e)
        except self._truncated:
            self.store.counters.bad_frames += 1  # a message longer than its frame said
            log.info("closing ucx endpoint after a message longer than announced")
        except (TimeoutError, self._rt.ucx_error, ConnectionError):
            pass  # idle, stalled or gone: just close
        except asyncio.CancelledError:
            pass
        except Exception:  # never let one endpoint take the daemon down
            log.exception("ucx transfer endpoint failed")
        finally:
            self._eps.pop(ep, None)
            held = self._holders.pop(ep, None)
            if held is not None:
                held.close()
            abort(ep)

    async def _authenticate(self, ep: Any) -> Tenant:
        """The first frame must be AUTH (count = token length, body = the token)."""
        assert self.tenants is not None
        head = bytearray(wire.HEADER_LEN)
        await ep.recv(head)
        h = wire.decode_header(head, wire.REQ_MAGIC)
        if h.op != wire.OP_AUTH or h.count > wire.MAX_TOKEN:
            err: KVStoreError = Unauthenticated("the first frame must be AUTH with a token")
            await self._fail(ep, h, err)
            raise ProtocolError(str(err))
        token = bytearray(h.count)
        await recv_all(ep, [token])
        try:
            tenant = self.tenants.authenticate(token.decode(errors="replace"))
        except Unauthenticated as e:
            await self._fail(ep, h, e)
            raise ProtocolError(str(e)) from e
        await send_all(ep, [wire.encode_answer_header(h.op, 0, 0, h.req_id)])
        return tenant

    async def _frame(self, ep: Any, head: bytearray, tenant: Tenant | None, first: bool) -> None:
        h = wire.decode_header(head, wire.REQ_MAGIC)
        if h.op == wire.OP_AUTH:  # without tenants: accepted (any token) as the first frame
            if not first or h.count > wire.MAX_TOKEN:
                raise ProtocolError("AUTH is only valid as the first frame")
            await recv_all(ep, [bytearray(h.count)])
            await send_all(ep, [wire.encode_answer_header(h.op, 0, 0, h.req_id)])
            return
        if h.ns_len == 0 or h.ns_len > 255:
            raise ProtocolError(f"namespace length {h.ns_len} out of range")
        if h.op not in SERVED_OPS:
            await self._fail(ep, h, InvalidArgument(f"op {h.op} is not served over ucx://"))
            raise ProtocolError(f"op {h.op} is not served over ucx://")
        try:
            self.core.check_batch(h.count)
        except InvalidArgument as e:
            await self._fail(ep, h, e)
            raise ProtocolError(str(e)) from e
        if h.flags_or_code & ~(wire.FLAG_PARTS | wire.FLAG_SESSION) or (
            h.flags_or_code and h.op not in (wire.OP_PUT, wire.OP_GET)
        ):
            raise ProtocolError(f"bad flags {h.flags_or_code} for op {h.op}")
        body = bytearray(h.ns_len + body_len(h.op, h.count, h.flags_or_code))
        await ep.recv(body)
        try:
            ns = self.core.admit(tenant, body[: h.ns_len])
        except KVStoreError as e:
            await self._fail(ep, h, e)
            raise ProtocolError(str(e)) from e
        with observe_frame(self.on_request, h.op):
            await self._dispatch(ep, h, ns, memoryview(body)[h.ns_len :])

    async def _dispatch(self, ep: Any, h: wire.Header, ns: str, rest: memoryview) -> None:
        parts: list[list[int]] | None = None
        if h.flags_or_code & wire.FLAG_PARTS:  # a part count per block, then the sizes
            cut = len(rest) - 4 * h.count
            counts = read_part_counts(rest[cut:])
            rest = rest[:cut]
            table = bytearray(4 * sum(counts))
            await recv_all(ep, [table])
            parts = split_sizes(counts, table)
        if h.op == wire.OP_PUT:
            await self._put(ep, h, ns, rest, parts)
        elif h.op == wire.OP_GET:
            await self._get(ep, h, ns, _hashes(rest), parts)
        elif h.op == wire.OP_EXISTS:
            bitmap = to_bitmap(self.store.exists(ns, _hashes(rest)))
            await send_all(ep, [wire.encode_answer_header(h.op, 0, h.count, h.req_id), bitmap])
        else:  # OP_REMOVE
            n = self.store.remove(ns, _hashes(rest))
            await send_all(ep, [wire.encode_answer_header(h.op, 0, n, h.req_id)])

    async def _fail(self, ep: Any, h: wire.Header, err: KVStoreError) -> None:
        msg = str(err).encode()[:ERROR_MAX]
        head = wire.encode_answer_header(h.op, int(err.code), len(msg), h.req_id)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(send_all(ep, [head, msg]), 1.0)

    def _discard_buffer(self, size: int) -> memoryview:
        # One landing area for every payload that is received only to be dropped: UCX
        # may fill it from several endpoints at once, which does not matter.
        if len(self._scratch) < size:
            self._scratch = memoryview(bytearray(size))
        return self._scratch[:size]

    async def _put(
        self, ep: Any, h: wire.Header, ns: str, raw: memoryview, parts: list[list[int]] | None
    ) -> None:
        """PUT; with ``parts`` (per block its part sizes, adding up to its size) each
        block arrives as one message per part, landing in consecutive slot slices."""
        entries = list(wire.PUT_ENTRY.iter_unpack(raw))
        try:
            self.core.check_sizes([e[1] for e in entries])
            if parts is not None and any(
                sum(p) != e[1] for p, e in zip(parts, entries, strict=True)
            ):
                raise InvalidArgument("part sizes do not add up to their block's size")
        except InvalidArgument as e:
            await self._fail(ep, h, e)
            raise ProtocolError(str(e)) from e
        # The whole frame lands at once (UCX tag messages): it reserves within the
        # worker's budget for ucx:// senders, or is refused as full.
        declared = sum(e[1] for e in entries)
        holder = self._holders[ep]
        slots: list[Block | ResourceExhausted | None]
        if holder.take(declared):
            slots = self.store.reserve_many(
                ns,
                [e[0] for e in entries],
                [e[1] for e in entries],
                [e[2] for e in entries],
                hinted=bool(h.flags_or_code & wire.FLAG_SESSION),
            )
        else:
            declared = 0
            slots = [ResourceExhausted("transfer budget exhausted")] * len(entries)
        reserved = [s for s in slots if isinstance(s, Block)]
        status = bytearray(h.count)
        ok: list[bool] = []
        total = 0
        try:
            dests: list[memoryview] = []
            lands: list[memoryview] = []
            for i, ((_, size, _), slot) in enumerate(zip(entries, slots, strict=True)):
                total += size
                dest = (
                    self.store.view(slot) if isinstance(slot, Block) else self._discard_buffer(size)
                )
                dests.append(dest)
                if parts is not None and len(parts[i]) > 1:
                    lands.extend(slices(dest, parts[i]))
                else:
                    lands.append(dest)
            await recv_all(ep, lands)
            for i, ((_, _, checksum), slot, dest) in enumerate(
                zip(entries, slots, dests, strict=True)
            ):
                if isinstance(slot, Block):
                    good = xxhash.xxh3_64_intdigest(dest) == checksum
                    ok.append(good)
                    status[i] = wire.PUT_STORED if good else wire.PUT_CORRUPT
                    if not good:
                        self.store.counters.checksum_errors += 1
                else:
                    status[i] = put_status(slot)
        except BaseException:
            # The sender vanished or stalled mid-frame: cancel what UCX still has
            # posted into the slots, and none of its blocks become visible.
            abort(ep)
            self.store.finish_many(reserved, [False] * len(reserved))
            holder.give(declared)
            raise
        self.store.finish_many(reserved, ok)
        holder.give(declared)
        if self.on_bytes is not None:
            self.on_bytes("ucx", "rx", total)
        await send_all(ep, [wire.encode_answer_header(h.op, 0, h.count, h.req_id), status])

    async def _get(
        self, ep: Any, h: wire.Header, ns: str, keys: list[bytes], parts: list[list[int]] | None
    ) -> None:
        """GET; with ``parts`` (the reader's part sizes per block) a hit whose size is
        their sum goes out as one message per part, any other hit as one message."""
        # DRAM blocks are verified by the reader against the checksum sent with them.
        reading = self.store.read(ns, keys, verify_dram=False)
        total = 0
        try:
            try:
                self.core.check_answer(reading.payload_bytes, inline=False)
            except InvalidArgument as e:
                await self._fail(ep, h, e)
                raise ProtocolError(str(e)) from e
            held = reading.held
            meta, views, total = wire.encode_get_entries(
                [(x.view, x.checksum) if x is not None else None for x in held]
            )
            if parts is not None:
                views = []
                for x, p in zip(held, parts, strict=True):
                    if x is None:
                        continue
                    v = memoryview(x.view).cast("B")
                    split = len(p) > 1 and sum(p) == v.nbytes
                    views.extend(slices(v, p) if split else [v])
            head = wire.encode_answer_header(h.op, 0, h.count, h.req_id)
            await send_all(ep, [head, meta, *views])
        except BaseException:
            abort(ep)  # no send may still read the views once they are released
            raise
        finally:
            self.store.done(reading)
        if self.on_bytes is not None:
            self.on_bytes("ucx", "tx", total)


def _hashes(raw: memoryview) -> list[bytes]:
    b = bytes(raw)
    return [b[i : i + HASH_LEN] for i in range(0, len(b), HASH_LEN)]
