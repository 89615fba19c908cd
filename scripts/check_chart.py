#!/usr/bin/env python3
"""Offline checks for the kvstore Helm chart: no helm binary, no cluster.

    python scripts/check_chart.py [--chart DIR] [--kube-version 1.33.0 ...]

Needs helm-python-sdk (Helm 4's Go library through ctypes) and kubernetes-validate
(Kubernetes OpenAPI schemas shipped offline). What it checks:

1. `helm lint --strict` on the chart with each variant's values.
2. Renders every variant (defaults, values-ha.yaml, DaemonSet + hostPath, every optional
   feature on) and validates each manifest against the Kubernetes schemas in strict mode
   (unknown fields fail), for the chart's minimum Kubernetes version (Chart.yaml
   kubeVersion) and the newest one kubernetes-validate ships. CRDs (the ServiceMonitor)
   have no schema there: only their apiVersion/kind and references are checked.
3. Chart conventions on the rendered objects: standard labels, selectors that match pods,
   gRPC probes on the gRPC port, non-root read-only containers with ALL capabilities
   dropped, no service-link env vars, volume mounts that resolve, the helm test pod.
4. Rejections: typo'd and malformed values fail the schema; contradictory values fail
   the templates with a clear message.
5. values.schema.json sets additionalProperties at every object level (a short,
   explicit list of Kubernetes pass-through objects excepted), and every key in
   values.yaml and values-ha.yaml has a comment.

Exits 0 when everything passes, 1 on any failure, 2 when a dependency is missing.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "kvstore"
RELEASE = "kv"
NAMESPACE = "kvstore"
FULLNAME = "kv-kvstore"

# Kinds served by CRDs: kubernetes-validate has no schema for them.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
ALERT_RULES = CHART_DIR / "files" / "kvstore-alerts.yaml"

# Schema nodes that hold Kubernetes objects verbatim (validated after rendering instead).
PASSTHROUGH = frozenset(
    {
        "master.affinity",
        "worker.affinity",
        "master.topologySpreadConstraints[]",
        "worker.topologySpreadConstraints[]",
        "master.extraEnv[].valueFrom",
        "worker.extraEnv[].valueFrom",
        "master.extraVolumes[]",
        "worker.extraVolumes[]",
        "metrics.serviceMonitor.relabelings[]",
        "metrics.serviceMonitor.metricRelabelings[]",
    }
)

STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)

Manifest = dict[str, Any]


class MissingDependency(RuntimeError):
    """helm-python-sdk or kubernetes-validate is not importable."""


def _helm() -> Any:
    try:
        import helm_python
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            f"helm-python-sdk is not importable ({exc}); pip install helm-python-sdk==0.2.2"
        ) from exc
    return helm_python


def _kv() -> Any:
    try:
        from kubernetes_validate import utils
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            f"kubernetes-validate is not importable ({exc}); "
            "pip install kubernetes-validate==1.37.0"
        ) from exc
    return utils


# --------------------------------------------------------------------------- values


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge `override` into a copy of `base`, maps recursively (Helm's -f semantics)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_values_file(path: Path) -> dict[str, Any]:
    """Parse a values file with Helm's own YAML rules (e.g. `y` is a boolean there)."""
    values: dict[str, Any] = _helm().values_from_yaml(path.read_text())
    return values


@dataclass(frozen=True)
class Variant:
    """A set of values the chart must render and validate with."""

    name: str
    files: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)
    # Capabilities the main containers may add on top of drop ALL.
    allowed_caps: frozenset[str] = frozenset()
    # Pod Security "restricted"-like: no hostPath, no hostNetwork, no root init container.
    restricted: bool = True
    expect: Callable[[list[Manifest]], list[str]] | None = None

    def values(self, chart_dir: Path) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for name in self.files:
            merged = deep_merge(merged, load_values_file(chart_dir / name))
        return deep_merge(merged, self.overrides)


# --------------------------------------------------------------------------- helpers


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [
        m
        for m in manifests
        if m.get("kind") == kind and (name is None or m["metadata"]["name"] == name)
    ]


def pod_specs(
    manifests: list[Manifest],
) -> Iterator[tuple[Manifest, dict[str, Any], dict[str, str]]]:
    """(object, pod spec, pod labels) for every workload and bare Pod."""
    for m in manifests:
        if m.get("kind") in ("StatefulSet", "DaemonSet", "Deployment"):
            template = m["spec"]["template"]
            yield m, template["spec"], template["metadata"].get("labels", {})
        elif m.get("kind") == "Pod":
            yield m, m["spec"], m["metadata"].get("labels", {})


def container(manifests: list[Manifest], kind: str, name: str) -> dict[str, Any]:
    (workload,) = find(manifests, kind, name)
    first: dict[str, Any] = workload["spec"]["template"]["spec"]["containers"][0]
    return first


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def ident(m: Manifest) -> str:
    return f"{m.get('kind')}/{m.get('metadata', {}).get('name')}"


