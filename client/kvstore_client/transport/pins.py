"""Leases on a same-host worker's arena: blocks pinned in place (the arena as a copy
source) and slots reserved to write into (a copy target). The leases are made by
:func:`kvstore_client.transport.shm.pin` and :func:`~kvstore_client.transport.shm.reserve`.

A GPU connector copies a hit straight from the arena slot into its KV cache by DMA
(the mapping registered with ``cudaHostRegister``), with no host copy. For that the
slot must stay put until the copy is done, so a pin is a lease. Through the worker's
same-host index (:mod:`.shmlocal`) a pin is hazard words in this client's page, with no
round trip; :meth:`ArenaPins.release` clears them. Blocks the index cannot answer go
the socket way: :func:`~.shm.pin` sends one GET_LOC on a connection it takes out of the
pool and the release sends the RELEASE on that same connection. Either way each
block's xxh3-64 is verified over the slot itself (a mismatch is a miss), the worker
never frees or reuses a pinned slot until the release, and a client that dies, or
closes its Client with a lease unreleased, gives back everything it held (its hazard
page and its connections go with it). Blocks the worker holds outside the arena (SSD
hits) come inline: their views are private copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class Mapped(Protocol):
    """A mapping of a worker's arena (:class:`~.shm.ShmArena`)."""

    @property
    def id(self) -> str: ...

    @property
    def view(self) -> memoryview: ...


@dataclass(slots=True)
class ArenaPins:
    """Per block, a view of its verified bytes (``None``: not pinned here, read it
    another way), held until :meth:`release` (idempotent, thread-safe). The views
    are only valid until then; never write through them. ``arenas``: the mappings
    the views point into (to register them for DMA once)."""

    views: list[memoryview | None]
    arenas: list[Mapped] = field(default_factory=list)
    _releases: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def count(self) -> int:
        return sum(v is not None for v in self.views)

    def release(self) -> None:
        with self._lock:
            todo, self._releases = self._releases, []
        for r in todo:
            r()

    def on_release(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at :meth:`release` too (with the lease's own releases)."""
        with self._lock:
            self._releases.append(fn)

    def adopt(self, other: ArenaPins, at: Sequence[int]) -> None:
        """Take over ``other``'s lease: its block ``j`` becomes this one's block
        ``at[j]``, its mappings join :attr:`arenas` (once each) and its release is
        this one's (``other`` then holds nothing)."""
        for j, i in enumerate(at):
            self.views[int(i)] = other.views[j]
        self.arenas += [a for a in other.arenas if all(a is not b for b in self.arenas)]
        todo = other.hand_over()
        with self._lock:
            self._releases += todo

    def hand_over(self) -> list[Callable[[], None]]:
        """Give up this lease's releases to the caller, who then owns them (the
        views stay valid until they run); a later :meth:`release` does nothing."""
        with self._lock:
            todo, self._releases = self._releases, []
        return todo

    def __enter__(self) -> ArenaPins:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class ArenaSlots:
    """Slots reserved in same-host workers' arenas for blocks to be written into
    them directly (a GPU's DMA). Per block: ``views[i]``, the slot to fill, or None
    (not reserved: ``present[i]`` when the store already holds it, else no room or
    not a same-host worker: write it another way). :meth:`commit` publishes the
    slots filled, with checksums taken over the slots then; until it (or
    :meth:`abort`), nobody can read them and the worker keeps them reserved.
    ``arenas``: the mappings the views point into (to register them for DMA)."""

    views: list[memoryview | None]
    present: list[bool]
    arenas: list[Mapped] = field(default_factory=list)
    _commits: list[tuple[list[int], Callable[[list[bool]], list[bool]]]] = field(
        default_factory=list
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def count(self) -> int:
        return sum(v is not None for v in self.views)

    def commit(self, written: Sequence[bool]) -> list[bool]:
        """Publish the reserved slots whose ``written[i]`` is True (the others are
        dropped); True per block stored now. Once only; later calls return Falses."""
        out = [False] * len(self.views)
        with self._lock:
            todo, self._commits = self._commits, []
        for idx, commit in todo:
            for i, ok in zip(idx, commit([bool(written[i]) for i in idx]), strict=True):
                out[i] = ok
        return out

    def abort(self) -> None:
        """Drop every reservation (nothing is published)."""
        self.commit([False] * len(self.views))

    def on_commit(self, idx: list[int], fn: Callable[[list[bool]], list[bool]]) -> None:
        """At :meth:`commit`, call ``fn`` with the written flags of blocks ``idx``; it
        returns per block of ``idx`` whether it is stored now."""
        with self._lock:
            self._commits.append((idx, fn))

    def adopt(self, other: ArenaSlots, at: Sequence[int]) -> None:
        """Take over ``other``'s reservations: its block ``j`` becomes this one's
        block ``at[j]``, its mappings join :attr:`arenas` and its commit is this
        one's (``other`` then holds nothing)."""
        ids = [int(i) for i in at]
        for j, i in enumerate(ids):
            self.views[i] = other.views[j]
            self.present[i] = other.present[j]
        self.arenas += other.arenas
        todo = other.hand_over()
        with self._lock:
            self._commits += [([ids[j] for j in sub], fn) for sub, fn in todo]

    def hand_over(self) -> list[tuple[list[int], Callable[[list[bool]], list[bool]]]]:
        """Give up this lease's commits to the caller, who then owns them; a later
        :meth:`commit` publishes nothing."""
        with self._lock:
            todo, self._commits = self._commits, []
        return todo


class Remote:
    """What a transport to a worker on another host says about the local path: its
    calls wait on the network, and nothing can be pinned or reserved in this
    process's memory. tcp:// and ucx:// transfers derive from it; shm:// overrides."""

    @property
    def local(self) -> bool:
        """False: calls wait on the network (run them on the client's pool)."""
        return False

    @property
    def same_host(self) -> bool:
        """False: the worker's arena is not mapped in this process."""
        return False

    @property
    def control(self) -> Any:
        """None: this transfer's own calls carry its lookups (see
        :attr:`kvstore_client.transport.Transfer.control`)."""
        return None

    def present(
        self, ns: bytes, packed: bytes, anyway: bool = False
    ) -> npt.NDArray[np.bool_] | None:
        """None: only the worker can tell."""
        return None

    @property
    def wants_lookups(self) -> bool:
        """False: every lookup goes to the worker anyway."""
        return False

    def prefix(self, ns: bytes, packed: bytes) -> int | None:
        """None: only the worker can tell."""
        return None

    def pin(self, timeout: float, ns: bytes, hashes: Sequence[bytes]) -> ArenaPins | None:
        """None: the worker's blocks are not in this process's memory."""
        return None

    def reserve(
        self,
        timeout: float,
        ns: bytes,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        flags: int = 0,
    ) -> ArenaSlots | None:
        """None: the worker has no slots in this process's memory."""
        return None
