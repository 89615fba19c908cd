"""`kvstore bench engine --saturate`: enough sessions in flight that no engine idles.

On the traces' clock the engines sit idle between requests, and input tokens per second
measure the arrival rate, not the work a cache saves. Saturated, sessions start when
there is room, not at their trace start time: :class:`Admission` keeps ``target``
sessions *busy* (a request sent or about to be sent), starting the next waiting session
whenever one goes idle: its turn came back and it pauses (the agent's tool call) or it
ended. A session's own turns stay in order with their pauses between them; other
sessions fill those pauses. Sub-agents start right after the parent turn they fork
from (their trace start time is ignored) and count as busy while their turns run.

Admission alone cannot fill a pause when every session has started (agentic traces
start all their sessions at 0): :class:`PauseClock` then keeps pauses on a clock of their
own that jumps ahead whenever fewer than ``floor`` sessions are busy (an engine would
idle) and none is due: the pause that ends first ends now. Pauses stay in order, across
sessions and within each; only the idle time between them goes.

Pure: no threads, no clock (the caller passes the wall time). The caller
(:func:`kvstore_bench.engine.run.run_config`) holds a lock around every call and starts
a thread for each script :meth:`admit` returns; the pause clock's floor is the number
of engines. Throughput is then prompt tokens per second of wall time, per configuration.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .workload import Script

__all__ = ["DEFAULT_IN_FLIGHT", "Admission", "PauseClock", "goes_idle"]

# sessions busy per engine: one in the engine's step, one more waiting in its queue so
# the engine never waits for the bench to send the next, one spare while an answer is
# being handed back
DEFAULT_IN_FLIGHT = 3


def goes_idle(script: Script, index: int) -> bool:
    """Whether ``script`` frees its place after its turn ``index``: it ended, or a pause
    comes before its next turn."""
    nxt = index + 1
    return nxt >= len(script.turns) or script.turns[nxt].pause_s > 0


class Admission:
    """Which top-level scripts start when, keeping ``target`` sessions busy.

    - :meth:`admit`: the scripts to start now (each counts as busy from then on);
    - :meth:`turn_done`: a script's turn came back; it frees its place when it pauses
      or ended (``idle``), and keeps it when its next turn follows at once;
    - :meth:`turn_ready`: a script that had freed its place is about to send its next
      turn (its pause is over), or a sub-agent starts.
    """

    def __init__(self, scripts: Sequence[Script], target: int) -> None:
        if target < 1:
            raise ValueError(f"want at least one session in flight, got {target}")
        self.target = target
        self.pending: deque[Script] = deque(
            sorted((s for s in scripts if s.parent is None), key=lambda s: s.start_s)
        )
        self.busy = 0

    def admit(self) -> list[Script]:
        out: list[Script] = []
        while self.pending and self.busy < self.target:
            out.append(self.pending.popleft())
            self.busy += 1
        return out

    def turn_done(self, idle: bool = True) -> None:
        if idle:
            self.busy = max(0, self.busy - 1)

    def turn_ready(self) -> None:
        self.busy += 1

    @property
    def waiting(self) -> int:
        """Top-level scripts not started yet."""
        return len(self.pending)


class PauseClock:
    """Pauses on a virtual clock = wall time + the idle time skipped so far.

    :meth:`pause` starts a session's pause; :meth:`due` says whether it is over;
    :meth:`skip` jumps the clock to the earliest end of a pause when fewer than
    ``floor`` sessions are busy and no pause is due, and returns the seconds skipped.
    """

    def __init__(self, floor: int) -> None:
        self.floor = max(1, floor)
        self.offset = 0.0
        self.wakes: dict[str, float] = {}

    def now(self, wall: float) -> float:
        return wall + self.offset

    def pause(self, sid: str, wall: float, seconds: float) -> None:
        self.wakes[sid] = self.now(wall) + max(0.0, seconds)

    def due(self, sid: str, wall: float) -> bool:
        wake = self.wakes.get(sid)
        return wake is None or self.now(wall) >= wake

    def resume(self, sid: str) -> None:
        self.wakes.pop(sid, None)

    def skip(self, wall: float, busy: int) -> float:
        if busy >= self.floor or not self.wakes:
            return 0.0
        gap = min(self.wakes.values()) - self.now(wall)
        if gap <= 0:
            return 0.0
        self.offset += gap
        return gap
