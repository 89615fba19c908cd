"""Lookups: which keys the workers hold (``Client.batch_exists``), in which tier
(``Client.batch_where``) and how many lead a chain (``Client.match_prefix``), in as
few round trips as the transports allow.

A worker whose transfer has a tcp:// control pool (:attr:`Transfer.control
<kvstore_client.transport.Transfer.control>`) gets its EXISTS from one thread that
sends every owner its request before it reads any answer (:func:`scatter`): one round
trip to the slowest worker, no threads; a same-host worker answers from its shared
index in this process, with none. Otherwise (ucx://) each owner is asked on the
client's pool (:func:`exists_threads`).

Tiers (:func:`where`, EXISTS with wire.FLAG_WHERE) are the ``wire.WHERE_*`` codes,
re-exported here: :data:`WHERE_ABSENT`, :data:`WHERE_DRAM`, :data:`WHERE_SSD` and
:data:`WHERE_UNKNOWN` (present on a worker that predates FLAG_WHERE, tier unknown;
see :mod:`kvstore_client.transport.where`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import wire
from .dispatch import Dispatch
from .errors import CallerError, InvalidArgument, KVStoreError, Unavailable
from .keys import HASH_LEN, leading_run, pack_hashes
from .routing import View, bind, misses_only
from .transport import Transfer
from .transport.tcp import TcpConnection, TcpPool
from .transport.where import after_refusal, merge
from .wire import WHERE_ABSENT, WHERE_DRAM, WHERE_SSD, WHERE_UNKNOWN

_KEY = np.dtype((np.void, HASH_LEN))  # one packed hash, to gather whole rows
Groups = list[tuple[int, np.ndarray]]


def scatters(view: View, groups: Groups) -> bool:
    """Whether every owner of ``groups`` can be asked by :func:`scatter`."""
    return all(view.workers[w].via.control is not None for w, _ in groups)


def exists(d: Dispatch, ns: str, nsb: bytes, hashes: Sequence[bytes]) -> list[bool]:
    """Per hash, present on any of its owners (False also for unreachable workers)."""
    view, groups = d.copy_groups(ns, hashes)
    if not groups:
        return [False] * len(hashes)
    if not scatters(view, groups):
        return exists_threads(d, nsb, hashes, view, groups)
    flags: list[bool] = exists_scatter(d, nsb, hashes, view, groups).tolist()
    return flags


def prefix(d: Dispatch, ns: str, nsb: bytes, hashes: Sequence[bytes]) -> int:
    """How many leading hashes are present (see ``Client.match_prefix``)."""
    view = d.view
    if (
        view is not None
        and view.workers
        and d.copies(view, ns, None, reading=True) == 1
        and all(w.via.control is not None for w in view.workers)
    ):
        return prefix_scatter(d, nsb, hashes, view)
    view, groups = d.copy_groups(ns, hashes)
    if not groups:
        return 0
    if not scatters(view, groups):
        return leading_run(exists_threads(d, nsb, hashes, view, groups))
    flags = exists_scatter(d, nsb, hashes, view, groups)
    return len(flags) if flags.all() else int(np.argmin(flags))


def exists_threads(
    d: Dispatch, nsb: bytes, hashes: Sequence[bytes], view: View, groups: Groups
) -> list[bool]:
    result = [False] * len(hashes)
    tasks: list[Callable[[], Any]] = [
        bind(view.workers[w].via.exists, d.timeout, nsb, [hashes[i] for i in idx])
        for w, idx in groups
    ]
    for (_, idx), flags in zip(groups, d.fan_out(tasks, misses_only), strict=True):
        if flags is not None:
            for j, i in enumerate(idx):
                result[int(i)] = result[int(i)] or flags[j]
    return result


def exists_scatter(
    d: Dispatch, nsb: bytes, hashes: Sequence[bytes], view: View, groups: Groups
) -> np.ndarray:
    """EXISTS without threads: send one request to every owner, then read every
    answer. A prefix lookup is one round trip to the slowest worker."""
    out = np.zeros(len(hashes), dtype=bool)
    answers = scatter(
        d,
        nsb,
        pack_hashes(hashes),
        view,
        groups,
        0,
        lambda c, g: c.recv_exists(),
        lambda via, keys: via.present(nsb, keys),  # same-host: the shared index
    )
    for (_, idx), flags in zip(groups, answers, strict=True):
        if flags is not None:
            out[idx] |= flags  # any copy counts (replicas)
    return out


def scatter(
    d: Dispatch,
    nsb: bytes,
    packed: bytes,
    view: View,
    groups: Groups,
    flags: int | Sequence[int],
    recv: Callable[[TcpConnection, int], Any],
    local: Callable[[Transfer, bytes], Any] | None = None,
) -> list[Any]:
    """Send every owner its keys in one EXISTS (``flags``, or per group its flags),
    all before any answer is read, then ``recv(connection, group)`` each answer: one
    round trip to the slowest worker, no threads. Per group its answer, or None
    where the worker failed (a miss); a caller's error (bad namespace, auth) is
    raised once every answer is in.
    ``local(via, keys)`` answers a group without the socket when it can (not None):
    same-host groups go last, while the others' answers are on their way."""
    rows = np.frombuffer(packed, dtype=_KEY)
    answers: list[Any] = [None] * len(groups)
    sent: list[tuple[int, TcpPool, TcpConnection]] = []
    deadline = time.monotonic() + d.timeout
    order = sorted(range(len(groups)), key=lambda g: view.workers[groups[g][0]].via.local)
    for g in order:
        w, idx = groups[g]
        pool = view.workers[w].via.control
        assert pool is not None  # callers scatter only to transfers that have one
        body = packed if len(groups) == 1 else rows[idx].tobytes()
        if local is not None and (got := local(view.workers[w].via, body)) is not None:
            answers[g] = got
            continue
        try:
            conn = pool.take(d.timeout)
            conn.sock.settimeout(d.timeout)
            conn.send_exists(nsb, body, len(idx), flags if isinstance(flags, int) else flags[g])
        except KVStoreError as e:
            misses_only(w, e)
            continue
        except OSError:
            conn.close()
            continue
        sent.append((g, pool, conn))
    error: KVStoreError | None = None
    for g, pool, conn in sent:
        try:
            conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
            answers[g] = recv(conn, g)
        except (OSError, KVStoreError) as e:
            conn.close()
            if isinstance(e, CallerError):
                error = error or e
            continue
        pool.give(conn)
    if error is not None:
        raise error
    return answers


