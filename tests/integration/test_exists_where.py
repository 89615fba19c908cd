"""Client.batch_where / where_local (EXISTS with wire.FLAG_WHERE) against real workers:
per key, in DRAM, only on SSD, or absent, over tcp://, shm:// and ucx:// (skipped
without ucxx); it agrees with batch_exists on presence; FLAG_WHERE with FLAG_PREFIX
is refused; and a worker that predates the flag (the frame core of an in-process
server with the old flag table; ucx://: a child process) gets plain EXISTS, its hits
reported WHERE_UNKNOWN."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.cluster import LocalCluster
from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.transfer.frames import TCP_OPS, FrameCore
from kvstore.worker.transfer.tcp import TcpTransferServer
from kvstore_client import (
    WHERE_ABSENT,
    WHERE_DRAM,
    WHERE_SSD,
    WHERE_UNKNOWN,
    Client,
    InvalidArgument,
    lookups,
    wire,
)
from kvstore_client.dispatch import Dispatch
from kvstore_client.proto import master_pb2, store_pb2, store_pb2_grpc
from kvstore_client.routing import View, WorkerLink
from kvstore_client.sharding import build_ring
from kvstore_client.transport import ucx
from kvstore_client.transport.tcp import TcpPool, TcpTransfer
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "llama3-8b/bf16/b16/tp0of1"
NSB = NS.encode()
MiB = 1 << 20
BLOCKS = 96  # 1 MiB each through 64 MiB of DRAM: the oldest end up only on SSD
BATCH = 16


def stats(cluster: LocalCluster) -> store_pb2.StatsResponse:
    with grpc.insecure_channel(cluster.worker_procs[0].ready["grpc"]) as ch:
        return store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=5)


def settled(cluster: LocalCluster, timeout: float = 60.0) -> store_pb2.StatsResponse:
    """The worker's stats once demotion is over: every block in exactly one tier, and
    nothing moved between two looks."""
    last = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stats(cluster)
        now = (s.keys, s.ssd_keys, s.demotions)
        if now == last and s.keys + s.ssd_keys == BLOCKS:
            return s
        last = now
        time.sleep(0.3)
    raise AssertionError(f"demotion did not settle: {stats(cluster)}")


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, list[bytes]]]:
    """One worker with 64 MiB of DRAM and an SSD tier, holding BLOCKS blocks of 1 MiB
    (ucx:// too when ucxx is importable), settled."""
    path = tmp_path_factory.mktemp("where")
    extra = ["--ssd-path", str(path / "ssd"), "--ssd-size", "1GiB", "--id", "w0"]
    if ucx.available():
        extra += ["--ucx-port", "0"]
    cluster = LocalCluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="4MiB",
        worker_ttl="3s",
        extra_worker_args=extra,
        log_dir=str(path),
    )
    cluster.start()
    try:
        keys = [key(i, "where") for i in range(BLOCKS)]
        with Client(cluster.address, timeout=30, transport="tcp") as c:
            for s in range(0, BLOCKS, BATCH):
                part = keys[s : s + BATCH]
                assert all(c.batch_put(NS, part, [value_for(k, MiB) for k in part]))
        yield cluster, keys
    finally:
        cluster.stop()


