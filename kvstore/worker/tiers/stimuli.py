"""What crosses the boundary of the worker's tier state (:class:`~.state.TierState`).

Stimuli go in: each says what happened or what a caller asks (a put reserved, a copy
finished, a read, an SSD write done, a heartbeat tick, a hint slice, a removal slice);
its type parameter is the type of the reply the caller gets back. The tier policy's
own events (:mod:`.policy`: ``SessionHint``, ``Lookup``, ``SessionTick``,
``NeedSsdRoom``, ...) are stimuli too, with no reply.

Instructions come out: what the store must do about it (:data:`Todo`). ``Publish``
is appended to the KV-event sink while the store still holds its lock (the order of
events is the order of the changes); every other instruction is carried out by the
executor (:mod:`kvstore.worker.executor`) after the lock is released: LMDB writes and
deletes, drops, prefetches, cut walks.

Every stimulus is bounded by construction: a caller with a long list (a 65,536-key
batch, a 200,000-key hint, a namespace removal) sends a stream of them, one slice
each, and the store releases its lock between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvstore_client.errors import ResourceExhausted

from .blocks import Block, Held, Staged
from .policy import DeleteSsd, Demote, Drop, Prefetch

if TYPE_CHECKING:
    from .shared import ReapPlan, SharedIndex

R = TypeVar("R", covariant=True)

Key = tuple[str, bytes]


class Stimulus(Generic[R]):
    """A stimulus whose reply is of type ``R``."""

    __slots__ = ()


# ---- the data path -------------------------------------------------------------------


@dataclass(slots=True)
class Present(Stimulus[npt.NDArray[np.bool_]]):
    """exists: per key, is it held in DRAM, a staged copy or on SSD (no LRU change)."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class Where(Stimulus[npt.NDArray[np.uint8]]):
    """exists, tier-aware: per key a ``wire.WHERE_*`` code: WHERE_DRAM (ready in
    DRAM), WHERE_SSD (not in DRAM but on SSD or a staged copy on its way there),
    WHERE_ABSENT (no LRU change)."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class LeadingRun(Stimulus[int]):
    """match_prefix: how many leading keys are present (no LRU change)."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class Sizes(Stimulus[int]):
    """Payload bytes a read of ``keys`` would return (duplicates counted), pinning nothing."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class Reserve(Stimulus[list[Block | ResourceExhausted | None]]):
    """A put's first phase: per key a reserved Block, None (already present) or
    ResourceExhausted (QuotaExceeded; SessionShareFull only when ``hinted``)."""

    ns: str
    keys: Sequence[bytes]
    sizes: Sequence[int]
    checksums: Sequence[int]
    hinted: bool = False
    now: float | None = None  # the clock, for retained blocks asked to yield room


@dataclass(slots=True)
class Commit(Stimulus[list[bool]]):
    """A put's second phase for one slice: commit the blocks whose bytes arrived
    intact (``ok``), abort the others; ``checksums``: given only now (FLAG_LATE_SUM).
    Replies, per block, whether it was committed. Runs the slice last block first."""

    blocks: Sequence[Block]
    ok: Sequence[bool]
    checksums: Sequence[int] | None = None


@dataclass(slots=True)
class Pinned:
    """The reply to :class:`Pin`: per key what DRAM or a staged copy holds (None:
    neither), and the positions of the keys to look for on SSD."""

    held: list[Held | None]
    on_ssd: list[int]


@dataclass(slots=True)
class Pin(Stimulus[Pinned]):
    """A read: pin the DRAM blocks of ``keys`` (counted as hits and misses)."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class Unpin(Stimulus[None]):
    """A read is done with these DRAM blocks (release them, in this order)."""

    blocks: Sequence[Block]


@dataclass(slots=True)
class SsdFound(Stimulus[bool]):
    """A read found the key on SSD (counted as a hit); replies: promote it."""

    ns: str
    key: bytes
    now: float


@dataclass(slots=True)
class SsdCorrupt(Stimulus[None]):
    """An SSD entry failed its header or checksum check: drop it, count an error."""

    ns: str
    key: bytes


@dataclass(slots=True)
class Corrupt(Stimulus[None]):
    """A block a read held failed its checksum: a miss, dropped from its tier."""

    ns: str
    key: bytes
    held: Held


@dataclass(slots=True)
class PromoteReserve(Stimulus[Block | None]):
    """Reserve a DRAM slot to copy an SSD block into (None: not wanted or no room)."""

    ns: str
    key: bytes
    size: int
    checksum: int


