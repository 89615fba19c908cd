"""Cluster-wide calls with tenants: ClusterStatus is for admin tenants only (it shows
every worker's endpoints and stats), the shard map stays readable by every tenant,
and RemoveNamespace("t") removes "t" and everything under "t/" (the ownership rule),
never a look-alike such as "tx"."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client, PermissionDenied
from kvstore_client.proto import master_pb2, master_pb2_grpc, store_pb2, store_pb2_grpc
from tests.conftest import MakeCluster
from tests.helpers import key

TENANTS = """
tenants:
  - name: team-a
    token: token-a
    namespaces: [t, other]
  - name: ops
    token: token-ops
    admin: true
"""


@pytest.fixture
def secured(make_cluster: MakeCluster, tmp_path: Path) -> LocalCluster:
    f = tmp_path / "tenants.yaml"
    f.write_text(TENANTS)
    return make_cluster(
        workers=2,
        dram_size="64MiB",
        max_value_size="1MiB",
        token="token-ops",
        extra_master_args=["--tenants-file", str(f)],
        extra_worker_args=["--tenants-file", str(f), "--token", "token-ops"],
    )


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def test_cluster_status_is_admin_only(secured: LocalCluster) -> None:
    with grpc.insecure_channel(secured.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=5,
                               metadata=bearer("token-a"))  # fmt: skip
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin" in (e.value.details() or "")
        st = stub.ClusterStatus(
            master_pb2.ClusterStatusRequest(), timeout=5, metadata=bearer("token-ops")
        )
        assert len(st.workers) == 2
        # The map is what every client routes with: any tenant may read it.
        m = stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=5, metadata=bearer("token-a"))
        assert len(m.workers) == 2
    with Client(secured.address, token="token-a") as c, pytest.raises(PermissionDenied):
        c.cluster_status()


def fill(c: Client, namespaces: list[str]) -> None:
    for ns in namespaces:
        hs = [key(i, ns) for i in range(16)]
        assert all(c.batch_put(ns, hs, [ns.encode()] * 16))


def present(c: Client, ns: str) -> int:
    return sum(c.batch_exists(ns, [key(i, ns) for i in range(16)]))


def test_remove_namespace_takes_the_subtree_and_nothing_else(secured: LocalCluster) -> None:
    with Client(secured.address, token="token-a") as a:
        fill(a, ["t", "t/x", "t/x/y", "other", "other/t"])
        assert a.remove_namespace("t") == 48
        assert [present(a, ns) for ns in ("t", "t/x", "t/x/y")] == [0, 0, 0]
        assert present(a, "other") == 16 and present(a, "other/t") == 16
        assert a.remove_namespace("other/t") == 16 and present(a, "other") == 16
        with pytest.raises(PermissionDenied):
            a.remove_namespace("tx")
    with Client(secured.address, token="token-ops") as ops:
        fill(ops, ["tx", "tx/1"])
        assert ops.remove_namespace("t") == 0, "a look-alike prefix is not below 't'"
        assert present(ops, "tx") == 16


def test_remove_namespace_over_grpc_counts_every_level(secured: LocalCluster) -> None:
    with Client(secured.address, token="token-ops") as ops:
        fill(ops, ["t", "t/x"])
    removed = 0
    for w in secured.worker_procs:
        with grpc.insecure_channel(w.ready["grpc"]) as ch:
            r = store_pb2_grpc.StoreStub(ch).RemoveNamespace(
                store_pb2.RemoveNamespaceRequest(namespace="t"),
                timeout=5,
                metadata=bearer("token-a"),
            )
            removed += r.removed
    assert removed == 32


def test_drain_is_admin_only_and_works_with_tokens(secured: LocalCluster) -> None:
    """Master.Drain and the worker's Store.HandOff: a tenant that is not admin gets
    PERMISSION_DENIED from both; an admin drains (the master passes its token on to
    the worker, whose hand-off client uses the worker's own token)."""
    wids = [w.ready["id"] for w in secured.worker_procs]
    with grpc.insecure_channel(secured.worker_procs[0].ready["grpc"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            store_pb2_grpc.StoreStub(ch).HandOff(
                store_pb2.HandOffRequest(), timeout=5, metadata=bearer("token-a")
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with Client(secured.address, token="token-a") as c:
        fill(c, ["t"])
    with grpc.insecure_channel(secured.address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Drain(master_pb2.DrainRequest(worker_id=wids[0]), timeout=30,
                       metadata=bearer("token-a"))  # fmt: skip
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        r = stub.Drain(master_pb2.DrainRequest(worker_id=wids[0], timeout_s=30), timeout=60,
                       metadata=bearer("token-ops"))  # fmt: skip
    assert r.kept_blocks == 0
    with Client(secured.address, token="token-a") as c:
        assert [w.id for w in c.workers()] == [wids[1]]
        assert present(c, "t") == 16
