"""Sessions in the tier policy, as a pure state machine: hints in, instructions out.

Also the two DRAM primitives the instructions use (retain, make_oldest) and one
BlockStore run on a real arena and LMDB: a paused session survives pressure that
an LRU would evict it under, and comes back into DRAM when it resumes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore.worker.arena import Arena
from kvstore.worker.sessions import SessionTable
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.budgets import Watermarks
from kvstore.worker.tiers.dram import DramTier
from kvstore.worker.tiers.policy import (
    Evicted,
    EvictFirst,
    Lookup,
    NeedDramRoom,
    NeedSsdRoom,
    Prefetch,
    Release,
    Removed,
    Retain,
    SessionHint,
    SessionTick,
    SsdWritten,
    TailFirst,
    TierPolicy,
    WriteSsd,
)
from kvstore.worker.tiers.ssd import SsdStore
from kvstore_client.errors import InvalidArgument
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"
MiB = 1 << 20


def ks(name: str, n: int) -> tuple[bytes, ...]:
    return tuple(key(i, name) for i in range(n))


def policy(dram: dict[tuple[str, bytes], int], budget: int = 1000, **table: int) -> TierPolicy:
    return TierPolicy(
        has_ssd=True,
        ssd_capacity=10_000,
        ssd_marks=Watermarks(0.9, 0.5),
        in_dram=lambda ns, k: (ns, k) in dram,
        dram_size=lambda ns, k: dram.get((ns, k), 0),
        sessions=SessionTable(paused_ttl=30, **table),
        retain_budget=budget,
        ssd_retain_budget=4000,
    )


def hint(p: TierPolicy, sid: str, state: str, keys: tuple[bytes, ...] = (), now: float = 0.0):
    return p.handle(SessionHint(NS, sid, state, keys, None, now))


def test_a_live_session_retains_leading_blocks_within_the_budget() -> None:
    a = ks("a", 4)
    p = policy({(NS, k): 300 for k in a}, budget=700)
    assert hint(p, "s1", "active", a) == [Retain(NS, a[:2])], (
        "an active session's leading blocks retained, up to 700 bytes"
    )
    out = hint(p, "s1", "paused")
    assert out == [TailFirst(NS, tuple(reversed(a)))], "paused: the chain tail first, kept"
    assert p.retained_bytes == 600 and p.counters.retain_refused == 4
    assert p.sessions.is_protected(NS, a[3]), "over-budget blocks stay protected on SSD"


def test_pause_orders_the_whole_chain_tail_first() -> None:
    """Plain LRU evicts a just-used chain from its head, which kills the whole prefix
    match; a paused hint lists the chain (all turns so far) last block first."""
    a, b = ks("a", 3), ks("b", 2)
    p = policy({}, budget=0)
    hint(p, "s1", "active", a)
    hint(p, "s1", "paused", b)
    assert hint(p, "s1", "paused") == [TailFirst(NS, tuple(reversed(a + b)))]
    assert hint(p, "s1", "active", now=1) == []


def test_resume_keeps_the_retained_blocks_and_prefetches_ssd_only_ones() -> None:
    """Bug (old code): a resume released the session's retained blocks to the LRU
    list at once; the engine reads them after its lookup, often after waiting in its
    queue, and meanwhile other requests' writes evicted them (a quarter of the loaded
    blocks failed in the engine bench at a quarter of the working set). They stay
    retained while the turn runs and are released when the session ends."""
    a = ks("a", 3)
    dram = {(NS, a[0]): 100}
    p = policy(dram)
    p.handle(SsdWritten(tuple((NS, k, 100, 120, True) for k in a[1:])))
    hint(p, "s1", "paused", a)
    assert p.retained == {(NS, a[0]): 100}
    out = hint(p, "s1", "active", (), now=1)
    assert out == [Prefetch(NS, a[1:])], "no Release: its turn is running"
    assert p.retained_bytes == 100 and not p.sessions.is_protected(NS, a[1])
    assert hint(p, "s1", "paused", now=2) == [TailFirst(NS, tuple(reversed(a)))]
    assert p.retained_bytes == 100, "paused again: still retained once"
    hint(p, "s1", "active", now=3)
    out = hint(p, "s1", "ended", now=4)
    assert out == [Release(NS, (a[0],)), EvictFirst(NS, a)] and p.retained_bytes == 0


def test_lookup_of_a_paused_sessions_blocks_resumes_it() -> None:
    sys_prompt, a, b = ks("sys", 2), ks("a", 2), ks("b", 2)
    p = policy({})
    p.handle(SsdWritten(tuple((NS, k, 10, 20, True) for k in a)))
    hint(p, "A", "paused", sys_prompt + a)
    hint(p, "B", "paused", sys_prompt + b)
    assert p.handle(Lookup(NS, ks("other", 3), 1.0)) == []
    assert p.handle(Lookup(NS, sys_prompt + ks("c", 2), 1.0)) == [], (
        "a new session's lookup shares only the system prompt: it resumes neither A nor B"
    )
    out = p.handle(Lookup(NS, sys_prompt + a, 1.0))  # A's next turn looks up its chain
    assert out == [Prefetch(NS, a)]
    assert p.sessions.get(NS, "A").state == "active"  # type: ignore[union-attr]
    assert p.sessions.get(NS, "B").state == "paused"  # type: ignore[union-attr]
    assert p.sessions.is_protected(NS, sys_prompt[0]), "B still holds the shared prompt"


def test_ended_session_orphans_only_blocks_no_live_session_holds() -> None:
    shared, a = ks("sys", 2), ks("a", 2)
    p = policy({})
    p.handle(SsdWritten(tuple((NS, k, 10, 20, True) for k in shared + a)))
    hint(p, "A", "active", shared + a)
    hint(p, "B", "active", shared)
    assert hint(p, "A", "ended") == [EvictFirst(NS, a)]
    # SSD evicts them first, the chain's tail (least shareable) before its head.
    assert list(p.ssd.entries)[:2] == [(NS, a[1]), (NS, a[0])]
    assert hint(p, "B", "ended") == [EvictFirst(NS, shared)]
    assert p.sessions.refs == {} and p.sessions.blocks == 0


def test_an_ended_sessions_dram_blocks_are_dropped_not_written_to_ssd() -> None:
    """Before: an ended session's blocks went first, but each eviction wrote them to
    SSD (WriteSsd), pushing live blocks off the SSD for blocks nobody asks for again
    (the concurrent replay lost hit rate with hints)."""
    shared, a = ks("sys", 2), ks("a", 3)
    dram = {(NS, k): 10 for k in shared + a}
    p = policy(dram)
    hint(p, "A", "active", shared + a)
    hint(p, "B", "active", shared)
    hint(p, "A", "ended")
    assert [p.dead(NS, k) for k in shared + a] == [False, False, True, True, True]
    assert p.handle(Evicted(NS, a[0], 10)) == []  # dropped: no SSD copy
    assert p.counters.evicted_lost == 1
    assert p.handle(Evicted(NS, shared[0], 10)) == [WriteSsd(NS, shared[0])]  # B holds it
    # A block listed again by a live session is live again: demoted as usual.
    hint(p, "C", "active", (a[1],))
    assert not p.dead(NS, a[1])
    assert p.handle(Evicted(NS, a[1], 10)) == [WriteSsd(NS, a[1])]
    p.handle(Removed(NS, a[2], True, 10))
    assert p.orphans == set(), "bounded: forgotten when the block leaves DRAM"


def test_store_drops_an_ended_sessions_blocks_instead_of_demoting(tmp_path: Path) -> None:
    arena = Arena(8 * MiB)
    st = BlockStore(
        arena, MiB, ssd=SsdStore(str(tmp_path / "ssd"), 64 * MiB), sessions=SessionTable()
    )
    try:
        done, live = ks("done", 4), ks("live", 4)
        for k in done + live:
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        st.session_hint(NS, "d", "active", done, None)
        st.session_hint(NS, "d", "ended", (), None)
        st.demote(8 * MiB)
        assert not any(st.tier.contains(NS, k) or st.policy.on_ssd(NS, k) for k in done)
        assert all(st.policy.on_ssd(NS, k) for k in live), "the others are demoted"
        assert st.get_bytes(NS, list(live)) == [value_for(k, MiB // 2) for k in live]
        assert st.policy.orphans == set()
    finally:
        st.close()
        arena.close()


def test_ssd_evicts_a_paused_sessions_blocks_last() -> None:
    a, other = ks("a", 2), ks("o", 2)
    p = policy({})
    p.handle(SsdWritten(tuple((NS, k, 1000, 2000, True) for k in a + other)))
    hint(p, "s1", "paused", a)
    (out,) = p.handle(NeedSsdRoom(3000, force=True))
    assert out.keys == tuple((NS, k) for k in other)  # type: ignore[union-attr]
    (out,) = p.handle(NeedSsdRoom(1, force=True))
    assert out.keys == ((NS, a[1]),), "when nothing else is left, protected blocks go, tail first"  # type: ignore[union-attr]
    p.ssd_retain_budget = 2000  # spares one block of 2000 bytes: the chain's head
    p.handle(SsdWritten(tuple((NS, k, 1000, 2000, True) for k in a + other)))
    hint(p, "s2", "paused", a)
    (out,) = p.handle(NeedSsdRoom(6000, force=True))
    assert out.keys == ((NS, other[0]), (NS, other[1]), (NS, a[1])), (  # type: ignore[union-attr]
        "a[0] is spared (budget), a[1] is not"
    )


def test_pause_orders_the_chain_tail_first_on_ssd_too() -> None:
    """A chain written head first sits on SSD head-oldest: LRU would evict its head
    first and lose the whole prefix. Pausing reorders it so the tail goes first."""
    a, other = ks("a", 4), ks("o", 2)
    p = policy({})
    p.ssd_retain_budget = 0
    p.handle(SsdWritten(tuple((NS, k, 1000, 2000, True) for k in a + other)))
    hint(p, "s1", "paused", a)
    (out,) = p.handle(NeedSsdRoom(12_000, force=True))
    assert out.keys == tuple((NS, k) for k in (*other, *reversed(a)))  # type: ignore[union-attr]


def test_paused_ttl_expires_and_releases() -> None:
    a = ks("a", 2)
    p = policy({(NS, k): 10 for k in a})
    hint(p, "s1", "paused", a, now=0)
    assert p.handle(SessionTick(29.0)) == []
    assert p.handle(SessionTick(31.0)) == [Release(NS, a)]
    assert len(p.sessions) == 0 and p.sessions.counters.expired == 1
    assert p.retained_bytes == 0 and p.sessions.refs == {} and p.sessions.owner == {}


def test_bad_hints_are_invalid_argument_and_change_nothing() -> None:
    p = policy({})
    for sid, state, ttl in (
        ("s", "sleeping", None),
        ("x" * 257, "active", None),
        ("", "active", None),
        ("s", "paused", 0.0),
        ("s", "paused", 1e9),
    ):
        with pytest.raises(InvalidArgument):
            p.handle(SessionHint(NS, sid, state, (), ttl, 0.0))
    assert len(p.sessions) == 0
    assert hint(p, "never-seen", "ended") == [] and len(p.sessions) == 0


def test_a_flood_of_sessions_stays_bounded() -> None:
    p = policy({}, max_sessions=8, max_blocks=20)
    hint(p, "old-ended", "active", ks("e", 1))
    hint(p, "old-ended", "ended")
    for i in range(1000):
        hint(p, f"s{i}", "paused", ks(f"s{i}", 3), now=float(i))
    t = p.sessions
    assert len(t) == 8 and t.counters.dropped == 1000 - 8 + 1
    assert t.get(NS, "old-ended") is None, "ended sessions are pushed out first"
    assert t.blocks <= 20 and len(t.refs) <= 20 and len(t.owner) <= 20
    assert sorted(s.sid for s in t.sessions.values()) == sorted(t.by_sid), "small ids reused"
    assert max(t.by_sid) <= 8


def test_dram_retain_and_make_oldest() -> None:
    t = DramTier(4 * 256, 256)
    blocks = []
    for i in range(4):
        b = t.reserve(NS, key(i), 200, 0)
        assert b is not None
        t.commit(b)
        blocks.append(b)
    assert t.retain(NS, key(0), True) and t.size_of(NS, key(0)) == 200
    assert t.make_oldest(NS, key(3))
    b = t.reserve(NS, key(10), 200, 0)  # full: evicts one block
    assert b is not None
    assert not t.contains(NS, key(3)), "make_oldest: evicted first"
    for i in range(11, 14):
        nb = t.reserve(NS, key(i), 200, 0)
        assert nb is not None
        t.commit(nb)
    assert t.contains(NS, key(0)), "a retained block is never evicted"
    assert t.oldest(1 << 20) and all(x.key != key(0) for x in t.oldest(1 << 20))
    assert t.retain(NS, key(0), False)
    assert not t.retain(NS, key(99), True)


def test_store_keeps_a_paused_session_in_dram_and_prefetches_on_resume(tmp_path: Path) -> None:
    arena = Arena(8 * MiB)
    st = BlockStore(
        arena,
        MiB,
        ssd=SsdStore(str(tmp_path / "ssd"), 64 * MiB),
        sessions=SessionTable(),
        retain_budget=4 * MiB,
    )
    try:
        mine = ks("mine", 3)
        for k in mine:
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        st.session_hint(NS, "s1", "paused", mine, None)
        for i in range(40):  # 20 MiB of other traffic through an 8 MiB arena
            k = key(i, "flood")
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        assert all(st.tier.contains(NS, k) for k in mine), "retained in DRAM"
        assert st.stats().retained_bytes == 3 * (MiB // 2)
        st.session_hint(NS, "s1", "active", mine, None)
        assert st.stats().retained_bytes == 3 * (MiB // 2), "kept while its turn runs"
        # Blocks written before their session hinted them (plain LRU blocks), then
        # pushed out by other traffic, are demoted, not lost ...
        yours = ks("yours", 3)
        for k in yours:
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        for i in range(40, 80):
            k = key(i, "flood")
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        assert not any(st.tier.contains(NS, k) for k in yours)
        assert all(st.policy.on_ssd(NS, k) for k in yours), "demoted, not lost"
        # ... and when it pauses then resumes, its SSD-only blocks are prefetched into
        # DRAM, but only into free DRAM (a prefetch never evicts), so make room first.
        assert st.remove(NS, [key(i, "flood") for i in range(80)]) > 0
        st.session_hint(NS, "s2", "paused", yours, None)
        assert st.session_hint(NS, "s2", "active", yours, None).matched == 3
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(st.tier.contains(NS, k) for k in yours):
            time.sleep(0.02)
        assert all(st.tier.contains(NS, k) for k in yours), "prefetched on resume"
        assert st.stats().prefetched == 3
        assert st.get_bytes(NS, list(yours)) == [value_for(k, MiB // 2) for k in yours]
    finally:
        st.close()
        arena.close()


def test_retained_blocks_yield_newest_session_first_tail_first() -> None:
    """DRAM with no other room asks retained blocks to yield: the last session to
    pause gives up its tail first, and what yields goes to the evicting end."""
    a, b = ks("a", 3), ks("b", 3)
    p = policy({(NS, k): 100 for k in a + b}, budget=10_000)
    for sid, chain in (("sa", a), ("sb", b)):
        hint(p, sid, "active", chain)
        hint(p, sid, "paused")
    assert p.retained_bytes == 600
    out = p.handle(NeedDramRoom(150))
    assert out == [Release(NS, b[1:]), EvictFirst(NS, b[1:])], "b's tail, head to tail"
    assert p.retained_bytes == 400 and p.counters.retain_yielded == 2
    out = p.handle(NeedDramRoom(1000))
    # b's head, then all of a; made oldest in this order, so b's head is evicted first
    assert out == [Release(NS, a + b[:1]), EvictFirst(NS, a + b[:1])]
    assert p.retained_bytes == 0 and p.handle(NeedDramRoom(1)) == []


def test_store_puts_when_paused_sessions_hold_all_of_dram() -> None:
    """With a retain budget as large as DRAM, paused sessions can hold every slot:
    a put must still succeed (retained blocks yield), not fail with
    ResourceExhausted as it did before, and the session paused first keeps its head."""
    arena = Arena(4 * MiB)
    st = BlockStore(arena, MiB, sessions=SessionTable(), retain_budget=4 * MiB)
    try:
        first, second = ks("first", 4), ks("second", 4)
        for name, chain in (("s1", first), ("s2", second)):
            st.session_hint(NS, name, "active", chain, None)
            st.put_bytes(NS, list(chain), [value_for(k, MiB // 2) for k in chain])
            st.session_hint(NS, name, "paused", chain, None)
        assert st.stats().retained_bytes == 4 * MiB, "every slot retained"
        new = ks("new", 2)
        assert st.put_bytes(NS, list(new), [value_for(k, MiB // 2) for k in new]) == [True] * 2
        assert st.get_bytes(NS, list(new)) == [value_for(k, MiB // 2) for k in new]
        assert st.match_prefix(NS, first) == 4, "the session paused first keeps all of it"
        assert st.match_prefix(NS, second) == 2, "the newest gives up its tail"
        assert st.policy.counters.retain_yielded == 2
    finally:
        st.close()
        arena.close()


def test_a_session_over_its_share_gets_no_new_blocks() -> None:
    """One session whose chain outgrows the worker would push every other session
    out; past its share its deeper blocks are declined, so its head stays too."""
    a, shared = ks("a", 6), ks("sys", 1)
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    p.session_share = 3000
    hint(p, "other", "active", shared)
    hint(p, "s1", "active", shared + a)
    assert p.session_admits(NS, shared[0], 1000), "a block two live sessions list: admitted"
    assert [p.session_admits(NS, k, 1000) for k in a] == [True] * 3 + [False] * 3
    assert p.counters.share_declined == 3
    assert p.session_admits(NS, key(0, "nobody"), 1000), "blocks no session listed: admitted"
    for k in a[:3]:  # what was admitted is now stored
        dram[(NS, k)] = 1000
    hint(p, "s1", "paused")
    assert not p.session_admits(NS, a[3], 1000), "recounted at the next hint: still full"
    del dram[(NS, a[2])]  # one of its blocks left the worker: room for one more
    hint(p, "s1", "active")
    assert p.session_admits(NS, a[3], 1000) and not p.session_admits(NS, a[4], 1000)
    hint(p, "s1", "ended")
    assert p.session_admits(NS, a[5], 1000), "an ended session no longer limits"
    p.session_share = 0
    hint(p, "s2", "active", ks("b", 2))
    assert p.session_admits(NS, ks("b", 2)[1], 10**9), "share 0: no cap"


def test_active_sessions_yield_before_paused_ones_and_shared_blocks_last() -> None:
    """The yield order: active sessions (least recently hinted first), then paused
    ones (most recently paused first), each from its tail; a block several live
    sessions share (a system prompt) only when nothing else is left."""
    shared = ks("sys", 1)
    a, b, c = ks("a", 2), ks("b", 2), ks("c", 2)
    p = policy({(NS, k): 100 for k in shared + a + b + c}, budget=10_000)
    for sid, chain in (("sa", a), ("sb", b), ("sc", c)):
        hint(p, sid, "active", shared + chain)
    hint(p, "sa", "paused")
    hint(p, "sb", "paused")  # sb paused last; sc is running
    assert p.retained_bytes == 700
    assert p.handle(NeedDramRoom(150)) == [Release(NS, c), EvictFirst(NS, c)], "the running one"
    assert p.handle(NeedDramRoom(100)) == [Release(NS, b[1:]), EvictFirst(NS, b[1:])]
    out = p.handle(NeedDramRoom(250))
    # b's head, then a's chain (made oldest in this order: b's head is evicted first)
    assert out == [Release(NS, a + b[:1]), EvictFirst(NS, a + b[:1])]
    assert p.retained == {(NS, shared[0]): 100}, "the shared prompt held last"
    assert p.handle(NeedDramRoom(1)) == [Release(NS, shared), EvictFirst(NS, shared)]


def test_a_live_sessions_new_block_is_retained_when_committed() -> None:
    """A block an active session listed is retained as soon as it is written: on the
    LRU list until the session's ``paused`` hint, a turn's new blocks were the first
    victims of other sessions' writes. Blocks no live session listed are not."""
    a = ks("a", 2)
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram, budget=10_000)
    assert hint(p, "sa", "active", a) == [], "nothing written yet"
    dram[(NS, a[0])] = 100
    assert p.committed(NS, a[0]) == [Retain(NS, a[:1])]
    assert p.committed(NS, a[0]) == [], "once"
    stranger = key(1, "stranger")
    dram[(NS, stranger)] = 100
    assert p.committed(NS, stranger) == []
    hint(p, "sa", "ended")
    dram[(NS, a[1])] = 100
    assert p.committed(NS, a[1]) == [] and p.retained_bytes == 0


