"""The simulated side of `kvstore bench scale`: workers that register and heartbeat,
and map watchers, all in the bench's process on asyncio (the scenario is :mod:`.run`).

Workers share gRPC connections (``per_connection`` each, as several workers on a host
would share one link) and heartbeat as ``kvstore worker`` does: by default on one
Beats stream per connection (:func:`connection_loop`: one batch per interval naming
every live worker's slot), with datagram beats when asked (each worker's bind asks for
them; once the master confirms a slot, its beats are UDP datagrams alone, as a real
worker's), or each on its own HeartbeatStream, or by unary calls (:func:`worker_loop`,
the protocols before Beats). Watchers hold the WatchShardMap
stream open and time every version they get, as deltas unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore import beatgram
from kvstore_client.proto import master_pb2, master_pb2_grpc

__all__ = [
    "BeatLog",
    "Datagrams",
    "SimWorker",
    "Watcher",
    "connection_loop",
    "map_version",
    "sim_info",
    "worker_loop",
    "worker_rpc",
]

GIB = 1 << 30
WATCH_METHOD = "/kvstore.v1.Master/WatchShardMap"
CALL_TIMEOUT = 30.0  # the bench's own calls; a master on a loaded host can take seconds


@dataclass(slots=True)
class SimWorker:
    """One simulated worker: what it registers and whether it heartbeats."""

    info: master_pb2.WorkerInfo
    stub: master_pb2_grpc.MasterAsyncStub
    paused: bool = False
    heartbeats: int = 0
    registers: int = 0
    # the first registration: when its Register went out, when the answer came, when
    # the worker's first beat (or bind) after it was sent (monotonic; nan: not yet)
    asked_at: float = float("nan")
    answered_at: float = float("nan")
    first_beat_at: float = float("nan")
    # Each worker process binds its registration to a random instance token.
    instance: str = field(default_factory=lambda: secrets.token_hex(16))

    def beat_sent(self, now: float) -> None:
        """A beat (or a bind) of this worker went out at ``now``."""
        self.heartbeats += 1
        if self.first_beat_at != self.first_beat_at and self.registers:  # nan: the first
            self.first_beat_at = now


def sim_info(i: int, tag: str = "sim") -> master_pb2.WorkerInfo:
    """A plausible WorkerInfo for simulated worker ``i`` (mixed capacities)."""
    port = 20000 + i
    return master_pb2.WorkerInfo(
        id=f"{tag}-{i:05d}",
        grpc=f"10.0.{i // 250}.{i % 250}:{port}",
        endpoints=[f"tcp://10.0.{i // 250}.{i % 250}:{port + 1}"],
        capacity_bytes=[64, 128, 256][i % 3] * GIB,
        max_value_bytes=16 << 20,
        host_id=f"host-{i // 2:05d}",
        version="sim",
    )


async def worker_rpc(w: SimWorker, *, register: bool) -> int:
    """The one place a simulated worker talks to the master: Register when
    ``register`` (or when a heartbeat finds the worker forgotten), else Heartbeat.
    Returns the map version the master answered with."""
    if not register:
        hb = await w.stub.Heartbeat(
            master_pb2.HeartbeatRequest(
                worker_id=w.info.id, stats=master_pb2.WorkerStats(), instance=w.instance
            ),
            timeout=CALL_TIMEOUT,
        )
        w.beat_sent(time.monotonic())
        if hb.known:
            return int(hb.map_version)
    first = not w.registers
    if first:
        w.asked_at = time.monotonic()
    reg = await w.stub.Register(
        master_pb2.RegisterRequest(worker=w.info, instance=w.instance), timeout=CALL_TIMEOUT
    )
    if first:
        w.answered_at = time.monotonic()
    w.registers += 1
    return int(reg.map_version)


async def worker_loop(w: SimWorker, interval: float, unary: bool = False) -> None:
    """One worker heartbeating alone, as ``kvstore.worker.masterlink`` does against
    masters older than Beats: on its own HeartbeatStream (or, with ``unary``, one
    Heartbeat call each); when the master forgot the worker (it expired while
    paused), register again after a jittered pause and reopen."""
    await asyncio.sleep(random.random() * interval)  # spread the phases
    while True:
        if unary:
            nxt = time.monotonic()
            while True:
                nxt += interval
                if not w.paused:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await worker_rpc(w, register=False)
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        call = w.stub.HeartbeatStream()  # type: ignore[call-arg]
        reader = asyncio.create_task(_read_answers(call))
        try:
            nxt = time.monotonic()
            while not reader.done():
                if not w.paused:
                    await call.write(
                        master_pb2.HeartbeatRequest(
                            worker_id=w.info.id, stats=master_pb2.WorkerStats(), instance=w.instance
                        )
                    )
                    w.beat_sent(time.monotonic())
                nxt += interval
                await asyncio.wait([reader], timeout=max(0.0, nxt - time.monotonic()))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass
        finally:
            call.cancel()
            reader.cancel()
        await asyncio.sleep(interval * (0.5 + random.random() / 2))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await worker_rpc(w, register=True)


@dataclass(slots=True)
class BeatLog:
    """What the simulated workers of all connections saw, for the run's figures: when
    the master said datagrams_lost or unknown, how late the send loops ran, and the
    gaps between one worker's consecutive beats (stream or datagram) longer than
    ``gap_s`` (the simulator itself starved)."""

    gap_s: float = 2.0
    lost_at: list[float] = field(default_factory=list)
    unknown_at: list[float] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (when, gap)
    late_max: float = 0.0
    late_over_1s: int = 0


class _BeatStream:
    """One Beats stream of a connection: which slots it bound, which workers the
    master forgot (they register again, then are bound again on it)."""

    def __init__(
        self,
        ws: list[SimWorker],
        pace: list[float],
        udp: Datagrams | None = None,
        log: BeatLog | None = None,
    ) -> None:
        self.ws = ws
        self.log = log
        self.last: dict[int, float] = {}
        self.pace = pace
        self.bound: set[int] = set()
        self.forgotten: set[int] = set()
        self.rejoins: list[asyncio.Task[None]] = []
        self.udp = udp
        self.grants: dict[int, master_pb2.DatagramGrant] = {}
        self.seq: dict[int, int] = {}
        self.confirmed: set[int] = set()
        self.retries: dict[int, float] = {}  # slot -> its next retry pause after a loss

    def batch(self) -> master_pb2.BeatBatch:
        b = master_pb2.BeatBatch()
        now = time.monotonic()
        log = self.log
        for i, w in enumerate(self.ws):
            if w.paused or i in self.forgotten or not w.registers:
                self.last.pop(i, None)
                continue  # paused, registering again, or not registered yet
            if log is not None:
                t = self.last.get(i)
                if t is not None and now - t > log.gap_s:
                    log.gaps.append((now, now - t))
                self.last[i] = now
            if i in self.bound:
                g = self.grants.get(i)
                if g is not None and self.udp is not None:
                    seq = self.seq[i] = self.seq.get(i, 0) + 1
                    self.udp.send(beatgram.encode(g.key, g.binding, seq), g.port)
                if i not in self.confirmed:
                    b.alive.append(i)
            else:
                b.bind.add(
                    slot=i, worker_id=w.info.id, instance=w.instance, datagrams=self.udp is not None
                )
                self.bound.add(i)
            w.beat_sent(now)
        return b

    def _drop_grant(self, i: int) -> None:
        self.grants.pop(i, None)
        self.seq.pop(i, None)
        self.confirmed.discard(i)

    def told(self, i: int) -> None:
        self._drop_grant(i)
        if i < len(self.ws) and i not in self.forgotten:
            self.forgotten.add(i)
            self.rejoins.append(asyncio.create_task(self._rejoin(i)))

    async def _ask_again(self, i: int) -> None:
        """As the worker does after datagrams_lost: bind again (asking for datagrams)
        after a pause (beatgram.RETRY_S doubling up to RETRY_CAP_S until a binding
        is confirmed, x0.5-1 jittered)."""
        pause = self.retries.get(i, beatgram.RETRY_S)
        self.retries[i] = min(2 * pause, beatgram.RETRY_CAP_S)
        await asyncio.sleep(pause * (0.5 + random.random() / 2))
        self.bound.discard(i)

    async def _rejoin(self, i: int) -> None:
        await asyncio.sleep(self.pace[0] * (0.5 + random.random() / 2))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await worker_rpc(self.ws[i], register=True)
        self.bound.discard(i)
        self.forgotten.discard(i)

    async def read(self, call: Any) -> None:
        """Follows the master's answers (the interval, forgotten slots); returns when
        the stream ends."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for resp in call:
                if resp.interval_s > 0:
                    self.pace[0] = resp.interval_s
                for g in resp.datagrams:
                    self._drop_grant(g.slot)
                    self.grants[g.slot] = g
                for s in resp.datagrams_ok:
                    if s in self.grants:
                        self.confirmed.add(s)
                        self.retries.pop(s, None)
                if self.log is not None:
                    now = time.monotonic()
                    self.log.lost_at += [now] * len(resp.datagrams_lost)
                    self.log.unknown_at += [now] * len(resp.unknown)
                for slot in resp.datagrams_lost:  # on the stream, datagrams again later
                    self._drop_grant(slot)
                    self.rejoins.append(asyncio.create_task(self._ask_again(slot)))
                for slot in resp.unknown:
                    self.told(slot)
                for r in resp.refused:
                    self.told(r.slot)

    def close(self) -> None:
        for t in self.rejoins:
            t.cancel()


