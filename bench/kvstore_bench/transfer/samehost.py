"""Same-host points of ``kvstore bench transfer``: multi-part blocks (``--parts``) and
prefix-lookup latency (``--match-prefix``).

``--parts 1,8,80``: per transport (tcp, shm, ucx) and part count, ``batch_put_parts`` of fresh
keys and ``batch_get_into_parts`` of a stored working set, each block split into N near-equal
views of one pre-faulted engine-like buffer (no staging copies). Reports GiB/s, that
against the one-part point, and CPU seconds per GiB (this process plus the workers,
counted while the clock runs). The ceilings (memcpy, one bare socket stream, and as
many streams at once as frames a batch is cut into, when more than one) are measured
three times in the run and reported with their spread. With ``--vs mooncake``,
Mooncake Store over TCP moves the same part lists with ``batch_put_from_multi_buffers``
/ ``batch_get_into_multi_buffers`` in the same run.

``--match-prefix``: ``match_prefix`` of a fully stored 1,000-block chain in a loop, p50 /
p99 per call, the chain passed as a list of hashes and as :class:`kvstore_client.Keys`
(packed and checked once), the two taking turns call by call: one and two workers on
this host (through their shared indexes, and over tcp:// for comparison), and two
workers of which one does not share its arena (``--no-share-arena``: reached over
tcp:// as a remote worker would be).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.cluster import LocalCluster
from kvstore.config import format_size, parse_size
from kvstore.console import make_console
from kvstore_client import Client, Keys
from kvstore_client.routing import FRAME_BYTES

from ..peers import MooncakeServer, MooncakeStoreAdapter, PeerUnavailable, cpu_seconds
from . import ceilings
from .systems import worker_args

GIB = float(1 << 30)
NS = "bench/samehost/b0/tp0of1"


def _cpu(pids: list[int]) -> float:
    return cpu_seconds(None) + sum(cpu_seconds(p) for p in pids)


def ceilings_3x(total: int, streams: int = 1) -> dict[str, Any]:
    """memcpy and one socket stream, three runs each, with their spread; with
    ``streams`` > 1 also that many socket streams at once (three runs)."""
    mem = [ceilings.memcpy_gib_s(min(total, 256 << 20), 0.3, 1) for _ in range(3)]
    sock = [ceilings.socket_stream_gib_s(min(total, 512 << 20), 1) for _ in range(3)]
    out: dict[str, Any] = {
        "memcpy_gib_s": mem,
        "socket_gib_s": sock,
        "memcpy_median": float(np.median(mem)),
        "socket_median": float(np.median(sock)),
    }
    if streams > 1:
        many = [ceilings.socket_streams_gib_s(streams, min(total, 512 << 20), 1) for _ in range(3)]
        out["socket_streams"] = {str(streams): {"runs": many, "median": float(np.median(many))}}
    return out


def _timed(fn: Callable[[], None], reps: int, nbytes: int, pids: list[int]) -> dict[str, float]:
    c0, t0 = _cpu(pids), time.perf_counter()
    for _ in range(reps):
        fn()
    dt, cpu = time.perf_counter() - t0, _cpu(pids) - c0
    moved = reps * nbytes / GIB
    return {"gib_s": moved / dt, "cpu_s_per_gib": cpu / moved}


def parts_points(
    cluster: LocalCluster,
    transports: list[str],
    counts: list[int],
    block: int,
    batch: int,
    total: int,
) -> list[dict[str, Any]]:
    """The --parts sweep; one dict per (transport, op, parts)."""
    pids = [d.pid for d in cluster.worker_procs]
    engine = np.random.default_rng(1).integers(0, 255, (batch, block), dtype=np.uint8)
    reps = max(4, total // (batch * block))
    out: list[dict[str, Any]] = []
    for tr in transports:
        with Client(cluster.address, transport=tr) as c:
            for n in counts:
                cut = [j * block // n for j in range(n + 1)]  # N near-equal parts
                views = [[row[cut[j] : cut[j + 1]].data for j in range(n)] for row in engine]
                stored = [os.urandom(16) for _ in range(batch)]
                c.batch_put_parts(NS, stored, views)

                def put(views: list[list[memoryview]] = views) -> None:
                    keys = [os.urandom(16) for _ in range(batch)]
                    assert all(c.batch_put_parts(NS, keys, views))
                    c.remove(NS, keys)

                def get(
                    views: list[list[memoryview]] = views, stored: list[bytes] = stored
                ) -> None:
                    assert all(c.batch_get_into_parts(NS, stored, views).result())

                for op, fn in (("put", put), ("get", get)):
                    r = _timed(fn, reps, batch * block, pids)
                    out.append({"transport": tr, "op": op, "parts": n, "block": block, **r})
                c.remove(NS, stored)
    return _relative(out)


def mooncake_parts_points(
    counts: list[int], block: int, batch: int, total: int, dram: int
) -> list[dict[str, Any]]:
    """Mooncake's multi-buffer calls on the same part lists (one segment host, TCP);
    PeerUnavailable when Mooncake is not installed or does not start."""
    engine = np.random.default_rng(1).integers(0, 255, (batch, block), dtype=np.uint8)
    reps = max(4, total // (batch * block))
    out: list[dict[str, Any]] = []
    errors = [0]  # blocks a call failed, per point
    with (
        MooncakeServer(segment_size=dram) as server,
        MooncakeStoreAdapter(server.master_address) as mc,
    ):
        mc.register(engine)
        base = int(engine.ctypes.data)
        for n in counts:
            cut = [j * block // n for j in range(n + 1)]
            ptrs = [[base + i * block + cut[j] for j in range(n)] for i in range(batch)]
            sizes = [[cut[j + 1] - cut[j] for j in range(n)] for _ in range(batch)]
            stored = [os.urandom(16).hex() for _ in range(batch)]
            mc.store.batch_put_from_multi_buffers(stored, ptrs, sizes)

            def put(ptrs: list[list[int]] = ptrs, sizes: list[list[int]] = sizes) -> None:
                keys = [os.urandom(16).hex() for _ in range(batch)]
                got = mc.store.batch_put_from_multi_buffers(keys, ptrs, sizes)
                errors[0] += sum(r != 0 for r in got)
                mc.store.batch_remove(keys, True)

            def get(
                ptrs: list[list[int]] = ptrs,
                sizes: list[list[int]] = sizes,
                keys: list[str] = stored,
            ) -> None:
                got = mc.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
                errors[0] += sum(r != block for r in got)

            for op, fn in (("put", put), ("get", get)):
                errors[0] = 0
                r = _timed(fn, reps, batch * block, server.pids)
                out.append(
                    {"transport": "mooncake", "op": op, "parts": n, "block": block, **r}
                    | {"errors": errors[0]}
                )
            mc.store.batch_remove(stored, True)
        mc.unregister(engine)
    return _relative(out)


def _relative(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point's GiB/s over its one-part point (itself when 1 was not measured)."""
    for p in out:
        one = next(
            q for q in out if (q["transport"], q["op"], q["parts"]) == (p["transport"], p["op"], 1)
        ) if any(q["parts"] == 1 for q in out) else p  # fmt: skip
        p["x_one_part"] = p["gib_s"] / one["gib_s"]
    return out


