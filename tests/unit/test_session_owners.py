"""Whose session it is at a worker, and who may cut it (issue 41, finding 8).

A session belongs to the client (identity) that first hinted it here; only its hints
change it and only its cut notices are applied or handed out. Another client takes it
over by showing the chain held here (its last key, at its depth); a whole chain that
shows nothing of it starts the session over, dropping nothing. The policy and the
session table as pure state machines, driven by scripted events.
"""

from __future__ import annotations

from kvstore.worker.cutnotices import CutNotices
from kvstore.worker.sessions import MOVED, OWN, REFUSED, RESTARTED, SessionTable
from kvstore.worker.tiers.policy import (
    Drop,
    Evicted,
    SessionCut,
    SessionCutStep,
    SessionHint,
    TierPolicy,
)
from tests.helpers import key

NS = "m/bf16/b16/tp0of1"
A = b"\x0a" * 16  # the victim's engine
B = b"\x0b" * 16  # another engine of the same tenant
OLD = b""  # a client that sends no identity


def policy(dram: dict[tuple[str, bytes], int]) -> TierPolicy:
    return TierPolicy(
        has_ssd=False,
        in_dram=lambda ns, k: (ns, k) in dram,
        dram_size=lambda ns, k: dram.get((ns, k), 0),
        sessions=SessionTable(),
        retain_budget=0,
    )


def hint(p: TierPolicy, client: bytes, sid: str, state: str, keys=(), depths=()):  # type: ignore[no-untyped-def]
    return p.handle(
        SessionHint(NS, sid, state, tuple(keys), None, 0.0, True, tuple(depths), client)
    )


def walk(p: TierPolicy) -> list[bytes]:
    out: list[bytes] = []
    while p.sessions.cutting:
        todo = p.handle(SessionCutStep(64))
        out += [k for ins in todo if isinstance(ins, Drop) for k in ins.keys]
    return out


def cut(p: TierPolicy, client: bytes, sid: str, depth: int, turn: int = 1) -> list[bytes]:
    p.handle(SessionCut(NS, sid, depth, turn, client))
    return walk(p)


def victim(p: TierPolicy, dram: dict[tuple[str, bytes], int], n: int = 32) -> list[bytes]:
    """A's session "v": its share here at depths 0, 2, 4, ... (blocks in DRAM)."""
    chain = [key(i, "victim") for i in range(n)]
    dram.update({(NS, k): 100 for k in chain})
    hint(p, A, "v", "active", chain, range(0, 2 * n, 2))
    hint(p, A, "v", "paused")
    return chain


def test_a_cut_from_another_client_drops_none_of_the_sessions_blocks() -> None:
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    chain = victim(p, dram)
    assert cut(p, B, "v", 0) == [], "a forged cut dropped the victim's blocks"
    assert cut(p, OLD, "v", 0) == [], "so did one from a client with no identity"
    assert p.sessions.counters.cuts_refused == 2
    assert p.sessions.counters.cut_walked == 0
    assert cut(p, A, "v", 2) == chain[:1:-1], "the session's own client still cuts it"


def test_notices_are_handed_to_the_sessions_client_only() -> None:
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    chain = victim(p, dram)
    hint(p, B, "b-own", "active", [key(1, "b")], [0])
    del dram[(NS, chain[3])]
    p.handle(Evicted(NS, chain[3], 100))
    walk(p)
    assert p.take_cuts(NS, B) == [], "another client of the namespace learns nothing"
    assert p.take_cuts(NS, OLD) == []
    assert p.take_cuts(NS, A) == [("v", 6, 1)]


def test_another_client_takes_a_session_over_by_showing_its_chain() -> None:
    """An agent's next turn on another engine: its first hint carries the whole chain,
    which lists the session's last key here: the session, and its pending notice, are
    the new client's from then on, and its cuts apply (the old client's do not)."""
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    chain = victim(p, dram, 8)  # depths 0..14 here
    del dram[(NS, chain[7])]
    p.handle(Evicted(NS, chain[7], 100))  # a notice for A, not taken yet
    more = [key(i, "next-turn") for i in range(4)]
    dram.update({(NS, k): 100 for k in more})
    # An incremental hint (only the new part of the chain) shows nothing: refused.
    verdict, todo = p.claim(NS, "v", B, dict.fromkeys(more, 20), whole=False)
    assert (verdict, todo) == (REFUSED, [])
    assert hint(p, B, "v", "active", more, range(16, 24, 2)) == []
    s = p.sessions.get(NS, "v")
    assert s is not None and s.client == A and s.state == "paused" and len(s.keys) == 8
    # The last key at another depth shows nothing either.
    assert p.claim(NS, "v", B, {chain[7]: 13}, whole=False)[0] == REFUSED
    # The whole chain (its share here) shows it.
    shown = dict(zip(chain + more, [*range(0, 16, 2), *range(16, 24, 2)], strict=True))
    assert p.claim(NS, "v", B, shown, whole=True) == (MOVED, [])
    assert p.claim(NS, "v", B, shown, whole=True)[0] == OWN
    assert p.take_cuts(NS, A) == [] and p.take_cuts(NS, B) == [("v", 14, 1)]
    hint(p, B, "v", "active", chain + more, shown.values())
    assert s.client == B and s.turn == 2 and len(s.keys) == 12
    assert cut(p, A, "v", 0, 2) == [], "the old engine's cut is refused now"
    assert cut(p, B, "v", 10, 2) == [*more[::-1], chain[6]]
    assert p.sessions.counters.moved == 1


