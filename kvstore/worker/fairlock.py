"""A first-come, first-served lock for the store.

``threading.Lock`` lets a thread that releases the lock take it straight back
(barging): a request that walks 65,536 keys in slices, releasing the lock between
them, re-takes it before a waiting thread is even scheduled, so slicing alone did not
let another client's 1-key lookup in (p99 of hundreds of milliseconds). This lock
hands itself to the longest waiter on release; uncontended it costs two
``threading.Lock`` operations.
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType


class FairLock:
    """A non-reentrant mutex granted in arrival order (a handoff to the next waiter)."""

    __slots__ = ("_held", "_mutex", "_waiters")

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards _held and _waiters
        self._held = False
        self._waiters: deque[threading.Lock] = deque()

    def acquire(self) -> bool:
        with self._mutex:
            if not self._held:
                self._held = True
                return True
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append(gate)
        gate.acquire()  # released by the holder's release(): the lock is ours now
        return True

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # still held: handed over
            else:
                self._held = False

    def locked(self) -> bool:
        return self._held

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
