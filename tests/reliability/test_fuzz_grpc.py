"""Hostile input on a worker's gRPC Store API, generated with hypothesis.

Every answer must be OK or a clean error code: INVALID_ARGUMENT for malformed input
(bad hash length, bad namespace, too many hashes, value over the size limit,
mismatched counts), RESOURCE_EXHAUSTED for "no room" or a message over gRPC's size
limit. Never UNKNOWN or INTERNAL, and the daemon keeps serving good requests with
bounded memory. Where the request is well formed, the answer must also be right
(bitmap sizes, first writer wins, bytes read back equal bytes written).

Default runs draw a modest number of examples; ``--runslow`` draws many more.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.cluster import LocalCluster
from kvstore_client.keys import MAX_NAMESPACE_LEN, check_namespace, from_bitmap
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.conftest import assert_no_leaks
from tests.reliability.loadgen import proc_status

MAX_VALUE = 256 << 10  # the fixture's --max-value-size
MAX_BATCH = 1 << 16  # servicer.MAX_BATCH
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
CLEAN = {OK, INVALID, EXHAUSTED, grpc.StatusCode.NOT_FOUND}
DEFAULT_EXAMPLES = 60
SLOW_EXAMPLES = 1000
_NS_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+=@-]*(/[A-Za-z0-9_][A-Za-z0-9._:+=@-]*)*")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One worker with a small arena (64 MiB) and a small value limit (256 KiB)."""
    c = LocalCluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="256KiB",
        worker_ttl="2s",
        log_dir=str(tmp_path_factory.mktemp("fuzz-grpc")),
    )
    try:
        yield c.start()
    finally:
        c.stop()
        assert_no_leaks(c)


@pytest.fixture(scope="module")
def stub(worker: LocalCluster) -> Iterator[store_pb2_grpc.StoreStub]:
    ch = grpc.insecure_channel(
        worker.worker_procs[0].ready["grpc"],
        options=[("grpc.max_send_message_length", 512 << 20)],
    )
    try:
        yield store_pb2_grpc.StoreStub(ch)
    finally:
        ch.close()


def call(fn: Callable[..., Any], req: Any, timeout: float = 30) -> tuple[grpc.StatusCode, Any]:
    try:
        return OK, fn(req, timeout=timeout)
    except grpc.RpcError as e:
        return e.code(), e.details()


def still_serving(stub: store_pb2_grpc.StoreStub, worker: LocalCluster) -> None:
    assert worker.worker_procs[0].alive(), "the worker died"
    code, resp = call(stub.Stats, store_pb2.StatsRequest(), timeout=10)
    assert code == OK, f"the worker stopped answering: {code} {resp}"


def ns_valid(ns: str) -> bool:
    try:
        check_namespace(ns)
    except ValueError:
        return False
    return True


# ---- strategies ------------------------------------------------------------------

valid_namespaces = st.from_regex(_NS_RE, fullmatch=True).filter(
    lambda s: len(s.encode()) <= MAX_NAMESPACE_LEN
)
namespaces = st.one_of(
    valid_namespaces,
    st.text(max_size=300),
    st.sampled_from(
        [
            "",
            "a" * MAX_NAMESPACE_LEN,
            "a" * (MAX_NAMESPACE_LEN + 1),
            "é" * 200,
            "/",
            "a//b",
            ".hidden",
            "a/.b",
            "a b",
            "a\x00b",
            "../../etc/passwd",
            "a/" * 127 + "a",
        ]
    ),
)
# Packed hashes: mostly whole 16-byte hashes (a few shared ones, so keys repeat), or any length.
one_hash = st.one_of(st.binary(min_size=16, max_size=16), st.sampled_from([b"\0" * 16, b"k" * 16]))
packed_hashes = st.one_of(
    st.lists(one_hash, max_size=40).map(b"".join),
    st.binary(max_size=200),
)
values = st.lists(
    st.one_of(
        st.binary(max_size=2048),
        st.sampled_from([b"", b"\0" * MAX_VALUE, b"v" * (MAX_VALUE + 1)]),
    ),
    max_size=40,
)


