"""Faults under concurrent verifiable load: killed and stopped workers, a killed master,
a client killed mid-put. Readers may miss; they never get wrong or partial bytes.

Every test runs the load generator (tests/reliability/loadgen.py) in threads of this
process while it injects the fault, then reads the per-call samples by time window.
Results are tabulated in docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest

from kvstore.cluster import Daemon, LocalCluster, spawn
from kvstore_client import Client, Unavailable
from kvstore_client.proto import master_pb2, master_pb2_grpc, store_pb2
from tests.conftest import MakeCluster
from tests.reliability.loadgen import (
    READS,
    LoadConfig,
    LoadGen,
    LoadResult,
    block_value,
    session_key,
    store_stats,
)

MiB = 1 << 20
NS = "faults/bf16/b16/tp0of1"


@contextmanager
def running(cfg: LoadConfig) -> Iterator[LoadGen]:
    """Start the load; stop it on exit even when the test fails."""
    gen = LoadGen(cfg).start()
    try:
        yield gen
    finally:
        if not gen.stopping.is_set():
            gen.stop()


def wait_for(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    """Seconds until ``pred()`` held; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout}s")


def no_bad_outcomes(res: LoadResult) -> None:
    assert res.wrong == 0, f"{res.wrong} blocks came back with wrong bytes: {res.wrong_samples}"
    assert res.error_count == 0, f"calls raised: {dict(res.errors)} {res.error_samples}"


def in_flight_at(res: LoadResult, t: float) -> int:
    return sum(1 for s in res.samples if s[0] <= t <= s[0] + s[2])


# ---- SIGKILL a worker mid-transfer -------------------------------------------------


def test_sigkill_worker_mid_transfer_gives_misses_never_wrong_bytes(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(workers=2, dram_size="128MiB", max_value_size="1MiB", worker_ttl="2s")
    cfg = LoadConfig(
        master=cluster.address,
        sessions=8,
        duration=60,
        min_size=64 << 10,
        max_size=512 << 10,  # batches of ~2 MiB: frames are in flight most of the time
        transport="mix",
        timeout=2.0,
        namespace=NS,
        salt="kill",
    )
    victim = cluster.worker_procs[0]
    with running(cfg) as gen:
        time.sleep(1.5)
        t_kill = gen.elapsed()
        victim.signal(signal.SIGKILL)
        victim.proc.wait(5)
        wait_for(lambda: victim.ready["id"] not in cluster.live_worker_ids(), 6)
        t_dropped = gen.elapsed()
        time.sleep(1.0)
        res = gen.stop()
    no_bad_outcomes(res)
    before = res.window(0, t_kill, READS, ended_by=t_kill)
    after = res.window(t_kill, res.duration + 1, READS)
    puts_after = res.window(t_dropped, res.duration + 1, ("put",))
    assert in_flight_at(res, t_kill) > 0, "the kill should land while calls are in flight"
    assert before.hits > 0 and before.misses == 0, f"before the kill: {before}"
    assert after.misses > 0, "the killed worker's blocks must turn into misses"
    assert after.hits > 0, "the survivor's blocks still come back"
    assert puts_after.hits > 0, "writes keep being stored once the map dropped the worker"
    assert cluster.worker_procs[1].alive()
    print(
        f"\nSIGKILL: {in_flight_at(res, t_kill)} calls in flight at the kill; before: "
        f"{before.hits} hits, {before.misses} misses; after: {after.hits} hits, {after.misses} "
        f"misses, {res.wrong} wrong, {res.error_count} errors; dropped from the map after "
        f"{t_dropped - t_kill:.1f}s; {puts_after.hits} blocks stored after the drop"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_kill_restart_stop_workers_under_load(make_cluster: MakeCluster) -> None:
    """Two minutes of SIGKILL + restart and SIGSTOP + SIGCONT of random workers."""
    cluster = make_cluster(workers=3, dram_size="128MiB", max_value_size="1MiB", worker_ttl="2s")
    cfg = LoadConfig(
        master=cluster.address,
        sessions=16,
        duration=600,
        min_size=16 << 10,
        max_size=256 << 10,
        transport="mix",
        timeout=2.0,
        namespace=NS,
        salt="chaos",
    )
    rng = random.Random(8)
    faults = 0
    with running(cfg) as gen:
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(1.0, 4.0))
            i = rng.randrange(len(cluster.worker_procs))
            w = cluster.worker_procs[i]
            if rng.random() < 0.5:
                cluster.restart_worker(i, kill=True)
            else:
                w.signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.5, 4.0))
                w.signal(signal.SIGCONT)
            faults += 1
            cluster.wait_for_workers(3, timeout=20)
        res = gen.stop()
    no_bad_outcomes(res)
    assert faults >= 20 and res.hits > 0
    print(f"\nchaos: {faults} faults, {res.summary()}")


