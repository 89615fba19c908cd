"""A load generator of verifiable blocks: N concurrent client sessions doing put/get.

Every block's size and bytes are a pure function of its key (:func:`block_value`),
so any reader can check what it got, whoever wrote it: a hit whose bytes differ is
counted as ``wrong`` (the one number that must always be zero). Each session owns
its keys: it writes new blocks in batches, keeps its last ``live_keys`` of them
(removing older ones, so the working set stays bounded), and reads random batches
of its live keys back, alternating ``batch_get`` and ``batch_get_into``. A live key
that does not come back is a ``miss`` (zero without faults or evictions). A few
``shared_keys`` are written and read by every session (first writer wins).

Per call it records (start, op, seconds, blocks, hits, misses, wrong, error), so a
test can compare time windows (throughput, p99) and see when misses started.

From a test::

    gen = LoadGen(LoadConfig(master=cluster.address, sessions=8, duration=60))
    gen.start(); ...inject a fault...; result = gen.stop()
    assert result.wrong == 0

From a shell (the repository root on ``sys.path``)::

    python -m tests.reliability.loadgen --master HOST:PORT --sessions 64 --duration 300

Helpers :func:`proc_status`, :func:`fd_count` and :class:`ProcSampler` read
``/proc/PID`` (RSS and open descriptors) without psutil.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvstore_client import Client
from kvstore_client.proto import store_pb2, store_pb2_grpc

OPS = ("put", "get", "get_into", "exists", "remove")
READS = ("get", "get_into")


# ---- verifiable blocks -----------------------------------------------------------

_noise = np.zeros(0, dtype=np.uint8)
_noise_lock = threading.Lock()


def _noise_of(size: int) -> np.ndarray:
    """A fixed pseudo-random byte string (the same in every process), at least ``size`` long."""
    global _noise
    cur = _noise
    if len(cur) >= size:
        return cur
    with _noise_lock:
        if len(_noise) < size:
            n = max(size, 2 * len(_noise), 1 << 16)
            _noise = np.random.default_rng(20260807).integers(0, 256, n, dtype=np.uint8)
        return _noise


def session_key(session: int, i: int, salt: str = "") -> bytes:
    """The i-th key of a session (16 bytes)."""
    return hashlib.blake2b(f"{salt}/s{session}/{i}".encode(), digest_size=16).digest()


def shared_key(i: int, salt: str = "") -> bytes:
    return hashlib.blake2b(f"{salt}/shared/{i}".encode(), digest_size=16).digest()


def block_size(key: bytes, min_size: int, max_size: int) -> int:
    """The size of a key's block, in [min_size, max_size], derived from the key."""
    return min_size + int.from_bytes(key[:4], "little") % (max_size - min_size + 1)


def block_array(key: bytes, size: int) -> np.ndarray:
    """The block of ``key``: its 64-byte digest tiled, XOR a fixed non-periodic noise.

    The digest makes blocks of different keys differ everywhere; the noise makes every
    offset of one block differ from its neighbours, so shifted or spliced bytes show.
    """
    seed = np.frombuffer(hashlib.blake2b(key, digest_size=64).digest(), dtype=np.uint8)
    return np.resize(seed, size) ^ _noise_of(size)[:size]


def block_value(key: bytes, size: int) -> bytes:
    return block_array(key, size).tobytes()


# ---- /proc helpers ---------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """Numeric fields of /proc/PID/status; sizes in bytes (VmRSS, RssAnon, RssShmem...)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                out[name] = int(parts[0]) * 1024
            elif len(parts) == 1 and parts[0].isdigit():
                out[name] = int(parts[0])
    return out


