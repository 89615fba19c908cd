"""The worker's tier state as a pure state machine, driven by scripted stimuli: no
daemon, no threads, no lock, no LMDB. ``state.handle(stimulus) == (reply, [instructions])``
as dask's worker state machine is tested; the bytes live in a plain bytearray standing
in for the arena (the state only copies from it)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from kvstore.worker.events import DRAM, SSD
from kvstore.worker.sessions import SessionTable
from kvstore.worker.tiers import stimuli as st
from kvstore.worker.tiers.blocks import Block
from kvstore.worker.tiers.budgets import Promoter, Watermarks
from kvstore.worker.tiers.policy import DeleteSsd, Drop, SessionHint, SsdWritten
from kvstore.worker.tiers.state import TierState
from kvstore_client.errors import QuotaExceeded
from kvstore_client.wire import WHERE_ABSENT, WHERE_DRAM, WHERE_SSD

NS = "m/bf16/b16/tp0of1"
SLAB = 64 << 10


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(
    nslabs: int = 4, *, ssd: int | None = None, publish: bool = True, **kw: object
) -> tuple[TierState, bytearray]:
    arena = bytearray(nslabs * SLAB)
    view = memoryview(arena)

    def slot(off: int, n: int) -> memoryview:
        return view[off : off + n]

    state = TierState(nslabs * SLAB, SLAB, slot, ssd_size=ssd, publish=publish, **kw)  # type: ignore[arg-type]
    return state, arena


def put(state: TierState, arena: bytearray, keys: list[bytes], size: int = 1000) -> list[st.Todo]:
    """Reserve, write a pattern per key, commit: the instructions both calls returned."""
    res, todo = state.handle(st.Reserve(NS, keys, [size] * len(keys), [0] * len(keys)))
    blocks = [b for b in res if isinstance(b, Block)]
    for b in blocks:
        arena[b.offset : b.offset + b.size] = bytes([b.key[0]]) * b.size
    sums = [_sum(bytes([b.key[0]]) * b.size) for b in blocks]
    good, more = state.handle(st.Commit(blocks, [True] * len(blocks), sums))
    assert all(good)
    return todo + more


def _sum(data: bytes) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def published(todo: list[st.Todo]) -> list[tuple[bool, str, list[tuple[str, bytes]]]]:
    return [(p.stored, p.medium, list(p.items)) for p in todo if isinstance(p, st.Publish)]


def test_every_stimulus_has_a_handler_and_an_unknown_one_is_refused() -> None:
    kinds = [
        c
        for _, c in inspect.getmembers(st, inspect.isclass)
        if issubclass(c, st.Stimulus) and c is not st.Stimulus
    ]
    state, _ = make()
    missing = [c.__name__ for c in kinds if c not in state.kinds]
    assert missing == []

    class Unknown(st.Stimulus[None]):
        pass

    with pytest.raises(TypeError):
        state.handle(Unknown())


def test_a_put_is_invisible_until_committed_then_found_read_and_published_in_order() -> None:
    state, arena = make()
    keys = [k(1), k(2), k(3)]
    res, todo = state.handle(st.Reserve(NS, keys, [100] * 3, [0] * 3))
    assert all(isinstance(b, Block) for b in res) and todo == []
    assert state.handle(st.Present(NS, keys))[0].tolist() == [False] * 3  # pending
    blocks = [b for b in res if isinstance(b, Block)]
    for b in blocks:
        arena[b.offset : b.offset + 100] = b"x" * 100
    good, todo = state.handle(st.Commit(blocks, [True, False, True], [_sum(b"x" * 100)] * 3))
    assert good == [True, False, True]
    assert published(todo) == [(True, DRAM, [(NS, k(1)), (NS, k(3))])]
    assert state.handle(st.Present(NS, keys))[0].tolist() == [True, False, True]
    assert state.handle(st.LeadingRun(NS, keys))[0] == 1
    assert state.handle(st.Sizes(NS, keys))[0] == 200
    pinned, _ = state.handle(st.Pin(NS, keys))
    assert [h is not None for h in pinned.held] == [True, False, True]
    assert bytes(pinned.held[0].view) == b"x" * 100  # type: ignore[union-attr]
    assert pinned.on_ssd == []
    assert state.dram.counters.hits == 2 and state.dram.counters.misses == 1
    held = [h.block for h in pinned.held if h is not None and h.block is not None]
    assert state.handle(st.Unpin(held)) == (None, [])
    assert sum(state.dram.pins) == 0


def test_the_first_writer_wins_and_a_duplicate_is_skipped() -> None:
    state, arena = make()
    put(state, arena, [k(1)])
    res, _ = state.handle(st.Reserve(NS, [k(1), k(2)], [10, 10], [0, 0]))
    assert res[0] is None and isinstance(res[1], Block)
    assert state.dram.counters.skipped == 1


def test_a_quota_refuses_new_blocks_and_an_abort_refunds_it() -> None:
    state, _ = make(pins={NS: 2000})
    res, _ = state.handle(st.Reserve(NS, [k(1), k(2)], [1000, 1000], [0, 0]))
    assert isinstance(res[0], Block) and isinstance(res[1], QuotaExceeded)
    state.handle(st.Commit([res[0]], [False]))
    assert state.quota.used[NS] == 0


def test_an_eviction_stages_a_readable_copy_and_its_ssd_write_moves_it_there() -> None:
    state, arena = make(1, ssd=1 << 20)
    per_slab = SLAB // 1024
    first = [k(i) for i in range(per_slab)]
    put(state, arena, first)
    todo = put(state, arena, [k(1000)])  # one more: the least recently used goes
    assert any(isinstance(t, st.WriteStaged) for t in todo)
    [(stored, medium, items)] = [p for p in published(todo) if not p[0]]
    assert (stored, medium) == (False, DRAM)
    (ns, victim) = items[0]
    assert victim in first and (ns, victim) in state.staged
    # Readable while staged, with the bytes it had; counted as a hit.
    pinned, _ = state.handle(st.Pin(NS, [victim]))
    assert pinned.held[0] is not None and pinned.held[0].block is None
    assert bytes(pinned.held[0].view) == bytes([victim[0]]) * 1000
    # The SSD write: a batch marked as being written, then written.
    batch, _ = state.handle(st.StageBatch())
    assert [key for key, _ in batch] == [(NS, victim)]
    assert state.handle(st.StageBatch())[0] == []  # not handed out twice
    state.handle(NeedSsdRoomFor(1100))
    _, todo = state.handle(st.StageWritten(batch, [(NS, victim, 1000, 1100)], 1100))
    assert published(todo) == [(True, SSD, [(NS, victim)])]
    assert (NS, victim) not in state.staged and (NS, victim) in state.ssd_index
    assert state.counters.demotions == 1 and state.ssd_index.pending == 0
    pinned, _ = state.handle(st.Pin(NS, [victim]))
    assert pinned.held == [None] and pinned.on_ssd == [0]


@pytest.mark.parametrize("many", [False, True], ids=["key-by-key", "batch-probe"])
def test_where_tells_dram_from_staged_and_ssd_without_changing_anything(many: bool) -> None:
    state, arena = make(1, ssd=1 << 20)
    per_slab = SLAB // 1024
    first = [k(i) for i in range(per_slab)]
    put(state, arena, first)
    put(state, arena, [k(1000)])  # the least recently used is staged for the SSD
    [victim] = [key for _, key in state.staged]
    batch, _ = state.handle(st.StageBatch())
    state.handle(NeedSsdRoomFor(1100))
    state.handle(st.StageWritten(batch, [(NS, victim, 1000, 1100)], 1100))  # now on SSD
    put(state, arena, [k(1001)])  # another victim, staged (not yet written)
    [staged] = [key for _, key in state.staged]
    state.handle(SsdWritten(((NS, k(1000), 1000, 1100, True),)))  # in DRAM and on SSD
    probe = [victim, staged, k(1000), k(9999), k(1001)]
    if many:  # past the scalar cut-off: the numpy probe of DRAM, then the SSD maps
        probe += [key for key in first if key not in (victim, staged)]
    before = (list(state.dram.oldest(1 << 30)), list(state.ssd_index.entries))
    got, todo = state.handle(st.Where(NS, probe))
    assert got.dtype == np.uint8
    assert got[:5].tolist() == [WHERE_SSD, WHERE_SSD, WHERE_DRAM, WHERE_ABSENT, WHERE_DRAM]
    assert set(got[5:].tolist()) <= {WHERE_DRAM}
    present, _ = state.handle(st.Present(NS, probe))
    assert (got != WHERE_ABSENT).tolist() == present.tolist()  # agrees with exists
    assert (
        todo == [] and (list(state.dram.oldest(1 << 30)), list(state.ssd_index.entries)) == before
    )
    assert state.handle(st.Where("m/other", probe))[0].tolist() == [WHERE_ABSENT] * len(probe)
    assert state.handle(st.Where(NS, []))[0].tolist() == []


def NeedSsdRoomFor(n: int) -> object:
    from kvstore.worker.tiers.policy import NeedSsdRoom

    return NeedSsdRoom(n)


def test_a_removal_takes_a_block_from_every_tier_and_asks_for_the_lmdb_delete() -> None:
    state, arena = make(ssd=1 << 20)
    put(state, arena, [k(1), k(2)])
    state.handle(SsdWritten(((NS, k(1), 1000, 1100, True),)))  # k(1) is on SSD too
    n, todo = state.handle(st.Remove(NS, [k(1), k(2), k(3)]))
    assert n == 2
    assert DeleteSsd(((NS, k(1)),)) in todo
    assert published(todo) == [
        (False, DRAM, [(NS, k(1))]),
        (False, SSD, [(NS, k(1))]),
        (False, DRAM, [(NS, k(2))]),
    ]
    assert state.handle(st.Present(NS, [k(1), k(2)]))[0].tolist() == [False, False]


def test_a_demotion_pins_writes_then_drops_the_dram_copy() -> None:
    state, arena = make(ssd=1 << 20)
    put(state, arena, [k(1), k(2)])
    batch, _ = state.handle(st.DemotePick(1 << 20))
    assert {b.key for b in batch.blocks} == {k(1), k(2)} and batch.dead == set()
    assert all(b.pins == 1 for b in batch.blocks)
    written = [(b.ns, b.key, b.size, b.size + 64) for b in batch.todo]
    moved, todo = state.handle(st.DemoteDone(batch, written, 0))
    assert moved == 2000
    assert not state.dram.contains(NS, k(1)) and (NS, k(1)) in state.ssd_index
    assert {(m, s) for s, m, _ in published(todo)} == {(SSD, True), (DRAM, False)}


def test_a_removal_during_a_demotion_wins() -> None:
    state, arena = make(ssd=1 << 20)
    put(state, arena, [k(1)])
    batch, _ = state.handle(st.DemotePick(1 << 20))
    state.handle(st.Remove(NS, [k(1)]))  # removed while its bytes are being written
    written = [(b.ns, b.key, b.size, b.size + 64) for b in batch.todo]
    moved, todo = state.handle(st.DemoteDone(batch, written, 0))
    assert moved == 0 and DeleteSsd(((NS, k(1)),)) in todo  # the copy must not come back
    assert (NS, k(1)) not in state.ssd_index and sum(state.dram.pins) == 0


def test_a_corrupt_dram_block_is_a_miss_and_leaves() -> None:
    state, arena = make()
    put(state, arena, [k(1)])
    pinned, _ = state.handle(st.Pin(NS, [k(1)]))
    h = pinned.held[0]
    assert h is not None
    _, todo = state.handle(st.Corrupt(NS, k(1), h))
    assert published(todo) == [(False, DRAM, [(NS, k(1))])]
    assert state.counters.checksum_errors == 1 and state.dram.counters.hits == 0
    assert not state.dram.contains(NS, k(1)) and sum(state.dram.pins) == 0


def test_a_second_ssd_hit_promotes_unless_the_block_is_removed_meanwhile() -> None:
    state, _ = make(ssd=1 << 20, promoter=Promoter("second-hit", window=10))
    state.handle(SsdWritten(((NS, k(1), 100, 164, True), (NS, k(2), 100, 164, True))))
    assert state.handle(st.SsdFound(NS, k(1), 1.0))[0] is False
    assert state.handle(st.SsdFound(NS, k(1), 2.0))[0] is True
    b, _ = state.handle(st.PromoteReserve(NS, k(1), 100, 7))
    assert isinstance(b, Block)
    ok, todo = state.handle(st.PromoteCommit(b))
    assert ok and state.dram.contains(NS, k(1)) and state.counters.promotions == 1
    assert published(todo) == [(True, DRAM, [(NS, k(1))])]
    b, _ = state.handle(st.PromoteReserve(NS, k(2), 100, 7))
    assert isinstance(b, Block)
    state.handle(st.Remove(NS, [k(2)]))
    assert state.handle(st.PromoteCommit(b))[0] is False
    assert not state.dram.contains(NS, k(2)) and state.counters.promotions == 1


def test_the_heartbeat_tick_asks_for_demotion_above_the_high_watermark() -> None:
    state, arena = make(1, ssd=1 << 20, dram_marks=Watermarks(0.5, 0.25))
    assert state.handle(st.DramTick())[0] == 0
    put(state, arena, [k(i) for i in range(40)])  # 40 of 64 KiB
    assert state.handle(st.DramTick())[0] > 0
    no_ssd, arena2 = make(1, dram_marks=Watermarks(0.5, 0.25))
    put(no_ssd, arena2, [k(i) for i in range(40)])
    assert no_ssd.handle(st.DramTick())[0] == 0  # nowhere to demote to


def test_a_chain_that_loses_its_head_has_its_tail_dropped_a_slice_at_a_time() -> None:
    state, arena = make(1, sessions=SessionTable(), retain_budget=0)
    chain = [k(i) for i in range(1, 5)]
    state.handle(SessionHint(NS, "s", "active", tuple(chain), None, 0.0, True, (0, 1, 2, 3)))
    per_slab = SLAB // state.dram.slot_size_for(1000)
    put(state, arena, chain)
    put(state, arena, [k(100 + i) for i in range(per_slab - len(chain))])  # DRAM is full
    pinned, _ = state.handle(st.Pin(NS, chain[1:]))  # the tail is read: the head is oldest
    state.handle(st.Unpin([h.block for h in pinned.held if h is not None and h.block]))
    assert not any(isinstance(t, st.WalkCuts) for t in state.handle(st.Sizes(NS, chain))[1])
    # Without an SSD, the head leaves the last tier: the chain is cut there (a prefix
    # match cannot reach its tail any more), and the cut is walked a slice at a time.
    todo = put(state, arena, [k(999)])
    assert (False, DRAM, [(NS, k(1))]) in published(todo)
    assert any(isinstance(t, st.WalkCuts) for t in todo)
    drops: list[bytes] = []
    steps = 0
    while True:
        more, todo = state.handle(st.CutStep(2))
        steps += more
        drops += [key for t in todo if isinstance(t, Drop) for key in t.keys]
        if not more:
            break
    assert sorted(drops) == sorted(chain[1:]) and steps >= 2
    assert state.policy.counters.cut_dropped == 3


def test_a_session_report_and_its_counters() -> None:
    state, _ = make(sessions=SessionTable(), retain_budget=1 << 20)
    state.handle(SessionHint(NS, "a", "active", (k(1),), None, 0.0))
    state.handle(SessionHint("other/ns", "b", "paused", (k(2),), 30.0, 0.0))
    view, _ = state.handle(st.SessionsReport(lambda ns: ns == NS, 10, 1.0))
    assert [s.name for s in view.sessions] == ["a"] and view.live == 1
    assert view.retain_budget == 1 << 20
    assert state.handle(st.SessionKnown(NS, "a"))[0] is True
    assert state.handle(st.SessionOwner(NS, "a"))[0] == b""
    cursor, _ = state.handle(st.ChainOpen(NS, "a", b""))
    assert cursor is not None and state.handle(st.ChainNext(cursor, 10))[0] == [k(1)]
    assert state.handle(st.ChainOpen(NS, "a", b"someone else"))[0] is None
