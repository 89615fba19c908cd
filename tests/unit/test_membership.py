"""Master membership state machine: joins, heartbeats, expiry, drain, versions, and the
instance token that binds a live worker id to the process that registered it."""

from __future__ import annotations

import pytest

from kvstore.master import membership as mb
from kvstore.master.membership import IdConflict, Membership
from kvstore_client.errors import InvalidArgument, ResourceExhausted
from kvstore_client.proto import master_pb2

A = "a" * 32  # instance tokens
B = "b" * 32


def info(i: str) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(id=i, grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1)


def test_join_heartbeat_expire() -> None:
    m = Membership(ttl=10)
    v0 = m.version
    assert m.register(info("a"), A, now=0)
    assert m.register(info("b"), B, now=0)
    assert not m.register(info("a"), A, now=1), "re-registering the same info changes nothing"
    assert m.version == v0 + 2
    assert m.heartbeat("a", A, master_pb2.WorkerStats(keys=5), now=9)
    assert m.expire(now=10.5) == [], "b has not beaten yet: only the hard limit drops it"
    for t in (19, 29, 39):
        assert m.heartbeat("a", A, master_pb2.WorkerStats(keys=5), now=t)
    assert m.expire(now=40.5) == ["b"]
    assert [w.id for w in m.shard_map().workers] == ["a"]
    assert m.version == v0 + 3
    assert not m.heartbeat("b", B, master_pb2.WorkerStats(), now=41), "expired: must re-register"


def test_draining_worker_leaves_the_map_but_stays_known() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), A, now=0)
    m.register(info("b"), B, now=0)
    v = m.version
    assert m.heartbeat("a", A, master_pb2.WorkerStats(), now=1, draining=True)
    assert m.version == v + 1
    assert [w.id for w in m.shard_map().workers] == ["b"]
    assert m.leave("a", A, now=1) and not m.leave("a", A, now=1)


def test_changed_info_bumps_the_version() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), A, now=0)
    v = m.version
    moved = info("a")
    moved.endpoints[:] = ["tcp://h:other"]
    assert m.register(moved, A, now=1)
    assert m.version == v + 1


def test_a_live_id_cannot_be_taken_over_by_another_instance() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), A, now=0)
    v = m.version
    thief = info("a")
    thief.grpc = "evil:1"
    thief.endpoints[:] = ["tcp://evil:1"]
    with pytest.raises(IdConflict, match="another live instance"):
        m.register(thief, B, now=5)
    assert m.shard_map().workers[0].grpc == "h:a", "traffic still goes to the first instance"
    assert m.version == v


def test_wrong_token_heartbeat_and_leave_change_nothing() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), A, now=0)
    v = m.version
    with pytest.raises(IdConflict):
        m.heartbeat("a", B, master_pb2.WorkerStats(draining=True), now=1, draining=True)
    with pytest.raises(IdConflict):
        m.leave("a", B, now=1)
    assert [w.id for w in m.shard_map().workers] == ["a"] and m.version == v
    assert m.members["a"].seen == 0, "a refused heartbeat does not keep the id alive"
    assert m.heartbeat("a", A, master_pb2.WorkerStats(), now=2)


def test_an_expired_id_may_be_registered_by_a_new_instance() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), A, now=0)
    assert m.heartbeat("a", A, master_pb2.WorkerStats(), now=0)  # beating: the plain TTL
    with pytest.raises(IdConflict):
        m.register(info("a"), B, now=10)  # exactly at the TTL: still live
    # past the TTL, before the expiry sweep ran: the new instance takes the id
    assert m.register(info("a"), B, now=10.5) or m.members["a"].instance == B
    assert m.members["a"].instance == B
    with pytest.raises(IdConflict):
        m.heartbeat("a", A, master_pb2.WorkerStats(), now=11)
    # after a Leave, too
    assert m.leave("a", B, now=11)
    assert m.register(info("a"), A, now=11)


def test_evict_only_the_registration_that_was_probed() -> None:
    m = Membership(ttl=10)
    m.register(info("a"), A, now=0)
    assert m.live_grpc("a") == "h:a" and m.live_grpc("zz") == ""
    assert not m.evict("a", "h:other"), "the id moved on since the probe"
    assert m.evict("a", "h:a")
    assert m.register(info("a"), B, now=1)