def test_a_next_turn_on_another_engine_moves_the_session_without_the_last_turns_output() -> None:
    """A turn's ``paused`` hint lists its chain with its output; the next turn's prompt
    extends the previous prompt but need not hold the output token for token (a chat
    template closes the turn otherwise; the engine bench sends the trace's tokens). Run
    on another engine, its whole chain shows the previous prompt's last key, not the
    chain's last: the session moves with its retained chain. (It used to start over
    as plain LRU blocks, 51 times in one engine-bench run of 249 turns.)"""
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    prompt = [key(i, "prompt") for i in range(6)]
    output = [key(i, "output") for i in range(2)]
    nxt = [key(i, "next") for i in range(3)]
    dram.update({(NS, k): 100 for k in prompt + output + nxt})
    hint(p, A, "v", "active", prompt, range(6))
    hint(p, A, "v", "paused", prompt + output, range(8))
    shown = dict(zip(prompt + nxt, range(9), strict=True))  # the next prompt, whole
    assert p.claim(NS, "v", B, shown, whole=True) == (MOVED, [])
    hint(p, B, "v", "active", prompt + nxt, range(9))
    s = p.sessions.get(NS, "v")
    assert s is not None and s.client == B and s.turn == 2 and s.anchor == nxt[-1]
    assert all(k in s.keys for k in prompt + output), "the session keeps its chain"
    hint(p, B, "v", "paused", prompt + nxt, range(9))
    assert all(p.sessions.is_protected(NS, k) for k in prompt), "and retains it"
    # The previous prompt's last key at another depth proves nothing.
    assert p.claim(NS, "v", A, {nxt[-1]: 3}, whole=False)[0] == REFUSED
    # An earlier turn's prompt end proves nothing now: only the latest turn's does.
    assert p.claim(NS, "v", A, {prompt[5]: 5}, whole=False)[0] == REFUSED
    assert p.sessions.counters.moved == 1 and p.sessions.counters.restarted == 0


def test_a_whole_chain_that_shows_nothing_starts_the_session_over_dropping_nothing() -> None:
    """A hint with a whole, different chain under the victim's session id (a forger's,
    or a history that changed): the old session leaves the table (its blocks become
    plain LRU blocks) and a new one starts under the sender. No block is dropped, and
    the sender's cuts reach only the keys it listed itself."""
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    chain = victim(p, dram)
    junk = [key(i, "forger") for i in range(4)]
    dram.update({(NS, k): 100 for k in junk})
    verdict, todo = p.claim(NS, "v", B, dict.fromkeys(junk, 0), whole=True)
    assert verdict == RESTARTED
    assert not [i for i in todo if isinstance(i, Drop)], "starting over dropped blocks"
    assert p.sessions.get(NS, "v") is None and p.sessions.counters.restarted == 1
    assert not any(p.sessions.is_protected(NS, k) for k in chain), "protection goes"
    hint(p, B, "v", "paused", junk, range(4))
    assert cut(p, B, "v", 0, turn=0) == junk[:0:-1], "only the forger's own keys"
    assert p.counters.cut_dropped == 3
    # The victim's next hint: incremental (shows nothing of the new chain) is refused,
    # its whole chain takes the session back.
    assert p.claim(NS, "v", A, dict.fromkeys(chain[-2:], 60), whole=False)[0] == REFUSED
    shown = dict(zip(chain, range(0, 64, 2), strict=True))
    assert p.claim(NS, "v", A, shown, whole=True)[0] == RESTARTED
    hint(p, A, "v", "active", chain, shown.values())
    assert cut(p, A, "v", 60) == [chain[31]]


def test_a_session_with_no_keys_here_moves_on_any_hint() -> None:
    p = policy({})
    hint(p, A, "v", "active")  # this worker holds none of its chain
    assert p.claim(NS, "v", B, {}, whole=False) == (MOVED, [])
    assert p.sessions.client_of(NS, "v") == B
    assert p.claim(NS, "nobody", B, {}, whole=False) == (OWN, [])


def test_old_clients_are_one_identity_among_themselves() -> None:
    """Clients that send no identity cut each other's sessions as before, and none of
    a client's that does."""
    dram: dict[tuple[str, bytes], int] = {}
    p = policy(dram)
    old = [key(i, "old") for i in range(4)]
    dram.update({(NS, k): 100 for k in old})
    hint(p, OLD, "o", "active", old, range(4))
    assert cut(p, OLD, "o", 1) == [old[3], old[2]]
    victim(p, dram, 4)
    assert cut(p, OLD, "v", 0) == []


def test_notices_are_bounded_and_taken_per_client_and_namespace() -> None:
    n = CutNotices(limit=3)
    for i in range(5):
        n.add(NS, f"s{i}", i, 1, A if i % 2 else B)
    assert len(n) == 3, "the oldest notices went"
    assert n.take(NS, A) == [("s3", 3, 1)]
    assert n.take("other", B) == []
    n.move(NS, "s4", A)
    assert n.take(NS, B) == [("s2", 2, 1)]
    n.forget(NS, "s4")
    assert n.take(NS, A) == [] and len(n) == 0
