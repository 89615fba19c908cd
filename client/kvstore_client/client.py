"""The kvstore client: routes batches of blocks straight to their owner workers.

It asks the master for the shard map once and then watches it; every data call
groups its hashes by owner (see :mod:`kvstore_client.sharding`) and sends one
request per worker, all in parallel, over the transfer plane. A worker that is
down or dies mid-call turns its keys into misses (False / None), never errors;
invalid arguments raise :class:`~kvstore_client.errors.InvalidArgument`.

All methods are thread-safe. Every call has a deadline (``timeout``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import grpc
import numpy as np

from . import leases, lookups, verified, wire
from .copyreads import read_copies
from .dispatch import Dispatch
from .errors import (
    CallerError,
    InvalidArgument,
    KVStoreError,
    PeerError,
    Unavailable,
    from_rpc_error,
)
from .keys import check_hashes, check_namespace
from .mapwatch import MapWatch
from .outcomes import PutOutcome, room_error
from .parts import check_disjoint, part_views
from .proto import master_pb2, store_pb2, store_pb2_grpc
from .replicas import (
    ReplicaStats,
)
from .routing import Links, View, frames, parse_masters
from .routing import bind as _bind
from .routing import misses_only as _misses_only
from .security import Tls, metadata, new_identity, open_channel
from .sessions import SessionHints
from .sharding import DEFAULT_VNODES_PER_GIB, build_ring
from .transport import BlockView
from .transport.pins import ArenaPins, ArenaSlots, Mapped
from .transport.ucx import available as ucx_available
from .verified import GetResult

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSPORTS = ("auto", "tcp", "shm", "ucx")


class Client:
    """Blocking client; see the module docstring. Use as a context manager.

    ``transport``: "auto" (default, or env KVSTORE_TRANSPORT) and "shm" copy through
    shared memory with workers on this host whose arena file this process may open,
    and use tcp:// with the others; "tcp" forces tcp:// everywhere; "ucx" uses ucx://
    (UCX, the extra kvstore-cache[ucx]; docs/UCX.md) with every worker that advertises it and
    tcp:// with the others.
    ``tls`` (default: env KVSTORE_TLS_CA/CERT/KEY) and ``token`` (default: env
    KVSTORE_TOKEN) are needed when the cluster enables TLS or tenants.
    ``session_writer``: this client writes the blocks of sessions that some client
    hints (an engine's save path whose scheduler sends the hints through another
    Client): its puts are marked (wire.FLAG_SESSION), so a session over its share has
    them declined. A client that sends a hint itself marks its puts from then on; the
    puts of every other client are always admitted (docs/OPERATIONS.md, sessions).
    """

    def __init__(
        self,
        master: str,
        *,
        timeout: float = 5.0,
        transport: str | None = None,
        max_threads: int = 16,
        tls: Tls | None = None,
        token: str | None = None,
        session_writer: bool = False,
    ) -> None:
        if timeout <= 0:
            raise InvalidArgument("timeout must be positive")
        transport = transport or os.environ.get("KVSTORE_TRANSPORT") or "auto"
        if transport not in TRANSPORTS:
            raise InvalidArgument(
                f"unknown transport {transport!r}; available: {', '.join(TRANSPORTS)}"
            )
        if transport == "ucx" and not ucx_available():
            raise InvalidArgument("transport 'ucx' needs ucxx: pip install 'kvstore-cache[ucx]'")
        self.transport = transport
        self.timeout = timeout
        self.tls = tls if tls is not None else Tls.from_env()
        self._token = token if token is not None else os.environ.get("KVSTORE_TOKEN", "")
        self.identity = new_identity()  # who this client is to the workers (security.py)
        self._md = metadata(self._token, self.identity)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._d = Dispatch(timeout, max_threads, self.tls, self._md)
        self._links = Links(transport, self.tls, self._token, self.identity)
        self._watch = MapWatch(
            parse_masters(master), tls=self.tls, md=self._md, timeout=timeout, apply=self._apply_map
        )
        self.session_writer = session_writer
        self._hints: SessionHints | None = None
        try:
            self._watch.fetch()
        except BaseException:
            self.close()
            raise
        self._watch.start()

    # ---- map -----------------------------------------------------------------

    def _apply_map(self, m: master_pb2.ShardMap) -> None:
        with self._lock:
            if self._view is not None and m.version <= self._view.version:
                return
            ring = build_ring(
                [(w.id, w.capacity_bytes) for w in m.workers],
                vnodes_per_gib=m.vnodes_per_gib or DEFAULT_VNODES_PER_GIB,
                replicas=max(1, m.replicas),
                hosts={w.id: w.host_id for w in m.workers},
            )
            workers = self._links.update(ring.worker_ids, m.workers)
            max_value = min((w.max_value_bytes for w in m.workers), default=0)
            local = np.array([w.via.same_host for w in workers], dtype=bool)
            ns_r = dict(m.namespace_replicas)
            self._d.view = View(
                m.version, ring, workers, max_value, max(1, m.replicas), ns_r, local
            )

    def workers(self) -> list[master_pb2.WorkerInfo]:
        """The workers of the current map."""
        view = self._view
        return [w.info for w in view.workers] if view else []

    @property
    def map_version(self) -> int:
        return self._view.version if self._view else 0

    # ---- routing -------------------------------------------------------------

    @property
    def _view(self) -> View | None:
        """The current map (tests and the shm transport's hand-over read it)."""
        return self._d.view

    @property
    def replica_stats(self) -> ReplicaStats:
        """Counters of copies written, failed, repaired and fallback reads."""
        return self._d.replica_stats

    def _check(self, ns: str, hashes: Sequence[bytes]) -> bytes:
        if self._closed.is_set():
            raise InvalidArgument("this Client is closed")
        check_namespace(ns)
        check_hashes(hashes)
        return ns.encode()

    # ---- data calls ----------------------------------------------------------

    def batch_put(
        self,
        ns: str,
        hashes: list[bytes],
        values: Sequence[bytes | bytearray | memoryview],
        *,
        replicas: int | None = None,
    ) -> list[bool]:
        """Store blocks that are absent. True = stored now (by the primary owner);
        False = already present (skipped) or its primary was unreachable. Raises
        InvalidArgument on bad input and ResourceExhausted when a primary has no room.
        :meth:`put_outcomes` tells those cases apart.

        ``replicas``: copies on distinct workers (1..8; default: the namespace's count
        from the map, see :mod:`kvstore_client.replicas`). Copies beyond the primary
        are best effort: their failures are counted in ``replica_stats``, not raised.
        """
        return self._stored(ns, hashes, values, False, replicas)

    def batch_put_parts(
        self,
        ns: str,
        hashes: list[bytes],
        parts: Sequence[Sequence[Any]],
        *,
        replicas: int | None = None,
    ) -> list[bool]:
        """:meth:`batch_put` of blocks given as parts: ``parts[i]`` is the ordered list
        of buffers (bytes-like, C-contiguous) whose concatenation is block ``i``. The
        parts are sent without being joined; the stored value (and its checksum) is
        that of the concatenation, so it reads whole with :meth:`batch_get` too.

        Same result and errors as :meth:`batch_put`; InvalidArgument (nothing stored)
        when the part lists do not match the hashes, a block has no parts or zero
        bytes, or a block is above the workers' max value size.
        """
        return self._stored(ns, hashes, parts, True, replicas)

    def put_outcomes(
        self,
        ns: str,
        hashes: list[bytes],
        values: Sequence[Any],
        *,
        parts: bool = False,
        replicas: int | None = None,
    ) -> list[PutOutcome]:
        """:meth:`batch_put` (``parts``: :meth:`batch_put_parts`) with what happened to
        each block (:class:`~kvstore_client.outcomes.PutOutcome`): stored now,
        already present, refused and why (no room, over quota, corrupt, declined), or
        its owner unreachable. A full store is an outcome here, not an error; bad input
        and a worker's refusal of the caller (auth) still raise."""
        outcomes, fails, _ = self._put(ns, hashes, values, parts, replicas)
        if fails:
            raise fails[0]
        return outcomes

    def _stored(
        self, ns: str, hashes: list[bytes], values: Sequence[Any], parts: bool,
        replicas: int | None,
    ) -> list[bool]:  # fmt: skip
        """batch_put's answer: True per block stored now; the first error raised."""
        outcomes, fails, rooms = self._put(ns, hashes, values, parts, replicas)
        if fails or rooms:
            raise (fails + rooms)[0]
        return [o is PutOutcome.STORED for o in outcomes]

    def _put(
        self, ns: str, hashes: list[bytes], values: Sequence[Any], parts: bool,
        replicas: int | None,
    ) -> tuple[list[PutOutcome], list[KVStoreError], list[KVStoreError]]:  # fmt: skip
        nsb = self._check(ns, hashes)
        view = self._view
        if parts:
            pv, sizes = part_views(
                values, len(hashes), writable=False, max_value=view.max_value if view else 0
            )
            blocks: list[wire.Block] = list(pv)
        else:
            if len(values) != len(hashes):
                raise InvalidArgument(f"{len(hashes)} hashes but {len(values)} values")
            views = _byte_views(values, "value")
            sizes = [v.nbytes for v in views]
            for i, n in enumerate(sizes):
                if view is not None and view.max_value and n > view.max_value:
                    raise InvalidArgument(f"value {i} is {n} bytes; the limit is {view.max_value}")
            blocks = list(views)
        return self._put_blocks(ns, nsb, hashes, blocks, sizes, replicas)

    def _put_blocks(
        self,
        ns: str,
        nsb: bytes,
        hashes: list[bytes],
        views: list[wire.Block],
        sizes: list[int],
        replicas: int | None,
    ) -> tuple[list[PutOutcome], list[KVStoreError], list[KVStoreError]]:
        """Per block its outcome; the failures of primaries other than unreachable (and
        the caller's errors of any owner); per primary that lacked room, its error.
        :meth:`batch_put` raises the first of both."""
        view, groups = self._d.groups(hashes)
        r = self._d.copies(view, ns, replicas)
        self._d.wrote(ns, r)
        if r > 1 and groups:
            owners = view.ring.lookup(hashes, r)
            groups = [(w, np.flatnonzero(owners[:, 0] == w)) for w in np.unique(owners[:, 0])]
            extra = [
                (int(w), np.flatnonzero(owners[:, c] == w))
                for c in range(1, owners.shape[1])
                for w in np.unique(owners[:, c])
            ]
        else:
            extra = []
        for i, n in enumerate(sizes):
            if view.max_value and n > view.max_value:
                raise InvalidArgument(f"value {i} is {n} bytes; the limit is {view.max_value}")
        result = [PutOutcome.UNREACHABLE] * len(hashes)
        if not groups:
            return result, [], []
        sums: list[int] = []  # computed once, only if a transfer needs them
        # A client that sends session hints marks its puts: its sessions' shares apply
        # to them. Puts of clients without hints are always admitted.
        flags = wire.FLAG_SESSION if self.session_writer or self._hints is not None else 0
        tasks: list[Callable[[], Any]] = []
        parts: list[np.ndarray] = []
        primaries = 0
        for k, (w, idx) in enumerate([*groups, *extra]):
            for chunk in frames(idx, [sizes[i] for i in idx]):
                hs = [hashes[i] for i in chunk]
                vs = [views[i] for i in chunk]
                via = view.workers[w].via
                if not via.local and not sums:  # over the copy pool when the batch is big
                    sums = verified.run(
                        [partial(wire.block_checksum, v) for v in views], sum(sizes)
                    )
                cs = [0] * len(chunk) if via.local else [sums[i] for i in chunk]
                tasks.append(_bind(via.put, self.timeout, nsb, hs, vs, cs, flags))
                parts.append(chunk)
            if k == len(groups) - 1:
                primaries = len(tasks)
        full: list[KVStoreError] = []
        rooms: list[KVStoreError] = []

        def on_error(t: int, e: KVStoreError) -> None:
            if t >= primaries:
                if isinstance(e, CallerError):
                    full.append(e)
                return  # a copy beyond the primary: counted below, never raised
            if not isinstance(e, Unavailable | TimeoutError):
                full.append(e)  # raised after the other workers' results are in

        for t, (chunk, status) in enumerate(
            zip(parts, self._d.fan_out(tasks, on_error), strict=True)
        ):
            if t >= primaries:
                ok = 0 if status is None else sum(1 for x in status if x in (0, 1))
                self._d.replica_stats.add(copies_written=ok, copies_failed=len(chunk) - ok)
                continue
            if status is None:
                continue
            for j, i in enumerate(chunk):
                result[int(i)] = PutOutcome.of_status(status[j])
            if (err := room_error(status)) is not None:
                rooms.append(err)
        return result, full, rooms

    def batch_exists(self, ns: str, hashes: Sequence[bytes]) -> list[bool]:
        """Which hashes are present on any of their owners (False also for unreachable
        workers); one batched request per worker (see :mod:`kvstore_client.lookups`)."""
        return lookups.exists(self._d, ns, self._check(ns, hashes), hashes)

    def exists_local(self, ns: str, hashes: Sequence[bytes]) -> tuple[list[bool], bool] | None:
        """:meth:`batch_exists` from same-host workers' shared indexes, never waiting
        on a socket, and whether to send the workers the lookup too (one wants to see
        lookups: it may resume a paused session); None when a key needs an answer."""
        if not hashes:
            return [], False
        got = self._d.exists_local(ns, self._check(ns, hashes), hashes)
        return None if got is None else (got[0].tolist(), got[1])

    def batch_where(self, ns: str, hashes: Sequence[bytes]) -> list[int]:
        """Per hash, where its owners hold it: ``WHERE_DRAM`` (a worker's DRAM, a
        host-memory hit), ``WHERE_SSD`` (only on a worker's SSD tier, evicted from
        DRAM, or staged on its way there), ``WHERE_ABSENT`` (no owner holds it, or
        none answered), or ``WHERE_UNKNOWN`` (held by a worker that predates the
        tier lookup, ``wire.FLAG_WHERE``: present, tier unknown; never reported as
        DRAM). With several owners (replicas) the best copy wins: DRAM, then
        unknown, then SSD. The constants are ``kvstore_client.WHERE_*`` (0, 1, 2,
        3). One batched request per worker, as :meth:`batch_exists`, which it agrees
        with on presence (``code != WHERE_ABSENT``); a hint like it (a block may
        move between tiers, or leave, right after the answer)."""
        return lookups.where(self._d, ns, self._check(ns, hashes), hashes)

    def where_local(self, ns: str, hashes: Sequence[bytes]) -> tuple[list[int], bool] | None:
        """:meth:`batch_where` from same-host workers' shared indexes, never waiting on
        a socket, with :meth:`exists_local`'s contract: also whether to send the
        workers the lookup too, and None when a key needs an answer (e.g. the worker
        has an SSD tier and its index lacks the key). An index holds only blocks in
        the worker's arena, so every hit is ``WHERE_DRAM``."""
        if not hashes:
            return [], False
        got = self._d.exists_local(ns, self._check(ns, hashes), hashes)
        if got is None:
            return None
        codes: list[int] = (got[0].astype(np.uint8) * np.uint8(wire.WHERE_DRAM)).tolist()
        return codes, got[1]

    def match_prefix(self, ns: str, hashes: Sequence[bytes], *, state_ns: str | None = None) -> int:
        """Number of leading hashes present (one batched EXISTS per owner, in parallel).

        With ``state_ns`` (hybrid models), a prefix of k blocks counts only when its k KV
        blocks are present in ``ns`` and the state at boundary k (stored under hash k-1)
        is present in ``state_ns``; a partial write can therefore never make a wrong hit.
        """
        if state_ns is not None:
            k = self.match_prefix(ns, hashes)
            states = self.batch_exists(state_ns, hashes[:k]) if k else []
            while k and not states[k - 1]:
                k -= 1
            return k
        return lookups.prefix(self._d, ns, self._check(ns, hashes), hashes)

    def batch_get(self, ns: str, hashes: list[bytes]) -> list[bytes | None]:
        """The values, None for misses (absent, corrupt, or worker unreachable).
        In a namespace with replicas, a key missed by one owner is read from the next
        (see :mod:`kvstore_client.replicas`)."""
        nsb = self._check(ns, hashes)
        view, groups = self._d.groups(hashes)
        r = self._d.copies(view, ns, None, reading=True)
        if r > 1 and groups:
            return read_copies(self._d, view, nsb, hashes, None, r)[1]
        result: list[bytes | None] = [None] * len(hashes)
        tasks: list[Callable[[], Any]] = [
            _bind(view.workers[w].via.get, self.timeout, nsb, [hashes[i] for i in idx], None)
            for w, idx in groups
        ]
        for (_, idx), res in zip(groups, self._d.fan_out(tasks, _misses_only), strict=True):
            if res is not None:
                for j, i in enumerate(idx):
                    v = res.values[j]
                    result[int(i)] = bytes(v) if v is not None else None
        return result

    def batch_get_into(
        self, ns: str, hashes: list[bytes], buffers: Sequence[memoryview]
    ) -> cf.Future[list[bool]]:
        """Read blocks straight into the caller's buffers; returns a future of hit flags.

        A block counts as a hit only if its stored size equals its buffer's size and
        its checksum matches; a buffer of a miss may hold partial bytes. The future
        never raises for worker failures (those are misses). An empty value is a value:
        a 0-byte buffer is a hit when the stored value is ``b""``. A buffer that no
        block can fill (above the workers' max value size) or buffers that share a
        byte raise InvalidArgument at once; to learn a stored block's size, read it
        with :meth:`batch_get`.
        Calls on a closed client raise InvalidArgument. When every block lives on one
        same-host worker reached over shm://, the copies run on the calling thread and
        the future comes back already done (no executor hop).
        """
        self._check(ns, hashes)
        if len(buffers) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes but {len(buffers)} buffers")
        views = _byte_views(buffers, "buffer")
        view = self._view
        limit = view.max_value if view is not None else 0
        for i, v in enumerate(views):
            if v.readonly:
                raise InvalidArgument(f"buffer {i} is read-only")
            if limit and v.nbytes > limit:
                raise InvalidArgument(
                    f"buffer {i} is {v.nbytes} bytes: no block can fill it (blocks are "
                    f"0..{limit} bytes)"
                )
        check_disjoint(views)
        return self._get_into_blocks(ns, hashes, list(views))

    def batch_get_into_parts(
        self, ns: str, hashes: list[bytes], parts: Sequence[Sequence[Any]]
    ) -> cf.Future[list[bool]]:
        """:meth:`batch_get_into` into blocks given as parts: ``parts[i]`` is the ordered
        list of writable buffers that block ``i`` is scattered into (no intermediate
        copy). A block is a hit only if its stored size equals the sum of its parts'
        sizes and its checksum (over the parts) matches; it may have been written whole
        or in any other split. InvalidArgument at once (nothing read) for part lists
        that do not match the hashes, a block with no parts (parts of zero bytes in all
        are an empty value, like ``b""``), a read-only part, parts (of any blocks)
        that share a byte, or a block above the workers' max value size.
        """
        self._check(ns, hashes)
        view = self._view
        blocks, _ = part_views(
            parts, len(hashes), writable=True, max_value=view.max_value if view else 0
        )
        check_disjoint([p for b in blocks for p in b])
        return self._get_into_blocks(ns, hashes, list(blocks))

    def _get_into_blocks(
        self, ns: str, hashes: list[bytes], views: list[BlockView]
    ) -> cf.Future[list[bool]]:
        nsb = ns.encode()
        view, groups = self._d.groups(hashes)
        result = [False] * len(hashes)
        done: cf.Future[list[bool]] = cf.Future()
        if not groups:
            done.set_result(result)
            return done
        r = self._d.copies(view, ns, None, reading=True)
        if r > 1:
            return self._d.executor.submit(
                lambda: read_copies(self._d, view, nsb, hashes, views, r)[0].tolist()
            )
        if all(view.workers[w].via.local for w, _ in groups):
            # Same-host workers: copies on this thread (see Dispatch.read_local); the
            # future comes back done.
            try:
                done.set_result(self._d.read_local(view, groups, nsb, hashes, views))
            except Exception as e:  # CallerError, or a bug: surface it
                done.set_exception(e)
            return done
        remaining = [len(groups)]
        lock = threading.Lock()

        def finish(idx: np.ndarray, fut: cf.Future[GetResult]) -> None:
            try:
                res = fut.result()
                for j, i in enumerate(idx):
                    result[int(i)] = res.found[j]
            except CallerError as e:
                if not done.done():
                    done.set_exception(e)
            except PeerError:
                pass
            except Exception as e:  # a bug: surface it rather than hang the caller
                if not done.done():
                    done.set_exception(e)
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and not done.done():
                done.set_result(result)

        for w, idx in groups:
            fut = self._d.executor.submit(
                view.workers[w].via.get,
                self.timeout,
                nsb,
                [hashes[i] for i in idx],
                [views[i] for i in idx],
            )
            fut.add_done_callback(lambda f, idx=idx: finish(idx, f))  # type: ignore[misc]
        return done

    def pin_local(self, ns: str, hashes: list[bytes]) -> ArenaPins:
        """Pin the blocks that same-host workers hold, in place in their arenas (to
        copy straight out of the slot, e.g. by DMA); ``views[i]`` is None for a
        block that is missing, fails its checksum, or is not on a same-host worker
        (read those with :meth:`batch_get_into`). Release the pins once the copies
        are done (the views die then). Worker failures are misses; InvalidArgument
        for bad input. Namespaces with several copies per block pin nothing."""
        self._check(ns, hashes)
        view, groups = self._d.groups(hashes)
        if self._d.copies(view, ns, None) > 1:
            return ArenaPins([None] * len(hashes))
        return leases.pin(view, groups, self.timeout, ns.encode(), hashes)

    def local_arenas(self) -> list[Mapped]:
        """The live arena mappings of the same-host workers in the current map (an
        engine registers them for DMA once, ahead of its first load; a mapping that
        went stale is left out)."""
        view = self._view
        if view is None:
            return []
        return [w.arena for w in view.workers if w.arena is not None and not w.arena.stale]

    def reserve_local(self, ns: str, hashes: list[bytes], sizes: list[int]) -> ArenaSlots:
        """Reserve slots on same-host workers for blocks to be written straight into
        them (e.g. by DMA), published by ``commit(written)`` with checksums taken
        over the slots then; a block without a slot (None) is already there
        (``present``), has no room, or is not on a same-host worker (write it with
        :meth:`batch_put`). InvalidArgument for bad input or a size over the
        workers' limit. Namespaces with several copies per block reserve nothing."""
        self._check(ns, hashes)
        view = self._view
        if len(sizes) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes but {len(sizes)} sizes")
        limit = view.max_value if view is not None else 0
        for i, n in enumerate(sizes):
            if n <= 0 or (limit and n > limit):
                raise InvalidArgument(f"block {i} is {n} bytes; blocks are 1..{limit} bytes")
        view, groups = self._d.groups(hashes)
        if self._d.copies(view, ns, None) > 1:
            return ArenaSlots([None] * len(hashes), [False] * len(hashes))
        flags = wire.FLAG_SESSION if self.session_writer or self._hints is not None else 0
        return leases.reserve(view, groups, self.timeout, ns.encode(), hashes, sizes, flags)

    def remove(self, ns: str, hashes: list[bytes]) -> int:
        """Remove blocks (every copy); returns how many copies were present.

        Every worker of the map is asked, not only a key's owners by the current
        count: copies written with a per-call ``replicas=`` (by any client) or
        repaired onto a new owner after a membership change must not come back."""
        nsb = self._check(ns, hashes)
        view = self._view
        links = view.workers if view is not None and hashes else []
        tasks: list[Callable[[], Any]] = [
            _bind(w.via.remove, self.timeout, nsb, hashes) for w in links
        ]
        return sum(n for n in self._d.fan_out(tasks, _misses_only) if n is not None)

    # ---- admin ---------------------------------------------------------------

    def remove_namespace(self, ns: str) -> int:
        """Remove ``ns`` and every namespace below ``ns/`` on every worker of the map;
        returns how many blocks were removed. Asks all workers, then raises the first
        error (e.g. PermissionDenied, Unavailable) if any failed."""
        check_namespace(ns)
        view = self._view
        removed = 0
        errors: list[KVStoreError] = []
        for w in view.workers if view else []:
            try:
                with open_channel(w.info.grpc, self.tls) as ch:
                    r = store_pb2_grpc.StoreStub(ch).RemoveNamespace(
                        store_pb2.RemoveNamespaceRequest(namespace=ns),
                        timeout=self.timeout,
                        metadata=self._md,
                    )
                removed += r.removed
            except grpc.RpcError as e:
                errors.append(from_rpc_error(e))
        if errors:
            raise errors[0]
        return removed

    def cluster_status(self) -> master_pb2.ClusterStatusResponse:
        """The master's view of the cluster (workers, capacities, stats)."""
        if self._closed.is_set():
            raise InvalidArgument("this Client is closed")
        try:
            return self._watch.stub().ClusterStatus(
                master_pb2.ClusterStatusRequest(), timeout=self.timeout, metadata=self._md
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    # ---- sessions ------------------------------------------------------------

    def session_hint(
        self,
        ns: str,
        session_id: str,
        state: str,
        ttl: float | None = None,
        *,
        hashes: Sequence[bytes] = (),
    ) -> int:
        """Tell every worker that agent session ``session_id`` of ``ns`` is now ``state``
        (``active`` | ``paused`` | ``ended``), with ``hashes`` its block chain; returns
        how many workers took it. See :mod:`kvstore_client.sessions`."""
        if self._closed.is_set():
            raise InvalidArgument("this Client is closed")
        with self._lock:
            if self._hints is None:
                self._hints = SessionHints(self._d)
        return self._hints.hint(ns, session_id, state, ttl, hashes)

    def sessions(self, limit: int = 10) -> list[store_pb2.SessionsResponse]:
        """Each worker's top ``limit`` sessions and session counters."""
        with self._lock:
            if self._hints is None:
                self._hints = SessionHints(self._d)
        return self._hints.sessions(limit)

    # ---- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Stop the watch, close connections and threads. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._watch.close()
        self._d.close()
        with self._lock:
            self._links.close()
            if self._hints is not None:
                self._hints.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _byte_views(items: Sequence[Any], what: str) -> list[memoryview]:
    """Flat byte views of bytes-like objects; InvalidArgument for anything else."""
    out: list[memoryview] = []
    for i, v in enumerate(items):
        if type(v) is memoryview and v.ndim == 1 and v.format == "B" and v.c_contiguous:
            out.append(v)  # already a flat byte view: no cast, no new object
            continue
        if isinstance(v, str):
            raise InvalidArgument(f"{what} {i} is a str: encode it to bytes first")
        try:
            out.append(memoryview(v).cast("B"))
        except TypeError as e:
            raise InvalidArgument(
                f"{what} {i} is a {type(v).__name__}, not a bytes-like object: {e}"
            ) from e
    return out
