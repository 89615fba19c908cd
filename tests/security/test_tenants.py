"""Tenants: tokens on every call, namespaces by prefix, byte quotas (real worker processes)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvstore.auth import Tenants, token_digest
from kvstore.cluster import LocalCluster
from kvstore_client import Client, InvalidArgument, PermissionDenied, ResourceExhausted
from kvstore_client.errors import Unauthenticated
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

TENANTS = f"""
tenants:
  - name: team-a
    token_sha256: {token_digest("token-a")}
    namespaces: [team-a]
    quota: 2MiB
  - name: team-b
    token: token-b
    namespaces: [team-b, shared/b]
  - name: ops
    token: token-ops
    admin: true
"""


@pytest.fixture
def secured(make_cluster: MakeCluster, tmp_path: Path) -> LocalCluster:
    f = tmp_path / "tenants.yaml"
    f.write_text(TENANTS)
    return make_cluster(
        workers=1,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_worker_args=["--tenants-file", str(f), "--token", "token-ops"],
    )


def test_tenants_file_parsing(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(TENANTS)
    t = Tenants.load(str(f))
    a = t.authenticate("token-a")
    assert a.owns("team-a") and a.owns("team-a/llama/tp0") and not a.owns("team-ab")
    assert t.authenticate("token-ops").owns("anything")
    with pytest.raises(Unauthenticated):
        t.authenticate("nope")
    with pytest.raises(Unauthenticated):
        t.authenticate(None)
    f.write_text("tenants:\n  - name: x\n    token: t\n    namespacez: [x]\n")
    with pytest.raises(InvalidArgument, match="unknown keys"):
        Tenants.load(str(f))


def test_tokens_namespaces_and_quotas(secured: LocalCluster) -> None:
    with Client(secured.address, token="token-a") as a:
        k = [key(i, "a") for i in range(3)]
        assert a.batch_put("team-a/m", k[:1], [b"x" * 1000]) == [True]
        assert a.batch_get("team-a/m", k[:1]) == [b"x" * 1000]
        with pytest.raises(PermissionDenied, match="does not own"):
            a.batch_put("team-b/m", k[:1], [b"y"])
        with pytest.raises(PermissionDenied):
            a.batch_get("team-b/m", k[:1])
        # 2 MiB quota: two 1 MiB blocks do not fit next to the first one.
        assert a.batch_put("team-a/m", [k[1]], [bytes(1 << 20)]) == [True]
        with pytest.raises(ResourceExhausted, match="quota"):
            a.batch_put("team-a/m", [k[2]], [bytes(1 << 20)])
        assert a.remove("team-a/m", [k[1]]) == 1
        assert a.batch_put("team-a/m", [k[2]], [bytes(1 << 20)]) == [True], "removal refunds"
    with Client(secured.address, token="token-b") as b:
        assert b.batch_put("shared/b/x", [key(1, "b")], [b"b"]) == [True]
        with pytest.raises(PermissionDenied):
            b.batch_exists("team-a/m", [key(0, "a")])
    with Client(secured.address, token="token-ops") as ops:
        assert ops.batch_get("team-a/m", [key(0, "a")]) == [b"x" * 1000], "admin sees all"


@pytest.mark.parametrize("token", ["", "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(secured: LocalCluster, token: str) -> None:
    with Client(secured.address, token=token) as c:
        with pytest.raises(Unauthenticated):
            c.batch_put("team-a/m", [key(1)], [b"x"])
        with pytest.raises(Unauthenticated):
            c.batch_get("team-a/m", [key(1)])


def test_grpc_codes_for_auth(secured: LocalCluster) -> None:
    with grpc.insecure_channel(secured.worker_procs[0].ready["grpc"]) as ch:
        stub = store_pb2_grpc.StoreStub(ch)
        req = store_pb2.ExistsRequest(namespace="team-a/m", hashes=key(1))
        with pytest.raises(grpc.RpcError) as e:
            stub.Exists(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.Exists(req, timeout=5, metadata=(("authorization", "Bearer token-b"),))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        r = stub.Exists(req, timeout=5, metadata=(("authorization", "Bearer token-a"),))
        assert r.count == 1
        v = value_for(key(2), 10)
        put = store_pb2.PutRequest(namespace="team-a/m", hashes=key(2), values=[v])
        assert stub.Put(put, timeout=5, metadata=(("authorization", "Bearer token-a"),))
