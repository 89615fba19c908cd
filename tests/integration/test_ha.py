"""HA masters on a real etcd (Debian's etcd-server, started here on loopback).

Three masters elect a leader; standbys mirror etcd, serve the map and forward
membership writes; SIGKILL of the leader hands over within the lease TTL while
a put/get load sees no errors and no misses. The first tests cover the pure
etcd layout (no etcd needed).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import cluster
from kvstore.cluster import Daemon, Etcd, free_port, spawn
from kvstore.master.membership import IdConflict, Membership
from kvstore.master.snapshot import (
    Layout,
    decode,
    decode_leader,
    diff,
    encode,
    encode_leader,
    prefix_end,
    restore,
)
from kvstore_client import Client
from kvstore_client.proto import master_pb2, master_pb2_grpc
from tests.conftest import arena_files
from tests.helpers import key, value_for

NS = "model/bf16/b16/tp0of1"
LEASE_TTL = 5.0  # the master's default


# ---- the etcd layout, without etcd --------------------------------------------------


def _info(i: str) -> master_pb2.WorkerInfo:
    return master_pb2.WorkerInfo(id=i, grpc=f"h:{i}", endpoints=[f"tcp://h:{i}"], capacity_bytes=1)


TOKEN_A, TOKEN_B = "a" * 32, "b" * 32  # instance tokens


def test_layout_round_trip_and_diff() -> None:
    lay = Layout("c1")
    m = Membership(ttl=10, cluster_id="c1")
    m.register(_info("a"), TOKEN_A, now=0)
    m.register(_info("b"), TOKEN_B, now=0)
    m.heartbeat("b", TOKEN_B, master_pb2.WorkerStats(), now=1, draining=True)
    kv = encode(lay, m)
    assert set(kv) == {
        b"/kvstore/c1/map_version",
        b"/kvstore/c1/workers/a",
        b"/kvstore/c1/workers/b",
    }
    snap = decode(lay, kv)
    assert snap.version == m.version
    assert snap.workers["a"] == (_info("a"), False, TOKEN_A), "the instance token is persisted"
    assert snap.workers["b"][1] is True, "draining survives a takeover"
    back = restore(snap, ttl=10, replicas=1, cluster_id="c1", now=100.0)
    assert back.shard_map() == m.shard_map()
    assert all(mem.seen == 100.0 for mem in back.members.values()), "a fresh TTL for all"
    assert back.members["a"].instance == TOKEN_A
    with pytest.raises(IdConflict):  # a new leader still refuses a takeover of a live id
        back.register(_info("a"), TOKEN_B, now=101.0)

    m.leave("a", TOKEN_A, now=2)
    m.register(_info("c"), TOKEN_A, now=2)
    puts, deletes = diff(kv, encode(lay, m), lay.version_key)
    assert deletes == [b"/kvstore/c1/workers/a"]
    assert [k for k, _ in puts] == [b"/kvstore/c1/workers/c", lay.version_key], "version last"
    assert diff(kv, kv, lay.version_key) == ([], [])


def test_layout_ignores_foreign_and_corrupt_keys() -> None:
    lay = Layout("c1")
    snap = decode(
        lay,
        [
            (b"/kvstore/c1/map_version", b"not a number"),
            (b"/kvstore/c1/workers/x", b"\xff\xff garbage"),
            (
                b"/kvstore/c1/workers/y",
                master_pb2.WorkerStatus(info=_info("z")).SerializeToString(),
            ),
            (b"/kvstore/c1/leader", encode_leader("h:1")),
        ],
    )
    assert snap.version == 0 and snap.workers == {}
    assert decode_leader(encode_leader("h:1")) == "h:1"
    assert decode_leader(b"{") == "" and decode_leader(b"[1]") == ""
    assert prefix_end(b"/a/") == b"/a0" and prefix_end(b"a\xff") == b"b"
    assert restore(snap, ttl=1, replicas=1, cluster_id="c1", now=0).version == 1
    # An entry written by an older master (a WorkerStatus, no token) still decodes.
    old = master_pb2.WorkerStatus(info=_info("o"), stats=master_pb2.WorkerStats(draining=True))
    snap = decode(lay, [(b"/kvstore/c1/workers/o", old.SerializeToString())])
    assert snap.workers == {"o": (_info("o"), True, "")}


def test_etcd_endpoints_are_checked() -> None:
    from kvstore.errors import InvalidArgument
    from kvstore.master.etcd import parse_endpoints

    assert parse_endpoints("http://a:1, b:2") == (["a:1", "b:2"], False)
    assert parse_endpoints("https://a:1,https://b:2/") == (["a:1", "b:2"], True)
    for bad in ("", "a", "http://a:b", "http://a:1/x", "http://a:1,https://b:2", "unixs://x"):
        with pytest.raises(InvalidArgument):
            parse_endpoints(bad)


# ---- a real etcd and real masters ---------------------------------------------------


def start_etcd(workdir: Path) -> Etcd:
    """An etcd on two free loopback ports with its data in ``workdir``."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed: run scripts/install_etcd.sh (Debian etcd-server)")
    pytest.importorskip("pyetcd", reason="etcd-sdk-python (import pyetcd) is not installed")
    return cluster.start_etcd(workdir, name="kvtest")


