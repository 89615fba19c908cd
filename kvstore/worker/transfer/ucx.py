"""Server half of the ucx:// transfer plane: UCX through the ``ucxx`` bindings.

Framing and threading are described in :mod:`kvstore_client.transport.ucx`: wire.py
frames cut into UCX tag messages, served on the process's UCX event loop thread.
PUT payloads are received straight into reserved arena slots (``reserve_many`` ->
slot view -> UCX receive -> xxh3 check -> ``finish_many``); GET payloads are sent
from the zero-copy views ``store.read`` returns and released with ``store.done``
once UCX reports the sends complete (or the endpoint is aborted).

Packed frames (wire.FLAG_PACKED) are copied through chunk buffers leased per frame from
one :class:`StagingPool` per server (``staging_bytes``, 64 MiB by default), not per
endpoint: however many clients read or write packed at once, the worker's staging
stays within that bound (a frame waits for its first buffer when all are leased), and
once no packed frame has run for a couple of seconds it gives the memory back.

A malformed frame gets an error answer where one can be framed, then that endpoint
is closed and counted in ``store.counters.bad_frames``; every other endpoint keeps
being served. Optional: constructing a server raises Unavailable without ucxx.

With a ``host`` other than a wildcard the server keeps to that address
(:mod:`.ucxbind`): UCX's network devices are limited to the host's interface, and an
endpoint whose connection arrived on another address is closed before any frame is
read (counted in ``rejected_connections``). UCX's connection manager itself still
listens on every address (ucxx takes no bind address; docs/UCX.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

from kvstore_client import wire
from kvstore_client.errors import KVStoreError, ProtocolError, Unavailable
from kvstore_client.transport.ucxcodec import StagingPool, Unpacker, slices
from kvstore_client.transport.ucxruntime import (
    UcxRuntime,
    abort,
    recv_all,
    recv_blocks,
    recv_packed,
    send_all,
    send_packed,
)

from ...auth import Tenants
from ..requests import RequestCore
from ..store import BlockStore
from .frames import UCX_OPS, FrameCore, Peer, PutPlan, Refused, observe_frame, own_core
from .ucxbind import WILDCARDS, LocalAddress, restrict_devices, same_address

_ENDPOINTS = itertools.count(1)  # names budget accounts of connections that gave no identity
log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # chunk buffers of packed frames, all endpoints together


class UcxTransferServer:
    """Serves PUT/GET/EXISTS/REMOVE frames over UCX against a BlockStore.

    ``port`` 0 lets UCX pick a free port; :attr:`port` is the bound one, known once
    the constructor returns (which also starts listening; endpoints that connect
    before :meth:`start` wait for it). Timeouts, limits and ``tenants`` mean what they
    mean for :class:`~kvstore.worker.transfer.tcp.TcpTransferServer`: with tenants, an
    endpoint's first frame must be AUTH with a known token, and a frame for a namespace
    its tenant does not own is answered PERMISSION_DENIED and closes the endpoint. There
    is no TLS and no per-client connection limit (ucxx does not tell the peer's address).
    ``staging_bytes``: the bound on the chunk buffers of packed frames (all endpoints).
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
        on_bytes: Callable[[str, str, int], None] | None = None,
        on_request: Callable[[str, str, float], None] | None = None,
        on_bad_frame: Callable[[str], None] | None = None,
        tenants: Tenants | None = None,
        core: RequestCore | None = None,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        self.store = store
        self.core = own_core(store, core, tenants)
        self.tenants = self.core.tenants
        self.frames = FrameCore(store, self.core, UCX_OPS, "ucx")
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self.on_bytes = on_bytes  # ("ucx", direction, payload bytes)
        self.on_request = on_request  # (op, status code name, seconds) per served frame
        self.on_bad_frame = on_bad_frame  # (transport) per connection closed for a bad frame
        self.rejected_connections = 0
        self.host = host
        self.device = restrict_devices(host)  # before UCX starts in this process
        self._local = LocalAddress() if host not in WILDCARDS else None
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
        self.staging = StagingPool(staging_bytes)  # used on the UCX loop only
        self._started: asyncio.Event | None = None
        self._listener: Any = None
        try:
            self.port: int = self._rt.run(self._listen(port), 30.0)
        except Exception as e:  # port in use, no usable interface, ...
            raise Unavailable(f"cannot listen for ucx:// on port {port}: {e!r}") from e
        if host not in WILDCARDS:
            log.info(
                "ucx:// on port %d serves connections to %s only (UCX devices: %s); UCX's "
                "connection manager listens on every address (docs/UCX.md)",
                self.port,
                host,
                os.environ.get("UCX_NET_DEVICES", "all"),
            )

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
        if self._local is not None:
            got = self._local.of(ep)
            if got is not None and not same_address(got, self.host):
                self.rejected_connections += 1
                log.info("ucx:// endpoint on %s closed: this worker serves %s", got, self.host)
                abort(ep)
                return
        self._eps[ep] = False
        # Budget per endpoint (an account of its own until AUTH names the client).
        p = self.frames.peer(f"ucx:{next(_ENDPOINTS)}")
        try:
            assert self._started is not None
            await self._started.wait()
            if self.tenants is not None:  # AUTH within frame_timeout
                head = bytearray(wire.HEADER_LEN)
                await asyncio.wait_for(ep.recv(head), self.frame_timeout)
                await asyncio.wait_for(self._frame(ep, p, head), self.frame_timeout)
            while not self._stopping:
                head = bytearray(wire.HEADER_LEN)
                await asyncio.wait_for(ep.recv(head), self.idle_timeout)
                self._eps[ep] = True
                await asyncio.wait_for(self._frame(ep, p, head), self.frame_timeout)
                self._eps[ep] = False
        except ProtocolError as e:
            self._bad_frame()
            log.info("closing ucx endpoint after a bad frame: %s", e)
            if isinstance(e, Refused):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(send_all(ep, e.answer()), 1.0)
        except self._truncated:
            self._bad_frame()  # a message longer than its frame said
            log.info("closing ucx endpoint after a message longer than announced")
        except (TimeoutError, self._rt.ucx_error, ConnectionError):
            pass  # idle, stalled or gone: just close
        except asyncio.CancelledError:
            pass
        except Exception:  # never let one endpoint take the daemon down
            log.exception("ucx transfer endpoint failed")
        finally:
            self._eps.pop(ep, None)
            p.holder.close()
            abort(ep)

    async def _frame(self, ep: Any, p: Peer, head: bytearray) -> None:
        """Serve one frame whose header was read (checks in the frame core's order)."""
        h = self.frames.header(p, head)
        if h.op == wire.OP_AUTH:
            token = bytearray(h.count)
            await recv_all(ep, [token])
            await send_all(ep, [self.frames.authenticate(p, h, token)])
            return
        body = bytearray(h.ns_len + self.frames.body_len(h))
        await ep.recv(body)  # the namespace and the body: one message
        ns = self.frames.admit(p, h, body[: h.ns_len])
        rest = memoryview(body)[h.ns_len :]
        with observe_frame(self.on_request, h.op):
            parts: list[list[int]] | None = None
            if h.flags_or_code & wire.FLAG_PARTS and h.op in (wire.OP_PUT, wire.OP_GET):
                rest, counts, table_len = self.frames.part_counts(h, rest)
                table = bytearray(table_len)
                await recv_all(ep, [table])
                parts = self.frames.part_sizes(counts, table)
            if h.op == wire.OP_PUT:
                await self._put(ep, p, h, ns, rest, parts)
            elif h.op == wire.OP_GET:
                await self._get(ep, h, ns, rest, parts)
            elif h.op == wire.OP_EXISTS:
                await send_all(ep, self.frames.exists(h, ns, rest))
            else:  # OP_REMOVE
                await send_all(ep, self.frames.remove(h, ns, rest))

    def _discard_buffer(self, size: int) -> memoryview:
        # One landing area for every payload that is received only to be dropped: UCX
        # may fill it from several endpoints at once, which does not matter.
        if len(self._scratch) < size:
            self._scratch = memoryview(bytearray(size))
        return self._scratch[:size]

    async def _put(
        self,
        ep: Any,
        p: Peer,
        h: wire.Header,
        ns: str,
        raw: memoryview,
        parts: list[list[int]] | None,
    ) -> None:
        """PUT; with ``parts`` (per block its part sizes, adding up to its size) each
        block arrives as one message per part, landing in consecutive slot slices;
        packed (wire.FLAG_PACKED), the blocks as one stream of chunks, copied into the
        slots."""
        plan = self.frames.put_plan(p, h, ns, raw, parts)
        if h.flags_or_code & wire.FLAG_PACKED:
            await self._put_packed(ep, plan)
            return
        try:
            # The whole frame lands at once (UCX tag messages): it reserves within the
            # worker's budget for ucx:// senders, or is refused as full.
            lands: list[list[memoryview]] = []
            slots: list[memoryview | None] = plan.reserve(len(plan.entries))
            for i, dest in enumerate(slots):
                if dest is None:
                    dest = self._discard_buffer(plan.sizes[i])
                if parts is not None and len(parts[i]) > 1:
                    lands.append(slices(dest, parts[i]))
                else:
                    lands.append([dest])

            def landed(i: int) -> None:  # checked while the next blocks arrive
                slot = slots[i]
                if slot is not None:
                    plan.landed(i, slot)

            await recv_blocks(ep, lands, landed)
            plan.finish()
        except BaseException:
            # The sender vanished or stalled mid-frame: cancel what UCX still has
            # posted into the slots, and none of its blocks become visible.
            abort(ep)
            plan.abort()
            raise
        self._count("rx", plan.total)
        await send_all(ep, plan.answer())

    async def _put_packed(self, ep: Any, plan: PutPlan) -> None:
        try:
            slots = plan.reserve(len(plan.entries))

            def landed(i: int) -> None:  # checked while the next chunks arrive
                slot = slots[i]
                if slot is not None:  # a refused block's bytes are skipped
                    plan.landed(i, slot)

            dests = [[slot] if slot is not None else None for slot in slots]
            unpacker = Unpacker(dests, plan.sizes)
            await recv_packed(ep, sum(plan.sizes), unpacker, self.staging, landed)
            plan.finish()
        except BaseException:
            abort(ep)  # chunks may still be landing in the staging buffers
            plan.abort()
            raise
        self._count("rx", plan.total)
        await send_all(ep, plan.answer())

    async def _get(
        self,
        ep: Any,
        h: wire.Header,
        ns: str,
        raw: memoryview,
        parts: list[list[int]] | None,
    ) -> None:
        """GET; with ``parts`` (the reader's part sizes per block) a hit whose size is
        their sum goes out as one message per part, any other hit as one message; a
        packed answer (the frame core's decision) sends the hits as one stream of chunks."""
        answer = self.frames.get_answer(h, ns, raw, parts)
        try:
            buffers = answer.buffers
            if answer.packed:
                await send_packed(ep, buffers[:2], buffers[2:], answer.nbytes, self.staging)
            else:
                await send_all(ep, buffers)
        except BaseException:
            abort(ep)  # no send may still read the views once they are released
            raise
        finally:
            answer.close()
        self._count("tx", answer.nbytes)

    def _bad_frame(self) -> None:
        self.store.counters.bad_frames += 1
        if self.on_bad_frame is not None:
            self.on_bad_frame("ucx")

    def _count(self, direction: str, n: int) -> None:
        if self.on_bytes is not None and n:
            self.on_bytes("ucx", direction, n)
