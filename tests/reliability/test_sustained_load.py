"""Sustained load: 64 concurrent client sessions of verifiable put/get/remove.

Throughput and p99 latency must hold steady (the last third of the run against the
first, after a warm-up while clients connect), worker memory must stay flat, and
nothing may leak: worker and client descriptors return to their baselines when the
sessions close, client threads end, and (conftest) no arena file stays in /dev/shm.

The default run lasts 15 s; ``--runslow`` adds a 4-minute run over two client processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from tests.conftest import MakeCluster
from tests.reliability.loadgen import LoadConfig, LoadResult, ProcSampler, fd_count, run_load

MiB = 1 << 20
WARMUP = 2.0  # seconds: 64 clients fetch the map and map the arenas


def wait_until(pred: Callable[[], bool], timeout: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def sustained(cluster: LocalCluster, duration: float, processes: int = 1) -> None:
    pids = [w.pid for w in cluster.worker_procs]
    with Client(cluster.address):  # warm up grpc's process-wide state before the baselines
        pass
    worker_fds0 = {pid: fd_count(pid) for pid in pids}
    own_fds0 = fd_count()
    threads0 = threading.active_count()
    sampler = ProcSampler(pids, interval=0.5).start()
    cfg = LoadConfig(
        master=cluster.address,
        sessions=64,
        duration=duration,
        transport="mix",  # half the sessions over tcp://, half over shm://
        timeout=5.0,
        processes=processes,
        salt=f"sustained-{duration}",
    )
    try:
        res = run_load(cfg)
    finally:
        sampler.stop()
    report(res, sampler, pids)
    # Correctness: exact bytes, no errors, no lost blocks (the working set fits in DRAM).
    assert res.wrong == 0, f"{res.wrong} wrong blocks: {res.wrong_samples}"
    assert res.error_count == 0, f"{dict(res.errors)}: {res.error_samples}"
    assert res.misses == 0, f"{res.misses} live blocks missed without any fault"
    assert res.put_not_stored == 0
    # Stability: compare the first and the last third after the warm-up.
    first, _, last = res.thirds(warmup=WARMUP)
    assert first.calls > 100 and last.calls > 100, (first, last)
    assert last.blocks_per_s >= 0.5 * first.blocks_per_s, (
        f"throughput fell from {first.blocks_per_s:.0f} to {last.blocks_per_s:.0f} blocks/s"
    )
    assert last.p99 <= 2 * first.p99 + 0.1, (
        f"p99 rose from {first.p99 * 1e3:.0f} ms to {last.p99 * 1e3:.0f} ms"
    )
    # Worker memory is flat: heap (RssAnon) of the last third vs the first, after warm-up.
    t_end = max(s.t for s in sampler.samples)
    third = (t_end - WARMUP) / 3
    for pid in pids:
        a = np.mean([s.rss_anon for s in sampler.of(pid, WARMUP, WARMUP + third)])
        b = np.mean([s.rss_anon for s in sampler.of(pid, t_end - third, t_end)])
        assert b - a < 32 * MiB, f"worker {pid} heap grew {(b - a) / MiB:.1f} MiB under load"
    # No leaks once the sessions closed: worker connections, our sockets, our threads.
    for pid in pids:
        assert wait_until(lambda pid=pid: fd_count(pid) <= worker_fds0[pid] + 2, 10), (
            f"worker {pid}: {fd_count(pid)} fds after the load, {worker_fds0[pid]} before"
        )
    assert wait_until(lambda: fd_count() <= own_fds0 + 2, 10), (
        f"client process: {fd_count()} fds after, {own_fds0} before"
    )
    assert wait_until(lambda: threading.active_count() <= threads0 + 2, 10), (
        f"client threads: {threading.active_count()} after, {threads0} before"
    )


def report(res: LoadResult, sampler: ProcSampler, pids: list[int]) -> None:
    """One line per third, for docs/RELIABILITY.md (visible with pytest -s)."""
    print(f"\n{res.sessions} sessions, {res.duration:.0f} s: {res.summary()['calls']}")
    print(
        f"blocks put {res.put_stored}, read {res.get_blocks} (hits {res.hits}, misses "
        f"{res.misses}, wrong {res.wrong}), removed {res.removed}, errors {dict(res.errors)}"
    )
    for i, w in enumerate(res.thirds(warmup=WARMUP)):
        print(
            f"third {i + 1}: {w.blocks_per_s:.0f} blocks/s, {w.calls_per_s:.0f} calls/s, "
            f"p50 {w.p50 * 1e3:.1f} ms, p99 {w.p99 * 1e3:.1f} ms, max {w.max * 1e3:.0f} ms"
        )
    for pid in pids:
        s = sampler.of(pid)
        print(
            f"worker {pid}: RssAnon {s[0].rss_anon / MiB:.0f} -> {s[-1].rss_anon / MiB:.0f} MiB "
            f"(max {max(x.rss_anon for x in s) / MiB:.0f}), VmRSS max "
            f"{max(x.rss for x in s) / MiB:.0f} MiB, fds max {max(x.fds for x in s)}, "
            f"threads max {max(x.threads for x in s)}"
        )


def test_sustained_load_64_sessions(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=2, dram_size="128MiB", max_value_size="1MiB", worker_ttl="3s")
    sustained(cluster, duration=15.0)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sustained_load_64_sessions_long(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=2, dram_size="256MiB", max_value_size="1MiB", worker_ttl="3s")
    sustained(cluster, duration=240.0, processes=2)
