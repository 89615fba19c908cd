"""Records of the block store (:mod:`kvstore.worker.store`): its stats snapshot and a
read in progress (:class:`Reading` of :class:`~.tiers.blocks.Held` blocks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from .tiers.blocks import Held, StoreCounters
from .tiers.state import TierState

__all__ = ["LOOKUP_SLICES", "Held", "Reading", "StoreCounters", "StoreStats", "snapshot"]

LOOKUP_SLICES = 8  # a lookup (or a session hint) holds the store lock for this many slices


@dataclass(slots=True, frozen=True)
class StoreStats:
    """One snapshot of a worker's store, read by the gRPC Stats call, the heartbeat
    and the Prometheus collector (the only stats record; no string-keyed dicts)."""

    dram_capacity_bytes: int
    dram_used_bytes: int
    dram_keys: int
    hits: int
    misses: int
    evictions: int
    puts: int
    checksum_errors: int
    bad_frames: int
    demotions: int
    promotions: int
    ssd_hits: int
    has_ssd: bool
    ssd_capacity_bytes: int = 0
    ssd_used_bytes: int = 0
    ssd_keys: int = 0
    ssd_evictions: int = 0
    ssd_write_errors: int = 0
    sessions: int = 0
    retained_bytes: int = 0
    prefetched: int = 0
    share_declined: int = 0
    session_cuts_refused: int = 0
    session_hints_refused: int = 0
    inbox_mismatches: int = 0
    pages_revoked: int = 0


@dataclass(slots=True)
class Reading:
    """The result of :meth:`BlockStore.read`; give it back with :meth:`BlockStore.done`."""

    held: list[Held | None]
    txn: Any = None  # LMDB read transaction holding SSD views
    released: bool = False

    @property
    def payload_bytes(self) -> int:
        return sum(len(h.view) for h in self.held if h is not None)


def snapshot(state: TierState) -> StoreStats:
    """A store's counters and tier sizes now (read without the lock: a scrape)."""
    t, policy, counters, ssd_size = state.dram, state.policy, state.counters, state.ssd_size
    c = t.counters
    pc = policy.counters
    ssd_index = policy.ssd
    return StoreStats(
        dram_capacity_bytes=t.capacity,
        dram_used_bytes=t.used_bytes,
        dram_keys=t.keys,
        hits=c.hits,
        misses=c.misses,
        evictions=c.evictions,
        puts=c.puts,
        checksum_errors=counters.checksum_errors,
        bad_frames=counters.bad_frames,
        demotions=counters.demotions,
        promotions=counters.promotions,
        ssd_hits=counters.ssd_hits,
        has_ssd=ssd_size is not None,
        ssd_capacity_bytes=ssd_size or 0,
        ssd_used_bytes=ssd_index.used_bytes,
        ssd_keys=len(ssd_index),
        ssd_evictions=ssd_index.evictions,
        ssd_write_errors=pc.ssd_write_errors,
        sessions=len(policy.sessions),
        retained_bytes=policy.retained_bytes,
        prefetched=counters.prefetched,
        share_declined=pc.share_declined,
        session_cuts_refused=policy.sessions.counters.cuts_refused,
        session_hints_refused=policy.sessions.counters.hints_refused,
        inbox_mismatches=counters.inbox_mismatches,
        pages_revoked=t.shared.revoked if t.shared is not None else 0,
    )


M = TypeVar("M", bound=Message)
# StoreStats fields whose protobuf field has another name (the protos predate the tiers).
PB_NAMES = {
    "dram_capacity_bytes": "capacity_bytes",
    "dram_used_bytes": "used_bytes",
    "dram_keys": "keys",
}


def stats_message(stats: StoreStats, cls: type[M], **extra: Any) -> M:
    """``cls``, a protobuf message (the gRPC ``StatsResponse``, the heartbeat's
    ``WorkerStats``), filled from one stats record: each of its fields the record has,
    under the record's name or its :data:`PB_NAMES` name; ``extra`` sets the others."""
    names = set(cls.DESCRIPTOR.fields_by_name)
    fields = {PB_NAMES.get(k, k): v for k, v in asdict(stats).items()}
    return cls(**{k: v for k, v in fields.items() if k in names}, **extra)