# --------------------------------------------------------------------------- variants


# What a default install may ask of a small cluster (a laptop's kind or minikube, one
# small node): the sum over every pod the chart starts, and no volume claims at all.
SMALL_CLUSTER = {"cpu": 2.0, "memory_mib": 4096}


def quantity(q: object) -> float:
    """A Kubernetes quantity as a number: CPU cores ("250m" -> 0.25) or MiB of memory."""
    text = str(q)
    units = {"m": 1e-3, "Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0, "Ti": 1024.0**2,
             "k": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}  # fmt: skip
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)


def requested(ms: list[Manifest]) -> tuple[float, float]:
    """(CPU cores, MiB) the scheduler must find for every pod of the workloads (a
    DaemonSet counted once: one node)."""
    cpu = mem = 0.0
    for m in ms:
        if m["kind"] not in ("StatefulSet", "Deployment", "DaemonSet"):
            continue
        n = int(m["spec"].get("replicas", 1)) if m["kind"] != "DaemonSet" else 1
        for c in m["spec"]["template"]["spec"]["containers"]:
            req = c.get("resources", {}).get("requests", {})
            cpu += n * quantity(req.get("cpu", 0))
            mem += n * quantity(req.get("memory", "0Mi"))
    return cpu, mem


def expect_default(ms: list[Manifest]) -> list[str]:
    """A default install schedules on a small cluster: no volume claims, and all its pods
    together within SMALL_CLUSTER (before, each worker claimed a 110 GiB volume and
    asked for 6 GiB of memory: a default install stayed Pending on a small cluster)."""
    problems = []
    (sts,) = find(ms, "StatefulSet", f"{FULLNAME}-worker")
    if sts["spec"].get("volumeClaimTemplates"):
        problems.append("a default install should claim no volume (SSD tier off)")
    if find(ms, "PersistentVolumeClaim"):
        problems.append("a default install should create no PersistentVolumeClaim")
    cpu, mem = requested(ms)
    if cpu > SMALL_CLUSTER["cpu"] or mem > SMALL_CLUSTER["memory_mib"]:
        problems.append(
            f"a default install requests {cpu:g} CPU and {mem:g} MiB, over a small "
            f"cluster's {SMALL_CLUSTER}"
        )
    for c in sts["spec"]["template"]["spec"]["containers"]:
        if any("hugepages" in k or "/" in k for k in c.get("resources", {}).get("requests", {})):
            problems.append("a default install should request no huge pages or devices")
    master = container(ms, "StatefulSet", f"{FULLNAME}-master")
    args = master["args"]
    if any(a.startswith("--etcd") for a in args):
        problems.append("a single master should not get --etcd without etcd.endpoints")
    problems += datagram_problems(ms, on=False)  # opt-in: no UDP port by default
    if find(ms, "PodDisruptionBudget", f"{FULLNAME}-master"):
        problems.append("no master PDB expected without ha.enabled")
    if not find(ms, "PodDisruptionBudget", f"{FULLNAME}-worker"):
        problems.append("worker PDB missing")
    return problems


def datagram_problems(ms: list[Manifest], on: bool) -> list[str]:
    """Datagram beats (``master.datagramBeats``): on, a UDP port of the gRPC port's
    number on the master's container and Services and ``--datagram-beats`` on the
    workers; off, none of it and ``--beat-port=off``."""
    problems = []
    master = container(ms, "StatefulSet", f"{FULLNAME}-master")
    args = master["args"]
    grpc_port = next(p["containerPort"] for p in master["ports"] if p["name"] == "grpc")
    udp = [p for p in master["ports"] if p.get("protocol") == "UDP"]
    want = [("beats", grpc_port)] if on else []
    if [(p["name"], p["containerPort"]) for p in udp] != want:
        problems.append(f"the master container's UDP ports should be {want}, are {udp}")
    flag = f"--beat-port={grpc_port}" if on else "--beat-port=off"
    if flag not in args:
        problems.append(f"the master should get {flag}")
    for svc in find(ms, "Service"):
        if svc["metadata"]["name"].startswith(f"{FULLNAME}-master"):
            names = {(p["name"], p.get("protocol"), p["port"]) for p in svc["spec"]["ports"]}
            if (("beats", "UDP", grpc_port) in names) != on:
                problems.append(
                    f"Service {svc['metadata']['name']}: the UDP beats port should be "
                    + ("there" if on else "absent")
                )
    worker = container(ms, "StatefulSet", f"{FULLNAME}-worker")
    if ("--datagram-beats" in worker["args"]) != on:
        problems.append(f"workers should {'' if on else 'not '}get --datagram-beats")
    return problems


