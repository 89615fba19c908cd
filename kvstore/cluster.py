"""Start and stop a local cluster (master + N workers) as real child processes.

Used by ``kvstore up``, the demo, the benchmarks and the test fixtures. Each
daemon prints one JSON "ready" line on stdout; we wait for it, so callers get
real addresses (ports picked by the daemons) and know the processes serve.
Children are ended by pid (SIGTERM, then SIGKILL after a grace period), never
by name.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from kvstore_client.security import Tls


class StartError(RuntimeError):
    """A daemon exited or stayed silent before printing its ready line."""


@dataclass(slots=True)
class Daemon:
    """A running daemon: its process and what its ready line said."""

    role: str
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any]
    args: list[str]
    log_path: str | None = None

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
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(5)


def _read_ready(proc: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
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
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("event") == "ready":
                    return msg
    finally:
        sel.close()
    code = proc.poll()
    if code is None:
        proc.kill()
        proc.wait(5)
        raise StartError(f"{what} printed no ready line within {timeout:.0f}s")
    raise StartError(f"{what} exited with code {code} before it was ready")


@dataclass(slots=True)
class Starting:
    """A daemon process launched but not yet ready; see :func:`launch`."""

    role: str
    proc: subprocess.Popen[bytes]
    args: list[str]
    log_path: str | None

    def ready(self, timeout: float = 30.0) -> Daemon:
        """Wait for the ready line; on failure the process is killed and reaped."""
        try:
            msg = _read_ready(self.proc, timeout, f"kvstore {self.role}")
        except BaseException:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            raise
        return Daemon(self.role, self.proc, msg, self.args, self.log_path)


def launch(
    role: str,
    args: Sequence[str],
    *,
    stderr: IO[bytes] | int | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
) -> Starting:
    """Start ``python -m kvstore ROLE ARGS...`` without waiting for it."""
    cmd = [sys.executable, "-m", "kvstore", role, *args]
    err: IO[bytes] | int | None = stderr
    log_fh = None
    if log_path is not None:
        log_fh = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        err = log_fh
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=env, stdin=subprocess.DEVNULL
        )
    finally:
        if log_fh is not None:
            log_fh.close()
    return Starting(role, proc, list(args), log_path)


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
            self.master = spawn(
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
            )
            # Workers start in parallel (each faults its arena in, which takes a while).
            starting = [self._launch_worker(i) for i in range(self.workers)]
            try:
                for s in starting:
                    self.worker_procs.append(s.ready())
            finally:
                for s in starting:  # a failed start leaves no process behind
                    if s.proc.poll() is None and all(
                        w.proc is not s.proc for w in self.worker_procs
                    ):
                        s.proc.kill()
                        s.proc.wait(5)
            self.wait_for_workers(self.workers)
        except BaseException:
            self.stop()
            raise
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
        """Wait until the master's map lists exactly ``n`` workers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.live_worker_ids()) == n:
                return
            time.sleep(0.05)
        raise StartError(f"the master did not list {n} workers within {timeout:.0f}s")

    def stop(self) -> None:
        """Stop workers, then the master; safe to call twice or after a failed start."""
        for w in self.worker_procs:
            w.stop()
        if self.master is not None:
            self.master.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
