"""A real master at the highest ring density it accepts, with 80 registered 64 GiB
workers and registrations that overstate their capacity: the master refuses the
impossible one and logs one line for each refusal and each outsized worker; a real
Client builds a ring of at most MAX_RING_POINTS points in which the outsized worker
holds a bounded share. (The workers are registrations only: the Client routes, it
does not connect, so no worker process is needed.)"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.cluster import LocalCluster
from kvstore.config import MAX_VNODES_PER_GIB
from kvstore.master.membership import MAX_CAPACITY
from kvstore_client import Client
from kvstore_client.proto import master_pb2, master_pb2_grpc
from kvstore_client.sharding import MAX_RING_POINTS
from tests.conftest import MakeCluster
from tests.helpers import key

GiB = 1 << 30
LIAR = (1 << 64) - 1


def info(name: str, i: int, capacity: int) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(
        id=name,
        grpc=f"127.0.0.1:{20000 + i}",
        endpoints=[f"tcp://127.0.0.1:{30000 + i}"],
        capacity_bytes=capacity,
        max_value_bytes=1 << 20,
    )


def register(stub: master_pb2_grpc.MasterStub, w: master_pb2.WorkerInfo, instance: str) -> None:
    stub.Register(master_pb2.RegisterRequest(worker=w, instance=instance), timeout=10)


def master_log(cluster: LocalCluster) -> list[str]:
    return Path(cluster.master.log_path or "").read_text().splitlines()  # type: ignore[union-attr]


def test_the_densest_ring_the_master_accepts_stays_bounded(make_cluster: MakeCluster) -> None:
    """80 workers of 64 GiB at --vnodes-per-gib 2^20: each at the per-worker maximum
    would be 5.2M points; the client builds at most MAX_RING_POINTS, equal shares."""
    cluster = make_cluster(
        workers=0,
        worker_ttl="120s",
        extra_master_args=["--vnodes-per-gib", str(MAX_VNODES_PER_GIB)],
    )
    with grpc.insecure_channel(cluster.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        for i in range(80):
            register(stub, info(f"w{i:03d}", i, 64 * GiB), f"{i:032d}")
    with Client(cluster.address, transport="tcp", timeout=10) as c:
        ring = c._view.ring  # type: ignore[union-attr]
        assert len(ring.worker_ids) == 80
        assert len(ring.points) <= MAX_RING_POINTS
        per = np.bincount(ring.owners[:, 0])
        assert per.min() == per.max()
    scaled = [ln for ln in master_log(cluster) if "would exceed" in ln]
    assert len(scaled) == 1, "one line says the ring is scaled (not one per join)"


def test_an_overstated_capacity_is_refused_or_bounded(make_cluster: MakeCluster) -> None:
    """2^64-1 bytes is refused (INVALID_ARGUMENT, one log line); 1 PiB is accepted
    and counted as 8 median workers (one log line), not as the whole ring."""
    cluster = make_cluster(workers=0, worker_ttl="120s")
    with grpc.insecure_channel(cluster.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        for i in range(8):
            register(stub, info(f"w{i:03d}", i, 64 * GiB), f"{i:032d}")
        with pytest.raises(grpc.RpcError) as e:
            register(stub, info("liar", 98, LIAR), "l" * 32)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the limit" in (e.value.details() or "")
        register(stub, info("big", 99, MAX_CAPACITY), "b" * 32)
    with Client(cluster.address, transport="tcp", timeout=10) as c:
        ring = c._view.ring  # type: ignore[union-attr]
        assert len(ring.worker_ids) == 9 and "liar" not in ring.worker_ids
        keys = [key(i, "hostile-map") for i in range(20_000)]
        big_share = float((ring.primary(keys) == ring.worker_ids.index("big")).mean())
        assert big_share < 0.55, big_share  # 8 median workers of 16: about half
        per = np.bincount(ring.owners[:, 0])
        assert per.max() == 8 * np.median(per), "the outsized worker: 8 median workers"
    lines = master_log(cluster)
    refused = [ln for ln in lines if "refused Register for worker 'liar'" in ln]
    assert len(refused) == 1 and "18446744073709551615" in refused[0], refused
    noted = [ln for ln in lines if "worker big registers" in ln]
    assert len(noted) == 1 and "more than 8x the median worker" in noted[0], noted
