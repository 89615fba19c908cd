"""The worker side's bookkeeping records (:mod:`.worker`): the mover path's rows, a
load in flight and what it got, and one step's saves."""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]

from .. import blockcopy as bc
from .common import Transfer


@dataclass(slots=True)
class Rows:
    """Rows allocated once for the mover path: host rows (pinned where CUDA is
    present) with a byte view per row, and on CUDA as many device rows."""

    host: Any
    views: list[memoryview]
    dev: Any = None

    @property
    def cap(self) -> int:
        return int(self.host.shape[0])


def make_rows(cap: int, width: int, device: Any, on_device: bool) -> Rows:
    host = bc.pinned_rows(cap, width, pin=on_device)  # a CPU cache never touches CUDA
    views = [memoryview(host[i].numpy()) for i in range(cap)]
    dev = torch.empty((cap, width), dtype=torch.uint8, device=device) if on_device else None
    return Rows(host, views, dev)


@dataclass(slots=True)
class Loaded:
    """What a mover-path load job got: KV flags, state flags (None: no state),
    and the ticket of its last copy into the cache."""

    flags: list[bool]
    state: list[bool] | None
    ticket: bc.Ticket


@dataclass
class PendingLoad:
    transfer: Transfer
    nbytes: int
    started: float
    future: cf.Future[list[bool]] | None = None  # zero copy: the client's read
    state_future: cf.Future[list[bool]] | None = None
    job: cf.Future[Loaded] | None = None  # mover path: the loader's job
    landed: float = 0.0  # when its last read (or the loader's job) completed

    def stamp(self, _: object) -> None:
        """A done callback of its futures: the load's time is up to its last one, not
        up to the step that notices (which made every asynchronous load look a step
        long, and ``load_mode: auto`` then chose asynchronous loads only)."""
        self.landed = max(self.landed, time.perf_counter())

    def done(self) -> bool:
        if self.job is not None:
            return self.job.done() and (self.job.exception() is not None
                                        or self.job.result().ticket.done())  # fmt: skip
        assert self.future is not None
        return self.future.done() and (self.state_future is None or self.state_future.done())


@dataclass
class StepSave:
    """One step's saves: the rows (request, index, hash), the block ids per group,
    and (CUDA) the event marking the end of the step's forward on its stream."""

    refs: list[tuple[str, int, bytes]]  # (req_id, index, hash), row order
    ids: list[list[int]]  # per attention group, the block ids of the rows
    state_refs: list[tuple[str, int, bytes]]
    state_ids: list[list[int]]
    nbytes: int
    ready: Any = None
    gathered: Any = None  # CUDA: the KV blocks, gathered into device rows at the step
    state_gathered: Any = None

    def requests(self) -> list[str]:
        return [r for r, _, _ in self.refs] + [r for r, _, _ in self.state_refs]
