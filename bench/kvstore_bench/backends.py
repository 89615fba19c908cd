"""Stores the benchmarks drive, behind one small interface, and the servers behind them.

:class:`Backend` is what a replay or a store benchmark needs from a KV-cache store:
batched ``exists`` / ``match_prefix``, ``get_into`` caller-owned buffers, ``put`` and
``remove``. Three implementations:

- ``kvstore``: :class:`kvstore_client.Client` against a :class:`LocalCluster` started here
  (master + N workers) or an existing cluster (``master=HOST:PORT``);
- ``mooncake``: Mooncake Store over TCP (pip ``mooncake-transfer-engine-non-cuda``): a
  ``mooncake_master`` with its built-in HTTP metadata server, N ``mooncake_client``
  processes each contributing one segment of the same size as a kvstore worker's DRAM, and
  an in-process client that reads into and writes from registered buffers;
- ``redis``: one ``redis-server`` (Debian package) with ``maxmemory`` = the same total
  capacity and ``allkeys-lru``, driven with pipelines and MGET.

:func:`open_backend` starts what a backend needs on 127.0.0.1 (free ports, logs in a
temporary directory), yields the backend and stops every process it started, by pid,
even on failure. Keys are 16-byte block hashes; ``prefix`` keeps runs apart (it is the
kvstore namespace, a key prefix for the others).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BACKENDS",
    "Backend",
    "ClusterSpec",
    "StartError",
    "open_backend",
    "unavailable_reason",
]

BACKENDS = ("kvstore", "mooncake", "redis")
"""Backend names in the order ``--backend all`` runs them."""


class StartError(RuntimeError):
    """A server did not start (missing binary, exited early, or never became ready)."""


class Backend(Protocol):
    """A KV-cache store as the benchmarks see it. Keys are 16-byte hashes.

    All calls are blocking and safe to call from several threads at once. A store that
    is full or unreachable turns its keys into misses or failed puts, never exceptions.
    """

    name: str
    description: str
    pids: list[int]
    """Server processes started for this backend (empty for an existing cluster)."""

    def exists(self, keys: list[bytes]) -> list[bool]:
        """Which keys are present, in one batched call."""
        ...

    def match_prefix(self, keys: list[bytes]) -> int:
        """Number of leading keys present."""
        ...

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        """Read each value into its buffer (same size); True where it arrived whole.
        ``parallel=False`` reads from one server at a time (where there are several)."""
        ...

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        """Store the values; returns (accepted, failed). Already present counts as
        accepted (for kvstore it is not counted at all: accepted = newly stored)."""
        ...

    def remove(self, keys: list[bytes]) -> None:
        """Drop the keys (absent ones are ignored)."""
        ...

    def register(self, buf: np.ndarray) -> None:
        """Announce a long-lived buffer that get_into / put will use (Mooncake registers
        it with its transfer engine; a no-op elsewhere)."""
        ...

    def unregister(self, buf: np.ndarray) -> None:
        """Undo :meth:`register` before ``buf`` is freed."""
        ...

    def capacity_blocks(self, block_bytes: int) -> int | None:
        """How many blocks of this size the store can hold, None when unknown."""
        ...

    def close(self) -> None:
        """Release connections (not the servers: :func:`open_backend` stops those)."""
        ...


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What to start: the same capacity for every backend.

    ``workers`` x ``dram_bytes`` is the total memory (kvstore workers, Mooncake
    segments, one Redis ``maxmemory``). ``max_value_bytes`` is kvstore's slab size (pick
    a small multiple of the block size). ``ssd_size`` (text, e.g. "4GiB"), when given,
    is passed to kvstore workers as ``--ssd-size`` with a per-worker ``--ssd-path``
    in a temporary directory. ``master`` uses a running kvstore cluster instead;
    ``transport`` is the kvstore client's (None: its default, "auto").
    ``mooncake_lease_ms`` is Mooncake's read lease (an object read within it cannot be
    evicted; a read that outlasts it fails). Mooncake defaults to 10 s, which at replay
    speed pins most of a small cache, so its puts fail; 2 s is enough for every read here.
    """

    workers: int = 2
    dram_bytes: int = 256 << 20
    max_value_bytes: int = 1 << 20
    ssd_size: str | None = None
    master: str | None = None
    timeout: float = 30.0
    mooncake_lease_ms: int = 2000
    transport: str | None = None


