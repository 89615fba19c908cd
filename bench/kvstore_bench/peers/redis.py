"""Redis as a peer: one ``redis-server`` (Debian package) with ``maxmemory`` = the same
total capacity and ``allkeys-lru``, driven with pipelines and MGET."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .base import ClusterSpec, leading
from .procs import free_port, spawn, wait_port

MGET_BYTES = 1 << 20
"""Largest MGET reply or SET pipeline: Redis counts client query and output buffers
against ``maxmemory``, so one big batch per prompt evicts the very blocks in use."""


class RedisBackend:
    """One redis-server: pipelined EXISTS, MGETs copied into the buffers, pipelined
    SET NX; reads and writes in batches of at most MGET_BYTES."""

    name = "redis"

    def __init__(
        self, client: Any, prefix: str, description: str, capacity: int, pids: list[int]
    ) -> None:
        self.r = client
        self.pids = pids
        self.prefix = prefix.encode() + b"/"
        self.description = description
        self.capacity = capacity

    def _keys(self, keys: list[bytes]) -> list[bytes]:
        p = self.prefix
        return [p + k for k in keys]

    def exists(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        pipe = self.r.pipeline(transaction=False)
        for k in self._keys(keys):
            pipe.exists(k)
        return [bool(x) for x in pipe.execute()]

    def match_prefix(self, keys: list[bytes]) -> int:
        return leading(self.exists(keys))

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        if not keys:
            return []
        out: list[bool] = []
        names = self._keys(keys)
        step = max(1, MGET_BYTES // max(1, buffers[0].nbytes))
        for i in range(0, len(names), step):
            got = self.r.mget(names[i : i + step])
            for v, buf in zip(got, buffers[i : i + step], strict=True):
                ok = v is not None and len(v) == buf.nbytes
                if ok:
                    buf[:] = v
                out.append(ok)
        return out

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        import redis

        if not keys:
            return 0, 0
        names = self._keys(keys)
        step = max(1, MGET_BYTES // max(1, values[0].nbytes))
        res: list[Any] = []
        for i in range(0, len(names), step):
            pipe = self.r.pipeline(transaction=False)
            for k, v in zip(names[i : i + step], values[i : i + step], strict=True):
                pipe.set(k, v, nx=True)
            res += pipe.execute(raise_on_error=False)
        failed = sum(1 for x in res if isinstance(x, redis.RedisError))
        return len(res) - failed, failed

    def remove(self, keys: list[bytes]) -> None:
        if keys:
            self.r.unlink(*self._keys(keys))

    def register(self, buf: np.ndarray) -> None:
        return None

    def unregister(self, buf: np.ndarray) -> None:
        return None

    def capacity_blocks(self, block_bytes: int) -> int | None:
        return self.capacity // block_bytes

    def close(self) -> None:
        self.r.close()


@contextlib.contextmanager
def _redis(spec: ClusterSpec, prefix: str, tmp: str) -> Iterator[RedisBackend]:
    import redis

    server = shutil.which("redis-server")
    assert server is not None
    capacity = spec.workers * spec.dram_bytes
    port = free_port()
    p = spawn(
        "redis-server",
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tmp,
            "--maxmemory",
            str(capacity),
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        tmp,
    )
    try:
        wait_port(p, port, spec.timeout)
        r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30.0, max_connections=256)
        r.ping()
        desc = f"redis: 1 server, maxmemory {capacity >> 20} MiB, allkeys-lru"
        b = RedisBackend(r, prefix, desc, capacity, [p.proc.pid])
        try:
            yield b
        finally:
            b.close()
    finally:
        p.stop()