def _requests() -> st.SearchStrategy[tuple[str, Any]]:
    exists = st.builds(store_pb2.ExistsRequest, namespace=namespaces, hashes=packed_hashes)
    match = st.builds(
        store_pb2.MatchPrefixRequest,
        namespace=namespaces,
        hashes=packed_hashes,
        state_namespace=st.one_of(st.just(""), namespaces),
    )
    put = st.builds(store_pb2.PutRequest, namespace=namespaces, hashes=packed_hashes, values=values)
    get = st.builds(store_pb2.GetRequest, namespace=namespaces, hashes=packed_hashes)
    remove = st.builds(store_pb2.RemoveRequest, namespace=namespaces, hashes=packed_hashes)
    remove_ns = st.builds(store_pb2.RemoveNamespaceRequest, namespace=namespaces)
    return st.one_of(
        exists.map(lambda r: ("Exists", r)),
        match.map(lambda r: ("MatchPrefix", r)),
        put.map(lambda r: ("Put", r)),
        # A put whose counts agree, so the valid path (and first writer wins) is exercised.
        st.lists(st.tuples(one_hash, st.binary(max_size=4096)), max_size=30).flatmap(
            lambda kv: namespaces.map(
                lambda ns: (
                    "Put",
                    store_pb2.PutRequest(
                        namespace=ns,
                        hashes=b"".join(k for k, _ in kv),
                        values=[v for _, v in kv],
                    ),
                )
            )
        ),
        get.map(lambda r: ("Get", r)),
        remove.map(lambda r: ("Remove", r)),
        remove_ns.map(lambda r: ("RemoveNamespace", r)),
        st.just(("Stats", store_pb2.StatsRequest())),
    )


def expected_code(op: str, req: Any) -> set[grpc.StatusCode]:
    """The codes a correct worker may answer (the oracle)."""
    if op == "Stats":
        return {OK}
    if not ns_valid(req.namespace):
        return {INVALID}
    if op == "RemoveNamespace":
        return {OK}
    if len(req.hashes) % 16 or len(req.hashes) // 16 > MAX_BATCH:
        return {INVALID}
    if op == "MatchPrefix" and req.state_namespace and not ns_valid(req.state_namespace):
        return {INVALID}
    if op == "Put":
        if len(req.values) != len(req.hashes) // 16 or any(len(v) > MAX_VALUE for v in req.values):
            return {INVALID}
        return {OK, EXHAUSTED}
    return {OK}


def check_answer(op: str, req: Any, resp: Any) -> None:
    """A well-formed request's answer must be consistent with it."""
    n = len(req.hashes) // 16 if hasattr(req, "hashes") else 0
    if op == "Exists":
        assert resp.count == n and len(resp.bitmap) == (n + 7) // 8
    elif op == "MatchPrefix":
        assert 0 <= resp.matched <= n
    elif op == "Put":
        assert len(resp.stored_bitmap) == (n + 7) // 8
        stored = from_bitmap(resp.stored_bitmap, n)
        seen: set[bytes] = set()
        for i in range(n):
            h = req.hashes[16 * i : 16 * i + 16]
            assert not (stored[i] and h in seen), "a key stored twice in one batch"
            seen.add(h)
    elif op == "Get":
        assert len(resp.values) == n and len(resp.found_bitmap) == (n + 7) // 8
        found = from_bitmap(resp.found_bitmap, n)
        assert all(f or v == b"" for f, v in zip(found, resp.values, strict=True))
        assert all(len(v) <= MAX_VALUE for v in resp.values)


def fuzz_store_api(stub: store_pb2_grpc.StoreStub, examples: int) -> dict[str, int]:
    seen: dict[str, int] = {}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(_requests())
    def one(op_req: tuple[str, Any]) -> None:
        op, req = op_req
        code, resp = call(getattr(stub, op), req)
        seen[f"{op}:{code.name}"] = seen.get(f"{op}:{code.name}", 0) + 1
        assert code in CLEAN, f"{op} answered {code.name} ({resp}) to {req!r:.300}"
        want = expected_code(op, req)
        assert code in want, f"{op} answered {code.name} ({resp}), expected {want}: {req!r:.300}"
        if code == OK:
            check_answer(op, req, resp)

    one()
    return seen


