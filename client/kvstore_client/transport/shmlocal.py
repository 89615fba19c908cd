"""The same-host path with no round trip: lookups, reads and pins through a worker's
shared index (:mod:`.shmindex`) and its mapped arena.

Each function answers what the index can answer alone and says which keys it could
not (the caller asks the worker for those over the socket, as before):

- :func:`prefix` - the leading run of present keys (no pin: a lookup is a hint);
- :func:`read` - copies out of the arena under hazard pins, each block verified
  against its xxh3-64 in the caller's buffer (a mismatch is a miss);
- :func:`pin` - hazard pins held until the lease is released, each slot verified.

A key the index does not hold is a miss unless it is "unsure" (a full bucket, or a
worker with an SSD tier): those are left to the socket path, like keys whose entry
changed between the probe and the pin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt
import xxhash

from .. import verified
from .shmindex import W_OFF, W_SIZESLOT, W_SUM, HazardPage, IndexView, Probe

# Parts below this size are copied by memoryview slice assignment (less per-call
# overhead than numpy); larger ones by numpy.copyto, which ran 3-4x faster than
# memoryview assignment for 128 KiB-1 MiB copies on the development VM.
SMALL_PART = 64 << 10

Bounce = Callable[[int], tuple[np.ndarray, memoryview]]


@dataclass(slots=True)
class Local:
    """What a same-host client holds of one worker: its arena mapped read-only
    (``src`` / ``mv``), its index read-only, and this client's hazard page."""

    src: np.ndarray
    mv: memoryview
    index: IndexView
    hazards: HazardPage


def prefix(loc: Local, ns: bytes, packed: bytes) -> int | None:
    """How many of the keys lead as present, or None when the first key the index
    lacks might still be held by the worker, or the worker wants lookups (ask it)."""
    if not loc.index.lookups_here:
        return None
    p = loc.index.probe(ns, packed)
    miss = np.flatnonzero(~p.found)
    if not len(miss):
        return len(p.found)
    first = int(miss[0])
    return None if p.unsure[first] else first


def exists(
    loc: Local, ns: bytes, packed: bytes, anyway: bool = False
) -> npt.NDArray[np.bool_] | None:
    """Per key, present; None if some key is unsure, or the worker wants lookups and
    not ``anyway`` (ask the worker for all)."""
    if not anyway and not loc.index.lookups_here:
        return None
    p = loc.index.probe(ns, packed)
    return None if p.unsure.any() else p.found


@dataclass(slots=True)
class _Pinned:
    """Keys pinned through the index: ``rows`` (indices into the batch) whose
    entries held still after the pin, their (offset, size, checksum, hazard word)
    columns, and the hazard range with the bytes it was taken for."""

    rows: npt.NDArray[np.int64]
    cols: list[tuple[int, int, int, int]]
    start: int
    count: int
    nbytes: int = 0
    over: npt.NDArray[np.int64] = field(default_factory=lambda: np.empty(0, np.int64))

    def give(self, hazards: HazardPage) -> None:
        hazards.give(self.start, self.count, self.nbytes)


