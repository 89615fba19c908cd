"""`kvstore bench contention`: does one client's huge request stall everyone else's lookups?

A probe client sends 1-key EXISTS frames over tcp:// back to back and records their
latency, first alone, then while another client runs each big request in turn:
65,536-block shm:// and tcp:// puts and gets, a 65,536-value gRPC Put, session hints
growing one chain to 262,144 blocks (four of 65,536; each walks the whole chain) and
pausing it, the session's own client cutting that chain at depth 0 in a loop (a new
turn, then a cut notice: each cut walks the whole chain), and a RemoveNamespace of
524,288 blocks (``--quick``: 16,384 / 65,536 / 65,536). The worker processes big
requests in slices (``slice_keys`` per hold of its store lock, granted first come,
first served), so the probe's p99 should stay under 50 ms. Runs against a local
cluster it starts (one worker); ``--only cuts`` runs one point (and what it needs).
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
from rich.table import Table

from kvstore.cluster import LocalCluster
from kvstore.console import make_console
from kvstore_client import Client
from kvstore_client.proto import store_pb2, store_pb2_grpc
from kvstore_client.security import metadata

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
    conn: Connection, work: Callable[[], object] | None, seconds: float
) -> tuple[list[float], float, object]:
    conn.send("mark")
    conn.recv()  # what the probe saw before: discarded
    t0 = time.perf_counter()
    got: object = None
    if work is None:
        time.sleep(seconds)
    else:
        got = work()
    took = time.perf_counter() - t0
    conn.send("mark")
    lat: list[float] = conn.recv()
    return lat, took, got


def _done(got: object) -> float:
    """Blocks the big request handled: stored or found (-1: not a list)."""
    if isinstance(got, list):
        return float(sum(1 for x in got if x is not None and x is not False))
    return -1.0


def _pcts(lat: list[float]) -> dict[str, float]:
    a = np.array(lat or [0.0]) * 1e3
    return {
        "n": len(lat),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


CUTS = 8  # cuts of the long chain in the cut point


def _runs(
    big: Client,
    tcp: Client,
    probe: Connection,
    blocks: int,
    value_size: int,
    removal: int,
    only: str = "",
) -> dict[str, dict[str, float]]:
    value = os.urandom(value_size)
    grpc_addr = big.workers()[0].grpc
    out: dict[str, dict[str, float]] = {}
    lat, _, _ = _measure(probe, None, 2.0)
    out["idle"] = _pcts(lat)
    keys = [_key(i, "shm") for i in range(blocks)]
    tkeys = [_key(i, "tcp") for i in range(blocks)]
    gkeys = [_key(i, "grpc") for i in range(blocks)]
    chain = [_key(i, "chain") for i in range(4 * blocks)]
    rkeys = [_key(i, "rm") for i in range(removal)]

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
                store_pb2.RemoveNamespaceRequest(namespace=NS + "-rm"), timeout=300
            )

    def hint_chain() -> None:  # hints are incremental: the chain grows by a batch each
        for i in range(0, len(chain), blocks):
            tcp.session_hint(NS, "long", "active", hashes=chain[: i + blocks])
        tcp.session_hint(NS, "long", "paused", ttl=60)  # a tool call: the chain changes state

    def cut_chain() -> None:
        """The chain's own client (its identity) cuts it at depth 0, CUTS times, each
        after a new turn (a cut no shallower than the last is ignored until then). The
        chain's blocks were never written: the cost is the walk, not the drops."""
        with grpc.insecure_channel(grpc_addr) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            for turn in range(5, 5 + CUTS):  # the hint point made 4 turns
                tcp.session_hint(NS, "long", "active")
                cut = store_pb2.SessionCut(namespace=NS, session_id="long", depth=0, turn=turn)
                stub.SessionHint(
                    store_pb2.SessionHintRequest(
                        namespace=NS, session_id="cutter", state="active", cuts=[cut]
                    ),
                    metadata=metadata(None, tcp.identity),
                    timeout=120,
                )

    def fill_removal() -> None:  # not measured
        step = 1 << 16
        for i in range(0, removal, step):
            tcp.batch_put(NS + "-rm", rkeys[i : i + step], [value] * len(rkeys[i : i + step]))

    points: list[tuple[str, Callable[[], object]]] = [
        (f"shm put x{blocks}", lambda: big.batch_put(NS, keys, [value] * blocks)),
        (f"shm get x{blocks}", lambda: big.batch_get(NS, keys)),
        (f"tcp put x{blocks}", lambda: tcp.batch_put(NS, tkeys, [value] * blocks)),
        (f"tcp get x{blocks}", lambda: tcp.batch_get(NS, tkeys)),
        (f"gRPC Put x{blocks}", grpc_put),
        (f"session hints + pause, {len(chain)}-block chain", hint_chain),
        (f"{CUTS} turns + cuts at depth 0 of the {len(chain)}-block chain", cut_chain),
        (f"RemoveNamespace of {removal}", remove_ns),
    ]
    if only:
        keep = {n for n, _ in points if only in n}
        if any("cuts" in n for n in keep):  # the chain to cut comes from the hint point
            keep.add(points[5][0])
        points = [(n, f) for n, f in points if n in keep]
    for name, fn in points:
        if name.startswith("RemoveNamespace"):
            fill_removal()
        lat, took, got = _measure(probe, fn, 0)
        out[name] = {**_pcts(lat), "request_s": took, "blocks_done": _done(got)}
    return out


