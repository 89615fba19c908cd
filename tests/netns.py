"""A multi-host test harness on one machine: Linux network namespaces.

:class:`Topology` builds N "hosts" (namespaces ``kvt<pid>w<i>``) joined to a
hub namespace (``kvt<pid>h``) by veth pairs on a bridge, all inside namespaces
it created, so the machine's own network is never touched:

    hub 10.200.1.1/24 (bridge) --veth-- w0 10.200.1.10, w1 .11, w2 .12 ...

The master and the client run in the hub (outside the worker hosts), one worker
runs in each host namespace. :meth:`Topology.cut` sets a host's link down on the
hub side (a silent partition: packets vanish, nothing is refused) and
:meth:`Topology.heal` brings it back. :meth:`Topology.destroy` ends what it
started (by pid) and deletes every namespace, also after a failure.

The client lives in a separate process in the hub namespace (its sockets must
be created there): ``python -m tests.netns client --master ADDR`` reads one JSON
command per line on stdin and answers one JSON line on stdout; see
:class:`RemoteClient`.

Needs root and ``ip`` (iproute2): :func:`unavailable` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvstore import procs
from kvstore.cluster import Daemon

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.200.1"  # only inside the namespaces created here
HUB_ADDR = f"{SUBNET}.1"
_NAME = re.compile(r"^kvt(\d+)[hw]\d*$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns): run as root to include them"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2 (`ip`): run scripts/install_etcd.sh"
    probe = f"kvt{os.getpid()}probe"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` is not permitted here: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale_namespaces() -> None:
    """Delete namespaces left by earlier runs of this harness whose process is gone."""
    out = _ip("netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not procs.pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)


def _read_ready(proc: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    """The daemon's JSON ready line (it prints one on stdout when it serves); a daemon
    that is not ready in time is killed (by pid)."""
    got = procs.read_ready(proc, timeout)
    if got.msg is not None:
        return got.msg
    procs.kill(proc)
    raise RuntimeError(f"{what} was not ready within {timeout:.0f}s (exit {proc.poll()})")


@dataclass
class Topology:
    """N worker hosts around a hub; see the module docstring."""

    hosts: int
    log_dir: Path
    tag: str = field(default_factory=lambda: f"kvt{os.getpid()}")
    created: list[str] = field(default_factory=list)
    daemons: list[Daemon] = field(default_factory=list)
    clients: list[RemoteClient] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"{self.tag}h"

    def host(self, i: int) -> str:
        return f"{self.tag}w{i}"

    @staticmethod
    def addr(i: int) -> str:
        """The address of worker host ``i``."""
        return f"{SUBNET}.{10 + i}"

    def create(self) -> Topology:
        """Make the namespaces, bridge and links; on failure undo what was made."""
        remove_stale_namespaces()
        try:
            self._netns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "addr", "add", f"{HUB_ADDR}/24", "dev", "br0")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns = self.host(i)
                self._netns(ns)
                _ip(
                    *("link", "add", f"vh{i}", "netns", self.hub, "type", "veth"),
                    *("peer", "name", "eth0", "netns", ns),
                )
                _ip("-n", self.hub, "link", "set", f"vh{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"vh{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def cut(self, i: int) -> None:
        """Partition host ``i``: its link goes down on the hub side; packets are lost."""
        _ip("-n", self.hub, "link", "set", f"vh{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"vh{i}", "up")

    # ---- processes -------------------------------------------------------------

    def spawn(self, ns: str, role: str, args: list[str], timeout: float = 60.0) -> Daemon:
        """``python -m kvstore ROLE ARGS`` inside namespace ``ns``, once it is ready."""
        argv = [sys.executable, "-m", "kvstore", role, *args]
        log = open(self.log_dir / f"{ns}-{role}-{len(self.daemons)}.log", "ab")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],  # ip execs: the pid is the daemon's
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=REPO,
            )
        try:
            ready = _read_ready(proc, timeout, f"{role} in {ns}")
        except BaseException:
            if proc.stdout is not None:
                proc.stdout.close()
            raise
        d = Daemon(role, proc, ready, args)
        self.daemons.append(d)
        return d

    def client(self, master: str, timeout: float) -> RemoteClient:
        """A client process in the hub namespace."""
        c = RemoteClient(self.hub, master, timeout, self.log_dir / "client.log")
        self.clients.append(c)
        return c

    def destroy(self) -> None:
        """Stop every process started here (by pid), then delete the namespaces."""
        for c in self.clients:
            c.close()
        for d in reversed(self.daemons):
            d.stop(timeout=15)
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created.clear()


class RemoteClient:
    """Drives a kvstore Client that runs in another namespace (``python -m tests.netns
    client``). Each call sends a command and waits up to ``deadline`` seconds for its
    answer; a stuck client fails the test instead of hanging it."""

    def __init__(self, ns: str, master: str, timeout: float, log_path: Path) -> None:
        argv = [sys.executable, "-m", "tests.netns", "client", master, str(timeout)]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=REPO,
            )
        self._buf = b""
        self.call({"op": "ping"}, deadline=60)

    def call(self, cmd: dict[str, Any], deadline: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        end = time.monotonic() + deadline
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"client gave no answer to {cmd} within {deadline}s")
                if sel.select(min(left, 0.5)):
                    chunk = os.read(self.proc.stdout.fileno(), 65536)
                    if not chunk:
                        raise RuntimeError(f"client exited ({self.proc.poll()}) during {cmd}")
                    self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"client failed {cmd}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call({"op": "quit"}, deadline=10)
            try:
                self.proc.wait(10)  # it quits on its own after the "quit" command
            except subprocess.TimeoutExpired:
                procs.kill(self.proc)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


# ---- the client process -------------------------------------------------------------


def _serve_client(master: str, timeout: float, inp: IO[str], out: IO[str]) -> None:
    """Answer commands with a real Client: put/get/exists of ``n`` blocks of ``size``
    bytes keyed by ``salt`` (see tests.helpers), the map's workers, ping, quit."""
    from kvstore_client import Client
    from tests.helpers import key, value_for

    ns = "netns/bf16/b16/tp0of1"
    with Client(master, timeout=timeout) as c:
        for line in inp:
            cmd = json.loads(line)
            op = cmd["op"]
            t0 = time.monotonic()
            answer: dict[str, Any] = {}
            try:
                keys = [key(i, cmd.get("salt", "")) for i in range(int(cmd.get("n", 0)))]
                if op == "quit":
                    out.write("{}\n")
                    out.flush()
                    return
                if op == "put":
                    vals = [value_for(k, int(cmd["size"])) for k in keys]
                    answer["stored"] = sum(c.batch_put(ns, keys, vals))
                elif op == "get":
                    got = c.batch_get(ns, keys)
                    answer["hit"] = [g is not None for g in got]
                    answer["wrong"] = sum(
                        g is not None and g != value_for(k, int(cmd["size"]))
                        for g, k in zip(got, keys, strict=True)
                    )
                elif op == "exists":
                    answer["present"] = c.batch_exists(ns, keys)
                elif op == "workers":
                    answer["ids"] = sorted(w.id for w in c.workers())
                    answer["version"] = c.map_version
            except Exception as e:  # reported to the test, which fails on it
                answer = {"error": repr(e)}
            answer["secs"] = time.monotonic() - t0
            out.write(json.dumps(answer) + "\n")
            out.flush()


if __name__ == "__main__":  # pragma: no cover - run by RemoteClient
    if len(sys.argv) == 4 and sys.argv[1] == "client":
        _serve_client(sys.argv[2], float(sys.argv[3]), sys.stdin, sys.stdout)
    else:
        sys.exit("usage: python -m tests.netns client MASTER TIMEOUT")