def expect_production(ms: list[Manifest]) -> list[str]:
    """values-production.yaml: 4 workers with a 32 GiB arena, a 110 GiB claim each."""
    problems = []
    (sts,) = find(ms, "StatefulSet", f"{FULLNAME}-worker")
    if sts["spec"]["replicas"] != 4:
        problems.append(f"production workers: replicas {sts['spec']['replicas']}, want 4")
    claims = {t["metadata"]["name"]: t for t in sts["spec"].get("volumeClaimTemplates", [])}
    size = claims.get("data", {}).get("spec", {}).get("resources", {}).get("requests", {})
    if size.get("storage") != "110Gi":
        problems.append(f"production workers should claim 110Gi for data, got {size}")
    worker = container(ms, "StatefulSet", f"{FULLNAME}-worker")
    for flag in ("--dram-size=32GiB", "--ssd-path=/data", "--ssd-size=100GiB"):
        if flag not in worker["args"]:
            problems.append(f"production workers should get {flag}")
    return problems


def check_engine_pod_example(docs: Path, ms: list[Manifest], versions: list[str]) -> list[str]:
    """The engine pod of docs/KUBERNETES.md ("Engine pods on the same node") is a valid
    Pod that mounts the socket directory the daemonset variant's workers use, at the
    same path, on the host network, as the workers' uid."""
    import yaml

    text = docs.read_text()
    mark = "<!-- engine-pod-example"
    if mark not in text:
        return [f"{docs.name}: the engine pod example (marker {mark!r}) is missing"]
    m = re.search(r"```yaml\n(.*?)\n```", text[text.index(mark) :], re.S)
    if not m:
        return [f"{docs.name}: no yaml block after {mark!r}"]
    pod = yaml.safe_load(m.group(1))
    problems = validate_kubernetes([pod], versions)
    spec = pod["spec"]
    (ds,) = find(ms, "DaemonSet", f"{FULLNAME}-worker")
    wspec = ds["spec"]["template"]["spec"]
    (hp,) = [v["hostPath"]["path"] for v in wspec["volumes"] if v["name"] == "handover"]
    worker = wspec["containers"][0]
    uid = worker["securityContext"].get("runAsUser") or wspec["securityContext"].get("runAsUser")
    vols = {v["name"]: v.get("hostPath", {}).get("path") for v in spec.get("volumes", [])}
    mounts = [mt for c in spec["containers"] for mt in c.get("volumeMounts", [])]
    if not any(vols.get(mt["name"]) == hp and mt["mountPath"] == hp for mt in mounts):
        problems.append(f"the engine pod example should mount hostPath {hp} at {hp}")
    if not spec.get("hostNetwork"):
        problems.append("the engine pod example needs hostNetwork: true")
    if spec.get("securityContext", {}).get("runAsUser") != uid:
        problems.append(f"the engine pod example should run as the workers' uid {uid}")
    return problems


def expect_ha(ms: list[Manifest]) -> list[str]:
    problems = []
    (master,) = find(ms, "StatefulSet", f"{FULLNAME}-master")
    if master["spec"]["replicas"] != 3:
        problems.append(f"HA masters: replicas {master['spec']['replicas']}, want 3")
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    etcd = [a for a in args if a.startswith("--etcd=")]
    if len(etcd) != 1 or etcd[0].count("http://") != 3:
        problems.append(f"HA masters: want one --etcd flag with 3 endpoints, got {etcd}")
    worker_args = container(ms, "StatefulSet", f"{FULLNAME}-worker")["args"]
    masters = [a for a in worker_args if a.startswith("--master=")]
    if len(masters) != 1 or len(masters[0].split(",")) != 3:
        problems.append(f"workers should list the 3 masters, got {masters}")
    if not find(ms, "PodDisruptionBudget", f"{FULLNAME}-master"):
        problems.append("HA: master PDB missing")
    return problems


def expect_daemonset(ms: list[Manifest]) -> list[str]:
    problems = []
    if find(ms, "StatefulSet", f"{FULLNAME}-worker"):
        problems.append("worker.kind=DaemonSet still renders a worker StatefulSet")
    ds = find(ms, "DaemonSet", f"{FULLNAME}-worker")
    if not ds:
        return [*problems, "worker DaemonSet missing"]
    spec = ds[0]["spec"]["template"]["spec"]
    data = [v for v in spec["volumes"] if v["name"] == "data"]
    if not data or "hostPath" not in data[0]:
        problems.append("DaemonSet workers should mount the hostPath SSD volume as data")
    if "--id=$(NODE_NAME)" not in spec["containers"][0]["args"]:
        problems.append("DaemonSet workers should use the node name as their id")
    if not any(c["name"] == "ssd-permissions" for c in spec.get("initContainers", [])):
        problems.append("initPermissions=true should add the ssd-permissions init container")
    return problems + expect_node_local(ds[0])


NODE_LOCAL_DIR = f"/run/kvstore/{NAMESPACE}.{FULLNAME}"


