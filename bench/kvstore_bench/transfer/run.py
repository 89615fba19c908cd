"""`kvstore bench transfer`: remote put/get bandwidth against the ceilings and Mooncake.

The bench process is the client. It starts a real local cluster (master + one
worker, as processes) and, with ``--vs mooncake``, Mooncake Store over TCP (a
master + one segment host, see :mod:`kvstore_bench.peers`) next to it. Then for
each point of the sweep (block size x batch size x concurrency) it moves about
``--total-bytes`` (at most ``--max-seconds``) with ``batch_put`` and with
``batch_get_into``, on every system and kvstore transport in turn, point by
point, so that a neighbour's load on a shared machine hits all of them alike.
Afterwards it adds workers (and segment hosts) for one aggregate point whose
batches span 4 of them, and loops ``batch_exists`` of 1,024 hashes.

Each point reports GiB/s (2**30 bytes per second of wall time), that as a
fraction of the ceilings measured in the same run (:mod:`kvstore_bench.ceilings`,
before and after the sweep, the better of the two),
batch latency p50/p99, and CPU seconds per GiB moved: this process plus the
servers' processes (``getrusage`` and /proc/PID/stat), counted only while the
point's clock runs. Results go to ``bench/results/transfer-<time>.json`` and
``.png``; the targets (goals per transport) are checked at the end.

Method: puts write fresh random keys; after at most half a worker's DRAM of
puts the clock stops and the keys are removed, so no system measures its
eviction or runs out of room. Gets read a working set stored beforehand (each
block starts with its key, and the last batch of every thread is checked).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.cluster import LocalCluster
from kvstore.config import format_size, parse_size
from kvstore_client import Client
from kvstore_client.errors import KVStoreError, ResourceExhausted

from ..peers import (
    MooncakeServer,
    MooncakeStoreAdapter,
    PeerUnavailable,
    cpu_seconds,
    unavailable_reason,
)
from ..report import transfer_plot, transfer_tables
from . import ceilings
from .targets import evaluate_targets

GIB = float(1 << 30)
NS = "bench/transfer/b0/tp0of1"
RESULTS = Path(__file__).resolve().parents[2] / "results"
TRANSPORTS = ("tcp", "shm")
PEERS = ("mooncake",)
EXISTS_KEYS = 1024
MAX_POINT_BUFFER = 512 << 20  # client buffers of one point: batch * block * concurrency
MOONCAKE_MAX_BATCH = 128  # Mooncake fails whole batch_put_from calls of thousands of keys

FULL_GRID = {
    "blocks": [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20],
    "batches": [1, 8, 32, 128],
    "concurrency": [1, 4],
}
QUICK_GRID = {"blocks": [4 << 10, 64 << 10, 1 << 20], "batches": [1, 32], "concurrency": [1]}


# ---- systems under test ----------------------------------------------------------


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
    def native(self, raw: Sequence[bytes]) -> list[Any]: ...
    def prepare(self, buf: Buf) -> None: ...
    def release(self, buf: Buf) -> None: ...
    def put(self, keys: list[Any], buf: Buf, n: int) -> int: ...
    def get(self, keys: list[Any], buf: Buf, n: int) -> int: ...
    def exists(self, keys: list[Any]) -> int: ...
    def remove(self, keys: list[Any]) -> None: ...


class KvTarget:
    """kvstore through ``Client(transport=...)``; the cluster's pids for CPU."""

    system = store = "kvstore"

    def __init__(self, client: Client, cluster: LocalCluster | None, transport: str) -> None:
        self.client, self.cluster, self.transport = client, cluster, transport

    def pids(self) -> list[int]:
        """The local cluster's processes (none for a running cluster: --master)."""
        if self.cluster is None:
            return []
        master = [self.cluster.master] if self.cluster.master else []
        return [d.pid for d in [*master, *self.cluster.worker_procs]]

    def native(self, raw: Sequence[bytes]) -> list[Any]:
        return list(raw)

    def prepare(self, buf: Buf) -> None:
        return None

    def release(self, buf: Buf) -> None:
        return None

    def put(self, keys: list[Any], buf: Buf, n: int) -> int:
        try:
            return sum(self.client.batch_put(NS, keys, buf.views[:n]))
        except ResourceExhausted:  # counted as errors of the point
            return 0

    def get(self, keys: list[Any], buf: Buf, n: int) -> int:
        return sum(self.client.batch_get_into(NS, keys, buf.views[:n]).result())

    def exists(self, keys: list[Any]) -> int:
        return sum(self.client.batch_exists(NS, keys))

    def remove(self, keys: list[Any]) -> None:
        for i in range(0, len(keys), 8192):
            self.client.remove(NS, keys[i : i + 8192])


