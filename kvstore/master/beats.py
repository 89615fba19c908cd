"""The master's side of one Beats stream (batched heartbeats; see master.proto), as a
translation without I/O: a batch in, the membership events it means, and the answer
to send (or None).

A stream names each worker once (a bind, checked like a Heartbeat: the id and its
instance token) under a slot number of the sender's choosing; afterwards a slot in
``alive`` costs the master a dictionary lookup and two stores
(:meth:`Membership.beat_all`), no map work and no token check. A slot stays bound
to the registration it was bound to: when that registration is gone (expired, left,
replaced) the slot is reported ``unknown`` and the worker registers and binds again.

A bind may ask for datagram beats (:mod:`kvstore.master.datagrams`): the session
grants a binding in its answer, says ``datagrams_ok`` once the binding's first
datagram was read, and ``datagrams_lost`` (forgetting the binding) when a confirmed
binding is silent for half a TTL, or an unconfirmed one for a whole TTL (a TTL and a
half for both while many bindings are silent at once: :func:`survey`); the worker
then beats on the stream again. :meth:`BeatSession.poll` is what the master asks of
a stream that carries no batches (its workers beat by datagram): the answer to push,
or None. When the stream ends, :meth:`BeatSession.close` forgets its bindings.
"""

from __future__ import annotations

from kvstore_client.errors import InvalidArgument, KVStoreError, to_grpc_code
from kvstore_client.proto import master_pb2

from .datagrams import Binding, Datagrams
from .membership import IdConflict, Member, Membership, check_instance

__all__ = ["MAX_SLOTS", "BeatSession", "survey"]

MAX_SLOTS = 1024  # slot numbers of one stream are below this
LOST_TTLS = 0.5  # a confirmed binding silent this long: datagrams_lost
UNCONFIRMED_TTLS = 1.0  # a binding without a datagram this long after its bind: lost too
# While many bindings are quiet at once (more than the membership's storm fraction of
# them, and at least its storm minimum, silent for LOST_TTLS), the trouble is the
# senders' host, the network or the master, not one worker's UDP path: a binding is
# lost only after this long then, still a TTL and a half before the membership's
# storm hold ends (1 + HOLD_TTLS TTLs), so that the workers of a real mass UDP outage
# reach their streams in time. A binding silent during a storm keeps that limit until
# it is heard again (the storm's stragglers are the storm's, not lost at once when
# the others come back).
STORM_LOST_TTLS = 1.5
# Bindings are counted in a storm once silent this long, before any is lost (at
# LOST_TTLS): the master surveys every TTL/10, and the senders of a stalled host fall
# silent spread over an interval, so counting only the lost would lose the first
# tenth of them before the storm is seen.
STORM_ONSET_TTLS = 0.35


def survey(dg: Datagrams, m: Membership, now: float, late: float = 0.0) -> bool:
    """Whether the bindings of ``dg`` are in a storm at ``now`` (see STORM_LOST_TTLS);
    sets ``dg.storm``, which :class:`BeatSession` reads until the next survey. The
    master surveys every TTL/10, before it asks its streams (:meth:`BeatSession.poll`);
    ``late`` as there."""
    listen = m.listening(now, late)
    quiet_after = STORM_ONSET_TTLS * m.ttl_now
    silent = [b for b in dg.bindings.values() if listen - b.heard > quiet_after]
    dg.storm = len(silent) >= m.storm_min and len(silent) > m.storm_fraction * len(dg.bindings)
    if dg.storm:
        for b in silent:
            b.held = True
    return dg.storm


