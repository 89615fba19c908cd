"""One typed configuration for every daemon.

Precedence: defaults < ``--config FILE`` (YAML, sections ``master:`` and
``worker:``) < environment ``KVSTORE_<SECTION>_<FIELD>`` (e.g.
``KVSTORE_WORKER_DRAM_SIZE=4GiB``; ``KVSTORE_MASTER`` also sets the worker's master,
below ``KVSTORE_WORKER_MASTER``) < command-line flags. Sizes are text such as
"4GiB", "512MiB", "64k" or a plain number of bytes; durations are "10s",
"500ms", "2m" or a plain number of seconds. Unknown keys are errors, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvstore_client.errors import InvalidArgument

# Dense enough for 1 MiB workers to get ~1,000 ring points; whatever the density, a
# worker gets at most sharding.MAX_VNODES points and a client's ring at most
# sharding.MAX_RING_POINTS (sharding.point_counts), so no setting makes a client's
# ring expensive to build.
MAX_VNODES_PER_GIB = 1 << 20

# The distribution's name on the package index (`pip install kvstore-cache`); the import
# packages (kvstore, kvstore_client, kvstore_bench) and the `kvstore` command keep theirs.
DIST_NAME = "kvstore-cache"

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
    # UDP port for datagram beats (master.proto): "" the gRPC port's number, "0" a free
    # port, "off" none (workers beat on their gRPC streams)
    beat_port: str = ""
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
    # ring points per GiB of a worker's capacity (at least 160, at most 65,536 a worker,
    # 1..MAX_VNODES_PER_GIB): the default gives a 64 GiB worker 1,024; small workers want
    # more (docs/SCALE.md); clients bound the whole ring (sharding.point_counts)
    vnodes_per_gib: int = 16
    namespace_replicas: list[str] = field(default_factory=list)  # "PREFIX=R": copies per ns prefix
    tls_cert: str = ""  # PEM certificate of this daemon; with tls_key enables TLS
    tls_key: str = ""
    tls_ca: str = ""  # CA that signed peers' certificates
    tls_client_auth: bool = False  # mutual TLS: require client certificates
    tenants_file: str = ""  # YAML tenants (tokens, namespaces, quotas); empty: no auth


@dataclass(slots=True)
class WorkerConfig:
    master: str = "127.0.0.1:7700"  # comma-separated for HA masters
    # beat by UDP datagram when the master offers it (master.proto); off (the default
    # until it holds on a loaded host, docs/SCALE.md): on the gRPC stream
    datagram_beats: bool = False
    host: str = "127.0.0.1"  # bind address
    advertise_host: str = ""  # address clients use; default: host (or hostname for 0.0.0.0)
    id: str = ""  # stable identity on the hash ring; default: advertise_host-grpc_port
    grpc_port: int = 0  # 0: pick a free port
    tcp_port: int = 0
    ucx_port: int = -1  # ucx:// listener (extra kvstore-cache[ucx]); 0: a free port; -1: none
    metrics_port: int = 0
    dram_size: int = _size("1GiB")
    max_value_size: int = _size("16MiB")  # also the slab size
    shm_dir: str = "/dev/shm"  # where the arena's hand-over socket lives (the arena is a memfd)
    share_arena: bool = True  # hand the arena and index to same-host clients (shm://)
    # Each same-host client's inbox, into which it writes the blocks it puts (the worker
    # verifies and publishes them): at least two values; 0 = no inboxes (puts over tcp://)
    shm_inbox_size: int = _size("64MiB")
    # Let debuggers of the worker's user attach (py-spy, gdb). Off: other processes of the
    # user cannot read or write the worker's memory or reopen its descriptors (prctl
    # PR_SET_DUMPABLE 0); root still can (docs/SECURITY.md)
    dumpable: bool = False
    huge_pages: int = _size("0")  # page size backing the arena (2MiB, 1GiB); 0: regular pages
    max_connections: int = 1024
    idle_timeout: float = _dur("300s")
    frame_timeout: float = _dur("30s")
    drain_timeout: float = _dur("30s")  # SIGTERM: time to finish calls and demote DRAM to SSD
    ssd_path: str = ""  # LMDB directory of the SSD tier; empty: no SSD tier
    ssd_size: int = _size("16GiB")  # bytes of LMDB pages (values page-rounded); map = 1.5x + 1 MiB
    ssd_sync: bool = False  # fsync every commit (default: only on graceful shutdown)
    dram_high: float = 0.95  # demote DRAM -> SSD above this fraction ...
    dram_low: float = 0.85  # ... down to this one
    ssd_high: float = 0.95  # evict from SSD above this fraction ...
    ssd_low: float = 0.85  # ... down to this one
    promote: str = "second-hit"  # SSD -> DRAM on a hit: always | second-hit | never
    promote_window: float = _dur("60s")  # second hit must come within this
    # Pinned namespaces: "ns" or "ns=QUOTA"; in YAML also a mapping {ns: QUOTA}.
    pin: list[str] = field(default_factory=list)
    max_batch: int = 65536  # blocks per transfer frame
    max_connections_per_client: int = 256  # transfer connections from one address
    # Request limits (worker/requests.py); sizes of 0 mean "scaled to the arena".
    max_answer_bytes: int = _size("64MiB")  # payload of one inline (gRPC) Get answer
    reserve_ahead: int = _size("8MiB")  # put bytes a connection reserves before they arrive
    hold_per_connection: int = _size("0")  # bytes one connection may hold pinned/reserved
    hold_per_client: int = _size("0")  # ... all connections of one client (its identity)
    hold_per_worker: int = _size("0")  # ... all connections together
    shm_entries_per_connection: int = 65536  # shm blocks one connection may hold open
    tls_cert: str = ""  # PEM certificate of this daemon; with tls_key enables TLS
    tls_key: str = ""
    tls_ca: str = ""  # CA that signed peers' certificates
    tls_client_auth: bool = False  # mutual TLS: require client certificates
    tenants_file: str = ""  # YAML tenants (tokens, namespaces, quotas); empty: no auth
    token: str = ""  # this worker's token for the master (an admin tenant's)
    # Agent sessions (worker/sessions.py): hints keep a paused session's blocks.
    session_budget: float = 0.25  # share of DRAM a worker may retain for paused sessions
    session_share: float = 0.5  # share of DRAM + SSD one hinted session may fill (0: no cap)
    # which session gives way first when DRAM is full: per-session (running or paused,
    # the one likely back last, from its own and the seen pauses) | expected (running
    # ones, then the paused one expected back last) | recent (running ones, then the
    # most recently paused)
    session_order: str = "per-session"
    session_ttl: float = _dur("300s")  # how long a paused session's blocks are kept
    session_idle_ttl: float = _dur("3600s")  # an active session with no hint leaves the table
    max_sessions: int = 4096  # live sessions per tenant (more push out its oldest)
    max_session_blocks: int = 262144  # (session, block) pairs per tenant
    # KV events (worker/events.py): ZMQ PUB endpoint, e.g. tcp://0.0.0.0:5557; empty: off.
    kv_events: str = ""
    kv_events_replay: str = ""  # ZMQ ROUTER endpoint answering replay requests; empty: off
    kv_events_topic: str = "kvstore/"  # topic prefix (then the namespace)
    kv_events_history_bytes: int = _size("32MiB")  # message payload bytes kept for replays
    kv_events_replay_peers: int = 8  # replays served at once (more get the end frame)


@dataclass(slots=True)
class Config:
    master: MasterConfig = field(default_factory=MasterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _strict_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"want one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def _strict_int(value: Any) -> int:
    if isinstance(value, bool):  # YAML `true` is not the number 1
        raise ValueError("want a whole number, not true/false")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("want a whole number")
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
        return int(value)
    raise ValueError("want a whole number")


def _strict_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("want a number, not true/false")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return float(value)
    raise ValueError("want a number")


def _pin_list(value: Any) -> list[str]:
    """``pin`` as "ns,ns=QUOTA" text, a list of "ns[=QUOTA]" / {ns: QUOTA}, or {ns: QUOTA}."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    items = [value] if isinstance(value, Mapping) else value
    if not isinstance(items, list | tuple):
        raise ValueError("want a list of NS or NS=QUOTA, or a mapping NS: QUOTA")
    out: list[str] = []
    for item in items:
        if isinstance(item, Mapping):
            for ns, quota in item.items():
                if not isinstance(ns, str) or isinstance(quota, bool):
                    raise ValueError(f"bad pin {ns!r}: {quota!r}")
                if quota is None or quota == "":
                    out.append(ns)
                else:
                    parse_size(quota)  # a bad quota is an error here, naming the key
                    out.append(f"{ns}={quota}")
        elif isinstance(item, str):
            out.append(item)
        else:
            raise ValueError(f"bad pin {item!r}: want NS or NS=QUOTA")
    return out