class MooncakeTarget:
    """Mooncake Store over TCP; this process is a client without a segment of its own."""

    system = store = "mooncake"
    transport = "tcp"

    def __init__(self, adapter: MooncakeStoreAdapter, server: MooncakeServer) -> None:
        self.adapter, self.server, self.mc = adapter, server, adapter.store

    def pids(self) -> list[int]:
        return self.server.pids

    def native(self, raw: Sequence[bytes]) -> list[Any]:
        return [k.hex() for k in raw]

    def prepare(self, buf: Buf) -> None:
        self.adapter.register(buf.arr)

    def release(self, buf: Buf) -> None:
        self.adapter.unregister(buf.arr)

    def put(self, keys: list[Any], buf: Buf, n: int) -> int:
        return sum(r == 0 for r in self.mc.batch_put_from(keys, buf.ptrs[:n], buf.sizes[:n]))

    def get(self, keys: list[Any], buf: Buf, n: int) -> int:
        res = self.mc.batch_get_into(keys, buf.ptrs[:n], buf.sizes[:n])
        return sum(r == s for r, s in zip(res, buf.sizes, strict=False))

    def exists(self, keys: list[Any]) -> int:
        return sum(r == 1 for r in self.mc.batch_is_exist(keys))

    def remove(self, keys: list[Any]) -> None:
        for i in range(0, len(keys), 8192):
            self.mc.batch_remove(keys[i : i + 8192], True)


# ---- points ------------------------------------------------------------------------


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
    blob = os.urandom(16 * n)
    return [blob[i : i + 16] for i in range(0, 16 * n, 16)]


def run_point(
    t: Target, plan: Plan, op: str, block: int, batch: int, conc: int, workers: int,
    ws: list[bytes] | None = None,
) -> Point:  # fmt: skip
    """Measure one point. ``put`` writes fresh keys and removes them after every
    ``plan.chunk`` bytes (clock stopped); ``get`` reads batches of ``ws``."""
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

            with clock.running():
                _run_threads(conc, body)
            good += sum(s[0] for s in st)
            tried += sum(s[1] for s in st)
            remaining -= sum(s[1] for s in st) * block
            lats.extend(x for lt in lat_t for x in lt)
            for keys in written:
                t.remove(keys)
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
        t.system, t.transport, op, block, batch, conc, workers, good * block, secs, gib / secs,
        len(lats), tried - good, float(np.percentile(lat, 50)), float(np.percentile(lat, 99)),
        clock.client, clock.servers, (clock.client + clock.servers) / gib if gib else 0.0,
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