def expect_node_local(ds: Manifest) -> list[str]:
    """nodeLocal: the hand-over socket in a hostPath directory mounted at the same path,
    handed to the worker's uid with mode 0750 by an init container (engine pods mount
    it: docs/KUBERNETES.md)."""
    problems = []
    spec = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    hp = vols.get("handover", {}).get("hostPath", {})
    if hp != {"path": NODE_LOCAL_DIR, "type": "DirectoryOrCreate"}:
        problems.append(f"nodeLocal: want hostPath {NODE_LOCAL_DIR} DirectoryOrCreate, got {hp}")
    worker = spec["containers"][0]
    if f"--shm-dir={NODE_LOCAL_DIR}" not in worker["args"]:
        problems.append("nodeLocal: the worker should get --shm-dir on the hostPath directory")
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    if mounts.get("handover") != NODE_LOCAL_DIR:
        problems.append("nodeLocal: the worker should mount the socket directory at its path")
    init = {c["name"]: c for c in spec.get("initContainers", [])}.get("socket-permissions")
    if init is None:
        problems.append("nodeLocal: the socket-permissions init container is missing")
    elif "chown 10001:10001" not in " ".join(init["command"]) or "0750" not in " ".join(
        init["command"]
    ):
        problems.append(f"nodeLocal: want chown 10001:10001 and mode 0750, got {init['command']}")
    if not spec.get("hostNetwork"):
        problems.append("nodeLocal: the workers need hostNetwork")
    return problems


def expect_full(ms: list[Manifest]) -> list[str]:
    problems = datagram_problems(ms, on=True)
    if not find(ms, "ServiceMonitor"):
        problems.append("ServiceMonitor missing with metrics.serviceMonitor.enabled")
    rules = find(ms, "PrometheusRule")
    if not rules or rules[0]["metadata"]["labels"].get("release") != "prometheus":
        problems.append("PrometheusRule (with its labels) missing with prometheusRule.enabled")
    worker = container(ms, "StatefulSet", f"{FULLNAME}-worker")
    res = worker.get("resources", {})
    for section in ("requests", "limits"):
        got = res.get(section, {})
        if got.get("hugepages-2Mi") != "4Gi":  # the 4GiB arena, in whole 2 MiB pages
            problems.append(f"hugepages-2Mi {section}: {got.get('hugepages-2Mi')}, want 4Gi")
        if got.get("rdma/hca_shared_devices_a") != 1:
            problems.append(f"RDMA resource missing from {section}")
    if "IPC_LOCK" not in worker["securityContext"]["capabilities"].get("add", []):
        problems.append("rdma.enabled with ipcLock should add IPC_LOCK")
    if worker["securityContext"].get("seccompProfile") != {"type": "RuntimeDefault"}:
        problems.append("worker.containerSecurityContext should be merged into the worker's")
    (sts,) = find(ms, "StatefulSet", f"{FULLNAME}-worker")
    (dshm,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    if dshm["emptyDir"] != {"medium": "Memory", "sizeLimit": "16Mi"}:
        problems.append(f"/dev/shm holds only the hand-over socket, got {dshm['emptyDir']}")
    if "--huge-pages=2MiB" not in worker["args"]:
        problems.append("hugepages.enabled should pass --huge-pages=2MiB to the worker")
    affinity = sts["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
    if "requiredDuringSchedulingIgnoredDuringExecution" not in affinity:
        problems.append("hostPath StatefulSet workers need required pod anti-affinity")
    return problems


VARIANTS: tuple[Variant, ...] = (
    Variant("default", expect=expect_default),
    Variant("ha", files=("values-ha.yaml",), expect=expect_ha),
    Variant("production", files=("values-production.yaml",), expect=expect_production),
    Variant(
        "daemonset",
        overrides={
            "worker": {
                "kind": "DaemonSet",
                "hostNetwork": True,
                "nodeLocal": {"enabled": True},
                "ssd": {
                    "enabled": True,
                    "type": "hostPath",
                    "hostPath": {"initPermissions": True},
                },
                "pdb": {"minAvailable": 1},
                "nodeSelector": {"kvstore.example.com/cache-node": "true"},
            }
        },
        restricted=False,
        expect=expect_daemonset,
    ),
    Variant(
        "all-features",
        overrides={
            "image": {"digest": "sha256:" + "0" * 64},
            "imagePullSecrets": [{"name": "regcred"}],
            "commonLabels": {"team": "inference"},
            "metrics": {
                "serviceMonitor": {
                    "enabled": True,
                    "labels": {"release": "prometheus"},
                    "metricRelabelings": [
                        {"action": "drop", "sourceLabels": ["__name__"], "regex": "go_.*"}
                    ],
                },
                "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
            },
            "master": {
                "datagramBeats": True,
                "service": {"type": "LoadBalancer"},
                "extraEnv": [
                    {"name": "KVSTORE_MASTER_WORKER_TTL", "value": "15s"},
                    {
                        "name": "LOG_LEVEL",
                        "valueFrom": {"configMapKeyRef": {"name": "kv-log", "key": "level"}},
                    },
                ],
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "kv"}],
            },
            "worker": {
                "dram": {"size": "4GiB"},
                "hugepages": {"enabled": True},
                "rdma": {"enabled": True},
                "ssd": {"enabled": True, "type": "hostPath"},
                "extraArgs": ["--log-level=debug"],
                "extraVolumes": [{"name": "certs", "secret": {"secretName": "kv-tls"}}],
                "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/kvstore/tls"}],
                "priorityClassName": "system-node-critical",
                "containerSecurityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                "resources": {"limits": {"memory": "2Gi"}, "requests": {"memory": "2Gi"}},
            },
        },
        allowed_caps=frozenset({"IPC_LOCK"}),
        restricted=False,
        expect=expect_full,
    ),
)


