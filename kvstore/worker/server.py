"""The worker daemon: arena, block store, gRPC Store service, transfer servers,
registration and heartbeats with the master, and a graceful drain on SIGTERM.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict, dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore_client import Client, __version__
from kvstore_client.proto import master_pb2, store_pb2_grpc
from kvstore_client.routing import parse_masters
from kvstore_client.security import Tls
from kvstore_client.transport.shm import host_id, shm_url
from kvstore_client.transport.ucx import ucx_url

from .. import metrics, procs
from ..auth import Tenants
from ..config import WorkerConfig
from ..errors import InvalidArgument, RejectUndecodable
from .arena import Arena
from .events import SSD, KvEventPublisher
from .handoff import HandOffResult, hand_off
from .masterlink import IdInUse, MasterLink
from .requests import Limits, RequestCore, account
from .servicer import StoreServicer
from .sessions import SessionTable
from .store import BlockStore
from .storerecords import StoreStats, stats_message
from .tiers.budgets import Promoter, QuotaBook, Watermarks, parse_pins
from .tiers.shared import SharedIndex
from .tiers.ssd import SsdStore
from .transfer.shm import ArenaShare, Inboxes
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
        # Whole slabs, and with --huge-pages whole huge pages too.
        unit = math.lcm(cfg.max_value_size, cfg.huge_pages or 1)
        self.arena = Arena(
            max(unit, cfg.dram_size - cfg.dram_size % unit), cfg.shm_dir, huge_page=cfg.huge_pages
        )
        # Anything failing from here on (a port in use, a bad certificate) must not leave
        # listeners or the hand-over socket behind: each is undone as it was made.
        undo = contextlib.ExitStack()
        try:
            self.store = BlockStore(
                self.arena,
                cfg.max_value_size,
                ssd=ssd,
                dram_marks=Watermarks(cfg.dram_high, cfg.dram_low),
                ssd_marks=Watermarks(cfg.ssd_high, cfg.ssd_low),
                promoter=Promoter(cfg.promote, cfg.promote_window),
                pins=pins,
                tenant_quota=(
                    QuotaBook(self.tenants.quotas, key_of=self.tenants.quota_account)
                    if self.tenants
                    else None
                ),
                sessions=SessionTable(
                    max_sessions=cfg.max_sessions,
                    max_blocks=cfg.max_session_blocks,
                    paused_ttl=cfg.session_ttl,
                    idle_ttl=cfg.session_idle_ttl,
                    account_of=self.tenants.owner if self.tenants else None,
                    move_slice=2048,  # a long chain changes state 2,048 keys at a time
                ),
                retain_budget=int(cfg.session_budget * cfg.dram_size),
                session_share=int(
                    cfg.session_share * (cfg.dram_size + (cfg.ssd_size if cfg.ssd_path else 0))
                ),
                session_order=cfg.session_order,
            )
            # The same-host index: clients that map the arena probe and pin it with
            # no round trip (tiers.shared); the hand-over thread runs its upkeep.
            self.index = SharedIndex(self.store.tier.capacity, self.arena.tag, ssd=ssd is not None)
            undo.callback(_quietly, self.index.close)
            self.store.attach_shared(self.index)  # the tier is empty: nothing to publish yet
            self.events: KvEventPublisher | None = None
            if cfg.kv_events:
                self.events = KvEventPublisher(
                    cfg.kv_events,
                    replay=cfg.kv_events_replay,
                    topic=cfg.kv_events_topic,
                    history_bytes=cfg.kv_events_history_bytes,
                    replay_peers=cfg.kv_events_replay_peers,
                )
                self.store.publish_events(self.events.sink)
                undo.callback(_quietly, self.events.close)
            n = cfg.shm_entries_per_connection
            self.core = RequestCore(
                Limits.for_arena(
                    self.store.tier.capacity,
                    self.store.max_value_size,
                    max_batch=cfg.max_batch,
                    max_answer_bytes=cfg.max_answer_bytes,
                    reserve_ahead=cfg.reserve_ahead,
                    hold_per_connection=cfg.hold_per_connection,
                    hold_per_client=cfg.hold_per_client,
                    hold_per_worker=cfg.hold_per_worker,
                    entries_per_connection=n,
                    entries_per_client=4 * n,
                    entries_per_worker=16 * n,
                ),
                self.tenants,
            )
            self.share: ArenaShare | None = None
            self.inboxes: Inboxes | None = None
            if self._shares(cfg):
                if cfg.shm_inbox_size:
                    self.inboxes = Inboxes(max(cfg.shm_inbox_size, 2 * cfg.max_value_size))
                self.share = ArenaShare(
                    self.arena, cfg.shm_dir, self.inboxes, self.core.limits.hold_per_client
                )
                undo.callback(_quietly, self.share.close)
                self.share.attach(self.index, self._index_upkeep)
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
                max_per_client=cfg.max_connections_per_client,
                on_bytes=lambda t, d, n: metrics.TRANSFER_BYTES.labels(t, d).inc(n),
                on_request=metrics.observe_request,
                on_bad_frame=lambda t: metrics.BAD_FRAMES.labels(t).inc(),
                core=self.core,
                ssl_context=(
                    self.tls.server_context(cfg.tls_client_auth) if self.tls.enabled else None
                ),
                inboxes=self.inboxes,
            )
            undo.callback(_quietly, self.tcp.stop, 0)
            # ucx:// (extra kvstore-cache[ucx]), made before anything else in this process uses UCX
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
                    on_bytes=lambda t, d, n: metrics.TRANSFER_BYTES.labels(t, d).inc(n),
                    on_request=metrics.observe_request,
                    on_bad_frame=lambda t: metrics.BAD_FRAMES.labels(t).inc(),
                    core=self.core,
                )
                undo.callback(_quietly, self.ucx.stop, 0)
            self.grpc_server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc"),
                interceptors=[RejectUndecodable()],
                options=[
                    ("grpc.max_receive_message_length", 256 << 20),
                    ("grpc.max_send_message_length", 256 << 20),
                    ("grpc.so_reuseport", 0),
                ],
            )
            undo.callback(_quietly, self.grpc_server.stop, 0)
            bind = f"{cfg.host}:{cfg.grpc_port}"
            if self.tls.enabled:
                creds = self.tls.server_credentials(cfg.tls_client_auth)
                self.grpc_port = self.grpc_server.add_secure_port(bind, creds)
            else:
                self.grpc_port = self.grpc_server.add_insecure_port(bind)
            self.id = cfg.id or f"{self.advertise}-{self.grpc_port}"
            self.servicer = StoreServicer(self.store, self.id, self.stats, self.core)
            self.handed_off = False  # Store.HandOff ran: out of the map until restarted
            self.servicer.hand_off = self._hand_off
            store_pb2_grpc.add_StoreServicer_to_server(self.servicer, self.grpc_server)
            self.health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
            self._stop = threading.Event()
            self.fatal = ""  # why the worker must exit (its id is taken), set by the link
            self.failed = threading.Event()
            self.link = MasterLink(
                parse_masters(cfg.master),
                tls=self.tls,
                token=cfg.token,
                worker_id=self.id,
                info=self.info,
                stats=self._pb_stats,
                on_registered=self._registered,
                on_fatal=self._fatal,
                serving=self._data_plane_serving,
                datagrams=cfg.datagram_beats,
            )
            metrics.enable_worker_metrics(
                self.stats,
                transports=[
                    "tcp",
                    *(["shm"] if self.share is not None else []),
                    *(["ucx"] if self.ucx is not None else []),
                ],
                tenants=[t.name for t in self.tenants.tenants] if self.tenants else [""],
            )
        except BaseException:
            undo.close()  # listeners, then the hand-over socket
            self.arena.close()
            raise
        self._undo = undo.pop_all()

    def abort(self) -> None:
        """Undo a start that failed: close listeners, the hand-over socket and the arena."""
        self._undo.close()
        self.arena.close()

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
            endpoints=[
                ep.tcp,
                *([shm_url(self.share.path, self.arena.id, self.arena.size)] if self.share else []),
                *([ep.ucx] if ep.ucx else []),
            ],
            capacity_bytes=self.store.tier.capacity,
            max_value_bytes=self.store.max_value_size,
            host_id=host_id(),
            version=__version__,
        )

    def _data_plane_serving(self) -> bool:
        return self.tcp.healthy() and (self.ucx is None or self.ucx.healthy())

    def stats(self) -> StoreStats:
        return self.store.stats()

    def totals(self) -> dict[str, object]:
        """The store's and its policy's counters, for the log line at exit."""
        p = self.store.policy
        return {
            **asdict(self.stats()),
            "policy": asdict(p.counters),
            "sessions": asdict(p.sessions.counters),
        }

    def start(self) -> None:
        if self.events is not None:  # a clean slate, then what the SSD tier still holds
            self.events.start(cleared=True)
            held = self.store.ssd_keys()
            for i in range(0, len(held), 4096):
                self.events.sink.add(True, SSD, held[i : i + 4096])
        self.tcp.start()
        if self.ucx is not None:
            self.ucx.start()
        self.grpc_server.start()
        metrics.serve(self.cfg.metrics_port, self.cfg.host)
        # NOT_SERVING until the master lists this worker (then _registered): a
        # readiness probe passes only once clients can route to it.
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.set("kvstore.v1.Store", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.link.start()

    # ---- master link ---------------------------------------------------------

    def _registered(self) -> None:
        """First registration: from now on the worker is in the map, so report SERVING."""
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("kvstore.v1.Store", health_pb2.HealthCheckResponse.SERVING)

    def _fatal(self, message: str) -> None:
        self.fatal = message
        self.failed.set()

    def _pb_stats(self) -> master_pb2.WorkerStats:
        draining = self.servicer.draining or self.handed_off
        return stats_message(self.stats(), master_pb2.WorkerStats, draining=draining)

    def _hand_off(self, timeout_s: float) -> HandOffResult:
        """Store.HandOff (Master.Drain): from now on the heartbeats say draining (the
        worker stays out of the map, also with a master that restarted), and the DRAM
        blocks go to their next owners."""
        self.handed_off = True
        cfg = self.cfg

        def client() -> Client:
            return Client(cfg.master, timeout=30.0, tls=self.tls, token=cfg.token or None)

        return hand_off(self.store, client, self.id, timeout_s)

    # ---- shutdown ------------------------------------------------------------

    def _shares(self, cfg: WorkerConfig) -> bool:
        """Whether same-host clients get the arena (docs/SECURITY.md, shared memory): not
        with tenants (one tenant's client would map every tenant's blocks), and only
        when the kernel seals it (no client can write a published block)."""
        if not cfg.share_arena:
            return False
        if self.tenants is not None:
            log.info("tenants: the arena is not shared; same-host clients use tcp://")
            return False
        if not self.arena.sealed:
            log.warning(
                "this kernel does not seal the arena%s: same-host clients use tcp://",
                " (huge pages need Linux 5.13)" if cfg.huge_pages else " (Linux 5.1)",
            )
            return False
        return True

    def _index_upkeep(self) -> None:
        budget = self.core.budget
        held = self.store.shared_upkeep(lambda ident: budget.client_bytes(account(ident)))
        budget.set_hazards({account(k): v for k, v in held.items()})
        # A lookup may resume a paused session (BlockStore.match_prefix): while one is
        # paused, same-host clients ask the worker for lookups.
        self.index.ask_lookups(bool(self.store.policy.sessions.paused))

    def stop(self) -> None:
        """Drain: report NOT_SERVING, leave the map, finish in-flight calls, close."""
        if self._stop.is_set():
            return
        self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        self._stop.set()
        self.link.stop(timeout=5)
        grace = min(self.cfg.drain_timeout, 10.0)
        self.tcp.stop(grace)
        if self.ucx is not None:
            self.ucx.stop(grace)
        self.grpc_server.stop(grace).wait(grace)
        try:
            self.store.close(demote_timeout=self.cfg.drain_timeout)
        finally:
            if self.events is not None:
                self.events.close()
            if self.share is not None:
                self.share.close()
            self.store.attach_shared(None)  # stats() at exit must not read a closed index
            self.index.close()
            self.arena.close()


STALL_AFTER_DRAIN_S = 10.0  # a stop still running this long past --drain-timeout


def run(cfg: WorkerConfig) -> int:
    """Run a worker until SIGTERM/SIGINT; prints one JSON 'ready' line on stdout."""
    if not cfg.dumpable:  # before any memfd exists: no other process reopens them
        procs.set_dumpable(False)
    w = Worker(cfg)
    try:
        w.start()
    except BaseException:
        w.abort()
        raise
    stopping = procs.StopSignals()
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
                **({"arena": w.share.path} if w.share else {}),
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    while not stopping.wait(0.5):
        if w.failed.is_set():
            break
    if stopping.signum is not None:
        log.info("signal %d: draining", stopping.signum)
    # A stop that hangs (in the drain, or at exit joining a thread) leaves its evidence:
    # every thread's stack on stderr once it runs STALL_AFTER_DRAIN_S past the drain's
    # bound. Never cancelled: a process that exits takes the watchdog with it.
    faulthandler.dump_traceback_later(cfg.drain_timeout + STALL_AFTER_DRAIN_S, exit=False)
    t0 = time.monotonic()
    w.stop()
    log.info("worker %s stopped in %.2fs", w.id, time.monotonic() - t0)
    log.info("worker %s totals: %s", w.id, json.dumps(w.totals(), sort_keys=True))
    sys.stdout.flush()
    if w.fatal:
        raise IdInUse(w.fatal)
    return 0


def _quietly(close: Callable[..., object], *args: object) -> None:
    """Undo one piece of a partial start; a failure there must not hide the first one."""
    with contextlib.suppress(Exception):
        close(*args)