def unavailable_reason(kind: str) -> str | None:
    """Why ``kind`` cannot run here (missing package or binary), None when it can."""
    if kind == "kvstore":
        return None
    if kind == "redis":
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis Python package is missing (pip install redis==8.1.0)"
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (apt-get install redis-server)"
        return None
    if kind == "mooncake":
        try:
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            with quiet_stderr():
                importlib.import_module("mooncake.store")
        except ImportError as e:
            return (
                "Mooncake is not importable (pip install mooncake-transfer-engine-non-cuda; "
                f"needs libibverbs1 and librdmacm1): {e}"
            )
        if _mooncake_bin("mooncake_master") is None:
            return "mooncake_master is not installed (it comes with the Mooncake wheel)"
        return None
    return f"unknown backend {kind!r}; choose from {', '.join(BACKENDS)}"


@contextlib.contextmanager
def open_backend(kind: str, spec: ClusterSpec, prefix: str) -> Iterator[Backend]:
    """Start what ``kind`` needs, yield a connected backend, stop it all on exit.

    ``prefix`` names this run's keys. Raises StartError when a
    server does not come up and RuntimeError when ``kind`` is unavailable here.
    """
    reason = unavailable_reason(kind)
    if reason is not None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix=f"kvbench-{kind}-") as tmp:
        if kind == "kvstore":
            with _kvstore(spec, prefix, tmp) as b:
                yield b
        elif kind == "mooncake":
            with _mooncake(spec, prefix, tmp) as mb:
                yield mb
        else:
            with _redis(spec, prefix, tmp) as rb:
                yield rb


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- kvstore