@dataclass(frozen=True)
class Rejection:
    """Values that must not render; `match` must appear in the error message."""

    name: str
    overrides: dict[str, Any]
    match: str
    # "values": rejected by values.schema.json; "template": by a `fail` in the templates.
    by: str = "values"


REJECTIONS: tuple[Rejection, ...] = (
    Rejection("typo top-level key", {"workers": {"replicas": 3}}, "workers"),
    Rejection("typo worker key", {"worker": {"dramSize": "8GiB"}}, "dramSize"),
    Rejection(
        "typo nested key",
        {"worker": {"ssd": {"persistence": {"storageClass": "fast"}}}},
        "storageClass",
    ),
    Rejection("typo probe key", {"master": {"livenessProbe": {"periodSecond": 5}}}, "periodSecond"),
    Rejection(
        "typo security key",
        {"containerSecurityContext": {"readOnlyRootFS": True}},
        "readOnlyRootFS",
    ),
    Rejection(
        "size without unit suffix", {"worker": {"dram": {"size": "4G"}}}, "/worker/dram/size"
    ),
    Rejection("unknown worker kind", {"worker": {"kind": "Deployment"}}, "/worker/kind"),
    Rejection("ha without etcd", {"ha": {"enabled": True}}, "etcd.endpoints", by="template"),
    Rejection(
        "node-local socket without a DaemonSet on the host network",
        {"worker": {"nodeLocal": {"enabled": True}}},
        "needs worker.kind=DaemonSet and worker.hostNetwork=true",
        by="template",
    ),
    Rejection(
        "DaemonSet with pvc",
        {"worker": {"kind": "DaemonSet", "ssd": {"enabled": True, "type": "pvc"}}},
        "cannot use worker.ssd.type=pvc",
        by="template",
    ),
    Rejection(
        "memory limit below the arena",
        {"worker": {"dram": {"size": "4GiB"}, "resources": {"limits": {"memory": "4Gi"}}}},
        "must exceed the DRAM arena plus the worker's own memory",
        by="template",
    ),
    Rejection(
        # Huge pages keep the arena out of the memory limit, but the check stays on.
        "memory limit below the headroom with huge pages",
        {
            "worker": {
                "hugepages": {"enabled": True},
                "resources": {"limits": {"memory": "256Mi"}, "requests": {"memory": "256Mi"}},
            }
        },
        "must exceed worker.dram.headroom",
        by="template",
    ),
    Rejection(
        "the renamed shmHeadroom",
        {"worker": {"dram": {"shmHeadroom": "1GiB"}}},
        "is now worker.dram.headroom",
        by="template",
    ),
    Rejection(
        "DaemonSet PDB percentage",
        {
            "worker": {
                "kind": "DaemonSet",
                "ssd": {"type": "hostPath"},
                "pdb": {"minAvailable": "50%"},
            }
        },
        "must be a whole number",
        by="template",
    ),
)


# --------------------------------------------------------------------------- checks


def lint(chart_dir: Path, values: dict[str, Any] | None = None) -> list[str]:
    """Strict lint; returns the warnings and errors (info messages are ignored)."""
    report = _helm().lint(str(chart_dir), values, strict=True)
    problems = [
        f"{m['path']}: {m['error'].strip()}"
        for m in report.get("messages", [])
        if m.get("severity", 0) >= 2
    ]
    return problems or [e.strip() for e in report.get("errors", [])]


def render(chart_dir: Path, values: dict[str, Any]) -> tuple[list[Manifest], str]:
    """Render like `helm template`; returns the parsed objects and the NOTES.txt text."""
    import yaml

    helm = _helm()
    with helm.Chart.load(str(chart_dir)) as chart:
        rendered: dict[str, str] = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    manifests: list[Manifest] = []
    notes = ""
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict):
                raise ValueError(f"{path}: rendered a YAML document that is no object: {doc!r}")
            manifests.append(doc)
    return manifests, notes


def validate_kubernetes(manifests: list[Manifest], kube_versions: list[str]) -> list[str]:
    """Strict validation against the Kubernetes OpenAPI schemas (unknown fields fail)."""
    kv = _kv()
    problems = []
    for m in manifests:
        key = (m.get("apiVersion"), m.get("kind"))
        if key in CRD_KINDS:
            continue  # no offline schema; see check_crds
        for version in kube_versions:
            try:
                kv.validate(m, version, strict=True)
            except kv.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path) or "(root)"
                problems.append(
                    f"{ident(m)} invalid for Kubernetes {version} at {where}: {exc.message}"
                )
            except kv.SchemaNotFoundError as exc:
                problems.append(f"{ident(m)}: {exc.message}")
            except kv.VersionNotSupportedError as exc:
                problems.append(exc.message)
    return problems


