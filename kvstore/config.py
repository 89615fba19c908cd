"""One typed configuration for every daemon.

Precedence: defaults < ``--config FILE`` (YAML, sections ``master:`` and
``worker:``) < environment ``KVSTORE_<SECTION>_<FIELD>`` (e.g.
``KVSTORE_WORKER_DRAM_SIZE=4GiB``) < command-line flags. Sizes are text such as
"4GiB", "512MiB", "64k" or a plain number of bytes; durations are "10s",
"500ms", "2m" or a plain number of seconds. Unknown keys are errors, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvstore_client.errors import InvalidArgument

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.I)
_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.I)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296; '4GB' -> 4000000000; 4096 -> 4096."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 4GiB or a number of bytes")
    num, unit, binary = m.groups()
    base = 1024 if binary else 1000
    return int(float(num) * base ** _POW[unit.lower()])


def parse_duration(text: str | float) -> float:
    """'10s' -> 10.0, '500ms' -> 0.5, '2m' -> 120.0, 3 -> 3.0."""
    if isinstance(text, int | float):
        return float(text)
    m = _DUR_RE.match(str(text))
    if not m:
        raise InvalidArgument(f"bad duration {text!r}: use e.g. 500ms, 10s, 2m")
    num, unit = m.groups()
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[(unit or "s").lower()]
    return float(num) * scale


def format_size(n: float) -> str:
    """Human-readable binary size."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _size(default: str) -> Any:
    return field(default=parse_size(default), metadata={"kind": "size"})


def _dur(default: str) -> Any:
    return field(default=parse_duration(default), metadata={"kind": "duration"})


@dataclass(slots=True)
class MasterConfig:
    host: str = "127.0.0.1"
    port: int = 7700
    worker_ttl: float = _dur("10s")
    metrics_port: int = 0  # 0: no metrics endpoint
    etcd: str = ""  # comma-separated etcd endpoints; empty: in-memory state
    etcd_ca: str = ""  # PEM CA bundle for https:// etcd endpoints (default: system roots)
    etcd_cert: str = ""  # PEM client certificate for etcd (with etcd_key; --client-cert-auth)
    etcd_key: str = ""
    lease_ttl: float = _dur("5s")  # etcd lease of the leader: a dead leader's key lives this long
    advertise_host: str = ""  # address other masters forward to; default: host, $POD_IP, hostname
    cluster_id: str = "kvstore"
    replicas: int = 1
    namespace_replicas: list[str] = field(default_factory=list)  # "PREFIX=R": copies per ns prefix
    tls_cert: str = ""  # PEM certificate of this daemon; with tls_key enables TLS
    tls_key: str = ""
    tls_ca: str = ""  # CA that signed peers' certificates
    tls_client_auth: bool = False  # mutual TLS: require client certificates
    tenants_file: str = ""  # YAML tenants (tokens, namespaces, quotas); empty: no auth


@dataclass(slots=True)
class WorkerConfig:
    master: str = "127.0.0.1:7700"  # comma-separated for HA masters
    host: str = "127.0.0.1"  # bind address
    advertise_host: str = ""  # address clients use; default: host (or hostname for 0.0.0.0)
    id: str = ""  # stable identity on the hash ring; default: advertise_host-grpc_port
    grpc_port: int = 0  # 0: pick a free port
    tcp_port: int = 0
    ucx_port: int = -1  # ucx:// listener (extra kvstore[ucx]); 0: a free port; -1: none
    metrics_port: int = 0
    dram_size: int = _size("1GiB")
    max_value_size: int = _size("16MiB")  # also the slab size
    shm_dir: str = "/dev/shm"
    max_connections: int = 1024
    idle_timeout: float = _dur("300s")
    frame_timeout: float = _dur("30s")
    drain_timeout: float = _dur("30s")  # SIGTERM: time to finish calls and demote DRAM to SSD
    ssd_path: str = ""  # LMDB directory of the SSD tier; empty: no SSD tier
    ssd_size: int = _size("16GiB")  # LMDB map size
    ssd_sync: bool = False  # fsync every commit (default: only on graceful shutdown)
    dram_high: float = 0.95  # demote DRAM -> SSD above this fraction ...
    dram_low: float = 0.85  # ... down to this one
    ssd_high: float = 0.95  # evict from SSD above this fraction ...
    ssd_low: float = 0.85  # ... down to this one
    promote: str = "second-hit"  # SSD -> DRAM on a hit: always | second-hit | never
    promote_window: float = _dur("60s")  # second hit must come within this
    pin: list[str] = field(default_factory=list)  # pinned namespaces: "ns" or "ns=QUOTA"
    max_batch: int = 65536  # blocks per transfer frame
    max_connections_per_client: int = 256  # transfer connections from one address
    # Request limits (worker/requests.py); sizes of 0 mean "scaled to the arena".
    max_answer_bytes: int = _size("64MiB")  # payload of one inline (gRPC) Get answer
    reserve_ahead: int = _size("8MiB")  # put bytes a connection reserves before they arrive
    hold_per_connection: int = _size("0")  # bytes one connection may hold pinned/reserved
    hold_per_client: int = _size("0")  # ... all connections of one client address
    hold_per_worker: int = _size("0")  # ... all connections together
    shm_entries_per_connection: int = 65536  # shm blocks one connection may hold open
    tls_cert: str = ""  # PEM certificate of this daemon; with tls_key enables TLS
    tls_key: str = ""
    tls_ca: str = ""  # CA that signed peers' certificates
    tls_client_auth: bool = False  # mutual TLS: require client certificates
    tenants_file: str = ""  # YAML tenants (tokens, namespaces, quotas); empty: no auth
    token: str = ""  # this worker's token for the master (an admin tenant's)


@dataclass(slots=True)
class Config:
    master: MasterConfig = field(default_factory=MasterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)


def _coerce(section: str, f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.metadata.get("kind")
    try:
        if kind == "size":
            return parse_size(value)
        if kind == "duration":
            return parse_duration(value)
        if f.type in ("int", int):
            return int(value)
        if f.type in ("float", float):
            return float(value)
        if f.type in ("bool", bool):
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        if f.type in ("list[str]",):
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]
        return str(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"bad value {value!r} for {section}.{f.name}: {e}") from e


def _apply(cfg: Config, section: str, values: Mapping[str, Any], origin: str) -> None:
    target = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise InvalidArgument(
                f"unknown {section} setting {key!r} in {origin}; known: {', '.join(sorted(fields))}"
            )
        if value is not None and value != ():
            setattr(target, name, _coerce(section, fields[name], value))


def load_config(
    path: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the config from defaults, a YAML file, the environment and flag overrides."""
    cfg = Config()
    if path:
        try:
            with open(path) as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as e:
            raise InvalidArgument(f"cannot read config file {path}: {e}") from e
        except yaml.YAMLError as e:
            raise InvalidArgument(f"config file {path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise InvalidArgument(f"config file {path} must be a mapping of sections")
        for section, values in data.items():
            if section not in ("master", "worker"):
                raise InvalidArgument(f"unknown config section {section!r} in {path}")
            if not isinstance(values, dict):
                raise InvalidArgument(f"config section {section!r} must be a mapping")
            _apply(cfg, section, values, path)
    env = os.environ if environ is None else environ
    for section in ("master", "worker"):
        prefix = f"KVSTORE_{section.upper()}_"
        from_env = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
        _apply(cfg, section, from_env, "the environment")
    for section, values in (overrides or {}).items():
        _apply(cfg, section, values, "the command line")
    return cfg
