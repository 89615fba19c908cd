"""Membership with tokens off: a live worker id cannot be taken over or dropped by
anyone but the process that registered it (its instance token); registrations have
size limits; a second worker with the same --id exits with one line; a worker
waits for a master that is down (one log line, backoff) and reports NOT_SERVING
on its health service until it has registered."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.cluster import LocalCluster, free_port, spawn
from kvstore_client import Client
from kvstore_client.proto import master_pb2, master_pb2_grpc
from tests.conftest import MakeCluster, arena_files
from tests.helpers import key, value_for

NS = "guard/bf16/b16/tp0of1"
OTHER = "f" * 32  # an instance token that is not the worker's


def master_stub(ch: grpc.Channel) -> master_pb2_grpc.MasterStub:
    return master_pb2_grpc.MasterStub(ch)


def the_map(addr: str) -> master_pb2.ShardMap:
    with grpc.insecure_channel(addr) as ch:
        return master_stub(ch).GetShardMap(master_pb2.GetShardMapRequest(), timeout=5)


def refused(call: object, request: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=5)  # type: ignore[operator]
    return e.value.code()  # type: ignore[no-any-return]


def health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(r.status)


def round_trips(addr: str, tag: str) -> bool:
    keys = [key(i, tag) for i in range(8)]
    vals = [value_for(k, 4096) for k in keys]
    with Client(addr, timeout=10) as c:
        return all(c.batch_put(NS, keys, vals)) and c.batch_get(NS, keys) == vals


def test_a_live_id_cannot_be_redirected_or_dropped(cluster: LocalCluster) -> None:
    before = the_map(cluster.address)
    victim = before.workers[0]
    thief = master_pb2.WorkerInfo()
    thief.CopyFrom(victim)
    thief.grpc = "127.0.0.1:9"
    thief.endpoints[:] = ["tcp://127.0.0.1:9"]
    with grpc.insecure_channel(cluster.address) as ch:
        stub = master_stub(ch)
        # Without the worker's instance token: no takeover, no drain, no leave.
        reg = master_pb2.RegisterRequest(worker=thief)
        assert refused(stub.Register, reg) == grpc.StatusCode.INVALID_ARGUMENT
        reg = master_pb2.RegisterRequest(worker=thief, instance=OTHER)
        assert refused(stub.Register, reg) == grpc.StatusCode.FAILED_PRECONDITION
        hb = master_pb2.HeartbeatRequest(worker_id=victim.id, draining=True)
        assert refused(stub.Heartbeat, hb) == grpc.StatusCode.FAILED_PRECONDITION
        leave = master_pb2.LeaveRequest(worker_id=victim.id)
        assert refused(stub.Leave, leave) == grpc.StatusCode.FAILED_PRECONDITION
    time.sleep(2.5)  # a TTL: refused heartbeats kept nothing alive, the real ones did
    after = the_map(cluster.address)
    assert list(after.workers) == list(before.workers), "the map still routes to the worker"
    assert after.version == before.version
    assert round_trips(cluster.address, "guard-live")
    log = Path(cluster.master.log_path or "").read_text()  # type: ignore[union-attr]
    assert "refused Register for worker" in log and "refused Leave" in log


def test_registration_fields_have_size_limits(cluster: LocalCluster) -> None:
    big = master_pb2.WorkerInfo(
        id="big", grpc="127.0.0.1:9", endpoints=["tcp://" + "x" * (1 << 20)], capacity_bytes=1
    )
    many = master_pb2.WorkerInfo(
        id="many", grpc="127.0.0.1:9", endpoints=["tcp://h:1"] * 100, capacity_bytes=1
    )
    with grpc.insecure_channel(cluster.address) as ch:
        stub = master_stub(ch)
        for w in (big, many, master_pb2.WorkerInfo(id="i" * 4096, grpc="h:1", endpoints=["x"])):
            req = master_pb2.RegisterRequest(worker=w, instance=OTHER)
            assert refused(stub.Register, req) == grpc.StatusCode.INVALID_ARGUMENT
    m = the_map(cluster.address)
    assert len(m.workers) == 2 and m.ByteSize() < 4096, "the map stays small"


def test_second_worker_with_the_same_id_exits_with_one_line(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB", worker_ttl="2s",
                     extra_worker_args=["--id", "w0"])  # fmt: skip
    first = c.worker_procs[0]
    log = tmp_path / "second.log"
    second = spawn(
        "worker",
        c._worker_args(),
        log_path=str(log),
    )
    try:
        code = second.proc.wait(20)
    finally:
        second.kill()
    assert code != 0
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "'w0' is in use by another live worker" in lines[0], lines
    assert "Traceback" not in log.read_text()
    assert not arena_files(second.pid), "the refused worker removed its arena"
    assert [w.grpc for w in the_map(c.address).workers] == [first.ready["grpc"]]
    assert first.alive() and round_trips(c.address, "guard-second")


def test_a_duplicate_id_fails_at_once_when_its_holder_answers(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    """Issue 25: with the default 10 s TTL a duplicate --id waited 1.5 TTL + 1 s (21 s
    with start-up) before its error, although the master could see the holder alive."""
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB", worker_ttl="10s",
                     extra_worker_args=["--id", "w0"])  # fmt: skip
    log = tmp_path / "second.log"
    t0 = time.monotonic()
    second = spawn("worker", c._worker_args(), log_path=str(log))
    try:
        code = second.proc.wait(20)
    finally:
        second.kill()
    took = time.monotonic() - t0
    assert code != 0
    assert took < 6, f"the holder answers at its address: no need to wait out the TTL ({took})"
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "'w0' is in use by another live worker" in lines[0], lines
    assert c.worker_procs[0].alive() and round_trips(c.address, "guard-fast")


def test_a_killed_worker_restarted_under_its_id_rejoins_at_once(
    make_cluster: MakeCluster,
) -> None:
    c = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB", worker_ttl="30s",
                     extra_worker_args=["--id", "w0"])  # fmt: skip
    old = c.worker_procs[0].ready["grpc"]
    new = c.restart_worker(0, kill=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and [w.grpc for w in the_map(c.address).workers] != [
        new.ready["grpc"]
    ]:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert [w.grpc for w in the_map(c.address).workers] == [new.ready["grpc"]] != [old]
    assert took < 5, f"the dead instance's port refuses: no need to wait out the 30 s TTL ({took})"


def test_worker_waits_for_the_master_quietly_and_is_not_serving_until_registered(
    tmp_path: Path,
) -> None:
    port = free_port()
    log = tmp_path / "worker.log"
    worker = spawn(
        "worker",
        [
            *("--master", f"127.0.0.1:{port}", "--host", "127.0.0.1"),
            *("--dram-size", "64MiB", "--max-value-size", "1MiB"),
        ],
        log_path=str(log),
    )
    master = None
    try:
        addr = worker.ready["grpc"]
        assert health(addr) == health_pb2.HealthCheckResponse.NOT_SERVING
        time.sleep(4)
        text = log.read_text()
        assert text.count("waiting for the master") == 1, text
        assert text.count("WARNING") <= 1, "one line, not one per second"
        assert health(addr) == health_pb2.HealthCheckResponse.NOT_SERVING
        master = spawn(
            "master",
            ["--host", "127.0.0.1", "--port", str(port), "--worker-ttl", "2s"],
            log_path=str(tmp_path / "master.log"),
        )
        t0 = time.monotonic()
        while health(addr) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() - t0 < 10, "registered within the backoff cap"
            time.sleep(0.1)
        assert [w.id for w in the_map(master.address).workers] == [worker.ready["id"]]
        assert "registered with master" in log.read_text()
    finally:
        assert worker.stop() == 0
        if master is not None:
            master.stop()
    assert not arena_files(worker.pid) and not os.path.exists(worker.ready["arena"])