def fd_count(pid: int | str = "self") -> int:
    """Open file descriptors of a process."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass(slots=True)
class ProcSample:
    t: float
    pid: int
    rss: int  # VmRSS bytes (includes the mapped arena)
    rss_anon: int  # RssAnon bytes: heap, stacks, buffers (what leaks would grow)
    fds: int
    threads: int


class ProcSampler:
    """Samples RSS, fds and threads of some pids every ``interval`` seconds in a thread."""

    def __init__(self, pids: Sequence[int], interval: float = 0.5) -> None:
        self.pids = list(pids)
        self.interval = interval
        self.samples: list[ProcSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="proc-sampler", daemon=True)
        self.t0 = time.monotonic()

    def sample(self) -> list[ProcSample]:
        now = time.monotonic() - self.t0
        got: list[ProcSample] = []
        for pid in self.pids:
            try:
                st = proc_status(pid)
                got.append(
                    ProcSample(
                        now,
                        pid,
                        st.get("VmRSS", 0),
                        st.get("RssAnon", 0),
                        fd_count(pid),
                        st.get("Threads", 0),
                    )
                )
            except OSError:
                continue  # the process is gone
        self.samples.extend(got)
        return got

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> ProcSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> list[ProcSample]:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
        return self.samples

    def of(self, pid: int, t0: float = 0.0, t1: float = float("inf")) -> list[ProcSample]:
        return [s for s in self.samples if s.pid == pid and t0 <= s.t < t1]


def store_stats(grpc_addr: str, timeout: float = 5.0) -> store_pb2.StatsResponse:
    """A worker's Stats (used bytes, keys, evictions, bad_frames...) over its gRPC port."""
    with grpc.insecure_channel(grpc_addr) as ch:
        return store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=timeout)


# ---- configuration and results ---------------------------------------------------


@dataclass(slots=True)
class LoadConfig:
    master: str
    sessions: int = 64
    duration: float = 20.0
    min_size: int = 4 << 10
    max_size: int = 32 << 10
    batch: int = 8
    live_keys: int = 64  # per session; older keys are removed
    shared_keys: int = 16  # written and read by every session
    get_fraction: float = 0.7  # of calls; the rest are puts (plus an exists now and then)
    transport: str = "tcp"  # tcp | shm | auto | mix (sessions alternate tcp and shm)
    timeout: float = 5.0  # Client(timeout=...)
    namespace: str = "loadgen/bf16/b16/tp0of1"
    salt: str = ""  # distinguishes runs against the same cluster
    processes: int = 1  # sessions are split over this many processes
    think: float = 0.0  # seconds a session pauses between calls
    seed: int = 0
    session_offset: int = 0  # first session index (set per process)


@dataclass(slots=True)
class Window:
    """What happened in [t0, t1): calls, blocks per second, latency percentiles (s)."""

    t0: float
    t1: float
    calls: int
    blocks_per_s: float
    calls_per_s: float
    p50: float
    p99: float
    max: float
    hits: int
    misses: int
    wrong: int
    errors: int


