"""tcp:// and shm:// move the same bytes; shm is chosen on the same host and only when
the arena file may be opened; a client dying mid-transfer leaks nothing."""

from __future__ import annotations

import os
import stat
import subprocess

import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, InvalidArgument
from kvstore_client.transport import shm
from tests.conftest import MakeCluster
from tests.helpers import corrupt_arena, key, run_client_process, value_for

NS = "m/bf16/b16/tp0of1"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("size", [100, 4096, 64 * 1024, 1 << 20])
def test_round_trip(shared_cluster: LocalCluster, transport: str, size: int) -> None:
    cluster = shared_cluster
    keys = [key(i, f"{transport}{size}") for i in range(40)]
    vals = [value_for(k, size) for k in keys]
    with Client(cluster.address, transport=transport) as c:
        assert all((w.arena is not None) == (transport == "shm") for w in c._view.workers)  # type: ignore[union-attr]
        assert c.batch_put(NS, keys, vals) == [True] * 40
        assert c.batch_put(NS, keys[:5], vals[:5]) == [False] * 5
        assert c.batch_get(NS, [*keys, key(0, "absent")]) == [*vals, None]
        out = np.zeros((40, size), dtype=np.uint8)
        assert c.batch_get_into(NS, keys, [r.data for r in out]).result() == [True] * 40
        assert all(out[i].tobytes() == vals[i] for i in range(40))
    other = "tcp" if transport == "shm" else "shm"
    with Client(cluster.address, transport=other) as c:
        assert c.batch_get(NS, keys) == vals, "both transports see the same blocks"


def test_auto_picks_shm_on_this_host_and_env_forces_tcp(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Client(cluster.address) as c:
        assert c.transport == "auto"
        assert all(w.arena is not None for w in c._view.workers)  # type: ignore[union-attr]
    monkeypatch.setenv("KVSTORE_TRANSPORT", "tcp")
    with Client(cluster.address) as c:
        assert all(w.arena is None for w in c._view.workers)  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="unknown transport"):
        Client(cluster.address, transport="carrier-pigeon")


def test_shm_needs_the_same_host_and_file_permission(cluster: LocalCluster) -> None:
    info = None
    with Client(cluster.address) as c:
        info = c.workers()[0]
    urls = list(info.endpoints)
    shm_urls = [u for u in urls if u.startswith("shm://")]
    assert shm_urls and "tcp://" in urls[0]
    path = shm.parse_shm_url(shm_urls[0]).path
    assert os.stat(path).st_mode & 0o777 == 0o600, "only the worker's user may map the arena"
    assert stat.S_ISSOCK(os.stat(path).st_mode), "a hand-over socket, not the arena itself"
    assert shm.try_map([shm_urls[0].replace("host=", "host=elsewhere")]) is None
    if os.geteuid() == 0:
        # An unprivileged user cannot open it, so such a client falls back to tcp://.
        code = (
            "import sys; sys.path.insert(0, 'client');"
            "from kvstore_client.transport import shm;"
            f"print(shm.try_map({shm_urls!r}) is None)"
        )
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "python3", "-c", code],
            capture_output=True,
            text=True,
            cwd=os.getcwd(),
        )
        if out.returncode == 0:
            assert out.stdout.strip() == "True"


def test_client_killed_mid_shm_put_leaves_nothing_visible(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="64MiB", max_value_size="1MiB")
    # A client writes 32 blocks into its inbox, sends half a PUT_INBOX and dies.
    run_client_process(
        """
import os
from kvstore_client import Client
from kvstore_client import wire
from helpers import key
with Client(PARAMS["master"]) as c:
    w = c._view.workers[0]
    inbox = w.arena.inbox
    assert inbox is not None
    inbox.array[: 32 << 20] = 7
    conn = w.pool.take(5)
    entries = b"".join(
        wire.INBOX_ENTRY.pack(key(i, "dead"), 1 << 20, 0, i << 20) for i in range(32)
    )
    head = wire.encode_request_header(wire.OP_PUT_INBOX, PARAMS["ns"].encode(), 32, 1)
    wire.send_buffers(conn.sock, [head, entries[: len(entries) // 2]])
    RESULT = True
    import json, sys
    print("RESULT=" + json.dumps(RESULT), flush=True)
    os._exit(0)
""",
        master=cluster.address,
        ns=NS,
    )
    keys = [key(i, "dead") for i in range(32)]
    with Client(cluster.address) as c:
        assert c.batch_exists(NS, keys) == [False] * 32, "unpublished blocks never appear"
        # All 64 MiB of DRAM is usable: nothing stays reserved for the dead client.
        fresh = [key(i, "fresh") for i in range(60)]
        for s in range(0, 60, 10):
            part = fresh[s : s + 10]
            assert all(c.batch_put(NS, part, [value_for(k, 1 << 20) for k in part]))


def test_corrupted_dram_block_is_a_miss_on_every_path(cluster: LocalCluster) -> None:
    """Flip a byte of a stored block inside the worker's arena: tcp://, shm:// and
    gRPC readers all get a miss, never the wrong bytes."""
    import grpc

    from kvstore_client.proto import store_pb2, store_pb2_grpc

    keys = [key(i, "rot") for i in range(8)]
    vals = [value_for(k, 64 * 1024) for k in keys]
    with Client(cluster.address, transport="tcp") as c:
        assert all(c.batch_put(NS, keys, vals))
    flipped = 0
    for w in cluster.worker_procs:
        # Memory gone bad under the block (no client can write the sealed arena).
        if corrupt_arena(w.proc.pid, vals[0][:4096]):
            flipped += 1
            grpc_addr = w.ready["grpc"]
    assert flipped == 1
    for transport in ("tcp", "shm"):
        with Client(cluster.address, transport=transport) as c:
            got = c.batch_get(NS, keys)
            assert got[0] is None, f"{transport}: a corrupt block is a miss"
            assert got[1:] == vals[1:]
    with grpc.insecure_channel(grpc_addr) as ch:
        r = store_pb2_grpc.StoreStub(ch).Get(
            store_pb2.GetRequest(namespace=NS, hashes=keys[0]), timeout=5
        )
        assert r.found_bitmap == b"\x00", "the worker's own check drops it on the gRPC path"


def w_endpoints(cluster: LocalCluster, worker_id: str) -> list[str]:
    with Client(cluster.address) as c:
        return next(list(w.endpoints) for w in c.workers() if w.id == worker_id)
