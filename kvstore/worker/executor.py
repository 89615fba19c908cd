"""The thin executor: carries out the tier state's instructions after the store's lock
is released.

The store hands :meth:`Executor.queue` what each stimulus returned while it still holds
its lock: KV events go to the sink there (their order is the order of the changes),
everything else waits in the executor's own queue (guarded by its own small mutex, not
the store's lock) until a thread calls :meth:`Executor.run`: any thread may, and the
store's calls do where they used to run their SSD work. What it does: LMDB deletes,
writing the staged copies of evicted blocks (:mod:`.ssdwrites`), dropping dead chain
tails (the store's :meth:`remove`, in slices), walking chain cuts (one thread at a
time), waking the demoter, and keeping prefetches for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from . import ssdwrites
from .events import EventSink
from .storehost import StoreHost
from .storerecords import LOOKUP_SLICES
from .tiers.policy import DeleteSsd, Demote, Drop, Prefetch
from .tiers.stimuli import CutStep, Key, Publish, Todo, WalkCuts, WriteStaged


class Executor:
    """Runs :data:`~kvstore.worker.tiers.stimuli.Todo` instructions for one store."""

    def __init__(self, host: StoreHost, sink: EventSink | None, wake: Callable[[], None]) -> None:
        self._host = host
        self._sink = sink
        self._wake = wake  # the demoter thread has work
        self._mutex = threading.Lock()  # guards the queue below (never the store lock)
        self._deletes: list[Key] = []
        self._write_staged = False
        self._drops: list[tuple[str, tuple[bytes, ...]]] = []
        self._prefetch: list[tuple[str, tuple[bytes, ...]]] = []
        self._walk = False
        self._walker = threading.Lock()  # one thread walks chain cuts at a time

    def publish_to(self, sink: EventSink | None) -> None:
        """KV events go to ``sink`` from now on (None: nowhere)."""
        with self._mutex:
            self._sink = sink

    def queue(self, todo: Sequence[Todo]) -> None:
        """Take what one stimulus returned (the store calls this under its lock)."""
        with self._mutex:
            for ins in todo:
                if isinstance(ins, Publish):
                    if self._sink is not None:
                        self._sink.add(ins.stored, ins.medium, ins.items)
                elif isinstance(ins, DeleteSsd):
                    self._deletes.extend(ins.keys)
                elif isinstance(ins, WriteStaged):
                    self._write_staged = True
                elif isinstance(ins, Drop):
                    self._drops.append((ins.ns, ins.keys))
                elif isinstance(ins, Prefetch):
                    self._prefetch.append((ins.ns, ins.keys))
                    self._wake()
                elif isinstance(ins, Demote):
                    self._wake()
                elif isinstance(ins, WalkCuts):
                    self._walk = True

    def run(self) -> None:
        """Carry out what is queued (off the store's lock)."""
        with self._mutex:
            deletes, self._deletes = self._deletes, []
            write, self._write_staged = self._write_staged, False
            drops, self._drops = self._drops, []
            walk, self._walk = self._walk, False
        host = self._host
        if deletes and host.ssd is not None:
            host.ssd.delete_many(deletes)
        if write:
            ssdwrites.write_staged(host)
        for ns, keys in drops:
            host.remove(ns, keys)
        if walk:  # chains cut by blocks lost meanwhile
            self.walk_cuts()

    def run_deletes(self) -> None:
        """Carry out only the queued SSD deletes (a writer making room)."""
        with self._mutex:
            deletes, self._deletes = self._deletes, []
        if deletes and self._host.ssd is not None:
            self._host.ssd.delete_many(deletes)

    def take_prefetch(self) -> list[tuple[str, tuple[bytes, ...]]]:
        """The prefetches queued so far (the demoter thread copies them)."""
        with self._mutex:
            todo, self._prefetch = self._prefetch, []
        return todo

    def walk_cuts(self) -> None:
        """Walk the recorded chain cuts (SessionTable.cut_step), ``slice_keys *
        LOOKUP_SLICES`` keys per hold of the store lock, and drop the dead blocks they
        find (outside it). The store runs it after any instructions it executes (a cut
        is recorded where a block is lost: an eviction, an SSD eviction), a hint after
        the notices it carries; one thread walks at a time (another returns at once:
        the walking one goes on until no cut is left)."""
        if not self._walker.acquire(blocking=False):
            return
        try:
            host = self._host
            step = host.slice_keys * LOOKUP_SLICES
            while host.apply(CutStep(step)):
                host.execute()
        finally:
            self._walker.release()
