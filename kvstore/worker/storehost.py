"""What the store's streams see of it: :class:`StoreHost`.

Long work runs as a stream of stimuli, each one bounded, with the store's lock released
between them: the SSD writes (:mod:`.ssdwrites`), a session hint and a prefetch
(:mod:`.session_ops`), a namespace removal (:mod:`.removal`), and the executor that
carries out the tier state's instructions (:mod:`.executor`). They see the store
through this protocol, which :class:`~kvstore.worker.store.BlockStore` is
structurally, so none of them imports the store (no import circle) and none takes its
lock or reaches into its private members: :meth:`StoreHost.apply` is the one door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from .tiers.blocks import Block, Held
from .tiers.policy import Event
from .tiers.ssd import SsdStore
from .tiers.stimuli import Stimulus

R = TypeVar("R")


class StoreHost(Protocol):
    """The store as its streams use it (see the module docstring)."""

    ssd: SsdStore | None
    slice_keys: int  # keys per slice of the data path (lookups take LOOKUP_SLICES of them)

    @property
    def session_share(self) -> int:
        """Bytes one hinted session may hold (0: no limit); fixed for the store's life."""
        ...

    def apply(self, stim: Stimulus[R]) -> R:
        """Hand the tier state one stimulus under the store's lock; its reply. Its
        instructions are queued for :meth:`execute` (KV events published at once)."""
        ...

    def tell(self, ev: Event) -> None:
        """:meth:`apply` for one of the tier policy's own events (no reply)."""
        ...

    def execute(self) -> None:
        """Carry out the queued instructions (off the lock; any thread may)."""
        ...

    def execute_deletes(self) -> None:
        """Carry out only the queued SSD deletes (a writer making room)."""
        ...

    def walk_cuts(self) -> None:
        """Walk the recorded chain cuts, a slice per hold of the lock."""
        ...

    def stopping(self) -> bool:
        """The store is closing: background work stops."""
        ...

    def expire_due(self, now: float) -> None:
        """Expire sessions now if they are due and no demoter thread does it."""
        ...

    def view(self, b: Block) -> memoryview:
        """The arena bytes of a reserved or pinned block."""
        ...

    def remove(self, ns: str, keys: Sequence[bytes]) -> int: ...

    def match_prefix(self, ns: str, keys: Sequence[bytes], state_ns: str = "") -> int: ...

    def promote(self, ns: str, key: bytes, h: Held, prefetched: bool = False) -> bool:
        """Copy an SSD block's verified bytes (``h``, a live view) into DRAM."""
        ...

    def bad_ssd(self, ns: str, key: bytes) -> None:
        """An SSD entry failed its check: drop it and count an error."""
        ...
