"""A busy host for `kvstore bench scale --background-load N`, and the master's own count
of heartbeats served (read from its Prometheus endpoint).

A cluster always runs on a busy host: the masters share nodes with workers and engines.
:class:`BackgroundLoad` starts N processes that spin on the CPU for as long as it is
open (plain ``while True: pass`` interpreters at normal priority), so a loaded host is
reproducible; they are ended by pid.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterable
from types import TracebackType

from kvstore import procs

__all__ = ["BackgroundLoad", "heartbeats_served", "scrape"]

SPIN = "while True: pass"


class BackgroundLoad:
    """``n`` CPU-bound processes beside the run, started on enter, ended (by pid) on exit."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError("background load must be >= 0 processes")
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> BackgroundLoad:
        try:
            for _ in range(self.n):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", SPIN],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self.procs:
            procs.kill(p)
        self.procs = []

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every sample of a Prometheus text endpoint: ``'name{labels}' -> value``."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def heartbeats_served(urls: Iterable[str]) -> float:
    """Heartbeats the masters at ``urls`` applied so far (summed over them; a master
    that does not answer counts 0): ``kvstore_heartbeats_total`` where the master has
    it (one per worker beat, batched or not), else the successful ``heartbeat``
    requests of ``kvstore_requests_total`` (masters before it, one per message)."""
    total = 0.0
    for url in urls:
        try:
            s = scrape(url)
        except OSError:
            continue
        beats = [v for k, v in s.items() if k.startswith("kvstore_heartbeats_total")]
        if beats:
            total += sum(beats)
            continue
        total += sum(
            v
            for k, v in s.items()
            if k.startswith("kvstore_requests_total{")
            and 'op="heartbeat"' in k
            and 'code="OK"' in k
        )
    return total
