"""Keys: namespace rules, 16-byte block hashes, packing and bitmaps.

Every check on what a key may be lives here, so the client, the gRPC servicer
and the transfer server reject the same inputs with the same message.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Sequence
from functools import cache
from operator import countOf
from typing import overload

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
    """Raise InvalidArgument unless every element is a 16-byte bytes object (a
    :class:`Keys` was checked when it was made)."""
    if type(hashes) is Keys:
        return
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
    """Concatenate 16-byte hashes into one field of 16*N bytes (a :class:`Keys` is
    packed already)."""
    if type(hashes) is Keys:
        return hashes.packed
    return b"".join(hashes)


class Keys(Sequence[bytes]):
    """Block hashes packed once (16 bytes each), checked when made, for lookups that
    ask about the same chain more than once.

    Every lookup of a list (``Client.match_prefix``, ``batch_exists``,
    ``exists_local``, ``batch_where``, ``where_local``) checks each hash's type and
    length and joins them: in CPython 40-80 ns a key, as much as the same-host index
    probe of the whole chain. A caller that asks about a chain again (an engine's
    scheduler asks every step a request waits) makes ``Keys(hashes)`` once (checked
    as a call would check the list; InvalidArgument otherwise) or
    ``Keys.frombytes(packed)`` from 16*N bytes, and passes it wherever those calls
    take a list: they then skip the checks and the join. Immutable; indexing gives
    the 16-byte bytes objects (split on first use), a slice a list of them.
    """

    __slots__ = ("_list", "packed")

    packed: bytes
    _list: list[bytes] | None

    def __init__(self, hashes: Sequence[bytes] = ()) -> None:
        if type(hashes) is Keys:
            self.packed = hashes.packed
        else:
            check_hashes(hashes)
            self.packed = b"".join(hashes)
        self._list = None  # split on first use

    @classmethod
    def frombytes(cls, packed: bytes | bytearray | memoryview) -> Keys:
        """Keys from 16*N packed bytes (copied); InvalidArgument for another length."""
        if isinstance(packed, str) or len(packed) % HASH_LEN:
            got = type(packed).__name__ if isinstance(packed, str) else f"{len(packed)} bytes"
            raise InvalidArgument(
                f"packed hashes must be a multiple of {HASH_LEN} bytes, got {got}"
            )
        k = cls()
        k.packed = bytes(packed)
        return k

    def _split(self) -> list[bytes]:
        if self._list is None:
            self._list = split_hashes(self.packed)
        return self._list

    def __len__(self) -> int:
        return len(self.packed) // HASH_LEN

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        return self._split()[i]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._split())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keys) and other.packed == self.packed

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"Keys(<{len(self)} hashes>)"


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
