"""TLS on every connection (gRPC to master and workers, the transfer plane), mutual TLS,
and tenant tokens on the master — with real certificates made by openssl."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.errors import Unauthenticated, Unavailable
from kvstore_client.security import Tls
from tests.conftest import MakeCluster
from tests.helpers import key, value_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kvstore-test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


def tls_args(d: Path, mutual: bool) -> list[str]:
    args = [
        "--tls-cert",
        str(d / "server.pem"),
        "--tls-key",
        str(d / "server.key"),
        "--tls-ca",
        str(d / "ca.pem"),
    ]
    return [*args, "--tls-client-auth"] if mutual else args


def start(
    make_cluster: MakeCluster,
    d: Path,
    mutual: bool,
    extra: list[str] | None = None,
    token: str = "",
) -> LocalCluster:
    # Daemons present the server certificate to each other; with mutual TLS it also
    # serves as the worker's client certificate towards the master (same CA).
    args = tls_args(d, mutual)
    return make_cluster(
        workers=2,
        dram_size="64MiB",
        max_value_size="1MiB",
        extra_master_args=[*args, *(extra or [])],
        extra_worker_args=[*args, *(["--token", token] if token else [])],
        tls=Tls(str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key")),
        token=token,
    )


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_end_to_end(make_cluster: MakeCluster, pki: Path, mutual: bool) -> None:
    cluster = start(make_cluster, pki, mutual)
    keys = [key(i, "tls") for i in range(20)]
    vals = [value_for(k, 200_000) for k in keys]
    client_tls = Tls(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
    with Client(cluster.address, tls=client_tls, transport="tcp") as c:
        assert c.batch_put("tls/ns", keys, vals) == [True] * 20
        assert c.batch_get("tls/ns", keys) == vals, "bytes round-trip over TLS"
    # No TLS at all: the master refuses the plaintext connection.
    with pytest.raises(Unavailable):
        Client(cluster.address, tls=Tls(), timeout=2)
    if mutual:  # TLS without a client certificate is refused too
        with pytest.raises(Unavailable):
            Client(cluster.address, tls=Tls(str(pki / "ca.pem")), timeout=2)


def test_master_requires_tokens_and_admin_for_membership(
    make_cluster: MakeCluster, pki: Path, tmp_path: Path
) -> None:
    f = tmp_path / "tenants.yaml"
    f.write_text(
        "tenants:\n"
        "  - {name: app, token: tok-app, namespaces: [app]}\n"
        "  - {name: ops, token: tok-ops, admin: true}\n"
    )
    cluster = start(make_cluster, pki, False, ["--tenants-file", str(f)], token="tok-ops")
    client_tls = Tls(str(pki / "ca.pem"))
    with pytest.raises(Unauthenticated):
        Client(cluster.address, tls=client_tls, token="nope", timeout=2)
    with Client(cluster.address, tls=client_tls, token="tok-app") as c:
        assert len(c.workers()) == 2, "workers with the admin token registered"
        assert c.batch_put("app/x", [key(1)], [b"ok"]) is not None
    import grpc

    from kvstore_client.proto import master_pb2, master_pb2_grpc
    from kvstore_client.security import metadata, open_channel

    with open_channel(cluster.address, client_tls) as ch:
        with pytest.raises(grpc.RpcError) as e:
            master_pb2_grpc.MasterStub(ch).Leave(
                master_pb2.LeaveRequest(worker_id="w"), timeout=5, metadata=metadata("tok-app")
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
