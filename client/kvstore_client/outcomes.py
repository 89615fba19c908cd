"""What a put did with each block: :class:`PutOutcome`, one per block, from the status
byte its primary owner answered (``wire.PUT_*``), or :attr:`PutOutcome.UNREACHABLE`
when that owner gave no answer. ``Client.put_outcomes`` returns them;
``Client.batch_put`` keeps its booleans (True = :attr:`~PutOutcome.STORED`) and raises
for a full store."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from . import wire
from .errors import QuotaExceeded, ResourceExhausted


class PutOutcome(enum.Enum):
    """One block's put. :attr:`in_store`: the store holds it afterwards; :attr:`refused`:
    its owner answered but did not take it (:attr:`why` says why)."""

    STORED = "stored"  # written now, by its primary owner
    PRESENT = "already present"  # the owner held it already: nothing sent twice
    FULL = "refused: the worker had no room"
    QUOTA = "refused: over its namespace's quota"
    CORRUPT = "refused: its bytes did not match their checksum"
    TOO_LARGE = "refused: above the worker's max value size"
    DECLINED = "refused: its session holds its share of the worker"
    UNREACHABLE = "its owner did not answer"

    @property
    def in_store(self) -> bool:
        return self in (PutOutcome.STORED, PutOutcome.PRESENT)

    @property
    def refused(self) -> bool:
        return self not in (PutOutcome.STORED, PutOutcome.PRESENT, PutOutcome.UNREACHABLE)

    @property
    def why(self) -> str:
        """In words: what happened to the block."""
        return str(self.value)

    @classmethod
    def of_status(cls, status: int) -> PutOutcome:
        """The outcome a worker's ``wire.PUT_*`` status byte means (an unknown byte
        is taken as a refusal without room)."""
        return _BY_STATUS.get(status, cls.FULL)


_BY_STATUS = {
    wire.PUT_STORED: PutOutcome.STORED,
    wire.PUT_PRESENT: PutOutcome.PRESENT,
    wire.PUT_FULL: PutOutcome.FULL,
    wire.PUT_CORRUPT: PutOutcome.CORRUPT,
    wire.PUT_TOO_LARGE: PutOutcome.TOO_LARGE,
    wire.PUT_QUOTA: PutOutcome.QUOTA,
    wire.PUT_DECLINED: PutOutcome.DECLINED,
}


def room_error(statuses: bytes | Sequence[int]) -> QuotaExceeded | ResourceExhausted | None:
    """The error :meth:`~kvstore_client.client.Client.batch_put` raises for one owner's
    answer: over a quota, or without room; None when neither."""
    if wire.PUT_QUOTA in statuses:
        return QuotaExceeded("some blocks are over their namespace's quota")
    if wire.PUT_FULL in statuses:
        return ResourceExhausted("a worker had no room for some blocks")
    return None


def raise_for_room(outcomes: Sequence[PutOutcome]) -> None:
    """Raise what :meth:`~kvstore_client.client.Client.batch_put` raises when some
    blocks found no room (QuotaExceeded before ResourceExhausted)."""
    err = room_error(
        [wire.PUT_QUOTA if o is PutOutcome.QUOTA else wire.PUT_FULL if o is PutOutcome.FULL
         else wire.PUT_STORED for o in outcomes]
    )  # fmt: skip
    if err is not None:
        raise err


__all__ = ["PutOutcome", "raise_for_room", "room_error"]
