"""The pause model (worker/pauses.py) and the orders in which retained sessions give
way (tiers/retention.py): per-session (the default), expected and recent."""

from __future__ import annotations

import pytest

from kvstore.worker.pauses import PauseModel
from kvstore.worker.sessions import SessionTable
from kvstore.worker.tiers.policy import EvictFirst, NeedDramRoom, Release, SessionHint, TierPolicy
from kvstore.worker.tiers.retention import REORDER_S, Retention
from tests.helpers import key

NS = "m/bf16/b16/tp0of1"


def ks(name: str, n: int) -> tuple[bytes, ...]:
    return tuple(key(i, name) for i in range(n))


def test_remaining_is_the_mean_further_pause_of_longer_pauses() -> None:
    m = PauseModel(min_samples=4)
    for x in (1.0, 1.0, 1.0, 10.0):
        assert not m.ready
        m.observe(x)
    assert m.ready and len(m) == 4
    assert m.remaining(0.0) == pytest.approx(13 / 4)
    # away 2 s: only the long pause is left in the running
    assert m.remaining(2.0) == pytest.approx(8.0)
    assert m.remaining(9.5) == pytest.approx(0.5)
    # past every pause seen: as long again as it has been away
    assert m.remaining(12.0) == pytest.approx(12.0)


def test_the_window_forgets_the_oldest_pauses() -> None:
    m = PauseModel(window=3, min_samples=1)
    for x in (100.0, 1.0, 2.0, 3.0):
        m.observe(x)
    assert len(m) == 3
    assert m.remaining(0.0) == pytest.approx(2.0), "100 s left the window"
    m.observe(float("nan"))
    m.observe(-5.0)  # a clock step back counts as no pause
    assert len(m) == 3 and m.remaining(0.0) == pytest.approx(2.5), "1 s left; 0 s is no longer"


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError):
        PauseModel(window=0)


def test_the_table_learns_pauses_from_paused_to_active() -> None:
    t = SessionTable()
    t.hint(NS, "s", "active", ks("s", 2), now=0.0)
    t.hint(NS, "s", "paused", now=1.0)
    t.hint(NS, "s", "active", now=4.5)
    t.hint(NS, "s", "active", now=5.0)  # no pause in between: not one
    t.hint(NS, "s", "paused", now=6.0)
    t.lookup(NS, ks("s", 2), now=6.25)  # a lookup resumes it: the pause ends there
    t.hint(NS, "s", "active", now=7.0)
    assert sorted(t.pauses._sorted) == [0.25, 3.5]


def _policy(order: str) -> TierPolicy:
    dram = {(NS, k): 100 for n in "abc" for k in ks(n, 2)}
    return TierPolicy(
        has_ssd=False,
        in_dram=lambda ns, k: (ns, k) in dram,
        dram_size=lambda ns, k: dram.get((ns, k), 0),
        sessions=SessionTable(paused_ttl=300),
        retain_budget=10_000,
        session_order=order,
    )


def _agents(p: TierPolicy) -> None:
    """Pauses seen: mostly 1 s, a few 20 s. Then a pauses at t=100, b at t=103 and c
    at t=105.5: at t=106, a has been away 6 s (so it is on a long pause, about 14 s
    more), b 3 s (the same) and c half a second (most likely back in another half)."""
    model = p.sessions.pauses
    for x in [1.0] * 12 + [20.0] * 4:
        model.observe(x)
    for sid, at in (("sa", 100.0), ("sb", 103.0), ("sc", 105.5)):
        p.handle(SessionHint(NS, sid, "active", ks(sid[1], 2), None, at - 1))
        p.handle(SessionHint(NS, sid, "paused", (), None, at))


def test_paused_sessions_give_way_expected_back_last_first() -> None:
    p = _policy("expected")
    _agents(p)
    a, b, c = ks("a", 2), ks("b", 2), ks("c", 2)
    # a and b are both on a long pause; a is due back sooner (14 s against 17 s)
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, b), EvictFirst(NS, b)]
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, a), EvictFirst(NS, a)]
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, c), EvictFirst(NS, c)]


