"""Prometheus metrics on every daemon (--metrics-port) after a put/get workload:
the names of the issue, Prometheus conventions (kvstore_ prefix, base units,
_total counters, few labels), and every series the Grafana dashboard queries."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import metrics
from kvstore.cluster import Daemon, spawn
from kvstore_client import Client, __version__
from kvstore_client.proto import store_pb2, store_pb2_grpc
from tests.conftest import arena_files
from tests.helpers import key, value_for

NS = "metrics/bf16/b16/tp0of1"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvstore.json"
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"
# "tenant": the tenants of the tenants file (a bounded set, like "op").
ALLOWED_LABELS = {
    "op",
    "code",
    "tier",
    "transport",
    "direction",
    "version",
    "le",
    "tenant",
    "result",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Scrape:
    """One /metrics page: declared names (# TYPE) and samples by (name, labels)."""

    text: str
    declared: set[str] = field(default_factory=set)
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for line in self.text.splitlines():
            if line.startswith("# TYPE "):
                self.declared.add(line.split()[2])
        for fam in text_string_to_metric_families(self.text):
            for s in fam.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        assert found, f"no sample {name}{labels or ''}"
        return sum(found)


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return Scrape(r.read().decode())


def spawn_with_metrics(role: str, args: list[str], log: Path) -> tuple[Daemon, int]:
    for _ in range(3):  # the port may be taken between the probe and the bind: retry
        port = free_port()
        try:
            return spawn(role, [*args, "--metrics-port", str(port)], log_path=str(log)), port
        except Exception:
            continue
    raise AssertionError(f"{role} with a metrics port did not start; see {log}")


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[tuple[Daemon, int]]]:
    out: list[tuple[Daemon, int]] = []
    try:
        out.append(
            spawn_with_metrics(
                "master",
                ["--host", "127.0.0.1", "--port", "0", "--worker-ttl", "5s"],
                tmp_path / "master.log",
            )
        )
        for i in range(2):
            out.append(
                spawn_with_metrics(
                    "worker",
                    [
                        *("--master", out[0][0].address, "--host", "127.0.0.1"),
                        *("--dram-size", "64MiB", "--max-value-size", "1MiB"),
                    ],
                    tmp_path / f"worker{i}.log",
                )
            )
        yield out
    finally:
        for d, _ in reversed(out):
            d.stop()
        for d, _ in out:
            assert not arena_files(d.pid)