def check_crds(manifests: list[Manifest]) -> list[str]:
    """CRD objects get no schema validation offline: check apiVersion/kind and references."""
    problems = []
    services = find(manifests, "Service")
    for m in manifests:
        group = str(m.get("apiVersion", "")).split("/")[0]
        if group != "monitoring.coreos.com":
            continue
        if (m.get("apiVersion"), m.get("kind")) not in CRD_KINDS:
            problems.append(f"{ident(m)}: unexpected CRD {m.get('apiVersion')} {m.get('kind')}")
            continue
        spec = m.get("spec", {})
        if m.get("kind") == "PrometheusRule":
            # The rules themselves are checked by promtool (tests/unit/test_alert_rules.py).
            import yaml

            if spec != yaml.safe_load(ALERT_RULES.read_text()):
                problems.append(f"{ident(m)}: spec is not files/kvstore-alerts.yaml")
            continue
        selector = spec.get("selector", {})
        allowed = set()
        for expr in selector.get("matchExpressions", []):
            allowed.update(expr.get("values", []))
        picked = [
            s
            for s in services
            if selects(selector.get("matchLabels", {}), s["metadata"]["labels"])
            and s["metadata"]["labels"].get("app.kubernetes.io/component") in allowed
        ]
        ports = {p["name"] for s in picked for p in s["spec"]["ports"]}
        for endpoint in spec.get("endpoints") or [{}]:
            if endpoint.get("port") not in ports:
                problems.append(
                    f"{ident(m)}: endpoint port {endpoint.get('port')!r} on no selected Service"
                )
    return problems


