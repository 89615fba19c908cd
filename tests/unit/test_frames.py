"""The transfer plane's frame core (kvstore.worker.transfer.frames), without a network:
frames in, decisions out. One order of checks for every transport, put plans that
say where bytes land and leave nothing behind, get answers that pin until closed,
and the shm:// server half as an object over the core."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.auth import Tenants
from kvstore.worker.arena import Arena
from kvstore.worker.requests import Limits, RequestCore
from kvstore.worker.store import BlockStore
from kvstore.worker.transfer.frames import (
    TCP_OPS,
    UCX_OPS,
    FrameCore,
    Refused,
    observe_frame,
)
from kvstore.worker.transfer.shm import Inboxes, ShmServer
from kvstore_client import wire
from kvstore_client.errors import (
    InvalidArgument,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
)
from kvstore_client.keys import from_bitmap

NS = b"m/bf16/b16/tp0of1"
MAX_BATCH = 64
MAX_VALUE = 1 << 20


@pytest.fixture
def store() -> Iterator[BlockStore]:
    arena = Arena(16 << 20)
    s = BlockStore(arena, MAX_VALUE)
    try:
        yield s
    finally:
        s.close()
        arena.close()


def core_for(store: BlockStore, tenants: Tenants | None = None, **kw: int) -> RequestCore:
    limits = Limits.for_arena(store.tier.capacity, MAX_VALUE, max_batch=MAX_BATCH, **kw)
    return RequestCore(limits, tenants)


@pytest.fixture
def tcp(store: BlockStore) -> FrameCore:
    return FrameCore(store, core_for(store), TCP_OPS, "tcp")


def head(op: int, count: int = 1, *, flags: int = 0, ns_len: int = len(NS), req: int = 7) -> bytes:
    return wire.HEADER.pack(wire.REQ_MAGIC, op, flags, ns_len, count, req)


def refusal(frames: FrameCore, raw: bytes) -> Refused:
    p = frames.peer("c")
    with pytest.raises(Refused) as e:
        frames.header(p, raw)
    return e.value


def pins(store: BlockStore) -> int:
    with store.lock:
        return sum(store.tier.pins)


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}{i}".encode()) for i in range(n)]


# ---- the order of checks ----------------------------------------------------------


def test_namespace_length_comes_before_op_flags_and_batch(tcp: FrameCore) -> None:
    """Everything wrong at once: the first check in the order decides (no answer)."""
    for op in (wire.OP_GET, wire.OP_PUT, wire.OP_EXISTS):
        raw = head(op, MAX_BATCH + 1, flags=0xF0, ns_len=0)
        with pytest.raises(ProtocolError, match="namespace length") as e:
            tcp.header(tcp.peer("c"), raw)
        assert not isinstance(e.value, Refused)
    with pytest.raises(ProtocolError, match="namespace length"):
        tcp.header(tcp.peer("c"), head(wire.OP_GET, ns_len=256))


def test_op_served_comes_before_flags_and_batch(store: BlockStore) -> None:
    ucx = FrameCore(store, core_for(store), UCX_OPS, "ucx")
    r = refusal(ucx, head(wire.OP_GET_LOC, MAX_BATCH + 1, flags=0xF0))
    assert isinstance(r.error, InvalidArgument) and "not served over ucx://" in str(r.error)


def test_flags_come_before_the_batch_size(tcp: FrameCore) -> None:
    r = refusal(tcp, head(wire.OP_EXISTS, MAX_BATCH + 1, flags=0x82))
    assert isinstance(r.error, InvalidArgument) and "flags" in str(r.error)
    r = refusal(tcp, head(wire.OP_EXISTS, MAX_BATCH + 1, flags=wire.FLAG_PREFIX))
    assert "exceeds the limit of 64 blocks" in str(r.error)


def test_the_batch_size_comes_before_the_namespace(tmp_path: Path, store: BlockStore) -> None:
    """A frame over the batch limit is refused from its header alone: before its
    namespace (here one the tenant does not own) is read."""
    frames = FrameCore(store, core_for(store, tenants(tmp_path)), TCP_OPS, "tcp")
    p = frames.peer("c")
    auth = frames.header(p, wire.encode_request_header(wire.OP_AUTH, b"", 5, 1))
    frames.authenticate(p, auth, b"tok-a")
    with pytest.raises(Refused, match="exceeds the limit"):
        frames.header(p, head(wire.OP_GET, MAX_BATCH + 1))
    h = frames.header(p, head(wire.OP_GET, 1))
    with pytest.raises(Refused) as e:
        frames.admit(p, h, NS)
    assert isinstance(e.value.error, PermissionDenied)


@pytest.mark.parametrize(
    "raw",
    [
        head(wire.OP_PUT, MAX_BATCH + 1),
        head(wire.OP_GET, 2, flags=4),
        head(wire.OP_EXISTS, 1, flags=0x82),
        head(wire.OP_REMOVE, 1, flags=wire.FLAG_PREFIX),
        head(wire.OP_PUT, 1, flags=4),
    ],
)
def test_tcp_and_ucx_refuse_the_same_frames_the_same_way(store: BlockStore, raw: bytes) -> None:
    core = core_for(store)
    a = refusal(FrameCore(store, core, TCP_OPS, "tcp"), raw)
    b = refusal(FrameCore(store, core, UCX_OPS, "ucx"), raw)
    assert type(a.error) is type(b.error) and str(a.error) == str(b.error)
    assert a.answer() == b.answer()


def test_flags_by_op_and_transport(store: BlockStore) -> None:
    core = core_for(store)
    tcp = FrameCore(store, core, TCP_OPS, "tcp")
    ucx = FrameCore(store, core, UCX_OPS, "ucx")
    ok = [
        (tcp, wire.OP_PUT, wire.FLAG_SESSION),
        (tcp, wire.OP_EXISTS, wire.FLAG_PREFIX),
        (tcp, wire.OP_PUT_INBOX, wire.FLAG_SESSION),
        (ucx, wire.OP_PUT, wire.FLAG_PARTS | wire.FLAG_SESSION),
        (ucx, wire.OP_PUT, wire.FLAG_PACKED | wire.FLAG_SESSION),
        (ucx, wire.OP_GET, wire.FLAG_PARTS),
        (ucx, wire.OP_GET, wire.FLAG_PACKED),
        (ucx, wire.OP_EXISTS, wire.FLAG_PREFIX),
    ]
    for frames, op, flags in ok:
        assert frames.header(frames.peer("c"), head(op, flags=flags)).flags_or_code == flags
    for frames, op, flags in [
        (tcp, wire.OP_PUT, wire.FLAG_PARTS),
        (tcp, wire.OP_GET, 1),
        (tcp, wire.OP_PUT, wire.FLAG_PACKED),  # packing is ucx://'s (one message per frame)
        (tcp, wire.OP_GET, wire.FLAG_PACKED),
    ]:
        with pytest.raises(Refused, match="flags"):
            frames.header(frames.peer("c"), head(op, flags=flags))


def test_bad_magic_and_unknown_op_are_not_answered(tcp: FrameCore) -> None:
    with pytest.raises(ProtocolError, match="magic") as e:
        tcp.header(tcp.peer("c"), b"GARBAGE!" * 2 + b"\0" * 4)
    assert not isinstance(e.value, Refused)
    with pytest.raises(ProtocolError, match="unknown op") as e:
        tcp.header(tcp.peer("c"), head(200))
    assert not isinstance(e.value, Refused)


def test_refusal_answer_is_the_error_code_and_message(tcp: FrameCore) -> None:
    r = refusal(tcp, head(wire.OP_GET, MAX_BATCH + 1, req=99))
    h_raw, msg = r.answer()
    h = wire.decode_header(h_raw, wire.ANS_MAGIC)
    assert (h.op, h.flags_or_code, h.req_id) == (wire.OP_GET, InvalidArgument.code, 99)
    assert h.count == len(msg) and b"exceeds the limit" in bytes(msg)


def test_observe_frame_reports_a_refusals_own_code() -> None:
    seen: list[tuple[str, str]] = []
    h = wire.Header(wire.OP_GET_LOC, 0, 1, 1, 1)
    with pytest.raises(Refused), observe_frame(lambda op, code, s: seen.append((op, code)), h.op):
        raise Refused(h, ResourceExhausted("full"))
    with pytest.raises(ConnectionError), observe_frame(lambda op, c, s: seen.append((op, c)), 1):
        raise ConnectionError
    assert seen == [("shm_get", "RESOURCE_EXHAUSTED"), ("put", "UNAVAILABLE")]


# ---- AUTH and admission -----------------------------------------------------------


def tenants(tmp_path: Path) -> Tenants:
    f = tmp_path / "tenants.yaml"
    f.write_text(
        "tenants:\n  - {name: a, token: tok-a, namespaces: [team-a]}\n"
        "  - {name: b, token: tok-b, namespaces: [team-b]}\n"
    )
    return Tenants.load(str(f))


def test_with_tenants_the_first_frame_must_be_auth(tmp_path: Path, store: BlockStore) -> None:
    frames = FrameCore(store, core_for(store, tenants(tmp_path)), TCP_OPS, "tcp")
    r = refusal(frames, head(wire.OP_GET))
    assert isinstance(r.error, Unauthenticated)
    r = refusal(frames, wire.encode_request_header(wire.OP_AUTH, b"", wire.MAX_TOKEN + 1, 1))
    assert isinstance(r.error, Unauthenticated)
    p = frames.peer("c")
    h = frames.header(p, wire.encode_request_header(wire.OP_AUTH, b"", 5, 1))
    with pytest.raises(Refused) as e:
        frames.authenticate(p, h, b"wrong")
    assert isinstance(e.value.error, Unauthenticated)
    p = frames.peer("c")
    h = frames.header(p, wire.encode_request_header(wire.OP_AUTH, b"", 5, 1))
    ok = wire.decode_header(frames.authenticate(p, h, b"tok-a"), wire.ANS_MAGIC)
    assert ok.flags_or_code == 0 and p.tenant is not None and p.tenant.name == "a"
    with pytest.raises(ProtocolError, match="first frame"):  # a second AUTH
        frames.header(p, wire.encode_request_header(wire.OP_AUTH, b"", 5, 2))
    g = frames.header(p, head(wire.OP_GET))
    assert frames.admit(p, g, b"team-a/x") == "team-a/x"
    with pytest.raises(Refused) as e:
        frames.admit(p, g, b"team-b/x")
    assert isinstance(e.value.error, PermissionDenied)


def test_without_tenants_auth_is_accepted_only_first(tcp: FrameCore) -> None:
    p = tcp.peer("c")
    h = tcp.header(p, wire.encode_request_header(wire.OP_AUTH, b"", 3, 1))
    assert wire.decode_header(tcp.authenticate(p, h, b"any"), wire.ANS_MAGIC).flags_or_code == 0
    p = tcp.peer("c")
    tcp.header(p, head(wire.OP_GET))
    with pytest.raises(ProtocolError, match="first frame"):
        tcp.header(p, wire.encode_request_header(wire.OP_AUTH, b"", 3, 1))


@pytest.mark.parametrize("ns", [b"../../etc", b"\xff\xfe", b"a//b"])
def test_bad_namespaces_are_refused_invalid(tcp: FrameCore, ns: bytes) -> None:
    p = tcp.peer("c")
    h = tcp.header(p, head(wire.OP_GET, ns_len=len(ns)))
    with pytest.raises(Refused) as e:
        tcp.admit(p, h, ns)
    assert isinstance(e.value.error, InvalidArgument)


def test_body_lengths() -> None:
    def h(op: int, n: int, flags: int = 0) -> wire.Header:
        return wire.Header(op, flags, 3, n, 1)

    assert FrameCore.body_len(h(wire.OP_PUT, 3)) == 3 * 28
    assert FrameCore.body_len(h(wire.OP_PUT, 3, wire.FLAG_PARTS)) == 3 * 32
    assert FrameCore.body_len(h(wire.OP_GET, 3, wire.FLAG_PARTS)) == 3 * 20
    assert FrameCore.body_len(h(wire.OP_GET, 3)) == 3 * 16
    assert FrameCore.body_len(h(wire.OP_EXISTS, 3, wire.FLAG_PREFIX)) == 3 * 16
    assert FrameCore.body_len(h(wire.OP_PUT_INBOX, 3)) == 3 * 36
    assert FrameCore.body_len(h(wire.OP_RELEASE, 3)) == 0


def test_part_counts_are_bounded() -> None:
    h = wire.Header(wire.OP_GET, wire.FLAG_PARTS, 3, 2, 1)
    body = memoryview(b"h" * 32 + struct.pack("<2I", 2, 3))
    rest, counts, table = FrameCore.part_counts(h, body)
    assert (len(rest), counts, table) == (32, [2, 3], 20)
    assert FrameCore.part_sizes(counts, struct.pack("<5I", 1, 2, 3, 4, 5)) == [[1, 2], [3, 4, 5]]
    for bad in (0, wire.MAX_PARTS + 1):
        with pytest.raises(ProtocolError, match="part counts"):
            FrameCore.part_counts(h, memoryview(b"h" * 32 + struct.pack("<2I", 1, bad)))


# ---- put plans and get answers ----------------------------------------------------


def entries(ks: list[bytes], vals: list[bytes], sums: list[int] | None = None) -> bytes:
    sums = sums or [xxhash.xxh3_64_intdigest(v) for v in vals]
    return b"".join(
        wire.PUT_ENTRY.pack(k, len(v), c) for k, v, c in zip(ks, vals, sums, strict=True)
    )


def test_put_plan_lands_checks_and_publishes(tcp: FrameCore, store: BlockStore) -> None:
    ks = keys(4, "plan")
    vals = [os.urandom(1000 * (i + 1)) for i in range(4)]
    store.put_bytes("m/bf16/b16/tp0of1", ks[:1], vals[:1])
    p = tcp.peer("c")
    h = tcp.header(p, head(wire.OP_PUT, 4))
    sums = [xxhash.xxh3_64_intdigest(v) for v in vals]
    sums[3] ^= 1  # corrupt on the wire
    plan = tcp.put_plan(p, h, "m/bf16/b16/tp0of1", entries(ks, vals, sums))
    assert plan.cut(1) == 1 and plan.cut(3000) == 2 and plan.cut(1 << 30) == 4
    dests = plan.reserve(2)
    assert dests[0] is None and dests[1] is not None  # present: read and drop
    dests[1][:] = vals[1]
    plan.landed(1, dests[1])
    plan.finish()
    assert p.holder.bytes == 0 and not plan.done
    for i, d in enumerate(plan.reserve(4), start=2):
        assert d is not None
        d[:] = vals[i]
    plan.finish()  # checks the blocks not reported landed
    assert plan.done and plan.total == sum(map(len, vals)) and p.holder.bytes == 0
    status = plan.answer()[1]
    assert bytes(status) == bytes(
        [wire.PUT_PRESENT, wire.PUT_STORED, wire.PUT_STORED, wire.PUT_CORRUPT]
    )
    assert store.get_bytes("m/bf16/b16/tp0of1", ks) == [*vals[:3], None]
    assert store.counters.checksum_errors == 1


def test_put_plan_abort_leaves_nothing(tcp: FrameCore, store: BlockStore) -> None:
    ks = keys(2, "abort")
    vals = [b"a" * 5000, b"b" * 5000]
    used = store.tier.used_bytes
    p = tcp.peer("c")
    plan = tcp.put_plan(p, tcp.header(p, head(wire.OP_PUT, 2)), "m/x", entries(ks, vals))
    dests = plan.reserve(2)
    assert all(d is not None for d in dests) and store.tier.used_bytes > used
    plan.abort()
    assert store.tier.used_bytes == used and p.holder.bytes == 0
    assert store.exists("m/x", ks) == [False, False]


def test_put_plan_over_budget_is_answered_full(store: BlockStore) -> None:
    core = core_for(store, hold_per_connection=4096, hold_per_client=4096, hold_per_worker=4096)
    frames = FrameCore(store, core, TCP_OPS, "tcp")
    p = frames.peer("c")
    assert p.holder.take(4096)
    ks = keys(1, "full")
    vals = [b"x" * MAX_VALUE]
    plan = frames.put_plan(p, frames.header(p, head(wire.OP_PUT, 1)), "m/x", entries(ks, vals))
    assert plan.reserve(1) == [None]
    plan.finish()
    assert bytes(plan.answer()[1]) == bytes([wire.PUT_FULL])


def test_put_plan_refuses_oversized_values_and_bad_parts(tcp: FrameCore) -> None:
    p = tcp.peer("c")
    h = tcp.header(p, head(wire.OP_PUT, 1))
    big = wire.PUT_ENTRY.pack(b"k" * 16, MAX_VALUE + 1, 0)
    with pytest.raises(Refused, match="exceeds the limit") as e:
        tcp.put_plan(p, h, "m/x", big)
    assert isinstance(e.value.error, InvalidArgument)
    ok = wire.PUT_ENTRY.pack(b"k" * 16, 10, 0)
    with pytest.raises(Refused, match="part sizes"):
        tcp.put_plan(p, h, "m/x", ok, [[4, 5]])


def test_get_answer_pins_until_closed_and_bounds_its_size(store: BlockStore) -> None:
    ks = keys(3, "get")
    vals = [b"1" * 3000, b"2" * 5000, b"3" * 7000]
    store.put_bytes("m/x", ks, vals)
    frames = FrameCore(store, core_for(store), TCP_OPS, "tcp")
    h = wire.Header(wire.OP_GET, wire.FLAG_PARTS, 3, 4, 1)
    miss = keys(1, "miss")
    parts = [[1000, 2000], [5000], [1, 1], [7]]
    answer = frames.get_answer(h, "m/x", b"".join([ks[0], ks[1], miss[0], ks[2]]), parts)
    assert pins(store) == 3 and answer.nbytes == 15000
    head_, meta, *views = answer.buffers
    assert wire.decode_header(head_, wire.ANS_MAGIC).count == 4
    got = [wire.GET_ENTRY.unpack_from(meta, 16 * i) for i in range(4)]
    assert [g[0] for g in got] == [wire.GET_HIT, wire.GET_HIT, wire.GET_MISS, wire.GET_HIT]
    # a hit of its parts' total goes out part by part; any other hit whole
    assert [bytes(v) for v in views] == [b"1" * 1000, b"1" * 2000, vals[1], vals[2]]
    answer.close()
    assert pins(store) == 0
    small = RequestCore(Limits(max_transfer_answer_bytes=10000))
    tight = FrameCore(store, small, TCP_OPS, "tcp")
    with pytest.raises(Refused, match="over the limit"):
        tight.get_answer(wire.Header(wire.OP_GET, 0, 3, 3, 1), "m/x", b"".join(ks))
    assert pins(store) == 0, "a refused answer pins nothing"


def test_exists_and_remove_answers(tcp: FrameCore, store: BlockStore) -> None:
    ks = keys(5, "ex")
    store.put_bytes("m/x", ks[:2], [b"a", b"b"])
    store.put_bytes("m/x", ks[3:4], [b"d"])
    body = b"".join(ks)
    _, bitmap = tcp.exists(wire.Header(wire.OP_EXISTS, 0, 3, 5, 1), "m/x", body)
    assert from_bitmap(bytes(bitmap), 5) == [True, True, False, True, False]
    (run,) = tcp.exists(wire.Header(wire.OP_EXISTS, wire.FLAG_PREFIX, 3, 5, 1), "m/x", body)
    r = wire.decode_header(run, wire.ANS_MAGIC)
    assert (r.count, r.ns_len) == (2, wire.TAG_RUN)
    (gone,) = tcp.remove(wire.Header(wire.OP_REMOVE, 0, 3, 5, 1), "m/x", body)
    assert wire.decode_header(gone, wire.ANS_MAGIC).count == 3


def test_exists_where_answers_two_bitmaps_in_one_buffer(tcp: FrameCore, store: BlockStore) -> None:
    ks = keys(10, "wh")
    store.put_bytes("m/x", ks[:2], [b"a", b"b"])
    store.put_bytes("m/x", ks[9:], [b"j"])
    h = wire.Header(wire.OP_EXISTS, wire.FLAG_WHERE, 3, 10, 1)
    head_, body = tcp.exists(h, "m/x", b"".join(ks))  # one buffer: one message on ucx://
    a = wire.decode_header(head_, wire.ANS_MAGIC)
    assert (a.count, a.ns_len) == (10, wire.TAG_WHERE) and len(body) == 2 * 2
    codes = wire.decode_where(body, 10).tolist()
    assert codes == [wire.WHERE_DRAM] * 2 + [wire.WHERE_ABSENT] * 7 + [wire.WHERE_DRAM]


@pytest.mark.parametrize("ops", [TCP_OPS, UCX_OPS], ids=["tcp", "ucx"])
def test_exists_where_and_prefix_together_are_refused(store: BlockStore, ops: dict) -> None:
    frames = FrameCore(store, core_for(store), ops, "x")
    for flags in (wire.FLAG_WHERE, wire.FLAG_PREFIX):
        assert frames.header(frames.peer("c"), head(wire.OP_EXISTS, flags=flags))
    e = refusal(frames, head(wire.OP_EXISTS, flags=wire.FLAG_WHERE | wire.FLAG_PREFIX))
    assert isinstance(e.error, InvalidArgument) and "one at a time" in str(e.error)


def test_where_codec_round_trips_and_checks_its_size() -> None:
    import numpy as np

    for n in (0, 1, 7, 8, 9, 100):
        codes = np.random.default_rng(n).integers(0, 3, n).astype(np.uint8)
        body = wire.encode_where(codes)
        assert len(body) == 2 * ((n + 7) // 8)
        assert wire.decode_where(body, n).tolist() == codes.tolist()
    with pytest.raises(ProtocolError):
        wire.decode_where(b"\x01", 3)


# ---- the shm:// server half -------------------------------------------------------


def test_shm_server_pins_until_release_and_refuses_a_reused_id(store: BlockStore) -> None:
    core = core_for(store)
    shm = ShmServer(store, core)
    ks = keys(2, "shm")
    store.put_bytes("m/x", ks, [b"a" * 4096, b"b" * 4096])
    st = shm.state(core.budget.holder("c"))
    h = wire.Header(wire.OP_GET_LOC, 0, 3, 2, 5)
    loc = shm.get_loc(st, h, "m/x", b"".join(ks))
    loc.sent()
    assert pins(store) == 2 and loc.inline == 0 and st.holder.entries == 2
    head_ = wire.decode_header(loc.buffers[0], wire.ANS_MAGIC)
    assert head_.ns_len == store.arena.tag
    with pytest.raises(Refused, match="already open") as e:
        shm.get_loc(st, h, "m/x", b"".join(ks))
    assert isinstance(e.value.error, InvalidArgument) and pins(store) == 2
    shm.release(st, h)
    assert pins(store) == 0 and st.holder.entries == 0 and st.holder.bytes == 0


def test_retired_shared_arena_writes_are_refused(store: BlockStore) -> None:
    """PUT_LOC / PUT_COMMIT (writes into a shared writable arena, with the writer's
    late checksum taken as given) are no longer served: INVALID_ARGUMENT."""
    tcp = FrameCore(store, core_for(store), TCP_OPS, "tcp")
    for op in (wire.OP_PUT_LOC, wire.OP_PUT_COMMIT):
        with pytest.raises(Refused, match=f"op {op} is not served") as e:
            tcp.header(tcp.peer("c"), head(op, 1))
        assert isinstance(e.value.error, InvalidArgument)


def inbox_entries(ks: list[bytes], vals: list[bytes], offs: list[int], sums: list[int]) -> bytes:
    return b"".join(
        wire.INBOX_ENTRY.pack(k, len(v), c, o)
        for k, v, o, c in zip(ks, vals, offs, sums, strict=True)
    )


def test_put_inbox_publishes_only_what_the_worker_verified(store: BlockStore) -> None:
    """The worker copies each block out of the writer's inbox into its slot, hashes its
    own copy and publishes only a match. A forged checksum (or bytes that changed)
    stores nothing: the key stays absent and the next correct writer stores it (a
    mismatched late sum used to leave the key present but unreadable, refusing every
    later put of it: first writer wins)."""
    import mmap as _mmap

    core = core_for(store)
    inboxes = Inboxes(1 << 20)
    me = b"\x01" * 16
    fd = inboxes.add(me)
    assert fd is not None and inboxes.add(me) is None  # one inbox per client
    mm = _mmap.mmap(fd, 1 << 20, _mmap.MAP_SHARED, _mmap.PROT_READ | _mmap.PROT_WRITE)
    os.close(fd)
    shm = ShmServer(store, core, inboxes)
    st = shm.state(core.budget.holder("c"))
    ks = keys(3, "inbox")
    vals = [b"x" * 4096, b"y" * 5000, b"z" * 100]
    offs = [256, 8192 + 256, 20000]
    for v, o in zip(vals, offs, strict=True):
        mm[o : o + len(v)] = v
    sums = [xxhash.xxh3_64_intdigest(v) for v in vals]
    sums[1] ^= 1  # forged
    h = wire.Header(wire.OP_PUT_INBOX, 0, 3, 3, 9)
    answer, n = shm.put_inbox(st, me, h, "m/x", inbox_entries(ks, vals, offs, sums))
    assert bytes(answer[1]) == bytes([wire.PUT_STORED, wire.PUT_CORRUPT, wire.PUT_STORED])
    assert n == 4196 and st.holder.bytes == 0 and st.holder.entries == 0
    assert store.exists("m/x", ks) == [True, False, True]
    assert store.get_bytes("m/x", ks) == [vals[0], None, vals[2]]
    # The next correct writer stores it.
    sums[1] ^= 1
    h = wire.Header(wire.OP_PUT_INBOX, 0, 3, 1, 9)
    answer, _ = shm.put_inbox(
        st, me, h, "m/x", inbox_entries(ks[1:2], vals[1:2], offs[1:2], sums[1:2])
    )
    assert bytes(answer[1]) == bytes([wire.PUT_STORED])
    assert store.get_bytes("m/x", ks[1:2]) == [vals[1]]
    # A block outside the inbox, or a connection whose identity has no inbox: refused.
    far = inbox_entries(keys(1, "far"), [b"q" * 10], [(1 << 20) - 5], [0])
    with pytest.raises(Refused, match="outside the inbox"):
        shm.put_inbox(st, me, wire.Header(wire.OP_PUT_INBOX, 0, 3, 1, 10), "m/x", far)
    near = inbox_entries(keys(1, "far"), [b"q" * 10], [0], [0])
    with pytest.raises(Refused, match="without an inbox"):
        shm.put_inbox(st, b"\x02" * 16, wire.Header(wire.OP_PUT_INBOX, 0, 3, 1, 11), "m/x", near)
    with pytest.raises(Refused, match="outside the inbox"):  # whoever sends it
        shm.put_inbox(st, b"", wire.Header(wire.OP_PUT_INBOX, 0, 3, 1, 12), "m/x", far)
    inboxes.drop(me)
    with pytest.raises(Refused, match="without an inbox"):
        shm.put_inbox(st, me, wire.Header(wire.OP_PUT_INBOX, 0, 3, 1, 13), "m/x", near)


def test_packed_put_is_bounded_and_has_no_part_tables(store: BlockStore) -> None:
    """A packed PUT (ucx://: every payload in one message) lands like any other; it
    carries no part tables and at most wire.MAX_PACKED bytes (INVALID_ARGUMENT)."""
    ucx = FrameCore(store, core_for(store), UCX_OPS, "ucx")
    p = ucx.peer("c")
    h = ucx.header(p, head(wire.OP_PUT, 2, flags=wire.FLAG_PACKED))
    ks, vals = keys(2, "packed"), [b"a" * 3000, b""]
    plan = ucx.put_plan(p, h, "m/x", entries(ks, vals))
    for i, d in enumerate(plan.reserve(2)):
        assert d is not None
        d[:] = vals[i]
    plan.finish()
    assert bytes(plan.answer()[1]) == bytes([wire.PUT_STORED] * 2)
    both = ucx.header(p, head(wire.OP_PUT, 1, flags=wire.FLAG_PACKED | wire.FLAG_PARTS))
    with pytest.raises(Refused, match="no part tables"):
        ucx.put_plan(p, both, "m/x", entries(keys(1, "pp"), [b"x" * 10]), [[10]])
    n = wire.MAX_PACKED // MAX_VALUE + 1
    over = wire.Header(wire.OP_PUT, wire.FLAG_PACKED, len(NS), n, 7)  # (past the batch check)
    big = b"".join(wire.PUT_ENTRY.pack(k, MAX_VALUE, 0) for k in keys(n, "big"))
    with pytest.raises(Refused, match="at most") as e:
        ucx.put_plan(p, over, "m/x", big)
    assert isinstance(e.value.error, InvalidArgument)


def test_packed_get_answer_is_tagged_and_unsliced_within_its_bound(store: BlockStore) -> None:
    """FLAG_PACKED: an answer whose hits fit in wire.MAX_PACKED is TAG_PACKED with the
    hits whole (the transport sends them as one message, part tables or not)."""
    ks = keys(2, "pget")
    vals = [b"1" * 3000, b"2" * 5000]
    store.put_bytes("m/x", ks, vals)
    ucx = FrameCore(store, core_for(store), UCX_OPS, "ucx")
    flags = wire.FLAG_PACKED | wire.FLAG_PARTS
    answer = ucx.get_answer(
        wire.Header(wire.OP_GET, flags, 3, 2, 1), "m/x", b"".join(ks), [[1000, 2000], [5000]]
    )
    head_, _, *views = answer.buffers
    assert answer.packed and wire.decode_header(head_, wire.ANS_MAGIC).ns_len == wire.TAG_PACKED
    assert [bytes(v) for v in views] == vals
    answer.close()
    plain = ucx.get_answer(wire.Header(wire.OP_GET, 0, 3, 2, 1), "m/x", b"".join(ks))
    assert not plain.packed
    assert wire.decode_header(plain.buffers[0], wire.ANS_MAGIC).ns_len == 0
    plain.close()
    assert pins(store) == 0
