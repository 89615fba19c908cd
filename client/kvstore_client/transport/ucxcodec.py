"""The ucx:// frame codec that needs no UCX: part tables (wire.FLAG_PARTS) and packed
payloads (wire.FLAG_PACKED). Shared by the client half (:mod:`.ucx`) and the worker's
frame core and server half, so each format is defined once.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .. import wire
from ..errors import ProtocolError

Buffer = bytes | bytearray | memoryview
ERROR_MAX = 4096  # bytes of an error message a peer may send

MAX_PART_ENTRIES = 1 << 20  # parts in one frame


def part_tables(blocks: Sequence[wire.Block | None]) -> tuple[bytes, bytes]:
    """The two part tables of a FLAG_PARTS frame: a u32 part count per block (ends the
    body), and the u32 size of every part (the message after the body). ``None`` (no
    destination) and a whole buffer count as one part."""
    counts = bytearray(len(blocks) * 4)
    sizes: list[int] = []
    for i, b in enumerate(blocks):
        if isinstance(b, list):
            wire.PART_COUNT.pack_into(counts, 4 * i, len(b))
            sizes.extend(p.nbytes for p in b)
        else:
            wire.PART_COUNT.pack_into(counts, 4 * i, 1)
            sizes.append(0 if b is None else wire.block_size(b))
    return bytes(counts), struct.pack(f"<{len(sizes)}I", *sizes)


def read_part_counts(raw: memoryview | bytes) -> list[int]:
    """Per block its part count (the tail of a FLAG_PARTS body); ProtocolError when a
    count is 0, above wire.MAX_PARTS, or the frame has too many parts in all."""
    counts = list(struct.unpack(f"<{len(raw) // 4}I", raw))
    if any(c < 1 or c > wire.MAX_PARTS for c in counts) or sum(counts) > MAX_PART_ENTRIES:
        raise ProtocolError("bad part counts in a FLAG_PARTS frame")
    return counts


def split_sizes(counts: Sequence[int], raw: bytes | bytearray) -> list[list[int]]:
    """Per block the sizes of its parts, from the part-size table."""
    sizes = struct.unpack(f"<{len(raw) // 4}I", raw)
    out: list[list[int]] = []
    at = 0
    for c in counts:
        out.append(list(sizes[at : at + c]))
        at += c
    return out


def slices(view: memoryview, sizes: Sequence[int]) -> list[memoryview]:
    """``view`` cut into consecutive slices of ``sizes`` (which add up to its size)."""
    out: list[memoryview] = []
    at = 0
    for n in sizes:
        out.append(view[at : at + n])
        at += n
    return out


PACK_BELOW = 256 << 10  # payload messages smaller than this on average go packed


def packs(blocks: Sequence[wire.Block]) -> bool:
    """Whether a frame's payloads go packed into one message (wire.FLAG_PACKED): more
    than one message, at most wire.MAX_PACKED bytes, averaging under PACK_BELOW. Each
    UCX message pays a rendezvous and the event loop's hand-offs (hundreds of
    microseconds over tcp), a copy of 64 KiB a few."""
    sizes = [b.nbytes if isinstance(b, memoryview) else len(b) for b in wire.flat_buffers(blocks)]
    messages = sum(1 for n in sizes if n)
    total = sum(sizes)
    return messages > 1 and total <= wire.MAX_PACKED and total < PACK_BELOW * messages


def copy_into(block: wire.Block, src: memoryview) -> None:
    """Copy ``src`` into ``block`` (one buffer, or its parts in order; sizes match)."""
    at = 0
    for part in wire.block_parts(block):
        view = memoryview(part).cast("B")
        view[:] = src[at : at + view.nbytes]
        at += view.nbytes


class Staging:
    """One endpoint's reusable area for packed payloads: grown as needed (up to
    wire.MAX_PACKED; zero-filled, so its pages are touched once, not per frame)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray(0)

    def view(self, n: int) -> memoryview:
        """The first ``n`` bytes (valid until the next call)."""
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]

    def pack(self, buffers: Sequence[Buffer]) -> memoryview:
        """``buffers`` copied back to back; the packed view."""
        views = [memoryview(b).cast("B") for b in buffers]
        out = self.view(sum(v.nbytes for v in views))
        at = 0
        for v in views:
            out[at : at + v.nbytes] = v
            at += v.nbytes
        return out


__all__ = [
    "ERROR_MAX",
    "MAX_PART_ENTRIES",
    "PACK_BELOW",
    "Staging",
    "copy_into",
    "packs",
    "part_tables",
    "read_part_counts",
    "slices",
    "split_sizes",
]
