"""What `kvstore status` and `kvstore drain` ask the cluster (the CLI prints it).

``status`` reads membership from the master (ClusterStatus: who is in the map, who is
draining, as the master holds it now) and each worker's counters from the worker
itself (Store.Stats, all workers at once, ``timeout`` each), so a put, a drain or an
eviction shows at once instead of one heartbeat later; a worker that does not answer
is shown with the stats of its last heartbeat (``stats_from`` says which). ``drain``
is Master.Drain (see kvstore.master.drain and kvstore.worker.handoff).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvstore_client.proto import master_pb2, master_pb2_grpc, store_pb2, store_pb2_grpc
from kvstore_client.security import Tls, metadata, open_channel

STAT_FIELDS = (
    "used_bytes", "keys", "ssd_capacity_bytes", "ssd_used_bytes", "ssd_keys", "hits", "misses",
    "evictions",
)  # fmt: skip


def _md() -> tuple[tuple[str, str], ...]:
    return tuple(metadata(os.environ.get("KVSTORE_TOKEN")) or ())


def worker_stats(addr: str, timeout: float) -> store_pb2.StatsResponse | None:
    """Store.Stats of the worker at ``addr``; None when it does not answer."""
    try:
        with open_channel(addr, Tls.from_env()) as ch:
            resp: store_pb2.StatsResponse = store_pb2_grpc.StoreStub(ch).Stats(
                store_pb2.StatsRequest(), timeout=timeout, metadata=_md()
            )
            return resp
    except grpc.RpcError:
        return None


def status(addr: str, timeout: float) -> tuple[int, list[dict[str, Any]]]:
    """(map version, one dict per worker) for `kvstore status`; grpc.RpcError when the
    master does not answer."""
    with open_channel(addr, Tls.from_env()) as ch:
        st = master_pb2_grpc.MasterStub(ch).ClusterStatus(
            master_pb2.ClusterStatusRequest(), timeout=timeout, metadata=_md()
        )
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(st.workers)))) as pool:
        fresh = list(pool.map(lambda w: worker_stats(w.info.grpc, timeout), st.workers))
    out: list[dict[str, Any]] = []
    for w, now in zip(st.workers, fresh, strict=True):
        stats: Any = now if now is not None else w.stats
        out.append(
            {
                "id": w.info.id,
                "grpc": w.info.grpc,
                "endpoints": list(w.info.endpoints),
                "state": "draining" if w.draining or w.stats.draining else "serving",
                "capacity_bytes": w.info.capacity_bytes,
                **{k: getattr(stats, k) for k in STAT_FIELDS},
                "stats_from": "worker" if now is not None else "heartbeat",
                "last_heartbeat_age_s": round(w.last_heartbeat_age_s, 3),
            }
        )
    return int(st.map_version), out


def drain(addr: str, worker_id: str, timeout_s: float) -> master_pb2.DrainResponse:
    """Master.Drain of ``worker_id``; grpc.RpcError when it fails."""
    with open_channel(addr, Tls.from_env()) as ch:
        resp: master_pb2.DrainResponse = master_pb2_grpc.MasterStub(ch).Drain(
            master_pb2.DrainRequest(worker_id=worker_id, timeout_s=timeout_s),
            timeout=timeout_s + 30,
            metadata=_md(),
        )
        return resp
