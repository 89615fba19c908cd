"""The longest hold of the store lock while a session's own client cuts its long chain
in a loop (issue 41, finding 8): ``python -m tests.perf.cut_holds [--keys 262144]
[--loops 8]``.

It measures a worker internal (``kvstore.worker.store.BlockStore``'s lock) directly, so
it lives with the tests rather than in the benchmarks, which use only the public API
(``kvstore bench contention --only cuts`` measures what another client's lookup sees).

A BlockStore (no SSD) holds one session of ``--keys`` hashes (hinted 65,536 at a time,
with their depths); then, ``--loops`` times, a new turn (an ``active`` hint) and a hint
of another session carrying a cut notice at depth 0 from the same client: each cut
walks the whole chain. Every hold of the store lock is timed in thread CPU time (the
machine may be shared: wall time would count preemption), and the longest ones are
printed with where they were taken. Works against code without client identities too
(the old code: the cut ran in one hold).
"""

from __future__ import annotations

import argparse
import inspect
import time
import traceback
from types import TracebackType

from kvstore.worker.arena import Arena
from kvstore.worker.fairlock import FairLock
from kvstore.worker.sessions import SessionTable
from kvstore.worker.store import BlockStore

ME = b"\x01" * 16


class TimedLock(FairLock):
    """A FairLock that records each hold's thread CPU time and where it was taken."""

    __slots__ = ("holds", "t0")

    def __init__(self) -> None:
        super().__init__()
        self.holds: list[tuple[float, str]] = []
        self.t0 = 0.0

    def __enter__(self) -> bool:
        got = self.acquire()
        self.t0 = time.thread_time()
        return got

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dt = time.thread_time() - self.t0
        if dt > 0.0005:
            # The `with` line; the store's one door (BlockStore.apply) names its caller.
            stack = traceback.extract_stack(limit=4)[:-1]
            outside = [f for f in stack if not f.filename.endswith("worker/store.py")]
            where = (outside or stack)[-1] if stack[-1].name in ("apply", "tell") else stack[-1]
            self.holds.append((dt, f"{where.filename}:{where.lineno} {where.name}"))
        self.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=262144)
    ap.add_argument("--loops", type=int, default=8)
    args = ap.parse_args()
    n = args.keys
    arena = Arena(64 << 20)
    st = BlockStore(arena, 64 << 10, sessions=SessionTable(move_slice=2048), retain_budget=0)
    params = inspect.signature(st.session_hint).parameters
    kw = {"client": ME} if "client" in params else {}  # the old code knows no identities
    lock = TimedLock()
    st.lock = lock
    try:
        chain = [i.to_bytes(16, "little") for i in range(n)]
        for i in range(0, n, 65536):
            part = chain[i : i + 65536]
            st.session_hint("ns", "long", "active", part, None, range(i, i + len(part)), **kw)
        st.session_hint("ns", "long", "paused", [], None, **kw)
        lock.holds.clear()
        t0 = time.perf_counter()
        for turn in range(n // 65536 + 1, n // 65536 + 1 + args.loops):
            st.session_hint("ns", "long", "active", [], None, **kw)
            st.session_hint("ns", "other", "active", [], None, (), [("long", 0, turn)], **kw)
        took = time.perf_counter() - t0
    finally:
        st.close()
        arena.close()
    holds = sorted(lock.holds, reverse=True)
    print(f"{args.loops} turns + cuts of a {n}-key chain: {took:.2f} s wall")
    print(f"holds over 0.5 ms CPU: {len(holds)}; the longest (ms CPU, where):")
    for dt, where in holds[:5]:
        print(f"  {dt * 1e3:8.2f}  {where}")


if __name__ == "__main__":
    main()