# ---- SIGSTOP / SIGCONT a worker ----------------------------------------------------


def test_sigstop_worker_calls_end_at_deadline_then_ttl_drops_it_and_sigcont_returns_it(
    make_cluster: MakeCluster,
) -> None:
    ttl = 2.0
    timeout = 1.0
    cluster = make_cluster(workers=2, dram_size="128MiB", max_value_size="1MiB", worker_ttl="2s")
    cfg = LoadConfig(
        master=cluster.address,
        sessions=6,
        duration=60,
        min_size=16 << 10,
        max_size=64 << 10,
        transport="mix",
        timeout=timeout,
        namespace=NS,
        salt="stop",
    )
    victim = cluster.worker_procs[0]
    vid = victim.ready["id"]
    probe_keys = [session_key(999, i, "stop-probe") for i in range(64)]
    probe_vals = [block_value(k, 4096) for k in probe_keys]
    with Client(cluster.address, timeout=timeout, transport="tcp") as probe, running(cfg) as gen:
        assert all(probe.batch_put(NS, probe_keys, probe_vals))
        time.sleep(1.5)
        t_stop = gen.elapsed()
        victim.signal(signal.SIGSTOP)
        try:
            drop_s = wait_for(lambda: vid not in cluster.live_worker_ids(), ttl + 4)
            t_dropped = gen.elapsed()
            wait_for(lambda: vid not in {w.id for w in probe.workers()}, 3)
            time.sleep(1.5)
            t_cont = gen.elapsed()
        finally:
            victim.signal(signal.SIGCONT)
        back_s = wait_for(lambda: vid in {w.id for w in probe.workers()}, 6)
        t_back = gen.elapsed()
        time.sleep(1.0)
        # The stopped worker kept its blocks: once back in the map they hit again.
        got = probe.batch_get(NS, probe_keys)
        res = gen.stop()
    no_bad_outcomes(res)
    assert got == probe_vals, "blocks of the resumed worker must be readable and exact"
    stopped = [s for s in res.samples if t_stop <= s[0] < t_dropped]
    assert stopped, "calls were made while the worker was stopped"
    worst = max(s[2] for s in stopped)
    # A call to a stopped worker ends after `timeout` per socket operation; a fan-out over
    # several workers waits at most timeout + 1 s (client.py). Allow scheduling slack.
    assert worst < 2 * timeout + 1.5, f"a call took {worst:.2f}s while the worker was stopped"
    assert drop_s < ttl + 2.0, f"the master dropped the stopped worker after {drop_s:.1f}s"
    healthy = res.window(t_dropped + 0.5, t_cont)
    assert healthy.calls > 0 and healthy.p99 < timeout, (
        f"once the map dropped the worker, calls are fast again: {healthy}"
    )
    assert back_s < 5.0, f"SIGCONT: back in the map after {back_s:.1f}s"
    assert res.window(t_back, res.duration + 1, READS).hits > 0
    print(
        f"\nSIGSTOP: {len(stopped)} calls while stopped, slowest {worst:.2f}s "
        f"(timeout {timeout}s); dropped after {drop_s:.1f}s (TTL {ttl}s); p99 after the drop "
        f"{healthy.p99 * 1e3:.0f} ms; SIGCONT: back in the map after {back_s:.1f}s; "
        f"{res.wrong} wrong, {res.error_count} errors"
    )


# ---- SIGKILL the master ------------------------------------------------------------


def _restart_master(cluster: LocalCluster) -> Daemon:
    """Start a master on the killed one's port; the old daemon goes to ``retired``."""
    old = cluster.master
    assert old is not None
    port = old.address.rsplit(":", 1)[1]
    new = spawn(
        "master",
        ["--host", cluster.host, "--port", port, "--worker-ttl", cluster.worker_ttl],
        log_path=cluster._log("master-restarted"),
    )
    cluster.retired.append(old)
    cluster.master = new
    return new