def lookup_point(
    cluster: LocalCluster, blocks: int = 1000, calls: int = 3000, transport: str = "auto"
) -> dict[str, Any]:
    """match_prefix of a stored ``blocks``-long chain over the cluster's workers."""
    keys = [os.urandom(16) for _ in range(blocks)]
    packed = Keys(keys)
    lat = np.empty((2, calls))  # a list of hashes, then the same chain as Keys
    with Client(cluster.address, transport=transport) as c:
        c.batch_put(NS, keys, [b"x" * 64] * blocks)
        for _ in range(200):  # warm connections
            c.match_prefix(NS, keys)
        for i in range(calls):  # the two forms take turns: the same load on each
            for j, chain in enumerate((keys, packed)):
                t0 = time.perf_counter()
                k = c.match_prefix(NS, chain)
                lat[j, i] = time.perf_counter() - t0
                assert k == blocks, f"match_prefix found {k} of {blocks}"
        c.remove(NS, keys)
    return {
        "blocks": blocks,
        "workers": len(cluster.worker_procs),
        "transport": transport,
        "calls": calls,
        "p50_ms": float(np.percentile(lat[0], 50) * 1e3),
        "p99_ms": float(np.percentile(lat[0], 99) * 1e3),
        "keys_p50_ms": float(np.percentile(lat[1], 50) * 1e3),
        "keys_p99_ms": float(np.percentile(lat[1], 99) * 1e3),
    }


