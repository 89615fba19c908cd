"""Per key its tier (EXISTS with ``wire.FLAG_WHERE``), and what a client does with a
worker that predates the flag.

Such a worker refuses the flag (INVALID_ARGUMENT, then it closes the connection). A
pool then asks it plain EXISTS for :data:`RETRY_WHERE` seconds and reports its hits
as ``wire.WHERE_UNKNOWN`` ("present, tier unknown"), then tries the flag once more
(a worker restarted behind the same address may know it by then). A refusal counts
as the worker's only when the plain EXISTS that follows is answered: a request the
worker refuses for another reason (a bad namespace, a batch over its limit) is
refused again and raised, and the pool keeps asking the flag.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from .. import wire
from ..errors import InvalidArgument

RETRY_WHERE = 60.0  # seconds a worker that refused FLAG_WHERE is asked plain EXISTS

Codes = npt.NDArray[np.uint8]


class WhereSupport:
    """Whether one worker is sent FLAG_WHERE (each pool holds one). Thread-safe: a
    float written whole."""

    def __init__(self) -> None:
        self.plain_until = 0.0  # monotonic time before which the worker gets plain EXISTS

    @property
    def asks(self) -> bool:
        """True unless the worker refused the flag less than RETRY_WHERE seconds ago."""
        return time.monotonic() >= self.plain_until

    def refused(self) -> None:
        """The worker refused FLAG_WHERE (and answered a plain EXISTS)."""
        self.plain_until = time.monotonic() + RETRY_WHERE


def unknown_tier(flags: Sequence[bool] | npt.NDArray[np.bool_]) -> Codes:
    """Codes for a plain EXISTS answer: WHERE_UNKNOWN for a hit, WHERE_ABSENT else."""
    out: Codes = np.asarray(flags, dtype=bool).astype(np.uint8) * np.uint8(wire.WHERE_UNKNOWN)
    return out


def where_or_exists(
    support: WhereSupport,
    ask_where: Callable[[], Codes],
    ask_exists: Callable[[], Sequence[bool] | npt.NDArray[np.bool_]],
) -> Codes:
    """``ask_where()`` (EXISTS with FLAG_WHERE) while the worker is asked the flag;
    ``ask_exists()`` (plain EXISTS, hits WHERE_UNKNOWN) otherwise, or after a
    refusal (see the module's docstring)."""
    if support.asks:
        try:
            return ask_where()
        except InvalidArgument:
            return after_refusal(support, ask_exists)
    return unknown_tier(ask_exists())


def after_refusal(
    support: WhereSupport, ask_exists: Callable[[], Sequence[bool] | npt.NDArray[np.bool_]]
) -> Codes:
    """The worker refused FLAG_WHERE: ``ask_exists()`` (plain EXISTS, hits
    WHERE_UNKNOWN); the refusal counts as the worker's once that is answered."""
    got = unknown_tier(ask_exists())
    support.refused()
    return got


# The best copy of a replicated key wins: DRAM, then a hit of unknown tier (it may be
# in DRAM), then SSD, then absent. Indexed by a WHERE_* code.
RANK = np.zeros(4, dtype=np.uint8)
RANK[[wire.WHERE_ABSENT, wire.WHERE_SSD, wire.WHERE_UNKNOWN, wire.WHERE_DRAM]] = [0, 1, 2, 3]


def merge(out: Codes, idx: npt.NDArray[np.intp], got: Codes) -> None:
    """Fold one owner's codes for the keys at ``idx`` into ``out``: the better copy
    stays (see :data:`RANK`)."""
    better = RANK[got] > RANK[out[idx]]
    out[idx[better]] = got[better]


__all__ = [
    "RANK",
    "RETRY_WHERE",
    "WhereSupport",
    "after_refusal",
    "merge",
    "unknown_tier",
    "where_or_exists",
]
