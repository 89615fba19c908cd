"""Lookups: which keys the workers hold (``Client.batch_exists``) and how many lead a
chain (``Client.match_prefix``), in as few round trips as the transports allow.

A worker whose transfer has a tcp:// control pool (:attr:`Transfer.control
<kvstore_client.transport.Transfer.control>`) gets its EXISTS from one thread that
sends every owner its request before it reads any answer (:func:`scatter`): one round
trip to the slowest worker, no threads; a same-host worker answers from its shared
index in this process, with none. Otherwise (ucx://) each owner is asked on the
client's pool (:func:`exists_threads`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import wire
from .dispatch import Dispatch
from .errors import CallerError, KVStoreError
from .keys import HASH_LEN, leading_run
from .routing import View, bind, misses_only
from .transport import Transfer
from .transport.tcp import TcpConnection, TcpPool

_KEY = np.dtype((np.void, HASH_LEN))  # one packed hash, to gather whole rows
Groups = list[tuple[int, np.ndarray]]


def scatters(view: View, groups: Groups) -> bool:
    """Whether every owner of ``groups`` can be asked by :func:`scatter`."""
    return all(view.workers[w].via.control is not None for w, _ in groups)


def exists(d: Dispatch, ns: str, nsb: bytes, hashes: list[bytes]) -> list[bool]:
    """Per hash, present on any of its owners (False also for unreachable workers)."""
    view, groups = d.copy_groups(ns, hashes)
    if not groups:
        return [False] * len(hashes)
    if not scatters(view, groups):
        return exists_threads(d, nsb, hashes, view, groups)
    flags: list[bool] = exists_scatter(d, nsb, hashes, view, groups).tolist()
    return flags


def prefix(d: Dispatch, ns: str, nsb: bytes, hashes: list[bytes]) -> int:
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
    d: Dispatch, nsb: bytes, hashes: list[bytes], view: View, groups: Groups
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
    d: Dispatch, nsb: bytes, hashes: list[bytes], view: View, groups: Groups
) -> np.ndarray:
    """EXISTS without threads: send one request to every owner, then read every
    answer. A prefix lookup is one round trip to the slowest worker."""
    out = np.zeros(len(hashes), dtype=bool)
    answers = scatter(
        d,
        nsb,
        b"".join(hashes),
        view,
        groups,
        0,
        lambda c, idx: c.recv_exists(),
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
    flags: int,
    recv: Callable[[TcpConnection, np.ndarray], Any],
    local: Callable[[Transfer, bytes], Any] | None = None,
) -> list[Any]:
    """Send every owner its keys in one EXISTS (``flags``), all before any answer is
    read, then ``recv`` each answer: one round trip to the slowest worker, no
    threads. Per group its answer, or None where the worker failed (a miss); a
    caller's error (bad namespace, auth) is raised once every answer is in.
    ``local(via, keys)`` answers a group without the socket when it can (not None):
    same-host groups go last, while the others' answers are on their way."""
    rows = np.frombuffer(packed, dtype=_KEY)
    answers: list[Any] = [None] * len(groups)
    sent: list[tuple[int, TcpPool, TcpConnection, np.ndarray]] = []
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
            conn.send_exists(nsb, body, len(idx), flags)
        except KVStoreError as e:
            misses_only(w, e)
            continue
        except OSError:
            conn.close()
            continue
        sent.append((g, pool, conn, idx))
    error: KVStoreError | None = None
    for g, pool, conn, idx in sent:
        try:
            conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
            answers[g] = recv(conn, idx)
        except (OSError, KVStoreError) as e:
            conn.close()
            if isinstance(e, CallerError):
                error = error or e
            continue
        pool.give(conn)
    if error is not None:
        raise error
    return answers


def prefix_scatter(d: Dispatch, nsb: bytes, hashes: list[bytes], view: View) -> int:
    """match_prefix with one owner per key: every owner gets its keys (in chain
    order) in one EXISTS with FLAG_PREFIX and answers how many of them lead its
    list; the chain's run ends at the first key some owner stopped at. An owner
    that cannot answer ends it at its first key."""
    n = len(hashes)
    if not n:
        return 0
    packed = b"".join(hashes)
    if len(view.workers) == 1:
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
        lambda c, idx: c.recv_prefix(len(idx)),
        lambda via, keys: via.prefix(nsb, keys),  # same-host: the shared index
    )
    run = n
    for (_, idx), k in zip(groups, answers, strict=True):
        if k is None:
            run = min(run, int(idx[0]))
        elif k < len(idx):
            run = min(run, int(idx[k]))
    return run
