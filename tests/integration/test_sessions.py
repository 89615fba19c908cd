"""Session hints and KV events against real worker processes.

KV events are decoded with msgpack alone (what a router in any language does);
tests/e2e/test_kv_events_vllm.py decodes the same messages with vLLM's classes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from kvstore.cluster import LocalCluster, free_port
from kvstore_client import Client, InvalidArgument
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"


class Sub:
    """A msgpack-only KV-event subscriber: (topic, seq, [ts, events])."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def messages(self, until: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(out):
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                out.append((topic.decode(), int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol from a DEALER: send (b"", start seq); read
    (b"", topic, seq, payload) until seq == -1."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while sock.poll(5000):
            _, topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError("replay did not end")
    finally:
        sock.close(0)
        ctx.term()


def hashes_of(msgs: list[Any], kind: str, medium: str) -> set[bytes]:
    return {
        h
        for _, _, (_, events, *_) in msgs
        for ev in events
        if ev["type"] == kind and ev["medium"] == medium
        for h in ev["block_hashes"]
    }


@pytest.fixture
def events_cluster(make_cluster: Callable[..., LocalCluster]) -> tuple[LocalCluster, str, str]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    c = make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_worker_args=["--kv-events", pub, "--kv-events-replay", rep],
    )
    return c, pub, rep


def test_kv_events_msgpack_batched_and_replayed(
    events_cluster: tuple[LocalCluster, str, str],
) -> None:
    c, pub, rep = events_cluster
    sub = Sub(pub)
    time.sleep(0.3)  # PUB/SUB slow joiner
    try:
        with Client(c.address) as cl:
            keys = [key(i, "ev") for i in range(300)]
            for i in range(0, 300, 10):  # a burst of 30 puts
                cl.batch_put(NS, keys[i : i + 10], [value_for(k, 1000) for k in keys[i : i + 10]])
            msgs = sub.messages(lambda m: hashes_of(m, "BlockStored", "CPU") >= set(keys))
            assert hashes_of(msgs, "BlockStored", "CPU") == set(keys)
            assert len(msgs) < 30, f"a burst of 30 puts became {len(msgs)} messages"
            topic, _, (ts, events, *_) = msgs[0]
            assert topic == "kvstore/" + NS and abs(ts - time.time()) < 60
            ev = events[0]
            assert ev["block_size"] == 16 and ev["parent_block_hash"] is None
            assert all(len(h) == 16 for h in ev["block_hashes"])
            assert cl.remove(NS, keys[:5]) == 5
            msgs = sub.messages(lambda m: hashes_of(m, "BlockRemoved", "CPU") >= set(keys[:5]))
            assert hashes_of(msgs, "BlockRemoved", "CPU") == set(keys[:5])
        # A subscriber that missed everything replays from 0: AllBlocksCleared first.
        got = replay(rep, 0)
        assert got[0][1] == 0 and got[0][0] == b"kvstore/"
        first = msgpack.unpackb(got[0][2])
        assert first[1] == [{"type": "AllBlocksCleared"}]
        assert [s for _, s, _ in got] == list(range(len(got))), "sequence numbers count up"
    finally:
        sub.close()


def test_session_hints_reach_every_worker_and_bad_hints_are_rejected(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    c = make_cluster(workers=2, dram_size="64MiB", max_value_size="1MiB")
    with Client(c.address) as cl:
        chain = [key(i, "sess") for i in range(40)]
        cl.batch_put(NS, chain, [value_for(k, 1000) for k in chain])
        assert cl.session_hint(NS, "agent-1", "active", hashes=chain) == 2
        assert cl.session_hint(NS, "agent-1", "paused", ttl=60, hashes=chain) == 2
        tables = cl.sessions()
        assert len(tables) == 2
        rows = [s for t in tables for s in t.sessions]
        assert {s.state for s in rows} == {"paused"}
        assert sum(s.blocks for s in rows) == 40, "each worker holds the hashes it owns"
        assert sum(s.hit_blocks for s in rows) > 0
        assert all(0 < s.expires_in_seconds <= 60 for s in rows)
        assert sum(t.retained_bytes for t in tables) == 40 * 1000
        # Incremental: the client sends only hashes past what the workers took.
        more = chain + [key(i, "sess") for i in range(40, 50)]
        assert cl.session_hint(NS, "agent-1", "active", hashes=more) == 2
        rows = [s for t in cl.sessions() for s in t.sessions]
        assert sum(s.blocks for s in rows) == 50, "the 10 new hashes were added"
        # The hit ratio counts the whole chain at each active hint, not only the hashes
        # an incremental hint carried: 40 of 40, then 40 of 50.
        assert sum(s.lookup_blocks for s in rows) == 90
        assert sum(s.hit_blocks for s in rows) == 80
        for bad in (
            ("agent-1", "sleeping", None),
            ("x" * 300, "paused", None),
            ("a", "paused", -1),
        ):
            with pytest.raises(InvalidArgument):
                cl.session_hint(NS, *bad)
        w = cl.workers()[0]
        with grpc.insecure_channel(w.grpc) as ch:  # the worker checks too
            stub = store_pb2_grpc.StoreStub(ch)
            for req in (
                store_pb2.SessionHintRequest(namespace=NS, session_id="a", state="zombie"),
                store_pb2.SessionHintRequest(namespace=NS, session_id="y" * 10_000, state="active"),
                store_pb2.SessionHintRequest(
                    namespace=NS, session_id="a", state="paused", ttl_seconds=1e12
                ),
                store_pb2.SessionHintRequest(
                    namespace=NS, session_id="a", state="active", hashes=b"x" * 17
                ),
            ):
                with pytest.raises(grpc.RpcError) as ei:
                    stub.SessionHint(req, timeout=5)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A flood of sessions is bounded by the table (4096 by default): sample 300.
            for i in range(300):
                stub.SessionHint(
                    store_pb2.SessionHintRequest(namespace=NS, session_id=f"f{i}", state="paused"),
                    timeout=5,
                )
            r = stub.Sessions(store_pb2.SessionsRequest(limit=5), timeout=5)
            assert len(r.sessions) == 5 and r.live == 301
        out = subprocess.run(
            [sys.executable, "-m", "kvstore", "status", "--master", c.address, "--sessions",
             "--top", "3", "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        doc = json.loads(out)
        assert doc["sessions"][0]["session"] == "agent-1", "most blocks asked first"
        assert doc["sessions"][0]["blocks"] == 50 and len(doc["sessions"]) == 3
        assert doc["totals"]["live"] == 302
        cl.session_hint(NS, "agent-1", "ended")
        assert sum(t.retained_bytes for t in cl.sessions()) == 0


@pytest.mark.parametrize("share", ["0.5", "0"])
def test_a_session_past_its_share_keeps_its_head_and_spares_the_others(
    make_cluster: Callable[..., LocalCluster], share: str
) -> None:
    """A hinted session whose chain outgrows the worker: with a share, its deeper
    blocks are declined (reported not stored, no error) and everyone's blocks stay;
    without one (0), its tail pushes its own head out under LRU (the other session,
    live, is retained)."""
    port = free_port()
    c = make_cluster(
        workers=1,
        dram_size="4MiB",
        max_value_size="64KiB",
        extra_worker_args=["--session-share", share, "--metrics-port", str(port)],
    )
    size = 64 << 10
    with Client(c.address) as cl:
        other = [key(i, "other") for i in range(16)]  # 1 MiB
        cl.session_hint(NS, "other", "active", hashes=other)
        assert all(cl.batch_put(NS, other, [value_for(k, size) for k in other]))
        big = [key(i, "big") for i in range(64)]  # 4 MiB: the whole worker
        cl.session_hint(NS, "big", "active", hashes=big)
        stored = []
        for i in range(0, 64, 8):
            stored += cl.batch_put(NS, big[i : i + 8], [value_for(k, size) for k in big[i : i + 8]])
        if share == "0":
            assert all(stored)
            # The other (live) session's blocks are retained; the big one's are over the
            # retention budget, so its tail pushes its own head out under LRU.
            assert cl.match_prefix(NS, other) == 16, "the other session is retained"
            assert cl.match_prefix(NS, big) == 0, "LRU: its head was pushed out by its tail"
            return
        assert stored == [True] * 32 + [False] * 32, "2 MiB admitted, the rest declined"
        assert cl.match_prefix(NS, big) == 32, "its head is kept"
        assert cl.match_prefix(NS, other) == 16, "the other session is untouched"
        got = cl.batch_get(NS, big[:32])
        assert got == [value_for(k, size) for k in big[:32]]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        page = r.read().decode()
    assert "kvstore_session_declined_blocks_total 32.0" in page


def test_a_chain_cut_on_one_worker_reaches_the_other_through_hints(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """A paused session's chain spread over two workers; other traffic through one of
    them evicts its share of the chain from the tail. That worker drops what it has
    past the gap at once; the client's next hints carry its notice to the other worker,
    which drops its blocks past the gap too (a prefix match cannot reach them). The
    chain's head still reads back exactly."""
    c = make_cluster(
        workers=2,
        dram_size="4MiB",
        max_value_size="64KiB",
        extra_worker_args=["--session-budget", "0"],
    )
    size = 64 << 10
    with Client(c.address) as cl:
        # The chain alternates between the workers and ends on the one holding its
        # head, so that one has blocks past any depth the other loses. (With keys
        # placed at random, a CI run found nothing of its share deeper than the cut.)
        pool = [key(i, "cut") for i in range(400)]
        _, pg = cl._d.groups(pool)
        on = {x: [pool[int(i)] for i in idx] for x, idx in pg}
        chain = [k for pair in zip(on[0][:11], on[1][:11], strict=True) for k in pair]
        chain.append(on[0][11])
        cl.session_hint(NS, "agent", "active", hashes=chain)
        assert all(cl.batch_put(NS, chain, [value_for(k, size) for k in chain]))
        cl.session_hint(NS, "agent", "paused", hashes=chain)
        _, groups = cl._d.groups(chain)
        worker_of = {int(i): w for w, idx in groups for i in idx}
        assert [worker_of[d] for d in range(4)] == [0, 1, 0, 1]
        first = {w: min(d for d, x in worker_of.items() if x == w) for w in (0, 1)}
        # Fill the worker that does not hold the chain's first block until half its
        # share of the chain is evicted (its tail first: a paused chain's order).
        w = 0 if first[0] > first[1] else 1
        mine = sorted(d for d, x in worker_of.items() if x == w)
        theirs = sorted(d for d, x in worker_of.items() if x != w)
        with grpc.insecure_channel(cl.workers()[w].grpc) as ch:
            st = store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=5)
        room = st.capacity_bytes // size - st.keys
        cand = [key(i, "flood") for i in range(4000)]
        _, fg = cl._d.groups(cand)
        flood = [cand[int(i)] for x, idx in fg if x == w for i in idx][: room + len(mine) // 2]
        for i in range(0, len(flood), 8):
            part = flood[i : i + 8]
            assert all(cl.batch_put(NS, part, [value_for(k, size) for k in part]))
        gone = [d for d in mine if not cl.batch_exists(NS, [chain[d]])[0]]
        assert gone and len(gone) < len(mine), (gone, mine)
        cut = min(gone)
        assert cut > 0
        assert not any(cl.batch_exists(NS, [chain[d] for d in mine if d > cut]))
        deeper = [chain[d] for d in theirs if d > cut]
        assert deeper and all(cl.batch_exists(NS, deeper)), "no notice has travelled yet"
        cl.session_hint(NS, "another", "active")  # its answers bring the notice back
        cl.session_hint(NS, "another", "paused")  # ... and this hint carries it
        assert not any(cl.batch_exists(NS, deeper)), "the other worker dropped them"
        head = chain[:cut]
        assert cl.match_prefix(NS, chain) == cut
        assert cl.batch_get(NS, head) == [value_for(k, size) for k in head]
        with grpc.insecure_channel(cl.workers()[0].grpc) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            cut_msg = store_pb2.SessionCut(namespace=NS, session_id="agent", depth=1, turn=1)
            for req in (
                store_pb2.SessionHintRequest(
                    namespace=NS, session_id="a", state="active", hashes=chain[0], depths=[0, 1]
                ),
                store_pb2.SessionHintRequest(
                    namespace=NS,
                    session_id="a",
                    state="active",
                    cuts=[store_pb2.SessionCut(namespace="other", session_id="agent")],
                ),
                store_pb2.SessionHintRequest(
                    namespace=NS,
                    session_id="a",
                    state="active",
                    cuts=[store_pb2.SessionCut(namespace=NS, session_id="")],
                ),
                store_pb2.SessionHintRequest(
                    namespace=NS, session_id="a", state="active", cuts=[cut_msg] * 5000
                ),
            ):
                with pytest.raises(grpc.RpcError) as ei:
                    stub.SessionHint(req, timeout=5)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert cl.batch_get(NS, head) == [value_for(k, size) for k in head], "nothing lost"
