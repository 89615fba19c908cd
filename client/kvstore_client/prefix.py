"""Chained block hashes of token ids, the same in every process and engine.

``h[i] = xxh3_128(h[i-1] || tokens of block i || extra)``: equal hashes mean
equal prefixes. Token ids are encoded as little-endian uint32 (int64 when an id
does not fit), so the result never depends on PYTHONHASHSEED or an engine's own
hashing. Only full blocks are hashed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from .errors import InvalidArgument

ROOT = b"\x00" * 16


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int,
    *,
    extra: bytes = b"",
    parent: bytes = ROOT,
) -> list[bytes]:
    """Chained 16-byte hashes of each full block of ``tokens``.

    ``extra`` is mixed into every block (LoRA id, cache salt, multimodal hashes);
    ``parent`` is the hash before the first block (ROOT for a whole prompt).
    Raises :class:`InvalidArgument` (a ValueError) unless ``tokens`` is a sequence or
    1-D array of integer token ids, ``block_tokens`` a positive int, ``extra`` bytes
    and ``parent`` 16 bytes.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int | np.integer):
        raise InvalidArgument(f"block_tokens must be an int, got {type(block_tokens).__name__}")
    if block_tokens <= 0:
        raise InvalidArgument("block_tokens must be positive")
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise InvalidArgument(
            f"tokens must be integer token ids, got {type(tokens).__name__}: "
            "tokenize the text first"
        )
    if not isinstance(extra, bytes) or not isinstance(parent, bytes) or len(parent) != 16:
        raise InvalidArgument("extra must be bytes and parent 16 bytes")
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"tokens must be integer token ids: {e}") from e
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(
            f"tokens must be a flat sequence of integer token ids, got dtype {arr.dtype} "
            f"and shape {arr.shape}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        data = arr.astype("<i8").tobytes()
        width = 8
    else:
        data = arr.astype("<u4").tobytes()
        width = 4
    step = block_tokens * width
    out: list[bytes] = []
    h = parent
    for i in range(len(arr) // block_tokens):
        h = xxhash.xxh3_128_digest(h + data[i * step : (i + 1) * step] + extra)
        out.append(h)
    return out


def key_of(data: bytes | bytearray | memoryview | str) -> bytes:
    """The 16-byte key (xxh3-128 digest) of ``data``: a str is hashed as UTF-8.

    Keys are 16-byte hashes; use this to store values under your own names
    (``c.batch_put(ns, [key_of("doc-1")], [value])``). Token blocks of a prompt take
    :func:`block_hashes` instead, whose keys chain the prefix. Raises
    :class:`InvalidArgument` for anything else.
    """
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"key_of takes bytes or str, got {type(data).__name__}")
    return xxhash.xxh3_128_digest(data)
