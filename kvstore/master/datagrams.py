"""The master's datagram beats (see master.proto, "Datagram beats"), as state without
I/O: the bindings granted on Beats streams, and a batch of datagrams read from the
beat socket in, the membership beats and the bindings that need their stream's
attention out.

A binding is one slot of one Beats stream (:class:`~kvstore.master.beats.BeatSession`)
that asked for datagrams: an id this master picks (unique in this process), a random
key of its own, the member it beats for, and the last sequence number accepted. The
master reads its socket every ~100 ms (:meth:`Datagrams.apply` on what it read): a
datagram counts as a beat at that moment (liveness is judged at TTLs of seconds, so
100 ms is noise), exactly as an ``alive`` slot on the stream would
(:meth:`Membership.beat_all`: no map work). Anything that is not a well-formed,
authentic, fresh datagram of a known binding is dropped and counted by result.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import beatgram
from .membership import Member, Membership

__all__ = ["BINDING_RESULTS", "RESULTS", "Binding", "Datagrams"]

# kvstore_master_beat_datagrams_total{result}: accepted (a beat), malformed (size,
# magic, version), unknown (no such binding), forged (wrong MAC), replayed (sequence
# number not above the last accepted), stale (its registration is gone)
RESULTS = ("accepted", "malformed", "unknown", "forged", "replayed", "stale")
# kvstore_master_beat_bindings_total{result}: granted (a bind asked for datagrams and
# got a binding), confirmed (its first datagram arrived), lost (a confirmed binding
# fell silent), unheard (no datagram arrived after the bind)
BINDING_RESULTS = ("granted", "confirmed", "lost", "unheard")


@dataclass(slots=True, eq=False)
class Binding:
    """One slot of one stream beating by datagram."""

    id: int
    key: bytes
    slot: int
    member: Member
    owner: Any  # the BeatSession that bound it
    heard: float  # listening time its last datagram was read (at first: when it was bound)
    seq: int = 0  # the last sequence number accepted
    arrived: bool = False  # a valid datagram was read
    confirmed: bool = False  # the stream said so (datagrams_ok)
    stale: bool = False  # its registration is gone: the stream says `unknown`
    attention: bool = False  # the sender asked for an answer on the stream
    held: bool = False  # silent during a storm (beats.survey): kept as long until heard


@dataclass(slots=True)
class Datagrams:
    """Every binding of this master, and what was dropped. ``port``: the UDP port
    beats are read on (0: none, nothing is granted)."""

    port: int = 0
    bindings: dict[int, Binding] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BINDING_RESULTS, 0))
    storm: bool = False  # many bindings quiet at once (kvstore.master.beats.survey)
    _next: int = field(default_factory=lambda: 1 + secrets.randbelow(1 << 31))

    @property
    def enabled(self) -> bool:
        return self.port > 0

    def bind(self, owner: Any, slot: int, member: Member, listen: float) -> Binding:
        """A new binding (a fresh id and key) for ``slot`` of ``owner``'s stream, at
        ``listen`` on the membership's listening clock (:meth:`Membership.listening`:
        time the master was behind is nobody's silence, for bindings too)."""
        bid = self._next
        while bid in self.bindings or bid == 0:
            bid = (bid + 1) & 0xFFFFFFFF
        self._next = (bid + 1) & 0xFFFFFFFF
        key = secrets.token_bytes(beatgram.KEY_BYTES)
        b = Binding(bid, key, slot, member, owner, listen)
        self.bindings[bid] = b
        self.events["granted"] += 1
        return b

    def forget(self, b: Binding) -> None:
        """Datagrams of ``b`` are ``unknown`` from now on."""
        if self.bindings.get(b.id) is b:
            del self.bindings[b.id]

    def apply(
        self, m: Membership, datagrams: Iterable[bytes | memoryview], now: float
    ) -> list[Binding]:
        """Check each datagram and count the good ones as beats of their members at
        ``now``; the bindings whose streams must answer (a first datagram arrived, the
        registration is gone, or the sender asked for attention)."""
        counts = self.counts
        get = self.bindings.get
        accepted: list[Binding] = []
        for d in datagrams:
            head = beatgram.decode(d)
            if head is None:
                counts["malformed"] += 1
                continue
            bid, seq, flags = head
            b = get(bid)
            if b is None:
                counts["unknown"] += 1
            elif not beatgram.verify(b.key, d):
                counts["forged"] += 1
            elif seq <= b.seq:
                counts["replayed"] += 1
            else:
                b.seq = seq
                if flags & beatgram.FLAG_ATTENTION:
                    b.attention = True
                accepted.append(b)
        if not accepted:
            return []
        stale = set(m.beat_all([b.member for b in accepted], now))
        counts["stale"] += len(stale)
        counts["accepted"] += len(accepted) - len(stale)
        wake: list[Binding] = []
        listen = m.listening(now)
        for i, b in enumerate(accepted):
            if i in stale:
                b.stale = True
                wake.append(b)
                continue
            b.heard = listen
            b.held = False
            if not b.arrived or b.attention:
                b.arrived = True
                wake.append(b)
        return wake
