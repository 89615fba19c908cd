"""`kvstore drain`: a worker leaves the map and hands its hot blocks to their next
owners without stopping; `kvstore status` shows a change at once, not one heartbeat
later (issue 43, item 9). Real master and workers on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

NS = "drain/bf16/b16/tp0of1"


def kv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=timeout
    )


def status(cluster: LocalCluster) -> dict[str, dict[str, object]]:
    out = kv("status", "--master", cluster.address, "--json", timeout=30)
    assert out.returncode == 0, out.stderr
    return {w["id"]: w for w in json.loads(out.stdout)["workers"]}


def keys_held(cluster: LocalCluster, i: int) -> int:
    with grpc.insecure_channel(cluster.worker_procs[i].ready["grpc"]) as ch:
        st = store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=5)
    return int(st.keys)


def test_drain_moves_hot_blocks_and_leaves_the_map(make_cluster: MakeCluster) -> None:
    # a long TTL: heartbeats come every 2.5 s, so nothing below waits for one
    cluster = make_cluster(workers=3, dram_size="128MiB", worker_ttl="10s")
    ids = [w.ready["id"] for w in cluster.worker_procs]
    keys = [key(i, "drain") for i in range(300)]
    vals = [value_for(k, 16 << 10) for k in keys]
    with Client(cluster.address, transport="tcp") as c:
        assert all(c.batch_put(NS, keys, vals))
    held = keys_held(cluster, 0)
    assert 0 < held < len(keys)
    # status reads each worker's counters: the puts show before any heartbeat
    before = status(cluster)
    assert sum(int(w["keys"]) for w in before.values()) == len(keys)  # type: ignore[call-overload]
    assert all(w["stats_from"] == "worker" and w["state"] == "serving" for w in before.values())

    out = kv("drain", ids[0], "--master", cluster.address, "--timeout", "60s")
    assert out.returncode == 0, out.stderr
    assert f"{held} blocks" in out.stdout and "0 kept" in out.stdout, out.stdout
    assert cluster.worker_procs[0].alive(), "a drained worker keeps running"

    after = status(cluster)
    assert after[ids[0]]["state"] == "draining"
    others = sum(int(after[i]["keys"]) for i in ids[1:])  # type: ignore[call-overload]
    assert others == len(keys), "every block is at an owner in the map"
    with Client(cluster.address, transport="tcp") as c:
        assert ids[0] not in {w.id for w in c.workers()}
        assert c.batch_get(NS, keys) == vals, "every block hits at its new owner"
    # it stays out of the map: its heartbeats say draining from now on
    time.sleep(3)
    with Client(cluster.address, transport="tcp") as c:
        assert ids[0] not in {w.id for w in c.workers()}
    assert kv("drain", ids[0], "--master", cluster.address).returncode == 0  # idempotent


def test_drain_refuses_what_it_cannot_do(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(workers=1, dram_size="64MiB")
    out = kv("drain", "no-such-worker", "--master", cluster.address)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = kv("drain", "x", "--master", cluster.address, "--timeout", "2h")
    assert out.returncode == 2 and "--timeout" in out.stderr, out.stderr
    # the last worker: it leaves the map, and keeps its blocks (no owner to take them)
    wid = cluster.worker_procs[0].ready["id"]
    with Client(cluster.address, transport="tcp") as c:
        assert all(c.batch_put(NS, [key(1)], [b"v"]))
    out = kv("drain", wid, "--master", cluster.address)
    assert out.returncode == 0 and "1 kept" in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("timeout", ["-1", "nan"])
def test_bad_hand_off_timeouts_are_invalid_argument(
    make_cluster: MakeCluster, timeout: str
) -> None:
    cluster = make_cluster(workers=1, dram_size="64MiB")
    with (
        grpc.insecure_channel(cluster.worker_procs[0].ready["grpc"]) as ch,
        pytest.raises(grpc.RpcError) as e,
    ):
        store_pb2_grpc.StoreStub(ch).HandOff(
            store_pb2.HandOffRequest(timeout_s=float(timeout)), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
