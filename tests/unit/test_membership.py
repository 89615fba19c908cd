"""Master membership state machine: joins, heartbeats, expiry, drain, versions."""

from __future__ import annotations

from kvstore.master.membership import Membership
from kvstore_client.proto import master_pb2


def info(i: str) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(id=i, grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1)


def test_join_heartbeat_expire() -> None:
    m = Membership(ttl=10)
    v0 = m.version
    assert m.register(info("a"), now=0)
    assert m.register(info("b"), now=0)
    assert not m.register(info("a"), now=1), "re-registering the same info changes nothing"
    assert m.version == v0 + 2
    assert m.heartbeat("a", master_pb2.WorkerStats(keys=5), now=9)
    assert m.expire(now=10.5) == ["b"]
    assert [w.id for w in m.shard_map().workers] == ["a"]
    assert m.version == v0 + 3
    assert not m.heartbeat("b", master_pb2.WorkerStats(), now=11), "expired: must re-register"


def test_draining_worker_leaves_the_map_but_stays_known() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), now=0)
    m.register(info("b"), now=0)
    v = m.version
    assert m.heartbeat("a", master_pb2.WorkerStats(), now=1, draining=True)
    assert m.version == v + 1
    assert [w.id for w in m.shard_map().workers] == ["b"]
    assert m.leave("a") and not m.leave("a")


def test_changed_info_bumps_the_version() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), now=0)
    v = m.version
    moved = info("a")
    moved.endpoints[:] = ["tcp://h:other"]
    assert m.register(moved, now=1)
    assert m.version == v + 1
