"""Chain cuts: when a live session's block is lost, its deeper blocks are dropped here
and, through a notice a client carries, on the other workers (a prefix match stops at
the first missing block, so they are dead weight until the chain is written again).

The policy as a pure state machine, then two real BlockStores standing for two
workers with a chain split between them. A loss or a notice only records a cut;
``SessionCutStep`` walks it a bounded number of keys per event (issue 41, finding 8).
Whose session it is, and who may cut it: tests/unit/test_session_owners.py.
"""

from __future__ import annotations

from kvstore.worker.arena import Arena
from kvstore.worker.sessions import SessionTable
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.policy import (
    Drop,
    Evicted,
    SessionCut,
    SessionCutStep,
    SessionHint,
    TierPolicy,
)
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"
KiB = 1 << 10
ME = b"\x01" * 16  # the client whose sessions these are


def policy(dram: dict[tuple[str, bytes], int]) -> TierPolicy:
    return TierPolicy(
        has_ssd=False,
        in_dram=lambda ns, k: (ns, k) in dram,
        dram_size=lambda ns, k: dram.get((ns, k), 0),
        sessions=SessionTable(),
        retain_budget=0,
    )


def hint(p: TierPolicy, sid: str, state: str, keys=(), depths=()):  # type: ignore[no-untyped-def]
    return p.handle(SessionHint(NS, sid, state, tuple(keys), None, 0.0, True, tuple(depths), ME))


def drops(out: list) -> list[bytes]:  # type: ignore[type-arg]
    return [k for ins in out if isinstance(ins, Drop) for k in ins.keys]


def walk(p: TierPolicy, n: int = 1 << 20) -> list[bytes]:
    """Every recorded cut walked to its end (what the store does between its lock
    holds): the blocks to drop."""
    out: list[bytes] = []
    while p.sessions.cutting:
        out += drops(p.handle(SessionCutStep(n)))
    return out


def cut(p: TierPolicy, sid: str, depth: int, turn: int) -> list[bytes]:
    """A notice from this session's client, walked at once."""
    assert p.handle(SessionCut(NS, sid, depth, turn, ME)) == [], "a cut is only recorded"
    return walk(p)


def test_a_lost_block_drops_the_sessions_deeper_blocks_and_leaves_one_notice() -> None:
    chain = [key(i, "c") for i in range(6)]  # this worker's share: depths 0, 2, ..., 10
    dram = {(NS, k): 100 for k in chain}
    p = policy(dram)
    hint(p, "s1", "active", chain, range(0, 12, 2))
    hint(p, "s1", "paused")
    del dram[(NS, chain[2])]
    assert p.handle(Evicted(NS, chain[2], 100)) == [], "the eviction only records the cut"
    assert p.sessions.counters.cut_walked == 0
    assert walk(p) == [chain[5], chain[4], chain[3]], "deeper than depth 4, tail first"
    assert p.take_cuts(NS, b"\x02" * 16) == [], "another client gets no notice of it"
    assert p.take_cuts(NS, ME) == [("s1", 4, 1)]
    assert p.take_cuts(NS, ME) == [], "a notice is taken once"
    for k in chain[3:]:
        del dram[(NS, k)]
    assert p.handle(Evicted(NS, chain[1], 100)) == []
    assert walk(p) == [], "nothing deeper is left"
    assert p.take_cuts(NS, ME) == [("s1", 2, 1)]
    assert p.take_cuts("other-ns", ME) == []
    assert p.counters.cut_dropped == 3


def test_blocks_another_live_session_holds_are_not_dropped_nor_cut() -> None:
    shared = [key(i, "sys") for i in range(2)]
    own = [key(i, "own") for i in range(3)]
    dram = {(NS, k): 100 for k in shared + own}
    p = policy(dram)
    hint(p, "a", "active", shared + own, range(5))
    hint(p, "b", "active", shared, range(2))
    del dram[(NS, shared[1])]
    p.handle(Evicted(NS, shared[1], 100))
    assert walk(p) == []
    assert p.take_cuts(NS, ME) == [], "a shared block's loss names no single chain"
    hint(p, "a", "active", [key(9, "late")])  # no depths (an older client): never cut
    del dram[(NS, own[0])]
    p.handle(Evicted(NS, own[0], 100))
    assert walk(p) == [own[2], own[1]]


def test_a_notice_applies_within_the_turn_it_names_only() -> None:
    chain = [key(i, "n") for i in range(4)]  # depths 1, 3, 5, 7 (the other worker: 0, 2...)
    dram = {(NS, k): 100 for k in chain}
    p = policy(dram)
    hint(p, "s1", "active", chain, (1, 3, 5, 7))
    assert cut(p, "nobody", 0, 1) == []
    assert cut(p, "s1", 4, 2) == [], "a turn this worker has not seen"
    assert cut(p, "s1", 4, 1) == [chain[3], chain[2]]
    for k in chain[2:]:  # what the store does with a Drop
        del dram[(NS, k)]
    assert p.take_cuts(NS, ME) == [], "a notice from elsewhere is not sent back"
    hint(p, "s1", "active")  # the next turn writes the chain again
    assert cut(p, "s1", 0, 1) == [], "the old turn's notice is stale"
    assert cut(p, "s1", 0, 2) == [chain[1], chain[0]]


