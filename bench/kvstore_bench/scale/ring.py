"""The client's ring at the scale bench's size: build time, per-key lookup, placement
balance with mixed capacities (64/128/256 GiB) and keys moved when workers leave.
Pure computation in this process (no master); `kvstore bench scale` reports it beside
the control-plane run (:mod:`.run`)."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from kvstore_client.sharding import DEFAULT_VNODES_PER_GIB, build_ring

from .run import sim_info

__all__ = ["ring_figures"]


def ring_figures(workers: int, keys: int, fail_fraction: float = 0.01) -> dict[str, Any]:
    """Build time, lookup cost, balance and movement of the client's ring at
    ``workers`` simulated workers with mixed capacities (64/128/256 GiB)."""
    infos = [sim_info(i) for i in range(workers)]
    pairs = [(w.id, int(w.capacity_bytes)) for w in infos]
    hosts = {w.id: w.host_id for w in infos}
    out: dict[str, Any] = {
        "workers": workers,
        "keys": keys,
        "vnodes_per_gib": DEFAULT_VNODES_PER_GIB,
    }
    for r in (1, 3):
        t0 = time.perf_counter()
        ring = build_ring(pairs, replicas=r, hosts=hosts)
        out[f"build_r{r}_s"] = time.perf_counter() - t0
    ring = build_ring(pairs)
    out["points"] = len(ring.points)
    out["ring_bytes"] = int(ring.points.nbytes + ring.owners.nbytes)
    rng = np.random.default_rng(1)
    batch = [bytes(x) for x in rng.integers(0, 256, size=(1000, 16), dtype=np.uint8)]
    ring.primary(batch)
    t0 = time.perf_counter()
    reps = 50
    for _ in range(reps):
        ring.primary(batch)
    out["lookup_per_key_s"] = (time.perf_counter() - t0) / (reps * len(batch))
    # exact shares: each point owns the arc that ends at it
    pts = ring.points.astype(np.float64)
    arcs = np.diff(np.concatenate([pts[-1:] - 2.0**64, pts]))
    share = np.bincount(ring.owners[:, 0], weights=arcs, minlength=workers) / 2.0**64
    cap = np.array([dict(pairs)[w] for w in ring.worker_ids], dtype=np.float64)
    load = share / (cap / cap.sum())
    out["balance_exact_max_over_mean"] = float(load.max() / load.mean())
    out["balance_exact_min_over_mean"] = float(load.min() / load.mean())
    hashes = [bytes(x) for x in rng.integers(0, 256, size=(keys, 16), dtype=np.uint8)]
    own = ring.primary(hashes)
    per = np.bincount(own, minlength=workers) / (cap / cap.sum() * keys)
    out["balance_keys_max_over_mean"] = float(per.max() / per.mean())
    out["load_exact"] = load.tolist()
    gone = set(random.Random(3).sample(range(workers), max(1, round(fail_fraction * workers))))
    rest = build_ring([p for i, p in enumerate(pairs) if i not in gone])
    ids_before = np.array(ring.worker_ids)[own]
    ids_after = np.array(rest.worker_ids)[rest.primary(hashes)]
    moved = ids_before != ids_after
    out["left_workers"] = len(gone)
    out["left_capacity_share"] = float(sum(cap[i] for i in gone) / cap.sum())
    out["moved_fraction"] = float(moved.mean())
    lost = {ring.worker_ids[i] for i in gone}
    out["moved_only_from_leavers"] = bool(np.all(np.isin(ids_before[moved], list(lost))))
    return out
