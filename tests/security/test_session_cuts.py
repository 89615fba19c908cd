"""Chain cuts are accepted only from the client whose session it is (issue 41, finding
8), against real master and worker processes on loopback.

Before: any client that could hint in a namespace could send cuts for another client's
session (a forged cut dropped 31 of 32 blocks of a same-tenant victim), and a worker
handed every notice of a namespace to whichever client hinted next in it. Now a session
belongs, at each worker, to the client (``Client.identity``) that first hinted it;
another engine takes it over by showing the chain. A hostile client here speaks gRPC
itself, with an identity of its own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import grpc

from kvstore_client import Client
from kvstore_client.proto import store_pb2, store_pb2_grpc
from kvstore_client.security import CLIENT_HEADER
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "cuts/bf16/b16/tp0of1"
SIZE = 64 << 10


def raw_hint(
    cl: Client, identity: bytes, cuts: Sequence[store_pb2.SessionCut] = ()
) -> list[store_pb2.SessionHintResponse]:
    """A hint of a session of its own, from ``identity``, to every worker, carrying
    ``cuts``: what a client that speaks gRPC itself sends."""
    out = []
    for w in cl.workers():
        with grpc.insecure_channel(w.grpc) as ch:
            out.append(
                store_pb2_grpc.StoreStub(ch).SessionHint(
                    store_pb2.SessionHintRequest(
                        namespace=NS,
                        session_id=f"probe-{identity.hex()}",
                        state="active",
                        cuts=cuts,
                    ),
                    metadata=((CLIENT_HEADER, identity.hex()),),
                    timeout=10,
                )
            )
    return out


def cut(session: str, depth: int, turn: int) -> store_pb2.SessionCut:
    return store_pb2.SessionCut(namespace=NS, session_id=session, depth=depth, turn=turn)


def counters(cl: Client) -> dict[str, int]:
    """The session counters summed over the workers."""
    names = ("cuts_refused", "hints_refused", "moved", "restarted")
    got = cl.sessions(limit=1)
    return {n: sum(getattr(r, n) for r in got) for n in names}


def by_worker(cl: Client, tag: str, n: int = 400) -> dict[int, list[bytes]]:
    pool = [key(i, tag) for i in range(n)]
    _, groups = cl._d.groups(pool)
    return {w: [pool[int(i)] for i in idx] for w, idx in groups}


def test_a_forged_cut_drops_none_of_another_clients_blocks(
    make_cluster: MakeCluster,
) -> None:
    """The finding's reproduction: a same-tenant client sends a cut for the victim's
    session (depth 0, its current turn) to every worker. None of the victim's 32 blocks
    goes (before: 31 of them did); the victim's own cut still works."""
    c = make_cluster(workers=2, dram_size="16MiB", max_value_size="64KiB")
    chain = [key(i, "victim") for i in range(32)]
    with Client(c.address) as victim:
        victim.session_hint(NS, "victim", "active", hashes=chain)
        assert all(victim.batch_put(NS, chain, [value_for(k, SIZE) for k in chain]))
        victim.session_hint(NS, "victim", "paused", hashes=chain)
        forger = os.urandom(16)
        for depth in (0, 0):  # a second try is refused as well (nothing was memoised)
            raw_hint(victim, forger, [cut("victim", depth, 1)])
        assert victim.batch_exists(NS, chain) == [True] * 32, "a forged cut dropped blocks"
        assert raw_hint(victim, b"", [cut("victim", 0, 1)]), "an old client's cut"
        assert victim.batch_exists(NS, chain) == [True] * 32
        assert counters(victim)["cuts_refused"] == 6
        # The session's own client cuts it (a notice it carries from another worker).
        raw_hint(victim, victim.identity, [cut("victim", 9, 1)])
        assert not any(victim.batch_exists(NS, chain[10:])), "the owner's cut was ignored"
        assert victim.batch_get(NS, chain[:10]) == [value_for(k, SIZE) for k in chain[:10]]
        assert victim.match_prefix(NS, chain) == 10


