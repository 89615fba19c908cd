"""How long agents pause between turns, learnt from the pauses a worker saw.

Pure (no I/O, no clock: callers pass durations), owned by the session table
(:mod:`kvstore.worker.sessions`) and run under the store's lock.

A pause is the time from a session's ``paused`` hint to its return (an ``active``
hint, or a lookup that resumes it). :class:`PauseModel` keeps the last ``window``
pauses and answers :meth:`PauseModel.remaining`: how much longer a session that has
been paused ``elapsed`` seconds should still be away, the mean of ``T - elapsed``
over the seen pauses ``T`` longer than ``elapsed``.

Why it matters: when DRAM runs out, retained sessions give way, and the one to give
way first is the one whose next read is furthest away (Belady). With pauses of about
one length, that is the session that paused last. Agents' tool calls are not like
that: most are short and a few are long, so a session that has already been away for
a while is, as a rule, one of the long ones, and the session that paused a moment ago
is likely to be back first. The empirical distribution covers both cases.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque

__all__ = ["PauseModel"]


class PauseModel:
    """The last ``window`` pauses; :meth:`remaining` once ``min_samples`` were seen."""

    def __init__(self, window: int = 512, min_samples: int = 16) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        self.window = window
        self.min_samples = min_samples
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._suffix: list[float] | None = None  # sums of _sorted[i:], built lazily

    def __len__(self) -> int:
        return len(self._recent)

    @property
    def ready(self) -> bool:
        return len(self._recent) >= self.min_samples

    def observe(self, seconds: float) -> None:
        """A session came back after ``seconds`` (negative values count as 0)."""
        x = float(seconds)
        if x != x:  # NaN
            return
        x = max(0.0, x)
        self._recent.append(x)
        insort(self._sorted, x)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect_right(self._sorted, old) - 1]
        self._suffix = None

    def remaining(self, elapsed: float) -> float:
        """Expected further pause of a session paused ``elapsed`` seconds ago: the mean
        of ``T - elapsed`` over seen pauses ``T > elapsed``. Past every seen pause it
        is ``elapsed`` itself (a session away longer than any other is, as a rule, one
        that is not coming back soon). Callers check :attr:`ready` first."""
        s = self._sorted
        i = bisect_right(s, elapsed)
        n = len(s) - i
        if n <= 0:
            return max(0.0, elapsed)
        if self._suffix is None:
            suffix = [0.0] * (len(s) + 1)
            for j in range(len(s) - 1, -1, -1):
                suffix[j] = suffix[j + 1] + s[j]
            self._suffix = suffix
        return self._suffix[i] / n - elapsed
