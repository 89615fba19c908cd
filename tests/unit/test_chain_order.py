"""Chain order in the block store: a batch is a run of one prefix chain, head first,
and a prefix match stops at the first gap. Eviction must shorten a chain from its
tail, never cut its head (plain LRU over a chain read or written head first evicts
the head first, which loses the whole prefix). BlockStore on a real arena."""

from __future__ import annotations

from kvstore.worker.arena import Arena
from kvstore.worker.events import EventSink
from kvstore.worker.store import BlockStore
from tests.helpers import key, value_for

NS = "m/bf16/b16/tp0of1"
KiB = 1 << 10


def leading(st: BlockStore, keys: list[bytes]) -> int:
    n = 0
    for k in keys:
        if not st.tier.contains(NS, k):
            break
        n += 1
    return n


def test_a_written_chain_loses_its_tail_first() -> None:
    arena = Arena(64 * KiB)  # 16 slots of 4 KiB, no SSD
    st = BlockStore(arena, 4 * KiB)
    try:
        chain = [key(i, "chain") for i in range(12)]
        st.put_bytes(NS, chain, [value_for(k, 4 * KiB) for k in chain])
        flood = [key(i, "flood") for i in range(8)]
        for k in flood:  # 8 more blocks: 4 of the chain must go
            st.put_bytes(NS, [k], [value_for(k, 4 * KiB)])
        assert leading(st, chain) == 8, "the chain's last 4 blocks went, its head stayed"
    finally:
        st.close()
        arena.close()


def test_a_read_chain_loses_its_tail_first() -> None:
    arena = Arena(64 * KiB)
    st = BlockStore(arena, 4 * KiB)
    try:
        chain = [key(i, "chain") for i in range(12)]
        for k in chain:  # written one by one, head first: the head is the oldest
            st.put_bytes(NS, [k], [value_for(k, 4 * KiB)])
        assert st.get_bytes(NS, chain) == [value_for(k, 4 * KiB) for k in chain]
        for i in range(8):
            k = key(i, "flood")
            st.put_bytes(NS, [k], [value_for(k, 4 * KiB)])
        assert leading(st, chain) == 8, "after a read, eviction takes the tail first"
    finally:
        st.close()
        arena.close()


def test_kv_events_keep_the_batch_order() -> None:
    """Commits run last block first; the stored events still list the batch in order
    (a router reads them as a chain)."""
    arena = Arena(64 * KiB)
    sink = EventSink()
    st = BlockStore(arena, 4 * KiB, events=sink)
    try:
        chain = [key(i, "ev") for i in range(6)]
        st.put_bytes(NS, chain, [value_for(k, 4 * KiB) for k in chain])
        stored = [k for ok, _, items in sink.drain() if ok for _, k in items]
        assert stored == chain
    finally:
        st.close()
        arena.close()