def prefix_scatter(d: Dispatch, nsb: bytes, hashes: Sequence[bytes], view: View) -> int:
    """match_prefix with one owner per key: every owner gets its keys (in chain
    order) in one EXISTS with FLAG_PREFIX and answers how many of them lead its
    list; the chain's run ends at the first key some owner stopped at. An owner
    that cannot answer ends it at its first key."""
    n = len(hashes)
    if not n:
        return 0
    packed = pack_hashes(hashes)
    if len(view.workers) == 1:
        via = view.workers[0].via
        if via.local and (k := via.prefix(nsb, packed)) is not None:
            return k  # the one worker's shared index answered: nothing else to do
        groups = [(0, np.arange(n))]
    else:
        owner = view.ring.primary_packed(packed)
        held = np.flatnonzero(np.bincount(owner)).tolist()
        groups = [(w, np.flatnonzero(owner == w)) for w in held]
    answers = scatter(
        d,
        nsb,
        packed,
        view,
        groups,
        wire.FLAG_PREFIX,
        lambda c, g: c.recv_prefix(len(groups[g][1])),
        lambda via, keys: via.prefix(nsb, keys),  # same-host: the shared index
    )
    run = n
    for (_, idx), k in zip(groups, answers, strict=True):
        if k is None:
            run = min(run, int(idx[0]))
        elif k < len(idx):
            run = min(run, int(idx[k]))
    return run


