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
from .shmindex import (
    W_OFF,
    W_SEQGEN,
    W_SIZESLOT,
    W_SUM,
    HazardPage,
    IndexView,
    Probe,
    slot_words,
)

ONE = np.uint64(1)
LOW32 = np.uint64(0xFFFFFFFF)

# Parts up to this size are copied by memoryview slice assignment (less per-call
# overhead than numpy: 32 copies of 64 KiB took 106 us against numpy.copyto's 160-196
# us on a 2-core VM, and the two ran even at 128 KiB); larger ones by numpy.copyto in
# cache-sized chunks, each hashed after its copy (kvstore_client.verified).
SMALL_PART = 128 << 10

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
    are free. Each step that drops rows (not found, mid-write, over the budget, changed
    since the probe) selects only when it drops one: a batch that is all hits costs a
    handful of array operations."""
    if p.whole:
        rows: npt.NDArray[np.int64] = np.arange(len(p.found))
        w = p.words
    else:
        rows = np.flatnonzero(p.found)
        w = p.words[rows]
    if not len(rows):
        return _Pinned(rows, [], 0, 0)
    odd = (w[:, W_SEQGEN] & ONE).astype(bool)  # entries mid-write: the socket path
    if odd.any():
        rows, w = rows[~odd], w[~odd]
        if not len(rows):
            return _Pinned(rows, [], 0, 0)
    sizes = w[:, W_SIZESLOT] & LOW32
    nbytes = int(sizes.sum())
    room = loc.hazards.room()
    over = rows[:0]
    if nbytes > room:
        fit = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
        over, rows, w, sizes = rows[fit:], rows[:fit], w[:fit], sizes[:fit]
        if not len(rows):
            return _Pinned(rows, [], 0, 0, 0, over)
        nbytes = int(sizes.sum())
    start = loc.hazards.take(len(rows), nbytes)
    if start < 0:
        return None  # no hazard words free, or over the budget: the socket path
    words = slot_words(w)
    loc.hazards.publish(start, words)
    taken = len(rows)
    still = loc.index.unchanged(p.pos if p.whole and taken == len(p.found) else p.pos[rows], w)
    if not still.all():
        rows, w, words, sizes = rows[still], w[still], words[still], sizes[still]
    cols = list(
        zip(
            w[:, W_OFF].tolist(),
            sizes.tolist(),
            w[:, W_SUM].tolist(),
            words.tolist(),
            strict=True,
        )
    )
    return _Pinned(rows, cols, start, taken, nbytes, over)


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
        src, mv = loc.src, loc.mv
        rows = pinned.rows.tolist()
        nbytes = sum(c[1] for c in pinned.cols)
        if buffers is not None and nbytes < verified.PARALLEL_MIN:
            got = _read_small(src, mv, rows, pinned.cols, buffers, sizes, found, bounce)
            total = sum(c[1] for c, ok in zip(pinned.cols, got, strict=True) if ok)
        else:
            got, total = _read_jobs(src, mv, rows, pinned.cols, buffers, sizes, found, values,
                                    bounce, nbytes)  # fmt: skip
    finally:
        pinned.give(loc.hazards)
    sure_miss = ~p.found & ~p.unsure
    _log(loc, pinned, got, int(sure_miss.sum()))
    left = np.flatnonzero(~done & ~sure_miss)
    return left.tolist(), total


def _read_jobs(
    src: np.ndarray,
    mv: memoryview,
    rows: list[int],
    cols: list[tuple[int, int, int, int]],
    buffers: Sequence[memoryview | list[memoryview]] | None,
    sizes: Sequence[int],
    found: list[bool],
    values: list[bytearray | None],
    bounce: Bounce,
    nbytes: int,
) -> tuple[list[bool], int]:
    """A batch as one job per block, spread over the copy pool when it is big
    (kvstore_client.verified); per row a hit, and the payload bytes read."""
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
        for i, (off, size, checksum, _) in zip(rows, cols, strict=True)
    ]
    got: list[bool] = []
    total = 0
    for i, (ok, value), c in zip(rows, verified.run(jobs, nbytes), cols, strict=True):
        if buffers is None:
            values[i] = value
        found[i] = ok
        got.append(ok)
        total += c[1] if ok else 0
    return got, total


def _read_small(
    src: np.ndarray,
    mv: memoryview,
    rows: list[int],
    cols: list[tuple[int, int, int, int]],
    buffers: Sequence[memoryview | list[memoryview]],
    sizes: Sequence[int],
    found: list[bool],
    bounce: Bounce,
) -> list[bool]:
    """A batch too small for the copy pool, into the caller's buffers on this thread:
    a small block into a flat buffer of its size in one slice assignment, then hashed
    there (what :func:`copy_block` does, without its calls: at 64 KiB those cost as
    much as the copy); anything else through :func:`copy_block`. Per row, a hit."""
    digest = xxhash.xxh3_64_intdigest
    limit = len(src)
    got: list[bool] = []
    for i, (off, size, checksum, _) in zip(rows, cols, strict=True):
        out = buffers[i]
        if off + size > limit:
            ok = False
        elif type(out) is memoryview and size <= SMALL_PART and out.nbytes == size:
            out[:] = mv[off : off + size]
            ok = digest(out) == checksum
        else:
            ok = copy_block(src, mv, off, size, checksum, out, sizes[i], bounce)
        found[i] = ok
        got.append(ok)
    return got


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
    if size <= SMALL_PART:
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