class Datagrams:
    """One UDP socket from which simulated workers send their datagram beats to the
    master at ``host`` (at the port each grant names)."""

    def __init__(self, host: str) -> None:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)[0]
        self.host = addr[0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sent = 0
        self.failed = 0
        self.ports: set[int] = set()

    def send(self, datagram: bytes, port: int) -> None:
        self.ports.add(port)
        try:
            self.sock.sendto(datagram, (self.host, port))
            self.sent += 1
        except OSError:
            self.failed += 1

    def close(self) -> None:
        self.sock.close()


async def connection_loop(
    ws: list[SimWorker], interval: float, udp: Datagrams | None = None, log: BeatLog | None = None
) -> None:
    """The workers of one connection heartbeating on one Beats stream: every interval
    (the one the master's answers ask for) one batch, in which each live worker is its
    slot number (bound once per stream). With ``udp`` each bind asks for datagram
    beats, and a slot the master granted them beats by datagram, on the stream too
    until the master confirms it. A worker the master forgot (it expired while
    paused) registers again after a jittered pause and is bound again on the same
    stream; a stream that ends is reopened after a jittered pause."""
    await asyncio.sleep(random.random() * interval)  # spread the phases
    pace = [interval]
    while True:
        call = ws[0].stub.Beats()  # type: ignore[call-arg]
        st = _BeatStream(ws, pace, udp, log)
        reader = asyncio.create_task(st.read(call))
        try:
            nxt = time.monotonic()
            while not reader.done():
                if log is not None:
                    late = time.monotonic() - nxt
                    log.late_max = max(log.late_max, late)
                    log.late_over_1s += late > 1.0
                batch = st.batch()
                if batch.alive or batch.bind:
                    await call.write(batch)
                nxt += pace[0]
                await asyncio.wait([reader], timeout=max(0.0, nxt - time.monotonic()))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass
        finally:
            call.cancel()
            reader.cancel()
            st.close()
        await asyncio.sleep(interval * (0.5 + random.random() / 2))


async def _read_answers(call: Any) -> None:
    """Returns when the master says it forgot the worker or the stream ends."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for resp in call:
            if not resp.known:
                return


# ---------------------------------------------------------------- watchers


def map_version(raw: bytes) -> int:
    """The version (field 1, the first one serialized) of a serialized ShardMap."""
    if not raw or raw[0] != 0x08:
        return 0
    v, shift = 0, 0
    for b in raw[1:11]:
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v
        shift += 7
    return 0


@dataclass(slots=True)
class Watcher:
    """A watch stream; records (version, arrival time) without parsing the map,
    so that the simulator stays cheap (a real client also applies deltas and builds
    its ring). Asks for deltas unless ``deltas`` is False (clients before them)."""

    seen: list[tuple[int, float]] = field(default_factory=list)
    bytes: int = 0

    @property
    def version(self) -> int:
        return self.seen[-1][0] if self.seen else 0

    def first_at_least(self, v: int) -> float | None:
        for ver, t in self.seen:
            if ver >= v:
                return t
        return None

    async def run(self, channel: grpc.aio.Channel, deltas: bool = True) -> None:
        call = channel.unary_stream(
            WATCH_METHOD,
            request_serializer=master_pb2.WatchShardMapRequest.SerializeToString,
            response_deserializer=None,
        )
        while True:
            req = master_pb2.WatchShardMapRequest(known_version=self.version, deltas=deltas)
            try:
                async for raw in call(req):
                    self.seen.append((map_version(raw), time.monotonic()))
                    self.bytes += len(raw)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)


# ---------------------------------------------------------------- processes
