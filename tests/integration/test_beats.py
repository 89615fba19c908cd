"""Batched heartbeats (Master.Beats), liveness under trouble and map deltas, against a
real master process (and a real worker and client where they matter).

- one Beats stream keeps many workers alive with one message per interval, and the
  master counts every worker's beat (kvstore_heartbeats_total);
- a forgotten slot is told, registers again and is bound again on the same stream;
  another instance's token is refused for its slot only;
- many workers falling silent at once are held (not expired) and the master alerts;
- a master stopped for several TTLs (SIGSTOP) expires nobody when it resumes;
- a real worker heartbeats on Beats; a real client follows joins and leaves through
  map deltas.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvstore.cluster import Daemon, free_port, spawn
from kvstore_client import Client
from kvstore_client.proto import master_pb2, master_pb2_grpc
from tests.conftest import MakeCluster

TOKEN, OTHER = "t" * 32, "o" * 32
TTL = 1.0


def _info(i: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"w{i:02d}", grpc=f"127.0.0.1:{i + 1}", endpoints=[f"tcp://127.0.0.1:{i + 1}"],
        capacity_bytes=1 << 30,
    )  # fmt: skip


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def metric(port: int, name: str) -> float:
    for line in scrape(port).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


class Master:
    def __init__(self, d: Daemon, metrics_port: int) -> None:
        self.d = d
        self.metrics_port = metrics_port
        self.ch = grpc.insecure_channel(d.address)
        self.stub = master_pb2_grpc.MasterStub(self.ch)

    def metric(self, name: str) -> float:
        return metric(self.metrics_port, name)

    def live(self) -> set[str]:
        m = self.stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=10)
        return {w.id for w in m.workers}

    def register(self, i: int, token: str = TOKEN) -> None:
        self.stub.Register(master_pb2.RegisterRequest(worker=_info(i), instance=token), timeout=10)


@pytest.fixture
def master() -> Iterator[Master]:
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", "0", "--worker-ttl", f"{TTL:g}s"]
    d = spawn("master", [*args, "--metrics-port", str(port)])
    m = Master(d, port)
    try:
        yield m
    finally:
        m.ch.close()
        d.stop()


class Beats:
    """A Beats stream fed from a queue (None half-closes it); answers on a queue."""

    def __init__(self, stub: master_pb2_grpc.MasterStub) -> None:
        self.q: queue.Queue[master_pb2.BeatBatch | None] = queue.Queue()
        self.answers: queue.Queue[master_pb2.BeatAnswer] = queue.Queue()
        self.call = stub.Beats(iter(self.q.get, None))
        self.error: grpc.RpcError | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for a in self.call:
                self.answers.put(a)
        except grpc.RpcError as e:
            self.error = e

    def send(self, alive: list[int] = [], bind: list[int] = [], token: str = TOKEN) -> None:  # noqa: B006
        b = master_pb2.BeatBatch(alive=alive)
        for s in bind:
            b.bind.add(slot=s, worker_id=f"w{s:02d}", instance=token)
        self.q.put(b)

    def drain(self) -> list[master_pb2.BeatAnswer]:
        out = []
        while not self.answers.empty():
            out.append(self.answers.get())
        return out

    def close(self) -> None:
        self.q.put(None)


def _beat_for(s: Beats, slots: list[int], seconds: float, every: float = 0.25) -> int:
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.send(alive=slots)
        n += 1
        time.sleep(every)
    return n


def test_one_stream_keeps_twenty_workers_with_one_message_per_interval(master: Master) -> None:
    for i in range(20):
        master.register(i)
    s = Beats(master.stub)
    s.send(bind=list(range(20)))
    first = s.answers.get(timeout=5)
    assert not first.unknown and not first.refused and first.interval_s == TTL / 4
    batches = _beat_for(s, list(range(20)), 3 * TTL)
    assert master.live() == {f"w{i:02d}" for i in range(20)}, "beats kept everyone"
    answers = s.drain()
    assert len(answers) <= 3 * TTL / TTL + 2, f"{len(answers)} answers to {batches} batches"
    assert all(not a.unknown for a in answers)
    beats = master.metric("kvstore_heartbeats_total")
    assert beats >= 20 * (1 + batches) - 20, "every worker's beat counted"
    assert master.metric("kvstore_master_overloaded") == 0
    s.close()


def test_a_forgotten_slot_registers_and_binds_again_on_the_same_stream(master: Master) -> None:
    for i in range(3):
        master.register(i)
    s = Beats(master.stub)
    s.send(bind=[0, 1, 2])
    s.answers.get(timeout=5)
    _beat_for(s, [0, 1], 2.5 * TTL)  # w02 is silent past the TTL
    assert master.live() == {"w00", "w01"}
    s.drain()
    s.send(alive=[0, 1, 2])
    told = s.answers.get(timeout=5)
    assert list(told.unknown) == [2], "only the forgotten worker is told"
    master.register(2)
    s.send(alive=[0, 1], bind=[2])
    _beat_for(s, [0, 1, 2], 2 * TTL)
    assert master.live() == {"w00", "w01", "w02"}
    assert all(not a.unknown for a in s.drain())
    assert s.error is None
    s.close()


def test_another_instance_is_refused_for_its_slot_only(master: Master) -> None:
    master.register(0)
    master.register(1)
    # w00 beats once (a registration that never beat has until the 4-TTL hard limit)
    master.stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w00", instance=TOKEN), timeout=5)
    s = Beats(master.stub)
    b = master_pb2.BeatBatch()
    b.bind.add(slot=0, worker_id="w00", instance=OTHER)
    b.bind.add(slot=1, worker_id="w01", instance=TOKEN)
    s.q.put(b)
    a = s.answers.get(timeout=5)
    assert [r.slot for r in a.refused] == [0]
    assert a.refused[0].code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    _beat_for(s, [1], 2 * TTL)
    assert master.live() == {"w01"}, "the refused bind kept nothing alive; the other slot did"
    assert s.error is None, "the stream went on"
    s.q.put(master_pb2.BeatBatch(bind=[master_pb2.BeatBind(slot=5000, worker_id="w01")]))
    deadline = time.monotonic() + 5
    while s.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.error is not None and s.error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_many_silent_at_once_are_held_not_expired(master: Master) -> None:
    """Ten of twenty workers go silent together: more likely the master's or the
    network's trouble than ten crashes. They stay in the map (held, an alert) for two
    more TTLs, and are expired after that. Unary heartbeats, the oldest protocol."""
    for i in range(20):
        master.register(i)

    def beat(ids: range, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i in ids:
                master.stub.Heartbeat(
                    master_pb2.HeartbeatRequest(worker_id=f"w{i:02d}", instance=TOKEN),
                    timeout=5,
                )
            time.sleep(0.2)

    beat(range(20), 0.5)
    beat(range(10), 2.0 * TTL)  # w10..w19 silent for two TTLs
    assert len(master.live()) == 20, "held, not expired"
    assert master.metric("kvstore_expiries_held") == 10
    assert master.metric("kvstore_master_overloaded") == 1
    # Past the hold (three TTLs of listening silence, four of wall time at most: time
    # the master was late on its ticks is not counted, so on a busy host it is later).
    beat(range(10), 1.5 * TTL)
    for _ in range(int(3 * TTL / 0.25)):
        if len(master.live()) == 10:
            break
        beat(range(10), 0.25)
    assert master.live() == {f"w{i:02d}" for i in range(10)}
    assert master.metric("kvstore_workers_expired_total") == 10


def test_a_stopped_master_expires_nobody_when_it_resumes(master: Master) -> None:
    """The master process is stopped (SIGSTOP) for three TTLs while the workers keep
    beating; the beats wait unread in its sockets. When it runs again it reads them
    before it judges anyone: nobody expires."""
    for i in range(5):
        master.register(i)
    s = Beats(master.stub)
    s.send(bind=list(range(5)))
    s.answers.get(timeout=5)
    _beat_for(s, list(range(5)), TTL)
    master.d.signal(signal.SIGSTOP)
    try:
        _beat_for(s, list(range(5)), 3 * TTL)
    finally:
        master.d.signal(signal.SIGCONT)
    _beat_for(s, list(range(5)), 2 * TTL)
    deaf = master.metric("kvstore_master_deaf_seconds_total")
    expired = master.metric("kvstore_workers_expired_total")
    assert (master.live(), expired) == ({f"w{i:02d}" for i in range(5)}, 0), f"deaf {deaf:.2f}s"
    assert deaf > 2 * TTL, "the stop was counted as the master's own deafness"
    s.close()


def test_a_real_worker_beats_and_a_client_follows_deltas(make_cluster: MakeCluster) -> None:
    port = free_port()
    c = make_cluster(workers=1, worker_ttl="1s", extra_master_args=["--metrics-port", str(port)])
    with Client(c.address) as client:
        time.sleep(2.5)  # beyond two TTLs: only heartbeats keep the worker
        assert len(client.workers()) == 1
        with grpc.insecure_channel(c.address) as ch:
            stub = master_pb2_grpc.MasterStub(ch)
            st = stub.ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=5)
            assert st.workers[0].last_heartbeat_age_s < 1.0
            assert st.workers[0].stats.keys == 0 and st.workers[0].stats.used_bytes >= 0
            assert metric(port, "kvstore_heartbeats_total") >= 5
            per_worker = [
                float(line.rsplit(" ", 1)[1])
                for line in scrape(port).splitlines()
                if line.startswith("kvstore_requests_total{") and 'op="heartbeat' in line
            ]
            # (every known label value is exported from 0: only counts tell)
            assert sum(per_worker) == 0, "Beats, not the per-worker protocols"
            # joins and leaves reach the client as deltas; its map is the master's
            added = c.add_worker()
            deadline = time.monotonic() + 10
            while len(client.workers()) != 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            full = stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=5)
            assert client.map_version == full.version
            assert sorted(w.id for w in client.workers()) == sorted(w.id for w in full.workers)
            added.stop()
            while len(client.workers()) != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            full = stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=5)
            assert sorted(w.id for w in client.workers()) == [w.id for w in full.workers]
            assert client.map_version == full.version


def test_a_client_takes_full_maps_from_a_master_before_deltas() -> None:
    """A master older than deltas ignores the request's flag and sends full maps on
    the watch: the client asks for deltas and takes them whole."""
    from concurrent import futures
    from typing import Any

    asked: list[bool] = []

    def full(version: int, n: int) -> master_pb2.ShardMap:
        return master_pb2.ShardMap(version=version, workers=[_info(i) for i in range(n)])

    def get(req: master_pb2.GetShardMapRequest, ctx: Any) -> master_pb2.ShardMap:
        return full(1, 2)

    def watch(req: master_pb2.WatchShardMapRequest, ctx: Any) -> Iterator[master_pb2.ShardMap]:
        asked.append(req.deltas)
        yield full(1, 2)
        time.sleep(0.3)
        yield full(2, 3)
        time.sleep(0.3)
        yield full(3, 1)
        time.sleep(30)

    handlers = {
        "GetShardMap": grpc.unary_unary_rpc_method_handler(
            get,
            request_deserializer=master_pb2.GetShardMapRequest.FromString,
            response_serializer=master_pb2.ShardMap.SerializeToString,
        ),
        "WatchShardMap": grpc.unary_stream_rpc_method_handler(
            watch,
            request_deserializer=master_pb2.WatchShardMapRequest.FromString,
            response_serializer=master_pb2.ShardMap.SerializeToString,
        ),
    }
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.Master", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", transport="tcp") as c:
            deadline = time.monotonic() + 10
            while c.map_version != 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.map_version == 3 and [w.id for w in c.workers()] == ["w00"]
        assert asked and asked[0], "the client asked for deltas"
    finally:
        server.stop(0)