NO_UCX = "ucxx is not importable: pip install 'kvstore-cache[ucx]'"
TRANSPORTS = [
    "tcp",
    "shm",
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx.available(), reason=NO_UCX)),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_batch_where_tells_dram_from_ssd_and_misses(
    tiered: tuple[LocalCluster, list[bytes]], transport: str
) -> None:
    cluster, keys = tiered
    s = settled(cluster)
    assert s.keys > 0 and s.ssd_keys > 0, "some blocks in each tier"
    misses = [key(i, "never") for i in range(5)]
    with Client(cluster.address, timeout=30, transport=transport) as c:
        link = c._view.workers[0]  # type: ignore[union-attr]
        assert (link.arena is not None, link.ucx is not None) == (
            transport == "shm",
            transport == "ucx",
        )
        codes = c.batch_where(NS, keys + misses)
        present = c.batch_exists(NS, keys + misses)
        assert stats(cluster).demotions == s.demotions, "nothing moved during the lookups"
        assert codes[BLOCKS:] == [WHERE_ABSENT] * len(misses)
        assert [x != WHERE_ABSENT for x in codes] == present, "agrees with batch_exists"
        assert set(codes[:BLOCKS]) == {WHERE_DRAM, WHERE_SSD}
        assert codes.count(WHERE_DRAM) == s.keys and codes.count(WHERE_SSD) == s.ssd_keys
        # LRU: the first batch written left DRAM, the last one is still there.
        assert codes[:BATCH] == [WHERE_SSD] * BATCH
        assert codes[-BATCH - len(misses) : BLOCKS] == [WHERE_DRAM] * BATCH
        assert c.batch_where(NS, []) == []
        if transport == "shm":
            # The worker's shared index holds exactly what is in its arena.
            probe = link.arena.usable().index.probe(NSB, b"".join(keys))
            assert [bool(f) for f in probe.found] == [x == WHERE_DRAM for x in codes[:BLOCKS]]


def test_where_local_answers_dram_hits_and_leaves_the_rest_to_the_socket(
    tiered: tuple[LocalCluster, list[bytes]],
) -> None:
    cluster, keys = tiered
    settled(cluster)
    with Client(cluster.address, timeout=30, transport="shm") as c:
        codes = c.batch_where(NS, keys)
        in_dram = [k for k, x in zip(keys, codes, strict=True) if x == WHERE_DRAM]
        on_ssd = [k for k, x in zip(keys, codes, strict=True) if x == WHERE_SSD]
        assert c.where_local(NS, in_dram) == ([WHERE_DRAM] * len(in_dram), False)
        assert c.exists_local(NS, in_dram) == ([True] * len(in_dram), False)
        # With an SSD tier a key the index lacks may be on SSD: the socket must answer.
        assert c.where_local(NS, on_ssd[:1] + in_dram) is None
        assert c.where_local(NS, [key(0, "never")]) is None
        assert c.where_local(NS, []) == ([], False)
    with Client(cluster.address, timeout=30, transport="tcp") as c:
        assert c.where_local(NS, in_dram) is None, "no shared index over tcp://"


def test_where_local_without_an_ssd_tier_answers_misses_too(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="64MiB", worker_ttl="3s")
    keys = [key(i, "local") for i in range(40)]
    with Client(cluster.address, timeout=30, transport="shm") as c:
        assert all(c.batch_put(NS, keys[:20], [value_for(k, 4096) for k in keys[:20]]))
        want = [WHERE_DRAM] * 20 + [WHERE_ABSENT] * 20
        assert c.where_local(NS, keys) == (want, False)
        assert c.batch_where(NS, keys) == want
    with Client(cluster.address, timeout=30, transport="tcp") as c:
        assert c.batch_where(NS, keys) == want


def test_where_across_workers_and_replicas(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=2, dram_size="64MiB", worker_ttl="3s")
    keys = [key(i, "two") for i in range(64)]
    with Client(cluster.address, timeout=30, transport="tcp") as c:
        assert all(c.batch_put(NS, keys[:32], [value_for(k, 4096) for k in keys[:32]]))
        assert all(
            c.batch_put(NS, keys[32:48], [value_for(k, 4096) for k in keys[32:48]], replicas=2)
        )
        want = [WHERE_DRAM] * 48 + [WHERE_ABSENT] * 16
        assert c.batch_where(NS, keys) == want
    with Client(cluster.address, timeout=30, transport="shm") as c:
        assert c.batch_where(NS, keys) == want


