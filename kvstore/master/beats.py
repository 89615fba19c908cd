"""The master's side of one Beats stream (batched heartbeats; see master.proto), as a
translation without I/O: a batch in, the membership events it means, and the answer
to send (or None).

A stream names each worker once (a bind, checked like a Heartbeat: the id and its
instance token) under a slot number of the sender's choosing; afterwards a slot in
``alive`` costs the master a dictionary lookup and two stores
(:meth:`Membership.beat_all`), no map work and no token check. A slot stays bound
to the registration it was bound to: when that registration is gone (expired, left,
replaced) the slot is reported ``unknown`` and the worker registers and binds again.
"""

from __future__ import annotations

from kvstore_client.errors import InvalidArgument, KVStoreError, to_grpc_code
from kvstore_client.proto import master_pb2

from .membership import IdConflict, Member, Membership, check_instance

__all__ = ["MAX_SLOTS", "BeatSession"]

MAX_SLOTS = 1024  # slot numbers of one stream are below this


class BeatSession:
    """One Beats stream: its slots and when it last answered."""

    def __init__(self) -> None:
        self.slots: dict[int, Member] = {}
        self.answered = -float("inf")
        self.told = 0.0  # the interval last told on this stream

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
        for b in batch.bind:
            self.slots.pop(b.slot, None)
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
        interval = m.heartbeat_interval
        if unknown or refused or interval != self.told or now - self.answered >= m.ttl_now:
            self.answered, self.told = now, interval
            return master_pb2.BeatAnswer(
                unknown=unknown,
                refused=refused,
                interval_s=interval,
                ttl_s=m.ttl_now,
                map_version=m.version,
            )
        return None


def _refusal(slot: int, e: KVStoreError, ttl: float) -> master_pb2.BeatRefusal:
    r = master_pb2.BeatRefusal(slot=slot, code=to_grpc_code(e).value[0], message=str(e))
    if isinstance(e, IdConflict):
        r.ttl_s = ttl
        r.live_at = e.live_at
    return r
