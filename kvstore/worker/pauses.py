"""How long agents pause between turns, learnt from the pauses a worker saw.

Pure (no I/O, no clock: callers pass durations), owned by the session table
(:mod:`kvstore.worker.sessions`) and run under the store's lock.

A pause is the time from a session's ``paused`` hint to its return (an ``active``
hint, or a lookup that resumes it). :class:`PauseModel` keeps the last ``window``
pauses and answers two questions about a session that has been paused ``elapsed``
seconds:

- :meth:`PauseModel.remaining`: how much longer it should still be away, the mean of
  ``T - elapsed`` over the seen pauses ``T`` longer than ``elapsed`` (the
  ``expected`` order);
- :meth:`PauseModel.median`: the same for one session, from its own last pauses and
  the seen ones together, as a median (the ``per-session`` order, the default).

Sessions differ: in the agent traces one session's pauses average under a second
and another's ten (time-scaled), and a session's pauses resemble each other more
than the population's. So a session's own pauses, each weighing 1, count against
all the seen ones weighing ``prior`` (2) together: its first pauses move it away
from the population quickly. A median, not a mean: a session that is usually back
within a second and once took ten is still, most likely, back within a second; a
mean would rank it behind one that always takes three.

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
from math import ceil, inf

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

    def median(self, elapsed: float, own: tuple[float, ...] = (), prior: float = 2.0) -> float:
        """Median further pause of a session paused ``elapsed`` seconds ago: of
        ``T - elapsed`` over the pauses ``T > elapsed`` of its own (``own``, each
        weighing 1) and the seen ones (weighing ``prior`` in all). Past every one of
        them it is ``elapsed`` itself, as in :meth:`remaining`."""
        s = self._sorted
        w = prior / len(s) if s else 0.0
        j = bisect_right(s, elapsed)
        mine = sorted(x for x in own if x > elapsed)
        total = w * (len(s) - j) + len(mine)
        if total <= 0:
            return max(0.0, elapsed)
        half = total / 2 - 1e-9  # (float sums of the weights)
        acc = 0.0
        for x in (*mine, inf):
            k = bisect_right(s, x) if x < inf else len(s)
            if w > 0 and acc + w * (k - j) >= half:  # among the seen pauses s[j:k]
                m = j + max(1, ceil((half - acc) / w)) - 1
                return s[min(m, k - 1)] - elapsed
            acc += w * (k - j)
            j = k
            if x == inf:
                break
            acc += 1.0
            if acc >= half:
                return x - elapsed
        return max(0.0, elapsed)  # not reached: the halves add up

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
