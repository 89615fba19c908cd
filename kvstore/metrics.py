"""Prometheus metrics of the daemons, all defined here.

Names follow Prometheus conventions: the ``kvstore_`` prefix, base units
(``_bytes``, ``_seconds``) and ``_total`` for counters; labels have small,
fixed value sets (op, code, tier, transport, direction). State that lives in a
daemon's own bookkeeping (tier bytes, keys) is read at scrape time by a
collector instead of being mirrored into gauges.

Each daemon exports its own families only (a master no worker metric, a worker no
master metric): :func:`enable_worker_metrics` and :func:`enable_master_metrics`
register them. Every label value known at start starts at zero (each op with every
status code, each transport served both ways, each tenant, each etcd call), so a
``rate()`` or an alert on it has a series from the first scrape and counts the first
error too (a series that appears at 1 has no earlier sample to rate against).
docs/OPERATIONS.md lists the same families, and a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore_client import __version__
from kvstore_client.errors import Code

# No *_created series: they double the series count and dashboards do not use them.
disable_created_metrics()  # type: ignore[no-untyped-call]

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

BUILD = Info("kvstore_build", "Build information")
BUILD.info({"version": __version__})

REQUESTS = Counter(
    "kvstore_requests_total", "Requests served, by operation and status code", ["op", "code"]
)
LATENCY = Histogram(
    "kvstore_request_duration_seconds",
    "Time to serve a request, by operation",
    ["op"],
    buckets=LATENCY_BUCKETS,
)
# Every status code a request can end with (the error table's; the master's handlers
# may also end CANCELLED or UNKNOWN, counted when they happen).
CODES = tuple(c.name for c in Code)
# The ops of each daemon: the worker's gRPC Store calls and transfer frames, the master's
# calls (kvstore.master.server's @observed names).
WORKER_OPS = (
    "exists", "match_prefix", "put", "get", "remove", "remove_namespace", "stats",
    "session_hint", "sessions", "hand_off", "shm_get", "shm_reserve", "shm_commit",
)  # fmt: skip
MASTER_OPS = ("register", "heartbeat", "leave", "get_shard_map", "cluster_status", "drain")
# kvstore.master.datagrams.RESULTS
BEAT_DATAGRAM_RESULTS = ("accepted", "malformed", "unknown", "forged", "replayed", "stale")
# kvstore.master.datagrams.BINDING_RESULTS
BEAT_BINDING_RESULTS = ("granted", "confirmed", "lost", "unheard")
ETCD_OPS = ("range", "txn", "watch", "lease_grant", "lease_revoke", "lease_ttl", "lease_keepalive")

# A worker's own metrics: registered only by workers (enable_worker_metrics).
TRANSFER_BYTES = Counter(
    "kvstore_transfer_bytes_total",
    "Payload bytes moved on the transfer plane, by transport and direction",
    ["transport", "direction"],
    registry=None,
)
BAD_FRAMES = Counter(
    "kvstore_bad_frames_total",
    "Transfer connections closed for a malformed frame",
    ["transport"],
    registry=None,
)
SESSION_HIT_RATIO = Histogram(
    "kvstore_session_hit_ratio",
    "Per-session block hit ratio over its active hints, observed when it leaves the table "
    "(one observation per session: no per-session labels)",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
    registry=None,
)
TENANT_HIT_BLOCKS = Counter(
    "kvstore_tenant_hit_blocks_total",
    "Blocks found by lookups and inline reads, by tenant ('' without auth)",
    ["tenant"],
    registry=None,
)
TENANT_LOOKUP_BLOCKS = Counter(
    "kvstore_tenant_lookup_blocks_total",
    "Blocks asked about by lookups and inline reads, by tenant ('' without auth)",
    ["tenant"],
    registry=None,
)
TENANT_BYTES = Counter(
    "kvstore_tenant_bytes_total",
    "Inline (gRPC) payload bytes, by tenant and direction (in = put, out = get)",
    ["tenant", "direction"],
    registry=None,
)
_WORKER_METRICS = (
    TRANSFER_BYTES,
    BAD_FRAMES,
    SESSION_HIT_RATIO,
    TENANT_HIT_BLOCKS,
    TENANT_LOOKUP_BLOCKS,
    TENANT_BYTES,
)
_worker_enabled = False
# The master's own metrics: registered only by the master (enable_master_metrics), so
# workers do not export a misleading kvstore_master_leader 0.
LIVE_WORKERS = Gauge("kvstore_live_workers", "Workers in the shard map (master)", registry=None)
MAP_VERSION = Gauge("kvstore_shard_map_version", "Version of the shard map (master)", registry=None)
MASTER_LEADER = Gauge(
    "kvstore_master_leader",
    "1 on the leading master, 0 on standbys (always 1 without etcd)",
    registry=None,
)
LEADER_TERMS = Counter(
    "kvstore_master_leader_terms_total",
    "Times this master won the leader election",
    registry=None,
)
ETCD_ERRORS = Counter(
    "kvstore_etcd_errors_total",
    "Failed etcd calls of a master, by operation",
    ["op"],
    registry=None,
)
HEARTBEATS = Counter(
    "kvstore_heartbeats_total",
    "Worker heartbeats the master applied (one per worker beat, batched or not)",
    registry=None,
)
BEAT_DATAGRAMS = Counter(
    "kvstore_master_beat_datagrams_total",
    "UDP beat datagrams the master read, by result: accepted (a beat), malformed, "
    "unknown (binding), forged (MAC), replayed (sequence), stale (registration gone)",
    ["result"],
    registry=None,
)
BEAT_BINDINGS = Counter(
    "kvstore_master_beat_bindings_total",
    "Datagram beat bindings, by result: granted (on a Beats bind), confirmed (the first "
    "datagram arrived), lost (a confirmed binding fell silent), unheard (none arrived)",
    ["result"],
    registry=None,
)
WORKERS_EXPIRED = Counter(
    "kvstore_workers_expired_total",
    "Workers the master removed for missing heartbeats",
    registry=None,
)
MASTER_LAG = Gauge(
    "kvstore_master_lag_seconds",
    "How late the master's last expiry tick ran (its event loop or host is behind)",
    registry=None,
)
MASTER_DEAF = Counter(
    "kvstore_master_deaf_seconds_total",
    "Time the master was behind and did not count as any worker's silence",
    registry=None,
)
MASTER_OVERLOADED = Gauge(
    "kvstore_master_overloaded",
    "1 while the master is behind, holds silent workers or asks for slower heartbeats",
    registry=None,
)
HEARTBEAT_INTERVAL = Gauge(
    "kvstore_heartbeat_interval_seconds",
    "The heartbeat interval the master asks of workers (longer while it sheds load)",
    registry=None,
)
EXPIRIES_HELD = Gauge(
    "kvstore_expiries_held",
    "Workers silent past the TTL that the master holds back (many fell silent at once)",
    registry=None,
)
_MASTER_METRICS = (
    LIVE_WORKERS,
    MAP_VERSION,
    MASTER_LEADER,
    LEADER_TERMS,
    ETCD_ERRORS,
    HEARTBEATS,
    BEAT_DATAGRAMS,
    BEAT_BINDINGS,
    WORKERS_EXPIRED,
    MASTER_LAG,
    MASTER_DEAF,
    MASTER_OVERLOADED,
    HEARTBEAT_INTERVAL,
    EXPIRIES_HELD,
)
_master_enabled = False


def _start_requests(ops: Iterable[str]) -> None:
    """Every (op, code) of ``ops`` at zero, and each op's latency histogram."""
    for op in ops:
        for code in CODES:
            REQUESTS.labels(op, code)
        LATENCY.labels(op)


