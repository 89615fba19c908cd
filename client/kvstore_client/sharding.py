"""Placement of block hashes on workers: a capacity-weighted consistent-hash ring.

The master publishes membership (worker ids, capacities, hosts) and the ring's
parameters; every client builds the same ring from them with this module, so
placement is defined once. Each worker owns ``vnode_count(capacity)`` points on a
64-bit ring; a key belongs to the first point at or after its position, and
with ``replicas=R`` also to the next R-1 distinct workers along the ring (on
distinct hosts first, when the hosts are known and there are at least R).
Adding or removing a worker therefore moves only the keys of its own points.

Balance: a worker with V points owns a share whose spread is about 1/sqrt(V) of
its mean, so the busiest of N workers holds about ``1 + sqrt(2 ln N)/sqrt(V)``
times the mean. ``vnodes_per_gib`` (published by the master, default 16: one
point per 64 MiB) gives a 64 GiB worker 1,024 points: max/mean about 1.1 at
1,000 workers (``kvstore bench scale`` measures it; docs/SCALE.md).

The ring is built with numpy (points from a splitmix64 sequence seeded by the
worker id, no per-point Python work) and looked up with ``searchsorted``, so
routing 1,000 hashes costs tens of microseconds and a 1,000-worker ring builds
in a fraction of a second.

Bounds, whatever the map says (the map comes from the master, which could be
misconfigured, or relay a registration that overstates its capacity):
:func:`point_counts` gives no worker more than ``MAX_WORKER_SHARE`` times the
median worker's points (a worker claiming 2^64 bytes is counted as 8 median
workers, not as the whole ring), and the whole ring at most ``MAX_RING_POINTS``
points (above it every worker's points are scaled down alike), so a client
never spends more than about a second and ~150 MiB building a ring. Replicas are
clamped to ``MAX_REPLICAS``. Below these bounds placement is exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from .keys import HASH_LEN, pack_hashes
from .replicas import MAX_REPLICAS

MIN_VNODES = 160
MAX_VNODES = 65536
DEFAULT_VNODES_PER_GIB = 16
# Points of the whole ring, whatever the map says: 1,024 workers of 256 GiB at the
# default density (docs/SCALE.md: ~0.5-1 s and ~100-150 MiB to build at the cap).
MAX_RING_POINTS = 1 << 22
# No worker gets more points than this many times the median worker's.
MAX_WORKER_SHARE = 8
_GIB = float(1 << 30)
_ROWS = 1 << 18  # ring rows whose replica owners are found at once (bounds temporaries)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def vnode_count(capacity_bytes: int, vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB) -> int:
    """Virtual nodes for a worker of this capacity alone (clamped to [160, 65536]);
    in a ring, :func:`point_counts` also bounds its share and the ring's total."""
    n = int(capacity_bytes * vnodes_per_gib / (1 << 30))
    return max(MIN_VNODES, min(MAX_VNODES, n))


def wanted_counts(
    capacities: Sequence[int], vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB
) -> np.ndarray:
    """:func:`vnode_count` of each capacity (int64), at once."""
    try:
        caps = np.array(capacities, dtype=np.uint64)
    except OverflowError:  # not a map's uint64: clamped into one
        top = (1 << 64) - 1
        caps = np.array([min(max(int(c), 0), top) for c in capacities], dtype=np.uint64)
    # float64 gives vnode_count's exact int(c * d / 2**30) below 2**53 bytes
    want = np.floor(caps.astype(np.float64) * float(max(0, int(vnodes_per_gib))) / _GIB)
    counts: np.ndarray = np.clip(want, MIN_VNODES, MAX_VNODES).astype(np.int64)
    return counts


