"""Issue 23, finding 5: work that grows with its input lets other clients in.

The store's lock is granted first come, first served (a thread that releases it
between slices cannot barge back in ahead of a waiter), and a session hint runs in
slices of the store lock instead of walking its whole chain in one hold. Both
checks are on ordering, not on timing."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore

NS = "m/bf16/b16/tp0of1"


@pytest.fixture
def store() -> Iterator[BlockStore]:
    arena = Arena(16 << 20)
    s = BlockStore(arena, 1 << 20)
    try:
        yield s
    finally:
        s.close()
        arena.close()


def test_a_waiter_gets_the_store_lock_before_its_holder_takes_it_back(
    store: BlockStore,
) -> None:
    order: list[str] = []
    store.lock.acquire()
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        with store.lock:
            order.append("waiter")

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait(5)
    time.sleep(0.2)  # the waiter is blocked on the lock by now
    for _ in range(3):  # a slicing loop: release, then straight back in
        store.lock.release()
        store.lock.acquire()
        order.append("holder")
    store.lock.release()
    t.join(5)
    assert order[0] == "waiter", f"the holder barged back in ahead of a waiter: {order}"


def test_a_long_session_hint_lets_a_lookup_in_between_its_slices(store: BlockStore) -> None:
    chain = [os.urandom(16) for _ in range(200_000)]
    listed = threading.Event()
    t = threading.Thread(
        target=lambda: store.session_hint(NS, "long", "active", chain, None), daemon=True
    )
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = store.policy.sessions.get(NS, "long")
        if s is not None and s.keys:
            listed.set()
            break
        time.sleep(0.0005)
    assert listed.is_set()
    assert store.exists(NS, chain[:1]) == [False]
    added = len(store.policy.sessions.get(NS, "long").keys)  # type: ignore[union-attr]
    t.join(60)
    assert added < len(chain), "the lookup waited for the whole chain to be listed"
    assert len(store.policy.sessions.get(NS, "long").keys) == len(chain)  # type: ignore[union-attr]


def test_a_namespace_removal_lets_a_lookup_in_between_its_slices(store: BlockStore) -> None:
    from kvstore.worker import removal

    keys = [os.urandom(16) for _ in range(100_000)]
    for i in range(0, len(keys), 10_000):
        store.put_bytes(NS, keys[i : i + 10_000], [b"v" * 32] * 10_000)
    probe = os.urandom(16)
    store.put_bytes("other/ns", [probe], [b"p"])
    assert store.stats().dram_keys == len(keys) + 1
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(removal.remove_tree(store, NS)), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while store.stats().dram_keys > len(keys) and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert store.exists("other/ns", [probe]) == [True]
    left = store.stats().dram_keys - 1
    t.join(60)
    assert 0 < left < len(keys), f"the lookup waited for the whole removal ({left} left)"
    assert out == [len(keys)] and store.stats().dram_keys == 1


@pytest.mark.parametrize("state", ["paused", "ended"])
def test_a_long_chains_state_change_lets_a_lookup_in_between_its_slices(state: str) -> None:
    from kvstore.worker.sessions import SessionTable

    arena = Arena(16 << 20)
    store = BlockStore(arena, 1 << 20, sessions=SessionTable(move_slice=2048), retain_budget=1)
    try:
        chain = [os.urandom(16) for _ in range(200_000)]
        store.session_hint(NS, "long", "active", chain, None)
        t = threading.Thread(
            target=lambda: store.session_hint(NS, "long", state, [], 60.0), daemon=True
        )
        table = store.policy.sessions
        t.start()
        deadline = time.monotonic() + 30
        while not table.moving(NS, "long") and time.monotonic() < deadline:
            time.sleep(0.0002)
        assert table.moving(NS, "long"), "the state change never showed as moving"
        assert store.exists(NS, chain[:1]) == [False]
        still = table.moving(NS, "long")
        t.join(60)
        assert still, "the lookup waited for the whole chain to change state"
        s = table.get(NS, "long")
        assert s is not None and s.state == state and s.moving is None
        if state == "paused":
            assert len(table.paused_refs) == len(chain) and table.is_protected(NS, chain[-1])
        else:
            assert not table.refs and not table.owner and table.blocks == 0 and not s.keys
    finally:
        store.close()
        arena.close()


def test_a_long_session_that_expires_leaves_a_slice_at_a_time() -> None:
    from kvstore.worker.sessions import SessionTable

    arena = Arena(16 << 20)
    table = SessionTable(move_slice=2048, paused_ttl=60.0)
    store = BlockStore(arena, 1 << 20, sessions=table, retain_budget=1)
    try:
        chain = [os.urandom(16) for _ in range(200_000)]
        store.session_hint(NS, "long", "active", chain, None)
        store.session_hint(NS, "long", "paused", [], 60.0)
        assert table.is_protected(NS, chain[0])
        t = threading.Thread(target=lambda: store.session_tick(time.monotonic() + 3600))
        t.start()
        deadline = time.monotonic() + 30
        while not table.dropping and time.monotonic() < deadline:
            time.sleep(0.0002)
        assert table.dropping, "the expired session never showed as leaving"
        assert store.exists(NS, chain[:1]) == [False]
        still = bool(table.dropping)
        t.join(60)
        assert still, "the lookup waited for the whole chain to leave"
        assert table.get(NS, "long") is None and not table.dropping
        assert not table.refs and not table.paused_refs and not table.owner
        assert table.blocks == 0 and not table.by_sid and table.paused == 0
    finally:
        store.close()
        arena.close()
