"""Chain cuts: when a live session's block is lost, its deeper blocks are dropped here
and, through a notice a client carries, on the other workers (a prefix match stops at
the first missing block, so they are dead weight until the chain is written again).

The policy as a pure state machine, then two real BlockStores standing for two
workers with a chain split between them.
"""

from __future__ import annotations

from kvstore.worker.arena import Arena
from kvstore.worker.sessions import SessionTable
from kvstore.worker.store import BlockStore
from kvstore.worker.tiers.policy import Drop, Evicted, SessionCut, SessionHint, TierPolicy
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"
KiB = 1 << 10


def policy(dram: dict[tuple[str, bytes], int]) -> TierPolicy:
    return TierPolicy(
        has_ssd=False,
        in_dram=lambda ns, k: (ns, k) in dram,
        dram_size=lambda ns, k: dram.get((ns, k), 0),
        sessions=SessionTable(),
        retain_budget=0,
    )


def hint(p: TierPolicy, sid: str, state: str, keys=(), depths=()):  # type: ignore[no-untyped-def]
    return p.handle(SessionHint(NS, sid, state, tuple(keys), None, 0.0, True, tuple(depths)))


def drops(out: list) -> list[bytes]:  # type: ignore[type-arg]
    return [k for ins in out if isinstance(ins, Drop) for k in ins.keys]


def test_a_lost_block_drops_the_sessions_deeper_blocks_and_leaves_one_notice() -> None:
    chain = [key(i, "c") for i in range(6)]  # this worker's share: depths 0, 2, ..., 10
    dram = {(NS, k): 100 for k in chain}
    p = policy(dram)
    hint(p, "s1", "active", chain, range(0, 12, 2))
    hint(p, "s1", "paused")
    del dram[(NS, chain[2])]
    out = p.handle(Evicted(NS, chain[2], 100))
    assert drops(out) == [chain[5], chain[4], chain[3]], "deeper than depth 4, tail first"
    assert p.take_cuts(NS) == [("s1", 4, 1)]
    assert p.take_cuts(NS) == [], "a notice is taken once"
    for k in chain[3:]:
        del dram[(NS, k)]
    assert drops(p.handle(Evicted(NS, chain[1], 100))) == [], "nothing deeper is left"
    assert p.take_cuts(NS) == [("s1", 2, 1)]
    assert p.take_cuts("other-ns") == []
    assert p.counters.cut_dropped == 3


def test_blocks_another_live_session_holds_are_not_dropped_nor_cut() -> None:
    shared = [key(i, "sys") for i in range(2)]
    own = [key(i, "own") for i in range(3)]
    dram = {(NS, k): 100 for k in shared + own}
    p = policy(dram)
    hint(p, "a", "active", shared + own, range(5))
    hint(p, "b", "active", shared, range(2))
    del dram[(NS, shared[1])]
    assert drops(p.handle(Evicted(NS, shared[1], 100))) == []
    assert p.take_cuts(NS) == [], "a shared block's loss names no single chain"
    hint(p, "a", "active", [key(9, "late")])  # no depths (an older client): never cut
    del dram[(NS, own[0])]
    assert drops(p.handle(Evicted(NS, own[0], 100))) == [own[2], own[1]]


def test_a_notice_applies_within_the_turn_it_names_only() -> None:
    chain = [key(i, "n") for i in range(4)]  # depths 1, 3, 5, 7 (the other worker: 0, 2...)
    dram = {(NS, k): 100 for k in chain}
    p = policy(dram)
    hint(p, "s1", "active", chain, (1, 3, 5, 7))
    assert p.handle(SessionCut(NS, "nobody", 0, 1)) == []
    assert p.handle(SessionCut(NS, "s1", 4, 2)) == [], "a turn this worker has not seen"
    assert drops(p.handle(SessionCut(NS, "s1", 4, 1))) == [chain[3], chain[2]]
    for k in chain[2:]:  # what the store does with a Drop
        del dram[(NS, k)]
    assert p.take_cuts(NS) == [], "a notice from elsewhere is not sent back"
    hint(p, "s1", "active")  # the next turn writes the chain again
    assert p.handle(SessionCut(NS, "s1", 0, 1)) == [], "the old turn's notice is stale"
    assert drops(p.handle(SessionCut(NS, "s1", 0, 2))) == [chain[1], chain[0]]


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
            st.session_hint(NS, "s1", "active", keys, None, depths)
            st.put_bytes(NS, keys, [value_for(k, size) for k in keys])
            st.session_hint(NS, "s1", "paused", [], None)
        for i in range(12):  # 768 KiB of other blocks through A's 1 MiB
            k = key(i, "flood")
            a.put_bytes(NS, [k], [value_for(k, size)])
        on_a = a.exists(NS, [chain[d] for d in mine[a]])
        assert on_a[0] and not all(on_a), "A lost part of its share"
        cuts = a.take_cuts(NS)
        assert len(cuts) == 1 and cuts[0][0] == "s1" and cuts[0][2] == 1
        depth = cuts[0][1]
        assert chain[depth] not in [chain[d] for d, ok in zip(mine[a], on_a, strict=True) if ok]
        assert not any(a.exists(NS, chain[depth:]))
        assert all(b.exists(NS, [chain[d] for d in mine[b] if d > depth])), "B has no notice yet"
        b.session_hint(NS, "someone-else", "active", [], None, (), cuts)
        assert not any(b.exists(NS, [chain[d] for d in mine[b] if d > depth]))
        head = [chain[d] for d in mine[b] if d < depth]
        assert b.get_bytes(NS, head) == [value_for(k, size) for k in head], "its head stays"
    finally:
        for st in (a, b):
            st.close()
        for x in arenas:
            x.close()