def test_recent_order_and_a_cold_model_give_way_most_recently_paused_first() -> None:
    for order, learnt in (("recent", True), ("expected", False)):
        p = _policy(order)
        if learnt:
            _agents(p)
        else:
            for sid, at in (("sa", 100.0), ("sb", 103.0), ("sc", 105.5)):
                p.handle(SessionHint(NS, sid, "active", ks(sid[1], 2), None, at - 1))
                p.handle(SessionHint(NS, sid, "paused", (), None, at))
            assert not p.sessions.pauses.ready
        c = ks("c", 2)
        assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, c), EvictFirst(NS, c)]


def test_without_a_clock_the_last_hint_is_now() -> None:
    p = _policy("expected")
    _agents(p)  # the last hint came at t=105.5
    # a is 5.5 s away (14.5 s more), b 2.5 s (17.5 s more), c 0 s (5.75 s on average)
    b = ks("b", 2)
    assert p.handle(NeedDramRoom(200)) == [Release(NS, b), EvictFirst(NS, b)]


def test_a_running_session_gives_way_before_any_paused_one() -> None:
    """With the expected order, its turn has read its prefix, so it goes first
    whatever the paused sessions' expected returns."""
    p = _policy("expected")
    _agents(p)
    a, b, c = ks("a", 2), ks("b", 2), ks("c", 2)
    p.handle(SessionHint(NS, "sa", "active", (), None, 105.8))  # a's next turn runs
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, a), EvictFirst(NS, a)]
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, b), EvictFirst(NS, b)]
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, c), EvictFirst(NS, c)]


def test_median_weighs_a_sessions_own_pauses_against_the_seen_ones() -> None:
    m = PauseModel(min_samples=4)
    for x in (1.0, 1.0, 1.0, 10.0):
        m.observe(x)  # each weighs 2 / 4
    # none of its own: the seen pauses' median
    assert m.median(0.0) == pytest.approx(1.0)
    # three of 8 s (weighing 3) outweigh the seen ones (2)
    assert m.median(0.0, (8.0, 8.0, 8.0)) == pytest.approx(8.0)
    # one of 8 s (1) does not: the seen 1 s pauses weigh 1.5 of 3
    assert m.median(0.0, (8.0,)) == pytest.approx(1.0)
    # a session usually back within 2 s that once took 9: most likely back within 2
    assert m.median(0.0, (2.0, 2.0, 9.0)) == pytest.approx(2.0)
    # away 3 s: its 9 s pause (6 s more) and the seen 10 s one (7 s more, weighing 0.5)
    assert m.median(3.0, (2.0, 2.0, 9.0)) == pytest.approx(6.0)
    # past every pause, its own and the seen ones: as long again as it has been away
    assert m.median(12.0, (8.0,)) == pytest.approx(12.0)


def test_a_session_keeps_its_last_pauses() -> None:
    t = SessionTable()
    t.hint(NS, "s", "active", ks("s", 2), now=0.0)
    for i in range(10):
        t.hint(NS, "s", "paused", now=10.0 * i + 1)
        t.hint(NS, "s", "active", now=10.0 * i + 1 + i)
    assert t.sessions[(NS, "s")].pauses == tuple(float(i) for i in range(2, 10))


def _fast_and_slow(p: TierPolicy) -> None:
    """Sessions a (pauses of 1 s) and b (20 s), each with three pauses of its own,
    among seen pauses mostly 1 s and a few 20 s; b pauses at t=100, a's turn runs
    from t=105."""
    model = p.sessions.pauses
    for x in [1.0] * 12 + [20.0] * 4:
        model.observe(x)
    for sid, pause in (("sa", 1.0), ("sb", 20.0)):
        t = 0.0
        p.handle(SessionHint(NS, sid, "active", ks(sid[1], 2), None, t))
        for _ in range(3):
            p.handle(SessionHint(NS, sid, "paused", (), None, t + 0.5))
            t += 0.5 + pause
            p.handle(SessionHint(NS, sid, "active", (), None, t))
    p.handle(SessionHint(NS, "sb", "paused", (), None, 100.0))
    p.handle(SessionHint(NS, "sa", "active", (), None, 105.0))


def test_per_session_order_keeps_a_running_session_that_is_soon_back() -> None:
    p = _policy("per-session")
    _fast_and_slow(p)
    assert p.sessions.sessions[(NS, "sa")].pauses == (1.0, 1.0, 1.0)
    a, b = ks("a", 2), ks("b", 2)
    # b, 6 s into a pause of its usual 20 s, is back after a's next 1 s pause
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, b), EvictFirst(NS, b)]
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, a), EvictFirst(NS, a)]


