"""What the client's pieces share, without the Client itself: the current map view
(set by the map watch), routing a batch to its owners, how many copies a namespace's
keys have, a thread pool that fans calls out within the deadline, and the caller's
credentials. :class:`~kvstore_client.client.Client` (data calls),
:mod:`~kvstore_client.copyreads` (reads of replicated namespaces) and
:mod:`~kvstore_client.sessions` (hints) each hold the same :class:`Dispatch`, so none
of them imports another's module or reaches into its private members."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .errors import KVStoreError, PeerError, Unavailable
from .keys import HASH_LEN, pack_hashes
from .replicas import ReplicaStats, any_owner_groups, replica_count
from .routing import View
from .security import Tls
from .sharding import build_ring

T = TypeVar("T")
Groups = list[tuple[int, np.ndarray]]


class Dispatch:
    """See the module docstring. ``view`` is replaced whole by the map watch (reads
    take it once per call); the rest is fixed for the client's life. Thread-safe."""

    def __init__(
        self,
        timeout: float,
        max_threads: int,
        tls: Tls | None,
        md: tuple[tuple[str, str], ...] | None,
    ) -> None:
        self.timeout = timeout
        self.tls = tls
        self.md = md
        self.view: View | None = None
        self.executor = cf.ThreadPoolExecutor(max_threads, thread_name_prefix="kvstore-io")
        self.replica_stats = ReplicaStats()
        # Per namespace, the most copies a put of this client wrote with ``replicas=``
        # (reads consult as many owners).
        self._wrote: dict[str, int] = {}
        self._lock = threading.Lock()

    def groups(self, hashes: Sequence[bytes]) -> tuple[View, Groups]:
        """The current view and, per primary owner, the indices of its keys."""
        view = self.view
        if view is None or not view.workers:
            return View(0, build_ring([]), [], 0), []
        if len(view.workers) == 1:  # no hashing onto the ring needed
            return view, [(0, np.arange(len(hashes)))]
        owner = view.ring.primary(hashes)
        return view, [(int(w), np.flatnonzero(owner == w)) for w in np.unique(owner)]

    def exists_local(
        self, ns: str, nsb: bytes, hashes: Sequence[bytes]
    ) -> tuple[np.ndarray, bool] | None:
        """Which hashes are present (a bool array), from same-host workers' shared
        indexes only (no socket, no wait), and whether an owner wants to see the lookup
        too (see :attr:`Transfer.wants_lookups`); None when an owner is not a same-host
        worker with its arena mapped, or its index cannot tell for some key. A key an
        index holds is in that worker's arena (its DRAM)."""
        view, groups = self.copy_groups(ns, hashes)
        if not groups:
            return None
        tell = False
        out = np.zeros(len(hashes), dtype=bool)
        packed = pack_hashes(hashes)
        rows = np.frombuffer(packed, dtype=(np.void, HASH_LEN))
        for w, idx in groups:
            link = view.workers[w]
            if not link.via.local:
                return None
            body = packed if len(idx) == len(hashes) else rows[idx].tobytes()
            got = link.via.present(nsb, body, anyway=True)
            if got is None:
                return None
            out[idx] |= got
            tell = tell or link.via.wants_lookups
        return out, tell

    def read_local(
        self, view: View, groups: Groups, nsb: bytes, hashes: Sequence[bytes], views: list[Any]
    ) -> list[bool]:
        """Read blocks whose owners are all same-host workers on the calling thread,
        group after group: per hash, found. A worker's failure makes its blocks misses;
        a caller's error is raised. No hop through the executor, whose threads wait
        for the GIL behind a busy caller (an engine's loads took 40 ms for 3 MB)."""
        result = [False] * len(hashes)
        one = len(groups) == 1
        for w, idx in groups:
            try:
                got = view.workers[w].via.get(
                    self.timeout, nsb, hashes if one else [hashes[i] for i in idx],
                    views if one else [views[i] for i in idx],
                )  # fmt: skip
            except PeerError:
                continue
            for j, i in enumerate(idx):
                result[int(i)] = got.found[j]
        return result

    def copies(self, view: View, ns: str, requested: int | None, *, reading: bool = False) -> int:
        """Copies of a key in ``ns``: for a put, its ``replicas=`` or the map's count;
        for a read (``reading``), also at least as many as this client ever wrote into
        ``ns`` with a per-call ``replicas=``, so those copies are consulted too."""
        r = replica_count(ns, requested, view.replicas, view.ns_replicas or {})
        if reading:
            r = max(r, self._wrote.get(ns, 1))
        return min(r, len(view.workers)) if view.workers else r

    def wrote(self, ns: str, copies: int) -> None:
        """A put wrote ``copies`` copies into ``ns`` (reads then consult as many)."""
        if copies > self._wrote.get(ns, 1):
            with self._lock:
                self._wrote[ns] = max(copies, self._wrote.get(ns, 1))

    def copy_groups(self, ns: str, hashes: Sequence[bytes]) -> tuple[View, Groups]:
        """Like :meth:`groups`, but each worker gets every key it holds any copy of."""
        view, groups = self.groups(hashes)
        r = self.copies(view, ns, None, reading=True)
        if r > 1 and groups:
            groups = any_owner_groups(view.ring.lookup(hashes, r))
        return view, groups

    def fan_out(
        self,
        tasks: Sequence[Callable[[], T]],
        on_error: Callable[[int, KVStoreError], None],
    ) -> list[T | None]:
        """Run tasks in parallel within the deadline; errors go to on_error and yield None."""
        if len(tasks) == 1:
            try:
                return [tasks[0]()]
            except KVStoreError as e:
                on_error(0, e)
                return [None]
        futs = [self.executor.submit(t) for t in tasks]
        out: list[T | None] = []
        deadline = time.monotonic() + self.timeout + 1.0
        for i, f in enumerate(futs):
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except KVStoreError as e:
                on_error(i, e)
                out.append(None)
            except cf.TimeoutError:
                on_error(i, Unavailable("worker call outlived its deadline"))
                out.append(None)
        return out

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