@dataclass
class HaCluster:
    etcd: Etcd
    tmp: Path
    masters: list[Daemon] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)
    workers: list[Daemon] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        return [m.address for m in self.masters]

    @property
    def master_list(self) -> str:
        return ",".join(self.addresses)

    def add_master(self, worker_ttl: str = "10s") -> Daemon:
        i = len(self.masters)
        for _ in range(3):  # a metrics port taken in between makes the master exit: retry
            port = free_port()
            try:
                d = spawn(
                    "master",
                    [
                        *("--host", "127.0.0.1", "--port", "0", "--etcd", self.etcd.url),
                        *("--worker-ttl", worker_ttl, "--metrics-port", str(port)),
                    ],
                    log_path=str(self.tmp / f"master{i}.log"),
                )
            except Exception:
                continue
            self.masters.append(d)
            self.metrics_ports.append(port)
            return d
        raise AssertionError(f"master {i} did not start; see {self.tmp}")

    def add_worker(self) -> Daemon:
        d = spawn(
            "worker",
            [
                *("--master", self.master_list, "--host", "127.0.0.1"),
                *("--dram-size", "64MiB", "--max-value-size", "1MiB"),
            ],
            log_path=str(self.tmp / f"worker{len(self.workers)}.log"),
        )
        self.workers.append(d)
        return d

    def stop(self) -> None:
        for d in [*self.workers, *self.masters]:
            d.stop()
        self.etcd.stop()
        for d in self.workers:
            assert not arena_files(d.pid), f"arena of worker {d.pid} left behind"


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[HaCluster]:
    c = HaCluster(start_etcd(tmp_path), tmp_path)
    try:
        yield c
    finally:
        c.stop()


def status(addr: str, timeout: float = 2.0) -> master_pb2.ClusterStatusResponse | None:
    try:
        with grpc.insecure_channel(addr) as ch:
            return master_pb2_grpc.MasterStub(ch).ClusterStatus(
                master_pb2.ClusterStatusRequest(), timeout=timeout
            )
    except grpc.RpcError:
        return None


def shard_map(addr: str) -> master_pb2.ShardMap:
    with grpc.insecure_channel(addr) as ch:
        return master_pb2_grpc.MasterStub(ch).GetShardMap(
            master_pb2.GetShardMapRequest(), timeout=5
        )


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> float:
    """Poll ``cond`` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def leaders(c: HaCluster, among: list[int]) -> list[int]:
    out = []
    for i in among:
        st = status(c.addresses[i], timeout=1.0)
        if st is not None and st.leader:
            out.append(i)
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def requests_by_code(text: str) -> dict[tuple[str, str], float]:
    """kvstore_requests_total by (op, code)."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "kvstore_requests_total":
                out[(smp.labels["op"], smp.labels["code"])] = smp.value
    return out