def enable_master_metrics(*, etcd: bool = False) -> None:
    """Export the master's metrics from this process, its known label values at zero
    (the etcd calls' errors with ``etcd``). Idempotent; the master calls it."""
    global _master_enabled
    if not _master_enabled:
        for m in _MASTER_METRICS:
            REGISTRY.register(m)
        _master_enabled = True
    _start_requests(MASTER_OPS)
    for result in BEAT_DATAGRAM_RESULTS:
        BEAT_DATAGRAMS.labels(result)
    for result in BEAT_BINDING_RESULTS:
        BEAT_BINDINGS.labels(result)
    if etcd:
        for op in ETCD_OPS:
            ETCD_ERRORS.labels(op)


def enable_worker_metrics(
    read: Callable[[], Any], *, transports: Iterable[str], tenants: Iterable[str]
) -> None:
    """Export a worker's metrics from this process: its stats record read at scrape time
    (``read``, see :class:`StatsCollector`), and its known label values at zero: every
    op with every code, the ``transports`` it serves both ways, and the ``tenants`` of
    its tenants file ('' without one). Idempotent for the metric families; the worker
    calls it once."""
    global _worker_enabled
    if not _worker_enabled:
        for m in _WORKER_METRICS:
            REGISTRY.register(m)
        REGISTRY.register(StatsCollector(read))
        _worker_enabled = True
    _start_requests(WORKER_OPS)
    for t in transports:
        if t != "shm":  # shm:// frames travel on the tcp:// connection: counted as tcp
            BAD_FRAMES.labels(t)
        for d in ("rx", "tx"):
            TRANSFER_BYTES.labels(t, d)
    for name in tenants:
        TENANT_HIT_BLOCKS.labels(name)
        TENANT_LOOKUP_BLOCKS.labels(name)
        for d in ("in", "out"):
            TENANT_BYTES.labels(name, d)


