"""The master daemon: the Master gRPC service over the membership state machine.

Runs on asyncio (grpc.aio) so many clients can hold a shard-map watch stream
open without a thread each. Never on the data path.

Without etcd a master is alone and always leads, with its state in memory.
With ``--etcd`` several masters elect a leader (see :mod:`kvstore.master.ha`):

- map reads (GetShardMap, WatchShardMap) are served by every master, the
  standbys from their mirror of etcd, so clients need no leader;
- membership writes (Register, Leave) that reach a standby are forwarded to
  the leader; when there is no reachable leader they fail with UNAVAILABLE, the
  details and the ``kvstore-leader`` trailer naming the leader if one is known,
  and the worker tries its next master;
- heartbeats (Beats, HeartbeatStream, Heartbeat) are never forwarded: a standby
  answers UNAVAILABLE with the ``kvstore-leader`` trailer, so a thousand workers
  looking for a new leader cost a standby one refusal each, not a relay;
- ClusterStatus on a standby is forwarded too (for live stats), falling back
  to the mirror (membership without stats) when the leader does not answer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore_client import __version__
from kvstore_client.proto import master_pb2, master_pb2_grpc
from kvstore_client.replicas import check_replicas, parse_namespace_replicas
from kvstore_client.security import AUTH_HEADER, Tls

from .. import metrics
from ..auth import Tenants
from ..config import MasterConfig
from ..errors import InvalidArgument, KVStoreError, to_grpc_code
from . import drain
from .beats import BeatSession
from .beatsock import BeatEar, beat_port
from .feed import MapFeed
from .guard import TenantGuard
from .membership import MAX_ID, IdConflict, Membership, Tick
from .probe import address_accepts, address_refuses
from .snapshot import Layout, Snapshot, encode, restore

log = logging.getLogger(__name__)
Ctx = grpc.aio.ServicerContext[Any, Any]
S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
R = TypeVar("R")

FORWARDED = "kvstore-forwarded"  # metadata on a call a standby forwarded (never forwarded twice)
LEADER_TRAILER = "kvstore-leader"
TTL_TRAILER = "kvstore-ttl"  # on an IdConflict: the TTL after which a silent id is free
LIVE_TRAILER = "kvstore-id-live"  # on an IdConflict: the holder answers at this address
FORWARD_TIMEOUT = 3.0
STATUS_FORWARD_TIMEOUT = 1.5
FAILOVER_GRACE_TTLS = 1.0  # a new leader expires nobody for this many TTLs beyond the first
FLUSH_GAP_S = 0.05  # membership changes are persisted and published at most this often
OVERLOAD_LOG_S = 30.0  # at most one overload warning per this long

if TYPE_CHECKING:  # the etcd code is imported only with --etcd
    from .ha import HaCoordinator


def observed(
    op: str,
) -> Callable[[Callable[[S, Req, Ctx], Awaitable[Resp]]], Callable[[S, Req, Ctx], Awaitable[Resp]]]:
    """Decorate a unary handler: count it in kvstore_requests_total{op, code} and
    time it in kvstore_request_duration_seconds{op}."""

    def deco(
        fn: Callable[[S, Req, Ctx], Awaitable[Resp]],
    ) -> Callable[[S, Req, Ctx], Awaitable[Resp]]:
        @functools.wraps(fn)
        async def wrapper(self: S, request: Req, context: Ctx) -> Resp:
            t0 = time.perf_counter()
            code = "OK"
            try:
                return await fn(self, request, context)
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except BaseException:
                c = context.code()
                code = c.name if isinstance(c, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                metrics.observe_request(op, code, time.perf_counter() - t0)

        return wrapper

    return deco


class MasterServicer(master_pb2_grpc.MasterServicer):
    """The Master service. ``self.m`` is authoritative while this master leads and a
    copy of etcd's state while it stands by; ``self.published`` is the map that
    clients see (on a leader: only states already persisted)."""

    def __init__(self, members: Membership, *, address: str = "", tls: Tls | None = None) -> None:
        self.m = members
        self.tls = tls
        self.address = address
        self.feed = MapFeed(members.shard_map())
        self.ha: HaCoordinator | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.namespace_replicas: dict[str, int] = {}  # published in every map
        self._next_flush: asyncio.Future[None] | None = None  # see _bump
        self._flusher: asyncio.Task[None] | None = None
        self._flushed_at = -float("inf")  # when the last flush ended
        self._overload_said = -float("inf")  # when the last overload warning was logged
        self.ear = BeatEar(self)  # datagram beats (master.proto)

    @property
    def is_leader(self) -> bool:
        return self.ha is None or self.ha.is_leader

    @property
    def published(self) -> master_pb2.ShardMap:
        """The map clients see now."""
        return self.feed.current

    # ---- publishing ----------------------------------------------------------

    async def _bump(self) -> None:
        """Persist the membership (HA leader) and publish its map to watchers.

        Group commit: a caller that arrives while a write is in flight waits for
        the next one, which carries every change made until it starts, so a burst
        of registrations costs a few etcd transactions and map versions rather than
        one per worker. Returns once a state that includes the caller's change is
        persisted and published. Raises Unavailable when it could not be
        persisted; the change stays in memory and goes out with the next
        successful write.
        """
        if self._next_flush is None:
            self._next_flush = asyncio.get_running_loop().create_future()
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush_loop(), name="flush")
        await asyncio.shield(self._next_flush)

    async def _flush_loop(self) -> None:
        while self._next_flush is not None:
            # at most one write and one published map per FLUSH_GAP_S: a storm of
            # registrations costs a few dozen of each per second, not one per worker
            # (each is O(workers): the etcd state, the map, every standby's mirror)
            wait = self._flushed_at + FLUSH_GAP_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            fut, self._next_flush = self._next_flush, None
            try:
                if self.ha is not None:
                    await self.ha.persist(encode(self.ha.layout, self.m))
                await self._publish(self.m.shard_map())
            except Exception as e:
                fut.set_exception(e)
                fut.exception()  # retrieved: a caller that was cancelled logs nothing
            else:
                fut.set_result(None)
            self._flushed_at = time.monotonic()

    async def _publish(self, m: master_pb2.ShardMap) -> None:
        m.namespace_replicas.update(self.namespace_replicas)
        await self.feed.publish(m)

    async def republish(self) -> None:
        """Publish the current map again (at start: the metrics and the watchers)."""
        await self._publish(self.published)

    def _restore(self, snap: Snapshot) -> Membership:
        return restore(
            snap,
            ttl=self.m.ttl,
            replicas=self.m.replicas,
            cluster_id=self.m.cluster_id,
            now=time.monotonic(),
            vnodes_per_gib=self.m.vnodes_per_gib,
        )

    # ---- ha.Listener -----------------------------------------------------------

    async def become_leader(self, snap: Snapshot) -> None:
        """Take over etcd's membership. Every worker gets a fresh TTL, and nobody
        expires for FAILOVER_GRACE_TTLS more: a thousand workers that lost the old
        leader find this one without a wave of expiries and re-registrations."""
        self.m = self._restore(snap)
        self.m.grace(time.monotonic(), (1 + FAILOVER_GRACE_TTLS) * self.m.ttl)
        await self._publish(self.m.shard_map())
        self.start_expiry()

    async def become_standby(self, snap: Snapshot) -> None:
        self.stop_expiry()
        await self.mirror_changed(snap)

    async def mirror_changed(self, snap: Snapshot) -> None:
        if self.is_leader:
            return
        self.m = self._restore(snap)
        await self._publish(self.m.shard_map())

    # ---- forwarding to the leader ----------------------------------------------

    def _leader_stub(self, addr: str) -> master_pb2_grpc.MasterAsyncStub:
        ch = self._channels.get(addr)
        if ch is None:
            options = [
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ]
            if self.tls is not None and self.tls.enabled:
                creds = self.tls.channel_credentials()
                ch = grpc.aio.secure_channel(addr, creds, options=options)
            else:
                ch = grpc.aio.insecure_channel(addr, options=options)
            self._channels[addr] = ch
        return master_pb2_grpc.MasterStub(ch)

    def _leader_hint(self) -> str:
        addr = self.ha.leader_address if self.ha is not None else ""
        return addr if addr and addr != self.address else ""

    async def _not_leader(self, context: Ctx, why: str) -> None:
        leader = self._leader_hint()
        if leader:
            context.set_trailing_metadata(((LEADER_TRAILER, leader),))
        where = f"; the leader is {leader}" if leader else "; no leader is elected"
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"not the leader ({why}){where}")

    async def _forward(
        self,
        context: Ctx,
        call: Callable[
            [master_pb2_grpc.MasterAsyncStub, tuple[tuple[str, str], ...]], Awaitable[R]
        ],
    ) -> R:
        """Run ``call`` on the leader; abort UNAVAILABLE when that is not possible."""
        if any(k == FORWARDED for k, _ in context.invocation_metadata() or ()):
            await self._not_leader(context, "forwarded to a standby")
        leader = self._leader_hint()
        if not leader:
            await self._not_leader(context, "election in progress")
        md: tuple[tuple[str, str], ...] = ((FORWARDED, self.address or "1"),)
        for k, v in context.invocation_metadata() or ():
            if k == AUTH_HEADER:  # the caller's token goes along to the leader
                md += ((k, v if isinstance(v, str) else v.decode()),)
        try:
            return await call(self._leader_stub(leader), md)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                await self._not_leader(context, f"leader unreachable: {e.code().name}")
            trailer: Any = e.trailing_metadata() or ()
            ttl = tuple((str(k), str(v)) for k, v in trailer if k in (TTL_TRAILER, LIVE_TRAILER))
            if ttl:
                context.set_trailing_metadata(ttl)
            await context.abort(e.code(), e.details() or e.code().name)
        raise AssertionError("unreachable")  # abort raises

    # ---- membership writes (leader) --------------------------------------------

    async def _commit(self, context: Ctx) -> None:
        try:
            await self._bump()
        except KVStoreError as e:
            await context.abort(to_grpc_code(e), str(e))

    async def _refuse(self, context: Ctx, op: str, worker_id: str, e: KVStoreError) -> NoReturn:
        """Log a refused membership write (with the caller's address) and abort the call
        with the error's code; the state is unchanged."""
        if isinstance(e, IdConflict):
            md = [(TTL_TRAILER, f"{self.m.ttl:g}")]
            if e.live_at:
                md.append((LIVE_TRAILER, e.live_at))
            context.set_trailing_metadata(tuple(md))
        log.warning(
            "refused %s for worker %r from %s: %s", op, worker_id[:MAX_ID], context.peer(), e
        )
        await context.abort(to_grpc_code(e), str(e))
        raise AssertionError("unreachable")  # abort raises

    @observed("register")
    async def Register(
        self, request: master_pb2.RegisterRequest, context: Ctx
    ) -> master_pb2.RegisterResponse:
        if not self.is_leader:
            return await self._forward(
                context, lambda s, md: s.Register(request, timeout=FORWARD_TIMEOUT, metadata=md)
            )
        w = request.worker
        try:
            try:
                joined = self.m.register(w, request.instance, time.monotonic())
            except IdConflict as conflict:
                # A restarted worker may take its id at once if the old instance is
                # provably gone: nothing listens on its registered gRPC port any more.
                old = self.m.live_grpc(w.id)
                if not old or not await address_refuses(old):
                    # Provably taken when the holder answers at another address than
                    # the caller's (at the same one, the caller may be answering itself).
                    if old and old != w.grpc and await address_accepts(old):
                        conflict.live_at = old
                    raise
                if self.m.evict(w.id, old):
                    log.warning(
                        "worker %s: the instance registered at %s is gone (connection "
                        "refused); a new instance from %s takes the id",
                        w.id,
                        old,
                        context.peer(),
                    )
                joined = self.m.register(w, request.instance, time.monotonic())
        except KVStoreError as e:
            await self._refuse(context, "Register", w.id, e)
        if joined:
            log.info("worker %s joined (%s)", w.id, ", ".join(w.endpoints))
            note = self.m.ring_note(w.id)  # its capacity bounded by the clients' rings
            if note:
                log.warning("%s", note)
        if self.m.version != self.published.version:
            await self._commit(context)
        return master_pb2.RegisterResponse(
            heartbeat_interval_s=self.m.heartbeat_interval,
            ttl_s=self.m.ttl,
            map_version=self.m.version,
        )

    @observed("heartbeat")
    async def Heartbeat(
        self, request: master_pb2.HeartbeatRequest, context: Ctx
    ) -> master_pb2.HeartbeatResponse:
        if not self.is_leader:
            await self._not_leader(context, "heartbeats go to the leader")
        v0 = self.m.version
        try:
            known = self.m.heartbeat(
                request.worker_id,
                request.instance,
                request.stats,
                time.monotonic(),
                request.draining,
            )
        except KVStoreError as e:
            await self._refuse(context, "Heartbeat", request.worker_id, e)
        metrics.HEARTBEATS.inc(known)
        if self.m.version != v0:
            await self._commit(context)
        return master_pb2.HeartbeatResponse(known=known, map_version=self.m.version)

    async def HeartbeatStream(
        self, request_iterator: AsyncIterator[master_pb2.HeartbeatRequest], context: Ctx
    ) -> AsyncIterator[master_pb2.HeartbeatResponse]:
        """Heartbeats of one worker on one stream (leader only; see master.proto).

        Each message is handled as :meth:`Heartbeat` handles a call; answers go out
        for the first message, for an unknown worker (then the stream ends OK) and at
        most once per TTL otherwise. A standby, or a leader that stepped down, ends
        the stream UNAVAILABLE; another instance's token FAILED_PRECONDITION.
        """
        if not self.is_leader:
            await self._not_leader(context, "heartbeat streams go to the leader")
        ident: tuple[str, str] | None = None
        answered = -float("inf")
        while True:
            # context.read() costs ~20% less than iterating request_iterator; an empty
            # grpc.aio stream handler costs ~0.3 ms of CPU per message (docs/SCALE.md)
            req = await context.read()
            if req is grpc.aio.EOF:  # type: ignore[attr-defined]
                return
            assert isinstance(req, master_pb2.HeartbeatRequest)
            t0 = time.perf_counter()
            if not self.is_leader:
                metrics.observe_request("heartbeat", "UNAVAILABLE", 0.0)
                await self._not_leader(context, "stepped down")
            if ident is None:
                ident = (req.worker_id, req.instance)
            elif ident != (req.worker_id, req.instance):
                metrics.observe_request("heartbeat", "INVALID_ARGUMENT", 0.0)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "every heartbeat of a stream must name the same worker and instance",
                )
            now, v0 = time.monotonic(), self.m.version
            try:
                known = self.m.heartbeat(req.worker_id, req.instance, req.stats, now, req.draining)
            except KVStoreError as e:
                metrics.observe_request("heartbeat", to_grpc_code(e).name, 0.0)
                await self._refuse(context, "Heartbeat", req.worker_id, e)
            metrics.HEARTBEATS.inc(known)
            if self.m.version != v0:
                await self._commit(context)
            metrics.observe_request("heartbeat", "OK", time.perf_counter() - t0)
            if not known:
                yield master_pb2.HeartbeatResponse(known=False, map_version=self.m.version)
                return
            if now - answered >= self.m.ttl:
                answered = now
                yield master_pb2.HeartbeatResponse(known=True, map_version=self.m.version)

    async def Beats(  # type: ignore[override]  # writes with context.write
        self, request_iterator: AsyncIterator[master_pb2.BeatBatch], context: Ctx
    ) -> None:
        """Batched heartbeats of the workers on one connection (leader only; see
        master.proto and :class:`~kvstore.master.beats.BeatSession`). A standby, or a
        leader that stepped down, ends the stream UNAVAILABLE; a slot number out of
        range INVALID_ARGUMENT. While slots of the stream beat by datagram the stream
        carries few batches: the handler also wakes for what the datagram drain has
        to say on it (:meth:`BeatEar.drain`)."""
        if not self.is_leader:
            await self._not_leader(context, "heartbeats go to the leader")
        session = BeatSession(self.ear.datagrams)
        read: asyncio.Future[Any] | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                if session.beats_by_datagram:
                    wake = self.ear.streams.get(session)
                    if wake is None or wake.done():
                        wake = self.ear.streams[session] = loop.create_future()
                    if read is None:
                        read = asyncio.ensure_future(context.read())
                    await asyncio.wait((read, wake), return_when=asyncio.FIRST_COMPLETED)
                    if wake.done():
                        if not self.is_leader:
                            await self._not_leader(context, "stepped down")
                        pushed = wake.result()
                        if pushed is not None:
                            await context.write(pushed)
                    if not read.done():
                        continue
                    req, read = read.result(), None
                else:
                    self.ear.streams.pop(session, None)
                    if read is not None:  # begun while the stream beat by datagram
                        req, read = await read, None
                    else:
                        req = await context.read()
                if req is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                assert isinstance(req, master_pb2.BeatBatch)
                if not self.is_leader:
                    await self._not_leader(context, "stepped down")
                m, v0 = self.m, self.m.version
                b0 = m.beats
                try:
                    answer = session.handle(m, req, time.monotonic())
                except KVStoreError as e:
                    log.warning("refused a heartbeat batch from %s: %s", context.peer(), e)
                    await context.abort(to_grpc_code(e), str(e))
                metrics.HEARTBEATS.inc(m.beats - b0)
                if m.version != v0:
                    await self._commit(context)
                if answer is not None:
                    await context.write(answer)
        except asyncio.CancelledError:
            return  # the worker went away or the master is stopping: not an error
        finally:
            if read is not None:
                read.cancel()
            self.ear.streams.pop(session, None)
            session.close()

    @observed("leave")
    async def Leave(
        self, request: master_pb2.LeaveRequest, context: Ctx
    ) -> master_pb2.LeaveResponse:
        if not self.is_leader:
            return await self._forward(
                context, lambda s, md: s.Leave(request, timeout=FORWARD_TIMEOUT, metadata=md)
            )
        try:
            removed = self.m.leave(request.worker_id, request.instance, time.monotonic())
        except KVStoreError as e:
            await self._refuse(context, "Leave", request.worker_id, e)
        if removed:
            log.info("worker %s left", request.worker_id)
        if self.m.version != self.published.version:
            await self._commit(context)
        return master_pb2.LeaveResponse(removed=removed)

    # ---- map reads (every master) ------------------------------------------------

    @observed("get_shard_map")
    async def GetShardMap(
        self, request: master_pb2.GetShardMapRequest, context: Ctx
    ) -> master_pb2.ShardMap:
        return self.published

    async def WatchShardMap(
        self, request: master_pb2.WatchShardMapRequest, context: Ctx
    ) -> AsyncIterator[master_pb2.ShardMap]:
        """The current map, then every new version (see :meth:`MapFeed.watch`): as
        deltas when the request asks for them."""
        try:
            async for m in self.feed.watch(request.known_version, request.deltas):
                yield m
        except asyncio.CancelledError:
            return  # the client went away or the master is stopping: not an error

    @observed("cluster_status")
    async def ClusterStatus(
        self, request: master_pb2.ClusterStatusRequest, context: Ctx
    ) -> master_pb2.ClusterStatusResponse:
        forwarded = any(k == FORWARDED for k, _ in context.invocation_metadata() or ())
        leader = self._leader_hint()
        if not self.is_leader and leader and not forwarded:
            md: tuple[tuple[str, str], ...] = ((FORWARDED, self.address),)
            for k, v in context.invocation_metadata() or ():
                if k == AUTH_HEADER:  # the leader checks the caller's token too
                    md += ((k, v if isinstance(v, str) else v.decode()),)
            try:
                resp = await self._leader_stub(leader).ClusterStatus(
                    request, timeout=STATUS_FORWARD_TIMEOUT, metadata=md
                )
                resp.leader = False  # answered by a standby
                return resp
            except grpc.aio.AioRpcError as e:
                log.info("ClusterStatus: leader %s did not answer (%s)", leader, e.code().name)
        now = time.monotonic()
        return master_pb2.ClusterStatusResponse(
            map_version=self.published.version,
            workers=[
                master_pb2.WorkerStatus(
                    info=mem.info,
                    stats=mem.stats,
                    last_heartbeat_age_s=now - mem.seen,
                    draining=mem.draining,
                )
                for _, mem in sorted(self.m.members.items())
            ],
            master_version=__version__,
            leader=self.is_leader,
        )

    @observed("drain")
    async def Drain(
        self, request: master_pb2.DrainRequest, context: Ctx
    ) -> master_pb2.DrainResponse:
        """Take a worker out of the map now, then have it hand its DRAM blocks to their
        next owners (kvstore.master.drain); see master.proto."""
        try:
            timeout = drain.check_timeout(request.timeout_s)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not self.is_leader:
            return await self._forward(
                context,
                lambda s, md: s.Drain(request, timeout=timeout + 2 * drain.SLACK_S, metadata=md),
            )
        try:
            changed = self.m.drain(request.worker_id)
        except KVStoreError as e:
            await context.abort(to_grpc_code(e), str(e))
        if changed:
            await self._commit(context)
        version = self.m.version
        member = self.m.members.get(request.worker_id)
        if member is None:  # expired while the change was committed
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker {request.worker_id!r} left")
        auth = tuple(
            (k, v if isinstance(v, str) else v.decode())
            for k, v in context.invocation_metadata() or ()
            if k == AUTH_HEADER
        )
        try:
            r = await drain.ask_hand_off(member.info.grpc, self.tls, auth, timeout)
        except grpc.aio.AioRpcError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                else e.code(),
                f"worker {request.worker_id!r} left the map (version {version}) but did not "
                f"hand off its blocks: {e.code().name}: {e.details()}",
            )
        log.info(
            "drained worker %s: %d blocks moved, %d kept, %.2fs",
            request.worker_id, r.moved_blocks, r.kept_blocks, r.seconds,
        )  # fmt: skip
        return master_pb2.DrainResponse(
            worker_id=request.worker_id,
            map_version=version,
            moved_blocks=r.moved_blocks,
            moved_bytes=r.moved_bytes,
            kept_blocks=r.kept_blocks,
            seconds=r.seconds,
        )

    # ---- expiry (leader) -------------------------------------------------------

    def start_expiry(self) -> None:
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.create_task(self.expire_loop(), name="expiry")

    def stop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def expire_loop(self) -> None:
        """Tick the membership while this master leads: every TTL/10 it learns how late
        the tick ran (the master's own lateness, which it does not count as anyone's
        silence) and how busy the master was (its CPU time), expires the silent, sets
        the backoff it asks of workers, and alerts (metrics, a warning at most every
        OVERLOAD_LOG_S) while overloaded. See :mod:`kvstore.master.membership`."""
        cpu, last = time.process_time(), time.monotonic()
        while True:
            tick = max(0.05, self.m.ttl / 10)
            due = time.monotonic() + tick
            await asyncio.sleep(tick)
            now, cpu_now = time.monotonic(), time.process_time()
            busy = (cpu_now - cpu) / max(1e-3, now - last)
            cpu, last = cpu_now, now
            self.ear.drain(now - due)  # beats waiting in the socket count before the judging
            t = self.m.tick(now, now - due, busy)
            self._report(t, now - due, now)
            if t.expired:
                metrics.WORKERS_EXPIRED.inc(len(t.expired))
                why = ", ".join(t.why)  # each: its silence on both clocks, and the rule
                log.warning("workers missed heartbeats (TTL %gs), removed: %s", self.m.ttl_now, why)
            if self.m.version != self.published.version:
                try:
                    await self._bump()
                except KVStoreError as e:
                    log.warning("could not persist the map: %s", e)

    def _report(self, t: Tick, late: float, now: float) -> None:
        metrics.MASTER_LAG.set(max(0.0, late))
        metrics.MASTER_DEAF.inc(t.deaf)
        metrics.MASTER_OVERLOADED.set(int(t.overloaded))
        metrics.HEARTBEAT_INTERVAL.set(self.m.heartbeat_interval)
        metrics.EXPIRIES_HELD.set(t.held)
        if t.overloaded and now - self._overload_said >= OVERLOAD_LOG_S:
            self._overload_said = now
            log.warning(
                "the master is behind (this tick %.2fs late, %.1fs not counted as silence "
                "so far): %d silent workers held, heartbeats asked every %.2gs",
                late,
                self.m.deaf,
                t.held,
                self.m.heartbeat_interval,
            )

    async def close(self) -> None:
        self.stop_expiry()
        self.ear.close()
        if self._flusher is not None:
            self._flusher.cancel()
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()