def run_exists(t: Target, plan: Plan, workers: int) -> dict[str, Any]:
    """``batch_exists`` of 1,024 stored hashes in a loop: keys per second."""
    keys = t.native(store_working_set(t, plan, 4096, EXISTS_KEYS)[:EXISTS_KEYS])
    seconds = max(0.5, min(plan.max_seconds, 2.0))
    calls = found = 0
    t0 = time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds or not calls:
        found += t.exists(keys)
        calls += 1
    dt = time.perf_counter() - t0
    t.remove(keys)
    return {"system": t.system, "transport": t.transport, "workers": workers,
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

    def _say(self, what: str) -> None:
        self.progress.update(self.task, description=what)
        self.progress.refresh()

    def _tick(self) -> None:
        self.progress.advance(self.task)
        self.progress.refresh()

    def point(self, t: Target, op: str, block: int, batch: int, conc: int, workers: int,
              ws: list[bytes] | None = None) -> None:  # fmt: skip
        self._say(f"{t.system}/{t.transport} {op} {format_size(block)} x{batch} c{conc}")
        if ws is not None and len(ws) < batch:
            self.notes.append(
                f"{t.system}/{t.transport} {op} {format_size(block)} x{batch} c{conc} w{workers}"
                f" skipped: only {len(ws)} blocks to read could be stored"
            )
            self._tick()
            return
        runs = [run_point(t, self.plan, op, block, batch, conc, workers, ws)
                for _ in range(max(1, self.plan.repeat))]  # fmt: skip
        self.points.append(sorted(runs, key=lambda p: p.gib_s)[len(runs) // 2])
        self._tick()

    def _working_sets(self, targets: list[Target], block: int, need: int) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for t in targets:
            if t.store not in out:
                self._say(f"{t.store}: storing {format_size(block)} blocks to read")
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
                    self.point(t, "put", block, batch, conc, 1)
            if not combos:
                continue
            sets = self._working_sets(targets, block, max(b * c for b, c in combos))
            for batch, conc in combos:
                for t in targets:
                    self.point(t, "get", block, batch, conc, 1, sets[t.store])
            self._drop(targets, sets)
        for t in targets:
            self._say(f"{t.system}/{t.transport} batch_exists x{EXISTS_KEYS}")
            self.exists.append(run_exists(t, self.plan, 1))
            self._tick()

    def aggregate(self, targets: list[Target], workers: int) -> None:
        """1 MiB blocks, 32 per worker in one batch, spread over ``workers``; exists."""
        block, batch = 1 << 20, 32 * workers
        for t in targets:
            self.point(t, "put", block, batch, 1, workers)
        sets = self._working_sets(targets, block, batch)
        for t in targets:
            self.point(t, "get", block, batch, 1, workers, sets[t.store])
        self._drop(targets, sets)
        for t in targets:
            self.exists.append(run_exists(t, self.plan, workers))
            self._tick()


@contextlib.contextmanager
def systems(
    plan: Plan, transports: list[str], vs: list[str], dram: str, log_dir: str | None,
    notes: list[str], master: str | None = None,
) -> Iterator[tuple[list[Target], Callable[[], None]]]:  # fmt: skip
    """Start the cluster (and peers), or use the running one at ``master``; yield the
    targets and a function that grows every system to ``plan.aggregate_workers``
    servers (not for a running cluster). Everything started stops on exit."""
    with contextlib.ExitStack() as stack:
        quiet = subprocess.DEVNULL if log_dir is None else None
        cluster: LocalCluster | None = None
        if master is None:
            cluster = stack.enter_context(
                LocalCluster(workers=1, dram_size=dram, log_dir=log_dir, stderr=quiet)
            )
        address = master or (cluster.address if cluster else "")
        targets: list[Target] = []
        for tr in transports:
            try:
                client = stack.enter_context(Client(address, timeout=120.0, transport=tr))
            except (KVStoreError, ValueError) as e:
                notes.append(f"kvstore transport {tr!r} skipped: {e}")
                continue
            targets.append(KvTarget(client, cluster, tr))
        server: MooncakeServer | None = None
        if "mooncake" in vs:
            try:
                server = MooncakeServer(segment_size=plan.capacity, log_dir=log_dir).start()
                stack.callback(server.stop)
                adapter = stack.enter_context(MooncakeStoreAdapter(server.master_address))
                targets.append(MooncakeTarget(adapter, server))
            except PeerUnavailable as e:
                notes.append(f"mooncake skipped: {e}")

        def grow() -> None:
            n = plan.aggregate_workers
            if cluster is None:
                return
            for _ in range(n - len(cluster.worker_procs)):
                cluster.add_worker()
            cluster.wait_for_workers(n)
            deadline = time.monotonic() + 20
            for t in targets:
                while isinstance(t, KvTarget) and len(t.client.workers()) < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a client never saw the added workers")
                    time.sleep(0.05)
            while server is not None and len(server.hosts) < n:
                server.add_segment_host()

        yield targets, grow


def _socket_runs(quick: bool, n: int = 3, streams: int = 1) -> list[float]:
    """``n`` separate bare-socket runs (GiB/s) of ``streams`` streams at once, to report
    a median and a spread."""
    total = (256 << 20) if quick else (1 << 30)
    return [ceilings.socket_streams_gib_s(streams, total, repeats=1) for _ in range(n)]


# ---- command -------------------------------------------------------------------------


def _ceiling_note(master: str) -> str:
    """What the ceilings mean against a running cluster: they are measured on this host
    (a memcpy, and socket streams over loopback), which bounds a worker on this host;
    for workers on other hosts, the network between is not measured here."""
    local = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with contextlib.suppress(OSError):
        local.update(socket.gethostbyname_ex(socket.gethostname())[2])
    host = master.rsplit(":", 1)[0].strip("[]")
    where = "this host" if host in local else f"this host, not the network to {host}"
    return (
        f"running cluster at {master}: the ceilings are measured on {where} "
        "(memcpy on the client; socket streams over loopback)"
    )


def _list(text: str, conv: Callable[[str], int]) -> list[int]:
    try:
        out = [conv(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, KVStoreError) as e:
        raise click.BadParameter(str(e)) from e
    if not out or min(out) <= 0:
        raise click.BadParameter(f"{text!r}: want a comma list of positive values")
    return out


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    for x in out:
        if x not in allowed:
            raise click.BadParameter(f"unknown {what} {x!r}; choose from {', '.join(allowed)}")
    return out


@click.command("transfer")
@click.option(
    "--transport",
    "transports",
    default="tcp,shm",
    show_default=True,
    help="kvstore transports (comma list); an unavailable one is skipped with a note.",
)
@click.option("--vs", "peers", default="", help="Peers to run in the same run: mooncake.")
@click.option("--quick", is_flag=True, help="A small grid and budget (under a minute).")
@click.option("--total-bytes", default=None, help="Bytes per point [2GiB; quick 256MiB].")
@click.option(
    "--max-seconds",
    type=float,
    default=None,
    help="Clock seconds per point at most [4; quick 0.4].",
)
@click.option("--block-sizes", default=None, help="Comma list [4KiB,16KiB,...,16MiB].")
@click.option("--batch-sizes", default=None, help="Comma list [1,8,32,128; quick 1,32].")
@click.option("--concurrency", default=None, help="Client threads, comma list [1,4; quick 1].")
@click.option(
    "--repeat", type=int, default=1, show_default=True, help="Runs per point; the median is kept."
)
@click.option("--dram-size", default=None, help="Per worker and segment [1GiB; quick 256MiB].")
@click.option(
    "--aggregate-workers",
    type=int,
    default=4,
    show_default=True,
    help="Servers of the aggregate point (1 = no aggregate point).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=str(RESULTS),
    show_default=True,
    help="Directory of the JSON and PNG.",
)
@click.option("--log-dir", default=None, help="Keep the daemons' logs here.")
@click.option("--parts", default=None, help="Only the multi-part points: part counts, e.g. 1,8,80.")
@click.option("--match-prefix", is_flag=True, help="Only match_prefix latency (1,000 blocks).")
@click.option(
    "--master",
    default=None,
    help="Measure the running cluster at this master (HOST:PORT) instead of starting one.",
)
@click.option(
    "--device",
    type=click.Choice(["cuda", "cpu"]),
    default=None,
    help="Only the engine's data path: the vLLM connector's saves and loads of a "
    "FlashAttention cache on this device (cpu: the same path, host mover).",
)
def transfer_cmd(
    transports: str, peers: str, quick: bool, total_bytes: str | None, max_seconds: float | None,
    block_sizes: str | None, batch_sizes: str | None, concurrency: str | None, repeat: int,
    dram_size: str | None, aggregate_workers: int, out_dir: str, log_dir: str | None,
    parts: str | None, match_prefix: bool, master: str | None, device: str | None,
) -> None:  # fmt: skip
    """Remote put/get bandwidth per block size, batch and concurrency, against the
    ceilings (bare socket, memcpy) and optionally Mooncake Store over TCP."""
    if "mooncake" in _names(peers, PEERS, "peer"):
        why = unavailable_reason("mooncake")
        if why:  # at once, not after the sweep
            raise click.ClickException(f"--vs mooncake: {why}; scripts/install_peers.sh does both")
    if master and (parts or match_prefix):
        raise click.UsageError(
            "--master measures the grid; --parts and --match-prefix start their own cluster"
        )
    if device:
        from .device import main as device_main

        blocks = _list(batch_sizes, int)[0] if batch_sizes else (8 if quick else 64)
        layers = 4 if quick else 32
        return device_main(device, layers, blocks, 1 if quick else 5, 256, out_dir, master)
    if parts or match_prefix:
        blk = _list(block_sizes, parse_size)[0] if block_sizes else 1 << 20
        bat = _list(batch_sizes, int)[0] if batch_sizes else 32
        total = _list(total_bytes or "1GiB", parse_size)[0]
        from .samehost import main as same_host

        counts = _list(parts, int) if parts else []
        trs = _names(transports, TRANSPORTS, "transport")
        vs_ = _names(peers, PEERS, "peer")
        return same_host(trs, counts, match_prefix, blk, bat, total, dram_size, out_dir, vs_)
    grid = QUICK_GRID if quick else FULL_GRID
    dram = dram_size or ("256MiB" if quick else "1GiB")
    plan = Plan(
        blocks=_list(block_sizes, parse_size) if block_sizes else grid["blocks"],
        batches=_list(batch_sizes, int) if batch_sizes else grid["batches"],
        concurrency=_list(concurrency, int) if concurrency else grid["concurrency"],
        total_bytes=_list(total_bytes or ("256MiB" if quick else "2GiB"), parse_size)[0],
        max_seconds=max_seconds if max_seconds is not None else (0.4 if quick else 4.0),
        capacity=_list(dram, parse_size)[0],
        aggregate_workers=aggregate_workers,
        repeat=repeat,
    )
    kv_transports = _names(transports, TRANSPORTS, "transport")
    vs = _names(peers, PEERS, "peer")
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)
    started = time.strftime("%Y%m%d-%H%M%S")
    notes: list[str] = []
    if master:
        if plan.aggregate_workers > 1:
            notes.append(
                f"running cluster at {master}: no aggregate point (the bench adds servers "
                "only to a cluster it started); worker CPU is not counted"
            )
        plan.aggregate_workers = 1
        notes.append(_ceiling_note(master))
    console.print("measuring the ceilings (bare socket, 1 and N streams; memcpy) ...")
    first = ceilings.measure(quick).to_json()
    socket_runs = _socket_runs(quick)
    streams = ceilings.client_streams(plan.concurrency, plan.aggregate_workers)
    stream_runs = {n: _socket_runs(quick, streams=n) for n in streams}
    progress = Progress(TextColumn("{task.description:<44}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=console, auto_refresh=False)  # fmt: skip
    with progress:
        task = progress.add_task("starting the cluster", total=None)
        runner = Runner(plan, progress, task)
        with systems(plan, kv_transports, vs, dram, log_dir, notes, master) as (targets, grow):
            progress.update(task, total=Runner.count(plan, len(targets)))
            runner.sweep(targets)
            if plan.aggregate_workers > 1:
                runner._say(f"growing to {plan.aggregate_workers} servers each")
                grow()
                runner.aggregate(targets, plan.aggregate_workers)
            runner._say("stopping")
    notes.extend(runner.notes)
    console.print("measuring the ceilings again; each is the better of the two runs ...")
    last = ceilings.measure(quick).to_json()
    socket_runs += _socket_runs(quick)
    # memcpy: the better of the two (it is steady); the socket: the median of its runs
    # with their spread, because one noisy run must not decide the targets.
    ceil: dict[str, Any] = {
        "memcpy_gib_s": max(first["memcpy_gib_s"], last["memcpy_gib_s"]),
        "socket_gib_s": float(np.median(socket_runs)),
        "socket_runs": socket_runs,
        # N streams at once (3 runs each, N = workers x concurrency of some point)
        "socket_streams": {
            str(n): {"runs": r, "median": float(np.median(r))} for n, r in stream_runs.items()
        },
    }
    for p in runner.points:
        p.frac_socket = p.gib_s / ceil["socket_gib_s"]
        p.frac_memcpy = p.gib_s / ceil["memcpy_gib_s"]
        many = ceil["socket_streams"].get(str(p.workers * p.concurrency))
        p.frac_socket_streams = p.gib_s / many["median"] if many else p.frac_socket
    result: dict[str, Any] = {
        "benchmark": "transfer", "version": 1, "started": started,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "load": os.getloadavg()},
        "config": {"quick": quick, "master": master, "transports": kv_transports, "vs": vs,
                   "blocks": plan.blocks,
                   "batches": plan.batches, "concurrency": plan.concurrency,
                   "total_bytes": plan.total_bytes, "max_seconds": plan.max_seconds,
                   "dram_bytes": plan.capacity, "aggregate_workers": plan.aggregate_workers,
                   "repeat": plan.repeat},
        "ceilings": ceil, "ceilings_runs": [first, last],
        "points": [asdict(p) for p in runner.points],
        "exists": runner.exists,
        "excluded": plan.excluded(),
        "notes": notes,
        "targets": evaluate_targets(
            runner.points,
            runner.exists,
            ceil["socket_gib_s"],
            (min(socket_runs), max(socket_runs)),
        ),
    }  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"transfer-{started}.json", out / f"transfer-{started}.png"
    json_path.write_text(json.dumps(result, indent=1))
    transfer_tables(console, result, runner.points, EXISTS_KEYS)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    plot_note = transfer_plot(png_path, runner.points, ceil)
    console.print(f"results: {json_path}" + (f" ({plot_note})" if plot_note else f", {png_path}"))