@dataclass(slots=True)
class LoadResult:
    """Totals and per-call samples: (start s, op, seconds, blocks, hits, misses, wrong, error).

    For a put, ``hits`` is the number of its own new keys stored and ``misses`` the number
    not stored; for a get, hits and misses of live keys.
    """

    sessions: int = 0
    duration: float = 0.0
    calls: Counter[str] = field(default_factory=Counter)
    put_stored: int = 0
    put_not_stored: int = 0  # own keys a put did not store (worker unreachable or full)
    get_blocks: int = 0
    hits: int = 0
    misses: int = 0  # live keys that did not come back
    wrong: int = 0  # hits whose bytes were not the key's bytes
    removed: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    wrong_samples: list[str] = field(default_factory=list)
    samples: list[tuple[float, str, float, int, int, int, int, bool]] = field(default_factory=list)

    def merge(self, other: LoadResult) -> None:
        self.sessions += other.sessions
        self.duration = max(self.duration, other.duration)
        self.calls.update(other.calls)
        self.errors.update(other.errors)
        for name in (
            "put_stored",
            "put_not_stored",
            "get_blocks",
            "hits",
            "misses",
            "wrong",
            "removed",
            "bytes_put",
            "bytes_got",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.error_samples.extend(other.error_samples[:20])
        self.wrong_samples.extend(other.wrong_samples[:20])
        self.samples.extend(other.samples)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def window(
        self, t0: float, t1: float, ops: Sequence[str] = OPS, *, ended_by: float | None = None
    ) -> Window:
        """Stats of the calls that started in [t0, t1) (and ended by ``ended_by``)."""
        end = float("inf") if ended_by is None else ended_by
        sel = [s for s in self.samples if t0 <= s[0] < t1 and s[1] in ops and s[0] + s[2] <= end]
        lat = np.array([s[2] for s in sel]) if sel else np.zeros(1)
        span = max(t1 - t0, 1e-9)
        return Window(
            t0,
            t1,
            len(sel),
            sum(s[3] for s in sel) / span,
            len(sel) / span,
            float(np.percentile(lat, 50)),
            float(np.percentile(lat, 99)),
            float(lat.max()),
            sum(s[4] for s in sel),
            sum(s[5] for s in sel),
            sum(s[6] for s in sel),
            sum(1 for s in sel if s[7]),
        )

    def thirds(self, ops: Sequence[str] = OPS, warmup: float = 0.0) -> list[Window]:
        """Three equal windows of [warmup, duration) (clients connect during the warm-up)."""
        d = (self.duration - warmup) / 3
        return [self.window(warmup + i * d, warmup + (i + 1) * d, ops) for i in range(3)]

    def summary(self) -> dict[str, object]:
        total = self.window(0, self.duration)
        return {
            "sessions": self.sessions,
            "duration_s": round(self.duration, 2),
            "calls": dict(self.calls),
            "put_stored": self.put_stored,
            "put_not_stored": self.put_not_stored,
            "get_blocks": self.get_blocks,
            "hits": self.hits,
            "misses": self.misses,
            "wrong": self.wrong,
            "removed": self.removed,
            "mb_put": round(self.bytes_put / 1e6, 1),
            "mb_got": round(self.bytes_got / 1e6, 1),
            "errors": dict(self.errors),
            "error_samples": self.error_samples[:5],
            "wrong_samples": self.wrong_samples[:5],
            "blocks_per_s": round(total.blocks_per_s, 1),
            "p50_ms": round(total.p50 * 1e3, 2),
            "p99_ms": round(total.p99 * 1e3, 2),
            "max_ms": round(total.max * 1e3, 2),
            "thirds": [
                {
                    "blocks_per_s": round(w.blocks_per_s, 1),
                    "p99_ms": round(w.p99 * 1e3, 2),
                    "get_misses": g.misses,
                    "errors": w.errors,
                }
                for w, g in zip(self.thirds(), self.thirds(READS), strict=True)
            ],
        }


# ---- sessions --------------------------------------------------------------------


class _Session:
    """One client session: its own Client, keys and random stream."""

    def __init__(self, idx: int, cfg: LoadConfig, gen: LoadGen) -> None:
        self.idx = idx
        self.cfg = cfg
        self.gen = gen
        self.rng = random.Random(cfg.seed * 1_000_003 + idx)
        self.live: deque[bytes] = deque()
        self.shared_done: list[bytes] = []
        self.next_i = 0
        self.res = LoadResult(sessions=1)
        if cfg.transport == "mix":
            self.transport = "tcp" if idx % 2 == 0 else "shm"
        else:
            self.transport = cfg.transport

    def size(self, k: bytes) -> int:
        return block_size(k, self.cfg.min_size, self.cfg.max_size)

    def _record(
        self, t: float, op: str, blocks: int, hits: int, misses: int, wrong: int, err: bool
    ) -> None:
        now = time.monotonic()
        self.res.calls[op] += 1
        self.res.samples.append((t - self.gen.t0, op, now - t, blocks, hits, misses, wrong, err))

    def _error(self, t: float, op: str, e: BaseException) -> None:
        name = type(e).__name__
        self.res.errors[name] += 1
        if len(self.res.error_samples) < 20:
            self.res.error_samples.append(f"s{self.idx} {op}: {name}: {e}"[:300])
        self._record(t, op, 0, 0, 0, 0, True)

    def run(self) -> LoadResult:
        cfg = self.cfg
        try:
            client = Client(cfg.master, timeout=cfg.timeout, transport=self.transport)
        except Exception as e:
            self._error(time.monotonic(), "connect", e)
            return self.res
        try:
            while not self.gen.stopping.is_set() and time.monotonic() < self.gen.deadline:
                r = self.rng.random()
                try:
                    if r < 0.03:
                        self.exists(client)
                    elif r < cfg.get_fraction and (self.live or self.shared_done):
                        self.get(client, into=self.rng.random() < 0.5)
                    else:
                        self.put(client)
                except Exception as e:  # every exception is a finding
                    self._error(time.monotonic(), "call", e)
                if cfg.think:
                    self.gen.stopping.wait(cfg.think)
        finally:
            client.close()
        return self.res

    def put(self, c: Client) -> None:
        cfg = self.cfg
        keys = [
            session_key(cfg.session_offset + self.idx, self.next_i + j, cfg.salt)
            for j in range(cfg.batch)
        ]
        self.next_i += cfg.batch
        own = len(keys)
        if cfg.shared_keys:
            keys.append(shared_key(self.rng.randrange(cfg.shared_keys), cfg.salt))
        values = [block_value(k, self.size(k)) for k in keys]
        t = time.monotonic()
        try:
            stored = c.batch_put(cfg.namespace, keys, values)
        except Exception as e:
            self._error(t, "put", e)
            return
        self._record(t, "put", len(keys), sum(stored[:own]), own - sum(stored[:own]), 0, False)
        self.res.bytes_put += sum(len(v) for v in values)
        for i, (k, ok) in enumerate(zip(keys, stored, strict=True)):
            if i < own:
                if ok:
                    self.res.put_stored += 1
                    self.live.append(k)
                else:
                    self.res.put_not_stored += 1
            elif k not in self.shared_done:
                self.shared_done.append(k)  # stored now or by another session before
        if len(self.live) > cfg.live_keys:
            old = [self.live.popleft() for _ in range(len(self.live) - cfg.live_keys)]
            t = time.monotonic()
            try:
                self.res.removed += c.remove(cfg.namespace, old)
            except Exception as e:
                self._error(t, "remove", e)
                return
            self._record(t, "remove", len(old), 0, 0, 0, False)

    def _check(self, k: bytes, got: bytes | np.ndarray | None) -> tuple[int, int, int]:
        """(hit, miss, wrong) for one block read back."""
        if got is None:
            return 0, 1, 0
        want = block_array(k, self.size(k))
        arr = np.frombuffer(got, dtype=np.uint8) if isinstance(got, bytes) else got
        if arr.shape == want.shape and np.array_equal(arr, want):
            return 1, 0, 0
        if len(self.res.wrong_samples) < 20:
            self.res.wrong_samples.append(f"s{self.idx} key {k.hex()}: {len(arr)} bytes")
        return 0, 0, 1

    def get(self, c: Client, into: bool) -> None:
        cfg = self.cfg
        pool = list(self.live)
        n = min(cfg.batch, len(pool))
        keys = self.rng.sample(pool, n) if n else []
        if self.shared_done:
            keys.append(self.rng.choice(self.shared_done))
        op = "get_into" if into else "get"
        t = time.monotonic()
        got: list[bytes | np.ndarray | None]
        try:
            if into:
                bufs = [np.empty(self.size(k), dtype=np.uint8) for k in keys]
                fut = c.batch_get_into(cfg.namespace, keys, [memoryview(b) for b in bufs])
                try:
                    flags = fut.result(timeout=cfg.timeout * 3 + 5)
                except cf.TimeoutError as e:
                    raise TimeoutError("batch_get_into future never completed (hang)") from e
                got = [b if f else None for b, f in zip(bufs, flags, strict=True)]
            else:
                got = list(c.batch_get(cfg.namespace, keys))
        except Exception as e:
            self._error(t, op, e)
            return
        dt_end = time.monotonic()
        hits = misses = wrong = 0
        for k, g in zip(keys, got, strict=True):
            h, m, w = self._check(k, g)
            hits, misses, wrong = hits + h, misses + m, wrong + w
            if h:
                self.res.bytes_got += self.size(k)
        self.res.get_blocks += len(keys)
        self.res.hits += hits
        self.res.misses += misses
        self.res.wrong += wrong
        self.res.calls[op] += 1
        self.res.samples.append(
            (t - self.gen.t0, op, dt_end - t, len(keys), hits, misses, wrong, False)
        )

    def exists(self, c: Client) -> None:
        keys = list(self.live)[-self.cfg.batch * 4 :]
        if not keys:
            return
        t = time.monotonic()
        try:
            flags = c.batch_exists(self.cfg.namespace, keys)
        except Exception as e:
            self._error(t, "exists", e)
            return
        self._record(t, "exists", len(keys), sum(flags), len(keys) - sum(flags), 0, False)


class LoadGen:
    """Runs ``cfg.sessions`` sessions in threads of this process until stopped or done."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.stopping = threading.Event()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.duration
        self._sessions = [_Session(i, cfg, self) for i in range(cfg.sessions)]
        self._pool: cf.ThreadPoolExecutor | None = None
        self._futs: list[cf.Future[LoadResult]] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> LoadGen:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.cfg.duration
        self._pool = cf.ThreadPoolExecutor(self.cfg.sessions, thread_name_prefix="loadgen")
        self._futs = [self._pool.submit(s.run) for s in self._sessions]
        return self

    def stop(self, timeout: float = 60.0) -> LoadResult:
        """Stop every session (they finish their call in flight) and merge their results."""
        self.stopping.set()
        return self.join(timeout)

    def join(self, timeout: float = 60.0) -> LoadResult:
        assert self._pool is not None, "not started"
        out = LoadResult()
        done, pending = cf.wait(self._futs, timeout=timeout)
        for f in done:
            out.merge(f.result())
        if pending:
            out.errors["session_hang"] += len(pending)
            out.error_samples.append(f"{len(pending)} sessions did not finish in {timeout}s")
        self._pool.shutdown(wait=not pending, cancel_futures=True)
        out.duration = min(self.elapsed(), self.cfg.duration)
        return out

    def run(self) -> LoadResult:
        self.start()
        return self.join(self.cfg.duration + 60)


def _run_part(cfg: LoadConfig, start_wall: float) -> LoadResult:
    """One process's share (ProcessPoolExecutor target); sample times from ``start_wall``."""
    time.sleep(max(0.0, start_wall - time.time()))
    return LoadGen(cfg).run()


def run_load(cfg: LoadConfig) -> LoadResult:
    """Run the load to completion, in threads or split over ``cfg.processes`` processes."""
    if cfg.processes <= 1:
        return LoadGen(cfg).run()
    per = [cfg.sessions // cfg.processes] * cfg.processes
    for i in range(cfg.sessions % cfg.processes):
        per[i] += 1
    start_wall = time.time() + 2.0  # every process starts its clock together
    parts: list[LoadConfig] = []
    offset = 0
    for n in per:
        parts.append(dataclasses.replace(cfg, sessions=n, processes=1, session_offset=offset))
        offset += n
    ctx = multiprocessing.get_context("spawn")
    out = LoadResult()
    with cf.ProcessPoolExecutor(len(parts), mp_context=ctx) as ex:
        for r in ex.map(_run_part, parts, [start_wall] * len(parts)):
            out.merge(r)
    out.duration = cfg.duration
    return out


# ---- command line ----------------------------------------------------------------


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "kb": 1000, "mb": 1000**2, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.reliability.loadgen",
        description="Concurrent verifiable put/get load against a kvstore cluster.",
    )
    p.add_argument("--master", required=True, help="master host:port")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--duration", type=float, default=20.0, help="seconds")
    p.add_argument("--min-size", type=_size, default=4 << 10)
    p.add_argument("--max-size", type=_size, default=32 << 10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--live-keys", type=int, default=64, help="live keys per session")
    p.add_argument("--get-fraction", type=float, default=0.7)
    p.add_argument("--transport", default="tcp", choices=["tcp", "shm", "auto", "mix"])
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--namespace", default="loadgen/bf16/b16/tp0of1")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--think", type=float, default=0.0, help="pause between calls (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    cfg = LoadConfig(
        master=a.master,
        sessions=a.sessions,
        duration=a.duration,
        min_size=a.min_size,
        max_size=a.max_size,
        batch=a.batch,
        live_keys=a.live_keys,
        get_fraction=a.get_fraction,
        transport=a.transport,
        timeout=a.timeout,
        namespace=a.namespace,
        processes=a.processes,
        think=a.think,
        seed=a.seed,
        salt=f"cli-{os.getpid()}-{time.time_ns()}",
    )
    res = run_load(cfg)
    summary = res.summary()
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            if k != "thirds":
                print(f"{k:>16}: {v}")
        for i, w in enumerate(summary["thirds"]):  # type: ignore[attr-defined]
            print(f"{'third ' + str(i + 1):>16}: {w}")
    bad = res.wrong or res.error_count
    if bad:
        print(f"FAILED: {res.wrong} wrong blocks, {res.error_count} errors", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