def observe_session_hit_ratios(ratios: Iterable[float]) -> None:
    """One histogram observation per session that left a worker's table."""
    for r in ratios:
        SESSION_HIT_RATIO.observe(r)


def count_tenant(
    tenant: str, *, hits: int = 0, lookups: int = 0, nin: int = 0, nout: int = 0
) -> None:
    """Per-tenant hits and bytes (tenants come from the tenants file: a bounded set)."""
    if lookups:
        TENANT_LOOKUP_BLOCKS.labels(tenant).inc(lookups)
        TENANT_HIT_BLOCKS.labels(tenant).inc(hits)
    if nin:
        TENANT_BYTES.labels(tenant, "in").inc(nin)
    if nout:
        TENANT_BYTES.labels(tenant, "out").inc(nout)


def observe_request(op: str, code: str, seconds: float) -> None:
    """Count one served request of ``op`` that ended with status ``code`` (a gRPC
    status name such as "OK" or "UNAVAILABLE") and record its latency.

    Callable from any thread; ``op`` and ``code`` must come from small fixed sets.
    """
    children = _REQUEST_CHILDREN.get((op, code))
    if children is None:  # labels() takes a lock and builds a key: once per (op, code)
        children = _REQUEST_CHILDREN[(op, code)] = (REQUESTS.labels(op, code), LATENCY.labels(op))
    children[0].inc()
    children[1].observe(seconds)


# (op, code) -> its counter and histogram children (a small fixed set, see above).
_REQUEST_CHILDREN: dict[tuple[str, str], tuple[Any, Any]] = {}


class StatsCollector(Collector):
    """Reads a worker's counters at scrape time from a callable returning its stats
    record (kvstore.worker.storerecords.StoreStats; read by attribute name, so this module
    does not import worker code)."""

    def __init__(self, read: Callable[[], Any]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        rec = self._read()
        s = {k: getattr(rec, k) for k in rec.__slots__}
        if not s.get("has_ssd"):
            s = {k: v for k, v in s.items() if not k.startswith("ssd_")}
        used = GaugeMetricFamily(
            "kvstore_tier_used_bytes", "Bytes stored per tier", labels=["tier"]
        )
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        keys = GaugeMetricFamily("kvstore_tier_keys", "Blocks stored per tier", labels=["tier"])
        for tier in ("dram", "ssd"):
            if f"{tier}_capacity_bytes" in s:
                used.add_metric([tier], s.get(f"{tier}_used_bytes", 0))
                cap.add_metric([tier], s[f"{tier}_capacity_bytes"])
                keys.add_metric([tier], s.get(f"{tier}_keys", 0))
        yield from (used, cap, keys)
        for name, key, doc in (
            ("kvstore_sessions", "sessions", "Agent sessions in the worker's table"),
            ("kvstore_session_retained_bytes", "retained_bytes", "DRAM kept for paused sessions"),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], s.get(key, 0))
            yield g
        for name, key, doc in (
            ("kvstore_hit_blocks", "hits", "Blocks found by reads"),
            ("kvstore_miss_blocks", "misses", "Blocks missed by reads"),
            ("kvstore_evictions", "evictions", "Blocks evicted from DRAM"),
            ("kvstore_demotions", "demotions", "Blocks moved from DRAM to SSD"),
            ("kvstore_promotions", "promotions", "Blocks moved from SSD to DRAM"),
            ("kvstore_ssd_evictions", "ssd_evictions", "Blocks evicted from SSD"),
            ("kvstore_checksum_errors", "checksum_errors", "Blocks dropped for a bad checksum"),
            ("kvstore_stored_blocks", "puts", "Blocks stored"),
            ("kvstore_prefetched_blocks", "prefetched", "Blocks prefetched for resumed sessions"),
            (
                "kvstore_session_declined_blocks",
                "share_declined",
                "New blocks of a session already holding its share, not stored",
            ),
            (
                "kvstore_session_cuts_refused",
                "session_cuts_refused",
                "Chain-cut notices for a session of another client, ignored",
            ),
            (
                "kvstore_shm_inbox_mismatch_blocks",
                "inbox_mismatches",
                "Blocks a same-host writer put whose bytes did not match their checksum, "
                "not stored",
            ),
            (
                "kvstore_shm_pages_revoked",
                "pages_revoked",
                "Same-host clients' hazard pages revoked for naming more than their budget",
            ),
            (
                "kvstore_session_hints_refused",
                "session_hints_refused",
                "Hints of another client's session that did not show its chain, ignored",
            ),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], s.get(key, 0))
            yield c


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Expose /metrics over HTTP on ``port`` (0 = disabled)."""
    if port:
        start_http_server(port, addr=host)
