"""Mooncake Store as a peer (pip ``mooncake-transfer-engine-non-cuda``).

- :class:`MooncakeBackend` / :func:`open_mooncake` (the replay and store benches): a
  ``mooncake_master`` with its built-in HTTP metadata server, N ``mooncake_client``
  processes each contributing one segment, an in-process client reading into registered
  buffers.
- :class:`MooncakeServer` + :class:`MooncakeStoreAdapter` (the transfer bench):
  ``mooncake_master`` plus Python *segment hosts* (``python -m kvstore_bench.peers
  mooncake-segment``) using Mooncake's peer-to-peer handshake, and a client that mounts
  no segment, so every byte crosses loopback TCP.

Known limitation: Mooncake's transfer engine listens on the wildcard address for its data
and handshake ports whatever ``local_hostname`` says; only 127.0.0.1 is ever connected to.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import numpy as np

from kvstore.procs import StopSignals

from .base import ClusterSpec, leading
from .procs import (
    HOST,
    PeerUnavailable,
    Proc,
    StartError,
    free_port,
    quiet_stderr,
    read_ready_line,
    spawn,
    stop_process,
    wait_for_port,
    wait_port,
)

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
# Quiet the C++ logs of the Mooncake library in every process that loads it.
_MOONCAKE_ENV = {"GLOG_minloglevel": "3", "MC_LOG_LEVEL": "ERROR", "MC_YLT_LOG_LEVEL": "error"}


def _mooncake_env() -> None:
    for k, v in _MOONCAKE_ENV.items():
        os.environ.setdefault(k, v)


def mooncake_store_module() -> ModuleType:
    """Import ``mooncake.store``; PeerUnavailable (with the pip command) when missing."""
    _mooncake_env()
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as e:
        raise PeerUnavailable(
            f"Mooncake Store is not installed ({e}); "
            f"pip install {MOONCAKE_PACKAGE}==0.3.13.post1 (Linux x86-64, needs libibverbs1 "
            "and librdmacm1 from apt)"
        ) from e


def mooncake_master_binary() -> str:
    """Path of the ``mooncake_master`` executable shipped inside the wheel."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(f"Mooncake is not installed: pip install {MOONCAKE_PACKAGE}")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "mooncake_master")
    if not os.path.isfile(path):
        raise PeerUnavailable(f"{path} is missing from the {MOONCAKE_PACKAGE} wheel")
    if not os.access(path, os.X_OK):
        os.chmod(path, os.stat(path).st_mode | 0o111)
    return path


def _setup_store(module: ModuleType, master: str, segment_size: int, local_buffer_size: int) -> Any:
    store = module.MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", segment_size, local_buffer_size, "tcp", "", master)
    if rc != 0:
        raise PeerUnavailable(f"MooncakeDistributedStore.setup(master={master}) returned {rc}")
    return store


