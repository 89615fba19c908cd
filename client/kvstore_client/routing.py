"""How the client reaches each worker of the map: one link per worker, over tcp://,
shm:// (same host, arena handed over by the worker) or ucx:// (when asked for).

:class:`Links` keeps the connection pools, arena mappings and UCX pools across map
versions (a worker that stays in the map keeps its connections; one that leaves has
them closed) and builds the :class:`WorkerLink` list of a new :class:`View`.
Not thread-safe: the client calls :meth:`Links.update` and :meth:`Links.close` under
its lock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .errors import CallerError, InvalidArgument, KVStoreError
from .proto import master_pb2
from .security import Tls
from .sharding import Ring
from .transport import Transfer, shm
from .transport.shm import ShmArena, ShmTransfer
from .transport.tcp import TcpPool, TcpTransfer, parse_tcp_url
from .transport.ucx import UcxPool, find_ucx_url, parse_ucx_url

# A batch for one worker is cut into frames of at most this many payload bytes (one
# value at least), so big batches stream over several connections at once.
FRAME_BYTES = 32 << 20
runs = wire.runs


def parse_masters(master: str) -> list[str]:
    """ "h1:p1,h2:p2" -> ["h1:p1", "h2:p2"]; InvalidArgument when malformed."""
    out = [m.strip() for m in master.split(",") if m.strip()]
    for m in out:
        host, sep, port = m.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(f"bad master address {m!r}: want host:port")
    if not out:
        raise InvalidArgument("no master address given")
    return out


def merge_map(
    held: master_pb2.ShardMap | None, m: master_pb2.ShardMap
) -> master_pb2.ShardMap | None:
    """The full map that ``m`` from a map watch means to a client holding ``held``.

    A full map (``base_version`` 0) is itself. A delta (see master.proto) applies to
    the map of version ``base_version`` only: the result holds its workers less
    ``removed``, with ``workers`` added or replaced (sorted by id, as the master
    sends them), and the delta's other fields. None when ``held`` is not that map:
    the client must fetch a full map again (reopen its watch without a version).
    """
    if not m.base_version:
        return m
    if held is None or held.version != m.base_version:
        return None
    workers = {w.id: w for w in held.workers}
    for wid in m.removed:
        workers.pop(wid, None)
    for w in m.workers:
        workers[w.id] = w
    return master_pb2.ShardMap(
        version=m.version,
        workers=[workers[k] for k in sorted(workers)],
        vnodes_per_gib=m.vnodes_per_gib,
        replicas=m.replicas,
        cluster_id=m.cluster_id,
        namespace_replicas=m.namespace_replicas,
    )


def bind(fn: Callable[..., Any], *args: object) -> Callable[[], Any]:
    """A task for a fan-out: ``fn(*args)`` later."""
    return functools.partial(fn, *args)


def misses_only(_: int, e: KVStoreError) -> None:
    """Fan-out error policy: worker trouble becomes misses; the caller's own mistakes
    are raised."""
    if isinstance(e, CallerError):
        raise e


def frames(idx: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Positions ``idx`` (with payload ``sizes``) cut into frames of about FRAME_BYTES."""
    return [idx[a:b] for a, b in runs(sizes, FRAME_BYTES)]


def pick_transfer(
    info: master_pb2.WorkerInfo, pool: TcpPool, arena: ShmArena | None, ucx: UcxPool | None
) -> Transfer:
    """The one place a worker's transport is chosen: ucx:// when the client asked for
    it and the worker advertises it, shm:// when its arena is mapped (same host), else
    tcp://."""
    if ucx is not None:
        return ucx
    if arena is not None:
        return ShmTransfer(pool, arena, info.max_value_bytes)
    return TcpTransfer(pool)


@dataclass(slots=True)
class WorkerLink:
    """One worker of the map and how to reach it (``transfer``, see :func:`pick_transfer`).
    ``pool`` is its tcp:// pool (also used for EXISTS fan-outs without threads)."""

    info: master_pb2.WorkerInfo
    pool: TcpPool
    arena: ShmArena | None = None
    ucx: UcxPool | None = None
    transfer: Transfer | None = None

    def __post_init__(self) -> None:
        if self.transfer is None:
            self.transfer = pick_transfer(self.info, self.pool, self.arena, self.ucx)

    @property
    def via(self) -> Transfer:
        assert self.transfer is not None
        return self.transfer


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

    def __init__(self, transport: str, tls: Tls | None, token: str, identity: bytes = b"") -> None:
        self.transport = transport
        self.tls = tls
        self.token = token
        self.identity = identity
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
                pool = self._pools[key] = TcpPool(
                    host, port, tls=self.tls, token=self.token, identity=self.identity
                )
            arena = None
            if self.transport in ("auto", "shm"):
                # Keyed by the arena's identity too: a worker restarted behind the
                # same id and ports has a new arena, which must be mapped anew.
                surl = next((e for e in info.endpoints if e.startswith("shm://")), "")
                akey = f"{key}|{surl}"
                live.add(akey)
                if akey not in self._arenas:
                    self._arenas[akey] = shm.try_map(info.endpoints, self.identity, self.token)
                arena = self._arenas[akey]
            ucx = None
            ucx_url = find_ucx_url(info.endpoints) if self.transport == "ucx" else ""
            if ucx_url:
                ukey = f"{wid}|{ucx_url}"
                live.add(ukey)
                ucx = self._ucx.get(ukey)
                if ucx is None:
                    uhost, uport = parse_ucx_url(ucx_url)
                    ucx = self._ucx[ukey] = UcxPool(
                        uhost, uport, token=self.token, identity=self.identity
                    )
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
