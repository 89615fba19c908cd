"""Child processes: wait for a ready line, stop by pid, free ports.

One helper for everything that starts servers as child processes: the local cluster
(:mod:`kvstore.cluster`), the bench peers (``kvstore_bench.peers.procs`` re-uses it) and
the network-namespace harness (``tests/netns.py``). A process is stopped by its own pid
(SIGTERM, then SIGKILL after a grace period), never by name.

Nothing here raises on its own terms: the callers turn a missing ready line into their own
error (``StartError``, ``PeerUnavailable`` ...), with their own wording.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KILL_WAIT_S",
    "Ready",
    "StopSignals",
    "free_port",
    "kill",
    "read_ready",
    "stop",
    "wait_listening",
]

KILL_WAIT_S = 5.0  # how long to wait for a SIGKILLed child to be reaped


@dataclass(slots=True)
class Ready:
    """What :func:`read_ready` saw: the ready message (None if none came) and the last
    500 bytes it read from stdout (for an error message)."""

    msg: dict[str, Any] | None
    tail: bytes


def read_ready(proc: subprocess.Popen[bytes], timeout: float) -> Ready:
    """Read ``proc``'s stdout until a JSON line that is an object with ``"event":
    "ready"``; other lines are skipped.

    Returns as soon as the line arrives, or with ``msg`` None when stdout closes, the
    process exits with nothing left to read, or ``timeout`` seconds pass. Blocks the
    caller at most ``timeout`` seconds (plus one 0.1 s poll); never kills ``proc``.
    ``proc.stdout`` must be a binary pipe.
    """
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    buf = b""
    seen = b""
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
            seen = (seen + chunk)[-500:]
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("event") == "ready":
                    return Ready(msg, seen)
    finally:
        sel.close()
    return Ready(None, seen)


def stop(proc: subprocess.Popen[Any], timeout: float = 15.0) -> int | None:
    """SIGTERM ``proc`` (by its pid) if it runs, wait up to ``timeout`` seconds, then
    SIGKILL and reap it. Returns the exit code (None only if even SIGKILL left it
    unreaped for :data:`KILL_WAIT_S`). Streams are left to the caller; safe to call twice."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill(proc)
    return proc.returncode


def kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc`` (by its pid) if it runs and reap it."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_WAIT_S)


def wait_listening(proc: subprocess.Popen[Any], host: str, port: int, timeout: float) -> str | None:
    """Wait until ``host:port`` accepts a TCP connection. None when it does; otherwise
    why not: ``"exited with code N"`` (``proc`` ended first) or ``"did not listen"``
    (``timeout`` seconds passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return None
        time.sleep(0.05)
    return "did not listen"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (whoever binds it may race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


PR_SET_DUMPABLE = 4


def set_dumpable(on: bool) -> bool:
    """prctl(PR_SET_DUMPABLE): off, only root may ptrace this process, read or write its
    memory through /proc/PID/mem, or open its descriptors through /proc/PID/fd (and it
    leaves no core dump). True when the call took effect (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """Does a process with this pid exist (ours or another user's)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StopSignals:
    """SIGTERM and SIGINT as a flag that a daemon's main loop waits on.

    The handler takes no lock: it records the signal and writes a byte to a pipe
    (both async-signal-safe), and :meth:`wait` selects on that pipe. A
    ``threading.Event`` set from a handler deadlocks when the signal lands while the
    main thread is inside that Event's own ``wait`` holding its condition's lock (the
    handler then waits for a lock its own thread holds, and every later SIGTERM
    does the same), so a daemon stopped at the wrong instant hung until SIGKILL.
    Install from the main thread.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signum: int | None = None
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        # one selector for the process's life (not select.select: a daemon with many
        # connections has descriptors past FD_SETSIZE)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._r, selectors.EVENT_READ)
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, _frame: object) -> None:
        self.signum = signum
        with contextlib.suppress(OSError):  # a full pipe: a byte is there already
            os.write(self._w, b"\0")

    def wait(self, timeout: float) -> bool:
        """True once a stop signal came; else waits up to ``timeout`` seconds for one."""
        if self.signum is None:
            self._sel.select(timeout)
        return self.signum is not None
