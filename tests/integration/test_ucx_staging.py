"""ucx:// staging (the copy area of packed frames, wire.FLAG_PACKED) is bounded per
worker and given back when idle: six client processes reading 1,024 x 64 KiB at once
cost the worker at most its staging bound, and nothing once they are idle. A real
`kvstore worker --ucx-port 0` and real ucx:// Client processes over loopback (UCX's
tcp transport); the worker's resident memory is read from /proc/PID/status (its arena
is pre-faulted at start, so it is part of the baseline)."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore_client import Client
from kvstore_client.transport import ucx
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

if not ucx.available():
    pytest.skip(
        "ucxx is not importable: install the optional extra (pip install 'kvstore-cache[ucx]')",
        allow_module_level=True,
    )

NS = "m/bf16/b16/tp0of1"
MIB = 1 << 20
BLOCK = 64 << 10
BLOCKS = 1024  # 64 MiB: the most one packed frame carried before (wire.MAX_PACKED)
CLIENTS = 6
STAGING = 64 * MIB  # kvstore.worker.transfer.ucx.STAGING_BYTES
ROOT = Path(__file__).resolve().parents[2]
IDLE = 3.0  # seconds: past the staging pool's idle time (ucxcodec.STAGING_IDLE_S)

READER = """
import json, sys
from kvstore_client import Client
from tests.helpers import key, value_for
master, ns, block, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keys = [key(i, "staging") for i in range(blocks)]
ok = 0
with Client(master, transport="ucx") as c:
    for _ in range(3):
        bufs = [memoryview(bytearray(block)) for _ in keys]
        got = c.batch_get_into(ns, keys, bufs).result()
        ok += sum(g and b.tobytes() == value_for(k, block) for g, b, k in zip(got, bufs, keys))
    print(json.dumps(ok), flush=True)
    sys.stdin.readline()  # stays connected, idle, until told to go
"""


def rss(pid: int) -> int:
    """Resident bytes of the process (its arena is pre-faulted at start: a constant)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


def test_packed_reads_by_many_clients_cost_the_worker_bounded_staging_given_back(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(
        workers=1,
        dram_size="160MiB",
        max_value_size="1MiB",
        extra_worker_args=["--ucx-port", "0"],
    )
    pid = cluster.worker_procs[0].pid
    keys = [key(i, "staging") for i in range(BLOCKS)]
    with Client(cluster.address, transport="ucx") as c:
        assert c.batch_put(NS, keys, [value_for(k, BLOCK) for k in keys]) == [True] * BLOCKS
    time.sleep(IDLE)
    base = rss(pid)
    args = [cluster.address, NS, str(BLOCK), str(BLOCKS)]
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(CLIENTS)
    ]
    try:
        peak = base
        with cf.ThreadPoolExecutor(CLIENTS) as ex:
            reads = [ex.submit(r.stdout.readline) for r in readers]  # type: ignore[union-attr]
            while not all(f.done() for f in reads):
                peak = max(peak, rss(pid))
                time.sleep(0.01)
            assert [f.result().strip() for f in reads] == [str(3 * BLOCKS)] * CLIENTS
        grew = peak - base
        time.sleep(IDLE)  # the clients stay connected, idle: the staging goes back
        left = rss(pid) - base
    finally:
        for r in readers:
            r.communicate("go\n", timeout=60)
    print(f"worker RSS: base {base / MIB:.0f} MiB, peak +{grew / MIB:.0f} MiB,"
          f" idle +{left / MIB:.0f} MiB")  # fmt: skip
    assert all(r.returncode == 0 for r in readers)
    assert grew <= STAGING + 16 * MIB, f"reading cost the worker {grew / MIB:.0f} MiB at its peak"
    assert left <= 8 * MIB, f"the worker kept {left / MIB:.0f} MiB after the reads"


def test_packed_streams_of_many_chunks_round_trip_exactly() -> None:
    """Packed PUTs of ~7.5 MB (two PACK_CHUNK messages each) and a packed GET of ~15 MB
    (four), blocks straddling the messages, empty values among them: bytes come back
    exactly into buffers, parts and fresh values; a wrong-size buffer and an absent
    key are misses."""
    from kvstore_client import wire
    from kvstore_client.transport.ucxcodec import PACK_CHUNK, chunk_sizes
    from tests.integration.test_ucx import NS as RAW_NS
    from tests.integration.test_ucx import Server

    s = Server()
    pool = ucx.UcxPool("127.0.0.1", s.port)
    try:
        keys = [key(i, "chunks") for i in range(300)]
        vals = [value_for(k, 0 if i % 50 == 7 else 50_001 + i) for i, k in enumerate(keys)]
        total = sum(len(v) for v in vals)
        assert len(chunk_sizes(total)) == 4 and total % PACK_CHUNK
        assert ucx.packs([memoryview(v) for v in vals])
        sums = [wire.block_checksum(v) for v in vals]
        for a, b in ((0, 150), (150, 300)):  # a connection may hold 8 MiB: two PUTs
            status = pool.put(30.0, RAW_NS, keys[a:b], vals[a:b], sums[a:b])
            assert status == bytes([wire.PUT_STORED] * (b - a))
        bufs: list[memoryview | list[memoryview]] = [memoryview(bytearray(len(v))) for v in vals]
        bufs[100] = memoryview(bytearray(len(vals[100]) - 1))  # wrong size: a miss
        whole = bytearray(len(vals[200]))
        bufs[200] = [memoryview(whole)[:7], memoryview(whole)[7:]]  # parts
        absent = key(0, "chunks-absent")
        got = pool.get(30.0, RAW_NS, [*keys, absent], [*bufs, memoryview(bytearray(9))])
        want = [True] * 300 + [False]
        want[100] = False
        assert got.found == want
        for i, (b, v) in enumerate(zip(bufs, vals, strict=True)):
            if i == 200:
                assert bytes(whole) == v
            elif i != 100:
                assert isinstance(b, memoryview) and b.tobytes() == v, i
        fresh = pool.get(30.0, RAW_NS, keys, None)
        assert [bytes(v) if v is not None else None for v in fresh.values] == vals
        assert s.stats()["checksum_errors"] == 0 and s.alive()
    finally:
        pool.close()
        s.stop()