def test_a_cut_walks_a_bounded_slice_of_the_chain_per_event() -> None:
    """A cut of a long chain never walks it in one event: recording it walks nothing,
    each step walks at most its ``n`` keys, and every key is walked once in all (a
    shallower cut goes on from where the last one stopped)."""
    n_keys, n = 20_000, 256
    chain = [key(i, "long") for i in range(n_keys)]
    dram = {(NS, k): 100 for k in chain}
    p = policy(dram)
    hint(p, "s1", "active", chain, range(n_keys))
    c = p.sessions.counters
    assert p.handle(SessionCut(NS, "s1", 10, 1, ME)) == [] and c.cut_walked == 0
    got: list[bytes] = []
    steps = 0
    while p.sessions.cutting:
        before = c.cut_walked
        got += drops(p.handle(SessionCutStep(n)))
        assert c.cut_walked - before <= n, "one step walked more than its slice"
        steps += 1
    assert got == chain[:10:-1], "everything deeper than depth 10, tail first"
    assert steps == -(-(n_keys - 11) // n)
    for k in got:
        del dram[(NS, k)]
    # A loss at depth 5 (this worker): recorded by the eviction, walked from depth 10 down.
    del dram[(NS, chain[5])]
    assert p.handle(Evicted(NS, chain[5], 100)) == []
    assert c.cut_walked == n_keys - 11, "the eviction walked nothing"
    assert walk(p, n) == chain[10:5:-1], "the key the first walk stopped at is deeper now"
    assert c.cut_walked == n_keys - 6, "each key walked once"
    assert p.handle(SessionCutStep(n)) == [] and not p.sessions.cutting


def test_a_chain_that_grows_ends_the_walk_of_its_cut() -> None:
    """A hint that adds keys while a cut is still being walked ends that walk (the
    chain is being written again), and a later cut walks the new chain from its end."""
    chain = [key(i, "grow") for i in range(100)]
    dram = {(NS, k): 100 for k in chain}
    p = policy(dram)
    hint(p, "s1", "active", chain[:90], range(90))
    p.handle(SessionCut(NS, "s1", 0, 1, ME))
    first = drops(p.handle(SessionCutStep(10)))
    assert first == chain[89:79:-1]
    hint(p, "s1", "paused", chain[90:], range(90, 100))
    assert walk(p) == [], "the walk ended with the growth"
    for k in first:
        del dram[(NS, k)]
    assert cut(p, "s1", 50, 1) == [*chain[99:89:-1], *chain[79:50:-1]]


def test_two_stores_keep_no_block_past_the_first_gap_of_a_chain() -> None:
    """A chain split between two stores (even depths on A, odd on B); unhinted traffic
    through A evicts its share of the chain from the tail. A drops what it has past the
    first gap at once, and B does when a hint carries A's notice."""
    size = 64 * KiB
    arenas = [Arena(1 << 20), Arena(1 << 20)]
    a, b = (BlockStore(x, size, sessions=SessionTable(), retain_budget=0) for x in arenas)
    try:
        chain = [key(i, "chain") for i in range(12)]
        mine = {a: list(range(0, 12, 2)), b: list(range(1, 12, 2))}
        for st, depths in mine.items():
            keys = [chain[d] for d in depths]
            st.session_hint(NS, "s1", "active", keys, None, depths, client=ME)
            st.put_bytes(NS, keys, [value_for(k, size) for k in keys])
            st.session_hint(NS, "s1", "paused", [], None, client=ME)
        for i in range(12):  # 768 KiB of other blocks through A's 1 MiB
            k = key(i, "flood")
            a.put_bytes(NS, [k], [value_for(k, size)])
        on_a = a.exists(NS, [chain[d] for d in mine[a]])
        assert on_a[0] and not all(on_a), "A lost part of its share"
        assert a.take_cuts(NS, b"\x02" * 16) == [], "only the session's client gets it"
        cuts = a.take_cuts(NS, ME)
        assert len(cuts) == 1 and cuts[0][0] == "s1" and cuts[0][2] == 1
        depth = cuts[0][1]
        assert chain[depth] not in [chain[d] for d, ok in zip(mine[a], on_a, strict=True) if ok]
        assert not any(a.exists(NS, chain[depth:]))
        deeper = [chain[d] for d in mine[b] if d > depth]
        assert all(b.exists(NS, deeper)), "B has no notice yet"
        b.session_hint(NS, "other", "active", [], None, (), cuts, client=b"\x02" * 16)
        assert all(b.exists(NS, deeper)), "another client's notice is ignored"
        b.session_hint(NS, "someone-else", "active", [], None, (), cuts, client=ME)
        assert not any(b.exists(NS, deeper))
        head = [chain[d] for d in mine[b] if d < depth]
        assert b.get_bytes(NS, head) == [value_for(k, size) for k in head], "its head stays"
    finally:
        for st in (a, b):
            st.close()
        for x in arenas:
            x.close()
