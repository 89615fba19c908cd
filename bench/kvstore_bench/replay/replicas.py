"""`kvstore bench replay --replicas R1,R2 --kill-worker-at F`: what replicas cost and buy.

For each replica count R, a fresh local cluster (``kvstore master --replicas R`` and
``--workers`` workers w0, w1, ...) replays the same sessions one after another (so the
order, and the kill point, are the same for every R). After the fraction F of the
requests, it records the bytes and blocks stored across the workers (the memory cost
of R copies), SIGKILLs worker w0 and waits until the map has dropped it (the worker
TTL); then the replay goes on. Reported per R: bytes stored at the kill, the token hit
rate of the requests before and after the kill, and content errors (every loaded
block is verified, so a wrong byte is counted, never a hit).

The replay engine is :func:`kvstore_bench.replay.run_replay`; this module only adds the
cluster, the kill and the figures.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..peers import ClusterSpec, KVStoreBackend, StartError
from ..traces import Session
from .run import ReplayConfig, RequestRecord, run_replay

__all__ = ["ReplicaRun", "replica_rows", "replicas_cmd_body", "run_replica_replay"]


@dataclass(slots=True)
class ReplicaRun:
    """The figures of one replica count (see the module doc); rates are fractions."""

    replicas: int
    workers: int
    requests: int
    killed_after: int  # requests replayed before the kill
    stored_bytes: int  # sum of the workers' used bytes at the kill
    stored_blocks: int  # sum of the workers' keys at the kill
    hit_before: float  # token hit rate of the requests before the kill
    hit_after: float  # ... and after it
    content_errors: int
    store_failed: int
    map_drop_s: float  # SIGKILL -> the map without the dead worker

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _hit_rate(recs: Sequence[RequestRecord]) -> float:
    tok = sum(r.tokens for r in recs)
    return sum(r.hit_tokens for r in recs) / tok if tok else float("nan")


def run_replica_replay(
    sessions: Sequence[Session],
    cfg: ReplayConfig,
    spec: ClusterSpec,
    replicas: int,
    kill_at: float,
) -> ReplicaRun:
    """Replay ``sessions`` once on a new cluster with ``replicas`` copies per block,
    SIGKILLing worker w0 after the fraction ``kill_at`` (0 < kill_at < 1) of the
    requests. Needs ``spec.workers > replicas``; raises StartError when the cluster
    does not start. Sessions run one at a time (``cfg.sessions`` is ignored)."""
    from kvstore.cluster import LocalCluster
    from kvstore.cluster import StartError as ClusterStartError

    if not 0 < kill_at < 1:
        raise ValueError("kill_at must be between 0 and 1")
    if spec.workers <= replicas:
        raise ValueError(f"{spec.workers} workers cannot lose one and keep {replicas} copies")
    cfg = dataclasses.replace(cfg, sessions=1)
    total = sum(len(x.requests) for s in sessions for x in s.walk())
    kill_after = max(1, min(total - 1, round(kill_at * total)))
    with tempfile.TemporaryDirectory(prefix="kvbench-replicas-") as tmp:
        cluster = LocalCluster(
            workers=0,
            dram_size=str(spec.dram_bytes),
            max_value_size=str(spec.max_value_bytes),
            log_dir=tmp,
            worker_ttl="2s",
            extra_master_args=["--replicas", str(replicas)],
        )
        try:
            cluster.start()
            for i in range(spec.workers):
                cluster.add_worker("--id", f"w{i}")
            cluster.wait_for_workers(spec.workers)
        except ClusterStartError as e:
            cluster.stop()
            raise StartError(f"kvstore cluster did not start: {e}") from e
        try:
            backend = KVStoreBackend(
                cluster.address, "replicas/bench/b0/tp0of1", "kvstore", spec.transport
            )
            done = 0
            at: dict[str, float] = {}

            def on_request(rec: RequestRecord) -> None:
                nonlocal done
                done += 1
                if done != kill_after:
                    return
                stats = [_worker_stats(d.address) for d in cluster.worker_procs]
                at["bytes"] = sum(int(st.used_bytes) for st in stats)
                at["blocks"] = sum(int(st.keys) for st in stats)
                at["end"] = rec.end
                victim = cluster.worker_procs[0]
                t0 = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
                victim.proc.wait(10)
                while "w0" in cluster.live_worker_ids():
                    if time.monotonic() - t0 > 30:
                        raise RuntimeError("the map never dropped the killed worker")
                    time.sleep(0.05)
                # the client's watch carries the new map; give it a moment to arrive
                while backend.client.map_version < _map_version(cluster.address):
                    time.sleep(0.02)
                at["drop_s"] = time.monotonic() - t0

            try:
                res = run_replay(sessions, backend, cfg, on_request=on_request)
            finally:
                backend.close()
        finally:
            cluster.stop()
    recs = res.records
    before, after = recs[:kill_after], recs[kill_after:]
    return ReplicaRun(
        replicas=replicas,
        workers=spec.workers,
        requests=len(recs),
        killed_after=kill_after,
        stored_bytes=int(at.get("bytes", 0)),
        stored_blocks=int(at.get("blocks", 0)),
        hit_before=_hit_rate(before),
        hit_after=_hit_rate(after),
        content_errors=sum(r.content_errors for r in recs),
        store_failed=sum(r.store_failed for r in recs),
        map_drop_s=at.get("drop_s", float("nan")),
    )


def _worker_stats(addr: str) -> Any:
    """A worker's own Stats (exact now; the master's copy lags by a heartbeat)."""
    import grpc

    from kvstore_client.proto import store_pb2, store_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        return store_pb2_grpc.StoreStub(ch).Stats(store_pb2.StatsRequest(), timeout=5)


def _map_version(master: str) -> int:
    import grpc

    from kvstore_client.proto import master_pb2, master_pb2_grpc

    with grpc.insecure_channel(master) as ch:
        m = master_pb2_grpc.MasterStub(ch).GetShardMap(master_pb2.GetShardMapRequest(), timeout=5)
    return int(m.version)


def replica_rows(runs: Sequence[ReplicaRun]) -> list[list[str]]:
    """Table rows: one per replica count, memory relative to the first run."""
    base = runs[0].stored_bytes or 1
    return [
        [
            f"R={r.replicas}",
            f"{r.stored_bytes / 2**20:.1f} MiB ({r.stored_bytes / base:.2f}x), "
            f"{r.stored_blocks} blocks",
            f"{100 * r.hit_before:.1f}%",
            f"{100 * r.hit_after:.1f}%",
            str(r.content_errors),
            f"{r.map_drop_s:.1f} s",
        ]
        for r in runs
    ]


def replicas_cmd_body(
    console: Any,
    sessions: Sequence[Session],
    cfg: ReplayConfig,
    spec: ClusterSpec,
    replicas_text: str,
    kill_at: float,
    out: str,
) -> list[ReplicaRun]:
    """`kvstore bench replay --replicas ...`: one run per count, a table and JSON."""
    import click

    from .. import report

    try:
        counts = [int(x) for x in replicas_text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or max(counts) > 8:
        raise click.BadParameter(f"want R or R1,R2,... in 1..8, got {replicas_text!r}")
    if spec.master:
        raise click.UsageError("--replicas starts its own clusters: drop --master")
    if not 0 < kill_at < 1:
        raise click.BadParameter("--kill-worker-at must be between 0 and 1")
    if spec.workers <= max(counts):
        raise click.UsageError(f"--replicas {max(counts)} needs --workers > {max(counts)}")
    runs = []
    for r in counts:
        console.print(f"replicas={r}: {spec.workers} workers, SIGKILL w0 at {kill_at:.0%}")
        try:
            runs.append(run_replica_replay(sessions, cfg, spec, r, kill_at))
        except StartError as e:
            raise click.ClickException(str(e)) from e
    console.print(
        report.table(
            f"replicas: worker w0 SIGKILLed after {runs[0].killed_after} of "
            f"{runs[0].requests} requests ({report.command_line()})",
            ["copies", "stored at the kill", "hit before", "hit after", "errors", "map drop"],
            replica_rows(runs),
        )
    )
    path = report.write_json(
        report.results_path(Path(out), "replay-replicas", report.stamp(), ".json"),
        {"runs": [r.as_dict() for r in runs], "command": report.command_line()},
    )
    console.print(f"wrote {path}")
    return runs