def where(d: Dispatch, ns: str, nsb: bytes, hashes: Sequence[bytes]) -> list[int]:
    """Per hash a ``wire.WHERE_*`` code: the best tier any of its owners holds it in
    (DRAM, then WHERE_UNKNOWN, then SSD: :data:`kvstore_client.transport.where.RANK`);
    WHERE_ABSENT also for unreachable workers."""
    view, groups = d.copy_groups(ns, hashes)
    if not groups:
        return [WHERE_ABSENT] * len(hashes)
    if not scatters(view, groups):
        codes = where_threads(d, nsb, hashes, view, groups)
    else:
        codes = where_scatter(d, nsb, hashes, view, groups)
    out: list[int] = codes.tolist()
    return out


def where_threads(
    d: Dispatch, nsb: bytes, hashes: Sequence[bytes], view: View, groups: Groups
) -> np.ndarray:
    out = np.zeros(len(hashes), dtype=np.uint8)
    tasks: list[Callable[[], Any]] = [
        bind(view.workers[w].via.where, d.timeout, nsb, [hashes[i] for i in idx])
        for w, idx in groups
    ]
    for (_, idx), codes in zip(groups, d.fan_out(tasks, misses_only), strict=True):
        if codes is not None:
            merge(out, idx, codes)
    return out


def where_scatter(
    d: Dispatch, nsb: bytes, hashes: Sequence[bytes], view: View, groups: Groups
) -> np.ndarray:
    """:func:`exists_scatter` with FLAG_WHERE, to the owners not known to refuse it
    (the others get plain EXISTS: WHERE_UNKNOWN hits). An owner that refuses it now
    is asked plain EXISTS once every other answer is in."""
    pools = [view.workers[w].via.control for w, _ in groups]
    flags = [wire.FLAG_WHERE if p is not None and p.where_support.asks else 0 for p in pools]
    refused: list[int] = []

    def recv(c: TcpConnection, g: int) -> np.ndarray:
        try:
            return c.recv_where(len(groups[g][1]))
        except InvalidArgument:
            if not flags[g]:
                raise
            refused.append(g)  # closed by the worker: asked again below
            raise Unavailable("the worker refused FLAG_WHERE") from None

    answers = scatter(
        d,
        nsb,
        pack_hashes(hashes),
        view,
        groups,
        flags,
        recv,
        lambda via, keys: _in_dram(via.present(nsb, keys)),  # same-host: the shared index
    )
    if refused:
        tasks: list[Callable[[], Any]] = []
        for g in refused:
            w, idx = groups[g]
            pool = pools[g]
            assert pool is not None
            keys = [hashes[i] for i in idx]
            ask = bind(view.workers[w].via.exists, d.timeout, nsb, keys)
            tasks.append(bind(after_refusal, pool.where_support, ask))
        for g, codes in zip(refused, d.fan_out(tasks, misses_only), strict=True):
            answers[g] = codes
    out = np.zeros(len(hashes), dtype=np.uint8)
    for (_, idx), codes in zip(groups, answers, strict=True):
        if codes is not None:
            merge(out, idx, codes)
    return out


def _in_dram(flags: np.ndarray | None) -> np.ndarray | None:
    """A shared index's flags as codes: a key it holds is in the arena (WHERE_DRAM)."""
    return None if flags is None else flags.astype(np.uint8) * np.uint8(WHERE_DRAM)


__all__ = [
    "WHERE_ABSENT",
    "WHERE_DRAM",
    "WHERE_SSD",
    "WHERE_UNKNOWN",
    "exists",
    "exists_scatter",
    "exists_threads",
    "prefix",
    "prefix_scatter",
    "scatter",
    "scatters",
    "where",
    "where_scatter",
    "where_threads",
]
