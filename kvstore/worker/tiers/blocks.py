"""The handles the DRAM tier gives out (:class:`Block`) and its counters; a block being
read (:class:`Held`), an evicted block on its way to SSD (:class:`Staged`) and the tier
state's counters. A handle reads the slot state it names from the tier's slot index, so
it needs no more of the tier than :class:`~kvstore.worker.tiers.slots.SlotIndex`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .slots import DOOMED, READY, SlotIndex


@dataclass(slots=True, eq=False)
class Block:
    """A handle onto one stored block, made by reserve / acquire / peek / oldest.

    ns, key, offset, size, checksum and slot_size never change for the life of the
    block; ready, doomed and pins read the tier's current state. A handle outlives
    its block harmlessly: once the slot is freed (and maybe reused) the handle reads
    as neither ready nor doomed, and commit / abort / release / pin ignore it.
    Two handles are equal when they name the same slot generation.
    """

    ns: str
    key: bytes
    offset: int
    size: int
    checksum: int
    slot_size: int  # bytes of the size class the block occupies
    slot: int = field(repr=False)
    gen: int = field(repr=False)
    tier: SlotIndex = field(repr=False)

    @property
    def live(self) -> bool:
        """The slot still holds this block (pending, ready or doomed)."""
        return self.tier.gen[self.slot] == self.gen

    @property
    def ready(self) -> bool:
        t = self.tier
        return t.gen[self.slot] == self.gen and t.state[self.slot] == READY

    @property
    def doomed(self) -> bool:
        """Removed or evicted while pinned: the slot is freed on the last release."""
        t = self.tier
        return t.gen[self.slot] == self.gen and t.state[self.slot] == DOOMED

    @property
    def pins(self) -> int:
        t = self.tier
        return t.pins[self.slot] if t.gen[self.slot] == self.gen else 0

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Block)
            and other.slot == self.slot
            and other.gen == self.gen
            and other.tier is self.tier
        )

    def __hash__(self) -> int:
        return hash((self.slot, self.gen))


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    skipped: int = 0
    evictions: int = 0
    slab_moves: int = 0
    removed: int = 0


@dataclass(slots=True)
class Held:
    """A block being read: its bytes (zero-copy view) and stored checksum."""

    view: memoryview
    checksum: int
    block: Block | None  # the pinned DRAM block, or None when served from SSD / staged


@dataclass(slots=True)
class Staged:
    """An evicted block's bytes on their way to SSD (readable meanwhile)."""

    data: bytes
    checksum: int
    writing: bool = False


@dataclass(slots=True)
class StoreCounters:
    """The tier state's own counters (the DRAM tier's are :class:`TierCounters`)."""

    checksum_errors: int = 0
    bad_frames: int = 0
    demotions: int = 0
    promotions: int = 0
    ssd_hits: int = 0
    prefetched: int = 0  # blocks copied SSD -> DRAM for a resumed session
    inbox_mismatches: int = 0  # same-host writers' blocks whose bytes failed the check
