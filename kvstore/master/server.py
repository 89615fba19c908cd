"""The master daemon: the Master gRPC service over the membership state machine.

Runs on asyncio (grpc.aio) so many clients can hold a shard-map watch stream
open without a thread each. Never on the data path.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvstore_client import __version__
from kvstore_client.proto import master_pb2, master_pb2_grpc

from .. import metrics
from ..config import MasterConfig
from ..errors import InvalidArgument
from .membership import Membership

log = logging.getLogger(__name__)
Ctx = grpc.aio.ServicerContext[Any, Any]


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(self, members: Membership) -> None:
        self.m = members
        self.changed = asyncio.Condition()

    async def _bump(self) -> None:
        metrics.MAP_VERSION.set(self.m.version)
        metrics.LIVE_WORKERS.set(len(self.m.shard_map().workers))
        async with self.changed:
            self.changed.notify_all()

    async def Register(
        self, request: master_pb2.RegisterRequest, context: Ctx
    ) -> master_pb2.RegisterResponse:
        w = request.worker
        if not w.id or not w.grpc or not w.endpoints or not w.capacity_bytes:
            msg = "worker registration needs id, grpc, endpoints and capacity"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
        if self.m.register(w, time.monotonic()):
            log.info("worker %s joined (%s)", w.id, ", ".join(w.endpoints))
            await self._bump()
        return master_pb2.RegisterResponse(
            heartbeat_interval_s=self.m.heartbeat_interval,
            ttl_s=self.m.ttl,
            map_version=self.m.version,
        )

    async def Heartbeat(
        self, request: master_pb2.HeartbeatRequest, context: Ctx
    ) -> master_pb2.HeartbeatResponse:
        before = self.m.version
        known = self.m.heartbeat(
            request.worker_id, request.stats, time.monotonic(), request.draining
        )
        if self.m.version != before:
            await self._bump()
        return master_pb2.HeartbeatResponse(known=known, map_version=self.m.version)

    async def Leave(
        self, request: master_pb2.LeaveRequest, context: Ctx
    ) -> master_pb2.LeaveResponse:
        removed = self.m.leave(request.worker_id)
        if removed:
            log.info("worker %s left", request.worker_id)
            await self._bump()
        return master_pb2.LeaveResponse(removed=removed)

    async def GetShardMap(
        self, request: master_pb2.GetShardMapRequest, context: Ctx
    ) -> master_pb2.ShardMap:
        return self.m.shard_map()

    async def WatchShardMap(
        self, request: master_pb2.WatchShardMapRequest, context: Ctx
    ) -> AsyncIterator[master_pb2.ShardMap]:
        known = request.known_version
        while True:
            if self.m.version != known:
                current = self.m.shard_map()
                known = current.version
                yield current
            async with self.changed:
                await self.changed.wait_for(functools.partial(self._moved_on, known))

    def _moved_on(self, known: int) -> bool:
        return self.m.version != known

    async def ClusterStatus(
        self, request: master_pb2.ClusterStatusRequest, context: Ctx
    ) -> master_pb2.ClusterStatusResponse:
        now = time.monotonic()
        return master_pb2.ClusterStatusResponse(
            map_version=self.m.version,
            workers=[
                master_pb2.WorkerStatus(
                    info=mem.info, stats=mem.stats, last_heartbeat_age_s=now - mem.last_seen
                )
                for _, mem in sorted(self.m.members.items())
            ],
            master_version=__version__,
            leader=True,
        )

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.m.ttl / 10))
            dead = self.m.expire(time.monotonic())
            if dead:
                log.warning("workers missed heartbeats, removed: %s", ", ".join(dead))
                await self._bump()


async def serve(cfg: MasterConfig) -> int:
    """Run the master until SIGTERM/SIGINT; prints one JSON 'ready' line on stdout."""
    if cfg.etcd:
        raise InvalidArgument("--etcd (HA masters) is not available in this build yet")
    members = Membership(cfg.worker_ttl, replicas=cfg.replicas, cluster_id=cfg.cluster_id)
    servicer = MasterServicer(members)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    hs = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    await hs.set("kvstore.v1.Master", health_pb2.HealthCheckResponse.SERVING)
    metrics.serve(cfg.metrics_port, cfg.host)
    await servicer._bump()
    expiry = asyncio.create_task(servicer.expire_loop())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = cfg.host if cfg.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    ready = {"event": "ready", "role": "master", "grpc": f"{host}:{port}", "pid": os.getpid()}
    print(json.dumps(ready), flush=True)
    await stop.wait()
    log.info("master stopping")
    await hs.enter_graceful_shutdown()
    expiry.cancel()
    await server.stop(grace=2.0)
    return 0
