"""The points of ``kvstore bench transfer``: what one point measures and how the sweep
runs them on every target in turn.

A :class:`Plan` is the grid and each point's budget; :func:`run_point` measures one
(block size, batch, client threads, workers) point on one target; :class:`Runner`
runs the sweep (every put point, then every get point, per block size; then
``batch_exists``) point by point across the targets, so that a neighbour's load hits
all of them alike.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from rich.progress import Progress

from kvstore.config import format_size
from kvstore_client.keys import split_hashes

from ..peers import cpu_seconds

GIB = float(1 << 30)
EXISTS_KEYS = 1024
MAX_POINT_BUFFER = 512 << 20  # client buffers of one point: batch * block * concurrency
MOONCAKE_MAX_BATCH = 128  # Mooncake fails whole batch_put_from calls of thousands of keys


@dataclass(slots=True)
class Buf:
    """A thread's batch buffer: ``rows`` pre-faulted blocks of ``block`` bytes."""

    arr: np.ndarray
    views: list[memoryview]
    ptrs: list[int]
    sizes: list[int]

    @classmethod
    def make(cls, rows: int, block: int, fill: int) -> Buf:
        arr = np.full((rows, block), fill & 0xFF, dtype=np.uint8)
        base = int(arr.ctypes.data)
        ptrs = [base + i * block for i in range(rows)]
        return cls(arr, [arr[i].data for i in range(rows)], ptrs, [block] * rows)


class Target(Protocol):
    """One system on one transport, as the sweep sees it. Keys are native to it;
    targets with the same ``store`` share data (and so working sets)."""

    system: str
    transport: str
    store: str

    def pids(self) -> list[int]: ...
    def workers(self) -> list[str]: ...
    def native(self, raw: Sequence[bytes]) -> list[Any]: ...
    def prepare(self, buf: Buf) -> None: ...
    def release(self, buf: Buf) -> None: ...
    def put(self, keys: list[Any], buf: Buf, n: int) -> int: ...
    def get(self, keys: list[Any], buf: Buf, n: int) -> int: ...
    def exists(self, keys: list[Any]) -> int: ...
    def remove(self, keys: list[Any]) -> None: ...


@dataclass(slots=True)
class Point:
    """One measured point (the median of ``--repeat`` runs by GiB/s)."""

    system: str
    transport: str
    op: str
    block_bytes: int
    batch: int
    concurrency: int
    workers: int
    bytes: int
    seconds: float
    gib_s: float
    batches: int
    errors: int
    p50_ms: float
    p99_ms: float
    cpu_client_s: float
    cpu_servers_s: float
    cpu_s_per_gib: float
    frac_socket: float = 0.0
    frac_memcpy: float = 0.0
    frac_socket_streams: float = 0.0  # over N bare streams at once, N = workers x concurrency
    cpu_vs_copy_hash: float = 0.0  # cpu_s_per_gib over one bare verified copy's (ceilings)
    worker_ids: list[str] = field(default_factory=list)  # the servers its batches spread over

    @property
    def key(self) -> tuple[str, int, int, int, int]:
        return (self.op, self.block_bytes, self.batch, self.concurrency, self.workers)