def test_sigkill_master_data_path_keeps_reading_and_writing(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=2, dram_size="128MiB", max_value_size="1MiB", worker_ttl="2s")
    cfg = LoadConfig(
        master=cluster.address,
        sessions=6,
        duration=60,
        min_size=16 << 10,
        max_size=64 << 10,
        transport="mix",
        timeout=2.0,
        namespace=NS,
        salt="master",
    )
    assert cluster.master is not None
    with running(cfg) as gen:
        time.sleep(1.5)
        t_kill = gen.elapsed()
        cluster.master.signal(signal.SIGKILL)
        cluster.master.proc.wait(5)
        time.sleep(2.5)  # longer than the worker TTL: nothing may expire client-side
        # A new client cannot start without a master: a clean Unavailable, within its deadline.
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            Client(cluster.address, timeout=1.0)
        new_client_s = time.monotonic() - t0
        t_restart = gen.elapsed()
        _restart_master(cluster)
        cluster.wait_for_workers(2, timeout=10)
        # The clients' watch reconnects (its backoff reaches 2 s) and takes the new map.
        t_settled = gen.elapsed() + 2.5
        time.sleep(4.0)
        res = gen.stop()
    no_bad_outcomes(res)
    reads = res.window(t_kill, t_restart, READS, ended_by=t_restart)
    writes = res.window(t_kill, t_restart, ("put",), ended_by=t_restart)
    assert reads.hits > 0 and reads.misses == 0, f"reads without a master: {reads}"
    assert writes.hits > 0 and writes.misses == 0, f"writes without a master: {writes}"
    # While the restarted master fills its map again, a client may briefly route by a map
    # that lacks a worker (misses); once every worker is back, nothing is missed.
    later = res.window(t_settled, res.duration + 1, READS)
    assert later.hits > 0 and later.misses == 0, f"after the restart settled: {later}"
    assert new_client_s < 3.0
    assert all(w.alive() for w in cluster.worker_procs)
    print(
        f"\nmaster SIGKILL: {reads.calls} reads ({reads.hits} hits, {reads.misses} misses) and "
        f"{writes.calls} writes ({writes.hits} stored, {writes.misses} not) in "
        f"{t_restart - t_kill:.1f}s without a master; a new client gave up after "
        f"{new_client_s:.2f}s (Unavailable); after the restart settled {later.hits} hits, "
        f"{later.misses} misses"
    )
    with Client(cluster.address, timeout=2.0) as c:
        assert len(c.workers()) == 2, "the restarted master has every worker back"


GHOST = "g" * 32  # the ghosts' instance token (every Register/Leave carries one)


def _ghost(i: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"ghost-{i}",
        grpc="127.0.0.1:1",
        endpoints=["tcp://127.0.0.1:1"],
        capacity_bytes=MiB,
        max_value_bytes=MiB,
    )


