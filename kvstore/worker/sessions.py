"""Agent sessions on one worker: a bounded table of live sessions and the blocks they hold.

Pure bookkeeping (no I/O, no clock: callers pass ``now``), owned by the tier policy
(:mod:`kvstore.worker.tiers.policy`) and run under the store's lock. An engine (or
any client) sends hints: ``(namespace, session id, state, block hashes, ttl)``.

- A session is named by ``(namespace, session id)`` and gets a small integer id
  (reused once it leaves) while it is in the table.
- States: ``active`` (its blocks are plain LRU blocks), ``paused`` (a tool call is
  running: its blocks are *protected* until its TTL ends), ``ended`` (its blocks
  that no other live session holds are *orphaned*: the first eviction candidates).
- A block held by several live sessions (a shared system prompt) counts one
  reference per session; it is protected while any of them is paused and orphaned
  only when the last of them ends.
- A ``paused`` hint also lists the session's chain last block first: the policy
  reorders those blocks (just used by the turn that ended) so that LRU eviction takes
  the chain's tail before its head. A prefix match stops at the first missing block,
  so plain LRU, which evicts a chain from its head (its oldest-touched block), loses
  the whole prefix where this loses only its end.
- Memory is bounded per tenant (the account ``account_of(ns)`` names; one account
  when the worker has no tenants): at most ``max_sessions`` sessions of an account
  (a new one pushes out that account's oldest ended session, else its least
  recently hinted one, counted in ``counters.dropped``) and ``max_blocks``
  (session, block) pairs of an account (hashes beyond it are ignored, counted in
  ``counters.blocks_refused``). One tenant's flood of made-up sessions and hashes
  therefore costs only its own sessions; the table holds at most accounts x bounds.
- A long chain (over ``move_slice`` keys) changes state, and leaves the table, a
  slice at a time: the session is in its new state at once, its keys follow by
  :meth:`SessionTable.advance` / :meth:`SessionTable.drain` (the store calls them
  with its lock released in between), so no hint or expiry holds the lock for a
  whole chain.
- Each key may come with its depth in the session's whole chain (this worker holds
  only its share). When a live session's block is lost, :meth:`SessionTable.cut`
  marks its deeper blocks dead: a prefix match cannot reach them until the next turn
  (``turn``: the session's count of ``active`` hints, alike on every worker) writes
  the chain again. The cut only records its depth; :meth:`SessionTable.cut_step`
  walks the chain back from its end a bounded number of keys per call (the store
  calls it with its lock released in between) and names the blocks to drop.
- A session belongs to one client here (``Session.client``: the identity its hints
  carry, b"" for an old client that sends none): the first client that hints it.
  Only that client's hints change it and only its cut notices are applied
  (:meth:`SessionTable.cut_from`); others are refused and counted. Another client
  takes the session over (an agent's next turn runs on another engine) by showing
  its chain (:meth:`SessionTable.claim`): its hint lists the session's last key here
  at the same depth, which nobody can name without the conversation's tokens (hashes
  are chained over them). A hint that shows nothing of it but carries the sender's
  whole chain (``whole``: a chain that really changed, e.g. an edited history)
  makes the session start over under the sender: the old chain's blocks become
  plain LRU blocks, none is dropped. Anything else (an incremental hint that does
  not reach the last key) is refused and the client is asked for its whole chain.

Every call returns :class:`Change` records saying which blocks changed protection,
which were orphaned and which belong to a session that just resumed (to prefetch);
the policy turns them into tier instructions.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore_client.errors import InvalidArgument
from kvstore_client.sessions import MAX_SESSION_ID_BYTES, STATES

from .pauses import PauseModel

MAX_TTL = 7 * 86400.0
OWN_PAUSES = 8  # a session's own last pauses kept (retention's "per-session" order)
NO_CUT = 1 << 62

# What :meth:`SessionTable.claim` decided about a hint of a session another client holds.
OWN = "own"  # no other client holds it (absent, or the sender's own)
MOVED = "moved"  # the hint showed the session's chain: the sender holds it now
RESTARTED = "restarted"  # the sender's whole, different chain: it starts over under the sender
REFUSED = "refused"  # nothing shown, not the whole chain: unchanged (ask for the whole chain)

Key = tuple[str, bytes]


@dataclass(slots=True)
class Session:
    sid: int  # small integer id, unique among the table's sessions
    name: str
    ns: str
    state: str
    expires: float  # paused: end of its TTL; active: idle timeout; ended: leaves the table
    # its block hashes in chain order -> each one's depth in the whole chain (hints carry
    # it: a worker holds only its share of a chain), -1 when the hint did not say
    keys: dict[bytes, int] = field(default_factory=dict)
    hit_blocks: int = 0  # over its active hints: leading blocks present ...
    lookup_blocks: int = 0  # ... of the blocks asked about
    last: float = 0.0  # last hint
    pauses: tuple[float, ...] = ()  # its own last OWN_PAUSES pauses (seconds), oldest first
    room: int = -1  # bytes it may still add within its share (-1: no limit known)
    turn: int = 0  # active hints so far (not lookups' resumes): alike on every worker
    cut: int = NO_CUT  # the shallowest depth its chain lost this turn, since keys were added
    # The cut's walk back from the chain's end (cut_step): the keys not walked yet, the
    # key it stopped at (looked at again first by a shallower cut). Only a growth of
    # ``keys`` invalidates the iterator, and a growth ends the walk.
    cut_walk: Iterator[bytes] | None = None
    cut_next: bytes | None = None
    client: bytes = b""  # the client whose session it is here (its identity; b"": none sent)
    # The deepest key here of its latest turn's prompt (the last key of its client's
    # last ``active`` hint): a next turn's prompt extends that prompt, while the chain's
    # last keys may be the turn's output, which a next prompt need not contain token for
    # token (a chat template closes the turn differently, a bench sends the trace's
    # tokens). Showing it proves the conversation as the last key does (see claim).
    anchor: bytes | None = None
    account: str = ""  # the tenant its namespace belongs to ("" without tenants)
    # A state change of a long chain moves its keys a slice at a time (advance): the
    # keys of ``moving`` from ``moving_at`` on are still counted under ``moving_from``.
    moving: list[bytes] | None = None
    moving_from: str = ""
    moving_at: int = 0
    moving_orphan: bool = True

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0


@dataclass(slots=True)
class Change:
    """What one transition did to the blocks of namespace ``ns``."""

    ns: str
    protect: list[bytes] = field(default_factory=list)  # first paused session holds them
    unprotect: list[bytes] = field(default_factory=list)  # no paused session holds them now
    orphaned: list[bytes] = field(default_factory=list)  # no live session holds them now
    resumed: list[bytes] = field(default_factory=list)  # a paused session resumed: prefetch
    tail_first: list[bytes] = field(default_factory=list)  # paused: its chain, last block first
    live: list[bytes] = field(default_factory=list)  # joined an active session: retain them
    session: str = ""  # the session whose transition this is

    def __bool__(self) -> bool:
        return bool(
            self.protect
            or self.unprotect
            or self.orphaned
            or self.resumed
            or self.tail_first
            or self.live
        )


@dataclass(slots=True)
class SessionCounters:
    hints: int = 0
    dropped: int = 0  # sessions pushed out of a full table
    expired: int = 0  # paused sessions whose TTL ended, idle active ones
    resumed_by_lookup: int = 0
    blocks_refused: int = 0  # hashes over the block cap, ignored
    cut_walked: int = 0  # keys cut walks looked at (cut_step)
    cuts_refused: int = 0  # cut notices from a client whose session it is not, ignored
    hints_refused: int = 0  # hints of another client's session that did not show its chain
    moved: int = 0  # sessions another client took over by showing their chain
    restarted: int = 0  # sessions that started over under another client's whole chain


def check_hint(name: str, state: str, ttl: float | None) -> None:
    """InvalidArgument for a hint no table would accept (before anything changes)."""
    if state not in STATES:
        raise InvalidArgument(f"session state must be one of {', '.join(STATES)}, got {state!r}")
    if not name:
        raise InvalidArgument("a session id is a non-empty string")
    if len(name.encode()) > MAX_SESSION_ID_BYTES:
        raise InvalidArgument(
            f"a session id is at most {MAX_SESSION_ID_BYTES} bytes, got {len(name.encode())}"
        )
    if ttl is not None and not 0 < ttl <= MAX_TTL:
        raise InvalidArgument(f"a session ttl is in (0, {MAX_TTL:.0f}] seconds, got {ttl}")


class SessionTable:
    """The live sessions of one worker (see the module docstring)."""

    def __init__(
        self,
        *,
        max_sessions: int = 4096,
        max_blocks: int = 1 << 18,
        paused_ttl: float = 300.0,
        idle_ttl: float = 3600.0,
        ended_keep: float = 60.0,
        account_of: Callable[[str], str | None] | None = None,
        move_slice: int = 0,
    ) -> None:
        if max_sessions < 1 or max_blocks < 0:
            raise InvalidArgument("max_sessions must be >= 1 and max_blocks >= 0")
        self.max_sessions = max_sessions  # per account
        self.max_blocks = max_blocks  # per account
        self.account_of = account_of
        # A state change of a session with more keys than this is applied by
        # :meth:`advance`, a slice at a time (0: always at once).
        self.move_slice = move_slice
        self.paused_ttl = paused_ttl
        self.idle_ttl = idle_ttl
        self.ended_keep = ended_keep
        self.sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()  # by last hint
        self.by_sid: dict[int, Session] = {}
        self._free_sids: list[int] = []
        self.dropping: deque[Session] = deque()  # left the table, keys still moving out
        self.cutting: dict[int, Session] = {}  # by sid: sessions whose cut is still walked
        self._next_sid = 1
        self._sessions_of: dict[str, int] = {}  # per account: sessions in the table
        self._blocks_of: dict[str, int] = {}  # per account: (session, block) pairs
        self.refs: dict[Key, int] = {}  # live (active or paused) sessions holding a block
        self.paused_refs: dict[Key, int] = {}  # paused sessions holding a block
        self.owner: dict[Key, int] = {}  # sid of the last session that listed the block
        self.blocks = 0  # (session, block) pairs held
        self.paused = 0  # sessions in the paused state
        self.counters = SessionCounters()
        self.closed_rates: list[float] = []  # hit rates of sessions that left (drained by metrics)
        self.pauses = PauseModel()  # how long sessions stayed paused (retention's order)

    def __len__(self) -> int:
        return len(self.sessions)

    # ---- queries -------------------------------------------------------------

    def is_protected(self, ns: str, key: bytes) -> bool:
        """Does a paused session hold this block?"""
        return (ns, key) in self.paused_refs

    def get(self, ns: str, name: str) -> Session | None:
        return self.sessions.get((ns, name))

    def top(self, k: int) -> list[Session]:
        """The ``k`` sessions that asked about the most blocks."""
        return sorted(self.sessions.values(), key=lambda s: -s.lookup_blocks)[: max(0, k)]

    def client_of(self, ns: str, name: str) -> bytes | None:
        """The identity of the client whose session it is here; None: not in the table."""
        s = self.sessions.get((ns, name))
        return None if s is None else s.client

    # ---- transitions ---------------------------------------------------------

    def hint(
        self,
        ns: str,
        name: str,
        state: str,
        keys: Sequence[bytes] = (),
        ttl: float | None = None,
        now: float = 0.0,
        depths: Sequence[int] = (),
        *,
        sent: bool = True,
        client: bytes = b"",
    ) -> list[Change]:
        """Apply a hint: add ``keys`` (at ``depths`` in the whole chain, when given) to
        the session, then move it to ``state``. ``sent`` False: not a client's hint
        but a lookup's resume (this worker's alone: it does not count as a turn).
        ``client``: the sender's identity. A new session is the sender's; a session
        another client holds is left as it is (``counters.hints_refused``: see
        :meth:`claim`, which the caller runs first, for how a session changes hands).

        InvalidArgument for an unknown state, an empty or oversized id or a TTL out of
        range. An ``ended`` hint for an unknown session does nothing.
        """
        check_hint(name, state, ttl)
        self.counters.hints += 1
        out: list[Change] = []
        s = self.sessions.get((ns, name))
        if s is None:
            if state == "ended":
                return out
            s = self._new(ns, name, now, out, client)
        elif s.client != client:
            self.counters.hints_refused += 1
            return out
        else:
            self.sessions.move_to_end((ns, name))
            if state == "active" and s.state == "paused":
                p = now - s.last
                self.pauses.observe(p)
                if p == p:  # not NaN
                    s.pauses = (*s.pauses[1 - OWN_PAUSES :], max(0.0, p))
        s.last = now
        if state == "active" and sent:  # a new turn: the engine writes its chain again
            s.turn += 1
            self._uncut(s)
        ch = Change(ns, session=name)
        if s.moving is not None:  # the previous change is still moving: finish it
            self._step(s, None, ch)
        self._add(s, keys, ch, depths)
        if state == "active" and sent and keys and keys[-1] in s.keys:
            s.anchor = keys[-1]
        if state != s.state or state == "paused":  # paused: its chain tail first, again
            self._begin(s, state, orphan=True)
            if not (self.move_slice and len(s.keys) > self.move_slice):
                self._step(s, None, ch)
        if state == "paused":
            s.expires = now + (ttl if ttl is not None else self.paused_ttl)
        elif state == "active":
            s.expires = now + (ttl if ttl is not None else self.idle_ttl)
        else:
            s.expires = now + self.ended_keep
        out.append(ch)
        return out

    def add_keys(
        self,
        ns: str,
        name: str,
        keys: Sequence[bytes],
        now: float,
        depths: Sequence[int] = (),
        client: bytes = b"",
    ) -> list[Change]:
        """Add ``keys`` to the session in its current state (a new one starts
        ``active``, the sender's), with no state change: a long hint is fed in slices
        this way, its last slice as a :meth:`hint`. Another client's session is left
        as it is (as :meth:`hint`). InvalidArgument for an empty or oversized id."""
        check_hint(name, "active", None)
        out: list[Change] = []
        s = self.sessions.get((ns, name))
        if s is None:
            s = self._new(ns, name, now, out, client)
        elif s.client != client:
            self.counters.hints_refused += 1
            return out
        ch = Change(ns, session=name)
        self._add(s, keys, ch, depths)
        if ch:
            out.append(ch)
        return out

    def advance(self, ns: str, name: str, n: int) -> list[Change]:
        """Move up to ``n`` more keys of the session's pending state change (see
        ``move_slice``); [] when nothing is pending."""
        s = self.sessions.get((ns, name))
        if s is None or s.moving is None:
            return []
        ch = Change(ns, session=name)
        self._step(s, n, ch)
        return [ch] if ch else []

    def drain(self, n: int) -> list[Change]:
        """Give up up to ``n`` more keys of sessions that left the table with a long
        chain (see :meth:`_drop`); [] when none is left."""
        if not self.dropping:
            return []
        s = self.dropping[0]
        ch = Change(s.ns, session=s.name)
        self._step(s, n, ch)
        if s.moving is None:
            self.dropping.popleft()
            del self.by_sid[s.sid]
            self._free_sids.append(s.sid)
        return [ch] if ch else []

    def moving(self, ns: str, name: str) -> bool:
        s = self.sessions.get((ns, name))
        return s is not None and s.moving is not None

    def _add(self, s: Session, keys: Sequence[bytes], ch: Change, depths: Sequence[int]) -> None:
        if s.state == "ended":
            return  # an ended session holds no blocks
        ns = s.ns
        room = self.max_blocks - self._blocks_of.get(s.account, 0)
        added = 0
        for i, k in enumerate(keys):
            if k in s.keys:
                continue
            if room <= 0:
                self.counters.blocks_refused += 1
                continue
            room -= 1
            added += 1
            s.keys[k] = depths[i] if depths else -1
            self.owner[(ns, k)] = s.sid
            self._ref(s.state, ns, k, +1, ch, orphan=False)
        if added:
            self._uncut(s)  # its chain grew: a new cut walks it from its end
            self.blocks += added
            self._blocks_of[s.account] = self._blocks_of.get(s.account, 0) + added

    def claim(
        self, ns: str, name: str, client: bytes, shown: Mapping[bytes, int], whole: bool
    ) -> tuple[str, list[Change]]:
        """May a hint from ``client`` change the session? Run before the hint's keys
        are added; ``shown`` maps the hint's keys to their depths (-1: not given) and
        ``whole`` says the hint carries the sender's whole chain (its share here).

        OWN: the session is not in the table or is ``client``'s. MOVED: another
        client's session, and the hint lists its last key here or its latest turn's
        prompt's last key here (``Session.anchor``; at the same depth when both know
        it), or it holds no key here: it is ``client``'s from now on (an
        agent's next turn on another engine). RESTARTED: the hint shows nothing of its
        chain but is ``whole``: the session leaves the table (its blocks become plain
        LRU blocks, as when it expires; the returned changes say so) and the hint
        starts it again as ``client``'s. REFUSED otherwise: nothing changes (the
        caller asks the client for its whole chain). Cost: a few dictionary lookups,
        and for RESTARTED what :meth:`_drop` costs (a long chain leaves a slice at a
        time, by :meth:`drain`; a pending state change is finished first, so the
        caller moves it on by :meth:`advance` before)."""
        s = self.sessions.get((ns, name))
        if s is None or s.client == client:
            return OWN, []
        last = next(reversed(s.keys), None)

        def proves(k: bytes | None) -> bool:  # listed, at the same depth when both know it
            return (
                k is not None
                and k in shown
                and (s.keys.get(k, -1) < 0 or shown[k] < 0 or shown[k] == s.keys[k])
            )

        if last is None or proves(last) or proves(s.anchor):
            self.counters.moved += 1
            s.client = client
            return MOVED, []
        if whole:
            self.counters.restarted += 1
            return RESTARTED, self._drop(s)
        self.counters.hints_refused += 1
        return REFUSED, []

    def cut(self, s: Session, depth: int) -> bool:
        """The session's chain lost its block at ``depth`` (on this worker or another):
        a prefix match stops there, so its blocks deeper than that are of no use until
        the chain is written again, and they take room that chains which can still hit
        could use. Only records the cut (a few operations): :meth:`cut_step` walks the
        chain and names those blocks. False (nothing to do) for an ended session or a
        cut no shallower than an earlier one since the chain last grew."""
        if s.state == "ended" or depth >= s.cut:
            return False
        s.cut = depth
        if s.cut_walk is None:
            s.cut_walk, s.cut_next = reversed(s.keys), None
        self.cutting[s.sid] = s
        return True

    def cut_from(self, ns: str, name: str, depth: int, turn: int, client: bytes) -> bool:
        """A cut notice ``client`` carried here (another worker lost the session's
        block at ``depth`` during its ``turn``-th active hint): applied as
        :meth:`cut` when the session is ``client``'s and still in that turn; another
        client's notice is ignored and counted (``counters.cuts_refused``)."""
        s = self.sessions.get((ns, name))
        if s is None:
            return False
        if s.client != client:
            self.counters.cuts_refused += 1
            return False
        return s.turn == turn and self.cut(s, depth)

    def cut_step(self, n: int) -> tuple[str, list[bytes]]:
        """Walk up to ``n`` more keys of the first recorded cut, back from its chain's
        end, down to the first key at or above its depth; returns its namespace and
        the walked keys deeper than the cut that no other live session holds (the
        caller drops them), ("", []) when no cut is left. Each key is walked once
        until the chain grows (a shallower cut goes on from where the last stopped)."""
        n = max(1, n)
        refs = self.refs
        while self.cutting:
            sid, s = next(iter(self.cutting.items()))
            if s.cut_walk is None or s.state == "ended":
                del self.cutting[sid]
                continue
            out: list[bytes] = []
            walked, ns, depth, done = 0, s.ns, s.cut, False
            while walked < n:
                k = s.cut_next if s.cut_next is not None else next(s.cut_walk, None)
                s.cut_next = None
                if k is None:
                    done = True
                    break
                d = s.keys[k]
                if 0 <= d <= depth:
                    s.cut_next, done = k, True
                    break
                walked += 1
                if d > depth and refs.get((ns, k), 0) <= 1:
                    out.append(k)
            self.counters.cut_walked += walked
            if done:
                del self.cutting[sid]
            return ns, out
        return "", []

    def _uncut(self, s: Session) -> None:
        """Forget the session's cut (its chain grew, or a new turn writes it again)."""
        s.cut, s.cut_walk, s.cut_next = NO_CUT, None, None
        self.cutting.pop(s.sid, None)

    def record(self, ns: str, name: str, hits: int, lookups: int) -> None:
        """Count a lookup of the session's chain: ``hits`` leading blocks of ``lookups``."""
        s = self.sessions.get((ns, name))
        if s is not None:
            s.hit_blocks += hits
            s.lookup_blocks += lookups

    def lookup(self, ns: str, keys: Sequence[bytes], now: float) -> list[Change]:
        """A lookup of ``keys``: the paused session that alone holds the most specific
        of them (walking back from the end of the chain, stopping at the first block
        another live session shares) resumes, as if hinted ``active``."""
        if not self.paused:
            return []
        for k in reversed(keys):
            if (ns, k) not in self.paused_refs:
                continue
            if self.refs.get((ns, k), 0) > 1:
                return []  # a shared block (a system prompt): names no one session
            s = self.by_sid.get(self.owner.get((ns, k), 0))
            if s is not None and s.state == "paused" and s.ns == ns and s.moving is None:
                self.counters.resumed_by_lookup += 1
                return self.hint(ns, s.name, "active", (), None, now, sent=False, client=s.client)
        return []

    def tick(self, now: float) -> list[Change]:
        """Expire sessions: paused past their TTL and idle active ones leave the table
        (their blocks become plain LRU blocks); ended ones leave after ``ended_keep``."""
        out: list[Change] = []
        for s in [s for s in self.sessions.values() if s.expires <= now]:
            if s.state != "ended":
                self.counters.expired += 1
            out.extend(self._drop(s))
        return out

    # ---- internals -------------------------------------------------------------

    def _new(self, ns: str, name: str, now: float, out: list[Change], client: bytes) -> Session:
        acct = (self.account_of(ns) if self.account_of is not None else None) or ""
        while self._sessions_of.get(acct, 0) >= self.max_sessions:
            # The account's own oldest ended session, else its least recently hinted.
            mine = [v for v in self.sessions.values() if v.account == acct]
            victim = next((v for v in mine if v.state == "ended"), mine[0])
            self.counters.dropped += 1
            out.extend(self._drop(victim))
        if self._free_sids:
            sid = self._free_sids.pop()
        else:
            sid, self._next_sid = self._next_sid, self._next_sid + 1
        s = Session(
            sid, name, ns, "active", now + self.idle_ttl, last=now, account=acct, client=client
        )
        self.sessions[(ns, name)] = s
        self.by_sid[s.sid] = s
        self._sessions_of[acct] = self._sessions_of.get(acct, 0) + 1
        return s

    def _drop(self, s: Session) -> list[Change]:
        """The session leaves the table (expired, or pushed out). A long chain's keys
        are given up later, a slice at a time (:meth:`drain`); its id stays taken
        until then."""
        ch = Change(s.ns, session=s.name)
        if s.moving is not None:
            self._step(s, None, ch)
        del self.sessions[(s.ns, s.name)]
        self._uncut(s)
        if self.move_slice and len(s.keys) > self.move_slice and s.state != "ended":
            self._begin(s, "ended", orphan=False)
            self.dropping.append(s)
        else:
            self._move(s, "ended", ch, orphan=False)
            del self.by_sid[s.sid]
            self._free_sids.append(s.sid)
        left = self._sessions_of.get(s.account, 1) - 1
        if left:
            self._sessions_of[s.account] = left
        else:
            self._sessions_of.pop(s.account, None)
        if s.lookup_blocks and len(self.closed_rates) < 10_000:
            self.closed_rates.append(s.hit_rate)
        return [ch] if ch else []

    def _move(self, s: Session, state: str, ch: Change, *, orphan: bool) -> None:
        """Move every key of the session to ``state`` now."""
        if s.state == state:
            return
        self._begin(s, state, orphan=orphan)
        self._step(s, None, ch)

    def _begin(self, s: Session, state: str, *, orphan: bool) -> None:
        """Start a state change: the session is in ``state`` now, its keys move by
        :meth:`_step`, in chain order (its head protected first)."""
        old = s.state
        s.moving = list(s.keys)
        s.moving_from, s.moving_at, s.moving_orphan = old, 0, orphan
        s.state = state
        self.paused += (state == "paused") - (old == "paused")

    def _step(self, s: Session, n: int | None, ch: Change) -> None:
        """Move up to ``n`` (None: all) pending keys from ``moving_from`` to the
        session's state: references (new first, so no false orphans), a resumed
        session's keys to prefetch, a paused one's chain reordered last block first
        (the same share of it, from its end, so the steps together list the whole
        chain reversed); an ended one gives up its keys when the last has moved."""
        assert s.moving is not None
        keys, a = s.moving, s.moving_at
        b = len(keys) if n is None else min(len(keys), a + n)
        old, new, ns, orphan = s.moving_from, s.state, s.ns, s.moving_orphan
        for k in keys[a:b]:
            if old != new:
                self._ref(new, ns, k, +1, ch, orphan=orphan)
                self._ref(old, ns, k, -1, ch, orphan=orphan)
                if new == "ended" and self.owner.get((ns, k)) == s.sid:
                    del self.owner[(ns, k)]
        if old == "paused" and new == "active":
            ch.resumed.extend(keys[a:b])
        elif new == "paused":
            m = len(keys)
            ch.tail_first.extend(reversed(keys[m - b : m - a]))
        s.moving_at = b
        if b < len(keys):
            return
        s.moving = None
        if new == "ended" and old != "ended":  # it keeps its counters, not its blocks
            self.blocks -= len(s.keys)
            left = self._blocks_of.get(s.account, 0) - len(s.keys)
            if left > 0:
                self._blocks_of[s.account] = left
            else:
                self._blocks_of.pop(s.account, None)
            s.keys = {}

    def _ref(self, state: str, ns: str, k: bytes, sign: int, ch: Change, *, orphan: bool) -> None:
        if state == "ended":
            return
        key = (ns, k)
        n = self.refs.get(key, 0) + sign
        if n > 0:
            self.refs[key] = n
        else:
            self.refs.pop(key, None)
            if orphan:
                ch.orphaned.append(k)
        if state == "active" and sign > 0:
            ch.live.append(k)
        if state == "paused":
            p = self.paused_refs.get(key, 0) + sign
            if p > 0:
                self.paused_refs[key] = p
                if p == 1 and sign > 0:
                    ch.protect.append(k)
            else:
                self.paused_refs.pop(key, None)
                ch.unprotect.append(k)