@dataclass(slots=True)
class Plan:
    """What to run: the grid and the budget of each point."""

    blocks: list[int]
    batches: list[int]
    concurrency: list[int]
    total_bytes: int
    max_seconds: float
    capacity: int  # one worker's DRAM, one Mooncake segment
    aggregate_workers: int = 4
    repeat: int = 1

    @property
    def limit(self) -> int:
        """The most bytes one round of a point may hold: half a worker's DRAM."""
        return min(MAX_POINT_BUFFER, self.capacity // 2)

    def chunk(self, round_bytes: int) -> int:
        """Bytes put (or kept for reading) before the clock stops and keys are removed:
        a share of half the DRAM per block size, so the memory that one size class
        keeps after its keys are removed leaves room for the others."""
        return max(round_bytes, self.capacity // (2 * (len(self.blocks) + 1)))

    def fits(self, block: int, batch: int, conc: int) -> bool:
        return batch * block * conc <= self.limit

    def combos(self, block: int) -> list[tuple[int, int]]:
        return [(b, c) for b in self.batches for c in self.concurrency if self.fits(block, b, c)]

    def excluded(self) -> list[dict[str, Any]]:
        """Grid points left out because their buffers would not fit."""
        limit = format_size(self.limit)
        return [
            {"block_bytes": k, "batch": b, "concurrency": c, "reason": f"over {limit}"}
            for k in self.blocks
            for b in self.batches
            for c in self.concurrency
            if not self.fits(k, b, c)
        ]


class _Clock:
    """Wall and CPU time of this process plus ``pids``, summed while running."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.wall = self.client = self.servers = 0.0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        c0, s0 = cpu_seconds(), sum(cpu_seconds(p) for p in self.pids)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - t0
            self.client += cpu_seconds() - c0
            self.servers += sum(cpu_seconds(p) for p in self.pids) - s0


def _run_threads(n: int, fn: Callable[[int], None]) -> None:
    """fn(0..n-1) in parallel threads (inline for n == 1); re-raises the first error."""
    if n == 1:
        fn(0)
        return
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _raw_keys(n: int) -> list[bytes]:
    """``n`` random 16-byte block hashes (cut by the client's own splitter)."""
    return split_hashes(os.urandom(16 * n))


def run_point(
    t: Target, plan: Plan, op: str, block: int, batch: int, conc: int,
    ws: list[bytes] | None = None,
) -> Point:  # fmt: skip
    """Measure one point. ``put`` writes fresh keys and removes them after every
    ``plan.chunk`` bytes (clock stopped); ``get`` reads batches of ``ws``. The point
    names the servers the target spreads its batches over (``t.workers()``)."""
    ids = t.workers()
    chunk = plan.chunk(batch * block * conc)
    put = op == "put"
    bufs = [Buf.make(batch, block, 17 + i) for i in range(conc)]
    raw_b: list[list[bytes]] = []
    if not put:
        assert ws is not None and len(ws) >= batch
        raw_b = [ws[i : i + batch] for i in range(0, len(ws) - batch + 1, batch)]
    nat_b = [t.native(b) for b in raw_b]
    for b in bufs:
        t.prepare(b)
    clock = _Clock(t.pids())
    lats: list[float] = []
    good = tried = 0
    remaining = plan.total_bytes
    try:
        while remaining > 0 and clock.wall < plan.max_seconds:
            seg = min(remaining, chunk) if put else remaining
            per_thread = max(1, math.ceil(seg / (conc * batch * block)))
            deadline = time.perf_counter() + plan.max_seconds - clock.wall
            st = [[0, 0, 0, 0] for _ in range(conc)]  # good, tried, last batch, its hits
            lat_t: list[list[float]] = [[] for _ in range(conc)]
            written: list[list[Any]] = [[] for _ in range(conc)]

            def body(i: int, per_thread: int = per_thread, deadline: float = deadline,
                     st: list[list[int]] = st, lat_t: list[list[float]] = lat_t,
                     written: list[list[Any]] = written) -> None:  # fmt: skip
                start = i * len(nat_b) // conc
                for j in range(per_thread):
                    if j and time.perf_counter() > deadline:
                        break
                    if put:
                        keys = t.native(_raw_keys(batch))
                        written[i].extend(keys)
                    else:
                        st[i][2] = (start + j) % len(nat_b)
                        keys = nat_b[st[i][2]]
                    t0 = time.perf_counter()
                    n = t.put(keys, bufs[i], batch) if put else t.get(keys, bufs[i], batch)
                    lat_t[i].append(time.perf_counter() - t0)
                    st[i][0] += n
                    st[i][1] += batch
                    st[i][3] = n

            try:
                with clock.running():
                    _run_threads(conc, body)
            finally:  # what a failed point wrote is removed too
                for keys in written:
                    t.remove(keys)
            good += sum(s[0] for s in st)
            tried += sum(s[1] for s in st)
            remaining -= sum(s[1] for s in st) * block
            lats.extend(x for lt in lat_t for x in lt)
            for i, s in enumerate(st if not put else []):
                if s[3] != batch:  # a miss leaves its buffer as it was: check full hits only
                    continue
                wrong = sum(bytes(bufs[i].arr[j, :16]) != k for j, k in enumerate(raw_b[s[2]]))
                if wrong:
                    raise RuntimeError(f"{t.system} get returned {wrong} blocks of other keys")
    finally:
        for b in bufs:
            t.release(b)
    gib = good * block / GIB
    secs = max(clock.wall, 1e-9)
    lat = np.asarray(lats or [0.0]) * 1e3
    return Point(
        t.system, t.transport, op, block, batch, conc, len(ids), good * block, secs, gib / secs,
        len(lats), tried - good, float(np.percentile(lat, 50)), float(np.percentile(lat, 99)),
        clock.client, clock.servers, (clock.client + clock.servers) / gib if gib else 0.0,
        worker_ids=ids,
    )  # fmt: skip


def store_working_set(t: Target, plan: Plan, block: int, need: int) -> list[bytes]:
    """Store (untimed) the keys that get points read: at least ``need``, else about
    ``total_bytes`` within 8,192 keys and ``plan.chunk``. Each block's first 16
    bytes are its key. Returns the keys stored: fewer when the system ran out of room."""
    n = max(need, min(min(plan.total_bytes, plan.chunk(need * block)) // block, 8192))
    raw = _raw_keys(n)
    step = max(1, min(n, MOONCAKE_MAX_BATCH, (32 << 20) // block))
    buf = Buf.make(step, block, 3)
    t.prepare(buf)
    try:
        for i in range(0, n, step):
            part = raw[i : i + step]
            for j, k in enumerate(part):
                buf.arr[j, :16] = np.frombuffer(k, dtype=np.uint8)
            if t.put(t.native(part), buf, len(part)) != len(part):  # out of room
                t.remove(t.native(part))
                return raw[:i]
    finally:
        t.release(buf)
    return raw


def run_exists(t: Target, plan: Plan) -> dict[str, Any]:
    """``batch_exists`` of 1,024 stored hashes in a loop: keys per second. Every key
    stored for it is removed afterwards (the working set may hold more than 1,024)."""
    stored = t.native(store_working_set(t, plan, 4096, EXISTS_KEYS))
    keys = stored[:EXISTS_KEYS]
    ids = t.workers()
    seconds = max(0.5, min(plan.max_seconds, 2.0))
    calls = found = 0
    t0 = time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds or not calls:
        found += t.exists(keys)
        calls += 1
    dt = time.perf_counter() - t0
    t.remove(stored)
    return {"system": t.system, "transport": t.transport, "workers": len(ids), "worker_ids": ids,
            "keys": len(keys), "calls": calls, "seconds": dt,
            "keys_per_s": calls * len(keys) / dt, "us_per_call": dt / calls * 1e6,
            "all_found": found == calls * len(keys)}  # fmt: skip


# ---- the sweep -----------------------------------------------------------------------


class Runner:
    """Runs every point on every target, one after the other, with a progress bar."""

    def __init__(self, plan: Plan, progress: Progress, task: Any) -> None:
        self.plan, self.progress, self.task = plan, progress, task
        self.points: list[Point] = []
        self.exists: list[dict[str, Any]] = []
        self.notes: list[str] = []

    @staticmethod
    def count(plan: Plan, targets: int) -> int:
        """Progress steps for ``targets`` targets."""
        points = sum(2 * len(plan.combos(b)) for b in plan.blocks) + 1
        return targets * (points + (3 if plan.aggregate_workers > 1 else 0))

    def say(self, what: str) -> None:
        """Show ``what`` as the step in progress."""
        self.progress.update(self.task, description=what)
        self.progress.refresh()

    def _tick(self) -> None:
        self.progress.advance(self.task)
        self.progress.refresh()

    def point(self, t: Target, op: str, block: int, batch: int, conc: int,
              ws: list[bytes] | None = None) -> None:  # fmt: skip
        self.say(f"{t.system}/{t.transport} {op} {format_size(block)} x{batch} c{conc}")
        if ws is not None and len(ws) < batch:
            self.notes.append(
                f"{t.system}/{t.transport} {op} {format_size(block)} x{batch} c{conc} "
                f"w{len(t.workers())} skipped: only {len(ws)} blocks to read could be stored"
            )
            self._tick()
            return
        runs = [run_point(t, self.plan, op, block, batch, conc, ws)
                for _ in range(max(1, self.plan.repeat))]  # fmt: skip
        self.points.append(sorted(runs, key=lambda p: p.gib_s)[len(runs) // 2])
        self._tick()

    def _working_sets(self, targets: list[Target], block: int, need: int) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for t in targets:
            if t.store not in out:
                self.say(f"{t.store}: storing {format_size(block)} blocks to read")
                out[t.store] = store_working_set(t, self.plan, block, need)
        return out

    def _drop(self, targets: list[Target], sets: dict[str, list[bytes]]) -> None:
        for t in targets:
            if t.store in sets:
                t.remove(t.native(sets.pop(t.store)))

    def sweep(self, targets: list[Target]) -> None:
        """Per block size: every put point, then every get point; then exists."""
        for block in self.plan.blocks:
            combos = self.plan.combos(block)
            for batch, conc in combos:
                for t in targets:
                    self.point(t, "put", block, batch, conc)
            if not combos:
                continue
            sets = self._working_sets(targets, block, max(b * c for b, c in combos))
            for batch, conc in combos:
                for t in targets:
                    self.point(t, "get", block, batch, conc, sets[t.store])
            self._drop(targets, sets)
        for t in targets:
            self.say(f"{t.system}/{t.transport} batch_exists x{EXISTS_KEYS}")
            self.exists.append(run_exists(t, self.plan))
            self._tick()

    def aggregate(self, targets: list[Target], workers: int) -> None:
        """1 MiB blocks, 32 per worker in one batch, spread over ``workers``; exists."""
        block, batch = 1 << 20, 32 * workers
        for t in targets:
            self.point(t, "put", block, batch, 1)
        sets = self._working_sets(targets, block, batch)
        for t in targets:
            self.point(t, "get", block, batch, 1, sets[t.store])
        self._drop(targets, sets)
        for t in targets:
            self.exists.append(run_exists(t, self.plan))
            self._tick()