def kvstore_status(addr: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "status", "--master", addr, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_standbys_mirror_forward_and_take_over_on_sigterm(ha: HaCluster) -> None:
    for _ in range(2):
        ha.add_master(worker_ttl="60s")
    wait_for("a leader", lambda: len(leaders(ha, [0, 1])) == 1)
    lead = leaders(ha, [0, 1])[0]
    standby = 1 - lead
    with grpc.insecure_channel(ha.addresses[standby]) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        # A registration sent to the standby is forwarded to the leader, persisted in
        # etcd and mirrored back: both masters serve the same map.
        w = master_pb2.WorkerInfo(
            id="fake", grpc="127.0.0.1:9", endpoints=["tcp://127.0.0.1:9"], capacity_bytes=1 << 30
        )
        stub.Register(master_pb2.RegisterRequest(worker=w, instance=TOKEN_A), timeout=10)
        wait_for(
            "the mirror",
            lambda: [x.id for x in shard_map(ha.addresses[standby]).workers] == ["fake"],
        )
        assert shard_map(ha.addresses[lead]) == shard_map(ha.addresses[standby])
        # Heartbeats are never forwarded (a storm of them would load the standby and
        # the leader twice): a unary heartbeat and both streams end UNAVAILABLE and
        # name the leader, where the worker goes next.
        for beat in (
            lambda: stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="fake"), timeout=10),
            lambda: next(
                stub.HeartbeatStream(
                    iter([master_pb2.HeartbeatRequest(worker_id="fake", instance=TOKEN_A)]),
                    timeout=10,
                )
            ),
            lambda: next(
                stub.Beats(
                    iter([master_pb2.BeatBatch(alive=[0])]),
                    timeout=10,
                )
            ),
        ):
            with pytest.raises(grpc.RpcError) as e:
                beat()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            leader_md = dict(cast(grpc.Call, e.value).trailing_metadata() or ())
            assert leader_md["kvstore-leader"] == ha.addresses[lead]
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(master_pb2.RegisterRequest(worker=master_pb2.WorkerInfo()), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, "the leader's answer"
        with pytest.raises(grpc.RpcError) as e:  # never forwarded twice
            stub.Leave(
                master_pb2.LeaveRequest(worker_id="fake", instance=TOKEN_A),
                timeout=10,
                metadata=(("kvstore-forwarded", "x"),),
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ha.addresses[lead] in (e.value.details() or "")
        md = cast(grpc.Call, e.value).trailing_metadata() or ()
        trailer: dict[str, object] = {str(k): v for k, v in md}
        assert trailer.get("kvstore-leader") == ha.addresses[lead]
        st = status(ha.addresses[standby])
        assert st is not None and not st.leader and [x.info.id for x in st.workers] == ["fake"]
    version = shard_map(ha.addresses[lead]).version
    served = requests_by_code(scrape(ha.metrics_ports[standby]))
    assert served[("heartbeat", "UNAVAILABLE")] == 1 and served[("register", "OK")] == 1
    assert served[("leave", "UNAVAILABLE")] == 1
    assert gauge(scrape(ha.metrics_ports[standby]), "kvstore_heartbeats_total") == 0
    assert served[("register", "INVALID_ARGUMENT")] == 1, "the leader's code, passed on"
    assert gauge(scrape(ha.metrics_ports[lead]), "kvstore_master_leader") == 1
    assert gauge(scrape(ha.metrics_ports[standby]), "kvstore_master_leader") == 0
    # A clean stop revokes the lease: the standby leads at once, with the same map.
    ha.masters[lead].signal(signal.SIGTERM)
    assert ha.masters[lead].proc.wait(20) == 0
    took = wait_for("the standby to lead", lambda: leaders(ha, [standby]) == [standby], 10)
    assert took < 3.0, f"handover after SIGTERM took {took:.2f}s"
    m = shard_map(ha.addresses[standby])
    assert [x.id for x in m.workers] == ["fake"] and m.version == version
    assert gauge(scrape(ha.metrics_ports[standby]), "kvstore_master_leader") == 1


class Load(threading.Thread):
    """Steady put/get from one client: counts errors, wrong bytes and misses."""

    def __init__(self, client: Client) -> None:
        super().__init__(name="load", daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.rounds = 0
        self.errors: list[str] = []
        self.misses = 0
        self.not_stored = 0

    def run(self) -> None:
        prev: tuple[list[bytes], list[bytes]] | None = None
        i = 0
        while not self.stop.is_set():
            keys = [key(i * 8 + j, "ha-load") for j in range(8)]
            vals = [value_for(k, 16 * 1024) for k in keys]
            try:
                self.not_stored += sum(not ok for ok in self.client.batch_put(NS, keys, vals))
                if prev is not None:
                    got = self.client.batch_get(NS, prev[0])
                    self.misses += sum(g is None for g in got)
                    if any(g is not None and g != v for g, v in zip(got, prev[1], strict=True)):
                        self.errors.append("wrong bytes")
            except Exception as e:  # any exception is an error the test reports
                self.errors.append(repr(e))
            prev = (keys, vals)
            i += 1
            self.rounds += 1
            time.sleep(0.02)


def test_sigkill_leader_fails_over_within_the_lease_ttl(
    ha: HaCluster, record_property: Callable[[str, object], None]
) -> None:
    for _ in range(3):
        ha.add_master()
    wait_for("a leader", lambda: len(leaders(ha, [0, 1, 2])) == 1)
    lead = leaders(ha, [0, 1, 2])[0]
    others = [i for i in range(3) if i != lead]
    for _ in range(2):
        ha.add_worker()
    ids = sorted(w.ready["id"] for w in ha.workers)

    def every_master_lists_both() -> bool:
        return all(sorted(x.id for x in shard_map(a).workers) == ids for a in ha.addresses)

    wait_for("both workers in every master's map", every_master_lists_both)
    version = shard_map(ha.addresses[lead]).version
    terms = sum(gauge(scrape(p), "kvstore_master_leader_terms_total") for p in ha.metrics_ports)
    assert terms == 1, "one election so far: standbys never depose a live leader"
    with Client(ha.master_list, timeout=5.0) as c:
        load = Load(c)
        load.start()
        try:
            wait_for("the load to run", lambda: load.rounds >= 20)
            ha.masters[lead].signal(signal.SIGKILL)
            t0 = time.monotonic()
            ha.masters[lead].proc.wait(5)
            wait_for("a new leader", lambda: len(leaders(ha, others)) == 1, 3 * LEASE_TTL)
            failover = time.monotonic() - t0
            new = leaders(ha, others)[0]
            record_property("failover_seconds", round(failover, 2))
            print(
                f"\nfailover after SIGKILL of the leader: {failover:.2f}s (lease TTL {LEASE_TTL}s)"
            )
            assert failover <= LEASE_TTL
            m = shard_map(ha.addresses[new])
            assert sorted(x.id for x in m.workers) == ids, "the new leader took over the map"
            assert m.version >= version

            def heartbeating() -> bool:
                st = status(ha.addresses[new])
                return st is not None and all(
                    w.last_heartbeat_age_s < 2.0 and w.stats.puts for w in st.workers
                )

            wait_for("both workers to heartbeat to the new leader", heartbeating, 30)
            # The new leader took the instance tokens over from etcd: a registration
            # of a live worker's id by another instance is still refused (through a
            # standby too), and the map keeps the worker where it was.
            victim = next(w for w in m.workers if w.id == ids[0])
            thief = master_pb2.WorkerInfo()
            thief.CopyFrom(victim)
            thief.endpoints[:] = ["tcp://127.0.0.1:9"]
            for i in others:
                with grpc.insecure_channel(ha.addresses[i]) as ch:
                    with pytest.raises(grpc.RpcError) as e:
                        master_pb2_grpc.MasterStub(ch).Register(
                            master_pb2.RegisterRequest(worker=thief, instance=TOKEN_B), timeout=10
                        )
                    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert victim in shard_map(ha.addresses[new]).workers
            r = load.rounds
            wait_for("more load", lambda: load.rounds >= r + 20)
        finally:
            load.stop.set()
            load.join(30)
    assert load.errors == [], load.errors[:5]
    assert load.misses == 0 and load.not_stored == 0
    # `kvstore status` on any surviving master shows the same map.
    seen = [kvstore_status(ha.addresses[i]) for i in others]
    for s in seen:
        assert s["map_version"] == seen[0]["map_version"]
        assert sorted(str(w["id"]) for w in s["workers"]) == ids  # type: ignore[attr-defined]
    assert gauge(scrape(ha.metrics_ports[new]), "kvstore_master_leader") == 1
    stand = next(i for i in others if i != new)
    assert gauge(scrape(ha.metrics_ports[stand]), "kvstore_master_leader") == 0
