"""One stats record, one conversion: the gRPC Stats answer and the heartbeat's
WorkerStats are both filled by storerecords.stats_message, every field of each."""

from __future__ import annotations

import dataclasses

from kvstore.worker.storerecords import PB_NAMES, StoreStats, stats_message
from kvstore_client.proto import master_pb2, store_pb2


def numbered() -> StoreStats:
    """A record whose integer fields all differ (1, 2, 3, ...)."""
    values = {}
    for i, f in enumerate(dataclasses.fields(StoreStats), start=1):
        values[f.name] = True if f.type in (bool, "bool") else i
    return StoreStats(**values)


def test_every_field_of_both_messages_comes_from_the_record() -> None:
    s = numbered()
    by_pb = {PB_NAMES.get(k, k): v for k, v in dataclasses.asdict(s).items()}
    resp = stats_message(s, store_pb2.StatsResponse, worker_id="w1")
    beat = stats_message(s, master_pb2.WorkerStats, draining=True)
    for msg, extra in ((resp, {"worker_id": "w1"}), (beat, {"draining": True})):
        for name in msg.DESCRIPTOR.fields_by_name:
            want = extra[name] if name in extra else by_pb[name]
            assert getattr(msg, name) == want, f"{type(msg).__name__}.{name}"
    assert resp.capacity_bytes == s.dram_capacity_bytes and beat.used_bytes == s.dram_used_bytes
