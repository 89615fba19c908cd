"""Liveness judged on what arrived: the membership state machine driven by scripted
events (beats, ticks that ran late, a busy master, a storm of silence), no network.

Every scenario is a script of (time, event) steps against one Membership with a TTL
of 4 s and heartbeats every second, as in `kvstore bench scale`."""

from __future__ import annotations

import pytest

from kvstore.master import membership as mb
from kvstore.master.membership import Member, Membership
from kvstore_client.proto import master_pb2

TOKEN = "t" * 32
TTL = 4.0


def info(i: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=f"w{i:03d}", grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1
    )


def cluster(n: int, ttl: float = TTL) -> tuple[Membership, list[Member]]:
    m = Membership(ttl)
    members = []
    for i in range(n):
        assert m.register(info(i), TOKEN, 0.0)
        bound = m.bind(info(i).id, TOKEN, 0.0)
        assert bound is not None
        members.append(bound)
    return m, members


def run(
    m: Membership,
    beating: list[Member],
    start: float,
    end: float,
    *,
    late: float = 0.0,
    busy: float = 0.0,
    every: float | None = None,
) -> list[str]:
    """From ``start`` to ``end``: the ``beating`` members beat every ``every`` seconds
    (default: the interval the master asks for); the master ticks every TTL/10 plus
    ``late`` (each tick ``late`` seconds late), ``busy`` of a core busy. Returns the
    ids expired meanwhile."""
    expired: list[str] = []
    t, next_beat = start, start
    while t < end - 1e-9:
        t = round(t + TTL / 10 + late, 6)
        while next_beat <= t:
            m.beat_all(beating, next_beat)
            next_beat += every or m.heartbeat_interval
        expired += m.tick(t, late, busy).expired
    return expired


def first_expiry(m: Membership, beating: list[Member], limit: float, **kw: float) -> float:
    """When the first member expires (run in steps of a tick); inf if none by ``limit``."""
    t = 0.0
    while t < limit:
        step = TTL / 10 + kw.get("late", 0.0)
        if run(m, beating, t, t + step, **kw):
            return t + step
        t += step
    return float("inf")


def test_a_silent_worker_expires_after_the_ttl_and_the_rest_stay() -> None:
    m, ws = cluster(20)
    expired = run(m, ws[1:], 0.0, 3.9)
    assert expired == [], "nobody is silent for a TTL yet"
    expired = run(m, ws[1:], 3.9, 4.5)
    assert expired == ["w000"]
    assert len(m.members) == 19
    assert m.beat_all(ws, 5.0) == [0], "its old binding is stale: it must register again"


def test_a_registration_is_not_expired_before_its_first_beat_can_arrive() -> None:
    """Found by the scale bench on a busy host: workers expired during the
    registrations, deaf time 0. A worker beats only once it has read its Register
    answer, and those answers reached the simulated workers up to 7-13 s after the
    master had started their TTL. Now a registration that has not beaten yet is
    dropped only by the hard limit (4 TTLs); once heard, the plain TTL applies."""
    m = Membership(TTL)
    for i in range(40):
        assert m.register(info(i), TOKEN, 0.0)
    early = [m.bind(info(i).id, TOKEN, 0.5) for i in range(36)]
    assert all(early)
    beating = [b for b in early if b is not None]
    assert run(m, beating, 0.0, 12.4) == [], "no first beat yet is not past the TTL"
    late = [m.bind(info(i).id, TOKEN, 12.5) for i in (36, 37)]  # answers that took long
    assert all(late), "a first beat within 4 TTLs keeps the registration"
    gone = run(m, beating + [b for b in late if b is not None], 12.4, 16.5)
    assert gone == ["w038", "w039"], "never beat: gone at the hard limit"
    assert run(m, beating, 16.5, 20.0) == [], "silent since 16.4"
    assert run(m, beating, 20.0, 21.0) == ["w036", "w037"], "once heard, the plain TTL"


