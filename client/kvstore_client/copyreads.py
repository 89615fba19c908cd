"""Reads in namespaces with replicas: any copy serves, missing copies are repaired.

Executes the plan of :mod:`kvstore_client.replicas` (pure) with a client's
:class:`~kvstore_client.dispatch.Dispatch`: round k asks each still-missing key's k-th
owner (shm-reachable owners first), the first round also asks the other owners
whether they hold the key, and copies they lack are written back in the background.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import wire
from .dispatch import Dispatch
from .errors import KVStoreError
from .replicas import any_owner_groups, by_worker, read_order, repairs
from .routing import View, bind, misses_only
from .transport import BlockView


def read_copies(
    d: Dispatch,
    view: View,
    nsb: bytes,
    hashes: list[bytes],
    bufs: list[BlockView] | None,
    r: int,
) -> tuple[np.ndarray, list[bytes | None]]:
    """Read keys with ``r`` owners: round k asks each missing key's k-th owner
    (shm-reachable owners first); the first round also asks the other owners
    whether they hold the key, and copies they lack are written back in the
    background. Returns (found flags, values when ``bufs`` is None)."""
    n = len(hashes)
    owners = view.ring.lookup(hashes, r)
    order = read_order(owners, view.local if view.local is not None else np.zeros(0, bool))
    found_at = np.full(n, -1, dtype=np.int64)
    values: list[bytes | None] = [None] * n
    present: dict[int, dict[int, bool]] = {}
    todo = np.arange(n)
    for col in range(order.shape[1]):
        if not len(todo):
            break
        gets = by_worker(order[todo, col], todo)
        tasks: list[Callable[[], Any]] = [
            bind(
                view.workers[w].via.get,
                d.timeout,
                nsb,
                [hashes[i] for i in idx],
                [bufs[i] for i in idx] if bufs is not None else None,
            )
            for w, idx in gets
        ]
        checks: list[tuple[int, np.ndarray]] = []
        if col == 0:  # which other owners hold a copy: for the repair
            rest = [(w, idx[order[idx, 0] != w]) for w, idx in any_owner_groups(owners)]
            checks = [(w, idx) for w, idx in rest if len(idx)]
            tasks += [
                bind(view.workers[w].via.exists, d.timeout, nsb, [hashes[i] for i in idx])
                for w, idx in checks
            ]
        res = d.fan_out(tasks, misses_only)
        for (w, idx), got in zip(gets, res[: len(gets)], strict=True):
            if got is None:
                continue
            for j, i in enumerate(idx):
                if got.found[j]:
                    found_at[i] = w
                    if bufs is None:
                        v = got.values[j]
                        values[int(i)] = bytes(v) if v is not None else None
            present.setdefault(w, {}).update(
                (int(i), bool(f)) for i, f in zip(idx, got.found, strict=True)
            )
        for (w, idx), flags in zip(checks, res[len(gets) :], strict=True):
            if flags is not None:
                present.setdefault(w, {}).update(
                    (int(i), bool(f)) for i, f in zip(idx, flags, strict=True)
                )
        todo = todo[found_at[todo] < 0]
    fallback = int(np.count_nonzero((found_at >= 0) & (found_at != owners[:, 0])))
    if fallback:
        d.replica_stats.add(fallback_reads=fallback)
    fix = repairs(owners, found_at, present)
    if fix:
        src = {
            int(i): bytes(values[int(i)] or b"") if bufs is None else _joined(bufs[int(i)])
            for _, idx in fix
            for i in idx
        }
        d.executor.submit(_repair, d, view, nsb, hashes, src, fix)
    return found_at >= 0, values


def _repair(
    d: Dispatch,
    view: View,
    nsb: bytes,
    hashes: list[bytes],
    src: dict[int, bytes],
    fix: list[tuple[int, np.ndarray]],
) -> None:
    """Write the copies that a read found missing (background, best effort)."""
    for w, idx in fix:
        vs: list[wire.Block] = [memoryview(src[int(i)]) for i in idx]
        try:
            status = view.workers[w].via.put(
                d.timeout,
                nsb,
                [hashes[i] for i in idx],
                vs,
                [wire.block_checksum(v) for v in vs],
            )
        except KVStoreError:
            d.replica_stats.add(copies_failed=len(idx))
            continue
        d.replica_stats.add(repaired=sum(1 for x in status if x in (0, 1)))


def _joined(b: BlockView) -> bytes:
    return b"".join(b) if isinstance(b, list) else bytes(b)
