"""Cluster membership and the shard map, as a state machine without I/O.

Events in (register, heartbeat, leave, tick with the current time), state out
(the map and its version). Every change that clients must see bumps
``version``; the servicer pushes the new map to watchers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore_client.proto import master_pb2
from kvstore_client.sharding import DEFAULT_VNODES_PER_GIB


@dataclass(slots=True)
class Member:
    info: master_pb2.WorkerInfo
    last_seen: float
    stats: master_pb2.WorkerStats = field(default_factory=master_pb2.WorkerStats)
    draining: bool = False


class Membership:
    """Workers that joined and still heartbeat within ``ttl`` seconds."""

    def __init__(self, ttl: float, *, replicas: int = 1, cluster_id: str = "kvstore") -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.ttl = ttl
        self.replicas = replicas
        self.cluster_id = cluster_id
        self.members: dict[str, Member] = {}
        self.version = 1

    @property
    def heartbeat_interval(self) -> float:
        return self.ttl / 4

    def register(self, info: master_pb2.WorkerInfo, now: float) -> bool:
        """Add or refresh a worker; True if the map changed."""
        if not info.id:
            raise ValueError("worker id is empty")
        old = self.members.get(info.id)
        self.members[info.id] = Member(info, now)
        if old is None or old.info != info or old.draining:
            self.version += 1
            return True
        return False

    def heartbeat(
        self, worker_id: str, stats: master_pb2.WorkerStats, now: float, draining: bool = False
    ) -> bool:
        """Refresh a worker; False if it is unknown (it must register again).

        A draining worker leaves the map at once, so clients stop routing to it.
        """
        m = self.members.get(worker_id)
        if m is None:
            return False
        m.last_seen = now
        m.stats = stats
        if (draining or stats.draining) and not m.draining:
            m.draining = True
            self.version += 1
        return True

    def leave(self, worker_id: str) -> bool:
        if self.members.pop(worker_id, None) is None:
            return False
        self.version += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Remove workers silent for longer than the TTL; returns their ids."""
        dead = [wid for wid, m in self.members.items() if now - m.last_seen > self.ttl]
        for wid in dead:
            del self.members[wid]
        if dead:
            self.version += 1
        return dead

    def shard_map(self) -> master_pb2.ShardMap:
        live = [m.info for _, m in sorted(self.members.items()) if not m.draining]
        return master_pb2.ShardMap(
            version=self.version,
            workers=live,
            vnodes_per_gib=DEFAULT_VNODES_PER_GIB,
            replicas=self.replicas,
            cluster_id=self.cluster_id,
        )
