"""The master's side of a Beats stream without a network: batches in, membership events
and answers out (kvstore.master.beats.BeatSession)."""

from __future__ import annotations

import pytest

from kvstore.master.beats import MAX_SLOTS, BeatSession
from kvstore.master.membership import Membership
from kvstore_client.errors import InvalidArgument
from kvstore_client.proto import master_pb2

A, B = "a" * 32, "b" * 32


def info(i: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"w{i}", grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1
    )


def bind(*slots: int, token: str = A) -> master_pb2.BeatBatch:
    b = master_pb2.BeatBatch()
    for s in slots:
        b.bind.add(slot=s, worker_id=f"w{s}", instance=token)
    return b


def test_bind_then_alive_slots_keep_workers_and_cost_no_map_work() -> None:
    m = Membership(4)
    for i in range(3):
        m.register(info(i), A, 0.0)
    v = m.version
    s = BeatSession()
    first = s.handle(m, bind(0, 1, 2), 0.5)
    assert first is not None and not first.unknown and first.interval_s == 1.0
    assert first.ttl_s == 4.0
    for t in (1.5, 2.5, 3.5, 4.5, 5.5):
        a = s.handle(m, master_pb2.BeatBatch(alive=[0, 1, 2]), t)
        assert a is None or not a.unknown
    assert m.tick(6.0).expired == []
    assert m.version == v, "beats changed nothing in the map"
    assert m.beats == 3 + 5 * 3
    assert {w.id for w in m.shard_map().workers} == {"w0", "w1", "w2"}


def test_answers_are_sparse_a_sign_of_life_once_per_ttl() -> None:
    m = Membership(4)
    m.register(info(0), A, 0.0)
    s = BeatSession()
    answers = [s.handle(m, bind(0), 0.0)]
    answers += [s.handle(m, master_pb2.BeatBatch(alive=[0]), float(t)) for t in range(1, 13)]
    sent = [a for a in answers if a is not None]
    assert len(sent) == 4, "the first batch, then one per TTL (at 4, 8 and 12 s)"


def test_a_forgotten_worker_is_told_and_bound_again_after_it_registers() -> None:
    m = Membership(4)
    m.register(info(0), A, 0.0)
    m.register(info(1), A, 0.0)
    s = BeatSession()
    s.handle(m, bind(0, 1), 0.0)
    for t in range(1, 6):
        s.handle(m, master_pb2.BeatBatch(alive=[1]), float(t))  # w0 is silent
    assert m.tick(5.0).expired == ["w0"]
    a = s.handle(m, master_pb2.BeatBatch(alive=[0, 1]), 6.0)
    assert a is not None and list(a.unknown) == [0], "only the forgotten slot"
    m.register(info(0), A, 6.5)
    a = s.handle(m, bind(0), 7.0)
    assert a is None or not a.unknown
    assert s.handle(m, master_pb2.BeatBatch(alive=[0, 1]), 8.0) is None
    assert {w.id for w in m.shard_map().workers} == {"w0", "w1"}


def test_a_bind_under_another_token_is_refused_and_the_stream_goes_on() -> None:
    m = Membership(4)
    m.register(info(0), A, 0.0)
    m.register(info(1), A, 0.0)
    s = BeatSession()
    batch = bind(1)
    batch.bind.add(slot=0, worker_id="w0", instance=B)
    a = s.handle(m, batch, 1.0)
    assert a is not None and [r.slot for r in a.refused] == [0]
    r = a.refused[0]
    assert r.code == 9 and "another live instance" in r.message  # FAILED_PRECONDITION
    assert r.ttl_s == 4.0
    assert m.members["w0"].seen == 0.0, "the refused bind kept nothing alive"
    a = s.handle(m, master_pb2.BeatBatch(alive=[0, 1]), 2.0)
    assert a is not None and list(a.unknown) == [0], "slot 0 was never bound here"
    bad = master_pb2.BeatBatch()
    bad.bind.add(slot=3, worker_id="w1", instance="short")
    a = s.handle(m, bad, 2.5)
    assert a is not None and a.refused[0].code == 3  # INVALID_ARGUMENT


def test_slot_numbers_are_bounded() -> None:
    m = Membership(4)
    m.register(info(0), A, 0.0)
    s = BeatSession()
    with pytest.raises(InvalidArgument, match="out of range"):
        s.handle(m, master_pb2.BeatBatch(bind=[master_pb2.BeatBind(slot=MAX_SLOTS)]), 0.0)
    assert not s.slots and m.beats == 0, "nothing of the batch was applied"
    a = s.handle(m, master_pb2.BeatBatch(alive=[5, 1 << 31]), 0.0)
    assert a is not None and list(a.unknown) == [5, 1 << 31], "unbound slots are unknown"


def test_news_drain_and_stats() -> None:
    m = Membership(4)
    m.register(info(0), A, 0.0)
    m.register(info(1), A, 0.0)
    s = BeatSession()
    s.handle(m, bind(0, 1), 0.0)
    v = m.version
    ch = master_pb2.BeatBatch()
    ch.changed.add(slot=0, stats=master_pb2.WorkerStats(keys=42))
    ch.changed.add(slot=1, draining=True)
    s.handle(m, ch, 1.0)
    assert m.members["w0"].stats.keys == 42
    assert m.version == v + 1 and [w.id for w in m.shard_map().workers] == ["w0"]


def test_a_pace_change_is_told_at_once() -> None:
    m = Membership(4)
    m.register(info(0), A, 0.0)
    s = BeatSession()
    s.handle(m, bind(0), 0.0)
    assert s.handle(m, master_pb2.BeatBatch(alive=[0]), 0.5) is None
    m.pace = 2.0  # what a tick decides when the master is busy and behind
    a = s.handle(m, master_pb2.BeatBatch(alive=[0]), 1.0)
    assert a is not None and a.interval_s == 2.0