def test_a_tick_says_why_each_member_expired() -> None:
    """The master logs each removal with its silence on both clocks and the rule
    that removed it, so an SRE (or a bench) can tell a dead worker from a lagging
    master."""
    m, ws = cluster(20)
    run(m, ws[1:], 0.0, 3.9)
    t = m.tick(4.3)
    assert t.expired == ["w000"] and len(t.why) == 1
    assert t.why[0].startswith("w000 (silent 4.3s listening, 4.3s wall: past the TTL")
    m, ws = cluster(20)
    assert m.tick(16.5, late=16.4).expired == []  # deaf all along: not judged on that
    t = m.tick(16.9)  # heard nothing since: only the wall-clock limit applies
    assert len(t.expired) == 20
    assert all("0.6s listening, 16.9s wall: more than 4 TTLs of wall time" in w for w in t.why)


def test_time_the_master_was_behind_is_nobodys_silence() -> None:
    """The master's loop stalls for 10 s (a CPU-starved host): every beat sent
    meanwhile is still unread. The tick after the stall is 10 s late; nobody expires,
    and the beats read right after it keep everyone."""
    m, ws = cluster(50)
    assert run(m, ws, 0.0, 2.0) == []
    t = m.tick(12.4, late=10.0)  # the loop was stuck from 2.0 to 12.4
    assert t.expired == [] and t.deaf > 9.9
    assert t.overloaded, "a master that was deaf says so"
    assert m.beat_all(ws, 12.41) == [], "the backlog is read: everyone is still bound"
    assert run(m, ws, 12.4, 20.0) == []
    assert len(m.members) == 50


def test_a_dead_worker_still_expires_while_the_master_lags_all_the_time() -> None:
    """Every tick runs 0.3 s late (a master that keeps falling behind): the dead
    worker's silence counts only the time the master listened, so it goes later than
    a TTL, but it goes; the live ones stay."""
    m, ws = cluster(20)
    at = first_expiry(m, ws[1:], 30.0, late=0.3)
    assert TTL + 1.0 < at < mb.MAX_SILENCE_TTLS * TTL, f"expired at {at:.1f}s"
    assert set(m.members) == {w.info.id for w in ws[1:]}


def test_the_hard_limit_drops_the_dead_even_when_the_master_hears_almost_nothing() -> None:
    m, ws = cluster(20)
    # every tick 3.6 s late: the listening clock moves 0.48 s in 4 s
    at = first_expiry(m, ws[1:], 60.0, late=3.6)
    assert m.listening(at) < TTL, "not by its listening-time silence"
    limit = mb.MAX_SILENCE_TTLS * TTL
    assert limit < at <= limit + 2 * 4.0, f"dropped at {at:.1f}s of wall-clock silence"
    assert set(m.members) == {w.info.id for w in ws[1:]}


def test_a_storm_of_silence_is_held_not_expired() -> None:
    """Half the workers fall silent at once (the master's network or its host, more
    likely than 50 crashes): they are held for HOLD_TTLS more TTLs, and come back
    without ever leaving the map when their beats arrive again."""
    m, ws = cluster(100)
    v = m.version
    assert run(m, ws[50:], 0.0, 6.0) == []
    t = m.tick(6.0)
    assert t.held == 50 and t.overloaded
    assert m.version == v, "the map did not change"
    assert m.beat_all(ws, 7.0) == [], "all of them are still bound"
    assert run(m, ws, 7.0, 12.0) == []
    assert m.tick(12.0).held == 0


def test_a_storm_that_lasts_expires_after_the_hold() -> None:
    m, ws = cluster(100)
    expired = run(m, ws[50:], 0.0, (1 + mb.HOLD_TTLS) * TTL)
    assert expired == [], "held up to (1 + HOLD_TTLS) TTLs"
    expired = run(m, ws[50:], (1 + mb.HOLD_TTLS) * TTL, 14.0)
    assert sorted(expired) == [w.info.id for w in ws[:50]]


def test_a_storm_whose_members_fall_silent_a_moment_apart_is_held_from_its_first() -> None:
    """Ten of twenty go silent within less than half a TTL (beats sent in turn by a
    loaded host, a network that fails link by link): the first two past the TTL are
    part of the storm, held with the others, not expired before the rest are counted."""
    m, ws = cluster(20)
    assert run(m, ws[:10] + ws[12:], 0.0, 1.5) == []  # w10, w11 silent from 0
    assert run(m, ws[:10], 1.5, 8.0) == [], "held from the first"
    expired = run(m, ws[:10], 8.0, 17.0)
    assert sorted(expired) == [w.info.id for w in ws[10:]], "and expired after the hold"


