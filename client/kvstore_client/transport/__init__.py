"""Client halves of the transfer plane, behind one :class:`Transfer` protocol.

Each worker link holds one Transfer. The implementations are registered by URL scheme
(:mod:`.registry`): tcp:// (:class:`~.tcp.TcpTransfer`), shm:// (:class:`~.shm.ShmTransfer`,
same host) and ucx:// (:class:`~.ucx.UcxPool`); :class:`kvstore_client.routing.Links`
asks the registry which to open for a worker and which carries its calls, and the
client asks the Transfer (:attr:`~Transfer.local`, :attr:`~Transfer.control`, ...),
never which class it is. Every get lands and verifies its hits through
:class:`kvstore_client.verified.Landing`.
Every method takes a deadline (``timeout`` seconds) and is thread-safe; worker
trouble raises a :class:`~kvstore_client.errors.PeerError` (the client turns it into
misses), the caller's own mistakes a :class:`~kvstore_client.errors.CallerError`.
Lower-level socket and UCX errors are translated in one place:
:func:`kvstore_client.errors.from_transport_error`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .. import wire
from ..verified import GetResult
from .pins import ArenaPins, ArenaSlots
from .registry import Credentials, Opened, Scheme, register, scheme, schemes
from .tcp import TcpPool

BlockView = memoryview | list[memoryview]  # a destination: one view, or its parts


class Transfer(Protocol):
    """Batched block calls to one worker, each within ``timeout`` seconds."""

    @property
    def local(self) -> bool:
        """True when a read is copies on the calling thread with no wait on the
        network (a same-host worker's mapped arena): callers need not hand it to a
        pool."""
        ...

    @property
    def same_host(self) -> bool:
        """True when the worker shares this host and its arena is mapped here (even
        once stale): reads of replicated blocks prefer it."""
        ...

    @property
    def control(self) -> TcpPool | None:
        """The worker's tcp:// pool when lookups (EXISTS, prefix runs) may go over it,
        so one thread sends every worker its request before reading any answer; None
        when this transfer's own calls must carry them (ucx://: the client asked that
        the worker's traffic go over UCX)."""
        ...

    def put(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        values: Sequence[wire.Block],
        checksums: Sequence[int],
        flags: int = 0,
    ) -> bytes:
        """Store blocks that are absent (a block may be a list of parts, sent as one
        value); one ``wire.PUT_*`` status byte per block. ``flags``: wire.FLAG_SESSION
        when the caller sends session hints (its session's share applies).
        ``checksums``: each block's xxh3-64; a :attr:`local` transfer takes them over
        the bytes it copies and ignores these (callers pass zeros)."""
        ...

    def get(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        buffers: Sequence[BlockView] | None,
    ) -> GetResult:
        """Read blocks, into ``buffers`` when given (a block whose stored size differs
        from its buffer's, or whose checksum fails, is a miss)."""
        ...

    def exists(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> list[bool]:
        """Per hash, whether the worker holds it."""
        ...

    def where(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> npt.NDArray[np.uint8]:
        """Per hash a ``wire.WHERE_*`` code: in the worker's DRAM, only on its SSD,
        absent, or WHERE_UNKNOWN for a hit of a worker that predates wire.FLAG_WHERE
        (:mod:`.where`)."""
        ...

    def remove(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> int:
        """Remove blocks; how many were present."""
        ...

    def present(
        self, ns: bytes, packed: bytes, anyway: bool = False
    ) -> npt.NDArray[np.bool_] | None:
        """Per key (16 bytes each in ``packed``), whether the worker holds it, when
        this process can tell without asking (a same-host worker's shared index);
        None otherwise. While the worker wants to see lookups (:attr:`wants_lookups`)
        it answers only ``anyway``, and the caller then sends the worker the lookup."""
        ...

    @property
    def wants_lookups(self) -> bool:
        """True while the worker asks to see lookups (one may resume a paused session
        there), even those its shared index could answer."""
        ...

    def prefix(self, ns: bytes, packed: bytes) -> int | None:
        """How many of the keys (16 bytes each in ``packed``) lead as present, when
        this process can tell without asking the worker (a same-host worker's shared
        index); None otherwise."""
        ...

    def pin(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> ArenaPins | None:
        """Pin blocks in place in a same-host worker's arena (a lease, see
        :mod:`.pins`); None when this transport cannot (not same-host)."""
        ...

    def reserve(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        flags: int = 0,
    ) -> ArenaSlots | None:
        """Reserve slots in a same-host worker's arena to write blocks into directly,
        published by their commit (see :mod:`.pins`); None when this transport
        cannot (not same-host)."""
        ...


__all__ = [
    "ArenaPins",
    "ArenaSlots",
    "BlockView",
    "Credentials",
    "GetResult",
    "Opened",
    "Scheme",
    "Transfer",
    "register",
    "scheme",
    "schemes",
]