class _Capture:
    """Stands in for a server to capture the generated Master method handlers."""

    name = ""
    handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, name: str, handlers: Any) -> None:
        self.name, self.handlers = name, dict(handlers)


def _add_servicer(servicer: MasterServicer, server: grpc.aio.Server) -> None:
    """``add_MasterServicer_to_server`` with WatchShardMap's serializer replaced by
    :meth:`MapFeed.wire` (one serialization per message)."""
    cap = _Capture()
    master_pb2_grpc.add_MasterServicer_to_server(servicer, cap)  # type: ignore[arg-type]
    cap.handlers["WatchShardMap"] = grpc.unary_stream_rpc_method_handler(
        servicer.WatchShardMap,
        request_deserializer=master_pb2.WatchShardMapRequest.FromString,
        response_serializer=servicer.feed.wire,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.name, cap.handlers),))
    server.add_registered_method_handlers(cap.name, cap.handlers)  # type: ignore[attr-defined]


def _advertised(cfg: MasterConfig, port: int) -> str:
    """The address other masters and workers reach this one at."""
    host = cfg.advertise_host or os.environ.get("POD_IP", "") or cfg.host
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = socket.gethostname()
    return f"{host}:{port}"


async def serve(cfg: MasterConfig) -> int:
    """Run the master until SIGTERM/SIGINT; prints one JSON 'ready' line on stdout.

    With ``cfg.etcd`` it joins the leader election first and raises Unavailable
    when etcd does not answer within 15 s.
    """
    metrics.enable_master_metrics(etcd=bool(cfg.etcd))
    check_replicas(cfg.replicas)
    parse_namespace_replicas(cfg.namespace_replicas)  # bad entries fail before binding
    members = Membership(
        cfg.worker_ttl,
        replicas=cfg.replicas,
        cluster_id=cfg.cluster_id,
        vnodes_per_gib=cfg.vnodes_per_gib,
    )
    if not cfg.etcd:
        # Alone, in memory: number the maps from the clock, so that a restarted master's
        # maps rank above every map of its predecessor that clients still hold (they
        # ignore a map whose version is not above theirs). etcd keeps the count with HA.
        members.version = time.time_ns() // 1000
    tenants = Tenants.load(cfg.tenants_file) if cfg.tenants_file else None
    tls = Tls(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    if tls.enabled and not (cfg.tls_cert and cfg.tls_key):
        raise InvalidArgument("TLS needs both --tls-cert and --tls-key")
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0)],
        interceptors=[TenantGuard(tenants)] if tenants is not None else None,
    )
    bind = f"{cfg.host}:{cfg.port}"
    if tls.enabled:
        port = server.add_secure_port(bind, tls.server_credentials(cfg.tls_client_auth))
    else:
        port = server.add_insecure_port(bind)
    servicer = MasterServicer(members, address=_advertised(cfg, port), tls=tls)
    servicer.namespace_replicas = parse_namespace_replicas(cfg.namespace_replicas)
    _add_servicer(servicer, server)
    udp = beat_port(cfg.beat_port, port)
    if udp is not None:
        servicer.ear.open(cfg.host, udp)
    hs = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    ha: HaCoordinator | None = None
    if cfg.etcd:
        from .etcd import EtcdClient, EtcdTls
        from .ha import HaCoordinator

        etcd_tls = None
        if cfg.etcd_ca or cfg.etcd_cert or cfg.etcd_key:
            etcd_tls = EtcdTls.from_files(cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key)
        ha = HaCoordinator(
            EtcdClient(cfg.etcd, tls=etcd_tls),
            Layout(cfg.cluster_id),
            servicer.address,
            servicer,
            lease_ttl=cfg.lease_ttl,
        )
        servicer.ha = ha
        try:
            await ha.start()
        except KVStoreError:
            await ha.etcd.close()
            raise
    else:
        metrics.MASTER_LEADER.set(1)
        servicer.start_expiry()
    await server.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    await hs.set("kvstore.v1.Master", health_pb2.HealthCheckResponse.SERVING)
    metrics.serve(cfg.metrics_port, cfg.host)
    await servicer.republish()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = cfg.host if cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    ready: dict[str, Any] = {
        "event": "ready",
        "role": "master",
        "grpc": f"{host}:{port}",
        "pid": os.getpid(),
    }
    if servicer.ear.socket is not None:
        ready["beat_port"] = servicer.ear.socket.port
    if ha is not None:
        ready["advertise"] = servicer.address
    print(json.dumps(ready), flush=True)
    await stop.wait()
    log.info("master stopping")
    await hs.enter_graceful_shutdown()
    if ha is not None:
        await ha.stop()  # revokes the lease: a standby leads at once
        await ha.etcd.close()
    await servicer.close()
    await server.stop(grace=2.0)
    return 0
