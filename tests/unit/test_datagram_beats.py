"""Datagram beats without a network: the codec (kvstore.beatgram), the master's check of
a batch of datagrams (kvstore.master.datagrams), a Beats stream's confirmations and
losses (kvstore.master.beats.BeatSession), and the worker's side
(kvstore.worker.masterlink.DatagramBeats)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore import beatgram, metrics
from kvstore.config import load_config
from kvstore.errors import InvalidArgument
from kvstore.master.beats import BeatSession, survey
from kvstore.master.beatsock import beat_port
from kvstore.master.datagrams import RESULTS, Datagrams
from kvstore.master.membership import Membership
from kvstore.worker.masterlink import DATAGRAM_RETRY_S, DatagramBeats
from kvstore_client.proto import master_pb2

A = "a" * 32
KEY = bytes(range(32))


def info(i: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"w{i}", grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1
    )


def bind(*slots: int, datagrams: bool = True) -> master_pb2.BeatBatch:
    b = master_pb2.BeatBatch()
    for s in slots:
        b.bind.add(slot=s, worker_id=f"w{s}", instance=A, datagrams=datagrams)
    return b


def cluster(n: int = 2, port: int = 7700) -> tuple[Membership, Datagrams, BeatSession]:
    m = Membership(4)
    for i in range(n):
        m.register(info(i), A, 0.0)
    dg = Datagrams(port=port)
    return m, dg, BeatSession(dg)


# ---- the codec -----------------------------------------------------------------


def test_a_datagram_is_32_bytes_and_decodes_to_what_was_encoded() -> None:
    d = beatgram.encode(KEY, 0xDEADBEEF, 1 << 62, beatgram.FLAG_ATTENTION)
    assert len(d) == beatgram.SIZE == 32 and d[:2] == b"KB"
    assert beatgram.decode(d) == (0xDEADBEEF, 1 << 62, beatgram.FLAG_ATTENTION)
    assert beatgram.verify(KEY, d)
    assert not beatgram.verify(bytes(32), d)
    flipped = bytearray(d)
    flipped[9] ^= 1  # the sequence number
    assert not beatgram.verify(KEY, flipped)
    assert beatgram.decode(d[:31]) is None and beatgram.decode(d + b"\0") is None
    assert beatgram.decode(b"XX" + d[2:]) is None
    assert beatgram.decode(d[:2] + b"\x02" + d[3:]) is None  # another version


# ---- the master's check ------------------------------------------------------------


def test_a_valid_datagram_is_a_beat_and_confirms_its_binding() -> None:
    m, dg, s = cluster()
    a = s.handle(m, bind(0, 1), 0.0)
    assert a is not None and [g.slot for g in a.datagrams] == [0, 1]
    g0, g1 = a.datagrams
    assert g0.port == 7700 and len(g0.key) == 32 and g0.key != g1.key
    assert g0.binding != g1.binding
    beats = m.beats
    woken = dg.apply(m, [beatgram.encode(g0.key, g0.binding, 1)], 3.0)
    assert [b.slot for b in woken] == [0]
    assert m.beats == beats + 1 and dg.counts["accepted"] == 1
    assert m.members["w0"].seen == 3.0 and m.members["w1"].seen == 0.0
    p = s.poll(m, 3.0)
    assert p is not None and list(p.datagrams_ok) == [0] and not p.datagrams_lost
    assert s.poll(m, 3.1) is None  # said once
    # only datagrams from now on: the worker stays over many TTLs
    for t in range(1, 40):
        dg.apply(m, [beatgram.encode(g0.key, g0.binding, 1 + t)], 3.0 + t)
        m.tick(3.0 + t)
    assert "w0" in m.members and "w1" not in m.members


def test_wrong_mac_replay_unknown_truncated_and_garbage_are_dropped_and_counted() -> None:
    m, dg, s = cluster()
    a = s.handle(m, bind(0), 0.0)
    assert a is not None
    g = a.datagrams[0]
    good = beatgram.encode(g.key, g.binding, 5)
    rng = random.Random(1)
    garbage = [rng.randbytes(rng.randrange(0, 100)) for _ in range(2000)]
    garbage += [rng.randbytes(32) for _ in range(500)]  # the right size, rubbish inside
    batch = [
        good,
        good,  # replayed
        beatgram.encode(g.key, g.binding, 4),  # older: replayed
        beatgram.encode(bytes(32), g.binding, 6),  # forged
        good[:-1] + bytes([good[-1] ^ 1]),  # forged
        beatgram.encode(g.key, g.binding + 1, 6),  # unknown binding
        good[:20],  # truncated
        memoryview(good + b"x"),  # too long
        *garbage,
    ]
    beats = m.beats
    dg.apply(m, batch, 1.0)
    c = dg.counts
    assert c["accepted"] == 1 and m.beats == beats + 1
    assert c["replayed"] == 2 and c["forged"] >= 2 and c["unknown"] >= 1
    assert sum(c.values()) == len(batch)
    assert c["malformed"] >= 2000  # (rubbish of 32 bytes is unknown, forged or malformed)
    assert set(c) == set(RESULTS) == set(metrics.BEAT_DATAGRAM_RESULTS)


def test_a_datagram_of_a_forgotten_registration_is_told_unknown_on_the_stream() -> None:
    m, dg, s = cluster()
    a = s.handle(m, bind(0), 0.0)
    assert a is not None
    g = a.datagrams[0]
    m.leave("w0", A, 0.5)
    dg.apply(m, [beatgram.encode(g.key, g.binding, 1)], 1.0)
    assert dg.counts["stale"] == 1 and dg.counts["accepted"] == 0
    p = s.poll(m, 1.0)
    assert p is not None and list(p.unknown) == [0]
    assert not dg.bindings and not s.beats_by_datagram


def test_a_confirmed_binding_silent_for_half_a_ttl_is_lost() -> None:
    m, dg, s = cluster()
    a = s.handle(m, bind(0), 0.0)
    assert a is not None
    g = a.datagrams[0]
    dg.apply(m, [beatgram.encode(g.key, g.binding, 1)], 1.0)
    assert s.poll(m, 1.0) is not None  # ok
    assert s.poll(m, 2.9) is None  # < half a TTL (2 s)
    p = s.poll(m, 3.1)
    assert p is not None and list(p.datagrams_lost) == [0]
    assert not dg.bindings  # forgotten: its datagrams are unknown now
    dg.apply(m, [beatgram.encode(g.key, g.binding, 2)], 3.2)
    assert dg.counts["unknown"] == 1
    # the stream's alive slot still beats; a bind asks again and gets a new key
    assert s.handle(m, master_pb2.BeatBatch(alive=[0]), 3.3) is None
    again = s.handle(m, bind(0), 20.0)
    assert again is not None and again.datagrams[0].key != g.key


def test_a_late_drain_does_not_count_its_lateness_as_a_bindings_silence() -> None:
    # A master starved on a loaded host (its drain due at 1.1 runs at 3.6) heard
    # nobody meanwhile: the binding is not lost for it. Before, the drain judged the
    # silence before the tick counted the lateness as deaf time, and lost it.
    m, dg, s = cluster()
    a = s.handle(m, bind(0), 0.0)
    assert a is not None
    g = a.datagrams[0]
    dg.apply(m, [beatgram.encode(g.key, g.binding, 1)], 1.0)
    assert s.poll(m, 1.0) is not None  # ok
    p = s.poll(m, 3.6, late=2.5)
    assert p is None or not p.datagrams_lost
    m.tick(3.6, late=2.5)  # the tick counts it as deaf time
    dg.apply(m, [beatgram.encode(g.key, g.binding, 2)], 3.7)
    p = s.poll(m, 4.0)
    assert p is None or not p.datagrams_lost
    assert dg.events["lost"] == 0
    # silent for half a TTL of listening time after that: lost
    p = s.poll(m, 5.8)
    assert p is not None and list(p.datagrams_lost) == [0]
    assert dg.events == {"granted": 1, "confirmed": 1, "lost": 1, "unheard": 0}


def confirmed_streams(n: int) -> tuple[Membership, Datagrams, list[BeatSession], list[Any]]:
    """``n`` workers, one per stream (one worker per host), each bound for datagrams
    and confirmed at t=1."""
    m = Membership(4)
    for i in range(n):
        m.register(info(i), A, 0.0)
    dg = Datagrams(port=7700)
    ss, gs = [], []
    for i in range(n):
        s = BeatSession(dg)
        a = s.handle(m, bind(i), 0.0)
        assert a is not None
        ss.append(s)
        gs.append(a.datagrams[0])
    dg.apply(m, [beatgram.encode(g.key, g.binding, 1) for g in gs], 1.0)
    for s in ss:
        assert s.poll(m, 1.0) is not None  # ok
    return m, dg, ss, gs


def lost(m: Membership, dg: Datagrams, ss: list[BeatSession], now: float) -> list[int]:
    """Survey, then poll every stream at ``now`` as the master does: who is lost."""
    survey(dg, m, now)
    out = []
    for i, s in enumerate(ss):
        p = s.poll(m, now)
        if p is not None and p.datagrams_lost:
            out.append(i)
    return out


def test_many_bindings_silent_at_once_are_kept_longer() -> None:
    # On a loaded host the senders of all workers stall together (kvstore bench scale
    # --background-load 8: every simulated worker silent 2.5-5 s at once): that is
    # not one worker's UDP path. Before, every binding was lost at half a TTL, beat
    # on its stream again and re-bound: a loss storm every retry period.
    m, dg, ss, gs = confirmed_streams(10)
    assert lost(m, dg, ss, 3.5) == [] and dg.storm  # all silent 2.5 s > half a TTL
    assert lost(m, dg, ss, 6.5) == []  # 5.5 s < a TTL and a half
    # they come back, but for one: silent since the storm, it keeps the storm's
    # limit (a TTL and a half) and is lost then
    dg.apply(m, [beatgram.encode(g.key, g.binding, 2) for g in gs[1:]], 6.6)
    assert lost(m, dg, ss, 6.7) == [] and not dg.storm
    assert lost(m, dg, ss, 7.1) == [0]
    assert dg.events["lost"] == 1
    # a real mass outage (the datagrams never come again): lost after a TTL and a
    # half, while the membership still holds them (the storm), so they reach their
    # streams in time
    assert lost(m, dg, ss, 12.5) == []
    assert lost(m, dg, ss, 12.7) == list(range(1, 10))
    t = m.tick(12.7)
    assert t.expired == [] and len(m.members) == 10


def test_the_stragglers_of_a_storm_are_not_lost_when_the_others_come_back() -> None:
    # The senders come back one after another (kvstore bench scale --background-load 8,
    # HA: 45 bindings lost at the end of a stall, gaps up to 3.5 s): when fewer than
    # the storm fraction are still silent, those are the storm's stragglers, not
    # lost at half a TTL; one that falls silent later is.
    m, dg, ss, gs = confirmed_streams(10)
    assert lost(m, dg, ss, 3.5) == [] and dg.storm
    dg.apply(m, [beatgram.encode(g.key, g.binding, 2) for g in gs[2:]], 3.6)
    assert lost(m, dg, ss, 3.7) == [] and not dg.storm  # 2 silent: not a storm
    dg.apply(m, [beatgram.encode(g.key, g.binding, 3) for g in gs[1:]], 4.5)
    assert lost(m, dg, ss, 5.0) == []  # slot 0: 4 s silent, held
    # slot 1 came back (heard at 4.5): no longer held; silent again for half a TTL
    for t in (5.5, 6.0):
        dg.apply(m, [beatgram.encode(g.key, g.binding, int(2 * t)) for g in gs[2:]], t)
    assert lost(m, dg, ss, 6.6) == [1]
    assert lost(m, dg, ss, 6.9) == []  # slot 0: 5.9 s < a TTL and a half
    assert lost(m, dg, ss, 7.1) == [0]


def test_a_storm_is_seen_before_the_first_of_it_are_lost() -> None:
    # The senders stall at t=1 (kvstore bench scale --background-load 8, single: 34
    # bindings lost when a stall began): their last beats were spread over the
    # interval before, so they pass half a TTL one after another. The master surveys
    # every TTL/10 (0.4 s): it must see the storm before the first pass half a TTL.
    m, dg, ss, gs = confirmed_streams(100)
    for i, g in enumerate(gs):  # the last beats, spread over [0.01, 1.0]
        dg.apply(m, [beatgram.encode(g.key, g.binding, 2)], 0.01 * (i + 1))
    t = 0.84  # surveys at 1.64 (23 silent for 1.4 s) and 2.04 (3 past half a TTL)
    while t < 5.0:
        assert lost(m, dg, ss, t) == [], t
        t = round(t + 0.4, 2)
    assert dg.storm


def test_one_silent_binding_among_many_is_lost_at_half_a_ttl() -> None:
    m, dg, ss, gs = confirmed_streams(10)
    for k in range(2, 5):
        dg.apply(m, [beatgram.encode(g.key, g.binding, k) for g in gs[:8]], float(k))
    assert lost(m, dg, ss, 3.5) == [8, 9]  # two are not a storm (fewer than 3)
    assert not dg.storm


def test_a_binding_whose_datagrams_never_arrive_is_lost_after_a_ttl() -> None:
    m, _dg, s = cluster()
    s.handle(m, bind(0), 0.0)
    for t in (1.0, 2.0, 3.0, 3.9):
        a = s.handle(m, master_pb2.BeatBatch(alive=[0]), t)
        assert a is None or not a.datagrams_lost
    a = s.handle(m, master_pb2.BeatBatch(alive=[0]), 4.1)
    assert a is not None and list(a.datagrams_lost) == [0]
    assert "w0" in m.members


def test_no_grant_without_a_port_or_without_asking_and_the_stream_end_forgets() -> None:
    m, dg, s = cluster(port=0)
    a = s.handle(m, bind(0), 0.0)
    assert a is not None and not a.datagrams
    m, dg, s = cluster()
    a = s.handle(m, bind(0, datagrams=False), 0.0)
    assert a is not None and not a.datagrams
    a = s.handle(m, bind(1), 0.5)
    assert a is not None and len(a.datagrams) == 1 and len(dg.bindings) == 1
    s.close()
    assert not dg.bindings


def test_a_sender_asking_for_attention_gets_an_answer() -> None:
    m, dg, s = cluster()
    a = s.handle(m, bind(0), 0.0)
    assert a is not None
    g = a.datagrams[0]
    dg.apply(m, [beatgram.encode(g.key, g.binding, 1)], 0.5)
    assert s.poll(m, 0.5) is not None
    assert s.poll(m, 0.6) is None
    woken = dg.apply(m, [beatgram.encode(g.key, g.binding, 2, beatgram.FLAG_ATTENTION)], 1.0)
    assert woken and s.poll(m, 1.0) is not None


def test_binding_ids_are_unique_in_a_process() -> None:
    m, dg, _ = cluster()
    ss = [BeatSession(dg) for _ in range(50)]
    for i, s in enumerate(ss):
        s.handle(m, bind(0), float(i) / 100)
    assert len(dg.bindings) == 50


# ---- the worker's side -------------------------------------------------------------


def grant(slot: int = 0) -> master_pb2.BeatAnswer:
    return master_pb2.BeatAnswer(
        datagrams=[master_pb2.DatagramGrant(slot=slot, binding=9, key=KEY, port=7700)]
    )


def test_the_worker_beats_on_both_until_confirmed_then_by_datagram_alone() -> None:
    d = DatagramBeats()
    assert d.ask(0.0) and d.beat() == (True, None)
    d.bound()
    assert d.answer(grant(), 0.0) == "granted"
    on_stream, gram = d.beat()
    assert on_stream and gram is not None and beatgram.decode(gram) == (9, 1, 0)
    assert d.answer(master_pb2.BeatAnswer(datagrams_ok=[0]), 1.0) == "confirmed"
    on_stream, gram = d.beat(attention=True)
    assert not on_stream and gram is not None
    assert beatgram.decode(gram) == (9, 2, beatgram.FLAG_ATTENTION)
    assert beatgram.verify(KEY, gram)


def test_the_worker_returns_to_the_stream_when_lost_and_asks_again_later() -> None:
    d = DatagramBeats()
    d.bound()
    d.answer(grant(), 0.0)
    d.answer(master_pb2.BeatAnswer(datagrams_ok=[0]), 1.0)
    assert d.answer(master_pb2.BeatAnswer(datagrams_lost=[0]), 10.0) == "lost"
    assert d.beat() == (True, None)
    assert not d.rebind_due(10.0 + DATAGRAM_RETRY_S / 2 - 0.1)
    assert not d.ask(10.0)
    assert d.rebind_due(10.0 + DATAGRAM_RETRY_S) and d.ask(10.0 + DATAGRAM_RETRY_S)
    d.bound()
    assert not d.rebind_due(1e9)
    d.answer(grant(), 30.0)
    d.answer(master_pb2.BeatAnswer(datagrams_lost=[0]), 31.0)
    assert d.retry_at is not None and d.retry_at > 31.0 + DATAGRAM_RETRY_S  # backs off


def test_a_worker_with_datagrams_off_never_asks() -> None:
    d = DatagramBeats(enabled=False)
    assert not d.ask(0.0) and not d.rebind_due(1e9)
    assert d.beat() == (True, None)


# ---- configuration -----------------------------------------------------------------


def test_the_beat_port_setting() -> None:
    assert beat_port("", 7700) == 7700
    assert beat_port("0", 7700) == 0
    assert beat_port("7801", 7700) == 7801
    assert beat_port("off", 7700) is None
    assert load_config(environ={}).worker.datagram_beats is False  # opt-in (docs/SCALE.md)
    env = {"KVSTORE_MASTER_BEAT_PORT": "off", "KVSTORE_WORKER_DATAGRAM_BEATS": "true"}
    cfg = load_config(environ=env)
    assert cfg.master.beat_port == "off" and cfg.worker.datagram_beats is True
    for bad in ("70000", "-1", "udp", "1.5"):
        with pytest.raises(InvalidArgument, match="beat-port"):
            load_config(environ={"KVSTORE_MASTER_BEAT_PORT": bad})
