"""Keys: namespace rules, 16-byte block hashes, packing and bitmaps.

Every check on what a key may be lives here, so the client, the gRPC servicer
and the transfer server reject the same inputs with the same message.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from functools import cache
from operator import countOf

import numpy as np

from .errors import InvalidArgument

HASH_LEN = 16
MAX_NAMESPACE_LEN = 255
# Segments of letters, digits and . _ - : + = @, joined by '/', none empty, none
# starting with '.', e.g. "llama3-8b/bf16/b16/tp0of2".
_NS_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+=@-]*(/[A-Za-z0-9_][A-Za-z0-9._:+=@-]*)*")


def check_namespace(ns: object) -> str:
    """Return ``ns`` if it is a valid namespace, else raise InvalidArgument."""
    if not isinstance(ns, str):
        raise InvalidArgument(f"namespace must be str, got {type(ns).__name__}")
    if not ns or len(ns.encode()) > MAX_NAMESPACE_LEN or not _NS_RE.fullmatch(ns):
        raise InvalidArgument(
            f"bad namespace {ns[:80]!r}: want 1-{MAX_NAMESPACE_LEN} chars of "
            "[A-Za-z0-9._:+=@-] in '/'-separated segments, e.g. 'llama3-8b/bf16/b16/tp0of2'"
        )
    return ns


def check_hashes(hashes: Sequence[bytes]) -> None:
    """Raise InvalidArgument unless every element is a 16-byte bytes object."""
    if isinstance(hashes, (bytes, bytearray, memoryview, str)):
        raise InvalidArgument("hashes must be a list of 16-byte bytes objects, not one buffer")
    n = len(hashes)
    if countOf(map(type, hashes), bytes) == n and countOf(map(len, hashes), HASH_LEN) == n:
        return  # the common case, checked at C speed
    for i, h in enumerate(hashes):
        if not isinstance(h, bytes) or len(h) != HASH_LEN:
            got = f"{len(h)} bytes" if isinstance(h, (bytes, bytearray)) else type(h).__name__
            raise InvalidArgument(
                f"hash {i} must be {HASH_LEN} bytes, got {got}: keys are 16-byte hashes "
                "(kvstore_client.key_of(b'...') makes one from any bytes)"
            )


def pack_hashes(hashes: Sequence[bytes]) -> bytes:
    """Concatenate 16-byte hashes into one field of 16*N bytes."""
    return b"".join(hashes)


_SPLIT_MAX = 1024


@cache
def _splitter(n: int) -> struct.Struct:
    return struct.Struct(f"{HASH_LEN}s" * n)


def split_hashes(packed: bytes | bytearray | memoryview) -> list[bytes]:
    """Split a packed hash field (16*N bytes: gRPC requests, transfer frames, index
    dumps) into 16-byte bytes objects: the one splitter of client and worker. A few C
    calls (runs of power-of-two lengths up to 1,024); InvalidArgument if its length is
    not a multiple of 16."""
    n, rest = divmod(len(packed), HASH_LEN)
    if rest:
        raise InvalidArgument(
            f"packed hashes must be a multiple of {HASH_LEN} bytes, got {len(packed)}"
        )
    out: list[bytes] = []
    i = 0
    while i < n:
        k = min(_SPLIT_MAX, 1 << ((n - i).bit_length() - 1))
        out += _splitter(k).unpack_from(packed, i * HASH_LEN)
        i += k
    return out


def to_bitmap(flags: Sequence[bool]) -> bytes:
    """Bit i (LSB first within byte i // 8) is flags[i]."""
    if not flags:
        return b""
    return np.packbits(np.asarray(flags, dtype=bool), bitorder="little").tobytes()


def from_bitmap(bitmap: bytes, count: int) -> list[bool]:
    """The first ``count`` flags of a bitmap made by :func:`to_bitmap`."""
    if count == 0:
        return []
    if len(bitmap) * 8 < count:
        raise InvalidArgument(f"bitmap of {len(bitmap)} bytes cannot hold {count} flags")
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=count, bitorder="little")
    return [bool(b) for b in bits]


def leading_run(flags: Sequence[bool]) -> int:
    """Number of leading True values."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