def _churn(cluster: LocalCluster, ghost: int) -> None:
    """A worker joins and leaves (two map versions), as happens in any long-lived cluster."""
    with grpc.insecure_channel(cluster.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        stub.Register(master_pb2.RegisterRequest(worker=_ghost(ghost), instance=GHOST), timeout=5)
        stub.Leave(master_pb2.LeaveRequest(worker_id=f"ghost-{ghost}", instance=GHOST), timeout=5)


def test_master_restart_map_changes_still_reach_running_clients(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(workers=1, dram_size="32MiB", max_value_size="1MiB", worker_ttl="2s")
    assert cluster.master is not None
    with Client(cluster.address, timeout=2.0) as c:
        for i in range(3):
            _churn(cluster, i)
        wait_for(lambda: c.map_version >= 8, 5)
        cluster.master.signal(signal.SIGKILL)
        cluster.master.proc.wait(5)
        _restart_master(cluster)
        cluster.wait_for_workers(1, timeout=10)
        # A worker joins the restarted master: the running client must route to it.
        with grpc.insecure_channel(cluster.address) as ch:
            master_pb2_grpc.MasterStub(ch).Register(
                master_pb2.RegisterRequest(worker=_ghost(9), instance=GHOST), timeout=5
            )
        wait_for(lambda: "ghost-9" in {w.id for w in c.workers()}, 3)


# ---- a client killed mid-put --------------------------------------------------------

# Runs in a child process: the real Client, slowed down so the parent can kill it while a
# big batch is on the wire (tcp: sendmsg trickles 256 KiB per call; shm: each block copy
# into the mapped arena takes 30 ms).
_DYING_WRITER = """
import socket, sys, time
import numpy as np
from kvstore_client import Client
from tests.reliability.loadgen import block_value, session_key

if PARAMS["transport"] == "tcp":
    real_sendmsg = socket.socket.sendmsg
    def slow_sendmsg(self, buffers, *args):
        left, out = 256 << 10, []
        for b in buffers:
            m = memoryview(b).cast("B")[:left]
            out.append(m)
            left -= len(m)
            if not left:
                break
        time.sleep(0.02)
        return real_sendmsg(self, out, *args)
    socket.socket.sendmsg = slow_sendmsg
else:
    real_copyto = np.copyto
    def slow_copyto(dst, src, *args, **kw):
        time.sleep(0.03)
        return real_copyto(dst, src, *args, **kw)
    np.copyto = slow_copyto

keys = [session_key(0, i, "dying") for i in range(PARAMS["n"])]
vals = [block_value(k, PARAMS["size"]) for k in keys]
with Client(PARAMS["master"], timeout=60, transport=PARAMS["transport"]) as c:
    print("SENDING", flush=True)
    c.batch_put(PARAMS["ns"], keys, vals)
print("DONE", flush=True)
"""


@pytest.mark.parametrize(
    ("transport", "refill"),
    [
        ("tcp", MiB),
        # Slabs of aborted 1 MiB reservations must go to another size class (this found
        # a bug, fixed in 27a66ce: they used to stay with the 1 MiB class for good).
        pytest.param("tcp", 256 << 10, id="tcp-refill-256KiB"),
        pytest.param("shm", MiB, marks=pytest.mark.slow),
    ],
)
def test_client_killed_mid_put_leaves_nothing_visible_and_space_is_reclaimed(
    make_cluster: MakeCluster, transport: str, refill: int
) -> None:
    cluster = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB", worker_ttl="2s")
    grpc_addr = cluster.worker_procs[0].ready["grpc"]
    n, size = 48, MiB  # 48 MiB in one batch: two 32 MiB frames over two connections
    keys = [session_key(0, i, "dying") for i in range(n)]
    prog = "import json\nPARAMS = json.loads(sys.argv[1])\n" + textwrap.dedent(_DYING_WRITER)
    params = {"master": cluster.address, "transport": transport, "n": n, "size": size, "ns": NS}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys\n" + prog, json.dumps(params)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith(b"SENDING"):
            proc.kill()
            err = proc.stderr.read() if proc.stderr else b""
            raise AssertionError(f"the writer did not start: {(line + err)[-3000:]!r}")
        # Wait until the worker has reserved slots for the batch and bytes are arriving.
        wait_for(lambda: store_stats(grpc_addr).used_bytes >= 16 * MiB, 10)
        time.sleep(0.4)
        # A sample can fall between two blocks (every reservation committed): sample
        # until one is pending, then kill at once.
        samples: list[store_pb2.StatsResponse] = []

        def pending() -> bool:
            samples.append(store_stats(grpc_addr))
            return samples[-1].used_bytes > samples[-1].keys * size

        wait_for(pending, 5)
        mid = samples[-1]
        with Client(cluster.address, timeout=2.0) as reader:
            visible_mid = sum(reader.batch_exists(NS, keys))
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    assert mid.used_bytes > mid.keys * size, "killed while reservations were pending"

    # The connection died: every pending reservation is aborted and its space freed.
    def settled() -> bool:
        s = store_stats(grpc_addr)
        return s.used_bytes == s.keys * size

    reclaim_s = wait_for(settled, 5)
    final = store_stats(grpc_addr)
    with Client(cluster.address, timeout=5.0, transport=transport) as c:
        got = c.batch_get(NS, keys)
        ok = [g for g in got if g is not None]
        assert len(ok) == final.keys, "only whole, verified blocks are visible"
        assert final.keys < n, "the writer died before its batch was complete"
        assert mid.keys <= visible_mid <= final.keys, "only committed blocks are ever visible"
        assert all(g == block_value(k, size) for k, g in zip(keys, got, strict=True) if g)
        c.remove(NS, keys)
        before = store_stats(grpc_addr)
        assert before.used_bytes == 0 and before.keys == 0
        # The worker can fill its whole DRAM again, without evicting anything.
        slots = before.capacity_bytes // refill
        fill = [session_key(1, i, f"fill-{transport}") for i in range(slots)]
        vals = [block_value(k, refill) for k in fill]
        for s in range(0, len(fill), 16):
            assert all(c.batch_put(NS, fill[s : s + 16], vals[s : s + 16]))
        after = store_stats(grpc_addr)
        assert after.used_bytes == after.capacity_bytes, (
            f"only {after.used_bytes / after.capacity_bytes:.0%} of the arena is usable "
            f"by {refill >> 10} KiB blocks ({after.evictions - before.evictions} evictions)"
        )
        assert after.evictions == before.evictions, "filling the arena evicted nothing"
        assert c.batch_get(NS, fill) == vals
        # And the dead writer's keys can be written by someone else.
        assert c.remove(NS, fill[:4]) == 4
        assert all(c.batch_put(NS, keys[:4], [block_value(k, size) for k in keys[:4]]))
    print(
        f"\nclient killed mid-put ({transport}): "
        f"{(mid.used_bytes - mid.keys * size) / MiB:.0f} MiB reserved and pending at the "
        f"kill, {final.keys} of {n} blocks complete; pending space freed {reclaim_s:.2f}s "
        f"after the kill; then {slots} x {refill >> 10} KiB filled the arena, "
        f"{after.evictions - before.evictions} evictions"
    )