def test_random_store_requests_get_clean_codes_and_right_answers(
    stub: store_pb2_grpc.StoreStub, worker: LocalCluster
) -> None:
    rss0 = proc_status(worker.worker_procs[0].pid)["RssAnon"]
    seen = fuzz_store_api(stub, DEFAULT_EXAMPLES)
    still_serving(stub, worker)
    assert any(k.endswith(":OK") for k in seen) and any(
        k.endswith(":INVALID_ARGUMENT") for k in seen
    )
    grown = proc_status(worker.worker_procs[0].pid)["RssAnon"] - rss0
    # Requests here are < 1 MiB; the worker's heap may keep a few of them and grpc's
    # per-thread arenas (16 handler threads). 64 MiB is far below a leak of the values.
    assert grown < 64 << 20, f"worker heap grew by {grown >> 20} MiB"
    print(
        f"\ngRPC fuzz answers: {dict(sorted(seen.items()))}; worker heap {grown / 2**20:+.1f} MiB"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_random_store_requests_long(stub: store_pb2_grpc.StoreStub, worker: LocalCluster) -> None:
    fuzz_store_api(stub, SLOW_EXAMPLES)
    still_serving(stub, worker)


_rt = itertools.count()


def test_put_get_round_trip_first_writer_wins(stub: store_pb2_grpc.StoreStub) -> None:
    """Valid random batches (with repeated keys) read back exactly: first writer wins."""

    @settings(max_examples=DEFAULT_EXAMPLES, deadline=None, database=None)
    @given(st.lists(st.tuples(one_hash, st.binary(max_size=MAX_VALUE)), min_size=1, max_size=12))
    def one(kv: list[tuple[bytes, bytes]]) -> None:
        ns = f"fuzz/rt/{next(_rt)}"
        r = stub.Put(
            store_pb2.PutRequest(
                namespace=ns, hashes=b"".join(k for k, _ in kv), values=[v for _, v in kv]
            ),
            timeout=30,
        )
        first: dict[bytes, bytes] = {}
        for k, v in kv:
            first.setdefault(k, v)
        stored = from_bitmap(r.stored_bitmap, len(kv))
        assert sum(stored) == len(first), "each distinct key stored once"
        keys = list(first)
        g = stub.Get(store_pb2.GetRequest(namespace=ns, hashes=b"".join(keys)), timeout=30)
        assert list(g.values) == [first[k] for k in keys], "bytes read back are bytes written"
        stub.RemoveNamespace(store_pb2.RemoveNamespaceRequest(namespace=ns), timeout=30)

    one()


def test_batches_at_and_beyond_the_limits(
    stub: store_pb2_grpc.StoreStub, worker: LocalCluster
) -> None:
    ns = "fuzz/limits"
    at = os.urandom(16 * MAX_BATCH)
    beyond = at + os.urandom(16)
    assert call(stub.Exists, store_pb2.ExistsRequest(namespace=ns, hashes=at))[0] == OK
    assert call(stub.Exists, store_pb2.ExistsRequest(namespace=ns, hashes=beyond))[0] == INVALID
    assert call(stub.Get, store_pb2.GetRequest(namespace=ns, hashes=beyond))[0] == INVALID
    code, resp = call(
        stub.MatchPrefix, store_pb2.MatchPrefixRequest(namespace=ns, hashes=at, state_namespace=ns)
    )
    assert code == OK and resp.matched == 0
    # 65,536 empty values fit (64-byte slots: 4 MiB); one more is refused.
    code, resp = call(
        stub.Put, store_pb2.PutRequest(namespace=ns, hashes=at, values=[b""] * MAX_BATCH)
    )
    assert code == OK and sum(from_bitmap(resp.stored_bitmap, MAX_BATCH)) == MAX_BATCH
    code, _ = call(
        stub.Put, store_pb2.PutRequest(namespace=ns, hashes=beyond, values=[b""] * (MAX_BATCH + 1))
    )
    assert code == INVALID
    code, resp = call(stub.RemoveNamespace, store_pb2.RemoveNamespaceRequest(namespace=ns))
    assert code == OK and resp.removed == MAX_BATCH
    # More bytes than the whole arena in one put: RESOURCE_EXHAUSTED, and nothing is kept.
    before = stub.Stats(store_pb2.StatsRequest(), timeout=10)
    n = (before.capacity_bytes // MAX_VALUE) + 8
    big = store_pb2.PutRequest(
        namespace=ns, hashes=os.urandom(16 * n), values=[b"b" * MAX_VALUE] * n
    )
    code, _ = call(stub.Put, big)
    assert code == EXHAUSTED
    after = stub.Stats(store_pb2.StatsRequest(), timeout=10)
    assert after.keys <= before.keys and after.used_bytes <= before.used_bytes
    # A good put of max-size values still works afterwards.
    good = store_pb2.PutRequest(
        namespace=ns, hashes=os.urandom(16 * 16), values=[b"g" * MAX_VALUE] * 16
    )
    code, resp = call(stub.Put, good)
    assert code == OK and all(from_bitmap(resp.stored_bitmap, 16))
    stub.RemoveNamespace(store_pb2.RemoveNamespaceRequest(namespace=ns), timeout=30)
    still_serving(stub, worker)


def test_space_freed_in_one_size_class_is_usable_by_another(
    stub: store_pb2_grpc.StoreStub,
) -> None:
    """Slabs emptied by removals serve another size class (a bug until 27a66ce)."""
    ns = "fuzz/slabs"
    for part in range(2):  # 8,192 values of 64 bytes: two 256 KiB slabs of the 64-byte class
        hs = os.urandom(16 * 4096)
        r = stub.Put(store_pb2.PutRequest(namespace=ns, hashes=hs, values=[b"s" * 64] * 4096))
        assert all(from_bitmap(r.stored_bitmap, 4096)), part
    stub.RemoveNamespace(store_pb2.RemoveNamespaceRequest(namespace=ns), timeout=30)
    cap = stub.Stats(store_pb2.StatsRequest(), timeout=10).capacity_bytes
    for _ in range(cap // MAX_VALUE // 16):
        r = stub.Put(
            store_pb2.PutRequest(
                namespace=ns, hashes=os.urandom(16 * 16), values=[b"b" * MAX_VALUE] * 16
            ),
            timeout=30,
        )
        assert all(from_bitmap(r.stored_bitmap, 16))
    st_ = stub.Stats(store_pb2.StatsRequest(), timeout=10)
    stub.RemoveNamespace(store_pb2.RemoveNamespaceRequest(namespace=ns), timeout=30)
    assert st_.used_bytes == cap, (
        f"only {st_.used_bytes / cap:.0%} of an arena filled with max-size blocks is usable"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_message_over_grpc_limit_is_resource_exhausted(
    stub: store_pb2_grpc.StoreStub, worker: LocalCluster
) -> None:
    huge = store_pb2.GetRequest(namespace="fuzz/huge", hashes=b"h" * ((256 << 20) + 16))
    assert call(stub.Get, huge, timeout=120)[0] == EXHAUSTED
    still_serving(stub, worker)


# ---- bytes that are not a protobuf at all ----------------------------------------

METHODS = ["Exists", "MatchPrefix", "Put", "Get", "Remove", "RemoveNamespace", "Stats"]
# Field 1 (namespace, a string) holding bytes that are not UTF-8, and truncated varints.
NOT_PROTOBUF = [b"\x0a\x02\xff\xfe", b"\xff\xff\xff", b"\x12\x05ab", b"\x0a\x80"]


def raw_call(worker: LocalCluster, method: str, payload: bytes) -> grpc.StatusCode:
    with grpc.insecure_channel(worker.worker_procs[0].ready["grpc"]) as ch:
        fn = ch.unary_unary(f"/kvstore.v1.Store/{method}")
        try:
            fn(payload, timeout=10)
            return OK
        except grpc.RpcError as e:
            return e.code()


def test_random_bytes_as_a_request_never_take_the_daemon_down(
    stub: store_pb2_grpc.StoreStub, worker: LocalCluster
) -> None:
    @settings(max_examples=DEFAULT_EXAMPLES, deadline=None, database=None)
    @given(
        st.sampled_from(METHODS), st.one_of(st.binary(max_size=512), st.sampled_from(NOT_PROTOBUF))
    )
    def one(method: str, payload: bytes) -> None:
        code = raw_call(worker, method, payload)
        # INTERNAL is what grpc answers for an undecodable request (see the xfail below).
        assert code in CLEAN | {grpc.StatusCode.INTERNAL}, f"{method} answered {code.name}"

    one()
    still_serving(stub, worker)


@pytest.mark.parametrize("payload", NOT_PROTOBUF)
def test_undecodable_request_is_invalid_argument(worker: LocalCluster, payload: bytes) -> None:
    codes = {m: raw_call(worker, m, payload) for m in METHODS if m != "Stats"}
    assert set(codes.values()) <= {INVALID}, codes