def _coerce(section: str, f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.metadata.get("kind")
    try:
        if kind == "size":
            if isinstance(value, bool):
                raise ValueError("want a size such as 512MiB")
            return parse_size(value)
        if kind == "duration":
            if isinstance(value, bool):
                raise ValueError("want a duration such as 10s")
            return parse_duration(value)
        if f.type in ("int", int):
            return _strict_int(value)
        if f.type in ("float", float):
            return _strict_float(value)
        if f.type in ("bool", bool):
            return _strict_bool(value)
        if f.name == "pin":
            return _pin_list(value)
        if f.type in ("list[str]",):
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError("want a list of text values")
            return [str(v) for v in value]
        if isinstance(value, Mapping | list | tuple):
            raise ValueError("want a single text value")
        return str(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"bad value {value!r} for {section}.{f.name} ({_flag(f.name)}): {e}"
        ) from e


def _apply(cfg: Config, section: str, values: Mapping[str, Any], origin: str) -> None:
    target = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise InvalidArgument(
                f"unknown {section} setting {key!r} in {origin}; known: {', '.join(sorted(fields))}"
            )
        if value is not None and value != ():
            setattr(target, name, _coerce(section, fields[name], value))


# Ports: (field, flag); ucx_port also takes -1 (off).
_PORTS = {
    "master": {"port": "--port", "metrics_port": "--metrics-port"},
    "worker": {
        "grpc_port": "--grpc-port",
        "tcp_port": "--tcp-port",
        "ucx_port": "--ucx-port",
        "metrics_port": "--metrics-port",
    },
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(cfg: Config) -> None:
    """Check ranges and choices of every value; InvalidArgument names the key and flag.

    Called by :func:`load_config`; file-system checks (directories, certificates) are in
    :func:`check_worker_files` / :func:`check_tls_files`, run when a daemon starts.
    """
    for section, ports in _PORTS.items():
        sec = getattr(cfg, section)
        for name, flag in ports.items():
            v = getattr(sec, name)
            low = -1 if name == "ucx_port" else 0
            if not low <= v <= 65535:
                raise InvalidArgument(
                    f"{section}.{name} ({flag}) is {v}: a port must be 0..65535"
                    + (
                        " (0 picks a free one, -1 turns it off)"
                        if low < 0
                        else " (0 picks a free one)"
                    )
                )
    m, w = cfg.master, cfg.worker
    bp = m.beat_port.strip().lower()
    if bp not in ("", "off") and not (bp.isdigit() and int(bp) <= 65535):
        raise InvalidArgument(
            f"master.beat_port (--beat-port) is {m.beat_port!r}: want a UDP port 0..65535 "
            "(0 picks a free one), off, or nothing for the gRPC port's number"
        )
    positive: list[tuple[str, str, float]] = [
        ("master", "worker_ttl", m.worker_ttl),
        ("master", "lease_ttl", m.lease_ttl),
        ("worker", "dram_size", w.dram_size),
        ("worker", "max_value_size", w.max_value_size),
        ("worker", "ssd_size", w.ssd_size),
        ("worker", "max_connections", w.max_connections),
        ("worker", "max_connections_per_client", w.max_connections_per_client),
        ("worker", "max_batch", w.max_batch),
        ("worker", "idle_timeout", w.idle_timeout),
        ("worker", "frame_timeout", w.frame_timeout),
        ("worker", "session_ttl", w.session_ttl),
        ("worker", "session_idle_ttl", w.session_idle_ttl),
        ("worker", "max_sessions", w.max_sessions),
    ]
    for section, name, v in positive:
        if v <= 0:
            raise InvalidArgument(f"{section}.{name} ({_flag(name)}) must be positive, got {v}")
    for name in ("drain_timeout", "promote_window"):
        if getattr(w, name) < 0:
            raise InvalidArgument(f"worker.{name} ({_flag(name)}) must not be negative")
    if not 1 <= m.replicas <= 8:
        raise InvalidArgument(f"master.replicas (--replicas) must be 1-8, got {m.replicas}")
    if not 1 <= m.vnodes_per_gib <= MAX_VNODES_PER_GIB:
        raise InvalidArgument(
            f"master.vnodes_per_gib (--vnodes-per-gib) must be 1-{MAX_VNODES_PER_GIB},"
            f" got {m.vnodes_per_gib}"
        )
    for hi, lo in (("dram_high", "dram_low"), ("ssd_high", "ssd_low")):
        h, lw = getattr(w, hi), getattr(w, lo)
        if not 0 < lw <= h <= 1:
            raise InvalidArgument(
                f"worker.{lo} ({lw}) and worker.{hi} ({h}) need 0 < low <= high <= 1"
            )
    if not 0 <= w.session_budget <= 1:
        raise InvalidArgument(f"worker.session_budget must be in [0, 1], got {w.session_budget}")
    if not 0 <= w.session_share <= 1:
        raise InvalidArgument(f"worker.session_share must be in [0, 1], got {w.session_share}")
    if w.max_session_blocks < 0:
        raise InvalidArgument("worker.max_session_blocks must not be negative")
    if w.kv_events_replay_peers < 0:
        raise InvalidArgument("worker.kv_events_replay_peers must not be negative")
    for name in ("kv_events", "kv_events_replay"):
        ep = getattr(w, name)
        if ep and not re.match(r"^(tcp://[^\s]+:\d+|ipc://\S+|inproc://\S+)$", ep):
            raise InvalidArgument(
                f"worker.{name} ({_flag(name)}) is {ep!r}: want tcp://HOST:PORT or ipc://PATH"
            )
    hp = w.huge_pages
    if hp and (hp & (hp - 1) or hp < 64 << 10):
        raise InvalidArgument(
            f"worker.huge_pages (--huge-pages) is {hp}: want a huge page size such as 2MiB "
            "or 1GiB, or 0 for regular pages"
        )
    if hp and w.dram_size < max(hp, w.max_value_size):
        raise InvalidArgument(
            f"worker.dram_size (--dram-size) must be at least one huge page "
            f"({format_size(hp)}) with --huge-pages"
        )
    if w.session_order not in ("per-session", "expected", "recent"):
        raise InvalidArgument(
            f"worker.session_order is {w.session_order!r}: want per-session, expected or recent"
        )
    if w.promote not in ("always", "second-hit", "never"):
        raise InvalidArgument(f"worker.promote is {w.promote!r}: want always, second-hit or never")


def check_tls_files(section: str, cert: str, key: str, ca: str) -> None:
    """Load the PEM files now, so a bad one is named instead of failing a port bind."""
    import ssl

    if bool(cert) != bool(key):
        raise InvalidArgument(
            f"TLS needs both {section}.tls_cert and {section}.tls_key (--tls-cert, --tls-key)"
        )
    if ca and not (cert and key):
        raise InvalidArgument(f"{section}.tls_ca (--tls-ca) needs --tls-cert and --tls-key too")
    for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        if path and not os.path.isfile(path):
            raise InvalidArgument(f"{section}.{name} ({_flag(name)}): no such file {path}")
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise InvalidArgument(
                f"{section}.tls_cert/tls_key ({cert}, {key}) are not a PEM certificate and "
                f"its private key: {getattr(e, 'reason', None) or e}"
            ) from e
    if ca:
        try:
            ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, OSError) as e:
            raise InvalidArgument(
                f"{section}.tls_ca ({ca}) is not a PEM CA bundle: {getattr(e, 'reason', None) or e}"
            ) from e


def check_worker_files(w: WorkerConfig) -> None:
    """The arena directory exists and is writable; the SSD path is (or can be) a directory."""
    if not os.path.isdir(w.shm_dir):
        raise InvalidArgument(
            f"worker.shm_dir (--shm-dir) {w.shm_dir} is not a directory: give a local "
            "directory for the arena's hand-over socket, such as /dev/shm"
        )
    if not os.access(w.shm_dir, os.W_OK | os.X_OK):
        raise InvalidArgument(f"worker.shm_dir (--shm-dir) {w.shm_dir} is not writable")
    if w.ssd_path:
        if os.path.exists(w.ssd_path) and not os.path.isdir(w.ssd_path):
            raise InvalidArgument(
                f"worker.ssd_path (--ssd-path) {w.ssd_path} exists and is not a directory"
            )
        try:
            os.makedirs(w.ssd_path, exist_ok=True)
        except OSError as e:
            raise InvalidArgument(
                f"worker.ssd_path (--ssd-path) {w.ssd_path} cannot be created: {e.strerror}"
            ) from e
        if not os.access(w.ssd_path, os.W_OK | os.X_OK):
            raise InvalidArgument(f"worker.ssd_path (--ssd-path) {w.ssd_path} is not writable")
        check_ssd_room(w.ssd_path, w.ssd_size)


def check_ssd_room(path: str, ssd_size: int) -> None:
    """The SSD tier's values must fit on its disk: free space plus what the tier's LMDB
    files already hold there (a restarted worker reuses them)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    held = 0
    for name in ("data.mdb", "lock.mdb"):
        with contextlib.suppress(OSError):
            held += os.stat(os.path.join(path, name)).st_blocks * 512
    if ssd_size > free + held:
        raise InvalidArgument(
            f"worker.ssd_size (--ssd-size) is {format_size(ssd_size)} but {path} has "
            f"{format_size(free + held)} free"
            + (f" (with the {format_size(held)} the tier holds already)" if held else "")
            + ": lower --ssd-size or use a bigger disk"
        )


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
    # KVSTORE_MASTER (what `kvstore up` tells you to export, and what clients, status and
    # check read) is the worker's master too, below the more specific KVSTORE_WORKER_MASTER.
    if env.get("KVSTORE_MASTER"):
        _apply(cfg, "worker", {"master": env["KVSTORE_MASTER"]}, "KVSTORE_MASTER")
    for section in ("master", "worker"):
        prefix = f"KVSTORE_{section.upper()}_"
        from_env = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
        _apply(cfg, section, from_env, "the environment")
    for section, values in (overrides or {}).items():
        _apply(cfg, section, values, "the command line")
    validate(cfg)
    return cfg
