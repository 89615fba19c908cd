"""How the client reaches each worker of the map: one link per worker, over tcp://,
shm:// (same host, arena handed over by the worker) or ucx:// (when asked for).

:class:`Links` keeps the connection pools, arena mappings and UCX pools across map
versions (a worker that stays in the map keeps its connections; one that leaves has
them closed) and builds the :class:`WorkerLink` list of a new :class:`View`.
Not thread-safe: the client calls :meth:`Links.update` and :meth:`Links.close` under
its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .proto import master_pb2
from .security import Tls
from .sharding import Ring
from .transport import shm
from .transport.shm import ShmArena
from .transport.tcp import GetResult, TcpConnection, TcpPool, parse_tcp_url
from .transport.ucx import UcxPool, find_ucx_url, parse_ucx_url

# A batch for one worker is cut into frames of at most this many payload bytes (one
# value at least), so big batches stream over several connections at once.
FRAME_BYTES = 32 << 20


def runs(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Cut consecutive items into (start, end) runs of at most ``limit`` bytes each,
    and at least one item each."""
    out: list[tuple[int, int]] = []
    start, acc = 0, 0
    for j, s in enumerate(sizes):
        if j > start and acc + s > limit:
            out.append((start, j))
            start, acc = j, 0
        acc += s
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def frames(idx: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Positions ``idx`` (with payload ``sizes``) cut into frames of about FRAME_BYTES."""
    return [idx[a:b] for a, b in runs(sizes, FRAME_BYTES)]


@dataclass(slots=True)
class WorkerLink:
    """One worker of the map and how to reach it: tcp://, shm:// when mapped, or ucx://
    when the client asked for it and the worker advertises it."""

    info: master_pb2.WorkerInfo
    pool: TcpPool
    arena: ShmArena | None = None
    ucx: UcxPool | None = None

    def put(
        self, timeout: float, ns: bytes, hs: list[bytes], vs: list[memoryview], cs: list[int]
    ) -> bytes:
        if self.ucx is not None:
            return self.ucx.put(timeout, ns, hs, vs, cs)
        if self.arena is not None and not self.arena.stale:
            # A worker lets one connection hold at least two values' worth of shm
            # reservations at a time: cut the batch into requests that always fit.
            limit = 2 * max(self.info.max_value_bytes, 1)
            out = bytearray()
            for a, b in runs([v.nbytes for v in vs], limit):
                out += self.pool.call(timeout, shm.put, self.arena, ns, hs[a:b], vs[a:b], cs[a:b])
            return bytes(out)
        return self.pool.call(timeout, TcpConnection.put, ns, hs, vs, cs)

    def get(
        self, timeout: float, ns: bytes, hs: list[bytes], bufs: list[memoryview] | None
    ) -> GetResult:
        if self.ucx is not None:
            return self.ucx.get(timeout, ns, hs, bufs)
        if self.arena is not None and not self.arena.stale:
            return self.pool.call(timeout, shm.get, self.arena, ns, hs, bufs)
        return self.pool.call(timeout, TcpConnection.get, ns, hs, bufs)

    def exists(self, timeout: float, ns: bytes, hs: list[bytes]) -> list[bool]:
        if self.ucx is not None:
            return self.ucx.exists(timeout, ns, hs)
        return self.pool.call(timeout, TcpConnection.exists, ns, hs)

    def remove(self, timeout: float, ns: bytes, hs: list[bytes]) -> int:
        if self.ucx is not None:
            return self.ucx.remove(timeout, ns, hs)
        return self.pool.call(timeout, TcpConnection.remove, ns, hs)


@dataclass(slots=True)
class View:
    """An immutable snapshot of the map: the ring and a link per worker index."""

    version: int
    ring: Ring
    workers: list[WorkerLink]
    max_value: int
    replicas: int = 1  # the map's default copy count
    ns_replicas: dict[str, int] | None = None  # namespace prefix -> copies
    local: np.ndarray | None = None  # per worker: reachable over shm:// (same host)


class Links:
    """Connections to the workers, kept across map versions."""

    def __init__(self, transport: str, tls: Tls | None, token: str) -> None:
        self.transport = transport
        self.tls = tls
        self.token = token
        self._pools: dict[str, TcpPool] = {}
        self._arenas: dict[str, ShmArena | None] = {}
        self._ucx: dict[str, UcxPool] = {}

    def update(
        self, order: Iterable[str], infos: Iterable[master_pb2.WorkerInfo]
    ) -> list[WorkerLink]:
        """Links to the workers ``order`` names (the ring's worker order); connections
        of workers no longer in the map are closed."""
        by_id = {w.id: w for w in infos}
        links: list[WorkerLink] = []
        live: set[str] = set()
        for wid in order:
            info = by_id[wid]
            url = next((e for e in info.endpoints if e.startswith("tcp://")), "")
            key = f"{wid}|{url}"
            live.add(key)
            pool = self._pools.get(key)
            if pool is None:
                host, port = parse_tcp_url(url) if url else ("", 0)
                pool = self._pools[key] = TcpPool(host, port, tls=self.tls, token=self.token)
            arena = None
            if self.transport in ("auto", "shm"):
                # Keyed by the arena's identity too: a worker restarted behind the
                # same id and ports has a new arena, which must be mapped anew.
                surl = next((e for e in info.endpoints if e.startswith("shm://")), "")
                akey = f"{key}|{surl}"
                live.add(akey)
                if akey not in self._arenas:
                    self._arenas[akey] = shm.try_map(info.endpoints)
                arena = self._arenas[akey]
            ucx = None
            ucx_url = find_ucx_url(info.endpoints) if self.transport == "ucx" else ""
            if ucx_url:
                ukey = f"{wid}|{ucx_url}"
                live.add(ukey)
                ucx = self._ucx.get(ukey)
                if ucx is None:
                    uhost, uport = parse_ucx_url(ucx_url)
                    ucx = self._ucx[ukey] = UcxPool(uhost, uport, token=self.token)
            links.append(WorkerLink(info, pool, arena, ucx))
        self._close(lambda k: k not in live)
        return links

    def close(self) -> None:
        self._close(lambda k: True)

    def _close(self, gone: Callable[[str], bool]) -> None:
        for k in [k for k in self._pools if gone(k)]:
            self._pools.pop(k).close()
        for k in [k for k in self._arenas if gone(k)]:
            a = self._arenas.pop(k)
            if a is not None:
                a.close()
        for k in [k for k in self._ucx if gone(k)]:
            self._ucx.pop(k).close()