def raw_exists(cluster: LocalCluster, flags: int, keys: list[bytes]) -> tuple[int, int, bytes]:
    """One EXISTS frame on a fresh connection: the answer's (code, tag, body); a
    refusal must close the connection."""
    host, port = cluster.worker_procs[0].ready["tcp"][len("tcp://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        head = wire.encode_request_header(wire.OP_EXISTS, NSB, len(keys), 7, flags)
        s.sendall(head + b"".join(keys))
        h = wire.decode_header(wire.recv_exact(s, wire.HEADER_LEN), wire.ANS_MAGIC)
        nb = (len(keys) + 7) // 8
        n = h.count if h.flags_or_code else 2 * nb if h.ns_len == wire.TAG_WHERE else nb
        body = bytes(wire.recv_exact(s, n))
        if h.flags_or_code:
            assert s.recv(1) == b"", "a refused frame closes the connection"
        return h.flags_or_code, h.ns_len, body


def test_raw_frames_where_answer_and_refused_combination(
    tiered: tuple[LocalCluster, list[bytes]],
) -> None:
    cluster, keys = tiered
    settled(cluster)
    probe = keys[:BATCH] + keys[-BATCH:] + [key(1, "never")]
    code, tag, body = raw_exists(cluster, wire.FLAG_WHERE, probe)
    assert (code, tag) == (0, wire.TAG_WHERE)
    assert wire.decode_where(body, len(probe)).tolist() == (
        [WHERE_SSD] * BATCH + [WHERE_DRAM] * BATCH + [WHERE_ABSENT]
    )
    code, _, body = raw_exists(cluster, wire.FLAG_WHERE | wire.FLAG_PREFIX, probe)
    assert code == wire_code(InvalidArgument) and b"one at a time" in body
    code, _, body = raw_exists(cluster, wire.FLAG_WHERE | 0x80, probe)
    assert code == wire_code(InvalidArgument) and b"unknown EXISTS flags" in body


def wire_code(cls: type) -> int:
    return int(cls("").code)


# ---- a worker that predates FLAG_WHERE --------------------------------------------------

OLD_TCP_OPS = {**TCP_OPS, wire.OP_EXISTS: wire.FLAG_PREFIX}  # the table before FLAG_WHERE


class Served:
    """An in-process worker's tcp:// server over a real store: ``old`` swaps its frame
    core for one with the flag table of a worker that predates FLAG_WHERE."""

    def __init__(self, old: bool) -> None:
        self.arena = Arena(16 << 20)
        self.store = BlockStore(self.arena, 1 << 20)
        self.server = TcpTransferServer(self.store, "127.0.0.1", 0)
        if old:
            self.server.frames = FrameCore(self.store, self.server.core, OLD_TCP_OPS, "tcp")
        self.refused: list[str] = []
        self.server.on_bad_frame = self.refused.append
        self.server.start()
        self.pool = TcpPool("127.0.0.1", self.server.port)
        info = master_pb2.WorkerInfo(id="w0", endpoints=[f"tcp://127.0.0.1:{self.server.port}"])
        self.dispatch = Dispatch(5.0, 4, None, None)
        self.dispatch.view = View(
            1, build_ring([("w0", 1 << 30)]), [WorkerLink(info, self.pool)], 1 << 20
        )

    def close(self) -> None:
        self.dispatch.close()
        self.pool.close()
        self.server.stop(grace=1.0)
        self.store.close()
        self.arena.close()


@pytest.fixture(params=[False, True], ids=["new", "old"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    s = Served(request.param)
    try:
        yield s
    finally:
        s.close()


def test_a_worker_that_predates_the_flag_gets_plain_exists(served: Served) -> None:
    old = served.server.frames.ops is OLD_TCP_OPS
    keys = [key(i, "old") for i in range(20)]
    served.store.put_bytes(NS, keys[:10], [b"v"] * 10)
    hit = WHERE_UNKNOWN if old else WHERE_DRAM
    want = [hit] * 10 + [WHERE_ABSENT] * 10
    support = served.pool.where_support
    # The scatter path (one thread, every owner's request out first) and the pool's.
    assert lookups.where(served.dispatch, NS, NSB, keys) == want
    assert served.refused == (["tcp"] if old else []) and support.asks is not old
    assert lookups.where(served.dispatch, NS, NSB, keys) == want
    assert TcpTransfer(served.pool).where(5.0, NSB, keys).tolist() == want
    assert len(served.refused) == int(old), "refused once, then asked plain EXISTS"
    support.plain_until = 0.0  # the retry interval is over: the flag is tried again
    assert TcpTransfer(served.pool).where(5.0, NSB, keys).tolist() == want
    assert len(served.refused) == 2 * int(old) and support.asks is not old
    assert lookups.exists(served.dispatch, NS, NSB, keys) == [True] * 10 + [False] * 10


def test_a_refusal_for_another_reason_is_raised_and_not_taken_for_an_old_worker(
    served: Served,
) -> None:
    keys = [key(i, "bad") for i in range(4)]
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            lookups.where(served.dispatch, NS, b"bad namespace!", keys)
        with pytest.raises(InvalidArgument):
            TcpTransfer(served.pool).where(5.0, b"bad namespace!", keys)
    assert served.pool.where_support.asks, "the pool still asks the flag"


def test_the_client_checks_its_arguments(tiered: tuple[LocalCluster, list[bytes]]) -> None:
    cluster, _ = tiered
    with Client(cluster.address, timeout=30) as c:
        with pytest.raises(InvalidArgument):
            c.batch_where("bad namespace!", [key(0)])
        with pytest.raises(InvalidArgument):
            c.batch_where(NS, [b"short"])
        with pytest.raises(InvalidArgument):
            c.where_local(NS, [b"short"])


UCX_SERVER = """
import json, sys
from kvstore.worker.arena import Arena
from kvstore.worker.store import BlockStore
from kvstore.worker.transfer.frames import UCX_OPS, FrameCore
from kvstore.worker.transfer.ucx import UcxTransferServer
from kvstore_client import wire
from tests.helpers import key

arena = Arena(16 << 20)
try:
    store = BlockStore(arena, 1 << 20)
    store.put_bytes(sys.argv[2], [key(i, "ucx-where") for i in range(10)], [b"v"] * 10)
    srv = UcxTransferServer(store, "127.0.0.1", 0, frame_timeout=3.0)
    if sys.argv[1] == "old":  # the flag table of a worker that predates FLAG_WHERE
        ops = {**UCX_OPS, wire.OP_EXISTS: wire.FLAG_PREFIX}
        srv.frames = FrameCore(store, srv.core, ops, "ucx")
    srv.start()
    print(json.dumps({"ucx": srv.port}), flush=True)
    sys.stdin.read()
    srv.stop(1.0)
finally:
    store.close()
    arena.close()
"""


@pytest.mark.skipif(not ucx.available(), reason=NO_UCX)
@pytest.mark.parametrize("old", [False, True], ids=["new", "old"])
def test_where_over_ucx_against_a_worker_that_predates_the_flag(old: bool) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "client"), str(root / "bench")])
    proc = subprocess.Popen(
        [sys.executable, "-c", UCX_SERVER, "old" if old else "new", NS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        cwd=root,
    )
    assert proc.stdin is not None and proc.stdout is not None
    pool = None
    try:
        port = json.loads(proc.stdout.readline())["ucx"]
        pool = ucx.UcxPool("127.0.0.1", port)
        keys = [key(i, "ucx-where") for i in range(20)]
        want = [WHERE_UNKNOWN if old else WHERE_DRAM] * 10 + [WHERE_ABSENT] * 10
        assert pool.where(5.0, NSB, keys).tolist() == want
        assert pool.where_support.asks is not old
        assert pool.where(5.0, NSB, keys).tolist() == want, "then plain EXISTS"
        assert pool.exists(5.0, NSB, keys) == [True] * 10 + [False] * 10
    finally:
        if pool is not None:
            pool.close()
        proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
