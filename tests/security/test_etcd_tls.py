"""HA masters on an etcd that serves TLS only and requires client certificates
(Debian's etcd-server, certificates made here by openssl): the master leads and
persists membership over https:// with --etcd-ca/--etcd-cert/--etcd-key; a client
without a certificate, with the wrong CA, or speaking plain text gets nothing."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.cluster import spawn, start_etcd
from kvstore.errors import InvalidArgument
from kvstore.master.etcd import EtcdClient, EtcdTls, EtcdUnavailable
from kvstore_client.proto import master_pb2, master_pb2_grpc
from tests.conftest import arena_files

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


def make_cert(d: Path, name: str, ca: str) -> None:
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
             cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("etcd-pki")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    for name in ("server", "client"):
        make_cert(d, name, "ca")
    make_cert(d, "stranger", "other-ca")  # a client certificate from another CA
    return d


@pytest.fixture(scope="module")
def etcd_tls(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An etcd serving https:// only, with --client-cert-auth; yields its URL."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed: run scripts/install_etcd.sh (Debian etcd-server)")
    pytest.importorskip("pyetcd", reason="etcd-sdk-python (import pyetcd) is not installed")
    work = tmp_path_factory.mktemp("etcd-tls")
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    etcd = start_etcd(
        work,
        name="kvtls",
        tls_args=[
            *("--cert-file", str(pki / "server.pem")),
            *("--key-file", str(pki / "server.key")),
            *("--trusted-ca-file", str(pki / "ca.pem"), "--client-cert-auth"),
        ],
        context=ctx,
    )
    try:
        yield etcd.url
    finally:
        etcd.stop()


def tls_files(pki: Path, client: str = "client", ca: str = "ca") -> EtcdTls:
    return EtcdTls.from_files(
        str(pki / f"{ca}.pem"), str(pki / f"{client}.pem"), str(pki / f"{client}.key")
    )


async def lease(url: str, tls: EtcdTls | None) -> int:
    etcd = EtcdClient(url, timeout=2.0, tls=tls)
    try:
        lid = await etcd.grant(5)
        await etcd.revoke(lid)
        return lid
    finally:
        await etcd.close()


def test_the_etcd_client_speaks_tls_with_a_client_certificate(pki: Path, etcd_tls: str) -> None:
    assert asyncio.run(lease(etcd_tls, tls_files(pki))) > 0
    no_cert = EtcdTls.from_files(str(pki / "ca.pem"))
    for bad in (no_cert, tls_files(pki, client="stranger"), tls_files(pki, ca="other-ca")):
        with pytest.raises(EtcdUnavailable):
            asyncio.run(lease(etcd_tls, bad))
    plain = etcd_tls.replace("https://", "http://")
    with pytest.raises(EtcdUnavailable):
        asyncio.run(lease(plain, None))


def test_tls_settings_are_checked(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="both --etcd-cert and --etcd-key"):
        EtcdTls.from_files(str(pki / "ca.pem"), str(pki / "client.pem"))
    with pytest.raises(InvalidArgument, match=r"--etcd-ca .*missing\.pem"):
        EtcdTls.from_files(str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(InvalidArgument, match="not a PEM file"):
        EtcdTls.from_files(str(tmp_path / "junk.pem"))
    with pytest.raises(InvalidArgument, match="endpoints are http://"):
        EtcdClient("http://127.0.0.1:2379", tls=tls_files(pki))


def test_ha_master_on_etcd_over_tls(pki: Path, etcd_tls: str, tmp_path: Path) -> None:
    master = spawn(
        "master",
        [
            *("--host", "127.0.0.1", "--port", "0", "--worker-ttl", "5s"),
            *("--etcd", etcd_tls, "--cluster-id", "tls-test"),
            *("--etcd-ca", str(pki / "ca.pem")),
            *("--etcd-cert", str(pki / "client.pem"), "--etcd-key", str(pki / "client.key")),
        ],
        log_path=str(tmp_path / "master.log"),
    )
    worker = None
    try:
        with grpc.insecure_channel(master.address) as ch:
            stub = master_pb2_grpc.MasterStub(ch)
            deadline = time.monotonic() + 20
            while not stub.ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=5).leader:
                assert time.monotonic() < deadline, "the master leads through etcd over TLS"
                time.sleep(0.1)
            worker = spawn(
                "worker",
                [
                    *("--master", master.address, "--host", "127.0.0.1"),
                    *("--dram-size", "64MiB", "--max-value-size", "1MiB", "--id", "tls-w0"),
                ],
                log_path=str(tmp_path / "worker.log"),
            )
            while [w.id for w in stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=5)
                   .workers] != ["tls-w0"]:  # fmt: skip
                assert time.monotonic() < deadline + 20
                time.sleep(0.1)

        async def persisted() -> list[bytes]:
            etcd = EtcdClient(etcd_tls, tls=tls_files(pki))
            try:
                _, kvs = await etcd.get_prefix(b"/kvstore/tls-test/workers/")
                return [kv.key for kv in kvs]
            finally:
                await etcd.close()

        assert asyncio.run(persisted()) == [b"/kvstore/tls-test/workers/tls-w0"]
    finally:
        if worker is not None:
            worker.stop()
            assert not arena_files(worker.pid)
        master.stop()


def test_master_without_client_certificate_fails_with_one_line(
    pki: Path, etcd_tls: str, tmp_path: Path
) -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "kvstore", "master", "--port", "0", "--etcd", etcd_tls),
            *("--etcd-ca", str(pki / "ca.pem"), "--etcd-cert", str(pki / "client.pem")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "both --etcd-cert and --etcd-key" in out.stderr and "Traceback" not in out.stderr
