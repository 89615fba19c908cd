"""Cluster membership and the shard map, as a state machine without I/O.

Events in (register, heartbeat, leave, tick with the current time), state out
(the map and its version). Every change that clients must see bumps
``version``; the servicer pushes the new map to watchers.

A registration is bound to the worker's *instance token* (random, made by each
worker process at start). While a registration lives, a register, heartbeat or
leave for its id with another token raises :class:`IdConflict` and changes
nothing: a second process started with the same ``--id``, or anyone on the
network with tokens off, can neither take over a live worker's id (and so its
traffic) nor drop it from the map. Once the id expired or left, any instance
may register it again (a restarted worker waits at most one TTL). The servicer
also lets a new instance in at once when it proves the old one gone (the old
registration's gRPC port refuses connections; :meth:`evict`).

Registrations are checked against size limits (:func:`check_worker`), and the
number of members is capped, so the map every client downloads stays small. A
registered capacity above ``MAX_CAPACITY`` is refused; one that the ring bounds
(:func:`kvstore_client.sharding.point_counts`: a share of the ring, the ring's
total) is accepted and :meth:`Membership.ring_note` says how it is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore_client.errors import (
    Code,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ResourceExhausted,
)
from kvstore_client.proto import master_pb2
from kvstore_client.sharding import (
    DEFAULT_VNODES_PER_GIB,
    MAX_RING_POINTS,
    MAX_WORKER_SHARE,
    MIN_VNODES,
    bound_counts,
    share_cap,
    vnode_count,
    wanted_counts,
)

# Size limits of one registration (bytes of UTF-8); see master.proto.
MAX_ID = 128
MAX_GRPC = 256
MAX_ENDPOINTS = 8
MAX_ENDPOINT = 256
MAX_HOST_ID = 128
MAX_VERSION = 64
MIN_INSTANCE = 16
MAX_INSTANCE = 128
MAX_WORKERS = 1024  # at <= 2.7 KiB per worker, the map stays under gRPC's 4 MiB default
MAX_CAPACITY = 1 << 50  # bytes of DRAM one worker may register (1 PiB: no host has it)


class IdConflict(KVStoreError):
    """A worker id is live and bound to another instance token (FAILED_PRECONDITION).

    ``live_at``: the holder's gRPC address when the master saw it accept a connection
    there (a different address than the caller's): the id is provably taken."""

    code = Code.FAILED_PRECONDITION
    live_at: str = ""


def _printable(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _check_len(what: str, text: str, limit: int) -> None:
    n = len(text.encode())
    if n > limit:
        raise InvalidArgument(f"worker {what} of {n} bytes exceeds the limit of {limit}")


def check_instance(token: str) -> None:
    """InvalidArgument unless ``token`` is a plausible instance token."""
    if not MIN_INSTANCE <= len(token) <= MAX_INSTANCE or not _printable(token):
        raise InvalidArgument(
            f"the instance token must be {MIN_INSTANCE}..{MAX_INSTANCE} printable ASCII "
            "characters (workers of this version send one)"
        )


def check_worker(info: master_pb2.WorkerInfo) -> None:
    """InvalidArgument unless ``info`` is complete and within the size limits."""
    if not info.id or not info.grpc or not info.endpoints or not info.capacity_bytes:
        raise InvalidArgument("worker registration needs id, grpc, endpoints and capacity")
    if info.capacity_bytes > MAX_CAPACITY:
        raise InvalidArgument(
            f"worker capacity of {info.capacity_bytes} bytes exceeds the limit of "
            f"{MAX_CAPACITY} (1 PiB)"
        )
    _check_len("id", info.id, MAX_ID)
    if not _printable(info.id):
        raise InvalidArgument("worker id must be printable ASCII")
    _check_len("grpc address", info.grpc, MAX_GRPC)
    if len(info.endpoints) > MAX_ENDPOINTS:
        raise InvalidArgument(
            f"{len(info.endpoints)} endpoints exceed the limit of {MAX_ENDPOINTS}"
        )
    for ep in info.endpoints:
        _check_len("endpoint URL", ep, MAX_ENDPOINT)
    _check_len("host_id", info.host_id, MAX_HOST_ID)
    _check_len("version", info.version, MAX_VERSION)


@dataclass(slots=True)
class Member:
    info: master_pb2.WorkerInfo
    last_seen: float
    stats: master_pb2.WorkerStats = field(default_factory=master_pb2.WorkerStats)
    draining: bool = False
    instance: str = ""  # "" only for state persisted by an older master: bound on next contact


class Membership:
    """Workers that joined and still heartbeat within ``ttl`` seconds."""

    def __init__(
        self,
        ttl: float,
        *,
        replicas: int = 1,
        cluster_id: str = "kvstore",
        vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB,
        max_workers: int = MAX_WORKERS,
    ) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.ttl = ttl
        self.replicas = replicas
        self.vnodes_per_gib = vnodes_per_gib
        self.cluster_id = cluster_id
        self.max_workers = max_workers
        self.members: dict[str, Member] = {}
        self.version = 1
        self._scale_noted = False  # ring_note said the ring is scaled down

    @property
    def heartbeat_interval(self) -> float:
        return self.ttl / 4

    def _bound(self, worker_id: str, instance: str, now: float) -> Member | None:
        """The live member ``worker_id`` if ``instance`` may act for it, None if unknown.

        Raises IdConflict when it is live and bound to another instance. Another
        instance finds a member whose TTL ran out (not yet swept by
        :meth:`expire`) gone; its own instance may still refresh it.
        """
        m = self.members.get(worker_id)
        if m is None:
            return None
        if m.instance and m.instance != instance:
            if now - m.last_seen > self.ttl:
                del self.members[worker_id]
                self.version += 1
                return None
            raise IdConflict(
                f"worker id {worker_id!r} is registered by another live instance "
                f"(last heartbeat {max(0.0, now - m.last_seen):.1f}s ago); it can be taken "
                f"once it leaves or misses heartbeats for {self.ttl:g}s"
            )
        m.instance = instance  # binds a member restored from an older master's state
        return m

    def register(self, info: master_pb2.WorkerInfo, instance: str, now: float) -> bool:
        """Add or refresh a worker; True if the map changed.

        Raises InvalidArgument for an incomplete or oversized registration or a bad
        token, IdConflict when the id is live under another instance token, and
        ResourceExhausted when ``max_workers`` are already registered.
        """
        check_worker(info)
        check_instance(instance)
        old = self._bound(info.id, instance, now)
        if old is None and len(self.members) >= self.max_workers:
            raise ResourceExhausted(f"the cluster already has {self.max_workers} workers")
        self.members[info.id] = Member(info, now, instance=instance)
        if old is None or old.info != info or old.draining:
            self.version += 1
            return True
        return False

    def heartbeat(
        self,
        worker_id: str,
        instance: str,
        stats: master_pb2.WorkerStats,
        now: float,
        draining: bool = False,
    ) -> bool:
        """Refresh a worker; False if it is unknown (it must register again).

        Raises IdConflict when the id is live under another instance token.
        A draining worker leaves the map at once, so clients stop routing to it.
        """
        m = self._bound(worker_id, instance, now)
        if m is None:
            return False
        m.last_seen = now
        m.stats = stats
        if (draining or stats.draining) and not m.draining:
            m.draining = True
            self.version += 1
        return True

    def drain(self, worker_id: str) -> bool:
        """An operator's drain (Master.Drain): the worker leaves the map at once and
        stays a member, draining, as if its heartbeat had said so; True when the map
        changed. NotFound for a worker that is not a member."""
        m = self.members.get(worker_id)
        if m is None:
            raise NotFound(f"no worker {worker_id[:MAX_ID]!r} in the cluster")
        if m.draining:
            return False
        m.draining = True
        self.version += 1
        return True

    def leave(self, worker_id: str, instance: str, now: float) -> bool:
        """Remove a worker; False if unknown. IdConflict for another instance's id."""
        if self._bound(worker_id, instance, now) is None:
            return False
        del self.members[worker_id]
        self.version += 1
        return True

    def live_grpc(self, worker_id: str) -> str:
        """The gRPC address ``worker_id`` registered with, "" if unknown."""
        m = self.members.get(worker_id)
        return m.info.grpc if m is not None else ""

    def evict(self, worker_id: str, grpc_addr: str) -> bool:
        """Drop ``worker_id`` if it is still registered at ``grpc_addr``: the caller
        proved the process there gone (its port refuses connections)."""
        m = self.members.get(worker_id)
        if m is None or m.info.grpc != grpc_addr:
            return False
        del self.members[worker_id]
        self.version += 1
        return True

    def expire(self, now: float, ttl: float | None = None) -> list[str]:
        """Remove workers silent for longer than ``ttl`` (default: the TTL); returns
        their ids."""
        limit = self.ttl if ttl is None else ttl
        dead = [wid for wid, m in self.members.items() if now - m.last_seen > limit]
        for wid in dead:
            del self.members[wid]
        if dead:
            self.version += 1
        return dead

    def ring_note(self, worker_id: str) -> str:
        """How clients' rings bound live member ``worker_id``, in one sentence for
        the log; "" when it gets the ring points its capacity asks for."""
        m = self.members.get(worker_id)
        if m is None or m.draining:
            return ""
        share_binds = vnode_count(m.info.capacity_bytes, self.vnodes_per_gib) > (
            MAX_WORKER_SHARE * MIN_VNODES
        )
        if not share_binds and self._scale_noted:
            return ""  # neither bound can say anything new (O(1) for most joins)
        live = [x.info for x in self.members.values() if not x.draining]
        at = next(i for i, w in enumerate(live) if w.id == worker_id)
        wanted = wanted_counts([w.capacity_bytes for w in live], self.vnodes_per_gib)
        want, got = int(wanted[at]), int(bound_counts(wanted)[at])
        if got >= want:
            return ""
        if want > share_cap(wanted):
            return (
                f"worker {worker_id} registers {live[at].capacity_bytes} bytes ({want} ring "
                f"points), more than {MAX_WORKER_SHARE}x the median worker: clients give it "
                f"{got} points"
            )
        if self._scale_noted:
            return ""  # said once: every later join is scaled alike
        self._scale_noted = True
        return (
            f"the ring of {len(live)} workers would exceed {MAX_RING_POINTS} points: clients "
            f"scale every worker's points down ({want} -> {got} for {worker_id}); a lower "
            "--vnodes-per-gib keeps the capacity proportions exact"
        )

    def shard_map(self) -> master_pb2.ShardMap:
        live = [m.info for _, m in sorted(self.members.items()) if not m.draining]
        return master_pb2.ShardMap(
            version=self.version,
            workers=live,
            vnodes_per_gib=self.vnodes_per_gib,
            replicas=self.replicas,
            cluster_id=self.cluster_id,
        )