class KVStoreBackend:
    """kvstore through :class:`kvstore_client.Client`; ``prefix`` is the namespace."""

    name = "kvstore"

    def __init__(
        self,
        master: str,
        prefix: str,
        description: str = "kvstore",
        transport: str | None = None,
    ) -> None:
        from kvstore_client import Client

        self.description = description
        self.pids: list[int] = []
        self.ns = prefix
        self.client = Client(master, timeout=30.0, transport=transport)
        # One I/O thread: a batch's per-worker reads run one after another.
        self.serial = Client(master, timeout=30.0, max_threads=1, transport=transport)

    def exists(self, keys: list[bytes]) -> list[bool]:
        return self.client.batch_exists(self.ns, keys) if keys else []

    def match_prefix(self, keys: list[bytes]) -> int:
        return self.client.match_prefix(self.ns, keys) if keys else 0

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        if not keys:
            return []
        c = self.client if parallel else self.serial
        return c.batch_get_into(self.ns, keys, buffers).result()

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        from kvstore_client.errors import ResourceExhausted

        if not keys:
            return 0, 0
        try:
            return sum(self.client.batch_put(self.ns, keys, values)), 0
        except ResourceExhausted:
            # Some blocks found no unpinned slot; which ones is not reported.
            present = self.client.batch_exists(self.ns, keys)
            return sum(present), len(keys) - sum(present)

    def remove(self, keys: list[bytes]) -> None:
        if keys:
            self.client.remove(self.ns, keys)

    def register(self, buf: np.ndarray) -> None:
        return None

    def unregister(self, buf: np.ndarray) -> None:
        return None

    def capacity_blocks(self, block_bytes: int) -> int | None:
        from kvstore.worker.tiers.dram import size_classes

        total = 0
        for w in self.client.cluster_status().workers:
            slab = int(w.info.max_value_bytes)
            cap = int(w.info.capacity_bytes)
            if block_bytes > slab:
                return 0
            slot = next(s for s in size_classes(slab) if s >= block_bytes)
            total += (cap // slab) * (slab // slot)
            total += int(w.stats.ssd_capacity_bytes) // block_bytes
        return total

    def close(self) -> None:
        self.client.close()
        self.serial.close()


@contextlib.contextmanager
def _kvstore(spec: ClusterSpec, prefix: str, tmp: str) -> Iterator[KVStoreBackend]:
    from kvstore.cluster import LocalCluster
    from kvstore.cluster import StartError as ClusterStartError
    from kvstore.config import format_size

    if spec.master:
        desc = f"kvstore at {spec.master}, transport {spec.transport or 'auto'}"
        b = KVStoreBackend(spec.master, prefix, desc, spec.transport)
        try:
            yield b  # this run's blocks stay: they are cache entries, evicted in time
        finally:
            b.close()
        return
    cluster = LocalCluster(
        workers=0,
        dram_size=str(spec.dram_bytes),
        max_value_size=str(spec.max_value_bytes),
        log_dir=tmp,
    )
    desc = f"kvstore: {spec.workers} workers x {format_size(spec.dram_bytes)} DRAM"
    desc += f", slabs of {format_size(spec.max_value_bytes)}, transport {spec.transport or 'auto'}"
    try:
        cluster.start()
        for i in range(spec.workers):
            extra = ["--id", f"w{i}"]  # stable ids: the same ring, run after run
            if spec.ssd_size:
                extra += ["--ssd-path", os.path.join(tmp, f"ssd{i}"), "--ssd-size", spec.ssd_size]
            cluster.add_worker(*extra)
        cluster.wait_for_workers(spec.workers)
    except ClusterStartError as e:
        cluster.stop()
        raise StartError(f"kvstore cluster did not start: {e} (logs were in {tmp})") from e
    except BaseException:
        cluster.stop()
        raise
    if spec.ssd_size:
        desc += f" + {spec.ssd_size} SSD"
    try:
        b = KVStoreBackend(cluster.address, prefix, desc, spec.transport)
        b.pids = [
            d.pid for d in [*cluster.worker_procs, *([cluster.master] if cluster.master else [])]
        ]
        try:
            yield b
        finally:
            b.close()
    finally:
        cluster.stop()


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Proc:
    """A server process we started; stopped by pid (SIGTERM, then SIGKILL)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: str

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def tail(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-1500:]
        except OSError:
            return ""


def spawn(name: str, cmd: list[str], tmp: str, env: dict[str, str] | None = None) -> Proc:
    """Start ``cmd`` with stdout and stderr to ``tmp/<name>.log``."""
    log = os.path.join(tmp, f"{name}.log")
    with open(log, "ab") as fh:
        p = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    return Proc(name, p, log)


def wait_port(p: Proc, port: int, timeout: float) -> None:
    """Wait until ``p`` accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise StartError(f"{p.name} exited with code {p.proc.returncode}:\n{p.tail()}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise StartError(f"{p.name} did not listen on port {port} within {timeout:.0f}s:\n{p.tail()}")


@contextlib.contextmanager
def quiet_stderr(log: str = os.devnull) -> Iterator[None]:
    """Send file descriptor 2 to ``log`` meanwhile (Mooncake's C++ logging writes there,
    a line per miss, and no setting silences all of it); restored on exit."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def _mooncake_bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def _addresses(bufs: Sequence[memoryview]) -> list[int]:
    return [np.frombuffer(b, dtype=np.uint8).ctypes.data for b in bufs]


# --------------------------------------------------------------------------- mooncake


class MooncakeBackend:
    """Mooncake Store's Python client over TCP, reading into registered buffers."""

    name = "mooncake"

    def __init__(
        self, store: Any, prefix: str, description: str, capacity: int, pids: list[int]
    ) -> None:
        self.store = store
        self.pids = pids
        self.prefix = prefix + "/"
        self.description = description
        self.capacity = capacity

    def _keys(self, keys: list[bytes]) -> list[str]:
        p = self.prefix
        return [p + k.hex() for k in keys]

    def exists(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        return [r == 1 for r in self.store.batch_is_exist(self._keys(keys))]

    def match_prefix(self, keys: list[bytes]) -> int:
        return leading(self.exists(keys))

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        if not keys:
            return []
        sizes = [b.nbytes for b in buffers]
        rcs = self.store.batch_get_into(self._keys(keys), _addresses(buffers), sizes)
        return [rc == s for rc, s in zip(rcs, sizes, strict=True)]

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        if not keys:
            return 0, 0
        sizes = [v.nbytes for v in values]
        rcs = self.store.batch_put_from(self._keys(keys), _addresses(values), sizes)
        ok = sum(1 for rc in rcs if rc == 0)
        return ok, len(rcs) - ok

    def remove(self, keys: list[bytes]) -> None:
        if keys:
            self.store.batch_remove(self._keys(keys), force=True)

    def register(self, buf: np.ndarray) -> None:
        rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer failed: {rc}")

    def unregister(self, buf: np.ndarray) -> None:
        self.store.unregister_buffer(buf.ctypes.data)

    def capacity_blocks(self, block_bytes: int) -> int | None:
        return self.capacity // block_bytes

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.close()


@contextlib.contextmanager
def _mooncake(spec: ClusterSpec, prefix: str, tmp: str) -> Iterator[MooncakeBackend]:
    master_bin = _mooncake_bin("mooncake_master")
    client_bin = _mooncake_bin("mooncake_client")
    if master_bin is None or client_bin is None:
        raise StartError("mooncake_master / mooncake_client not found")
    if spec.dram_bytes < 16 << 20:
        raise StartError("Mooncake segments must be at least 16 MiB (--dram-size)")
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    procs: list[Proc] = []
    store: Any = None
    with quiet_stderr(os.path.join(tmp, "mooncake-python-client.log")):
        try:
            rpc, meta, metrics = free_port(), free_port(), free_port()
            master = spawn(
                "mooncake_master",
                [
                    master_bin,
                    f"--rpc_port={rpc}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={meta}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={metrics}",
                    f"--default_kv_lease_ttl={spec.mooncake_lease_ms}",
                ],
                tmp,
                env,
            )
            procs.append(master)
            wait_port(master, rpc, spec.timeout)
            wait_port(master, meta, spec.timeout)
            meta_url = f"http://127.0.0.1:{meta}/metadata"
            for i in range(spec.workers):
                port = free_port()
                p = spawn(
                    f"mooncake_client{i}",
                    [
                        client_bin,
                        f"--master_server_address=127.0.0.1:{rpc}",
                        f"--metadata_server={meta_url}",
                        f"--global_segment_size={spec.dram_bytes}",
                        "--host=127.0.0.1",
                        f"--port={port}",
                        "--protocol=tcp",
                    ],
                    tmp,
                    env,
                )
                procs.append(p)
                wait_port(p, port, spec.timeout)
            store = importlib.import_module("mooncake.store").MooncakeDistributedStore()
            rc = store.setup("127.0.0.1", meta_url, 0, 64 << 20, "tcp", "", f"127.0.0.1:{rpc}")
            if rc != 0:
                raise StartError(f"Mooncake client setup failed with {rc}:\n{master.tail()}")
            _mooncake_probe(store, spec.timeout)
            desc = f"mooncake: {spec.workers} segments x {spec.dram_bytes >> 20} MiB, tcp"
            yield MooncakeBackend(
                store, prefix, desc, spec.workers * spec.dram_bytes, [p.proc.pid for p in procs]
            )
        finally:
            if store is not None:
                with contextlib.suppress(Exception):
                    store.close()
            for p in reversed(procs):
                p.stop()


def _mooncake_probe(store: Any, timeout: float) -> None:
    """Wait until a put succeeds (every segment may take a moment to mount)."""
    probe = np.ones(4096, dtype=np.uint8)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.put("kvbench-probe", probe.tobytes()) == 0:
            store.remove("kvbench-probe", force=True)
            return
        time.sleep(0.1)
    raise StartError("Mooncake accepted no put: no segment mounted in time")


# --------------------------------------------------------------------------- redis


MGET_BYTES = 1 << 20
"""Largest MGET reply or SET pipeline: Redis counts client query and output buffers
against ``maxmemory``, so one big batch per prompt evicts the very blocks in use."""


class RedisBackend:
    """One redis-server: pipelined EXISTS, MGETs copied into the buffers, pipelined
    SET NX; reads and writes in batches of at most MGET_BYTES."""

    name = "redis"

    def __init__(
        self, client: Any, prefix: str, description: str, capacity: int, pids: list[int]
    ) -> None:
        self.r = client
        self.pids = pids
        self.prefix = prefix.encode() + b"/"
        self.description = description
        self.capacity = capacity

    def _keys(self, keys: list[bytes]) -> list[bytes]:
        p = self.prefix
        return [p + k for k in keys]

    def exists(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        pipe = self.r.pipeline(transaction=False)
        for k in self._keys(keys):
            pipe.exists(k)
        return [bool(x) for x in pipe.execute()]

    def match_prefix(self, keys: list[bytes]) -> int:
        return leading(self.exists(keys))

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        if not keys:
            return []
        out: list[bool] = []
        names = self._keys(keys)
        step = max(1, MGET_BYTES // max(1, buffers[0].nbytes))
        for i in range(0, len(names), step):
            got = self.r.mget(names[i : i + step])
            for v, buf in zip(got, buffers[i : i + step], strict=True):
                ok = v is not None and len(v) == buf.nbytes
                if ok:
                    buf[:] = v
                out.append(ok)
        return out

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        import redis

        if not keys:
            return 0, 0
        names = self._keys(keys)
        step = max(1, MGET_BYTES // max(1, values[0].nbytes))
        res: list[Any] = []
        for i in range(0, len(names), step):
            pipe = self.r.pipeline(transaction=False)
            for k, v in zip(names[i : i + step], values[i : i + step], strict=True):
                pipe.set(k, v, nx=True)
            res += pipe.execute(raise_on_error=False)
        failed = sum(1 for x in res if isinstance(x, redis.RedisError))
        return len(res) - failed, failed

    def remove(self, keys: list[bytes]) -> None:
        if keys:
            self.r.unlink(*self._keys(keys))

    def register(self, buf: np.ndarray) -> None:
        return None

    def unregister(self, buf: np.ndarray) -> None:
        return None

    def capacity_blocks(self, block_bytes: int) -> int | None:
        return self.capacity // block_bytes

    def close(self) -> None:
        self.r.close()


@contextlib.contextmanager
def _redis(spec: ClusterSpec, prefix: str, tmp: str) -> Iterator[RedisBackend]:
    import redis

    server = shutil.which("redis-server")
    assert server is not None
    capacity = spec.workers * spec.dram_bytes
    port = free_port()
    p = spawn(
        "redis-server",
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tmp,
            "--maxmemory",
            str(capacity),
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        tmp,
    )
    try:
        wait_port(p, port, spec.timeout)
        r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30.0, max_connections=256)
        r.ping()
        desc = f"redis: 1 server, maxmemory {capacity >> 20} MiB, allkeys-lru"
        b = RedisBackend(r, prefix, desc, capacity, [p.proc.pid])
        try:
            yield b
        finally:
            b.close()
    finally:
        p.stop()
