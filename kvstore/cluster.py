"""Start and stop a local cluster (master + N workers) as real child processes.

Used by ``kvstore up``, the demo, the benchmarks and the test fixtures. Each
daemon prints one JSON "ready" line on stdout; we wait for it, so callers get
real addresses (ports picked by the daemons) and know the processes serve.
Children are ended by pid (SIGTERM, then SIGKILL after a grace period), never
by name; the waiting and stopping is :mod:`kvstore.procs`, shared with the bench
peers and the network-namespace test harness.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from kvstore_client.security import Tls

from . import procs
from .procs import free_port as free_port  # re-exported: tests import it from here


class StartError(RuntimeError):
    """A daemon exited or stayed silent before printing its ready line."""


class StderrRelay:
    """Copies a child's stderr to ours (fd 2), holding it back until the child is ready.

    While held, lines are kept (the last 50), so a daemon that fails to start is reported
    by its own last line (e.g. ``Error: port 7701 on 127.0.0.1 is already in use ...``)
    instead of a second-hand "exited with code 1".
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._held: collections.deque[bytes] | None = collections.deque(maxlen=50)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stderr-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for line in iter(self._stream.readline, b""):
            with self._lock:
                if self._held is not None:
                    self._held.append(line)
                    continue
            _write_stderr(line)
        self._stream.close()

    def release(self) -> None:
        """The child is ready: print what was held and relay from now on."""
        with self._lock:
            held, self._held = self._held or (), None
            for line in held:
                _write_stderr(line)

    def last_error(self, wait: float = 2.0) -> str:
        """The child's last stderr line (after it exited); '' if none."""
        self._thread.join(wait)
        with self._lock:
            lines = [ln.decode(errors="replace").strip() for ln in self._held or ()]
        lines = [ln for ln in lines if ln]
        return lines[-1] if lines else ""

    def dump(self) -> None:
        """Print everything held (a traceback, for example) and stop holding."""
        self.release()

    def mute(self) -> None:
        """Drop what is held and everything the child writes from now on."""
        with self._lock:
            self._held = collections.deque(maxlen=0)