def lookup_points(dram: str) -> list[dict[str, Any]]:
    """The lookup cases: every worker on this host (its shared index: no round trip),
    the same over tcp://, and two workers of which one does not share its arena (a
    remote worker as the client sees it: tcp://)."""
    out = []
    for workers, shared in ((1, 1), (2, 2), (2, 1)):
        with LocalCluster(workers=shared, dram_size=dram) as cluster:
            if workers > shared:
                cluster.add_worker("--no-share-arena")
                cluster.wait_for_workers(workers)
            for t in ("tcp", "auto") if workers == shared else ("auto",):
                pt = lookup_point(cluster, transport=t)
                if t == "tcp":
                    pt["case"] = f"{workers} over tcp://"
                elif workers == shared:
                    pt["case"] = f"{workers} same-host"
                else:
                    pt["case"] = f"{shared} same-host + 1 remote"
                out.append(pt)
    return out


def main(
    transports: list[str], parts: list[int], match_prefix: bool, block: int, batch: int,
    total: int, dram: str | None, out_dir: str, vs: list[str],
) -> None:  # fmt: skip
    """``kvstore bench transfer --parts / --match-prefix``: a table and a JSON file."""
    console = make_console()
    result: dict[str, Any] = {"benchmark": "transfer-samehost", "load": os.getloadavg()}
    if match_prefix:
        lks = result["match_prefix"] = lookup_points(dram or "256MiB")
        for lk in lks:
            console.print(f"match_prefix of {lk['blocks']} blocks, {lk['case']}: "
                          f"p50 {lk['p50_ms'] * 1e3:.0f} us, p99 {lk['p99_ms'] * 1e3:.0f} us; "
                          f"as Keys p50 {lk['keys_p50_ms'] * 1e3:.0f} us, "
                          f"p99 {lk['keys_p99_ms'] * 1e3:.0f} us")  # fmt: skip
    if parts:
        # One worker, one client thread: a batch goes out in FRAME_BYTES frames at once.
        ceil = result["ceilings"] = ceilings_3x(total, -(-block * batch // FRAME_BYTES))
        extra = worker_args(transports)
        with LocalCluster(workers=1, dram_size=dram or "1GiB", extra_worker_args=extra) as cluster:
            pts = result["parts"] = parts_points(cluster, transports, parts, block, batch, total)
        if "mooncake" in vs:
            try:
                pts += mooncake_parts_points(parts, block, batch, total, parse_size(dram or "1GiB"))
            except PeerUnavailable as e:
                console.print(f"[yellow]note:[/] mooncake skipped: {e}")
        console.print("ceilings, 3 runs each: memcpy " + ", ".join(
            f"{x:.2f}" for x in ceil["memcpy_gib_s"]) + " GiB/s; socket " + ", ".join(
            f"{x:.2f}" for x in ceil["socket_gib_s"]) + " GiB/s" + "".join(
            f"; {n} streams " + ", ".join(f"{x:.2f}" for x in v["runs"]) + " GiB/s"
            for n, v in ceil.get("socket_streams", {}).items()))  # fmt: skip
        for p in pts:
            console.print(f"{p['transport']:>4} {p['op']} {format_size(p['block'])} in "
                          f"{p['parts']:>3} parts: {p['gib_s']:.2f} GiB/s "
                          f"({p['x_one_part']:.0%} of one part), "
                          f"{p['cpu_s_per_gib']:.2f} CPU s/GiB"
                          + (f", {p['errors']} failed" if p.get("errors") else ""))  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"transfer-samehost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    console.print(f"results: {path}")