def share_cap(counts: np.ndarray) -> int:
    """The most points one worker gets: ``MAX_WORKER_SHARE`` x the lower median."""
    return MAX_WORKER_SHARE * int(np.sort(counts)[(len(counts) - 1) // 2])


def point_counts(
    capacities: Sequence[int], vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB
) -> np.ndarray:
    """Ring points of each worker (int64, in the order given), within three bounds:

    1. each worker's :func:`vnode_count` (capacity x density, in [160, 65536]);
    2. at most :func:`share_cap` (``MAX_WORKER_SHARE`` x the median worker's count);
    3. all together at most ``MAX_RING_POINTS``: above it each worker keeps a floor
       (160, or fewer when there are very many workers) and the points above the
       floor shrink in proportion (integer arithmetic, so every client agrees).

    ValueError for more workers than ``MAX_RING_POINTS``.
    """
    return bound_counts(wanted_counts(capacities, vnodes_per_gib))


def bound_counts(wanted: np.ndarray) -> np.ndarray:
    """Bounds 2 and 3 of :func:`point_counts` applied to :func:`wanted_counts`."""
    n = len(wanted)
    if n > MAX_RING_POINTS:
        raise ValueError(f"a map of {n} workers: a ring has at most {MAX_RING_POINTS} points")
    if not n:
        return np.empty(0, dtype=np.int64)
    counts: np.ndarray = np.minimum(wanted, share_cap(wanted))
    total = int(counts.sum())
    if total > MAX_RING_POINTS:
        floor = min(MIN_VNODES, MAX_RING_POINTS // n)
        above = counts - floor
        counts = floor + above * (MAX_RING_POINTS - n * floor) // int(above.sum())
    return counts


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads keys that are not uniformly random (test ids)."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def key_positions(hashes: Sequence[bytes]) -> np.ndarray:
    """Ring positions (uint64) of 16-byte hashes."""
    if not hashes:
        return np.empty(0, dtype=np.uint64)
    return packed_positions(pack_hashes(hashes))


def packed_positions(packed: bytes) -> np.ndarray:
    """Ring positions (uint64) of hashes packed as 16*N bytes (same as key_positions,
    computed in place: one array and one scratch, no temporaries)."""
    words = np.frombuffer(packed, dtype="<u8").reshape(-1, HASH_LEN // 8)
    x = words[:, 1].astype(np.uint64)
    t = np.empty_like(x)
    _mix_into(x, t)
    x ^= words[:, 0]
    _mix_into(x, t)
    return x


def _mix_into(x: np.ndarray, t: np.ndarray) -> None:
    """:func:`_mix` of ``x`` in place (``t``: scratch of the same shape)."""
    np.right_shift(x, _S30, out=t)
    x ^= t
    x *= _M1
    np.right_shift(x, _S27, out=t)
    x ^= t
    x *= _M2
    np.right_shift(x, _S31, out=t)
    x ^= t


def worker_points(worker_id: str, count: int) -> np.ndarray:
    """The ring positions of a worker's ``count`` virtual nodes (uint64, unsorted).

    Point j is splitmix64(seed + j * golden) with seed = xxh3_64(worker id): the
    first k points of a worker do not depend on its total, so a capacity change
    moves only the points added or removed.
    """
    seed = np.uint64(xxhash.xxh3_64_intdigest(worker_id.encode()))
    with np.errstate(over="ignore"):
        seq = seed + np.arange(count, dtype=np.uint64) * _GOLDEN
    return _mix(seq)


@dataclass(frozen=True, slots=True)
class Ring:
    """An immutable ring. ``owners[p]`` lists the R distinct worker indices of point p."""

    worker_ids: tuple[str, ...]
    points: np.ndarray  # sorted uint64
    owners: np.ndarray  # int32, shape (len(points), replicas)
    host_of: np.ndarray | None = None  # host index per worker, when hosts were given
    # first owner per point, plus the first point's again (a key past the last point)
    wrapped: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = self.owners[:, 0] if self.owners.size else np.empty(0, dtype=np.int32)
        object.__setattr__(self, "wrapped", np.append(first, first[:1]))

    @property
    def replicas(self) -> int:
        return int(self.owners.shape[1]) if self.owners.size else 0

    def primary(self, hashes: Sequence[bytes]) -> np.ndarray:
        """Index into worker_ids of each hash's first owner (int32 array)."""
        return self.lookup(hashes)[:, 0] if len(hashes) else np.empty(0, dtype=np.int32)

    def primary_packed(self, packed: bytes) -> np.ndarray:
        """:meth:`primary` of hashes packed as 16*N bytes (one pass, no list)."""
        if not len(self.points):
            raise ValueError("the ring has no workers")
        owner: np.ndarray = self.wrapped[np.searchsorted(self.points, packed_positions(packed))]
        return owner

    def lookup(self, hashes: Sequence[bytes], replicas: int | None = None) -> np.ndarray:
        """Owner indices, shape (len(hashes), R) with R = ``replicas`` (default: the
        ring's) clamped to the number of workers; empty ring -> ValueError.

        Owners beyond the ring's own replica count are found by walking the ring
        for just these keys, with the same rule as :func:`build_ring`.
        """
        if not len(self.points):
            raise ValueError("the ring has no workers")
        idx = np.searchsorted(self.points, key_positions(hashes), side="left")
        idx[idx == len(self.points)] = 0
        have = self.owners.shape[1]
        r = have if replicas is None else max(1, min(replicas, len(self.worker_ids)))
        if r <= have:
            owners: np.ndarray = self.owners[idx, :r]
            return owners
        out = np.full((len(idx), r), -1, dtype=np.int32)
        out[:, :have] = self.owners[idx]
        filled = np.full(len(idx), have, dtype=np.int64)
        point_owner = self.owners[:, 0]
        if self.host_of is not None and len(set(self.host_of.tolist())) >= r:
            _fill(out, filled, point_owner, self.host_of, idx)
        _fill(out, filled, point_owner, None, idx)
        return out


def build_ring(
    workers: Sequence[tuple[str, int]],
    *,
    vnodes_per_gib: int = DEFAULT_VNODES_PER_GIB,
    replicas: int = 1,
    hosts: Mapping[str, str] | None = None,
) -> Ring:
    """Build the ring for (worker_id, capacity_bytes) pairs; order does not matter.

    Each worker gets :func:`point_counts` points (bounded whatever the capacities
    and density say). ``replicas`` is clamped to [1, min(number of workers,
    MAX_REPLICAS)]. With ``hosts`` (worker id -> host id) and at least ``replicas``
    distinct hosts, the owners of a point are on distinct hosts; otherwise they are
    distinct workers.
    """
    ids = tuple(sorted({w for w, _ in workers}))
    cap = dict(workers)
    if not ids:
        return Ring(ids, np.empty(0, dtype=np.uint64), np.empty((0, 0), dtype=np.int32))
    counts = point_counts([cap[wid] for wid in ids], vnodes_per_gib).tolist()
    raw = np.concatenate([worker_points(wid, c) for wid, c in zip(ids, counts, strict=True)])
    order = np.argsort(raw)  # 64-bit positions: ties do not happen in practice
    points = raw[order]
    del raw
    point_owner = np.repeat(np.arange(len(ids), dtype=np.int32), counts)[order]
    del order
    r = max(1, min(replicas, len(ids), MAX_REPLICAS))
    owners = np.full((len(points), r), -1, dtype=np.int32)
    owners[:, 0] = point_owner
    if r > 1:
        host_of = _host_index(ids, hosts)
        by_host = host_of is not None and len(set(host_of.tolist())) >= r
        for a in range(0, len(points), _ROWS):  # in slices: bounded temporaries
            rows = owners[a : a + _ROWS]
            filled = np.ones(len(rows), dtype=np.int64)
            start = np.arange(a, a + len(rows))
            if by_host:
                _fill(rows, filled, point_owner, host_of, start)
            _fill(rows, filled, point_owner, None, start)
    return Ring(ids, points, owners, _host_index(ids, hosts))


def _host_index(ids: Sequence[str], hosts: Mapping[str, str] | None) -> np.ndarray | None:
    if not hosts:
        return None
    names: dict[str, int] = {}
    # a worker without a host id is a host of its own
    return np.array(
        [names.setdefault(hosts.get(w) or f"\0{w}", len(names)) for w in ids], dtype=np.int32
    )


def _fill(
    owners: np.ndarray,
    filled: np.ndarray,
    point_owner: np.ndarray,
    host_of: np.ndarray | None,
    start: np.ndarray,
) -> None:
    """Append to each row of ``owners`` (row k starts at ring point ``start[k]``) the
    next workers along the ring that are not in the row yet (with ``host_of``: whose
    host is not in the row yet), until each row is full or the ring was walked once."""
    r = owners.shape[1]
    n = len(point_owner)
    shift = 1
    pending = np.flatnonzero(filled < r)
    while len(pending) and shift < n:
        cand = point_owner[(start[pending] + shift) % n]
        rows = owners[pending]
        if host_of is None:
            fresh = np.all(rows != cand[:, None], axis=1)
        else:
            row_hosts = np.where(rows >= 0, host_of[np.maximum(rows, 0)], -1)
            fresh = np.all(row_hosts != host_of[cand][:, None], axis=1)
        take = pending[fresh]
        owners[take, filled[take]] = cand[fresh]
        filled[take] += 1
        pending = pending[filled[pending] < r]
        shift += 1