@dataclass(slots=True)
class PromoteCommit(Stimulus[bool]):
    """The promoted bytes are in: commit if the block is still on SSD (a removal in
    between wins); ``prefetched``: a resumed session's prefetch."""

    block: Block
    prefetched: bool = False


@dataclass(slots=True)
class Remove(Stimulus[int]):
    """Remove keys from every tier; replies how many were present."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class InboxMismatches(Stimulus[None]):
    """Blocks a same-host writer sent whose bytes failed their checksum (not stored)."""

    n: int


@dataclass(slots=True)
class Publishing(Stimulus[None]):
    """KV events are wanted from now on (``on``), or no longer."""

    on: bool


@dataclass(slots=True)
class DramTick(Stimulus[int]):
    """A heartbeat tick: how many bytes of DRAM to demote now (0: none)."""


# ---- the same-host index -------------------------------------------------------------


@dataclass(slots=True)
class ShareIndex(Stimulus[None]):
    """Attach the same-host index (tiers.shared) to the DRAM tier, or detach it (None)."""

    index: SharedIndex | None


@dataclass(slots=True)
class ApplyReads(Stimulus[None]):
    """Reads same-host clients logged in the index (a slice of them)."""

    logged: Sequence[tuple[int, int]]


@dataclass(slots=True)
class HazardHeld(Stimulus[list[Any]]):
    """The blocks the DRAM tier holds for clients' hazard words (a copy)."""


@dataclass(slots=True)
class Reap(Stimulus[None]):
    """Free the held slots no live page names any more (a plan made off the lock)."""

    plan: ReapPlan


# ---- the SSD tier --------------------------------------------------------------------


@dataclass(slots=True)
class StageBatch(Stimulus[list[tuple[Key, Staged]]]):
    """The staged copies of evicted blocks not being written yet (marked as being written)."""


@dataclass(slots=True)
class StageWritten(Stimulus[None]):
    """A :class:`StageBatch` reached LMDB (``written``: (ns, key, size, stored) per
    block) or failed (None); ``booked``: what its NeedSsdRoom booked."""

    batch: Sequence[tuple[Key, Staged]]
    written: Sequence[tuple[str, bytes, int, int]] | None
    booked: int


@dataclass(slots=True)
class ForceSsdRoom(Stimulus[bool]):
    """LMDB said it is full: evict ``nbytes`` of SSD blocks whatever the watermarks
    say; replies whether anything was evicted."""

    nbytes: int


@dataclass(slots=True)
class DemoteBatch:
    """The reply to :class:`DemotePick`: the pinned blocks, those that are dead (an
    ended session's: evicted, not copied) and those to write to SSD."""

    blocks: list[Block]
    dead: set[int]
    todo: list[Block]


@dataclass(slots=True)
class DemotePick(Stimulus[DemoteBatch]):
    """Pick and pin up to ``nbytes`` of least recently used DRAM blocks to demote;
    ``everything``: blocks of pinned namespaces too (shutdown)."""

    nbytes: int
    everything: bool = False


@dataclass(slots=True)
class DemoteDone(Stimulus[int]):
    """A :class:`DemotePick` batch's SSD write is over (``written`` None: failed):
    unpin, drop the DRAM copies now on SSD; replies the bytes moved."""

    batch: DemoteBatch
    written: Sequence[tuple[str, bytes, int, int]] | None
    booked: int


@dataclass(slots=True)
class Rebuilt(Stimulus[None]):
    """Start-up: LMDB holds these blocks (ns, key, size, stored bytes); ``malformed``
    entries were dropped."""

    items: Sequence[tuple[str, bytes, int, int]]
    malformed: int = 0


@dataclass(slots=True)
class SsdKeys(Stimulus[list[Key]]):
    """Every key the SSD tier holds (a copy)."""


@dataclass(slots=True)
class PrefetchRoom(Stimulus[int]):
    """Bytes a prefetch may copy into DRAM without evicting (below the low watermark)."""


# ---- namespaces ----------------------------------------------------------------------


@dataclass(slots=True)
class DramNamespaces(Stimulus[list[str]]):
    """Namespaces holding DRAM blocks."""


@dataclass(slots=True)
class OffDramKeys(Stimulus[list[Key]]):
    """Every key on SSD or staged (a copy: the caller filters it off the lock)."""


