"""The interface every peer implements (:class:`Backend`) and what to start."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["Backend", "ClusterSpec", "leading"]


class Backend(Protocol):
    """A KV-cache store as the benchmarks see it. Keys are 16-byte hashes.

    All calls are blocking and safe to call from several threads at once. A store that
    is full or unreachable turns its keys into misses or failed puts, never exceptions.
    """

    name: str
    description: str
    pids: list[int]
    """Server processes started for this backend (empty for an existing cluster)."""

    def exists(self, keys: list[bytes]) -> list[bool]:
        """Which keys are present, in one batched call."""
        ...

    def match_prefix(self, keys: list[bytes]) -> int:
        """Number of leading keys present."""
        ...

    def get_into(
        self, keys: list[bytes], buffers: Sequence[memoryview], parallel: bool = True
    ) -> list[bool]:
        """Read each value into its buffer (same size); True where it arrived whole.
        ``parallel=False`` reads from one server at a time (where there are several)."""
        ...

    def put(self, keys: list[bytes], values: Sequence[memoryview]) -> tuple[int, int]:
        """Store the values; returns (accepted, failed). Already present counts as
        accepted (for kvstore it is not counted at all: accepted = newly stored)."""
        ...

    def remove(self, keys: list[bytes]) -> None:
        """Drop the keys (absent ones are ignored)."""
        ...

    def register(self, buf: np.ndarray) -> None:
        """Announce a long-lived buffer that get_into / put will use (Mooncake registers
        it with its transfer engine; a no-op elsewhere)."""
        ...

    def unregister(self, buf: np.ndarray) -> None:
        """Undo :meth:`register` before ``buf`` is freed."""
        ...

    def capacity_blocks(self, block_bytes: int) -> int | None:
        """How many blocks of this size the store can hold, None when unknown."""
        ...

    def close(self) -> None:
        """Release connections (not the servers: :func:`open_backend` stops those)."""
        ...


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What to start: the same capacity for every backend.

    ``workers`` x ``dram_bytes`` is the total memory (kvstore workers, Mooncake
    segments, one Redis ``maxmemory``). ``max_value_bytes`` is kvstore's slab size (pick
    a small multiple of the block size). ``ssd_size`` (text, e.g. "4GiB"), when given,
    is passed to kvstore workers as ``--ssd-size`` with a per-worker ``--ssd-path``
    in a temporary directory. ``master`` uses a running kvstore cluster instead;
    ``transport`` is the kvstore client's (None: its default, "auto").
    ``mooncake_lease_ms`` is Mooncake's read lease (an object read within it cannot be
    evicted; a read that outlasts it fails). Mooncake defaults to 10 s, which at replay
    speed pins most of a small cache, so its puts fail; 2 s is enough for every read here.
    """

    workers: int = 2
    dram_bytes: int = 256 << 20
    max_value_bytes: int = 1 << 20
    ssd_size: str | None = None
    master: str | None = None
    timeout: float = 30.0
    mooncake_lease_ms: int = 2000
    transport: str | None = None


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n
