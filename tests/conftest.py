"""Shared fixtures: real master and worker processes on 127.0.0.1 with free ports.

Every daemon a test needs is started here and stopped in teardown, even when the
test fails; teardown also checks that nothing leaked (processes, arena files).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.cluster import LocalCluster


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run long variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def arena_files(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kvstore-{pid}-*")


def assert_no_leaks(cluster: LocalCluster) -> None:
    daemons = [
        *cluster.worker_procs,
        *cluster.retired,
        *([cluster.master] if cluster.master else []),
    ]
    for d in daemons:
        assert not d.alive(), f"{d.role} pid {d.pid} still running"
        assert not arena_files(d.pid), f"arena of pid {d.pid} left in /dev/shm"


MakeCluster = Callable[..., LocalCluster]


def unlink_killed_arenas(c: LocalCluster) -> None:
    """SIGKILLed workers cannot unlink their arena; the test that killed them cleans up
    (after ``c.stop()``)."""
    for w in [*c.worker_procs, *c.retired]:
        if w.proc.returncode == -9:
            for f in arena_files(w.pid):
                os.unlink(f)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[MakeCluster]:
    """A factory: ``make_cluster(workers=2, ...)`` starts a cluster stopped at teardown."""
    started: list[LocalCluster] = []

    def factory(**kw: object) -> LocalCluster:
        kw.setdefault("log_dir", str(tmp_path))
        c = LocalCluster(**kw)  # type: ignore[arg-type]
        started.append(c)
        return c.start()

    yield factory
    for c in started:
        c.stop()
    for c in started:
        unlink_killed_arenas(c)
        assert_no_leaks(c)


@pytest.fixture
def cluster(make_cluster: MakeCluster) -> LocalCluster:
    """Master + 2 workers of 256 MiB, worker TTL 2 s."""
    return make_cluster(workers=2, dram_size="256MiB", worker_ttl="2s")


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One cluster for a whole module of tests that only read and write their own keys."""
    c = LocalCluster(
        workers=2,
        dram_size="256MiB",
        worker_ttl="2s",
        log_dir=str(tmp_path_factory.mktemp("shared")),
    )
    try:
        yield c.start()
    finally:
        c.stop()
        assert_no_leaks(c)