@dataclass(slots=True)
class DramKeys(Stimulus[list[bytes]]):
    """Up to ``n`` keys of the namespace's DRAM blocks."""

    ns: str
    n: int


# ---- sessions ------------------------------------------------------------------------


@dataclass(slots=True)
class RecordCuts(Stimulus[None]):
    """Cut notices a client carried: (session, depth, turn) of namespace ``ns``."""

    ns: str
    cuts: Sequence[tuple[str, int, int]]
    client: bytes


@dataclass(slots=True)
class CutStep(Stimulus[bool]):
    """Walk up to ``n`` keys of the recorded chain cuts; replies False when none was left."""

    n: int


@dataclass(slots=True)
class Drain(Stimulus[bool]):
    """Give up up to ``n`` keys of sessions that left the table; False: none left."""

    n: int


@dataclass(slots=True)
class Advance(Stimulus[bool]):
    """Move up to ``n`` keys of the session's pending state change; False: none pending."""

    ns: str
    session: str
    n: int


@dataclass(slots=True)
class SessionOwner(Stimulus[bytes | None]):
    """The identity of the client whose session it is here (None: not in the table)."""

    ns: str
    session: str


@dataclass(slots=True)
class SessionKnown(Stimulus[bool]):
    """Is the session in the table?"""

    ns: str
    session: str


@dataclass(slots=True)
class Claim(Stimulus[str]):
    """May ``client``'s hint change the session? (SessionTable.claim; the verdict)."""

    ns: str
    session: str
    client: bytes
    shown: Mapping[bytes, int]
    whole: bool


@dataclass(slots=True)
class ChainOpen(Stimulus[Iterator[bytes] | None]):
    """A cursor over the session's chain (None: gone, ended or another client's)."""

    ns: str
    session: str
    client: bytes


@dataclass(slots=True)
class ChainNext(Stimulus[list[bytes] | None]):
    """Up to ``n`` more keys of a :class:`ChainOpen` cursor (None: the chain changed)."""

    cursor: Iterator[bytes]
    n: int


@dataclass(slots=True)
class ChainBytes(Stimulus[int]):
    """Bytes these blocks of a chain occupy in DRAM, else on SSD."""

    ns: str
    keys: Sequence[bytes]


@dataclass(slots=True)
class SetRoom(Stimulus[None]):
    """What a live session may still add within its share."""

    ns: str
    session: str
    room: int


@dataclass(slots=True)
class RecordHits(Stimulus[None]):
    """A lookup of the session's chain: ``hits`` leading blocks of ``lookups``."""

    ns: str
    session: str
    hits: int
    lookups: int


@dataclass(slots=True)
class TakeCuts(Stimulus[list[tuple[str, int, int]]]):
    """``client``'s cut notices of ``ns`` not taken yet: (session, depth, turn)."""

    ns: str
    client: bytes


@dataclass(slots=True)
class TakeClosedRates(Stimulus[list[float]]):
    """Hit ratios of sessions that left the table since the last call."""


@dataclass(slots=True)
class SessionInfo:
    ns: str
    name: str
    state: str
    blocks: int
    hit_blocks: int
    lookup_blocks: int
    expires_in: float


@dataclass(slots=True)
class SessionsView:
    """The reply to :class:`SessionsReport`: the busiest sessions and the counters."""

    sessions: list[SessionInfo]
    live: int
    dropped: int
    expired: int
    retained_bytes: int
    retain_budget: int
    prefetched: int
    blocks_refused: int
    cuts_refused: int
    hints_refused: int
    moved: int
    restarted: int


@dataclass(slots=True)
class SessionsReport(Stimulus[SessionsView]):
    """Up to ``limit`` sessions whose namespace ``owns`` accepts (None: any), those
    that asked about the most blocks first, at clock ``now``."""

    owns: Callable[[str], bool] | None
    limit: int
    now: float


# ---- instructions --------------------------------------------------------------------


@dataclass(slots=True)
class Publish:
    """KV events: these blocks were stored in (``stored``) or removed from ``medium``
    (appended to the sink under the store's lock, in order)."""

    stored: bool
    medium: str
    items: Sequence[Key]


@dataclass(slots=True)
class WriteStaged:
    """Staged copies of evicted blocks wait: write them to LMDB (off the lock)."""


@dataclass(slots=True)
class WalkCuts:
    """Recorded chain cuts wait: walk them (:class:`CutStep` a slice at a time)."""


Todo = Publish | DeleteSsd | WriteStaged | Demote | Prefetch | Drop | WalkCuts