def test_store_retains_an_active_sessions_blocks_as_they_are_written() -> None:
    arena = Arena(4 * MiB)
    st = BlockStore(arena, MiB, sessions=SessionTable(), retain_budget=4 * MiB)
    try:
        mine = ks("mine", 3)
        st.session_hint(NS, "s1", "active", mine, None)
        for k in mine:
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        for i in range(20):  # 10 MiB of unhinted traffic through a 4 MiB arena
            k = key(i, "flood")
            st.put_bytes(NS, [k], [value_for(k, MiB // 2)])
        assert st.get_bytes(NS, list(mine)) == [value_for(k, MiB // 2) for k in mine]
        assert st.stats().retained_bytes == 3 * (MiB // 2)
    finally:
        st.close()
        arena.close()


def test_a_session_giving_way_block_by_block_goes_tail_first_and_sees_new_blocks() -> None:
    """Yields one block at a time walk a chain from its tail once (not from the tail
    each time), and a block the session retains again afterwards is found again."""
    a = ks("a", 6)
    p = policy({(NS, k): 100 for k in a}, budget=10_000)
    hint(p, "sa", "active", a)
    hint(p, "sa", "paused")
    order = []
    for _ in range(3):
        _, evict = p.handle(NeedDramRoom(100))
        assert isinstance(evict, EvictFirst)
        order += list(evict.keys)
    assert order == [a[5], a[4], a[3]]
    hint(p, "sa", "active")  # resumed: its blocks still in DRAM are retained again
    assert p.retained_bytes == 600
    assert p.handle(NeedDramRoom(100)) == [Release(NS, a[5:]), EvictFirst(NS, a[5:])]