class BeatSession:
    """One Beats stream: its slots and when it last answered."""

    def __init__(self, datagrams: Datagrams | None = None) -> None:
        self.slots: dict[int, Member] = {}
        self.answered = -float("inf")
        self.told = 0.0  # the interval last told on this stream
        self.datagrams = datagrams
        self.grams: dict[int, Binding] = {}  # slot -> its datagram binding

    def close(self) -> None:
        """The stream ended: its datagram bindings die with it."""
        if self.datagrams is not None:
            for b in self.grams.values():
                self.datagrams.forget(b)
        self.grams.clear()

    def _drop_gram(self, slot: int) -> None:
        b = self.grams.pop(slot, None)
        if b is not None and self.datagrams is not None:
            self.datagrams.forget(b)

    def _count(self, result: str) -> None:
        if self.datagrams is not None:
            self.datagrams.events[result] += 1

    def _gram_news(
        self, m: Membership, now: float, late: float = 0.0
    ) -> tuple[list[int], list[int], list[int], bool]:
        """(slots confirmed now, slots lost, slots forgotten, a sender asked for an
        answer) of this stream's datagram bindings; confirmed ones are marked told,
        lost and forgotten ones are dropped. ``late``: how late the master's timer
        that asks ran (its deaf time not yet counted, :meth:`Membership.listening`)."""
        ok: list[int] = []
        lost: list[int] = []
        gone: list[int] = []
        asked = False
        if not self.grams:
            return ok, lost, gone, asked
        ttl = m.ttl_now
        listen = m.listening(now, late)  # silence on the listening clock, as the membership's
        storm = self.datagrams is not None and self.datagrams.storm
        held_after = STORM_LOST_TTLS * ttl
        for slot, b in list(self.grams.items()):
            if b.attention:
                b.attention, asked = False, True
            if b.stale:
                gone.append(slot)
                self._drop_gram(slot)
                self.slots.pop(slot, None)
            elif b.arrived and not b.confirmed:
                b.confirmed = True
                ok.append(slot)
                self._count("confirmed")
            elif listen - b.heard > (
                held_after
                if storm or b.held
                else (LOST_TTLS if b.confirmed else UNCONFIRMED_TTLS) * ttl
            ):
                lost.append(slot)
                self._count("lost" if b.confirmed else "unheard")
                self._drop_gram(slot)
        return ok, lost, gone, asked

    @property
    def beats_by_datagram(self) -> bool:
        """Whether any slot of this stream holds a datagram binding."""
        return bool(self.grams)

    def poll(self, m: Membership, now: float, late: float = 0.0) -> master_pb2.BeatAnswer | None:
        """What to push on a stream between its batches: confirmations, lost and
        forgotten bindings, a new interval, or the sign of life once per TTL; None
        when there is nothing to say. ``late``: how late the drain that asks ran (a
        master starved for that long heard nobody: nobody's silence)."""
        ok, lost, gone, asked = self._gram_news(m, now, late)
        interval = m.heartbeat_interval
        if ok or lost or gone or asked or interval != self.told or now - self.answered >= m.ttl_now:
            return self._answer(m, now, unknown=gone, ok=ok, lost=lost)
        return None

    def _answer(
        self,
        m: Membership,
        now: float,
        *,
        unknown: list[int],
        refused: list[master_pb2.BeatRefusal] | None = None,
        grants: list[master_pb2.DatagramGrant] | None = None,
        ok: list[int] | None = None,
        lost: list[int] | None = None,
    ) -> master_pb2.BeatAnswer:
        interval = m.heartbeat_interval
        self.answered, self.told = now, interval
        return master_pb2.BeatAnswer(
            unknown=unknown,
            refused=refused,
            interval_s=interval,
            ttl_s=m.ttl_now,
            map_version=m.version,
            datagrams=grants,
            datagrams_ok=ok,
            datagrams_lost=lost,
        )

    def handle(
        self, m: Membership, batch: master_pb2.BeatBatch, now: float
    ) -> master_pb2.BeatAnswer | None:
        """Apply one batch to ``m`` at ``now``; the answer to send, or None.

        Raises InvalidArgument for a slot number of MAX_SLOTS or more (nothing of the
        batch is applied then). A bind that is refused (another instance's token, a
        malformed token) is reported in the answer; the other slots carry on.
        """
        for b in batch.bind:
            if b.slot >= MAX_SLOTS:
                raise InvalidArgument(f"slot {b.slot} is out of range (< {MAX_SLOTS})")
        unknown: list[int] = []
        refused: list[master_pb2.BeatRefusal] = []
        grants: list[master_pb2.DatagramGrant] = []
        dg = self.datagrams
        for b in batch.bind:
            self.slots.pop(b.slot, None)
            self._drop_gram(b.slot)
            try:
                check_instance(b.instance)
                mem = m.bind(b.worker_id, b.instance, now)
            except KVStoreError as e:
                refused.append(_refusal(b.slot, e, m.ttl))
                continue
            if mem is None:
                unknown.append(b.slot)
            else:
                self.slots[b.slot] = mem
                if b.datagrams and dg is not None and dg.enabled:
                    g = self.grams[b.slot] = dg.bind(self, b.slot, mem, m.listening(now))
                    grants.append(
                        master_pb2.DatagramGrant(slot=b.slot, binding=g.id, key=g.key, port=dg.port)
                    )
        alive = batch.alive
        if alive:
            get = self.slots.get
            for i in m.beat_all([get(s) for s in alive], now):
                unknown.append(alive[i])
        for c in batch.changed:
            mem = self.slots.get(c.slot)
            stats = c.stats if c.HasField("stats") else None
            if mem is None or not m.update(mem, now, stats, c.draining):
                unknown.append(c.slot)
        ok, lost, gone, asked = self._gram_news(m, now)
        unknown += gone
        interval = m.heartbeat_interval
        if (
            unknown
            or refused
            or grants
            or ok
            or lost
            or asked
            or interval != self.told
            or now - self.answered >= m.ttl_now
        ):
            return self._answer(
                m, now, unknown=unknown, refused=refused, grants=grants, ok=ok, lost=lost
            )
        return None


def _refusal(slot: int, e: KVStoreError, ttl: float) -> master_pb2.BeatRefusal:
    r = master_pb2.BeatRefusal(slot=slot, code=to_grpc_code(e).value[0], message=str(e))
    if isinstance(e, IdConflict):
        r.ttl_s = ttl
        r.live_at = e.live_at
    return r
