"""The worker daemon: arena, block store, gRPC Store service, transfer servers,
registration and heartbeats with the master, and a graceful drain on SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore_client import __version__
from kvstore_client.client import parse_masters
from kvstore_client.proto import master_pb2, master_pb2_grpc, store_pb2_grpc
from kvstore_client.security import Tls, metadata, open_channel
from kvstore_client.transport.shm import host_id, shm_url
from kvstore_client.transport.ucx import ucx_url

from .. import metrics
from ..auth import Tenants
from ..config import WorkerConfig
from ..errors import InvalidArgument, RejectUndecodable
from .arena import Arena
from .servicer import StoreServicer
from .store import BlockStore
from .tiers.policy import Promoter, Watermarks, parse_pins
from .tiers.ssd import SsdStore
from .transfer.tcp import TcpTransferServer
from .transfer.ucx import UcxTransferServer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Endpoints:
    grpc: str
    tcp: str
    metrics_port: int
    ucx: str = ""  # ucx://host:port with --ucx-port, else ""


class Worker:
    """One worker process. ``start()`` brings it up; ``stop()`` drains and closes."""

    def __init__(self, cfg: WorkerConfig) -> None:
        # A failed start (a port in use, a bad certificate) leaves no arena file behind.
        try:
            self._init(cfg)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """Undo a partial start: close the listeners and remove the arena file."""
        for name in ("tcp", "ucx", "grpc_server"):
            server = getattr(self, name, None)
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop(0)
        arena = getattr(self, "arena", None)
        if arena is not None:
            arena.close()

    def _init(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        if cfg.max_value_size <= 0 or cfg.max_value_size % 64:
            raise InvalidArgument("max-value-size must be a positive multiple of 64 bytes")
        if cfg.dram_size < cfg.max_value_size:
            raise InvalidArgument(
                f"dram-size ({cfg.dram_size} bytes) must be at least max-value-size "
                f"({cfg.max_value_size} bytes)"
            )
        pins = parse_pins(cfg.pin)
        self.tenants = Tenants.load(cfg.tenants_file) if cfg.tenants_file else None
        self.tls = Tls(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        if self.tls.enabled and not (cfg.tls_cert and cfg.tls_key):
            raise InvalidArgument("TLS needs both --tls-cert and --tls-key")
        ssd = SsdStore(cfg.ssd_path, cfg.ssd_size, sync=cfg.ssd_sync) if cfg.ssd_path else None
        self.arena = Arena(cfg.dram_size - cfg.dram_size % cfg.max_value_size, cfg.shm_dir)
        self.store = BlockStore(
            self.arena,
            cfg.max_value_size,
            ssd=ssd,
            dram_marks=Watermarks(cfg.dram_high, cfg.dram_low),
            ssd_marks=Watermarks(cfg.ssd_high, cfg.ssd_low),
            promoter=Promoter(cfg.promote, cfg.promote_window),
            pins=pins,
            tenant_quota=self.tenants.quota_book() if self.tenants else None,
        )
        self.advertise = cfg.advertise_host or (
            socket.gethostname() if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        )
        self.tcp = TcpTransferServer(
            self.store,
            cfg.host,
            cfg.tcp_port,
            max_connections=cfg.max_connections,
            idle_timeout=cfg.idle_timeout,
            frame_timeout=cfg.frame_timeout,
            max_batch=cfg.max_batch,
            max_per_client=cfg.max_connections_per_client,
            on_bytes=lambda t, d, n: metrics.TRANSFER_BYTES.labels(t, d).inc(n),
            on_request=metrics.observe_request,
            tenants=self.tenants,
            ssl_context=(
                self.tls.server_context(cfg.tls_client_auth) if self.tls.enabled else None
            ),
        )
        # ucx:// (extra kvstore[ucx]), made before anything else in this process uses UCX
        # so that UCX runs in its listener-safe progress mode (docs/UCX.md).
        self.ucx: UcxTransferServer | None = None
        if cfg.ucx_port >= 0:
            if self.tls.enabled:
                raise InvalidArgument(
                    "--ucx-port cannot be combined with TLS: UCX does not encrypt"
                )
            self.ucx = UcxTransferServer(
                self.store,
                cfg.host,
                cfg.ucx_port,
                max_connections=cfg.max_connections,
                idle_timeout=cfg.idle_timeout,
                frame_timeout=cfg.frame_timeout,
                max_batch=cfg.max_batch,
                on_bytes=lambda t, d, n: metrics.TRANSFER_BYTES.labels(t, d).inc(n),
                on_request=metrics.observe_request,
                tenants=self.tenants,
            )
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc"),
            interceptors=[RejectUndecodable()],
            options=[
                ("grpc.max_receive_message_length", 256 << 20),
                ("grpc.max_send_message_length", 256 << 20),
                ("grpc.so_reuseport", 0),
            ],
        )
        bind = f"{cfg.host}:{cfg.grpc_port}"
        if self.tls.enabled:
            creds = self.tls.server_credentials(cfg.tls_client_auth)
            self.grpc_port = self.grpc_server.add_secure_port(bind, creds)
        else:
            self.grpc_port = self.grpc_server.add_insecure_port(bind)
        self.id = cfg.id or f"{self.advertise}-{self.grpc_port}"
        self.servicer = StoreServicer(self.store, self.id, self.stats, self.tenants)
        store_pb2_grpc.add_StoreServicer_to_server(self.servicer, self.grpc_server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        self._stop = threading.Event()
        self._masters = parse_masters(cfg.master)
        self._hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        metrics.register_collector(self.stats)

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(
            f"{self.advertise}:{self.grpc_port}",
            f"tcp://{self.advertise}:{self.tcp.port}",
            self.cfg.metrics_port,
            ucx_url(self.advertise, self.ucx.port) if self.ucx is not None else "",
        )

    def info(self) -> master_pb2.WorkerInfo:
        ep = self.endpoints
        return master_pb2.WorkerInfo(
            id=self.id,
            grpc=ep.grpc,
            endpoints=[ep.tcp, shm_url(self.arena.path), *([ep.ucx] if ep.ucx else [])],
            capacity_bytes=self.store.tier.capacity,
            max_value_bytes=self.store.max_value_size,
            host_id=host_id(),
            version=__version__,
        )

    def stats(self) -> dict[str, float]:
        st = self.store
        t = st.tier
        c = t.counters
        out: dict[str, float] = {
            "dram_capacity_bytes": t.capacity,
            "dram_used_bytes": t.used_bytes,
            "dram_keys": t.keys,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "puts": c.puts,
            "checksum_errors": st.counters.checksum_errors,
            "bad_frames": st.counters.bad_frames,
            "demotions": st.counters.demotions,
            "promotions": st.counters.promotions,
            "ssd_hits": st.counters.ssd_hits,
        }
        if st.ssd is not None:
            out["ssd_capacity_bytes"] = st.ssd.size
            out["ssd_used_bytes"] = st.ssd_index.used_bytes
            out["ssd_keys"] = len(st.ssd_index)
            out["ssd_evictions"] = st.ssd_index.evictions
        return out

    def start(self) -> None:
        self.tcp.start()
        if self.ucx is not None:
            self.ucx.start()
        self.grpc_server.start()
        metrics.serve(self.cfg.metrics_port, self.cfg.host)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("kvstore.v1.Store", health_pb2.HealthCheckResponse.SERVING)
        self._hb.start()

    # ---- master link ---------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        md = metadata(self.cfg.token)
        idx = 0
        registered = False
        interval = 1.0
        channel = open_channel(self._masters[idx], self.tls)
        while not self._stop.is_set():
            stub = master_pb2_grpc.MasterStub(channel)
            try:
                if not registered:
                    r = stub.Register(
                        master_pb2.RegisterRequest(worker=self.info()), timeout=5, metadata=md
                    )
                    interval = r.heartbeat_interval_s or 1.0
                    registered = True
                    log.info("registered with master %s as %s", self._masters[idx], self.id)
                hb = stub.Heartbeat(
                    master_pb2.HeartbeatRequest(worker_id=self.id, stats=self._pb_stats()),
                    timeout=5,
                    metadata=md,
                )
                registered = hb.known
            except grpc.RpcError as e:
                log.warning("master %s unreachable: %s", self._masters[idx], e.code())
                registered = False
                channel.close()
                idx = (idx + 1) % len(self._masters)
                channel = open_channel(self._masters[idx], self.tls)
                interval = 1.0
            self._stop.wait(interval if registered else min(interval, 1.0))
        with contextlib.suppress(grpc.RpcError):
            master_pb2_grpc.MasterStub(channel).Leave(
                master_pb2.LeaveRequest(worker_id=self.id), timeout=2, metadata=md
            )
        channel.close()

    def _pb_stats(self) -> master_pb2.WorkerStats:
        s = self.stats()
        return master_pb2.WorkerStats(
            used_bytes=int(s["dram_used_bytes"]),
            keys=int(s["dram_keys"]),
            hits=int(s["hits"]),
            misses=int(s["misses"]),
            evictions=int(s["evictions"]),
            puts=int(s["puts"]),
            checksum_errors=int(s["checksum_errors"]),
            ssd_capacity_bytes=int(s.get("ssd_capacity_bytes", 0)),
            ssd_used_bytes=int(s.get("ssd_used_bytes", 0)),
            ssd_keys=int(s.get("ssd_keys", 0)),
            demotions=int(s["demotions"]),
            promotions=int(s["promotions"]),
            ssd_evictions=int(s.get("ssd_evictions", 0)),
            draining=self.servicer.draining,
        )

    # ---- shutdown ------------------------------------------------------------

    def stop(self) -> None:
        """Drain: report NOT_SERVING, leave the map, finish in-flight calls, close."""
        if self._stop.is_set():
            return
        self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        self._stop.set()
        self._hb.join(timeout=5)
        grace = min(self.cfg.drain_timeout, 10.0)
        self.tcp.stop(grace)
        if self.ucx is not None:
            self.ucx.stop(grace)
        self.grpc_server.stop(grace).wait(grace)
        try:
            self.store.close(demote_timeout=self.cfg.drain_timeout)
        finally:
            self.arena.close()


def run(cfg: WorkerConfig) -> int:
    """Run a worker until SIGTERM/SIGINT; prints one JSON 'ready' line on stdout."""
    w = Worker(cfg)
    try:
        w.start()
    except BaseException:
        w._abort()
        raise
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ep = w.endpoints
    print(
        json.dumps(
            {
                "event": "ready",
                "role": "worker",
                "id": w.id,
                "grpc": ep.grpc,
                "tcp": ep.tcp,
                **({"ucx": ep.ucx} if ep.ucx else {}),
                "arena": w.arena.path,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    while not done.wait(0.5):
        pass
    t0 = time.monotonic()
    w.stop()
    log.info("worker %s stopped in %.2fs", w.id, time.monotonic() - t0)
    sys.stdout.flush()
    return 0
