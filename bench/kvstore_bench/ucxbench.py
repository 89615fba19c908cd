"""ucx:// versus tcp:// throughput, 1 MiB blocks, in the same run.

    python -m kvstore_bench.ucxbench [--total 512MiB] [--batch 16] [--rounds 3]

A server process holds one BlockStore and serves it over both transports (a
TcpTransferServer and a UcxTransferServer on 127.0.0.1); this process is the
client. Rounds alternate the transports so a neighbour's load hits both alike.
Per round and transport: PUT ``--total`` bytes of fresh blocks in batches of
``--batch`` (one frame each), GET them back into preallocated buffers (checked
byte-exact once), then REMOVE them. Prints GiB/s (2**30 bytes per second of
wall time) and CPU seconds per GiB (client + server process; steadier than GiB/s
on a shared host) for every round and the best of each; ``--json`` prints one
JSON object instead. Without ucxx only tcp:// is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore_client.transport import ucx as ucx_client
from kvstore_client.transport.tcp import GetResult, TcpConnection, TcpPool

GIB = float(1 << 30)
MIB = 1 << 20
NS = b"bench/ucx/b0/tp0of1"
TIMEOUT = 30.0

Cpu = Callable[[], float]
Put = Callable[[list[bytes], list[memoryview], list[int]], bytes]
Get = Callable[[list[bytes], list[memoryview]], GetResult]
Remove = Callable[[list[bytes]], int]


# ---- server process -----------------------------------------------------------------


def serve(dram: int, block: int) -> None:
    """Serve one BlockStore over tcp:// and (when ucxx loads) ucx:// on 127.0.0.1.

    Prints ``{"tcp": port, "ucx": port | null}`` on stdout, then serves until stdin
    closes.
    """
    from kvstore.worker.arena import Arena
    from kvstore.worker.store import BlockStore
    from kvstore.worker.transfer.tcp import TcpTransferServer

    arena = Arena(dram - dram % block, "/dev/shm")
    tcp: Any = None
    ucx: Any = None
    try:
        store = BlockStore(arena, block)
        tcp = TcpTransferServer(store, "127.0.0.1", 0)
        tcp.start()
        if ucx_client.available():
            from kvstore.worker.transfer.ucx import UcxTransferServer

            ucx = UcxTransferServer(store, "127.0.0.1", 0)
            ucx.start()
        print(json.dumps({"tcp": tcp.port, "ucx": ucx.port if ucx else None}), flush=True)
        sys.stdin.read()
    finally:
        if ucx is not None:
            ucx.stop(1.0)
        if tcp is not None:
            tcp.stop(1.0)
        arena.close()


@contextlib.contextmanager
def server_process(dram: int, block: int) -> Iterator[dict[str, int | None]]:
    """Start :func:`serve` in a child process; yields its ports (and "pid"); always
    stops it."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [here, os.path.join(here, "client"), os.path.join(here, "bench")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore_bench.ucxbench", "--serve", "--dram", str(dram)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the bench server exited before it was ready")
        ports = json.loads(line)
        ports["pid"] = proc.pid
        yield ports
    finally:
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            for f in glob.glob(f"/dev/shm/kvstore-{proc.pid}-*"):
                os.unlink(f)  # a killed server cannot remove its arena


# ---- measurement ----------------------------------------------------------------------


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (``pid`` None) or of child ``pid``."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _batches(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(i + size, n))


