"""`kvstore bench engine --saturate`: the admission of sessions (pure; issue 46).

A discrete-event model of the bench's player drives :class:`Admission` as the player
does (threads there, events here): every request takes ``service`` seconds, a
session pauses ``pause_s`` between its turns, sub-agents start after their fork turn.
"""

from __future__ import annotations

import heapq
import itertools

import pytest

from kvstore_bench.engine.saturate import Admission, PauseClock, goes_idle
from kvstore_bench.engine.workload import Script, Turn


def _script(sid: str, turns: int, pause: float, start: float = 0.0, **kw: object) -> Script:
    ts = tuple(Turn(sid, k, (3, 4, 5), 1, pause if k else 0.0, k % 2) for k in range(turns))
    return Script(sid, start, ts, **kw)  # type: ignore[arg-type]


def simulate(
    scripts: list[Script], target: int, service: float = 1.0
) -> tuple[list[tuple[str, int, float, float]], list[tuple[float, int, int]]]:
    """(requests as (script, turn, start, end), samples of (time, busy, waiting))."""
    adm = Admission(scripts, target)
    by_id = {s.id: s for s in scripts}
    children = {(s.parent, s.after_turn): s for s in scripts if s.parent is not None}
    ev: list[tuple[float, int, str, int, str]] = []  # (time, seq, kind, turn, script)
    seq = 0

    def push(t: float, kind: str, sid: str, k: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, k, sid))

    for s in adm.admit():
        push(0.0, "send", s.id, 0)
    reqs: list[tuple[str, int, float, float]] = []
    samples: list[tuple[float, int, int]] = []
    while ev:
        now, _, kind, k, sid = heapq.heappop(ev)
        s = by_id[sid]
        if kind == "ready":  # a pause ended, or a sub-agent starts
            adm.turn_ready()
            push(now, "send", sid, k)
        elif kind == "send":
            push(now + service, "done", sid, k)
            reqs.append((sid, k, now, now + service))
        else:  # done
            idle = goes_idle(s, k)
            adm.turn_done(idle)
            child = children.get((sid, k))
            if child is not None:
                push(now, "ready", child.id, 0)
            if k + 1 < len(s.turns):  # as the player: only a pause frees the place
                push(now + s.turns[k + 1].pause_s, "ready" if idle else "send", sid, k + 1)
            for n in adm.admit():
                push(now, "send", n.id, 0)
        samples.append((now, adm.busy, adm.waiting))
    return reqs, samples


def test_sessions_fill_each_others_pauses_and_keep_their_own_order() -> None:
    scripts = [_script(f"s{i}", 3, pause=5.0, start=100.0 * i) for i in range(8)]
    reqs, samples = simulate(scripts, target=2)
    assert len(reqs) == 24  # every turn ran once
    for s in scripts:  # a session's turns in order, each after the pause that precedes it
        mine = sorted((r for r in reqs if r[0] == s.id), key=lambda r: r[1])
        assert [r[1] for r in mine] == [0, 1, 2]
        for a, b in itertools.pairwise(mine):
            assert b[2] >= a[3] + 5.0
    # while sessions wait to start, two are always busy (the trace's start times, 100 s
    # apart, are not waited for)
    assert all(busy >= 2 for _, busy, waiting in samples if waiting)
    assert max(r[3] for r in reqs) < 100.0


def test_without_pauses_a_session_keeps_its_slot_and_the_others_wait() -> None:
    scripts = [_script(f"s{i}", 2, pause=0.0) for i in range(4)]
    reqs, _ = simulate(scripts, target=2)
    starts = {(r[0], r[1]): r[2] for r in reqs}
    assert starts[("s0", 1)] == starts[("s1", 1)] == 1.0
    assert starts[("s2", 0)] == starts[("s3", 0)] == 2.0  # room only when s0, s1 ended


def test_a_sub_agent_starts_after_its_fork_turn_and_counts_as_busy() -> None:
    parent = _script("p", 2, pause=3.0)
    child = _script("p/c", 2, pause=0.0, start=50.0, parent="p", after_turn=0)
    other = _script("q", 1, pause=0.0)
    adm = Admission([parent, child, other], 1)
    assert [s.id for s in adm.admit()] == ["p"]  # sub-agents are never admitted
    reqs, _ = simulate([parent, child, other], target=1)
    start = {(r[0], r[1]): r[2] for r in reqs}
    assert start[("p/c", 0)] == 1.0  # right after the fork turn, not at 50 s
    assert start[("p", 1)] >= 1.0 + 3.0


def test_admission_wants_a_session_in_flight() -> None:
    with pytest.raises(ValueError):
        Admission([], 0)


def test_pauses_keep_their_order_and_the_idle_time_between_them_is_skipped() -> None:
    clock = PauseClock(floor=1)
    clock.pause("a", 0.0, 5.0)
    clock.pause("b", 0.0, 3.0)
    assert not clock.due("a", 0.0) and not clock.due("b", 0.0)
    assert clock.skip(0.0, busy=1) == 0.0  # a session is busy: its engine works
    assert clock.skip(0.0, busy=0) == pytest.approx(3.0)  # nobody busy: b's pause ends now
    assert clock.due("b", 0.0) and not clock.due("a", 0.0)
    clock.resume("b")
    assert clock.skip(0.5, busy=1) == 0.0
    assert clock.skip(0.5, busy=0) == pytest.approx(1.5)  # a ends 2 s after b, as paused
    assert clock.due("a", 0.5)
    clock.resume("a")
    assert clock.skip(0.5, busy=0) == 0.0  # no pause left