def _write_stderr(data: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(2, data)


def _last_log_line(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [ln for ln in lines if ln]
    return lines[-1] if lines else ""


def _error_text(line: str) -> str:
    return line.removeprefix("Error: ").strip()


@dataclass(slots=True)
class Daemon:
    """A running daemon: its process and what its ready line said."""

    role: str
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]
    args: list[str]
    log_path: str | None = None
    relay: StderrRelay | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return str(self.ready["grpc"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL (by pid, :func:`kvstore.procs.stop`); returns the
        exit code."""
        code = procs.stop(self.proc, timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def kill(self) -> None:
        """SIGKILL and reap."""
        procs.kill(self.proc)


def _read_ready(
    proc: subprocess.Popen[bytes],
    timeout: float,
    what: str,
    last_error: Callable[[], str] = lambda: "",
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    got = procs.read_ready(proc, timeout)
    if got.msg is not None:
        return got.msg
    # stdout closed: the daemon is exiting; give it a moment to be reaped so that an
    # early exit is reported as one (with its error), not as a timeout.
    try:
        code: int | None = proc.wait(min(5.0, max(0.5, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        procs.kill(proc)
        raise StartError(f"{what} printed no ready line within {timeout:.0f}s")
    err = _error_text(last_error())
    if err:
        raise StartError(f"{what} failed to start: {err}")
    raise StartError(f"{what} exited with code {code} before it was ready")


@dataclass(slots=True)
class Starting:
    """A daemon process launched but not yet ready; see :func:`launch`."""

    role: str
    proc: subprocess.Popen[bytes]
    args: list[str]
    log_path: str | None
    relay: StderrRelay | None = None

    def last_error(self) -> str:
        if self.relay is not None:
            return self.relay.last_error()
        return _last_log_line(self.log_path)

    def ready(self, timeout: float = 30.0, *, release: bool = True) -> Daemon:
        """Wait for the ready line; on failure the process is killed and reaped, and
        :class:`StartError` carries the daemon's own last error line when there is one.
        ``release=False`` keeps holding a relayed stderr (see ``Daemon.relay``)."""
        try:
            msg = _read_ready(self.proc, timeout, f"kvstore {self.role}", self.last_error)
        except BaseException:
            procs.kill(self.proc)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            if self.relay is not None and not self.relay.last_error().startswith("Error: "):
                self.relay.dump()  # not a one-line error (a traceback?): show all of it
            raise
        if self.relay is not None and release:
            self.relay.release()
        return Daemon(self.role, self.proc, msg, self.args, self.log_path, self.relay)


def launch(
    role: str,
    args: Sequence[str],
    *,
    stderr: IO[bytes] | int | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    relay_stderr: bool = False,
) -> Starting:
    """Start ``python -m kvstore ROLE ARGS...`` without waiting for it.

    ``relay_stderr`` (used by ``kvstore up`` and the demo): the child's stderr goes to
    ours through a :class:`StderrRelay`, so a failed start is reported in one line.
    """
    cmd = [sys.executable, "-m", "kvstore", role, *args]
    err: IO[bytes] | int | None = stderr
    log_fh = None
    if log_path is not None:
        log_fh = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        err = log_fh
    elif relay_stderr and stderr is None:
        err = subprocess.PIPE
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=env, stdin=subprocess.DEVNULL
        )
    finally:
        if log_fh is not None:
            log_fh.close()
    relay = StderrRelay(proc.stderr) if proc.stderr is not None else None
    return Starting(role, proc, list(args), log_path, relay)


def spawn(
    role: str,
    args: Sequence[str],
    *,
    timeout: float = 30.0,
    stderr: IO[bytes] | int | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
) -> Daemon:
    """Start ``python -m kvstore ROLE ARGS...`` and wait until it is ready."""
    return launch(role, args, stderr=stderr, env=env, log_path=log_path).ready(timeout)


@dataclass(slots=True)
class LocalCluster:
    """A master and N workers on 127.0.0.1 with ports picked by the daemons."""

    workers: int = 2
    dram_size: str = "256MiB"
    max_value_size: str = "16MiB"
    worker_ttl: str = "3s"
    host: str = "127.0.0.1"
    master_port: int = 0
    extra_worker_args: list[str] = field(default_factory=list)
    extra_master_args: list[str] = field(default_factory=list)
    tls: Tls | None = None  # how this process talks to the master (TLS clusters)
    token: str = ""  # bearer token for the master (clusters with tenants)
    log_dir: str | None = None
    stderr: IO[bytes] | int | None = None
    relay_stderr: bool = False  # see launch(); `kvstore up` and the demo set it
    master: Daemon | None = None
    worker_procs: list[Daemon] = field(default_factory=list)
    retired: list[Daemon] = field(default_factory=list)  # replaced by restart_worker

    @property
    def address(self) -> str:
        assert self.master is not None, "cluster not started"
        return self.master.address

    def _log(self, name: str) -> str | None:
        return os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None

    def start(self) -> LocalCluster:
        try:
            self.master = launch(
                "master",
                [
                    "--host",
                    self.host,
                    "--port",
                    str(self.master_port),
                    "--worker-ttl",
                    self.worker_ttl,
                    *self.extra_master_args,
                ],
                stderr=self.stderr,
                log_path=self._log("master"),
                relay_stderr=self.relay_stderr,
            ).ready(release=False)
            # Workers start in parallel (each faults its arena in, which takes a while).
            starting = [self._launch_worker(i) for i in range(self.workers)]
            try:
                for s in starting:
                    self.worker_procs.append(s.ready(release=False))
            finally:
                for s in starting:  # a failed start leaves no process behind
                    if s.proc.poll() is None and all(
                        w.proc is not s.proc for w in self.worker_procs
                    ):
                        procs.kill(s.proc)
            self.wait_for_workers(self.workers)
        except BaseException:
            # One line says why (StartError); the others' shutdown chatter is noise.
            for d in [self.master, *self.worker_procs]:
                if d is not None and d.relay is not None:
                    d.relay.mute()
            self.stop()
            raise
        for d in [self.master, *self.worker_procs]:  # the cluster is up: relay their logs
            if d is not None and d.relay is not None:
                d.relay.release()
        return self

    def _worker_args(self, extra: Sequence[str] = ()) -> list[str]:
        return [
            "--master", self.address,
            "--host", self.host,
            "--dram-size", self.dram_size,
            "--max-value-size", self.max_value_size,
            *self.extra_worker_args,
            *extra,
        ]  # fmt: skip

    def _launch_worker(self, index: int, *extra: str) -> Starting:
        return launch(
            "worker",
            self._worker_args(extra),
            stderr=self.stderr,
            log_path=self._log(f"worker{index}"),
            relay_stderr=self.relay_stderr,
        )

    def add_worker(self, *extra: str) -> Daemon:
        d = self._launch_worker(len(self.worker_procs), *extra).ready()
        self.worker_procs.append(d)
        return d

    def restart_worker(self, i: int, *, kill: bool = False) -> Daemon:
        """Stop worker ``i`` (SIGTERM, or SIGKILL with ``kill``) and start it again
        with the same arguments; returns the new daemon."""
        old = self.worker_procs[i]
        if kill:
            old.kill()
        else:
            old.stop()
        new = spawn("worker", old.args, stderr=self.stderr, log_path=old.log_path)
        self.worker_procs[i] = new
        self.retired.append(old)
        return new

    def live_worker_ids(self) -> set[str]:
        from kvstore_client.proto import master_pb2, master_pb2_grpc
        from kvstore_client.security import metadata, open_channel

        with open_channel(self.address, self.tls) as ch:
            m = master_pb2_grpc.MasterStub(ch).GetShardMap(
                master_pb2.GetShardMapRequest(), timeout=5, metadata=metadata(self.token)
            )
        return {w.id for w in m.workers}

    def wait_for_workers(self, n: int, timeout: float = 20.0) -> None:
        """Wait until the master's map lists exactly ``n`` workers (a master that does
        not answer yet, e.g. one just restarted, is asked again until ``timeout``)."""
        import grpc

        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                if len(self.live_worker_ids()) == n:
                    return
            except grpc.RpcError as e:
                last = f" (last answer: {e.code().name})"
            time.sleep(0.05)
        raise StartError(f"the master did not list {n} workers within {timeout:.0f}s{last}")

    def stop(self) -> None:
        """Stop workers, then the master; safe to call twice or after a failed start.
        The workers get SIGTERM all at once and stop side by side (in turn, a busy host
        made N slow stops add up)."""
        for w in self.worker_procs:
            w.signal(signal.SIGTERM)
        for w in self.worker_procs:
            w.stop()
        if self.master is not None:
            self.master.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- a local etcd (HA masters in tests and benches) --------------------------------


@dataclass(slots=True)
class Etcd:
    """A local etcd-server process and its client URL."""

    proc: subprocess.Popen[bytes]
    url: str
    context: ssl.SSLContext | None = None  # for https:// URLs (client certificate)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (by pid)."""
        procs.stop(self.proc, 10)

    def healthy(self) -> bool:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(f"{self.url}/health", timeout=1, context=self.context) as r,
        ):
            return bool(json.loads(r.read()).get("health") == "true")
        return False

    def metric(self, names: Sequence[str]) -> dict[str, float]:
        """Current values of some of etcd's Prometheus metrics (0 when absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5, context=self.context) as r:
            text = r.read().decode()
        out = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            name = line.split(" ", 1)[0]
            if name in out:
                out[name] = float(line.split()[-1])
        return out


def start_etcd(
    workdir: str | os.PathLike[str],
    *,
    name: str = "kvstore",
    tls_args: Sequence[str] = (),
    context: ssl.SSLContext | None = None,
    attempts: int = 3,
    timeout: float = 30.0,
) -> Etcd:
    """Debian's etcd-server (scripts/install_etcd.sh) on free loopback ports, data and
    log in ``workdir``; healthy when this returns. ``tls_args`` (--cert-file ...) serve
    https:// to clients, checked with ``context``. A start that loses a port race is
    retried; StartError when etcd is missing or never gets healthy."""
    binary = shutil.which("etcd")
    if binary is None:
        raise StartError("etcd is not installed: run scripts/install_etcd.sh")
    scheme = "https" if tls_args else "http"
    log_path = os.path.join(workdir, "etcd.log")
    for attempt in range(attempts):
        client = f"{scheme}://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    *("--name", name, "--data-dir", os.path.join(workdir, f"etcd{attempt}")),
                    *("--listen-client-urls", client, "--advertise-client-urls", client),
                    *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
                    *("--initial-cluster", f"{name}={peer}"),
                    *tls_args,
                    *("--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        etcd = Etcd(proc, client, context)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if etcd.healthy():
                return etcd
            time.sleep(0.1)
        etcd.stop()  # exited (a port was taken meanwhile) or never healthy: try again
    raise StartError(f"etcd did not start; see {log_path}")