def _pin(loc: Local, p: Probe) -> _Pinned | None:
    """Pin what the probe found, within this client's budget: the leading rows that fit
    (a chain's head matters most), the others in ``over``; None when no hazard words
    are free."""
    rows = p.stable(np.flatnonzero(p.found))  # entries mid-write: the socket path
    if not len(rows):
        return _Pinned(rows, [], 0, 0)
    sizes = (p.words[rows, W_SIZESLOT] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    fit = int(np.searchsorted(np.cumsum(sizes), loc.hazards.room(), side="right"))
    over = rows[fit:]
    rows = rows[:fit]
    if not len(rows):
        return _Pinned(rows, [], 0, 0, 0, over)
    nbytes = int(sizes[:fit].sum())
    start = loc.hazards.take(len(rows), nbytes)
    if start < 0:
        return None  # no hazard words free, or over the budget: the socket path
    words = p.slots(rows)
    loc.hazards.publish(start, words)
    still = loc.index.still(p, rows)
    rows, words = rows[still], words[still]
    w = p.words[rows]
    cols = list(
        zip(
            w[:, W_OFF].tolist(),
            (w[:, W_SIZESLOT] & np.uint64(0xFFFFFFFF)).tolist(),
            w[:, W_SUM].tolist(),
            words.tolist(),
            strict=True,
        )
    )
    return _Pinned(rows, cols, start, len(still), nbytes, over)


def _log(loc: Local, pinned: _Pinned, got: Sequence[bool], misses: int) -> None:
    """Tell the worker what was read (hits move up its LRU) and missed. Logged last
    block first, as the worker's own reads release them: a chain's head ends up the
    most recently used."""
    words = [c[3] for c, ok in zip(reversed(pinned.cols), reversed(got), strict=True) if ok]
    if misses:
        words.append(misses)
    if words:
        loc.hazards.touched(np.array(words, dtype=np.uint64))


def read(
    loc: Local,
    ns: bytes,
    packed: bytes,
    buffers: Sequence[memoryview | list[memoryview]] | None,
    sizes: Sequence[int],
    found: list[bool],
    values: list[bytearray | None],
    bounce: Bounce,
) -> tuple[list[int], int]:
    """Read what the index holds into ``buffers`` (or new ``values``), marking
    ``found``; returns (the indices left for the socket path, payload bytes read)."""
    p = loc.index.probe(ns, packed)
    pinned = _pin(loc, p)
    if pinned is None:
        return list(range(len(p.found))), 0
    try:
        done = np.zeros(len(p.found), dtype=bool)
        done[pinned.rows] = True
        total = 0
        src, mv = loc.src, loc.mv
        rows = pinned.rows.tolist()
        jobs = [
            partial(
                _read_one,
                src,
                mv,
                off,
                size,
                checksum,
                buffers[i] if buffers is not None else None,
                sizes[i] if sizes else size,
                bounce,
            )
            for i, (off, size, checksum, _) in zip(rows, pinned.cols, strict=True)
        ]
        # Copies spread over the copy pool when the batch is big (kvstore_client.verified).
        results = verified.run(jobs, sum(c[1] for c in pinned.cols))
        got: list[bool] = []
        for i, (ok, value), c in zip(rows, results, pinned.cols, strict=True):
            if buffers is None:
                values[i] = value
            found[i] = ok
            got.append(ok)
            total += c[1] if ok else 0
    finally:
        pinned.give(loc.hazards)
    sure_miss = ~p.found & ~p.unsure
    _log(loc, pinned, got, int(sure_miss.sum()))
    left = np.flatnonzero(~done & ~sure_miss)
    return left.tolist(), total


def _read_one(
    src: np.ndarray,
    mv: memoryview,
    off: int,
    size: int,
    checksum: int,
    out: memoryview | list[memoryview] | None,
    want: int,
    bounce: Bounce,
) -> tuple[bool, bytearray | None]:
    """One block out of the arena: into ``out``, or (``out`` None) a new bytearray,
    verified in the reader's own memory; (hit, the new value)."""
    if off + size > len(src):
        return False, None
    if out is not None:
        return copy_block(src, mv, off, size, checksum, out, want, bounce), None
    value = bytearray(size)
    ok = verified.copy_sum(np.frombuffer(value, dtype=np.uint8), src[off : off + size]) == checksum
    return ok, value if ok else None


def copy_block(
    src: np.ndarray,
    mv: memoryview,
    off: int,
    size: int,
    checksum: int,
    out: memoryview | list[memoryview] | None,
    want: int,
    bounce: Bounce,
) -> bool:
    """Copy one arena block into ``out`` and verify what landed there (True: a hit).
    ``out`` None checks nothing here (the caller copies and verifies)."""
    digest = xxhash.xxh3_64_intdigest
    if out is None:
        return True
    if want != size:
        return False
    if isinstance(out, list):
        if len(out) == 1:
            return verified.copy_sum(verified.as_array(out[0]), src[off : off + size]) == checksum
        # Many parts: one large copy into this thread's private bounce buffer, verify
        # it there, then scatter it from cache into the parts. Copies of under ~512 KiB
        # out of the (4 KiB-page) arena ran at a third of the speed of one large copy
        # (docs/BENCHMARKS.md); nothing else can write the bounce buffer, so the parts
        # get exactly the verified bytes.
        arr, bv = bounce(size)
        np.copyto(arr[:size], src[off : off + size])
        if digest(bv[:size]) != checksum:
            return False
        at = 0
        for part in out:
            k = part.nbytes
            part[:] = bv[at : at + k]
            at += k
        return True
    if out.nbytes != size:
        return False
    if size < SMALL_PART:
        out[:] = mv[off : off + size]
        return digest(out) == checksum
    # Copied and hashed chunk by chunk, the hash over the caller's buffer (what it gets).
    return verified.copy_sum(verified.as_array(out), src[off : off + size]) == checksum


def pin(
    loc: Local, ns: bytes, packed: bytes
) -> tuple[list[memoryview | None], list[int], Callable[[], None]]:
    """Pin what the index holds: (per key the verified slot view or None, the
    indices left for the socket path, the release)."""
    p = loc.index.probe(ns, packed)
    n = len(p.found)
    pinned = _pin(loc, p)
    if pinned is None:
        return [None] * n, list(range(n)), lambda: None
    views: list[memoryview | None] = [None] * n
    done = np.zeros(n, dtype=bool)
    done[pinned.rows] = True
    done[pinned.over] = True  # over this client's budget: not pinned (views None)
    mv = loc.mv
    # Checked once, at pin time: the arena is read-only to every client and a pinned
    # slot is not reused until released, so the bytes a DMA reads later are these.
    inside = [off + size <= len(mv) for off, size, _, _ in pinned.cols]
    slots = [mv[off : off + size] if ok else mv[:0]
             for (off, size, _, _), ok in zip(pinned.cols, inside, strict=True)]  # fmt: skip
    sums = verified.check_all(slots, [c for _, _, c, _ in pinned.cols])
    got = [a and b for a, b in zip(inside, sums, strict=True)]
    for i, ok, slot in zip(pinned.rows.tolist(), got, slots, strict=True):
        if ok:
            views[i] = slot
    sure_miss = ~p.found & ~p.unsure
    _log(loc, pinned, got, int(sure_miss.sum()))
    hazards = loc.hazards

    def release() -> None:
        pinned.give(hazards)

    return views, np.flatnonzero(~done & ~sure_miss).tolist(), release


__all__ = ["Local", "copy_block", "exists", "pin", "prefix", "read"]