def measure(
    put: Put, get: Get, remove: Remove, total: int, block: int, batch: int, cpu: Cpu
) -> dict[str, float]:
    """One round on one transport: PUT, GET (checked), REMOVE ``total`` bytes.

    Returns GiB/s and CPU seconds per GiB moved (``cpu()``: client + server CPU
    seconds so far) for PUT and GET; AssertionError when a block does not come back
    byte-exact or a PUT is refused.
    """
    n = max(1, total // block)
    rng = np.random.default_rng()
    data = rng.integers(0, 256, size=(n, block), dtype=np.uint8)
    keys = [os.urandom(16) for _ in range(n)]
    views = [memoryview(data[i]) for i in range(n)]
    sums = [xxhash.xxh3_64_intdigest(v) for v in views]
    out = np.zeros_like(data)
    dests = [memoryview(out[i]) for i in range(n)]
    c0, t0 = cpu(), time.perf_counter()
    for s in _batches(n, batch):
        status = put(keys[s], views[s], sums[s])
        assert status == bytes(len(status)), f"PUT refused: {status!r}"
    c1, t1 = cpu(), time.perf_counter()
    for s in _batches(n, batch):
        res = get(keys[s], dests[s])
        assert all(res.found), "a block stored a moment ago missed"
    c2, t2 = cpu(), time.perf_counter()
    assert np.array_equal(data, out), "GET did not return the bytes PUT stored"
    for s in _batches(n, 1024):
        remove(keys[s])
    moved = n * block / GIB
    return {
        "put_gib_s": moved / (t1 - t0),
        "get_gib_s": moved / (t2 - t1),
        "put_cpu_s_per_gib": (c1 - c0) / moved,
        "get_cpu_s_per_gib": (c2 - c1) / moved,
    }


def run(total: int, batch: int, rounds: int, block: int = MIB) -> dict[str, Any]:
    """Start a server process and measure each transport ``rounds`` times, alternating.

    Returns ``{"rounds": [{round, transport, put_gib_s, get_gib_s, put_cpu_s_per_gib,
    get_cpu_s_per_gib}], "best": {transport: {the highest GiB/s, the lowest CPU s/GiB}},
    "ucx": bool, ...}``.
    """
    dram = max(2 * total, 64 * MIB) + 16 * block
    results: list[dict[str, Any]] = []
    with server_process(dram, block) as ports:
        tcp_pool = TcpPool("127.0.0.1", int(ports["tcp"] or 0))
        transports: dict[str, tuple[Put, Get, Remove]] = {
            "tcp": (
                lambda h, v, c: tcp_pool.call(TIMEOUT, TcpConnection.put, NS, h, v, c),
                lambda h, d: tcp_pool.call(TIMEOUT, TcpConnection.get, NS, h, d),
                lambda h: tcp_pool.call(TIMEOUT, TcpConnection.remove, NS, h),
            )
        }
        ucx_pool: ucx_client.UcxPool | None = None
        if ports.get("ucx"):
            pool = ucx_pool = ucx_client.UcxPool("127.0.0.1", int(ports["ucx"] or 0))
            transports["ucx"] = (
                lambda h, v, c: pool.put(TIMEOUT, NS, h, v, c),
                lambda h, d: pool.get(TIMEOUT, NS, h, d),
                lambda h: pool.remove(TIMEOUT, NS, h),
            )
        try:
            pid = int(ports["pid"] or 0)

            def cpu() -> float:
                return cpu_seconds() + cpu_seconds(pid)

            for put, get, remove in transports.values():  # warm-up: connect, fault in
                measure(put, get, remove, min(total, 16 * block), block, batch, cpu)
            for r in range(rounds):
                for name, (put, get, remove) in transports.items():
                    res = measure(put, get, remove, total, block, batch, cpu)
                    results.append({"round": r, "transport": name, **res})
        finally:
            tcp_pool.close()
            if ucx_pool is not None:
                ucx_pool.close()
    best: dict[str, dict[str, float]] = {}
    for row in results:
        b = best.setdefault(row["transport"], {})
        for k in ("put_gib_s", "get_gib_s"):
            b[k] = max(b.get(k, 0.0), row[k])
        for k in ("put_cpu_s_per_gib", "get_cpu_s_per_gib"):
            b[k] = min(b.get(k, float("inf")), row[k])
    return {
        "block_bytes": block,
        "batch": batch,
        "total_bytes": total,
        "rounds": results,
        "best": best,
        "ucx": "ucx" in best,
    }


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    t = text.strip().lower()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total", default="256MiB", help="bytes per round and transport")
    p.add_argument("--batch", type=int, default=16, help="blocks per frame")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dram", default=str(512 * MIB), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(_size(a.dram), MIB)
        return 0
    out = run(_size(a.total), a.batch, a.rounds)
    if a.json:
        print(json.dumps(out))
        return 0
    if not out["ucx"]:
        print("ucxx is not importable: measuring tcp:// only (pip install 'kvstore-cache[ucx]')")
    print(
        f"{'round':>5} {'transport':>9} {'put GiB/s':>10} {'get GiB/s':>10} "
        f"{'put CPU s/GiB':>14} {'get CPU s/GiB':>14}"
    )
    for row in out["rounds"]:
        print(
            f"{row['round']:>5} {row['transport']:>9} "
            f"{row['put_gib_s']:>10.3f} {row['get_gib_s']:>10.3f} "
            f"{row['put_cpu_s_per_gib']:>14.2f} {row['get_cpu_s_per_gib']:>14.2f}"
        )
    for name, b in out["best"].items():
        print(
            f"best {name}: put {b['put_gib_s']:.3f} GiB/s, get {b['get_gib_s']:.3f} GiB/s; "
            f"CPU s/GiB put {b['put_cpu_s_per_gib']:.2f}, get {b['get_cpu_s_per_gib']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
