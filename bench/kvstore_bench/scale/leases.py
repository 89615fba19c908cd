"""The alternative to streamed heartbeats: worker leases in etcd (`kvstore bench scale
--etcd-leases`).

Each simulated worker grants an etcd lease of the master's TTL and puts its key
``/kvstore-leases/workers/<id>`` on it; keep-alives go to etcd (one LeaseKeepAlive
stream per connection of ``per_connection`` workers, one request per worker and
interval, as etcd clients send them); a master would only watch the prefix and
publish the map when a key appears or vanishes. This measures what that design costs
and how it holds up on a busy host, in the same shape as the Beats run:

1. all workers grant a lease and put their key (the registration);
2. steady state: etcd's CPU per second and per keep-alive, keep-alives answered,
   and every key etcd deleted meanwhile (a lease that expired: a worker that would
   have left the map) as seen by a watch on the prefix, the master's whole work;
3. 1% of the workers stop their keep-alives: time until the watch sees every key go.

Nothing here is kvstore code: it is the design the issue asked to consider, measured
with the etcd the HA masters use (the etcd v3 gRPC API through the generated stubs
of etcd-sdk-python, as kvstore.master.etcd uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kvstore.cluster import start_etcd

from .sim import sim_info

try:
    from pyetcd.etcdrpc import kv_pb2 as _kv  # type: ignore[import-untyped,import-not-found]
    from pyetcd.etcdrpc import rpc_pb2 as _rpc  # type: ignore[import-untyped,import-not-found]
    from pyetcd.etcdrpc import (  # type: ignore[import-untyped,import-not-found]
        rpc_pb2_grpc as _rpc_grpc,
    )
except ImportError:  # pragma: no cover - an install without etcd-sdk-python
    _rpc = _rpc_grpc = _kv = None

__all__ = ["run_leases"]

PREFIX = b"/kvstore-leases/workers/"
PREFIX_END = b"/kvstore-leases/workers0"  # "/" + 1


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class _Watch:
    """The master's side of the lease design: one watch on the prefix."""

    def __init__(self) -> None:
        self.deleted: list[tuple[bytes, float]] = []
        self.put = 0

    async def run(self, ch: grpc.aio.Channel) -> None:
        stream = _rpc_grpc.WatchStub(ch).Watch()
        create = _rpc.WatchCreateRequest(key=PREFIX, range_end=PREFIX_END)
        await stream.write(_rpc.WatchRequest(create_request=create))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for resp in stream:
                for ev in resp.events:
                    if ev.type == _kv.Event.DELETE:
                        self.deleted.append((bytes(ev.kv.key), time.monotonic()))
                    else:
                        self.put += 1


