"""`kvstore bench replay`: replay agent / chat traces against a real store and score it.

Each request does what an inference engine's connector does: chained hashes of its block
ids, one ``match_prefix``, a batched load of the hit blocks into pre-faulted buffers
(each block's bytes are derived from its hash, so a wrong block is caught and counted),
and a store of only the blocks that missed. Sessions run concurrently (``--sessions N``
conversations at once), each session's requests in order, pauses scaled by
``--time-scale``; a sub-agent starts, on its own thread (inline when sessions run one at
a time), when its parent reaches the sub-agent's start time, so it forks from the
parent's cached prefix.

The same requests, in the order the replay looked them up, go through the offline
simulators of :mod:`cachesim`: an infinite cache (the ideal hit rate) and a block LRU of
the store's capacity, so the gap to the LRU figure shows the store's eviction quality.
:func:`run_replay` is the engine (used by the tests); the CLI is :mod:`.cli`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..peers import Backend, leading
from ..traces import IdSpace, Request, Session, block_hashes, load_agentic, load_mooncake
from .cachesim import ideal_hit_rate, lru_hit_rate, opt_hit_rate
from .results import ReplayConfig, ReplayResult, RequestRecord

__all__ = [
    "ReplayConfig",
    "ReplayResult",
    "RequestRecord",
    "block_content",
    "load_sessions",
    "request_hashes",
    "run_replay",
]

_SALT = b"kvstore-bench-replay"
_MIX = np.uint64(0x9E3779B97F4A7C15)


def request_hashes(req: Request, cache: dict[int, bytes] | None = None) -> list[bytes]:
    """The 16-byte keys the replay uses for ``req``'s blocks (chained over its ids)."""
    return block_hashes(req.block_ids, _SALT, cache)


def block_content(hashes: Sequence[bytes], block_bytes: int) -> np.ndarray:
    """The bytes a replay stores for each hash: shape (len(hashes), block_bytes), uint8.

    Word j (8 bytes) of a block is ``(j * 0x9E3779B97F4A7C15) XOR hash[j % 2]``, so two
    blocks differ in every word and a block moved within a buffer is caught too.
    """
    out = np.empty((len(hashes), block_bytes), dtype=np.uint8)
    _fill(out, hashes, _pattern(block_bytes))
    return out


