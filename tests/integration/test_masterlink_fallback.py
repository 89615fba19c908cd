"""The worker's master link against a master without HeartbeatStream (an older
master, here a minimal in-process gRPC server with Register and Heartbeat only):
it falls back to unary heartbeats and stays registered; and against a current-shape
server it streams, re-registering when told it was forgotten."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from kvstore.worker.masterlink import MasterLink
from kvstore_client.proto import master_pb2


class OldMaster:
    """Register and Heartbeat only (UNIMPLEMENTED for HeartbeatStream), or with
    ``stream`` a HeartbeatStream that forgets the worker after ``forget_after``."""

    def __init__(self, stream: bool, forget_after: int = 0) -> None:
        self.registers = 0
        self.unary = 0
        self.streamed = 0
        self.forget_after = forget_after
        handlers: dict[str, Any] = {
            "Register": grpc.unary_unary_rpc_method_handler(
                self.register,
                request_deserializer=master_pb2.RegisterRequest.FromString,
                response_serializer=master_pb2.RegisterResponse.SerializeToString,
            ),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self.heartbeat,
                request_deserializer=master_pb2.HeartbeatRequest.FromString,
                response_serializer=master_pb2.HeartbeatResponse.SerializeToString,
            ),
        }
        if stream:
            handlers["HeartbeatStream"] = grpc.stream_stream_rpc_method_handler(
                self.stream,
                request_deserializer=master_pb2.HeartbeatRequest.FromString,
                response_serializer=master_pb2.HeartbeatResponse.SerializeToString,
            )
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("kvstore.v1.Master", handlers),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def register(self, req: master_pb2.RegisterRequest, ctx: Any) -> master_pb2.RegisterResponse:
        self.registers += 1
        return master_pb2.RegisterResponse(heartbeat_interval_s=0.05, ttl_s=0.2, map_version=1)

    def heartbeat(self, req: master_pb2.HeartbeatRequest, ctx: Any) -> master_pb2.HeartbeatResponse:
        self.unary += 1
        return master_pb2.HeartbeatResponse(known=True, map_version=1)

    def stream(
        self, reqs: Iterator[master_pb2.HeartbeatRequest], ctx: Any
    ) -> Iterator[master_pb2.HeartbeatResponse]:
        for n, _ in enumerate(reqs, 1):
            self.streamed += 1
            if self.forget_after and n >= self.forget_after:
                yield master_pb2.HeartbeatResponse(known=False)
                return
            if n == 1:
                yield master_pb2.HeartbeatResponse(known=True, map_version=1)


def _link(port: int) -> tuple[MasterLink, threading.Event]:
    registered = threading.Event()
    link = MasterLink(
        [f"127.0.0.1:{port}"],
        tls=None,
        token="",
        worker_id="w1",
        info=lambda: master_pb2.WorkerInfo(id="w1"),
        stats=master_pb2.WorkerStats,
        on_registered=registered.set,
        on_fatal=lambda msg: None,
    )
    return link, registered


def test_falls_back_to_unary_heartbeats_on_an_old_master() -> None:
    m = OldMaster(stream=False)
    link, registered = _link(m.port)
    link.start()
    try:
        assert registered.wait(5)
        time.sleep(1.0)
        assert m.unary >= 5, "unary heartbeats every 50 ms"
        assert m.registers == 1, "the fallback keeps the registration"
    finally:
        link.stop()
        m.server.stop(0)


def test_streams_and_registers_again_when_forgotten() -> None:
    m = OldMaster(stream=True, forget_after=5)
    link, registered = _link(m.port)
    link.start()
    try:
        assert registered.wait(5)
        time.sleep(1.5)
        assert m.unary == 0 and m.streamed >= 10
        assert m.registers >= 2, "told it was forgotten, the worker registered again"
    finally:
        link.stop()
        m.server.stop(0)


class BeatsMaster(OldMaster):
    """A master with Beats that asks for a slower interval in its first answer,
    forgets the worker after ``forget_after`` batches, and refuses its bind with
    FAILED_PRECONDITION when ``refuse``."""

    def __init__(self, interval: float, forget_after: int = 0, refuse: bool = False) -> None:
        super().__init__(stream=True)
        self.interval = interval
        self.beat_batches: list[master_pb2.BeatBatch] = []
        self.refuse = refuse
        self.forget_beats_after = forget_after
        handler = grpc.stream_stream_rpc_method_handler(
            self.beats,
            request_deserializer=master_pb2.BeatBatch.FromString,
            response_serializer=master_pb2.BeatAnswer.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("kvstore.v1.Master", {"Beats": handler}),)
        )

    def beats(
        self, reqs: Iterator[master_pb2.BeatBatch], ctx: Any
    ) -> Iterator[master_pb2.BeatAnswer]:
        for n, b in enumerate(reqs, 1):
            self.beat_batches.append(b)
            if self.refuse and b.bind:
                yield master_pb2.BeatAnswer(
                    refused=[master_pb2.BeatRefusal(slot=0, code=9, message="taken", ttl_s=0.2)]
                )
            elif self.forget_beats_after and n >= self.forget_beats_after:
                yield master_pb2.BeatAnswer(unknown=[0], interval_s=self.interval)
                return
            elif n == 1:
                yield master_pb2.BeatAnswer(interval_s=self.interval, ttl_s=4 * self.interval)


def _serve_beats(m: BeatsMaster) -> None:
    # generic handlers added after start() are not served: restart on the same port
    m.server.stop(0)
    handlers: dict[str, Any] = {
        "Register": grpc.unary_unary_rpc_method_handler(
            m.register,
            request_deserializer=master_pb2.RegisterRequest.FromString,
            response_serializer=master_pb2.RegisterResponse.SerializeToString,
        ),
        "Beats": grpc.stream_stream_rpc_method_handler(
            m.beats,
            request_deserializer=master_pb2.BeatBatch.FromString,
            response_serializer=master_pb2.BeatAnswer.SerializeToString,
        ),
    }
    m.server = grpc.server(futures.ThreadPoolExecutor(8))
    m.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.Master", handlers),)
    )
    m.port = m.server.add_insecure_port("127.0.0.1:0")
    m.server.start()


def test_beats_at_the_interval_the_master_asks_and_bind_once() -> None:
    """Register says every 50 ms; the master's first Beats answer asks for 300 ms: the
    worker slows down. Slot 0 is bound once, then beats as a bare slot number, its
    stats in the first batch only (they do not change)."""
    m = BeatsMaster(interval=0.3)
    _serve_beats(m)
    link, registered = _link(m.port)
    link.start()
    try:
        assert registered.wait(5)
        time.sleep(1.6)
        n = len(m.beat_batches)
        assert 4 <= n <= 9, f"{n} batches in 1.6 s at 0.3 s (not ~30 at 50 ms)"
        first, rest = m.beat_batches[0], m.beat_batches[1:]
        assert [(b.slot, b.worker_id) for b in first.bind] == [(0, "w1")]
        assert first.bind[0].instance == link.instance
        assert [c.slot for c in first.changed] == [0], "stats go with the first batch"
        assert all(list(b.alive) == [0] and not b.bind and not b.changed for b in rest)
        assert m.unary == 0 and m.streamed == 0
    finally:
        link.stop()
        m.server.stop(0)


def test_beats_register_again_when_forgotten() -> None:
    m = BeatsMaster(interval=0.05, forget_after=5)
    _serve_beats(m)
    link, registered = _link(m.port)
    link.start()
    try:
        assert registered.wait(5)
        time.sleep(1.5)
        assert m.registers >= 2, "told it was forgotten, the worker registered again"
        assert sum(1 for b in m.beat_batches if b.bind) >= 2, "and bound again"
    finally:
        link.stop()
        m.server.stop(0)


def test_a_refused_bind_is_an_id_conflict() -> None:
    """The master refuses the bind (another live instance holds the id): a worker
    that never registered before would exit; this one registered, so it keeps
    trying with backoff, not in a hot loop."""
    m = BeatsMaster(interval=0.05, refuse=True)
    _serve_beats(m)
    link, registered = _link(m.port)
    link.start()
    try:
        assert registered.wait(5)
        time.sleep(1.5)
        assert 2 <= m.registers <= 8, f"{m.registers} registrations in 1.5 s"
    finally:
        link.stop()
        m.server.stop(0)