def test_per_session_order_lets_a_slow_running_session_go_first() -> None:
    p = _policy("per-session")
    _fast_and_slow(p)
    p.handle(SessionHint(NS, "sa", "paused", (), None, 105.5))
    p.handle(SessionHint(NS, "sb", "active", (), None, 106.0))  # b back early, running
    a, b = ks("a", 2), ks("b", 2)
    assert p.handle(NeedDramRoom(200, now=106.2)) == [Release(NS, b), EvictFirst(NS, b)]
    assert p.handle(NeedDramRoom(200, now=106.2)) == [Release(NS, a), EvictFirst(NS, a)]


def test_expected_order_lets_the_running_session_go_first() -> None:
    p = _policy("expected")
    _fast_and_slow(p)
    a = ks("a", 2)
    assert p.handle(NeedDramRoom(200, now=106.0)) == [Release(NS, a), EvictFirst(NS, a)]


def test_the_default_order_is_per_session() -> None:
    assert TierPolicy(has_ssd=False).retention.order == "per-session"


class _Counting(PauseModel):
    """A pause model that counts the medians it works out."""

    calls = 0

    def median(self, elapsed: float, own: tuple[float, ...] = (), prior: float = 2.0) -> float:
        self.calls += 1
        return super().median(elapsed, own, prior)


def _many(n: int) -> tuple[SessionTable, Retention, Retention]:
    """n sessions, session i pausing for about i % 7 + 1 s, all paused at t=100 - i/10,
    each holding one retained block in two Retentions (the one under test, and a
    second to work the order out from scratch)."""
    t = SessionTable(paused_ttl=300)
    t.pauses = _Counting()
    for x in [1.0] * 12 + [20.0] * 4:
        t.pauses.observe(x)
    kept, fresh = Retention(1 << 30), Retention(1 << 30)
    for i in range(n):
        name, pause, at = f"s{i}", float(i % 7 + 1), 0.0
        t.hint(NS, name, "active", ks(name, 1), now=at)
        for _ in range(3):
            t.hint(NS, name, "paused", now=at + 0.5)
            at += 0.5 + pause
            t.hint(NS, name, "active", now=at)
        t.hint(NS, name, "paused", now=100.0 - i / 10)
        for r in (kept, fresh):
            r.keep((NS, ks(name, 1)[0]), 100, (NS, name))
    return t, kept, fresh


def test_per_session_ranks_are_reused_until_a_hint_or_reorder_s() -> None:
    """A hint while DRAM is full ranks the hinted session again, not every session;
    past REORDER_S every rank is worked out again, and the order is then the one a
    Retention with nothing cached gives."""
    t, kept, fresh = _many(40)
    assert isinstance(t.pauses, _Counting)
    first = [s.name for s in kept._order(t, 101.0)]
    assert t.pauses.calls == 40
    assert first == [s.name for s in fresh._order(t, 101.0)]
    # s39 pauses 5 s (i % 7 + 1) and has been away 4.9 s: due back, it goes last.
    # Back and running, it is ranked again at once: its next pause is 5 s away.
    assert first.index("s39") == 39
    t.hint(NS, "s39", "active", now=101.1)
    t.pauses.calls = 0
    again = [s.name for s in kept._order(t, 101.1)]
    assert t.pauses.calls == 1, "only the hinted session was ranked again"
    assert [n for n in again if n != "s39"] == [n for n in first if n != "s39"]
    assert again.index("s39") < 39
    assert again.index("s39") == [s.name for s in fresh._order(t, 101.1)].index("s39")
    t.pauses.calls = 0
    later = [s.name for s in kept._order(t, 101.2 + REORDER_S)]
    assert t.pauses.calls == 40
    assert later == [s.name for s in fresh._order(t, 101.2 + REORDER_S)]
    # a session that left holds nothing: forgotten with its rank
    kept.drop((NS, ks("s0", 1)[0]))
    assert "s0" not in [s.name for s in kept._order(t, 101.3 + REORDER_S)]
    assert t.sessions[(NS, "s0")].sid not in kept._ranks