def check_conventions(manifests: list[Manifest], variant: Variant) -> list[str]:
    problems: list[str] = []
    pods = list(pod_specs(manifests))
    for m in manifests:
        labels = m["metadata"].get("labels", {})
        wanted = [*STANDARD_LABELS]
        if m["kind"] != "ServiceAccount":
            wanted.append("app.kubernetes.io/component")
        missing = [label for label in wanted if label not in labels]
        if missing:
            problems.append(f"{ident(m)}: missing labels {missing}")

    for m, spec, labels in pods:
        where = ident(m)
        if m["kind"] != "Pod" and not selects(m["spec"]["selector"]["matchLabels"], labels):
            problems.append(f"{where}: selector does not match the pod labels")
        if spec.get("enableServiceLinks") is not False:
            problems.append(f"{where}: enableServiceLinks must be false (KVSTORE_* env clash)")
        if spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: automountServiceAccountToken must be false")
        if not spec.get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{where}: pod securityContext.runAsNonRoot must be true")
        if variant.restricted and spec.get("hostNetwork"):
            problems.append(f"{where}: hostNetwork in a restricted variant")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if variant.restricted and any("hostPath" in v for v in volumes.values()):
            problems.append(f"{where}: hostPath volume in a restricted variant")
        claims = {t["metadata"]["name"] for t in m.get("spec", {}).get("volumeClaimTemplates", [])}
        for c in spec.get("initContainers", []):
            problems += _check_container(
                where, c, set(volumes) | claims, init=True, variant=variant
            )
        for c in spec["containers"]:
            problems += _check_container(
                where, c, set(volumes) | claims, init=False, variant=variant
            )
            mounts = {vm["mountPath"]: vm["name"] for vm in c.get("volumeMounts", [])}
            if c["name"] == "worker":
                dshm = volumes.get(mounts.get("/dev/shm", ""), {}).get("emptyDir", {})
                if not (dshm.get("medium") == "Memory" and dshm.get("sizeLimit")):
                    problems.append(f"{where}: /dev/shm must be a sized Memory emptyDir")

        if m["kind"] == "StatefulSet":
            governing = find(manifests, "Service", m["spec"]["serviceName"])
            if not governing or governing[0]["spec"].get("clusterIP") != "None":
                problems.append(
                    f"{where}: serviceName {m['spec']['serviceName']} is no headless Service"
                )

    for svc in find(manifests, "Service"):
        matched = [(spec, lbl) for _, spec, lbl in pods if selects(svc["spec"]["selector"], lbl)]
        if not matched:
            problems.append(f"{ident(svc)}: selector matches no pod template")
            continue
        named = {
            p["name"] for spec, _ in matched for c in spec["containers"] for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            if isinstance(port.get("targetPort"), str) and port["targetPort"] not in named:
                problems.append(
                    f"{ident(svc)}: targetPort {port['targetPort']} is no container port"
                )

    for pdb in find(manifests, "PodDisruptionBudget"):
        if not any(selects(pdb["spec"]["selector"]["matchLabels"], lbl) for _, _, lbl in pods):
            problems.append(f"{ident(pdb)}: selector matches no pod template")

    problems += _check_test_pod(manifests)
    if variant.expect:
        problems += variant.expect(manifests)
    return problems


def _check_container(
    where: str, c: dict[str, Any], volumes: set[str], *, init: bool, variant: Variant
) -> list[str]:
    problems = []
    name = f"{where} container {c['name']}"
    sc = c.get("securityContext", {})
    caps = sc.get("capabilities", {})
    if "ALL" not in caps.get("drop", []):
        problems.append(f"{name}: capabilities.drop must include ALL")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{name}: allowPrivilegeEscalation must be false")
    if sc.get("privileged"):
        problems.append(f"{name}: must not be privileged")
    if not sc.get("readOnlyRootFilesystem"):
        problems.append(f"{name}: readOnlyRootFilesystem must be true")
    root_init = {"ssd-permissions": {"CHOWN"}, "socket-permissions": {"CHOWN", "FOWNER"}}
    if init and c["name"] in root_init:
        if variant.restricted:
            problems.append(f"{name}: root init container in a restricted variant")
        if set(caps.get("add", [])) != root_init[c["name"]]:
            problems.append(f"{name}: may add {sorted(root_init[c['name']])} only")
    else:
        if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") == 0:
            problems.append(f"{name}: must run as non-root")
        extra = set(caps.get("add", [])) - variant.allowed_caps
        if extra:
            problems.append(f"{name}: unexpected capabilities {sorted(extra)}")
    for vm in c.get("volumeMounts", []):
        if vm["name"] not in volumes:
            problems.append(f"{name}: volumeMount {vm['name']} has no volume")
    if not init and not where.startswith("Pod/"):
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe not in c:
                problems.append(f"{name}: {probe} missing")
            elif c[probe].get("grpc", {}).get("port") != ports.get("grpc"):
                problems.append(f"{name}: {probe} must be a gRPC probe on the grpc port")
    return problems


def _check_test_pod(manifests: list[Manifest]) -> list[str]:
    tests = [
        m
        for m in find(manifests, "Pod")
        if m["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"
    ]
    if len(tests) != 1:
        return [f"want exactly one helm test pod, found {len(tests)}"]
    args = tests[0]["spec"]["containers"][0].get("args", [])
    masters = [a.split("=", 1)[1] for a in args if a.startswith("--master=")]
    if not args or args[0] != "check" or len(masters) != 1:
        return [f"helm test pod should run `kvstore check --master=SVC:PORT`, runs {args}"]
    host, _, port = masters[0].partition(":")
    svc = find(manifests, "Service", host)
    if not svc or int(port) not in {p["port"] for p in svc[0]["spec"]["ports"]}:
        return [f"helm test pod targets {masters[0]}, which is no rendered Service port"]
    return []


def check_rejections(chart_dir: Path) -> list[str]:
    """Every Rejection must fail rendering, with the expected error class and message."""
    helm = _helm()
    problems = []
    expected_error = {"values": helm.HelmValuesError, "template": helm.HelmRenderError}
    for case in REJECTIONS:
        try:
            render(chart_dir, case.overrides)
        except helm.HelmError as exc:
            message = str(exc)
            if not isinstance(exc, expected_error[case.by]):
                problems.append(
                    f"rejection '{case.name}': {type(exc).__name__}, want a {case.by} error: "
                    + message
                )
            elif case.match not in message:
                problems.append(f"rejection '{case.name}': message lacks {case.match!r}: {message}")
            continue
        problems.append(f"rejection '{case.name}': values {case.overrides} were accepted")
    # `helm lint` must flag schema violations too, not only install/template.
    lint_problems = lint(chart_dir, REJECTIONS[1].overrides)
    if not any("dramSize" in p for p in lint_problems):
        problems.append("strict lint accepted a values typo (worker.dramSize)")
    return problems


def check_schema_strict(schema: dict[str, Any]) -> list[str]:
    """Every object node in values.schema.json must constrain its keys."""
    definitions = schema.get("definitions", {})
    problems: list[str] = []
    seen: set[str] = set()

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if ref is None:
            return node
        if not ref.startswith("#/definitions/"):
            raise ValueError(f"unsupported $ref {ref}")
        return resolve(definitions[ref.removeprefix("#/definitions/")])

    def walk(node: dict[str, Any], path: str) -> None:
        node = resolve(node)
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "object" in types or "properties" in node:
            extra = node.get("additionalProperties")
            if path in PASSTHROUGH:
                seen.add(path)
            elif extra is False:
                for key, child in node.get("properties", {}).items():
                    walk(child, f"{path}.{key}" if path else key)
            elif isinstance(extra, dict) and extra:
                walk(extra, f"{path}.*")
            else:
                problems.append(
                    f"schema: {path or '(root)'} accepts unknown keys (set additionalProperties)"
                )
        if "array" in types and isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    for stale in sorted(PASSTHROUGH - seen):
        problems.append(
            f"schema: pass-through {stale} is listed in PASSTHROUGH but not reached in the schema"
        )
    return problems


KEY_LINE = re.compile(r"^([A-Za-z0-9_./-]+|\"[^\"]+\"):(\s|$)")


def check_values_documented(path: Path) -> list[str]:
    """Each key of a values file needs a comment on the line above or at the end of its line.

    List items ("- ...", and keys nested inside them) are data, not options.
    """
    problems = []
    previous = ""
    list_indent: int | None = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        body = line.lstrip()
        if not body:
            continue
        indent = len(line) - len(body)
        if body.startswith("#"):
            previous = body
            continue
        if body.startswith("- "):
            list_indent = indent
        elif list_indent is None or indent <= list_indent:
            list_indent = None
            key = KEY_LINE.match(body)
            if key and not previous.startswith("#") and " #" not in body:
                problems.append(f"{path.name}:{number}: key '{key.group(1)}' has no comment")
        previous = body
    return problems


# --------------------------------------------------------------------------- driver


def kube_versions(chart_dir: Path) -> list[str]:
    """The chart's minimum Kubernetes version and the newest one with shipped schemas."""
    import yaml

    kv = _kv()
    latest = kv.latest_version()
    meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    found = re.search(r">=\s*v?(\d+\.\d+)", str(meta.get("kubeVersion", "")))
    versions = [f"{found.group(1)}.0"] if found else []
    if latest not in versions:
        versions.append(latest)
    return versions


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)

    def record(self, title: str, problems: list[str]) -> None:
        status = "ok  " if not problems else "FAIL"
        print(f"{status} {title}")
        for problem in problems:
            print(f"     - {problem}")
        self.failures += [f"{title}: {p}" for p in problems]


def run_variant(chart_dir: Path, variant: Variant, versions: list[str]) -> dict[str, list[str]]:
    """All checks for one variant, by title."""
    helm = _helm()
    values = variant.values(chart_dir)
    results = {f"lint --strict [{variant.name}]": lint(chart_dir, values or None)}
    try:
        manifests, notes = render(chart_dir, values)
    except (helm.HelmError, ValueError) as exc:
        results[f"render [{variant.name}]"] = [str(exc).strip()]
        return results
    tag = f"[{variant.name}]"
    results[f"render {tag}: {len(manifests)} objects"] = [] if notes.strip() else ["empty NOTES"]
    results[f"Kubernetes {'+'.join(versions)} schemas, strict {tag}"] = validate_kubernetes(
        manifests, versions
    )
    results[f"CRDs: apiVersion/kind and references only, no schema {tag}"] = check_crds(manifests)
    results[f"conventions {tag}"] = check_conventions(manifests, variant)
    return results


def run_all(chart_dir: Path = CHART_DIR, versions: list[str] | None = None) -> list[str]:
    """Run every check, print a line per check, return the failures."""
    report = Report()
    versions = versions or kube_versions(chart_dir)
    helm = _helm()
    print(
        f"chart {chart_dir}: Helm SDK {helm.helm_sdk_version()}, Kubernetes {', '.join(versions)}"
    )
    schema = json.loads((chart_dir / "values.schema.json").read_text())
    report.record(
        "values.schema.json: additionalProperties at every object level",
        check_schema_strict(schema),
    )
    documented = check_values_documented(chart_dir / "values.yaml")
    documented += check_values_documented(chart_dir / "values-ha.yaml")
    documented += check_values_documented(chart_dir / "values-production.yaml")
    report.record("values.yaml, values-ha.yaml, values-production.yaml: every key commented",
                  documented)  # fmt: skip
    for variant in VARIANTS:
        for title, problems in run_variant(chart_dir, variant, versions).items():
            report.record(title, problems)
    report.record(f"rejections ({len(REJECTIONS)} bad values files)", check_rejections(chart_dir))
    (daemonset,) = [v for v in VARIANTS if v.name == "daemonset"]
    manifests, _ = render(chart_dir, daemonset.values(chart_dir))
    report.record(
        "docs/KUBERNETES.md: the engine pod example fits the node-local workers",
        check_engine_pod_example(REPO_ROOT / "docs" / "KUBERNETES.md", manifests, versions),
    )
    return report.failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chart", type=Path, default=CHART_DIR, help="chart directory")
    parser.add_argument(
        "--kube-version",
        action="append",
        dest="versions",
        help="Kubernetes version to validate against (repeatable); default: the chart's "
        "minimum (Chart.yaml kubeVersion) and the newest shipped by kubernetes-validate",
    )
    args = parser.parse_args(argv)
    try:
        failures = run_all(args.chart, args.versions)
    except MissingDependency as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if failures:
        print(f"\n{len(failures)} problem(s) found in {args.chart}", file=sys.stderr)
        return 1
    print("\nall chart checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
