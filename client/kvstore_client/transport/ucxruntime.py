"""The UCX runtime of kvstore's ucx:// transport: loading ucxx, its progress modes, the
event loop thread that runs every endpoint's coroutines, and the message helpers (send,
receive, packed streams through a staging pool) that the client half
(:mod:`.ucx`) and the worker's server half share. Split from :mod:`.ucx`, which holds
the protocol: connections, the pool and URLs.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures as cf
import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import (
    DeadlineExceeded,
    Unavailable,
)
from .ucxcodec import (
    PACK_WINDOW,
    Packer,
    StagingPool,
    Unpacker,
    chunk_sizes,
)

R = TypeVar("R")
Buffer = bytes | bytearray | memoryview

SCHEME = "ucx://"
# In thread mode ucxx reports a refused first connection only when the handshake times
# out, so bound the handshake, and fail fast for a while after a failure.
CONNECT_TIMEOUT = 5.0  # ucxx's own default handshake timeout
DOWN_FOR = 1.0
CLIENT_PROGRESS_MODE = "thread"  # with Python futures: nothing polls
SERVER_PROGRESS_MODE = "blocking"  # see progress_settings
# Options of kvstore's own UCP context (not the process environment: an engine's own
# UCX, e.g. NIXL's, keeps its defaults); a UCX_* variable of the same name wins.
# Measured against tcp:// on one host over UCX's tcp transport (docs/UCX.md): with
# UCX's default rendezvous (fragmented copy-in copy-out through bounce buffers) ucx://
# moved 1 MiB blocks at 0.5-0.7x tcp:// for about twice its CPU per GiB; with
# put_zcopy (the sender writes straight from its buffer into the receiver's) it moved
# them at about tcp://'s speed for half that CPU. On RDMA it is a zero-copy RDMA write.
UCX_OPTIONS: Mapping[str, str] = {"RNDV_SCHEME": "put_zcopy"}
# Chunk buffers of packed frames for all of a process's client endpoints together.
CLIENT_STAGING_BYTES = 64 << 20

_import_lock = threading.Lock()
_import_error: str | None = None


def _import_ucxx() -> Any:
    """Import ucxx with kvstore's defaults; Unavailable when it cannot be loaded.

    Defaults, only where the environment has no value: host-memory rendezvous staging
    (ucxx would stage through CUDA memory; kvstore moves host memory only), and no UCX
    warning about the UCX_MEMTYPE_CACHE variable that ucxx itself sets.
    """
    global _import_error
    with _import_lock:
        if _import_error is not None:
            raise Unavailable(_import_error)
        os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx  # type: ignore[import-untyped, import-not-found, unused-ignore]
        except Exception as e:  # ImportError, or a missing libucx: same outcome
            _import_error = f"ucx:// needs the ucxx package (pip install 'kvstore-cache[ucx]'): {e}"
            raise Unavailable(_import_error) from e
        return ucxx


def progress_settings(
    environ: Mapping[str, str] | None = None, *, server: bool = False
) -> tuple[str, bool]:
    """(progress mode, Python futures) for ucxx.init. UCXPY_PROGRESS_MODE and
    UCXPY_ENABLE_PYTHON_FUTURE win; otherwise ``thread`` with futures for a client
    process and ``blocking`` for a process that serves ucx://.

    Thread mode with futures: a C++ thread progresses UCX and a notifier thread
    completes asyncio futures, so the loop sleeps while requests are in flight; it took
    about half the CPU per GiB of ``blocking`` (or plain ``thread``) mode, in which every
    request in flight re-polls the loop. But in thread mode ucxx 0.52 frees a closing
    listener's callback while UCX can still deliver connection requests to it (seen:
    KeyError/SystemError in the callback, and segfaults), so a process with a listener
    defaults to ``blocking``, where closing is synchronous.
    """
    env = os.environ if environ is None else environ
    default = SERVER_PROGRESS_MODE if server else CLIENT_PROGRESS_MODE
    mode = env.get("UCXPY_PROGRESS_MODE", default)
    futures = mode.startswith("thread") and env.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0"
    return mode, futures


def _no_cuda_context() -> None:
    return None


def available() -> bool:
    """True when ucxx imports (this loads it: about a second or two the first time)."""
    try:
        _import_ucxx()
    except Unavailable:
        return False
    return True


class UcxRuntime:
    """The process's UCX context and the event loop thread that progresses it.

    :meth:`get` starts it on first use (Unavailable without ucxx); it lives until the
    process exits. Everything that touches a ucxx object runs on :attr:`loop`.
    """

    _instance: UcxRuntime | None = None
    _lock = threading.Lock()

    def __init__(self, *, server: bool = False) -> None:
        self.ucxx = _import_ucxx()
        self.mode, self.futures = progress_settings(server=server)
        self.ucx_error: type[Exception] = self.ucxx.exceptions.UCXError
        self.staging = StagingPool(CLIENT_STAGING_BYTES)  # the client endpoints' packing
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="kvstore-ucx", daemon=True)
        self._thread.start()
        try:
            self.run(self._init(), 60.0)
        except Exception as e:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise Unavailable(f"UCX did not start: {e!r}") from e

    @classmethod
    def get(cls, *, server: bool = False) -> UcxRuntime:
        """The process-wide runtime, started on first use; Unavailable without ucxx.

        ``server``: the caller will listen; only matters for the first call, which picks
        the progress mode (:func:`progress_settings`).
        """
        with cls._lock:
            if cls._instance is None:
                cls._instance = UcxRuntime(server=server)
            return cls._instance

    @classmethod
    def started(cls) -> UcxRuntime | None:
        """The process-wide runtime if some caller started it, else None (never starts
        it: a pool closing without ever having used UCX has nothing to drain)."""
        return cls._instance

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init(self) -> None:
        mode, futures = self.mode, self.futures
        # ucxx's progress thread makes a CUDA context on device 0 when it starts: GPU
        # memory on GPU hosts, for nothing, as kvstore moves host memory only.
        progress_mod = getattr(
            getattr(self.ucxx, "_lib_async", None), "continuous_ucx_progress", None
        )
        make_context = getattr(progress_mod, "_create_context", None)
        if make_context is not None:
            progress_mod._create_context = _no_cuda_context  # type: ignore[union-attr]
        try:
            self.ucxx.init(
                options=dict(UCX_OPTIONS),
                env_takes_precedence=True,
                progress_mode=mode,
                enable_python_future=futures,
            )
        except RuntimeError:
            pass  # the application initialised ucxx already: share its context
        finally:
            if make_context is not None:
                progress_mod._create_context = make_context  # type: ignore[union-attr]
        with contextlib.suppress(Exception):  # a shared context may refuse a second loop
            self.ucxx.continuous_ucx_progress(event_loop=self.loop)
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        # ucxx: stop the notifier thread before the interpreter goes, or exit may hang.
        with contextlib.suppress(Exception):
            self.ucxx.stop_notifier_thread()

    def submit(self, coro: Coroutine[Any, Any, R]) -> cf.Future[R]:
        """Schedule ``coro`` on the UCX loop; the future resolves with its outcome."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, R], timeout: float) -> R:
        """Run ``coro`` on the UCX loop and wait for it; DeadlineExceeded after ``timeout``
        (the coroutine is then cancelled). Must not be called from the loop itself."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except cf.TimeoutError as e:
            fut.cancel()
            raise DeadlineExceeded(f"UCX operation did not finish in {timeout:.1f}s") from e


# ---- message helpers (used by both halves) -------------------------------------------


async def send_all(ep: Any, buffers: Sequence[Buffer]) -> None:
    """Send each non-empty buffer as one tag message, all posted at once, in order.

    Returns when every send completed (the buffers may be reused); raises the first
    error. UCX matches messages of one tag in the order they were posted.
    """
    bufs = [b for b in buffers if len(b)]
    if len(bufs) == 1:
        await ep.send(bufs[0])
        return
    # gather wraps each coroutine in a task, started in order; each posts its send
    # before its first await, so the posting order is the list order.
    results = await asyncio.gather(*(ep.send(b) for b in bufs), return_exceptions=True)
    _raise_first(results)


async def recv_all(ep: Any, buffers: Sequence[memoryview | bytearray]) -> None:
    """Receive one tag message into each non-empty buffer, all posted at once, in order.

    A message longer than its buffer fails the receive (UCX truncation); a shorter
    one leaves the buffer's tail as it was (checksums catch that for payloads).
    """
    bufs = [b for b in buffers if len(b)]
    if len(bufs) == 1:
        await ep.recv(bufs[0])
        return
    results = await asyncio.gather(*(ep.recv(b) for b in bufs), return_exceptions=True)
    _raise_first(results)


async def recv_blocks(
    ep: Any, blocks: Sequence[Sequence[memoryview | bytearray]], landed: Callable[[int], None]
) -> None:
    """Receive every block's messages (one per non-empty buffer, all posted at once, in
    order) and call ``landed(i)`` as soon as block ``i``'s have all arrived, while the
    later ones are still coming: the caller checks a block (xxh3) during the transfer
    instead of after it. On an error or a cancellation the receives still posted are
    cancelled and settled, then it is raised (the caller aborts the endpoint)."""
    tasks: list[asyncio.Future[Any]] = []
    ends: list[int] = []
    for parts in blocks:
        tasks.extend(asyncio.ensure_future(ep.recv(b)) for b in parts if len(b))
        ends.append(len(tasks))
    at = 0
    try:
        for i, end in enumerate(ends):
            while at < end:
                await tasks[at]
                at += 1
            landed(i)
    except BaseException:
        rest = tasks[at:]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        raise


async def send_packed(
    ep: Any, head: Sequence[Buffer], sources: Sequence[Buffer], total: int, pool: StagingPool
) -> None:
    """Send ``head`` (one message per non-empty buffer), then ``sources`` (``total``
    bytes back to back) as a packed stream: each chunk is copied into a buffer leased
    from ``pool`` and sent while the next one is filled (at most PACK_WINDOW buffers).
    Returns when every send completed; raises the first error (the caller aborts the
    endpoint; the buffers of a failed stream are not reused)."""
    sizes = chunk_sizes(total)
    if len(sizes) == 1:  # one message: posted with the head, as any other frame's
        (buf,) = await pool.take(1)
        ok = False
        try:
            view = memoryview(buf)[:total]
            Packer(sources).fill(view)
            await send_all(ep, [*head, view])
            ok = True
        finally:
            pool.give([buf], reuse=ok)
        return
    sends = [asyncio.ensure_future(ep.send(b)) for b in head if len(b)]
    bufs: list[mmap.mmap] = []
    ok = False
    try:
        if sizes:
            bufs = await pool.take(min(PACK_WINDOW, len(sizes)))
            packer = Packer(sources)
            free = list(bufs)
            wire_: collections.deque[tuple[asyncio.Future[Any], mmap.mmap]] = collections.deque()
            for n in sizes:
                if not free:  # the oldest send must finish before its buffer is refilled
                    fut, buf = wire_.popleft()
                    await fut
                    free.append(buf)
                buf = free.pop()
                view = memoryview(buf)[:n]
                packer.fill(view)
                fut = asyncio.ensure_future(ep.send(view))
                sends.append(fut)
                wire_.append((fut, buf))
        results = await asyncio.gather(*sends, return_exceptions=True)
        _raise_first(results)
        ok = True
    finally:
        if not ok:
            for t in sends:
                t.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        if bufs:
            pool.give(bufs, reuse=ok)


async def recv_packed(
    ep: Any, total: int, unpacker: Unpacker, pool: StagingPool, landed: Callable[[int], None]
) -> None:
    """Receive a packed stream of ``total`` bytes into ``unpacker``'s destinations, and
    call ``landed(i)`` as soon as block ``i`` is complete (empty blocks at once). Each
    chunk lands in a buffer leased from ``pool`` while the previous one is copied out
    (at most PACK_WINDOW). On an error or a cancellation the receives still posted are
    cancelled and settled, then it is raised (the caller aborts the endpoint)."""
    for i in unpacker.begin():
        landed(i)
    sizes = chunk_sizes(total)
    if not sizes:
        return
    bufs = await pool.take(min(PACK_WINDOW, len(sizes)))
    if len(sizes) == 1:  # one message: received straight, as any other frame's
        ok = False
        try:
            view = memoryview(bufs[0])[:total]
            await ep.recv(view)
            for i in unpacker.feed(view):
                landed(i)
            ok = True
        finally:
            pool.give(bufs, reuse=ok)
        return
    posted: collections.deque[tuple[asyncio.Future[Any], memoryview, mmap.mmap]]
    posted = collections.deque()
    nxt = 0

    def post(buf: mmap.mmap) -> None:
        nonlocal nxt
        view = memoryview(buf)[: sizes[nxt]]
        nxt += 1
        posted.append((asyncio.ensure_future(ep.recv(view)), view, buf))

    ok = False
    try:
        for buf in bufs:
            post(buf)
        while posted:
            fut, view, buf = posted[0]
            await fut
            posted.popleft()
            for i in unpacker.feed(view):
                landed(i)
            if nxt < len(sizes):
                post(buf)  # copied out: the next chunk may land in it
        ok = True
    finally:
        if not ok:
            for t, _, _ in posted:
                t.cancel()
            await asyncio.gather(*(t for t, _, _ in posted), return_exceptions=True)
        pool.give(bufs, reuse=ok)


def _raise_first(results: Sequence[object]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


def abort(ep: Any) -> None:
    """Close an endpoint at once, cancelling its in-flight requests (never raises)."""
    with contextlib.suppress(Exception):
        ep.abort(period=10**8, max_attempts=1)
