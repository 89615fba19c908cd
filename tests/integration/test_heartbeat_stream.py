"""Heartbeats on one stream per worker (Master.HeartbeatStream) against a real master.

The stream keeps the unary Heartbeat's semantics: it refreshes the worker's TTL,
answers the first heartbeat and then at most one per TTL, tells a forgotten worker
to register again (known = false, then the stream ends OK), and ends with
FAILED_PRECONDITION for another instance's token. A real worker heartbeats on it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.cluster import Daemon, LocalCluster, spawn
from kvstore_client.proto import master_pb2, master_pb2_grpc
from tests.conftest import MakeCluster

TOKEN, OTHER = "t" * 32, "o" * 32


def _info(wid: str) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=wid, grpc="127.0.0.1:1", endpoints=["tcp://127.0.0.1:2"], capacity_bytes=1 << 30
    )


@pytest.fixture
def master(tmp_path: object) -> Iterator[Daemon]:
    d = spawn("master", ["--host", "127.0.0.1", "--port", "0", "--worker-ttl", "1s"])
    try:
        yield d
    finally:
        d.stop()


class Stream:
    """A HeartbeatStream fed from a queue (``None`` half-closes it)."""

    def __init__(self, stub: master_pb2_grpc.MasterStub) -> None:
        self.q: queue.Queue[master_pb2.HeartbeatRequest | None] = queue.Queue()
        self.call = stub.HeartbeatStream(iter(self.q.get, None))

    def send(self, wid: str, instance: str = TOKEN) -> None:
        self.q.put(master_pb2.HeartbeatRequest(worker_id=wid, instance=instance))

    def next(self) -> master_pb2.HeartbeatResponse:
        return next(self.call)


def live(stub: master_pb2_grpc.MasterStub) -> set[str]:
    m = stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=5)
    return {w.id for w in m.workers}


def test_stream_refreshes_answers_sparsely_and_sends_the_forgotten_back(master: Daemon) -> None:
    with grpc.insecure_channel(master.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        stub.Register(master_pb2.RegisterRequest(worker=_info("w1"), instance=TOKEN), timeout=5)
        s = Stream(stub)
        s.send("w1")
        first = s.next()
        assert first.known and first.map_version > 0, "the first heartbeat is answered"
        # 3 s of heartbeats every 0.2 s (TTL 1 s): the worker stays, and the master
        # answers about once per TTL, not once per heartbeat
        answers = []
        got: queue.Queue[master_pb2.HeartbeatResponse] = queue.Queue()
        threading.Thread(target=lambda: [got.put(r) for r in s.call], daemon=True).start()
        for _ in range(15):
            s.send("w1")
            time.sleep(0.2)
        while not got.empty():
            answers.append(got.get())
        assert "w1" in live(stub), "stream heartbeats keep the worker in the map"
        assert 1 <= len(answers) <= 5, f"{len(answers)} answers to 15 heartbeats"
        assert all(a.known for a in answers)
        # silent for longer than the TTL: expired; the next heartbeat is told so
        deadline = time.monotonic() + 10
        while "w1" in live(stub):
            assert time.monotonic() < deadline, "the silent worker never expired"
            time.sleep(0.1)
        s.send("w1")
        forgotten = got.get(timeout=5)
        assert not forgotten.known, "a forgotten worker is told to register again"
        s.q.put(None)
        assert s.call.code() == grpc.StatusCode.OK, "then the stream ends cleanly"


def test_stream_refuses_another_instance_and_a_second_id(master: Daemon) -> None:
    with grpc.insecure_channel(master.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        stub.Register(master_pb2.RegisterRequest(worker=_info("w2"), instance=TOKEN), timeout=5)
        s = Stream(stub)
        s.send("w2", OTHER)
        with pytest.raises(grpc.RpcError) as e:
            s.next()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "w2" in live(stub), "a refused heartbeat changes nothing"
        stub.Register(master_pb2.RegisterRequest(worker=_info("w3"), instance=TOKEN), timeout=5)
        s = Stream(stub)
        s.send("w2")
        assert s.next().known
        s.send("w3")
        with pytest.raises(grpc.RpcError) as e:
            s.next()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_real_worker_heartbeats_on_the_stream(tmp_path: object) -> None:
    with LocalCluster(workers=1, worker_ttl="2s") as c:
        c.wait_for_workers(1)
        time.sleep(3)  # more than a TTL: only heartbeats keep it
        assert len(c.live_worker_ids()) == 1
        with grpc.insecure_channel(c.address) as ch:
            st = master_pb2_grpc.MasterStub(ch).ClusterStatus(
                master_pb2.ClusterStatusRequest(), timeout=5
            )
        assert st.workers[0].last_heartbeat_age_s < 1.5


TENANTS = """
tenants:
  - name: team-a
    token: token-a
    namespaces: [t]
  - name: ops
    token: token-ops
    admin: true
"""


def test_heartbeat_stream_is_admin_only(make_cluster: MakeCluster, tmp_path: Path) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text(TENANTS)
    c = make_cluster(
        workers=1,
        worker_ttl="2s",
        token="token-ops",
        extra_master_args=["--tenants-file", str(f)],
        extra_worker_args=["--tenants-file", str(f), "--token", "token-ops"],
    )
    time.sleep(3)  # beyond the TTL: the worker's admin token streams its heartbeats
    assert len(c.live_worker_ids()) == 1
    wid = next(iter(c.live_worker_ids()))
    with grpc.insecure_channel(c.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        for md, code in (
            ((("authorization", "Bearer token-a"),), grpc.StatusCode.PERMISSION_DENIED),
            ((), grpc.StatusCode.UNAUTHENTICATED),
        ):
            call = stub.HeartbeatStream(
                iter([master_pb2.HeartbeatRequest(worker_id=wid, instance=OTHER, draining=True)]),
                metadata=md,
            )
            with pytest.raises(grpc.RpcError) as e:
                next(call)
            assert e.value.code() == code
            batch = master_pb2.BeatBatch()
            batch.bind.add(slot=0, worker_id=wid, instance=OTHER)
            batch.changed.add(slot=0, draining=True)
            with pytest.raises(grpc.RpcError) as e:
                next(stub.Beats(iter([batch]), metadata=md))
            assert e.value.code() == code
    assert c.live_worker_ids() == {wid}, "a refused stream changes nothing"