def test_a_member_restored_without_a_token_is_bound_by_its_next_contact() -> None:
    m = Membership(ttl=10)
    m.members["a"] = mb.Member(info("a"), 0)  # persisted by an older master
    assert m.heartbeat("a", A, master_pb2.WorkerStats(), now=1)
    with pytest.raises(IdConflict):
        m.heartbeat("a", B, master_pb2.WorkerStats(), now=2)


@pytest.mark.parametrize(
    ("field", "value", "msg"),
    [
        ("id", "x" * (mb.MAX_ID + 1), "id of"),
        ("id", "a\nb", "printable"),
        ("grpc", "h:" + "1" * mb.MAX_GRPC, "grpc address"),
        ("host_id", "h" * (mb.MAX_HOST_ID + 1), "host_id"),
        ("version", "v" * (mb.MAX_VERSION + 1), "version"),
    ],
)
def test_oversized_fields_are_invalid(field: str, value: str, msg: str) -> None:
    m = Membership(ttl=10)
    w = info("a")
    setattr(w, field, value)
    with pytest.raises(InvalidArgument, match=msg):
        m.register(w, A, now=0)
    assert not m.members


def test_endpoint_count_and_length_limits() -> None:
    m = Membership(ttl=10)
    w = info("a")
    w.endpoints[:] = [f"tcp://h:{i}" for i in range(mb.MAX_ENDPOINTS + 1)]
    with pytest.raises(InvalidArgument, match="endpoints exceed"):
        m.register(w, A, now=0)
    w.endpoints[:] = ["tcp://" + "h" * mb.MAX_ENDPOINT]
    with pytest.raises(InvalidArgument, match="endpoint URL"):
        m.register(w, A, now=0)
    w.endpoints[:] = [f"tcp://h:{i}" for i in range(mb.MAX_ENDPOINTS)]
    assert m.register(w, A, now=0)


@pytest.mark.parametrize("token", ["", "short", "x" * (mb.MAX_INSTANCE + 1), "é" * 20])
def test_instance_token_is_required_and_bounded(token: str) -> None:
    with pytest.raises(InvalidArgument, match="instance token"):
        Membership(ttl=10).register(info("a"), token, now=0)


def test_incomplete_registration_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="needs id"):
        Membership(ttl=10).register(master_pb2.WorkerInfo(id="a"), A, now=0)


def test_the_number_of_workers_is_capped_so_the_map_stays_small() -> None:
    m = Membership(ttl=10, max_workers=3)
    for i in range(3):
        m.register(info(f"w{i}"), A, now=0)
    with pytest.raises(ResourceExhausted):
        m.register(info("w3"), A, now=0)
    assert m.register(info("w0"), A, now=1) is False, "a member may still refresh"
    biggest = master_pb2.WorkerInfo(
        id="i" * mb.MAX_ID,
        grpc="g" * mb.MAX_GRPC,
        endpoints=["e" * mb.MAX_ENDPOINT] * mb.MAX_ENDPOINTS,
        capacity_bytes=1 << 60,
        max_value_bytes=1 << 30,
        host_id="h" * mb.MAX_HOST_ID,
        version="v" * mb.MAX_VERSION,
    )
    full = master_pb2.ShardMap(workers=[biggest] * mb.MAX_WORKERS).ByteSize()
    assert full < 4 << 20, "a full map of the largest workers fits gRPC's default 4 MiB"


def test_the_worker_backs_off_and_logs_rarely_while_waiting() -> None:
    from kvstore.worker.masterlink import Backoff, Throttle, new_instance_token

    b = Backoff(first=0.2, cap=5.0)
    assert [b.next() for _ in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    b.reset()
    assert b.next() == 0.2
    t = Throttle(every=30.0)
    assert [t.ready(now) for now in (0, 1, 29.9, 30, 45, 61)] == [
        True, False, False, True, False, True,
    ]  # fmt: skip
    tok = new_instance_token()
    assert len(tok) == 32 and tok != new_instance_token()
    mb.check_instance(tok)