def lose_part_of_the_chain(cl: Client, chain: list[bytes], w: int) -> tuple[int, list[bytes]]:
    """Flood worker ``w`` with other blocks until half its share of ``chain`` is
    evicted (its tail first: a paused chain's order); returns the shallowest lost
    depth and the other worker's blocks deeper than it."""
    _, groups = cl._d.groups(chain)
    worker_of = {int(i): x for x, idx in groups for i in idx}
    mine = sorted(d for d, x in worker_of.items() if x == w)
    theirs = sorted(d for d, x in worker_of.items() if x != w)
    with grpc.insecure_channel(cl.workers()[w].grpc) as ch:
        st = store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=5)
    room = st.capacity_bytes // SIZE - st.keys
    flood = by_worker(cl, "flood", 4000)[w][: room + len(mine) // 2]
    for i in range(0, len(flood), 8):
        part = flood[i : i + 8]
        assert all(cl.batch_put(NS, part, [value_for(k, SIZE) for k in part]))
    gone = [d for d in mine if not cl.batch_exists(NS, [chain[d]])[0]]
    assert gone and len(gone) < len(mine), (gone, mine)
    depth = min(gone)
    assert not any(cl.batch_exists(NS, [chain[d] for d in mine if d > depth]))
    return depth, [chain[d] for d in theirs if d > depth]


def test_a_session_that_moves_to_another_engine_gets_its_cuts_there_only(
    make_cluster: MakeCluster,
) -> None:
    """Turn 1 on engine A, turn 2 on engine B (another Client): B's hints take the
    session over at both workers. A block of it is then lost on one worker: the notice
    goes to B alone (neither A nor a bystander learns of it), B carries it, and the
    other worker drops its blocks past the gap."""
    c = make_cluster(
        workers=2,
        dram_size="4MiB",
        max_value_size="64KiB",
        extra_worker_args=["--session-budget", "0"],
    )
    with Client(c.address) as a, Client(c.address) as b:
        # The chain alternates between the workers and ends on the one holding its head
        # (as in tests/integration/test_sessions.py), so that one has blocks past any
        # depth the other loses.
        on = by_worker(a, "moving")
        chain = [k for pair in zip(on[0][:11], on[1][:11], strict=True) for k in pair]
        chain.append(on[0][11])
        first, rest = chain[:10], chain[10:]
        a.session_hint(NS, "agent", "active", hashes=first)
        assert all(a.batch_put(NS, first, [value_for(k, SIZE) for k in first]))
        a.session_hint(NS, "agent", "paused", hashes=first)
        b.session_hint(NS, "agent", "active", hashes=chain)  # the next turn, elsewhere
        assert all(b.batch_put(NS, rest, [value_for(k, SIZE) for k in rest]))
        b.session_hint(NS, "agent", "paused", hashes=chain)
        depth, deeper = lose_part_of_the_chain(b, chain, 1)  # not the head's worker
        assert depth > 0 and deeper and all(b.batch_exists(NS, deeper))
        answers = raw_hint(a, os.urandom(16)) + raw_hint(a, a.identity) + raw_hint(a, b"")
        assert not [x for r in answers for x in r.cuts], "a notice went to another client"
        a.session_hint(NS, "a-other", "active")  # A carries nothing to cut it with
        a.session_hint(NS, "a-other", "paused")
        assert all(b.batch_exists(NS, deeper)), "the old engine cut the session"
        b.session_hint(NS, "b-other", "active")  # its answers bring B the notice ...
        b.session_hint(NS, "b-other", "paused")  # ... and this hint carries it
        assert not any(b.batch_exists(NS, deeper)), "the notice did not reach the other worker"
        assert b.match_prefix(NS, chain) == depth
        assert b.batch_get(NS, chain[:depth]) == [value_for(k, SIZE) for k in chain[:depth]]
        got = counters(b)
        assert got["moved"] == 2 and got["cuts_refused"] == 0 and got["restarted"] == 0, got


def test_an_engine_that_gets_the_session_back_shows_its_whole_chain(
    make_cluster: MakeCluster,
) -> None:
    """Turns on A, then B, then A again. A's third hint sends only the part of the
    chain past what it sent before; the worker whose share of the session did not grow
    in B's turn sees nothing of its chain in it, answers ``resend``, and A sends the
    whole chain at once: the session is A's again on both workers, and B's cuts are
    refused while A's apply."""
    c = make_cluster(workers=2, dram_size="16MiB", max_value_size="64KiB")
    with Client(c.address) as a, Client(c.address) as b:
        on = by_worker(a, "back")
        turn1 = [k for pair in zip(on[0][:6], on[1][:6], strict=True) for k in pair]
        turn2 = [*turn1, on[0][6], on[0][7]]  # B's turn adds blocks on worker 0 only
        turn3 = [*turn2, on[0][8]]
        a.session_hint(NS, "agent", "active", hashes=turn1)
        assert all(a.batch_put(NS, turn1, [value_for(k, SIZE) for k in turn1]))
        a.session_hint(NS, "agent", "paused", hashes=turn1)
        b.session_hint(NS, "agent", "active", hashes=turn2)
        assert all(b.batch_put(NS, turn2[12:], [value_for(k, SIZE) for k in turn2[12:]]))
        b.session_hint(NS, "agent", "paused", hashes=turn2)
        assert a.session_hint(NS, "agent", "active", hashes=turn3) == 2, "a worker refused A"
        assert all(a.batch_put(NS, turn3[14:], [value_for(k, SIZE) for k in turn3[14:]]))
        raw_hint(a, b.identity, [cut("agent", 0, 3)])
        assert all(a.batch_exists(NS, turn3)), "the previous engine still cut the session"
        raw_hint(a, a.identity, [cut("agent", 3, 3)])
        assert not any(a.batch_exists(NS, turn3[4:]))
        assert a.batch_get(NS, turn3[:4]) == [value_for(k, SIZE) for k in turn3[:4]]
        got = counters(a)
        assert got["moved"] == 4 and got["hints_refused"] == 1 and got["restarted"] == 0, got
        assert got["cuts_refused"] == 2
