"""Peers the benchmarks compare against, one module per system, behind one protocol.

:class:`~kvstore_bench.peers.base.Backend` is what a replay or a store benchmark needs
from a KV-cache store: batched ``exists`` / ``match_prefix``, ``get_into`` caller-owned
buffers, ``put`` and ``remove``. Implementations: ``kvstore`` (:mod:`.kvstore`),
``mooncake`` (:mod:`.mooncake`), ``redis`` (:mod:`.redis`). :func:`open_backend` starts
what a backend needs on 127.0.0.1 (free ports, logs in a temporary directory), yields the
backend and stops every process it started, by pid, even on failure. Keys are 16-byte
block hashes; ``prefix`` keeps runs apart (the kvstore namespace, a key prefix elsewhere).
Process helpers shared by every bench are in :mod:`.procs`. The engine bench's backings
(whole inference engines against each system) are in :mod:`kvstore_bench.engine.peers`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from .base import Backend, ClusterSpec, leading
from .kvstore import KVStoreBackend, _kvstore
from .mooncake import (
    MOONCAKE_PACKAGE,
    MooncakeBackend,
    MooncakeServer,
    MooncakeStoreAdapter,
    _mooncake,
    _mooncake_bin,
    mooncake_master_binary,
    mooncake_store_module,
)
from .procs import (
    HOST,
    PeerUnavailable,
    StartError,
    cpu_seconds,
    free_port,
    quiet_stderr,
    read_ready_line,
    stop_process,
    wait_for_port,
)
from .redis import RedisBackend, _redis

__all__ = [
    "BACKENDS",
    "HOST",
    "MOONCAKE_PACKAGE",
    "Backend",
    "ClusterSpec",
    "KVStoreBackend",
    "MooncakeBackend",
    "MooncakeServer",
    "MooncakeStoreAdapter",
    "PeerUnavailable",
    "RedisBackend",
    "StartError",
    "cpu_seconds",
    "free_port",
    "leading",
    "mooncake_master_binary",
    "mooncake_store_module",
    "open_backend",
    "read_ready_line",
    "stop_process",
    "unavailable_reason",
    "wait_for_port",
]

BACKENDS = ("kvstore", "mooncake", "redis")
"""Backend names in the order ``--backend all`` runs them."""


def unavailable_reason(kind: str) -> str | None:
    """Why ``kind`` cannot run here (missing package or binary), None when it can."""
    if kind == "kvstore":
        return None
    if kind == "redis":
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis Python package is missing (pip install redis==8.1.0)"
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (apt-get install redis-server)"
        return None
    if kind == "mooncake":
        try:
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            with quiet_stderr():
                importlib.import_module("mooncake.store")
        except ImportError as e:
            return (
                "Mooncake is not importable (pip install mooncake-transfer-engine-non-cuda; "
                f"needs libibverbs1 and librdmacm1): {e}"
            )
        if _mooncake_bin("mooncake_master") is None:
            return "mooncake_master is not installed (it comes with the Mooncake wheel)"
        return None
    return f"unknown backend {kind!r}; choose from {', '.join(BACKENDS)}"


@contextlib.contextmanager
def open_backend(kind: str, spec: ClusterSpec, prefix: str) -> Iterator[Backend]:
    """Start what ``kind`` needs, yield a connected backend, stop it all on exit.

    ``prefix`` names this run's keys. Raises StartError when a
    server does not come up and RuntimeError when ``kind`` is unavailable here.
    """
    reason = unavailable_reason(kind)
    if reason is not None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix=f"kvbench-{kind}-") as tmp:
        if kind == "kvstore":
            with _kvstore(spec, prefix, tmp) as b:
                yield b
        elif kind == "mooncake":
            with _mooncake(spec, prefix, tmp) as mb:
                yield mb
        else:
            with _redis(spec, prefix, tmp) as rb:
                yield rb
