"""Peers to benchmark against: start/stop helpers and thin adapters.

Everything here runs on 127.0.0.1 and starts its servers as child processes of
the caller, on free ports; each server class is a context manager that stops
its children by pid (SIGTERM, then SIGKILL), even when the body failed.

- :class:`MooncakeServer` starts ``mooncake_master`` from the
  ``mooncake-transfer-engine-non-cuda`` wheel plus one or more *segment hosts*:
  Python processes that mount a ``global_segment_size`` of memory into the
  store and otherwise idle. Metadata goes through Mooncake's peer-to-peer
  handshake (``P2PHANDSHAKE``), so no etcd or HTTP metadata server is needed.
- :class:`MooncakeStoreAdapter` is a client (``MooncakeDistributedStore`` over
  ``tcp``) that mounts no segment of its own by default, so every byte it puts
  or gets crosses a loopback TCP connection to a segment host: the same
  topology as a kvstore client talking to a remote worker.
- :class:`RedisServer` starts Debian's ``redis-server`` without persistence;
  :class:`RedisAdapter` wraps redis-py with the same batch calls.

A peer that is not installed raises :class:`PeerUnavailable` with the reason,
so a benchmark can skip it with a note. ``python -m kvstore_bench.peers
mooncake-segment ...`` is the segment host's entry point (internal).

Known limitation: Mooncake's transfer engine listens on the wildcard address
for its data and handshake ports whatever ``local_hostname`` says; only
127.0.0.1 is ever connected to.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import IO, Any

import numpy as np

HOST = "127.0.0.1"
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
# Quiet the C++ logs of the Mooncake library in every process that loads it.
_MOONCAKE_ENV = {"GLOG_minloglevel": "3", "MC_LOG_LEVEL": "ERROR", "MC_YLT_LOG_LEVEL": "error"}


class PeerUnavailable(RuntimeError):
    """A peer is not installed or could not start; the message says why and how to fix it."""


# ---- process helpers (shared by every benchmark) ---------------------------------


def free_port(host: str = HOST) -> int:
    """A TCP port that was free on ``host`` a moment ago (the caller binds it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until ``host:port`` accepts a connection; PeerUnavailable if ``proc`` exits
    first or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerUnavailable(f"{proc.args!r} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise PeerUnavailable(f"nothing listened on {host}:{port} within {timeout:.0f}s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    """SIGTERM ``proc`` (by its pid), wait, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return proc.returncode


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from
    /proc/PID/stat; ``None`` means this process. 0.0 for a process that is gone."""
    if pid is None or pid == os.getpid():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_ready_line(proc: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    """Read ``proc``'s stdout until a JSON line with ``"event": "ready"``;
    PeerUnavailable if it exits or stays silent for ``timeout`` seconds."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.1):
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if isinstance(msg, dict) and msg.get("event") == "ready":
                        return msg
    finally:
        sel.close()
    raise PeerUnavailable(f"{what} did not start (exit code {proc.poll()}): {buf[-500:]!r}")


# ---- Mooncake ---------------------------------------------------------------------


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
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = _setup_store(mooncake_store_module(), master, segment_size, 16 << 20)
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    while not stop.wait(1.0):
        pass
    with contextlib.suppress(Exception):
        store.close()
    return 0


# ---- Redis --------------------------------------------------------------------------


class RedisServer:
    """Debian's ``redis-server`` on 127.0.0.1 and a free port, with no persistence
    (no RDB snapshots, no AOF) and a scratch working directory.

    Use as a context manager. PeerUnavailable when ``redis-server`` is not on PATH
    (``apt-get install -y redis-server``) or it does not start.
    """

    def __init__(self, *, maxmemory: str = "0", start_timeout: float = 20.0) -> None:
        self.maxmemory = maxmemory
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._dir: str | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> RedisServer:
        """Start the server; returns once it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise PeerUnavailable("redis-server is not installed: apt-get install -y redis-server")
        self._dir = tempfile.mkdtemp(prefix="kvstore-bench-redis-")
        try:
            for attempt in range(3):
                self.port = free_port()
                self.proc = subprocess.Popen(
                    [
                        binary,
                        "--bind", HOST,
                        "--port", str(self.port),
                        "--save", "",
                        "--appendonly", "no",
                        "--dir", self._dir,
                        "--maxmemory", self.maxmemory,
                        "--loglevel", "warning",
                        "--daemonize", "no",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
                try:
                    wait_for_port(HOST, self.port, self.proc, self.start_timeout)
                    self._ping()
                    break
                except (PeerUnavailable, OSError):
                    stop_process(self.proc)
                    self.proc = None
                    if attempt == 2:
                        raise
        except BaseException:
            self.stop()
            raise
        return self

    def _ping(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            with socket.create_connection((HOST, self.port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise PeerUnavailable("redis-server does not answer PING")

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def stop(self) -> None:
        """Stop the server (by pid) and remove its directory. Idempotent."""
        if self.proc is not None:
            stop_process(self.proc)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisAdapter:
    """redis-py with the batch calls of the other adapters. Keys are bytes.

    Redis has no zero-copy reads: ``batch_get_into`` copies each value into its
    buffer after MGET. PeerUnavailable when redis-py is not installed.
    """

    def __init__(self, address: str) -> None:
        try:
            redis = importlib.import_module("redis")
        except ImportError as e:
            raise PeerUnavailable(f"redis-py is not installed ({e}): pip install redis") from e
        host, _, port = address.rpartition(":")
        self.client: Any = redis.Redis(host=host, port=int(port))

    def put(self, key: bytes, value: bytes | memoryview) -> bool:
        """Store one value if absent (SET NX); True when stored now."""
        return bool(self.client.set(key, bytes(value), nx=True))

    def get(self, key: bytes) -> bytes | None:
        """The value, or None when absent."""
        v = self.client.get(key)
        return bytes(v) if v is not None else None

    def batch_put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        """SET NX per key in one pipeline round trip; True = stored now."""
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(keys, values, strict=True):
            pipe.set(k, v, nx=True)
        return [bool(r) for r in pipe.execute()]

    def batch_get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[bool]:
        """MGET, then copy each hit of the right size into its buffer."""
        out: list[bool] = []
        for v, buf in zip(self.client.mget(list(keys)), buffers, strict=True):
            ok = v is not None and len(v) == buf.nbytes
            if ok:
                buf[:] = v
            out.append(ok)
        return out

    def batch_is_exist(self, keys: Sequence[bytes]) -> list[bool]:
        """EXISTS per key in one pipeline round trip."""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return [bool(r) for r in pipe.execute()]

    def remove(self, keys: Sequence[bytes]) -> int:
        """DEL; returns how many were present."""
        return int(self.client.delete(*keys)) if keys else 0

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()

    def __enter__(self) -> RedisAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Internal entry point: ``mooncake-segment --master ADDR --segment-size N``."""
    p = argparse.ArgumentParser(prog="python -m kvstore_bench.peers")
    sub = p.add_subparsers(dest="cmd", required=True)
    seg = sub.add_parser("mooncake-segment", help="mount a Mooncake segment and idle")
    seg.add_argument("--master", required=True)
    seg.add_argument("--segment-size", type=int, required=True)
    args = p.parse_args(argv)
    return _segment_host_main(args.master, args.segment_size)


if __name__ == "__main__":
    sys.exit(main())