def test_metrics_after_a_put_get_workload(daemons: list[tuple[Daemon, int]]) -> None:
    (master, mport), *workers = daemons
    keys = [key(i, "metrics") for i in range(64)]
    vals = [value_for(k, 32 * 1024) for k in keys]
    # tcp: the worker counts its bytes both ways (with shm the client copies reads itself).
    with Client(master.address, timeout=5.0, transport="tcp") as c:
        assert _wait_workers(c, 2), "both workers in the map"
        assert all(c.batch_put(NS, keys, vals))
        assert c.batch_get(NS, keys) == vals
        assert c.batch_get(NS, [key(i, "absent") for i in range(8)]) == [None] * 8
        assert c.match_prefix(NS, keys) == len(keys)
    # The gRPC Store path too: a good inline put/get and a bad request (an error code).
    wgrpc = workers[0][0].ready["grpc"]
    with grpc.insecure_channel(wgrpc) as ch:
        stub = store_pb2_grpc.StoreStub(ch)
        k = key(1, "inline")
        stub.Put(store_pb2.PutRequest(namespace=NS, hashes=k, values=[b"v"]), timeout=10)
        stub.Get(store_pb2.GetRequest(namespace=NS, hashes=k), timeout=10)
        with pytest.raises(grpc.RpcError):
            stub.Exists(store_pb2.ExistsRequest(namespace=NS, hashes=b"short"), timeout=10)

    # A malformed frame on the transfer port: the connection is closed and counted in
    # kvstore_bad_frames_total (before, only in the Stats call: the alert had no data).
    host, port = workers[0][0].ready["tcp"][len("tcp://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sk:
        sk.sendall(b"\xff" * 64)
        sk.settimeout(5)
        while sk.recv(4096):
            pass

    m = scrape(mport)
    assert m.value("kvstore_live_workers") == 2
    assert m.value("kvstore_master_leader") == 1, "alone without etcd: the leader"
    assert m.value("kvstore_shard_map_version") >= 1
    assert m.value("kvstore_requests_total", op="register", code="OK") >= 2
    assert m.value("kvstore_requests_total", op="get_shard_map", code="OK") >= 1
    assert m.value("kvstore_request_duration_seconds_count", op="register") >= 2
    assert m.value("kvstore_build_info", version=__version__) == 1

    ws = [scrape(p) for _, p in workers]
    for w in ws:
        assert "kvstore_master_leader" not in w.declared, "master metrics stay on masters"
        assert w.value("kvstore_tier_capacity_bytes", tier="dram") == 64 << 20
        assert w.value("kvstore_build_info") == 1
        for name in ("evictions", "demotions", "promotions"):
            assert w.value(f"kvstore_{name}_total") == 0
    assert _sum(ws, "kvstore_tier_used_bytes", tier="dram") >= 64 * 32 * 1024
    assert _sum(ws, "kvstore_tier_keys", tier="dram") == 65
    assert _sum(ws, "kvstore_hit_blocks_total") >= 64 + 1  # the get and the inline get
    assert _sum(ws, "kvstore_miss_blocks_total") >= 8
    assert _sum(ws, "kvstore_transfer_bytes_total", direction="rx") >= 64 * 32 * 1024
    assert _sum(ws, "kvstore_transfer_bytes_total", direction="tx") >= 64 * 32 * 1024
    assert _sum(ws, "kvstore_requests_total", op="exists", code="OK") >= 2  # transfer plane
    assert _sum(ws, "kvstore_requests_total", op="get", code="OK") >= 3
    w0 = ws[0]
    assert w0.value("kvstore_requests_total", op="put", code="OK") >= 1
    assert w0.value("kvstore_requests_total", op="get", code="OK") >= 1
    assert w0.value("kvstore_requests_total", op="exists", code="INVALID_ARGUMENT") == 1
    assert w0.value("kvstore_request_duration_seconds_bucket", op="get", le="+Inf") >= 1
    assert w0.value("kvstore_bad_frames_total", transport="tcp") == 1
    assert ws[1].value("kvstore_bad_frames_total", transport="tcp") == 0

    for s in [m, *ws]:
        _check_conventions(s)
    _check_dashboard({n for s in [m, *ws] for n in _exported(s)})


def _wait_workers(c: Client, n: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if len(c.workers()) == n:
            return True
        time.sleep(0.05)
    return False


def _sum(scrapes: list[Scrape], name: str, **labels: str) -> float:
    return sum(s.value(name, **labels) for s in scrapes)


def _exported(s: Scrape) -> set[str]:
    names = set(s.declared)
    names |= {n for n, _ in s.samples}
    return names


def _check_conventions(s: Scrape) -> None:
    """kvstore_ names in snake case with base units, counters end in _total, few labels."""
    series: dict[str, set[frozenset[tuple[str, str]]]] = {}
    for name in s.declared:
        if not name.startswith("kvstore_"):
            continue
        assert re.fullmatch(r"kvstore_[a-z0-9_]+", name), name
        assert "bytes" not in name or re.search(r"_bytes(_total)?$", name), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)(_|$)", name), name
    for line in s.text.splitlines():
        if line.startswith("# TYPE kvstore_") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total"), line
    for (name, labels), _ in s.samples.items():
        if name.startswith("kvstore_"):
            assert {k for k, _ in labels} <= ALLOWED_LABELS, (name, labels)
            series.setdefault(name, set()).add(labels)
    values: dict[str, set[str]] = {}
    for sets in series.values():
        for labels in sets:
            for k, v in labels:
                values.setdefault(k, set()).add(v)
    values.pop("le", None)  # histogram buckets: fixed at definition
    for k, vs in values.items():
        assert len(vs) <= 20, f"label {k} takes {len(vs)} values: a high-cardinality label?"


def _check_dashboard(exported: set[str]) -> None:
    """Every kvstore_ series the dashboard queries is one a daemon exports."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has queries"
    used = {n for e in exprs for n in re.findall(r"kvstore_[a-z0-9_]+", e)}
    known = exported | {"kvstore_etcd_errors_total", "kvstore_master_leader_terms_total"}
    known |= {f"{n}{sfx}" for n in exported for sfx in ("_bucket", "_sum", "_count")}
    missing = sorted(used - known)
    assert not missing, f"the dashboard queries series no daemon exports: {missing}"


# ---- a fresh daemon: what docs/OPERATIONS.md lists, known label values at zero ------


@dataclass(frozen=True)
class Documented:
    type: str
    labels: frozenset[str]
    where: str  # all, worker, master


def documented_families() -> dict[str, Documented]:
    """The metrics table of docs/OPERATIONS.md: name -> type, label names, daemon."""
    out: dict[str, Documented] = {}
    for line in OPERATIONS.read_text().splitlines():
        m = re.match(r"\| `(kvstore_[a-z0-9_]+)` \| ([a-z]+)[^|]*\| ([^|]*)\| ([a-z]+) \|", line)
        if m:
            labels = frozenset(re.findall(r"`([a-z_]+)`(?: \([^)]*\))?", m.group(3)))
            out[m.group(1)] = Documented(m.group(2), labels, m.group(4))
    return out


def documented_ops(daemon: str) -> set[str]:
    """The op label values the docs list for ``daemon`` (a line "<Daemon> operations
    (`op`): `a`, `b`, ...")."""
    text = OPERATIONS.read_text().replace("\n", " ")
    m = re.search(rf"{daemon.capitalize()} operations \(`op`\):([^.]*)\.", text)
    assert m, f"docs/OPERATIONS.md lists no {daemon} operations"
    return set(re.findall(r"`([a-z_]+)`", m.group(1)))


def exported_families(s: Scrape) -> dict[str, tuple[str, frozenset[str]]]:
    """kvstore_ families a /metrics page declares: name (counters with _total) ->
    (type, label names of its samples, le aside)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in text_string_to_metric_families(s.text):
        if not fam.name.startswith("kvstore_"):
            continue
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = frozenset(k for x in fam.samples for k in x.labels if k != "le")
        out[name] = ("gauge" if fam.type in ("info", "gauge") else fam.type, labels)
    return out


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[tuple[Scrape, Scrape]]:
    """A master and a worker that have served nothing yet, scraped once each."""
    started: list[Daemon] = []
    try:
        master, mport = spawn_with_metrics(
            "master", ["--host", "127.0.0.1", "--port", "0"], tmp_path / "master.log"
        )
        started.append(master)
        worker, wport = spawn_with_metrics(
            "worker",
            ["--master", master.address, "--host", "127.0.0.1", "--dram-size", "64MiB"],
            tmp_path / "worker.log",
        )
        started.append(worker)
        yield scrape(mport), scrape(wport)
    finally:
        for d in reversed(started):
            d.stop()


def test_fresh_daemons_export_what_the_docs_list_at_zero(fresh: tuple[Scrape, Scrape]) -> None:
    """A master and a worker that served nothing export exactly the families
    docs/OPERATIONS.md lists for them (names, types, label names), and every known
    label value already has its series at 0: each op with every status code and its
    latency histogram, the worker's transports both ways, its tenant (''), so rates
    and alerts on them have data from the first scrape. Before, a fresh worker had no
    request, transfer or tenant series, and a master exported the worker's session
    histogram."""
    m, w = fresh
    docs = documented_families()
    assert len(docs) > 25, "the table of docs/OPERATIONS.md was not parsed"
    for role, page in (("master", m), ("worker", w)):
        want = {n: (d.type, d.labels) for n, d in docs.items() if d.where in ("all", role)}
        got = exported_families(page)
        assert set(got) == set(want), (
            f"{role}: exported but not in docs/OPERATIONS.md: {sorted(set(got) - set(want))}; "
            f"documented but not exported: {sorted(set(want) - set(got))}"
        )
        for name, (typ, labels) in got.items():
            assert typ == want[name][0], (role, name, typ, want[name])
            assert not labels or labels == want[name][1], (role, name, labels, want[name])
    assert documented_ops("master") == set(metrics.MASTER_OPS)
    assert documented_ops("worker") == set(metrics.WORKER_OPS)
    for page, ops in ((m, metrics.MASTER_OPS), (w, metrics.WORKER_OPS)):
        for op in ops:
            assert page.value("kvstore_request_duration_seconds_count", op=op) == 0, op
            for code in metrics.CODES:
                key = ("kvstore_requests_total", frozenset({("op", op), ("code", code)}))
                assert page.samples.get(key) == 0, (op, code)
    for tr in ("tcp", "shm"):
        for d in ("rx", "tx"):
            assert (
                w.samples.get(
                    (
                        "kvstore_transfer_bytes_total",
                        frozenset({("transport", tr), ("direction", d)}),
                    )
                )
                == 0
            ), (tr, d)
    assert w.value("kvstore_bad_frames_total", transport="tcp") == 0
    assert w.value("kvstore_tenant_hit_blocks_total", tenant="") == 0
    assert w.value("kvstore_tenant_bytes_total", tenant="", direction="in") == 0
    _check_conventions(m)
    _check_conventions(w)
