"""Process helpers of the peers and benches: free ports, readiness, stop by pid, CPU time.

Every server a bench starts is a child process on 127.0.0.1; it is waited for (a port that
accepts connections, or a JSON ``{"event": "ready"}`` line on stdout) and stopped by its
pid (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "HOST",
    "PeerUnavailable",
    "Proc",
    "StartError",
    "cpu_seconds",
    "free_port",
    "quiet_stderr",
    "read_ready_line",
    "spawn",
    "stop_process",
    "wait_for_port",
    "wait_port",
]

HOST = "127.0.0.1"


class PeerUnavailable(RuntimeError):
    """A peer is not installed or could not start; the message says why and how to fix it."""


class StartError(PeerUnavailable):
    """A server did not start (missing binary, exited early, or never became ready)."""


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