class _Conn:
    """``per_connection`` workers' leases kept alive on one LeaseKeepAlive stream."""

    def __init__(self, ch: grpc.aio.Channel, ids: list[str]) -> None:
        self.ch = ch
        self.ids = ids
        self.leases: list[int] = []
        self.paused: set[int] = set()
        self.sent = 0
        self.answered = 0
        self.expired_answers = 0  # answers with TTL <= 0: etcd says the lease is gone

    async def register(self, ttl: int) -> None:
        lease = _rpc_grpc.LeaseStub(self.ch)
        kv = _rpc_grpc.KVStub(self.ch)
        for wid in self.ids:
            g = await lease.LeaseGrant(_rpc.LeaseGrantRequest(TTL=ttl), timeout=30)
            info = sim_info(int(wid.rsplit("-", 1)[1])).SerializeToString()
            await kv.Put(
                _rpc.PutRequest(key=PREFIX + wid.encode(), value=info, lease=g.ID), timeout=30
            )
            self.leases.append(int(g.ID))

    async def keep_alive(self, interval: float) -> None:
        await asyncio.sleep(random.random() * interval)
        while True:
            stream = _rpc_grpc.LeaseStub(self.ch).LeaseKeepAlive()
            reader = asyncio.create_task(self._read(stream))
            try:
                nxt = time.monotonic()
                while not reader.done():
                    for i, lid in enumerate(self.leases):
                        if i not in self.paused:
                            await stream.write(_rpc.LeaseKeepAliveRequest(ID=lid))
                            self.sent += 1
                    nxt += interval
                    await asyncio.wait([reader], timeout=max(0.0, nxt - time.monotonic()))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass
            finally:
                stream.cancel()
                reader.cancel()
            await asyncio.sleep(0.2)

    async def _read(self, stream: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for resp in stream:
                self.answered += 1
                if resp.TTL <= 0:
                    self.expired_answers += 1


async def _scenario(url: str, pid: int, workers: int, per: int, interval: float,
                    steady_s: float, fail_fraction: float, say: Any) -> dict[str, Any]:  # fmt: skip
    addr = url.removeprefix("http://")
    ttl = max(2, round(4 * interval))
    ids = [sim_info(i).id for i in range(workers)]
    chans = [grpc.aio.insecure_channel(addr) for _ in range(-(-workers // per))]
    conns = [_Conn(chans[k], ids[k * per : (k + 1) * per]) for k in range(len(chans))]
    res: dict[str, Any] = {"mode": "etcd-leases", "workers": workers, "lease_ttl_s": ttl}
    watch = _Watch()
    wch = grpc.aio.insecure_channel(addr)
    tasks = [asyncio.create_task(watch.run(wch))]
    say(f"etcd leases: {workers} workers grant leases")
    t0, c0 = time.monotonic(), _cpu(pid)
    sem = asyncio.Semaphore(16)

    async def reg(c: _Conn) -> None:
        async with sem:
            await c.register(ttl)
        tasks.append(asyncio.create_task(c.keep_alive(interval)))

    await asyncio.gather(*(reg(c) for c in conns))
    res["register_s"] = time.monotonic() - t0
    res["register_etcd_cpu_s"] = _cpu(pid) - c0
    say(f"etcd leases: steady state {steady_s:.0f}s")
    await asyncio.sleep(min(2.0, steady_s / 4))
    sent0 = sum(c.sent for c in conns)
    ans0 = sum(c.answered for c in conns)
    del0 = len(watch.deleted)
    p0, t1, c1 = time.process_time(), time.monotonic(), _cpu(pid)
    await asyncio.sleep(steady_s)
    dt = time.monotonic() - t1
    sent = sum(c.sent for c in conns) - sent0
    res["steady_s"] = dt
    res["etcd_cpu_per_s"] = (_cpu(pid) - c1) / dt
    res["keepalives_per_s"] = sent / dt
    res["keepalives_answered_ratio"] = (sum(c.answered for c in conns) - ans0) / sent if sent else 0
    res["etcd_cpu_per_keepalive_s"] = (_cpu(pid) - c1) / sent if sent else float("nan")
    res["simulator_cpu_per_s"] = (time.process_time() - p0) / dt
    res["leases_expired_steady"] = len(watch.deleted) - del0
    n_fail = max(1, round(fail_fraction * workers))
    say(f"etcd leases: {n_fail} workers stop their keep-alives")
    rnd = random.Random(7)
    failed = set()
    for k in rnd.sample(range(workers), n_fail):
        conns[k // per].paused.add(k % per)
        failed.add(PREFIX + ids[k].encode())
    tf = time.monotonic()
    deadline = tf + 4 * ttl + 10
    while time.monotonic() < deadline:
        gone = {key for key, _ in watch.deleted}
        if failed <= gone:
            break
        await asyncio.sleep(0.05)
    when = {key: t for key, t in watch.deleted if key in failed}
    res["fail_count"] = n_fail
    res["fail_detected_s"] = max(when.values()) - tf if len(when) == n_fail else float("nan")
    res["leases_expired_healthy"] = len([k for k, _ in watch.deleted if k not in failed])
    res["expired_answers"] = sum(c.expired_answers for c in conns)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in [*chans, wch]:
        await ch.close(None)
    return res


def run_leases(workers: int, per: int, interval: float, steady_s: float, fail_fraction: float,
               say: Any) -> dict[str, Any]:  # fmt: skip
    """The lease design at ``workers`` workers on a fresh etcd; see the module doc."""
    if _rpc is None:
        return {"mode": "etcd-leases", "error": "etcd-sdk-python is not installed"}
    with tempfile.TemporaryDirectory(prefix="kvleases-") as tmp:
        etcd = start_etcd(Path(tmp), name="kvleases")
        try:
            scenario = _scenario(
                etcd.url, etcd.proc.pid, workers, per, interval, steady_s, fail_fraction, say
            )
            return asyncio.run(scenario)
        finally:
            etcd.stop()
