"""Datagram beats (master.proto, "Datagram beats") against real master processes and a
real worker:

- a worker's beats arrive as UDP datagrams once the master confirmed them, and the
  worker stays in the map over several TTLs;
- a master with datagrams off, or whose UDP port the worker cannot reach (it dials
  the master through a TCP relay on another address, as through a Service without
  the UDP port), keeps the worker on stream beats;
- garbage, forged, replayed and unknown datagrams are dropped and counted, and the
  master keeps serving.

TTLs are generous: the host may be loaded.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvstore import beatgram
from kvstore.cluster import free_port, spawn
from kvstore_client.proto import master_pb2, master_pb2_grpc
from tests.conftest import MakeCluster
from tests.integration.test_beats import TOKEN, Beats, _info, metric, scrape

TTL = "2s"


def by_result(port: int, name: str) -> dict[str, float]:
    """The master's counter ``name``, per value of its ``result`` label."""
    out: dict[str, float] = {}
    for line in scrape(port).splitlines():
        if line.startswith(name + "{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


def datagrams(port: int) -> dict[str, float]:
    return by_result(port, "kvstore_master_beat_datagrams_total")


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def live(address: str) -> list[master_pb2.WorkerStatus]:
    with grpc.insecure_channel(address) as ch:
        st = master_pb2_grpc.MasterStub(ch).ClusterStatus(
            master_pb2.ClusterStatusRequest(), timeout=10
        )
    return list(st.workers)


def test_a_real_worker_beats_by_datagram(make_cluster: MakeCluster) -> None:
    port = free_port()
    c = make_cluster(
        workers=1,
        worker_ttl=TTL,
        extra_master_args=["--metrics-port", str(port)],
        extra_worker_args=["--datagram-beats"],
    )
    assert c.master.ready["beat_port"] == int(c.address.rsplit(":", 1)[1])  # the same number
    assert wait_for(lambda: datagrams(port)["accepted"] >= 3)
    time.sleep(1.0)  # the confirmation reaches the worker
    d0, h0 = datagrams(port)["accepted"], metric(port, "kvstore_heartbeats_total")
    time.sleep(6.0)  # three TTLs
    d1, h1 = datagrams(port)["accepted"], metric(port, "kvstore_heartbeats_total")
    by_datagram, all_beats = d1 - d0, h1 - h0
    assert by_datagram >= 6, "a beat every 0.5 s, by datagram"
    # every beat but a stats change (at most every 2 intervals) came by datagram
    assert all_beats - by_datagram <= by_datagram / 2 + 1
    ws = live(c.address)
    assert len(ws) == 1 and not ws[0].draining
    assert ws[0].last_heartbeat_age_s < 2.0
    assert datagrams(port)["forged"] == 0 and datagrams(port)["replayed"] == 0


def test_a_master_with_datagrams_off_keeps_the_worker_on_the_stream(
    make_cluster: MakeCluster,
) -> None:
    port = free_port()
    c = make_cluster(
        workers=1,
        worker_ttl=TTL,
        extra_master_args=["--metrics-port", str(port), "--beat-port", "off"],
        extra_worker_args=["--datagram-beats"],
    )
    assert "beat_port" not in c.master.ready
    h0 = metric(port, "kvstore_heartbeats_total")
    time.sleep(6.0)  # three TTLs
    assert metric(port, "kvstore_heartbeats_total") - h0 >= 6
    assert sum(datagrams(port).values()) == 0
    assert len(live(c.address)) == 1


class Relay:
    """A TCP relay from 127.0.0.2:PORT to ``target``: a worker that dials the master
    through it sends its datagrams to 127.0.0.2, where nothing listens for UDP."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.2", 0))
        self.port = self.lsock.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self.socks += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.lsock.close()
        for s in self.socks:
            s.close()


@pytest.fixture
def master() -> Iterator[tuple[str, int]]:
    port = free_port()
    d = spawn(
        "master",
        ["--host", "127.0.0.1", "--port", "0", "--worker-ttl", TTL, "--metrics-port", str(port)],
    )
    try:
        yield d.address, port
    finally:
        d.stop()


def test_datagrams_that_never_arrive_leave_the_worker_on_the_stream(
    master: tuple[str, int], tmp_path: object
) -> None:
    address, mport = master
    host, _, p = address.rpartition(":")
    relay = Relay((host, int(p)))
    worker = spawn(
        "worker",
        [
            "--master", f"127.0.0.2:{relay.port}", "--host", "127.0.0.1",
            "--grpc-port", "0", "--tcp-port", "0", "--dram-size", "64MiB",
            "--datagram-beats",
        ],
    )  # fmt: skip
    try:
        h0 = metric(mport, "kvstore_heartbeats_total")
        time.sleep(8.0)  # four TTLs: the binding is lost after one, beats stay on the stream
        assert metric(mport, "kvstore_heartbeats_total") - h0 >= 8
        assert datagrams(mport)["accepted"] == 0
        ws = live(address)
        assert len(ws) == 1 and ws[0].last_heartbeat_age_s < 2.0
    finally:
        worker.stop()
        relay.close()


def test_garbage_forged_and_replayed_datagrams_are_dropped(master: tuple[str, int]) -> None:
    address, mport = master
    with grpc.insecure_channel(address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        stub.Register(master_pb2.RegisterRequest(worker=_info(0), instance=TOKEN), timeout=10)
        s = Beats(stub)
        b = master_pb2.BeatBatch()
        b.bind.add(slot=0, worker_id="w00", instance=TOKEN, datagrams=True)
        s.q.put(b)
        first = s.answers.get(timeout=10)
        assert len(first.datagrams) == 1
        g = first.datagrams[0]
        assert g.slot == 0 and len(g.key) == 32 and g.port > 0
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.connect(("127.0.0.1", g.port))
        rng = random.Random(45)
        for _ in range(500):  # garbage of random lengths
            udp.send(os.urandom(rng.choice([0, 1, 15, 31, 33, 64, 200, 1400, rng.randrange(2000)])))
        for _ in range(50):  # the right layout, a wrong key
            udp.send(beatgram.encode(os.urandom(32), g.binding, rng.randrange(1, 1 << 60)))
        udp.send(beatgram.encode(g.key, g.binding ^ 1, 1))  # unknown binding
        good = beatgram.encode(g.key, g.binding, 7)
        udp.send(good)
        time.sleep(0.5)
        udp.send(good)  # a replay
        udp.send(beatgram.encode(g.key, g.binding, 3))  # an older one
        assert wait_for(lambda: datagrams(mport)["replayed"] >= 2, 15)
        d = datagrams(mport)
        assert d["accepted"] == 1 and d["forged"] == 50 and d["unknown"] >= 1
        assert d["malformed"] >= 400  # (a few may drop in the kernel on a loaded host)
        # the master confirmed the binding on the stream, and serves as before
        deadline = time.monotonic() + 10
        ok = False
        while not ok and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                ok = 0 in s.answers.get(timeout=1).datagrams_ok
        assert ok
        for seq in range(8, 20):  # the worker beats by datagram alone: it stays
            udp.send(beatgram.encode(g.key, g.binding, seq))
            time.sleep(0.5)
        m = stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=10)
        assert [w.id for w in m.workers] == ["w00"]
        # the datagrams stop: the stream says so, and stream beats keep the worker
        deadline = time.monotonic() + 15
        lost = False
        while not lost and time.monotonic() < deadline:
            s.send(alive=[0])
            with contextlib.suppress(Exception):
                lost = 0 in s.answers.get(timeout=0.5).datagrams_lost
        assert lost
        for _ in range(12):
            s.send(alive=[0])
            time.sleep(0.5)
        m = stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=10)
        assert [w.id for w in m.workers] == ["w00"]
        assert s.error is None
        s.close()
        udp.close()


def bindings(port: int) -> dict[str, float]:
    return by_result(port, "kvstore_master_beat_bindings_total")


def test_a_starved_host_loses_no_binding() -> None:
    """The master and the worker's sender are starved together (a loaded host): the
    sender pauses and the master is stopped (SIGSTOP) for more than half a TTL, then
    both run again. The master's first drain after the stop runs late: that time is
    its own deafness, not the binding's silence, so the binding is not lost (before,
    the drain judged the silence before the tick counted the lateness, and every
    binding on a starved host was lost and beat on its stream again)."""
    mport = free_port()
    d = spawn(
        "master",
        ["--host", "127.0.0.1", "--port", "0", "--worker-ttl", TTL, "--metrics-port", str(mport)],
    )
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with grpc.insecure_channel(d.address) as ch:
            stub = master_pb2_grpc.MasterStub(ch)
            stub.Register(master_pb2.RegisterRequest(worker=_info(0), instance=TOKEN), timeout=10)
            s = Beats(stub)
            b = master_pb2.BeatBatch()
            b.bind.add(slot=0, worker_id="w00", instance=TOKEN, datagrams=True)
            s.q.put(b)
            g = s.answers.get(timeout=10).datagrams[0]
            udp.connect(("127.0.0.1", g.port))
            seq = 0

            def beat(seconds: float) -> None:
                nonlocal seq
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    seq += 1
                    udp.send(beatgram.encode(g.key, g.binding, seq))
                    time.sleep(0.25)

            beat(1.0)
            assert wait_for(lambda: bindings(mport)["confirmed"] == 1, 10)
            beat(1.0)
            d.signal(signal.SIGSTOP)  # the sender is starved too: nothing is sent
            try:
                time.sleep(2.5)  # more than half a TTL (1 s), more than a TTL
            finally:
                d.signal(signal.SIGCONT)
            time.sleep(0.1)
            beat(3.0)
            answers = s.drain()
            assert not any(a.datagrams_lost for a in answers), answers
            got = bindings(mport)
            assert got["lost"] == 0 and got["unheard"] == 0, got
            assert datagrams(mport)["unknown"] == 0  # the binding lives on
            assert metric(mport, "kvstore_master_deaf_seconds_total") > 1.0
            assert [w.info.id for w in live(d.address)] == ["w00"]
            s.close()
    finally:
        udp.close()
        d.stop()
