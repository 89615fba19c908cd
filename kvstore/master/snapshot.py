"""How the master's state is laid out in etcd, as pure functions without I/O.

Keys live under ``/kvstore/<cluster>/``:

- ``leader``: the address of the leading master, on its etcd lease (JSON
  ``{"grpc": "host:port"}``); it vanishes with the lease when the leader dies.
- ``map_version``: the shard map's version, a decimal number.
- ``workers/<id>``: one serialized ``master_pb2.StoredWorker`` per known worker
  (its ``WorkerInfo``, in ``stats.draining`` whether it drains, and the instance
  token its registration is bound to, so a new leader keeps refusing takeovers).
  It is wire-compatible with the ``WorkerStatus`` older masters wrote; such an
  entry has no token and is bound by the worker's next heartbeat.

Heartbeat times and worker stats are not stored: they change every few seconds
and a new leader gives every worker a fresh TTL instead. The leader computes
the keys its membership should have (:func:`encode`), writes only the
difference to what etcd holds (:func:`diff`), and standbys rebuild the map from
the keys they watch (:func:`decode`, :func:`restore`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from kvstore_client.proto import master_pb2
from kvstore_client.sharding import DEFAULT_VNODES_PER_GIB

from .membership import Member, Membership


@dataclass(frozen=True, slots=True)
class Layout:
    """The etcd keys of one cluster (``cluster_id``)."""

    cluster: str

    @property
    def prefix(self) -> bytes:
        """Every key of this cluster starts with this."""
        return f"/kvstore/{self.cluster}/".encode()

    @property
    def leader_key(self) -> bytes:
        return self.prefix + b"leader"

    @property
    def version_key(self) -> bytes:
        return self.prefix + b"map_version"

    @property
    def workers_prefix(self) -> bytes:
        return self.prefix + b"workers/"

    def worker_key(self, worker_id: str) -> bytes:
        return self.workers_prefix + worker_id.encode()

    def is_state_key(self, key: bytes) -> bool:
        """True for the keys that make up the persisted membership (not the leader key)."""
        return key == self.version_key or key.startswith(self.workers_prefix)


def prefix_end(prefix: bytes) -> bytes:
    """etcd's ``range_end`` that selects every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\x00"  # every key


@dataclass(slots=True)
class Snapshot:
    """Persisted membership: the map version and, per worker id, (info, draining,
    instance token)."""

    version: int = 0
    workers: dict[str, tuple[master_pb2.WorkerInfo, bool, str]] = field(default_factory=dict)


def encode(layout: Layout, m: Membership) -> dict[bytes, bytes]:
    """The keys and values that represent ``m`` in etcd."""
    out: dict[bytes, bytes] = {}
    for wid, mem in m.members.items():
        st = master_pb2.StoredWorker(
            info=mem.info,
            stats=master_pb2.WorkerStats(draining=mem.draining),
            instance=mem.instance,
        )
        out[layout.worker_key(wid)] = st.SerializeToString(deterministic=True)
    out[layout.version_key] = str(m.version).encode()
    return out


def decode(layout: Layout, kvs: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]]) -> Snapshot:
    """Rebuild a snapshot from etcd's keys; foreign or corrupt values are skipped."""
    items = kvs.items() if isinstance(kvs, Mapping) else kvs
    snap = Snapshot()
    for key, value in items:
        if key == layout.version_key:
            try:
                snap.version = int(value.decode())
            except (UnicodeDecodeError, ValueError):
                continue
        elif key.startswith(layout.workers_prefix):
            st = master_pb2.StoredWorker()
            try:
                st.ParseFromString(value)
            except DecodeError:
                continue
            wid = key[len(layout.workers_prefix) :].decode(errors="replace")
            if st.info.id == wid:
                snap.workers[wid] = (st.info, st.stats.draining, st.instance)
    return snap


def diff(
    old: Mapping[bytes, bytes], new: Mapping[bytes, bytes], version_key: bytes
) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """Puts and deletes that turn ``old`` into ``new``.

    The version key, when it changed, is the last put, so a writer that splits
    the operations into several transactions writes it last and a reader that
    rebuilds the map on version changes sees every worker key of that version.
    """
    puts = [(k, v) for k, v in sorted(new.items()) if old.get(k) != v and k != version_key]
    deletes = sorted(k for k in old if k not in new)
    if version_key in new and old.get(version_key) != new[version_key]:
        puts.append((version_key, new[version_key]))
    return puts, deletes


def restore(
    snap: Snapshot,
    *,
    ttl: float,
    replicas: int,
    cluster_id: str,
    now: float,
    vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB,
) -> Membership:
    """A Membership holding the snapshot's workers, each seen at ``now`` (a fresh TTL)."""
    m = Membership(ttl, replicas=replicas, cluster_id=cluster_id, vnodes_per_gib=vnodes_per_gib)
    for wid, (info, draining, instance) in snap.workers.items():
        m.members[wid] = Member(info, now, draining=draining, instance=instance)
    m.version = max(1, snap.version)
    return m


def encode_leader(address: str) -> bytes:
    return json.dumps({"grpc": address}).encode()


def decode_leader(value: bytes) -> str:
    """The leader's gRPC address, or "" when the value is not one of ours."""
    try:
        data = json.loads(value)
    except ValueError:
        return ""
    addr = data.get("grpc") if isinstance(data, dict) else None
    return addr if isinstance(addr, str) else ""