def test_a_few_silent_workers_are_not_a_storm() -> None:
    """1% (the bench's failure phase) expires after one TTL as usual."""
    m, ws = cluster(200)
    expired = run(m, ws[2:], 0.0, 4.5)
    assert sorted(expired) == ["w000", "w001"]


def test_a_busy_master_that_is_behind_asks_for_slower_beats_and_stretches_the_ttl() -> None:
    m, ws = cluster(10)
    assert m.heartbeat_interval == 1.0
    # ticks 0.5 s late while the master burns 90% of a core; the workers obey the
    # interval it asks for, and nobody expires
    assert run(m, ws, 0.0, 6.0, late=0.5, busy=0.9) == []
    assert m.pace >= 2 and m.heartbeat_interval == m.pace * 1.0
    assert m.ttl_now == TTL * m.pace, "the TTL stretched with the pace"
    assert run(m, ws, 6.0, 40.0, late=0.5, busy=0.9) == []
    assert m.pace == mb.MAX_PACE
    assert m.tick(40.5, 0.5, 0.9).overloaded


def test_a_starved_master_does_not_shed() -> None:
    """Late but idle (its neighbours have the CPU): fewer beats would not help it;
    its lateness is already nobody's silence."""
    m, ws = cluster(10)
    run(m, ws, 0.0, 12.0, late=0.5, busy=0.05)
    assert m.pace == 1.0 and m.heartbeat_interval == 1.0
    assert len(m.members) == 10


def test_the_pace_comes_back_and_the_ttl_shrinks_only_after_the_workers_heard() -> None:
    m, ws = cluster(10)
    run(m, ws, 0.0, 12.0, late=0.5, busy=0.9)
    high = m.pace
    assert high == mb.MAX_PACE
    # the master recovers: on-time ticks, idle
    t = 12.0
    while m.pace == high:
        t = round(t + 0.4, 6)
        m.beat_all(ws, t)
        assert not m.tick(t).expired
    lowered_at = t
    assert m.pace == high / 2
    assert m.ttl_now == TTL * high, "the old TTL holds while workers may still beat slowly"
    # one worker keeps the old interval for most of the old TTL: still not expired
    slow, last = ws[0], lowered_at
    while t < lowered_at + TTL * high - 0.4:
        t = round(t + 0.4, 6)
        if t - last >= TTL * high - 1.0:
            m.beat(slow, t)
            last = t
        m.beat_all(ws[1:], t)
        assert m.tick(t).expired == []
    m.beat(slow, t)
    assert run(m, ws, t, t + 30.0) == []
    assert m.pace == 1.0 and m.heartbeat_interval == 1.0 and m.ttl_now == TTL
    assert not m.tick(t + 30.4).overloaded


def test_a_new_leaders_grace_holds_everyone_for_its_length() -> None:
    m, ws = cluster(2)  # fewer than a storm
    m.grace(0.0, 2 * TTL)
    assert run(m, [], 0.0, 2 * TTL - 0.4) == [], "nobody expires within the grace"
    assert sorted(run(m, [], 2 * TTL - 0.4, 2 * TTL + 1.0)) == [w.info.id for w in ws]


def test_late_beats_count_when_they_are_read() -> None:
    """A beat the master reads 3 s after it was sent (it queued while the master
    was behind) still counts: liveness is judged on what arrived, when it arrived."""
    m, ws = cluster(3)
    run(m, ws, 0.0, 2.0)
    m.tick(5.4, late=3.0)
    assert m.beat_all(ws, 5.45) == []
    assert run(m, [], 5.4, 5.4 + TTL - 0.1) == []


@pytest.mark.parametrize("n", [1, 2])
def test_storm_needs_a_minimum_count(n: int) -> None:
    m, ws = cluster(n)
    assert sorted(run(m, [], 0.0, 4.5)) == [w.info.id for w in ws]
