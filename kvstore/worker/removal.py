"""Namespace removal through a BlockStore, a slice at a time.

RemoveNamespace of half a million blocks must not hold the store lock for the whole
walk (issue 23: another client's 1-key lookup waited up to a second). DRAM keys are
taken a few thousand per hold of the lock and removed (BlockStore.remove slices
again); SSD and staged keys are picked out of a snapshot (one C-speed copy under the
lock, filtered outside it).
"""

from __future__ import annotations

from .storehost import StoreHost
from .storerecords import LOOKUP_SLICES
from .tiers.stimuli import DramKeys, DramNamespaces, OffDramKeys


def remove_tree(host: StoreHost, ns: str) -> int:
    """Remove ``ns`` and every namespace below ``ns + "/"``; returns blocks removed.
    Prefix semantics, like tenant ownership: "t" removes "t" and "t/...", never "tx"."""
    return sum(remove_namespace(host, n) for n in namespaces_under(host, ns))


def namespaces_under(host: StoreHost, ns: str) -> list[str]:
    """``ns`` and every namespace below ``ns + "/"`` that holds blocks (DRAM or SSD)."""
    names = set(host.apply(DramNamespaces()))
    names.update(n for n, _ in host.apply(OffDramKeys()))
    return sorted(n for n in names if n == ns or n.startswith(ns + "/"))


def remove_namespace(host: StoreHost, ns: str) -> int:
    """Remove every block of exactly this namespace; returns how many were present."""
    step = host.slice_keys * LOOKUP_SLICES
    others = host.apply(OffDramKeys())
    n = host.remove(ns, sorted({k for m, k in others if m == ns}))
    while True:
        keys = host.apply(DramKeys(ns, step))
        gone = host.remove(ns, keys) if keys else 0
        n += gone
        if not gone:
            return n
