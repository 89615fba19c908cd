"""Namespace removal through a BlockStore, a slice at a time.

RemoveNamespace of half a million blocks must not hold the store lock for the whole
walk (issue 23: another client's 1-key lookup waited up to a second). DRAM keys are
taken a few thousand per hold of the lock and removed (BlockStore.remove slices
again); SSD and staged keys are picked out of a snapshot (one C-speed copy under the
lock, filtered outside it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .storerecords import LOOKUP_SLICES

if TYPE_CHECKING:
    from .store import BlockStore


def remove_tree(store: BlockStore, ns: str) -> int:
    """Remove ``ns`` and every namespace below ``ns + "/"``; returns blocks removed.
    Prefix semantics, like tenant ownership: "t" removes "t" and "t/...", never "tx"."""
    return sum(remove_namespace(store, n) for n in namespaces_under(store, ns))


def namespaces_under(store: BlockStore, ns: str) -> list[str]:
    """``ns`` and every namespace below ``ns + "/"`` that holds blocks (DRAM or SSD)."""
    with store.lock:
        names = set(store.tier.namespaces())
        others = [*store.ssd_index.entries, *store._staged]
    names.update(n for n, _ in others)
    return sorted(n for n in names if n == ns or n.startswith(ns + "/"))


def remove_namespace(store: BlockStore, ns: str) -> int:
    """Remove every block of exactly this namespace; returns how many were present."""
    step = store.slice_keys * LOOKUP_SLICES
    with store.lock:
        others = [*store.ssd_index.entries, *store._staged]
    n = store.remove(ns, sorted({k for m, k in others if m == ns}))
    while True:
        with store.lock:
            keys = store.tier.keys_of(ns, step)
        gone = store.remove(ns, keys) if keys else 0
        n += gone
        if not gone:
            return n