@click.command("contention")
@click.option("--blocks", default=65536, show_default=True, help="Blocks per big request.")
@click.option("--value-size", default=256, show_default=True, help="Bytes per value.")
@click.option(
    "--removal",
    default=0,
    help="Blocks of the namespace removed in the last point [8 x blocks, 4 x quick].",
)
@click.option("--quick", is_flag=True, help="16,384 blocks per request.")
@click.option(
    "--only", default="", help="Run only the points whose name contains this text (e.g. cuts)."
)
@click.option("--json", "json_path", default="", help="Write results as JSON here.")
def contention_cmd(
    blocks: int, value_size: int, removal: int, quick: bool, only: str, json_path: str
) -> None:
    """Latency of another client's 1-key EXISTS while a big request runs."""
    if quick:
        blocks = min(blocks, 16384)
    removal = removal or (4 if quick else 8) * blocks
    console = make_console()
    slot = max(value_size, 64)
    dram = max(256 << 20, (4 * blocks + removal) * slot * 5 // 4)
    results: dict[str, dict[str, float]] = {}
    with (
        LocalCluster(workers=1, dram_size=str(dram), max_value_size="1MiB") as cluster,
        Client(cluster.address, transport="shm") as big,
        Client(cluster.address, transport="tcp") as tcp,
    ):
        big.batch_put(NS, [_key(0, "probe")], [b"x"])
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        probe = ctx.Process(target=_probe, args=(cluster.address, theirs), daemon=True)
        probe.start()
        try:
            assert mine.recv() == "ready"
            results.update(_runs(big, tcp, mine, blocks, value_size, removal, only))
        finally:
            mine.send("quit")
            probe.join(10)
    table = Table(title=f"1-key EXISTS latency of another client ({blocks} blocks per request)")
    for col in ("during", "probes", "p50 ms", "p99 ms", "max ms", "big request s", "blocks ok"):
        table.add_column(col, justify="right" if col != "during" else "left")
    for name, r in results.items():
        table.add_row(
            name,
            str(int(r["n"])),
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['max_ms']:.1f}",
            f"{r.get('request_s', 0):.2f}" if "request_s" in r else "-",
            f"{int(r['blocks_done'])}" if r.get("blocks_done", -1) >= 0 else "-",
        )
    console.print(table)
    console.print("goal: p99 under 50 ms during every big request")
    path = Path(json_path or "bench/results/contention.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"blocks": blocks, "value_size": value_size, "removal": removal, **results}, indent=2
        )
    )
    console.print(f"results: {path}")
