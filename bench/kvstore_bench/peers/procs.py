"""Process helpers of the peers and benches: free ports, readiness, stop by pid, CPU time.

Every server a bench starts is a child process on 127.0.0.1; it is waited for (a port that
accepts connections, or a JSON ``{"event": "ready"}`` line on stdout) and stopped by its
pid (SIGTERM, then SIGKILL), never by name. The waiting and stopping are the daemon
package's :mod:`kvstore.procs` (shared with the local cluster and the netns harness);
this module adds the peers' error types and log-file processes.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore import procs
from kvstore.procs import free_port

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


def wait_for_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until ``host:port`` accepts a connection; PeerUnavailable if ``proc`` exits
    first or the timeout passes."""
    why = procs.wait_listening(proc, host, port, timeout)
    if why is None:
        return
    if why.startswith("exited"):
        raise PeerUnavailable(f"{proc.args!r} {why}")
    raise PeerUnavailable(f"nothing listened on {host}:{port} within {timeout:.0f}s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    """SIGTERM ``proc`` (by its pid), wait, then SIGKILL; returns the exit code. Closes
    its pipes."""
    code = procs.stop(proc, timeout)
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return code


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
    got = procs.read_ready(proc, timeout)
    if got.msg is not None:
        return got.msg
    raise PeerUnavailable(f"{what} did not start (exit code {proc.poll()}): {got.tail!r}")


@dataclass(slots=True)
class Proc:
    """A server process we started; stopped by pid (SIGTERM, then SIGKILL)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: str

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (:func:`kvstore.procs.stop`)."""
        procs.stop(self.proc, grace)

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
    why = procs.wait_listening(p.proc, HOST, port, timeout)
    if why is None:
        return
    if why.startswith("exited"):
        raise StartError(f"{p.name} {why}:\n{p.tail()}")
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
