"""Which DRAM blocks live sessions hold off the LRU lists, and which give way first.

Pure bookkeeping (no I/O), owned by :class:`~kvstore.worker.tiers.policy.TierPolicy`
and run under the store's lock.

A block is *retained* while a live session holds it: a paused session (its next turn
will read its chain) or an active one (its blocks from the moment they are written:
on the LRU list, a turn's new blocks were the first victims of other sessions' writes
before its ``paused`` hint came). Retained blocks are never evicted nor demoted; they
fit within ``budget`` bytes of DRAM, and what a session cannot fit stays on the LRU
lists.

When DRAM has no other room for a new block, retained blocks *yield*, a session at a
time and each chain from its tail (a prefix match stops at the first gap, so a chain
that loses its tail keeps its head's hits), in the order of ``order``:

- ``"per-session"`` (the default): every live session, running or paused, the one
  whose next read is likely furthest away first. That is its median further pause
  (:meth:`~kvstore.worker.pauses.PauseModel.median`) from its own last pauses and
  the pauses this worker saw, given how long it has been away (each session's rank
  is reused for up to ``REORDER_S`` while it has no new hint); a running session
  counts as one that has just paused (its turn has read its prefix; the next turn
  reads it again after one more pause). Sessions differ by far: agents that call
  quick tools come back within a second, turn after turn, while others take ten, so
  a quick session keeps its chain through its turns and a slow one gives way even
  while it runs;
- ``"expected"``: running sessions first (the least recently hinted first), then
  paused ones, the one expected back last first, from the mean further pause of the
  pauses this worker saw (:meth:`~kvstore.worker.pauses.PauseModel.remaining`): with
  pauses of about one length the most recently paused session, with agents' tool
  calls (mostly short, a few long) one already away for a while;
- ``"recent"``: running sessions first, then the most recently paused.

Until the model has seen enough pauses, every order is ``recent``'s. Last go blocks
several live sessions share (a system prompt), and blocks whose sessions left the
table, oldest first.

Measured on engine runs (docs/BENCHMARKS.md, "Memory as the axis"): at a quarter of
the working set, retention took the token hit rate from about 31% to 42-46%, and
``per-session`` from 41.1% (``expected``, in the same invocation) to 49.8% (medians of
three runs; a mean in place of the median kept 1.6 points less). With ``expected``,
98% of the blocks that gave way were running sessions': a session that missed wrote
its whole chain during its turn and gave it way again at once, turn after turn.
Letting a turn that started under 2 s ago give way last (its engine might not have
read its prefix yet) lost 4.6 points.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice

from ..sessions import Session, SessionTable

Key = tuple[str, bytes]
Holder = tuple[str, str]  # (namespace, session id)


ORDERS = ("per-session", "expected", "recent")  # which session gives way first (docstring)
# The order is worked out once and reused by the writes that follow (each new block of
# a full DRAM asks for room) until a hint comes, a session starts holding blocks, or
# this many seconds pass (the expected returns move with the clock).
REORDER_S = 0.25


@dataclass(slots=True)
class Retention:
    budget: int  # bytes of DRAM retained blocks may occupy
    order: str = "per-session"  # one of ORDERS
    blocks: dict[Key, int] = field(default_factory=dict)  # retained block -> bytes
    nbytes: int = 0
    _holder: dict[Key, Holder] = field(default_factory=dict)
    _held: dict[Holder, int] = field(default_factory=dict)  # blocks per holder (upper bound)
    # holder -> (its chain's length then, keys from the chain's end that hold nothing it
    # may yield): a session giving way a block at a time is not walked again from its
    # tail each time (forgotten when the holder retains a block again)
    _walked: dict[Holder, tuple[int, int]] = field(default_factory=dict)
    _queue: deque[Session] = field(default_factory=deque)  # the order, as last worked out
    _stamp: tuple[int, int] = (-1, -1)  # (the table's hints, _version) it was worked out at
    _built: float = 0.0  # ... and the clock then
    _version: int = 0  # bumped when a holder starts holding blocks
    # per-session: each session's rank as last worked out -> (rank, clock then, the
    # session's last hint, state and name then); reused while both are unchanged for up to
    # REORDER_S, so a hint while DRAM is full ranks the hinted session again, not all
    # (keyed by the session's sid, with its name: a sid is reused once its session left)
    _ranks: dict[int, tuple[float, float, float, str, str]] = field(default_factory=dict)

    def __contains__(self, key: Key) -> bool:
        return key in self.blocks

    def fits(self, size: int) -> bool:
        return self.nbytes + size <= self.budget

    def keep(self, key: Key, size: int, holder: Holder) -> None:
        """Retain ``key`` (``size`` bytes) for ``holder``; the caller checked :meth:`fits`."""
        self.blocks[key] = size
        self.nbytes += size
        self._holder[key] = holder
        held = self._held.get(holder, 0)
        if not held:
            self._version += 1
        self._held[holder] = held + 1
        self._walked.pop(holder, None)

    def drop(self, key: Key) -> bool:
        """Stop retaining ``key``; False when it was not retained."""
        size = self.blocks.pop(key, None)
        if size is None:
            return False
        self.nbytes -= size
        h = self._holder.pop(key, None)
        if h is not None:
            n = self._held.get(h, 0) - 1
            if n > 0:
                self._held[h] = n
            else:
                self._held.pop(h, None)
                self._walked.pop(h, None)
        return True

    def give_way(
        self, nbytes: int, table: SessionTable, now: float | None = None
    ) -> dict[str, list[bytes]]:
        """Stop retaining at least ``nbytes`` (less when fewer are retained), in the
        order of the module docstring (``now``: the clock of the sessions' hints; None:
        the last hint's time). Returns the blocks per namespace, the first to
        be evicted last: each chain head ... tail, the first session to give way
        after the others (for EvictFirst, which makes each block the oldest in turn)."""
        groups: list[tuple[str, list[bytes]]] = []
        freed = 0
        refs = table.refs
        if now is None and table.sessions:  # the table keeps them in the order of their hints
            now = next(reversed(table.sessions.values())).last
        stamp = (table.counters.hints, self._version)
        fresh = stamp != self._stamp or now is None or abs(now - self._built) > REORDER_S
        while True:
            if fresh:
                self._queue = deque(self._order(table, now))
                self._stamp, self._built = stamp, now or 0.0
            freed = self._walk(nbytes, freed, groups, refs)
            if freed >= nbytes or fresh:
                break
            fresh = True  # a chain that grew since: work the order out again
        while freed < nbytes and self.blocks:  # shared, or held by sessions that left
            key = next(iter(self.blocks))
            freed += self.blocks[key]
            self.drop(key)
            groups.append((key[0], [key[1]]))
        out: dict[str, list[bytes]] = {}
        for ns, keys in reversed(groups):
            out.setdefault(ns, []).extend(keys)
        return out

    def _walk(
        self, nbytes: int, freed: int, groups: list[tuple[str, list[bytes]]], refs: dict[Key, int]
    ) -> int:
        """Give way along the queue until ``nbytes`` are freed; returns the bytes freed."""
        q = self._queue
        while q and freed < nbytes:
            s = q[0]
            holder = (s.ns, s.name)
            n = len(s.keys)
            at, skip = self._walked.get(holder, (n, 0))
            skip = skip if at == n else 0  # its chain grew: walk it from its new end
            if skip >= n or holder not in self._held:
                q.popleft()  # nothing left that it may yield
                continue
            gone: list[bytes] = []
            walked = 0
            for k in islice(reversed(s.keys), skip, None):
                if freed >= nbytes or holder not in self._held:
                    break
                walked += 1
                key = (s.ns, k)
                if self._holder.get(key) != holder or refs.get(key, 0) > 1:
                    continue  # another's, or shared (a system prompt): yields last
                freed += self.blocks[key]
                self.drop(key)
                gone.append(k)
            self._walked[holder] = (n, n if holder not in self._held else skip + walked)
            if freed < nbytes:
                q.popleft()  # walked to its head
            if gone:
                gone.reverse()
                groups.append((s.ns, gone))
        return freed

    def _order(self, table: SessionTable, now: float | None) -> Iterator[Session]:
        """Sessions that hold retained blocks, in the order of ``order`` (module
        docstring). Ties, and ``recent``: active ones from the least recently hinted,
        then paused ones from the most recently hinted (the table keeps its sessions
        in the order of their last hint)."""
        live = [s for s in table.sessions.values() if (s.ns, s.name) in self._held]
        active = [s for s in live if s.state == "active"]
        paused = [s for s in reversed(live) if s.state == "paused"]
        model = table.pauses
        ready = model.ready and now is not None
        t = now if now is not None else 0.0
        if self.order == "per-session" and ready:
            ranked = active + paused
            old, ranks = self._ranks, {}
            for s in ranked:
                c = old.get(s.sid)
                if (
                    c is None
                    or c[2] != s.last
                    or c[3] != s.state
                    or c[4] != s.name
                    or abs(t - c[1]) > REORDER_S
                ):
                    away = 0.0 if s.state == "active" else max(0.0, t - s.last)
                    c = (-model.median(away, s.pauses), t, s.last, s.state, s.name)
                ranks[s.sid] = c
            self._ranks = ranks  # sessions that left are forgotten here
            ranked.sort(key=lambda s: ranks[s.sid][0])
            yield from ranked
            return
        yield from active
        if self.order == "expected" and ready and len(paused) > 1:
            # stable: sessions expected alike keep the most recently paused first
            paused.sort(key=lambda s: -model.remaining(max(0.0, t - s.last)))
        yield from paused
