"""`kvstore bench contention`: does one client's huge request stall everyone else's lookups?

A probe client sends 1-key EXISTS frames over tcp:// back to back and records their
latency, first alone, then while another client runs each big request in turn:
a 65,536-block shm:// put (one PUT_LOC reservation), a 65,536-value gRPC Put, and a
RemoveNamespace of every block just written. The worker processes big requests in
slices (``slice_keys`` per hold of its store lock), so the probe's p99 should stay in
the tens of milliseconds. Runs against a local cluster it starts (one worker).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import click
import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.proto import store_pb2, store_pb2_grpc

NS = "contention"


def _key(i: int, tag: str) -> bytes:
    return (tag.encode() + i.to_bytes(8, "little")).ljust(16, b"\0")[:16]


def _probe(address: str, conn: Connection) -> None:
    """In its own process (its own GIL): 1-key EXISTS back to back; sends the latencies
    recorded since the last report whenever the parent sends a message."""
    k = [_key(0, "probe")]
    with Client(address, transport="tcp") as c:
        c.batch_exists(NS, k)
        conn.send("ready")
        while True:
            lat: list[float] = []
            while not conn.poll():
                t0 = time.perf_counter()
                c.batch_exists(NS, k)
                lat.append(time.perf_counter() - t0)
            if conn.recv() == "quit":
                return
            conn.send(lat)


def _measure(
    conn: Connection, work: Callable[[], None] | None, seconds: float
) -> tuple[list[float], float]:
    conn.send("mark")
    conn.recv()  # what the probe saw before: discarded
    t0 = time.perf_counter()
    if work is None:
        time.sleep(seconds)
    else:
        work()
    took = time.perf_counter() - t0
    conn.send("mark")
    lat: list[float] = conn.recv()
    return lat, took


def _pcts(lat: list[float]) -> dict[str, float]:
    a = np.array(lat or [0.0]) * 1e3
    return {
        "n": len(lat),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


def _runs(
    big: Client, probe: Connection, blocks: int, value_size: int
) -> dict[str, dict[str, float]]:
    value = os.urandom(value_size)
    grpc_addr = big.workers()[0].grpc
    out: dict[str, dict[str, float]] = {}
    lat, _ = _measure(probe, None, 2.0)
    out["idle"] = _pcts(lat)
    keys = [_key(i, "shm") for i in range(blocks)]
    gkeys = [_key(i, "grpc") for i in range(blocks)]

    def shm_put() -> None:
        big.batch_put(NS, keys, [value] * blocks)

    def grpc_put() -> None:
        opts = [("grpc.max_send_message_length", 1 << 30)]
        with grpc.insecure_channel(grpc_addr, options=opts) as ch:
            store_pb2_grpc.StoreStub(ch).Put(
                store_pb2.PutRequest(
                    namespace=NS + "-grpc", hashes=b"".join(gkeys), values=[value] * blocks
                ),
                timeout=120,
            )

    def remove_ns() -> None:
        with grpc.insecure_channel(grpc_addr) as ch:
            store_pb2_grpc.StoreStub(ch).RemoveNamespace(
                store_pb2.RemoveNamespaceRequest(namespace=NS + "-grpc"), timeout=120
            )

    for name, fn in (
        (f"shm put x{blocks}", shm_put),
        (f"gRPC Put x{blocks}", grpc_put),
        (f"RemoveNamespace of {blocks}", remove_ns),
    ):
        lat, took = _measure(probe, fn, 0)
        out[name] = {**_pcts(lat), "request_s": took}
    return out


@click.command("contention")
@click.option("--blocks", default=65536, show_default=True, help="Blocks per big request.")
@click.option("--value-size", default=256, show_default=True, help="Bytes per value.")
@click.option("--quick", is_flag=True, help="16,384 blocks per request.")
@click.option("--json", "json_path", default="", help="Write results as JSON here.")
def contention_cmd(blocks: int, value_size: int, quick: bool, json_path: str) -> None:
    """Latency of another client's 1-key EXISTS while a big request runs."""
    if quick:
        blocks = min(blocks, 16384)
    console = Console()
    dram = max(256 << 20, 4 * blocks * max(value_size, 64))
    results: dict[str, dict[str, float]] = {}
    with (
        LocalCluster(workers=1, dram_size=str(dram), max_value_size="1MiB") as cluster,
        Client(cluster.address, transport="shm") as big,
    ):
        big.batch_put(NS, [_key(0, "probe")], [b"x"])
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        probe = ctx.Process(target=_probe, args=(cluster.address, theirs), daemon=True)
        probe.start()
        try:
            assert mine.recv() == "ready"
            results.update(_runs(big, mine, blocks, value_size))
        finally:
            mine.send("quit")
            probe.join(10)
    table = Table(title=f"1-key EXISTS latency of another client ({blocks} blocks per request)")
    for col in ("during", "probes", "p50 ms", "p99 ms", "max ms", "big request s"):
        table.add_column(col, justify="right" if col != "during" else "left")
    for name, r in results.items():
        table.add_row(
            name,
            str(int(r["n"])),
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['max_ms']:.1f}",
            f"{r.get('request_s', 0):.2f}" if "request_s" in r else "-",
        )
    console.print(table)
    console.print("goal: p99 under 20 ms during every big request")
    path = Path(json_path or "bench/results/contention.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"blocks": blocks, "value_size": value_size, **results}, indent=2))
    console.print(f"results: {path}")
