"""What a new client pays to build its ring from a map it did not choose: a real
master (``python -m kvstore master --vnodes-per-gib D``), ``workers`` registrations of
``capacity`` each (no worker processes: a client routes without connecting), then
one fresh process per round that opens ``kvstore_client.Client`` and reports the
seconds until it is ready, its peak RSS (VmHWM) and its ring's points.

    python -m kvstore_bench.scale.ringcost --workers 512 --capacity 64GiB \\
        --vnodes-per-gib 1048576 --rounds 3

docs/SCALE.md and docs/SECURITY.md quote it (issue 41, finding 9).
"""

from __future__ import annotations

import json
import subprocess
import sys

import click
import grpc

from kvstore.cluster import LocalCluster
from kvstore.config import parse_size
from kvstore_client.proto import master_pb2, master_pb2_grpc
from kvstore_client.sharding import build_ring

# The client's side, in a fresh interpreter (nothing imported or warmed beforehand).
CLIENT = """
import json, sys, time
t0 = time.perf_counter()
from kvstore_client import Client
t1 = time.perf_counter()
with Client(sys.argv[1], transport="tcp", timeout=60) as c:
    t2 = time.perf_counter()
    workers = len(c.workers())
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"import_s": round(t1 - t0, 3), "ready_s": round(t2 - t1, 3),
                  "peak_rss_mib": round(hwm / 1024), "workers": workers}))
"""


def register(address: str, workers: int, capacity: int) -> None:
    """``workers`` registrations of ``capacity`` bytes each (sim ids and ports)."""
    with grpc.insecure_channel(address) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        for i in range(workers):
            info = master_pb2.WorkerInfo(
                id=f"ring-{i:05d}",
                grpc=f"10.9.{i // 250}.{i % 250}:7701",
                endpoints=[f"tcp://10.9.{i // 250}.{i % 250}:7702"],
                capacity_bytes=capacity,
                max_value_bytes=16 << 20,
            )
            req = master_pb2.RegisterRequest(worker=info, instance=f"{i:032d}")
            stub.Register(req, timeout=30)


@click.command()
@click.option("--workers", default=512, show_default=True)
@click.option("--capacity", default="64GiB", show_default=True)
@click.option("--vnodes-per-gib", default=1 << 20, show_default=True)
@click.option("--replicas", default=1, show_default=True)
@click.option("--rounds", default=3, show_default=True)
def main(workers: int, capacity: str, vnodes_per_gib: int, replicas: int, rounds: int) -> None:
    cluster = LocalCluster(
        workers=0,
        worker_ttl="600s",
        extra_master_args=["--vnodes-per-gib", str(vnodes_per_gib), "--replicas", str(replicas)],
        stderr=subprocess.DEVNULL,
    ).start()
    try:
        register(cluster.address, workers, parse_size(capacity))
        with grpc.insecure_channel(cluster.address) as ch:
            m = master_pb2_grpc.MasterStub(ch).GetShardMap(master_pb2.GetShardMapRequest())
        pairs = [(w.id, w.capacity_bytes) for w in m.workers]
        points = len(build_ring(pairs, vnodes_per_gib=m.vnodes_per_gib).points)
        print(json.dumps({"workers": len(pairs), "ring_points": points}), flush=True)
        for _ in range(rounds):
            out = subprocess.run(
                [sys.executable, "-c", CLIENT, cluster.address],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if out.returncode:
                raise click.ClickException(out.stderr[-2000:])
            print(out.stdout.strip().splitlines()[-1], flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