def _pattern(block_bytes: int) -> np.ndarray:
    words = block_bytes // 8
    return (np.arange(words, dtype=np.uint64) * _MIX).reshape(words // 2, 2)


def _words(rows: np.ndarray) -> np.ndarray:
    return rows.view(np.uint64).reshape(rows.shape[0], -1, 2)


def _hash_words(hashes: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(hashes), dtype=np.uint64).reshape(-1, 1, 2)


def _fill(rows: np.ndarray, hashes: Sequence[bytes], pattern: np.ndarray) -> None:
    np.bitwise_xor(pattern, _hash_words(hashes), out=_words(rows))


def _verify(rows: np.ndarray, hashes: Sequence[bytes], pattern: np.ndarray) -> np.ndarray:
    """Which rows hold their hash's content (destroys the rows' bytes)."""
    w = _words(rows)
    np.bitwise_xor(w, _hash_words(hashes), out=w)
    ok: np.ndarray = (w == pattern).all(axis=(1, 2))
    return ok


# --------------------------------------------------------------------------- engine


class _Buffers:
    """Pre-faulted (rows, block_bytes) arrays, one per running session, reused."""

    def __init__(self, backend: Backend, rows: int, block_bytes: int) -> None:
        self.backend = backend
        self.rows = rows
        self.block_bytes = block_bytes
        self.free: list[tuple[np.ndarray, list[memoryview]]] = []
        self.lock = threading.Lock()

    def acquire(self) -> tuple[np.ndarray, list[memoryview]]:
        with self.lock:
            if self.free:
                return self.free.pop()
        arr = np.empty((self.rows, self.block_bytes), dtype=np.uint8)
        arr.fill(0)  # touch every page now, not during a timed load
        self.backend.register(arr)
        return arr, [r.data for r in arr]

    def release(self, buf: tuple[np.ndarray, list[memoryview]]) -> None:
        with self.lock:
            self.free.append(buf)

    def close(self) -> None:
        """Unregister every buffer (all must have been released)."""
        with self.lock:
            for arr, _ in self.free:
                self.backend.unregister(arr)
            self.free.clear()


class _Replay:
    def __init__(
        self,
        backend: Backend,
        cfg: ReplayConfig,
        block_tokens: int,
        rows: int,
        on_request: Callable[[RequestRecord], None] | None,
    ) -> None:
        self.b = backend
        self.cfg = cfg
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * cfg.bytes_per_token
        self.pattern = _pattern(self.block_bytes)
        self.buffers = _Buffers(backend, rows, self.block_bytes)
        self.on_request = on_request
        self.hash_cache: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.order: list[Request] = []
        self.records: list[RequestRecord] = []
        self.threads: list[threading.Thread] = []
        self.failure: BaseException | None = None
        self.stop = threading.Event()
        self.t0 = time.perf_counter()
        self.hints = _Hints(backend) if cfg.sessions_aware else None

    # -- scheduling --

    def run(self, sessions: Sequence[Session]) -> None:
        queue = deque(sorted(sessions, key=lambda s: s.start))
        if self.cfg.sessions <= 1:
            for s in queue:
                self._wait_until(s.start)
                self._session(s)
            return
        for _ in range(min(self.cfg.sessions, len(queue))):
            self._spawn(self._slot, queue)
        try:
            while True:  # join everything, including sub-agents spawned meanwhile
                with self.lock:
                    alive = [t for t in self.threads if t.is_alive()]
                if not alive:
                    break
                alive[0].join(0.2)
        except BaseException:  # Ctrl-C: let the sessions stop at their next request
            self.stop.set()
            raise
        if self.failure is not None:
            raise self.failure

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        def guarded() -> None:
            try:
                fn(*args)
            except BaseException as e:
                with self.lock:
                    self.failure = self.failure or e
                self.stop.set()

        t = threading.Thread(target=guarded, daemon=True)
        with self.lock:
            self.threads.append(t)
        t.start()

    def _slot(self, queue: deque[Session]) -> None:
        while not self.stop.is_set():
            with self.lock:
                if not queue:
                    return
                s = queue.popleft()
            self._wait_until(s.start)
            self._session(s)

    def _wait_until(self, t: float, base: float | None = None, origin: float = 0.0) -> None:
        if self.cfg.time_scale <= 0:
            return
        target = (self.t0 if base is None else base) + (t - origin) * self.cfg.time_scale
        delay = target - time.perf_counter()
        if delay > 0:
            self.stop.wait(delay)

    def _session(self, s: Session) -> None:
        begin = time.perf_counter()
        children = deque(s.children)
        buf = self.buffers.acquire()
        cap = self.cfg.max_pause
        prev, clock = s.start, s.start  # the trace's time, and the capped session clock
        try:
            for i, req in enumerate(s.requests):
                while children and children[0].start <= req.t:
                    self._fork(children.popleft())
                if self.stop.is_set():
                    return
                gap = req.t - prev
                if cap > 0 and self.cfg.time_scale > 0:
                    gap = min(gap, cap / self.cfg.time_scale)  # a scaled pause of at most cap s
                prev, clock = req.t, clock + gap
                self._wait_until(clock, begin, s.start)
                self._request(req, buf, last=i == len(s.requests) - 1)
        finally:
            self.buffers.release(buf)
        while children:
            self._fork(children.popleft())

    def _fork(self, child: Session) -> None:
        if self.cfg.sessions <= 1:
            self._session(child)
        else:
            self._spawn(self._session, child)

    # -- one request --

    def _request(
        self, req: Request, buf: tuple[np.ndarray, list[memoryview]], last: bool = False
    ) -> None:
        arr, views = buf
        rows = arr.shape[0]
        b, cfg, bb = self.b, self.cfg, self.block_bytes
        hashes = request_hashes(req, self.hash_cache)
        n = len(hashes)
        if self.hints is not None:  # the turn starts: the session resumes
            self.hints.send(req.session, "active", hashes)

        t = time.perf_counter()
        if cfg.batched_lookup:
            matched = b.match_prefix(hashes)
        else:
            matched = 0
            while matched < n and b.exists([hashes[matched]])[0]:
                matched += 1
        match_s = time.perf_counter() - t
        with self.lock:
            self.order.append(req)

        hit = errors = 0
        load_s = 0.0
        while hit < matched:
            k = min(rows, matched - hit)
            t = time.perf_counter()
            flags = b.get_into(hashes[hit : hit + k], views[:k], cfg.parallel_loads)
            load_s += time.perf_counter() - t
            if cfg.verify:
                good = _verify(arr[:k], hashes[hit : hit + k], self.pattern)
                errors += sum(1 for f, g in zip(flags, good, strict=True) if f and not g)
                flags = [bool(f and g) for f, g in zip(flags, good, strict=True)]
            run = leading(flags)
            hit += run
            if run < k:
                break

        first = hit if cfg.write_only_new else 0
        store_s = 0.0
        failed = 0
        for pos in range(first, n, rows):
            chunk = hashes[pos : pos + rows]
            k = len(chunk)
            _fill(arr[:k], chunk, self.pattern)
            t = time.perf_counter()
            _, bad = b.put(chunk, views[:k])
            store_s += time.perf_counter() - t
            failed += bad
        if not cfg.retain:
            b.remove(hashes)
        if self.hints is not None:  # a pause for tools until the next turn, or the end
            self.hints.send(req.session, "ended" if last else "paused", hashes)

        bt = self.block_tokens
        rec = RequestRecord(
            session=req.session,
            end=time.perf_counter() - self.t0,
            blocks=n,
            matched=matched,
            hit=hit,
            tokens=req.input_tokens,
            hit_tokens=min(hit, req.input_tokens // bt) * bt,
            match_s=match_s,
            load_s=load_s,
            store_s=store_s,
            loaded_bytes=hit * bb,
            written_bytes=(n - first) * bb,
            skipped_bytes=first * bb,
            content_errors=errors,
            store_failed=failed,
        )
        with self.lock:
            self.records.append(rec)
        if self.on_request is not None:
            self.on_request(rec)


def run_replay(
    sessions: Sequence[Session],
    backend: Backend,
    cfg: ReplayConfig,
    *,
    label: str = "",
    on_request: Callable[[RequestRecord], None] | None = None,
) -> ReplayResult:
    """Replay ``sessions`` against ``backend`` and return what was measured.

    All requests must share one ``block_tokens`` (ValueError otherwise); a block is
    ``block_tokens * cfg.bytes_per_token`` bytes, which must be a multiple of 64.
    ``on_request`` is called (from replay threads) after each request. The offline
    ideal and LRU figures are computed on the requests in the order they were looked
    up, the LRU with ``backend.capacity_blocks``. Exceptions of the backend propagate.
    """
    reqs = [r for s in sessions for sub in s.walk() for r in sub.requests]
    sizes = {r.block_tokens for r in reqs}
    if len(sizes) > 1:
        raise ValueError(f"requests use different block sizes {sorted(sizes)}: replay one kind")
    block_tokens = sizes.pop() if sizes else 64
    block_bytes = block_tokens * cfg.bytes_per_token
    if block_bytes <= 0 or block_bytes % 64:
        raise ValueError(
            f"a block of {block_tokens} tokens x {cfg.bytes_per_token} bytes = {block_bytes} "
            "bytes: must be a positive multiple of 64"
        )
    longest = max((len(r.block_ids) for r in reqs), default=1)
    rows = max(1, min(longest, cfg.buffer_bytes // block_bytes))
    rp = _Replay(backend, cfg, block_tokens, rows, on_request)
    try:
        rp.run(sessions)
    finally:
        rp.buffers.close()
        if rp.hints is not None:
            rp.hints.close()
    wall = time.perf_counter() - rp.t0
    capacity = backend.capacity_blocks(block_bytes)
    return ReplayResult(
        backend=backend.name,
        description=backend.description,
        config=cfg,
        block_tokens=block_tokens,
        block_bytes=block_bytes,
        wall_s=wall,
        records=rp.records,
        ideal=ideal_hit_rate(rp.order),
        lru=lru_hit_rate(rp.order, capacity) if capacity is not None else None,
        capacity_blocks=capacity,
        label=label,
        opt=opt_hit_rate(rp.order, capacity) if capacity is not None else None,
    )


# --------------------------------------------------------------------------- sessions


PAUSED_TTL_MS = 300_000  # the worker's default session_ttl


class _Hints:
    """``--sessions-aware on``: the hints a connector sends, driven from the trace (a
    turn starts: ``active``; it ends with a next turn to come: ``paused``; the last
    turn: ``ended``), with the turn's block chain. Only the kvstore backend takes
    hints; they are advice, so a failed hint is counted, not raised."""

    def __init__(self, backend: Backend) -> None:
        self.client = getattr(backend, "client", None)
        self.ns = str(getattr(backend, "ns", ""))
        self.failed = 0
        self.backend = backend
        if hasattr(backend, "soft_pin_ms"):  # Mooncake: soft pins, the TTL of a pause
            backend.soft_pin_ms = PAUSED_TTL_MS

    def close(self) -> None:
        if hasattr(self.backend, "soft_pin_ms"):
            self.backend.soft_pin_ms = 0

    def send(self, session: str, state: str, hashes: list[bytes]) -> None:
        if self.client is None or not hasattr(self.client, "session_hint"):
            return
        try:
            self.client.session_hint(self.ns, session[:256], state, hashes=hashes)
        except Exception:
            self.failed += 1


def ssd_read_blocks(backend: Backend) -> int | None:
    """Blocks the kvstore workers served from SSD so far (None for other backends)."""
    from kvstore_client.proto import store_pb2, store_pb2_grpc
    from kvstore_client.security import open_channel

    client = getattr(backend, "client", None)
    if client is None or not hasattr(client, "workers"):
        return None
    total = 0
    for w in client.workers():
        with open_channel(w.grpc, client.tls) as ch:
            st = store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=10)
        total += st.ssd_hits
    return total


# --------------------------------------------------------------------------- traces


def load_sessions(
    files: Sequence[str],
    fmt: str,
    *,
    block_tokens: int | None = None,
    max_requests: int | None = None,
    limit: int | None = None,
) -> list[Session]:
    """Load trace files of one format into sessions with ids apart per file.

    ``block_tokens`` regroups agentic ids (a multiple of the trace's block size);
    ``max_requests`` keeps each session's (and sub-agent's) first requests; ``limit``
    keeps a Mooncake file's first requests. Raises TraceFormatError / ValueError / OSError
    as the loaders do.
    """
    ids = IdSpace()
    if fmt == "agentic":
        sessions = load_agentic(files, block_tokens=block_tokens, ids=ids)
    else:
        if block_tokens not in (None, 512):
            raise ValueError("Mooncake traces have 512-token blocks; --block-tokens must be 512")
        sessions = [s for f in files for s in load_mooncake(f, limit=limit, ids=ids)]
    if max_requests is not None:
        sessions = [_truncate(s, max_requests) for s in sessions]
    return sessions


def _truncate(s: Session, k: int) -> Session:
    kids = tuple(_truncate(c, k) for c in s.children)
    return dataclasses.replace(s, requests=s.requests[:k], children=kids)
