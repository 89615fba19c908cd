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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import wire
from .errors import CallerError, InvalidArgument, KVStoreError
from .proto import master_pb2
from .security import Tls
from .sharding import Ring
from .transport import Credentials, Opened, Scheme, Transfer, scheme, schemes
from .transport import shm as _shm  # noqa: F401  (registers shm://)
from .transport import ucx as _ucx  # noqa: F401  (registers ucx://)
from .transport.tcp import TcpPool

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
    info: master_pb2.WorkerInfo, pool: TcpPool, opened: dict[str, Opened]
) -> Transfer:
    """The one place a worker's transport is chosen: of the schemes that opened for it
    (``opened``: scheme name -> what it keeps), the registered one of highest rank
    (ucx:// when the client asked for it, then shm:// when the worker's arena is
    mapped), else tcp:// over ``pool``."""
    for s in schemes():
        if s.name in opened:
            t: Transfer = s.transfer(opened[s.name], pool, info)
            return t
    base: Transfer = scheme("tcp").transfer(pool, pool, info)
    return base


@dataclass(slots=True)
class WorkerLink:
    """One worker of the map and how to reach it (``transfer``, see :func:`pick_transfer`).
    ``pool`` is its tcp:// pool (control frames); ``opened``, what the other schemes
    keep for it (see :mod:`kvstore_client.transport.registry`)."""

    info: master_pb2.WorkerInfo
    pool: TcpPool
    opened: dict[str, Opened] = field(default_factory=dict)
    transfer: Transfer | None = None

    def __post_init__(self) -> None:
        if self.transfer is None:
            self.transfer = pick_transfer(self.info, self.pool, self.opened)

    @property
    def via(self) -> Transfer:
        assert self.transfer is not None
        return self.transfer

    @property
    def arena(self) -> Any:
        """The worker's arena mapping (shm://), or None."""
        return self.opened.get("shm")

    @property
    def ucx(self) -> Any:
        """The worker's ucx:// pool, or None."""
        return self.opened.get("ucx")


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
    """Connections to the workers, kept across map versions: per worker, what each
    registered scheme that the ``transport`` choice wants opened for it."""

    def __init__(self, transport: str, tls: Tls | None, token: str, identity: bytes = b"") -> None:
        self.transport = transport
        self.creds = Credentials(tls, token, identity)
        # "worker id|tcp url" -> its tcp:// pool; "...|scheme url" -> what that scheme
        # opened (None: it cannot reach that worker; not tried again)
        self._held: dict[str, Opened | None] = {}

    def update(
        self, order: Iterable[str], infos: Iterable[master_pb2.WorkerInfo]
    ) -> list[WorkerLink]:
        """Links to the workers ``order`` names (the ring's worker order); connections
        of workers no longer in the map are closed."""
        by_id = {w.id: w for w in infos}
        links: list[WorkerLink] = []
        live: set[str] = set()
        tcp = scheme("tcp")
        others = [s for s in schemes() if s is not tcp and s.wanted(self.transport)]
        for wid in order:
            info = by_id[wid]
            url = tcp.find(info.endpoints)
            key = f"{wid}|{url}"
            pool = self._open(key, tcp, url, info, live)
            assert isinstance(pool, TcpPool)
            opened: dict[str, Opened] = {}
            for s in others:
                # Keyed by the scheme's endpoint too: a worker restarted behind the
                # same id and ports has a new arena, which must be mapped anew.
                surl = s.find(info.endpoints)
                if surl and (got := self._open(f"{key}|{surl}", s, surl, info, live)) is not None:
                    opened[s.name] = got
            links.append(WorkerLink(info, pool, opened))
        self._close(lambda k: k not in live)
        return links

    def _open(
        self, key: str, s: Scheme, url: str, info: master_pb2.WorkerInfo, live: set[str]
    ) -> Opened | None:
        live.add(key)
        if key not in self._held:
            self._held[key] = s.open(url, info.endpoints, self.creds)
        return self._held[key]

    def close(self) -> None:
        self._close(lambda k: True)

    def _close(self, gone: Callable[[str], bool]) -> None:
        for k in [k for k in self._held if gone(k)]:
            held = self._held.pop(k)
            if held is not None:
                held.close()