class MooncakeServer:
    """``mooncake_master`` plus ``segment_hosts`` processes that each mount
    ``segment_size`` bytes; all children of this process, on 127.0.0.1.

    Use as a context manager (``start`` on enter, ``stop`` on exit). Clients
    connect with ``MooncakeStoreAdapter(server.master_address)``. Raises
    PeerUnavailable when Mooncake is not installed or a child fails to start.
    """

    def __init__(
        self,
        *,
        segment_size: int = 1 << 30,
        segment_hosts: int = 1,
        log_dir: str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.segment_size = segment_size
        self.initial_hosts = segment_hosts
        self.log_dir = log_dir
        self.start_timeout = start_timeout
        self.master: subprocess.Popen[bytes] | None = None
        self.hosts: list[subprocess.Popen[bytes]] = []
        self.master_address = ""
        self.metadata_server = "P2PHANDSHAKE"

    def _log(self, name: str) -> IO[bytes] | int:
        if self.log_dir is None:
            return subprocess.DEVNULL
        return open(os.path.join(self.log_dir, f"{name}.log"), "ab")

    def start(self) -> MooncakeServer:
        """Start the master and the segment hosts; returns once all serve."""
        binary = mooncake_master_binary()
        mooncake_store_module()  # fail early, in this process, if the library cannot load
        try:
            for attempt in range(3):  # a free port can be taken between probe and bind
                port = free_port()
                log = self._log("mooncake-master")
                self.master = subprocess.Popen(
                    [
                        binary,
                        f"--rpc_address={HOST}",
                        f"--rpc_port={port}",
                        "--rpc_thread_num=4",
                        f"--metrics_host={HOST}",
                        f"--metrics_port={free_port()}",
                        "--enable_http_metadata_server=false",
                        "--enable_metric_reporting=false",
                        "--logtostderr",
                        "--minloglevel=1",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
                if not isinstance(log, int):
                    log.close()
                try:
                    wait_for_port(HOST, port, self.master, self.start_timeout)
                    break
                except PeerUnavailable:
                    stop_process(self.master)
                    self.master = None
                    if attempt == 2:
                        raise
            self.master_address = f"{HOST}:{port}"
            for _ in range(self.initial_hosts):
                self.add_segment_host()
        except BaseException:
            self.stop()
            raise
        return self

    def add_segment_host(self) -> int:
        """Start one more process that mounts ``segment_size`` bytes; returns its pid."""
        env = dict(os.environ)
        env.update(_MOONCAKE_ENV)
        log = self._log(f"mooncake-segment{len(self.hosts)}")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore_bench.peers",
                "mooncake-segment",
                "--master",
                self.master_address,
                "--segment-size",
                str(self.segment_size),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )
        if not isinstance(log, int):
            log.close()
        self.hosts.append(proc)
        read_ready_line(proc, self.start_timeout, "Mooncake segment host")
        return proc.pid

    @property
    def pids(self) -> list[int]:
        """Pids of the master and the segment hosts (for CPU accounting)."""
        return [p.pid for p in ([self.master] if self.master else []) + self.hosts]

    def stop(self) -> None:
        """Stop segment hosts, then the master. Safe to call twice or after a failed start."""
        for p in self.hosts:
            stop_process(p)
        if self.master is not None:
            stop_process(self.master)

    def __enter__(self) -> MooncakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MooncakeStoreAdapter:
    """A ``MooncakeDistributedStore`` client over TCP.

    With ``segment_size=0`` (the default) it contributes no memory, so data
    lives on the server's segment hosts and every transfer is remote.
    Zero-copy calls take raw pointers: buffers given to ``batch_put_from`` /
    ``batch_get_into`` must be registered first with :meth:`register`.
    Keys are ``str`` (Mooncake's key type); ``bytes`` keys are hex-encoded.
    """

    def __init__(
        self, master_address: str, *, segment_size: int = 0, local_buffer_size: int = 64 << 20
    ) -> None:
        self._module = mooncake_store_module()
        self.store: Any = _setup_store(
            self._module, master_address, segment_size, local_buffer_size
        )
        self._registered: list[int] = []

    @staticmethod
    def key(k: bytes | str) -> str:
        """The Mooncake key for ``k`` (hex for bytes)."""
        return k.hex() if isinstance(k, bytes) else k

    def register(self, array: np.ndarray) -> None:
        """Register a C-contiguous array for zero-copy transfers; kept until close."""
        if not array.flags.c_contiguous:
            raise ValueError("register needs a C-contiguous array")
        ptr = int(array.ctypes.data)
        rc = self.store.register_buffer(ptr, array.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")
        self._registered.append(ptr)

    def unregister(self, array: np.ndarray) -> None:
        """Undo :meth:`register` for ``array`` (no-op if it was not registered)."""
        ptr = int(array.ctypes.data)
        if ptr in self._registered:
            self._registered.remove(ptr)
            self.store.unregister_buffer(ptr)

    def put(self, key: bytes | str, value: bytes | memoryview) -> bool:
        """Store one value (copied through the local buffer); True on success."""
        return int(self.store.put(self.key(key), value)) == 0

    def get(self, key: bytes | str) -> bytes | None:
        """The value, or None when absent."""
        out = self.store.get(self.key(key))
        return bytes(out) if out else None

    def batch_put_from(
        self, keys: Sequence[bytes | str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Zero-copy put from registered memory; per key 0 = stored, < 0 = Mooncake error."""
        return list(self.store.batch_put_from([self.key(k) for k in keys], list(ptrs), list(sizes)))

    def batch_put(self, keys: Sequence[bytes | str], values: Sequence[np.ndarray]) -> list[int]:
        """``batch_put_from`` for arrays that lie in registered memory."""
        return self.batch_put_from(
            keys, [int(v.ctypes.data) for v in values], [v.nbytes for v in values]
        )

    def batch_get_into(
        self, keys: Sequence[bytes | str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """Zero-copy get into registered memory; per key the bytes read (> 0) or an
        error (< 0, e.g. not found)."""
        return list(self.store.batch_get_into([self.key(k) for k in keys], list(ptrs), list(sizes)))

    def batch_is_exist(self, keys: Sequence[bytes | str]) -> list[bool]:
        """Presence per key (an error counts as absent)."""
        return [r == 1 for r in self.store.batch_is_exist([self.key(k) for k in keys])]

    def remove(self, keys: Sequence[bytes | str]) -> int:
        """Remove keys regardless of leases; returns how many were removed."""
        res = self.store.batch_remove([self.key(k) for k in keys], True)
        return sum(1 for r in res if r == 0)

    def close(self) -> None:
        """Unregister buffers and leave the cluster. Idempotent."""
        if self.store is None:
            return
        for ptr in self._registered:
            with contextlib.suppress(Exception):
                self.store.unregister_buffer(ptr)
        self._registered.clear()
        with contextlib.suppress(Exception):
            self.store.close()
        self.store = None

    def __enter__(self) -> MooncakeStoreAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _segment_host_main(master: str, segment_size: int) -> int:
    """Mount a segment, print a ready line, serve until SIGTERM."""
    stop = StopSignals((signal.SIGTERM,))
    store = _setup_store(mooncake_store_module(), master, segment_size, 16 << 20)
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    while not stop.wait(1.0):
        pass
    with contextlib.suppress(Exception):
        store.close()
    return 0


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
        # Session-aware replays: Mooncake's nearest feature is a soft pin with a TTL on
        # put (evicted only after unpinned objects); 0 = plain puts.
        self.soft_pin_ms = 0

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
        if self.soft_pin_ms:
            ms = importlib.import_module("mooncake.store")
            cfg = ms.ReplicateConfig()
            cfg.soft_pin_action = ms.SoftPinAction.ENABLE
            cfg.soft_pin_ttl_ms = self.soft_pin_ms
            rcs = self.store.batch_put_from(self._keys(keys), _addresses(values), sizes, cfg)
        else:
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
    # Equal memory: with an SSD size, a segment holds what a kvstore worker's DRAM and
    # SSD hold together (Mooncake has no SSD tier here, so all of it is DRAM).
    from kvstore.config import parse_size

    seg = spec.dram_bytes + (parse_size(spec.ssd_size) if spec.ssd_size else 0)
    if seg < 16 << 20:
        raise StartError("Mooncake segments must be at least 16 MiB (--dram-size [+ --ssd-size])")
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
                        f"--global_segment_size={seg}",
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
            desc = f"mooncake: {spec.workers} segments x {seg >> 20} MiB, tcp"
            yield MooncakeBackend(
                store, prefix, desc, spec.workers * seg, [p.proc.pid for p in procs]
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
