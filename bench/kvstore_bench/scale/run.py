"""`kvstore bench scale`: the control plane at 1,000 workers.

A real master process (``python -m kvstore master``; with ``--ha`` three masters on
a real etcd) and, in this process on asyncio, simulated workers and map watchers:

1. ``workers`` simulated workers (:mod:`.sim`) register and heartbeat at the
   configured interval (the master's ``--worker-ttl`` is four intervals),
   ``per_connection`` of them per gRPC connection, by default batched on one Beats
   stream per connection;
2. ``watchers`` clients open the Master's WatchShardMap stream (as
   ``kvstore_client.Client`` does, asking for deltas) and time every map version
   they receive;
3. steady state: master CPU seconds per second and per heartbeat (from
   ``/proc/PID/stat``), RSS, map size;
4. map changes (a worker joins, then leaves): time until each watcher has the new
   map (p50/p99 over watchers and changes, and the time until all have it);
5. 1% of the workers stop heartbeating at once (expired after the TTL), then return.

With ``background_load`` N busy processes run beside it all (:mod:`.load`); the
master's own count of heartbeats applied (its metrics endpoint) gives the share of
the simulated workers' heartbeats that it served.

The client's ring at the same size is measured by :mod:`.ring` (build time, per-key
lookup, placement balance with mixed capacities, keys moved when 1% of workers leave);
:mod:`.cli` prints the table, JSON and PNG plots under ``bench/results/``, which
docs/SCALE.md reads against the goals.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import grpc
import numpy as np

from kvstore.cluster import Daemon, Etcd, StartError, free_port, spawn, start_etcd
from kvstore_client.proto import master_pb2, master_pb2_grpc

from .. import report
from .leases import run_leases
from .load import BackgroundLoad, heartbeats_served, scrape
from .sim import (
    CALL_TIMEOUT,
    BeatLog,
    Datagrams,
    SimWorker,
    Watcher,
    connection_loop,
    map_version,
    sim_info,
    worker_loop,
    worker_rpc,
)

__all__ = ["PROTOCOLS", "ScaleConfig", "map_version", "run_scale", "sim_info", "worker_rpc"]

PER_CHANNEL = 10  # watchers per gRPC connection
PROTOCOLS = ("datagrams", "beats", "stream", "unary")  # how the simulated workers heartbeat


@dataclass(slots=True)
class ScaleConfig:
    workers: int = 1000
    watchers: int = 1000
    heartbeat_s: float = 1.0
    steady_s: float = 20.0
    changes: int = 10
    change_gap_s: float = 1.0
    fail_fraction: float = 0.01
    ring_keys: int = 2_000_000
    ha: bool = True
    # datagrams: Beats streams binding for datagram beats (as kvstore worker does);
    # beats: one Beats stream per connection, no datagrams; stream: a HeartbeatStream
    # per worker; unary: a Heartbeat call per beat (the protocols before Beats)
    protocol: str = "datagrams"
    per_connection: int = 10  # simulated workers per gRPC connection
    deltas: bool = True  # watchers ask for map deltas (False: full maps, older clients)
    etcd_leases: bool = False  # also measure worker leases in etcd (see .leases)
    background_load: int = 0  # busy processes beside the run (see .load)
    log_dir: str | None = None  # keep the masters' (and etcd's) logs here, per mode


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


ETCD_METRICS = (
    "etcd_server_proposals_committed_total",
    "etcd_mvcc_put_total",
    "etcd_mvcc_delete_total",
    "etcd_mvcc_txn_total",
)


def _start_etcd(workdir: Path) -> Etcd:
    try:
        return start_etcd(workdir, name="kvscale")
    except StartError as e:
        raise click.ClickException(str(e)) from e


@contextlib.contextmanager
def masters(
    cfg: ScaleConfig, workdir: Path, ha: bool
) -> Iterator[tuple[list[Daemon], Etcd | None, list[str]]]:
    """One in-memory master, or an etcd and three HA masters; with their metrics URLs."""
    ttl = f"{4 * cfg.heartbeat_s:g}s"
    etcd = _start_etcd(workdir) if ha else None
    ds: list[Daemon] = []
    urls: list[str] = []
    try:
        for i in range(3 if ha else 1):
            mport = free_port()
            args = ["--host", "127.0.0.1", "--port", "0", "--worker-ttl", ttl]
            args += ["--metrics-port", str(mport)]
            if etcd is not None:
                args += ["--etcd", etcd.url]
            # a loaded host (--background-load) can take more than the default 30 s
            log = str(workdir / f"master{i}.log")
            ds.append(spawn("master", args, log_path=log, timeout=120))
            urls.append(f"http://127.0.0.1:{mport}/metrics")
        yield ds, etcd, urls
    finally:
        for d in ds:
            d.stop()
        if etcd is not None:
            etcd.stop()


# ---------------------------------------------------------------- one run


def _channel(addr: str) -> grpc.aio.Channel:
    # a connection of its own (no subchannel sharing between channels)
    return grpc.aio.insecure_channel(
        addr,
        options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)],
    )


async def _leader(addrs: list[str]) -> int:
    while True:
        for i, a in enumerate(addrs):
            async with _channel(a) as ch:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    st = await master_pb2_grpc.MasterStub(ch).ClusterStatus(
                        master_pb2.ClusterStatusRequest(), timeout=2
                    )
                    if st.leader:
                        return i
        await asyncio.sleep(0.2)


def _delivery(watchers: list[Watcher], t0: float, v: int) -> list[float]:
    """Seconds from ``t0`` until each watcher had a map of version >= ``v``
    (NaN for a watcher that never got it)."""
    out = []
    for w in watchers:
        t = w.first_at_least(v)
        out.append(max(0.0, t - t0) if t is not None else float("nan"))
    return out


async def _until(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return False


class _Sampler:
    """Samples CPU and RSS of the master processes every ``every`` seconds."""

    def __init__(self, pids: list[int], every: float = 0.5) -> None:
        self.pids = pids
        self.every = every
        self.samples: list[tuple[float, list[float], list[int]]] = []

    def sample(self) -> tuple[float, list[float], list[int]]:
        s = (
            time.monotonic(),
            [cpu_seconds(p) for p in self.pids],
            [rss_bytes(p) for p in self.pids],
        )
        self.samples.append(s)
        return s

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every)


async def _served(urls: tuple[str, ...]) -> float:
    return await asyncio.to_thread(heartbeats_served, urls)


# The leader's counters recorded over the run (datagram results, binding results, deaf
# time, expiries, heartbeats), by the prefix of their samples
REQUEST_DURATION = "kvstore_request_duration_seconds"
MASTER_COUNTERS = (
    REQUEST_DURATION,
    "kvstore_master_beat_datagrams_total",
    "kvstore_master_beat_bindings_total",
    "kvstore_master_deaf_seconds_total",
    "kvstore_workers_expired_total",
    "kvstore_heartbeats_total",
)


async def _counters(url: str | None) -> dict[str, float]:
    """The leader's MASTER_COUNTERS now ({} without a metrics URL or an answer)."""
    if url is None:
        return {}
    try:
        s = await asyncio.to_thread(scrape, url)
    except OSError:
        return {}
    return {k: v for k, v in s.items() if k.startswith(MASTER_COUNTERS)}


def _register_time(delta: dict[str, float]) -> dict[str, float]:
    """The master's time serving Register (request in to answer out, the commit
    included) over a run, from its histogram's delta: calls, mean, and the bucket
    bounds that hold half and 99% of them."""
    op = 'op="register"'
    count = next((v for k, v in delta.items() if k.startswith(f"{REQUEST_DURATION}_count")
                  and op in k), 0.0)  # fmt: skip
    total = next((v for k, v in delta.items() if k.startswith(f"{REQUEST_DURATION}_sum")
                  and op in k), 0.0)  # fmt: skip
    buckets = []
    for k, v in delta.items():
        if k.startswith(f"{REQUEST_DURATION}_bucket") and op in k:
            le = k.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), v))
    buckets.sort()
    out = {"calls": count, "mean_s": total / count if count else 0.0}
    for name, q in (("p50_le_s", 0.5), ("p99_le_s", 0.99)):
        out[name] = next((le for le, c in buckets if count and c >= q * count), float("nan"))
    return out


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: v - a.get(k, 0.0) for k, v in b.items() if v != a.get(k, 0.0)}


def udp_kernel(ports: set[int]) -> dict[str, int]:
    """The host's UDP counters (/proc/net/snmp: InDatagrams, RcvbufErrors, InErrors)
    and the drops of the sockets bound to ``ports`` (/proc/net/udp and udp6)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        with open("/proc/net/snmp") as fh:
            rows = [line.split() for line in fh if line.startswith("Udp:")]
        if len(rows) >= 2:
            snmp = dict(zip(rows[0][1:], rows[1][1:], strict=False))
            for k in ("InDatagrams", "RcvbufErrors", "InErrors"):
                out[k] = int(snmp.get(k, 0))
    drops = 0
    for path in ("/proc/net/udp", "/proc/net/udp6"):
        with contextlib.suppress(OSError), open(path) as fh:
            for line in list(fh)[1:]:
                f = line.split()
                if len(f) > 12 and int(f[1].rsplit(":", 1)[1], 16) in ports:
                    drops += int(f[-1])
    out["socket_drops"] = drops
    return out


async def _run_mode(
    cfg: ScaleConfig,
    addrs: list[str],
    pids: list[int],
    etcd: Etcd | None,
    say: Any,
    metric_urls: tuple[str, ...] = (),
) -> dict[str, Any]:
    mode = "ha" if etcd is not None else "single"
    lead = await _leader(addrs) if etcd is not None else 0
    res: dict[str, Any] = {"mode": mode, "masters": len(addrs), "leader": lead}
    sampler = _Sampler(pids)
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(sampler.run())]
    per = max(1, cfg.per_connection)
    wchans = [_channel(addrs[lead]) for _ in range(-(-cfg.workers // per))]
    sims = [
        SimWorker(sim_info(i), master_pb2_grpc.MasterStub(wchans[i // per]))
        for i in range(cfg.workers)
    ]
    etcd0 = etcd.metric(ETCD_METRICS) if etcd is not None else {}
    t_start = time.monotonic()

    # 1. registration storm; each worker heartbeats from its registration on
    say(f"{mode}: {cfg.workers} workers register")
    sem = asyncio.Semaphore(64)
    served0 = await _served(metric_urls)
    lead_url = metric_urls[lead] if lead < len(metric_urls) else None
    k0 = await _counters(lead_url)
    udp0 = udp_kernel(set())
    udp = Datagrams(addrs[lead].rpartition(":")[0]) if cfg.protocol == "datagrams" else None
    batched = cfg.protocol in ("beats", "datagrams")
    blog = BeatLog(gap_s=2 * cfg.heartbeat_s)
    if batched:
        conns = [sims[i : i + per] for i in range(0, len(sims), per)]
        tasks += [
            asyncio.create_task(connection_loop(c, cfg.heartbeat_s, udp, blog)) for c in conns
        ]

    async def reg(w: SimWorker) -> None:
        async with sem:
            await worker_rpc(w, register=True)
        if not batched:
            unary = cfg.protocol == "unary"
            tasks.append(asyncio.create_task(worker_loop(w, cfg.heartbeat_s, unary)))

    c0 = sampler.sample()
    await asyncio.gather(*(reg(w) for w in sims))
    c1 = sampler.sample()
    res["register_s"] = c1[0] - c0[0]
    res["register_cpu_s"] = sum(c1[1]) - sum(c0[1])
    sent_reg, t_reg = sum(w.heartbeats for w in sims), time.monotonic()

    # 2. watchers, spread over the masters
    say(f"{mode}: {cfg.watchers} watchers connect")
    nv = max(1, -(-cfg.watchers // PER_CHANNEL))
    vchans = [_channel(addrs[i % len(addrs)]) for i in range(nv)]
    watchers = [Watcher() for _ in range(cfg.watchers)]
    tasks += [
        asyncio.create_task(w.run(vchans[i % nv], cfg.deltas)) for i, w in enumerate(watchers)
    ]
    async with _channel(addrs[lead]) as ch:
        stub = master_pb2_grpc.MasterStub(ch)
        first = await stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=CALL_TIMEOUT)
        res["map_bytes"] = first.ByteSize()
        res["map_workers"] = len(first.workers)
        res["watch_connect_s"] = float("nan")
        t0 = time.monotonic()
        if await _until(lambda: all(w.version >= first.version for w in watchers), 120):
            res["watch_connect_s"] = time.monotonic() - t0

        # 3. steady state
        say(f"{mode}: steady state {cfg.steady_s:.0f}s")
        await asyncio.sleep(min(2.0, cfg.steady_s / 4))
        e0 = etcd.metric(ETCD_METRICS) if etcd is not None else {}
        sv0 = await _served(metric_urls)
        ks0 = await _counters(lead_url)
        hb0 = sum(w.heartbeats for w in sims)
        u0 = udp.sent if udp is not None else 0
        p0 = time.process_time()
        s0 = sampler.sample()
        await asyncio.sleep(cfg.steady_s)
        s1 = sampler.sample()
        hbs = sum(w.heartbeats for w in sims) - hb0
        sv1 = await _served(metric_urls)
        res["master_counters_steady"] = _delta(ks0, await _counters(lead_url))
        e1 = etcd.metric(ETCD_METRICS) if etcd is not None else {}
        res["heartbeats_served_steady_ratio"] = (sv1 - sv0) / hbs if hbs else float("nan")
        dt = s1[0] - s0[0]
        cpu = [b - a for a, b in zip(s0[1], s1[1], strict=True)]
        res["steady_s"] = dt
        res["simulator_cpu_per_s"] = (time.process_time() - p0) / dt
        res["heartbeats_per_s"] = hbs / dt
        # beats sent as datagrams (a slot not yet confirmed beats on the stream too)
        res["datagrams_per_heartbeat"] = (udp.sent - u0) / hbs if udp is not None and hbs else 0.0
        res["master_cpu_per_s"] = cpu[lead] / dt
        res["master_cpu_per_heartbeat_s"] = cpu[lead] / hbs if hbs else float("nan")
        res["standby_cpu_per_s"] = [c / dt for i, c in enumerate(cpu) if i != lead]
        res["master_rss_bytes"] = s1[2][lead]
        res["standby_rss_bytes"] = [r for i, r in enumerate(s1[2]) if i != lead]
        if etcd is not None:
            res["etcd_steady"] = {k: (e1[k] - e0[k]) / dt for k in ETCD_METRICS}

        # 4. map changes: one worker joins, then leaves, and so on
        say(f"{mode}: {cfg.changes} map changes")
        extra = SimWorker(sim_info(cfg.workers, tag="extra"), stub)
        events: list[dict[str, Any]] = []
        for k in range(cfg.changes):
            t0 = time.monotonic()
            if k % 2 == 0:
                v = await worker_rpc(extra, register=True)
            else:
                await stub.Leave(
                    master_pb2.LeaveRequest(worker_id=extra.info.id, instance=extra.instance),
                    timeout=CALL_TIMEOUT,
                )
                v = (
                    await stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=CALL_TIMEOUT)
                ).version
            await _until(lambda v=v: all(w.version >= v for w in watchers), 10 * cfg.change_gap_s)
            d = _delivery(watchers, t0, v)
            events.append(
                {"kind": "join" if k % 2 == 0 else "leave", "version": v, "delivery_s": d}
            )
            await asyncio.sleep(max(0.0, cfg.change_gap_s - (time.monotonic() - t0)))
        if cfg.changes % 2:
            await stub.Leave(
                master_pb2.LeaveRequest(worker_id=extra.info.id, instance=extra.instance),
                timeout=CALL_TIMEOUT,
            )
        res["changes"] = events
        all_d = [x for e in events for x in e["delivery_s"]]
        finite = [x for x in all_d if x == x]
        res["delivery_p50_s"], res["delivery_p99_s"] = report.percentiles(finite, (50, 99))
        res["delivery_all_p50_s"], res["delivery_all_p99_s"] = report.percentiles(
            [max(e["delivery_s"]) for e in events], (50, 99)
        )
        res["delivery_missed"] = len(all_d) - len(finite)

        # 5. 1% of the workers fail at once, then return
        n_fail = max(1, round(cfg.fail_fraction * cfg.workers))
        say(f"{mode}: {n_fail} workers stop heartbeating")
        await asyncio.sleep(1.0)
        v_before = max(w.version for w in watchers)
        failed = random.Random(7).sample(sims, n_fail)
        tf = time.monotonic()
        for w in failed:
            w.paused = True
        ok = await _until(
            lambda: all(w.version > v_before for w in watchers), 8 * cfg.heartbeat_s + 10
        )
        res["fail_count"] = n_fail
        res["fail_all_watchers_s"] = time.monotonic() - tf if ok else float("nan")
        live = await stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=CALL_TIMEOUT)
        res["fail_map_workers"] = len(live.workers)
        d = _delivery(watchers, tf, v_before + 1)
        first_seen = min(x for x in d if x == x) if any(x == x for x in d) else float("nan")
        res["fail_publish_spread_s"] = max(d) - first_seen
        await asyncio.sleep(1.0)
        say(f"{mode}: {n_fail} workers return")
        tr = time.monotonic()
        for w in failed:
            w.paused = False

        async def back() -> bool:
            m = await stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=CALL_TIMEOUT)
            return len(m.workers) == cfg.workers

        ok = False
        while time.monotonic() - tr < 4 * cfg.heartbeat_s + 10:
            if await back():
                ok = True
                break
            await asyncio.sleep(0.05)
        if ok:
            final = (
                await stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=CALL_TIMEOUT)
            ).version
            await _until(lambda: all(w.version >= final for w in watchers), 10)
        res["return_all_watchers_s"] = time.monotonic() - tr if ok else float("nan")
        await asyncio.sleep(1.0)
        end = await stub.GetShardMap(master_pb2.GetShardMapRequest(), timeout=CALL_TIMEOUT)
        res["workers_in_map_end"] = len(end.workers)
        sent, end_t = sum(w.heartbeats for w in sims), time.monotonic()
        served = await _served(metric_urls) - served0
        # served: what the master applied / what the simulated workers sent (from the
        # registrations to the end of the run); due: what they sent after all had
        # registered / one per unpaused worker and interval over that time (below 1
        # when the simulator or a master's backoff slowed the beats down)
        res["heartbeats_sent"] = sent
        res["heartbeats_served"] = served
        res["heartbeats_served_ratio"] = served / sent if sent else float("nan")
        worker_s = cfg.workers * (end_t - t_reg) - n_fail * (tr - tf)
        res["heartbeats_sent_per_due"] = (sent - sent_reg) / (worker_s / cfg.heartbeat_s)
        # what went on with the beats (docs/SCALE.md, "Datagram beats"): the leader's
        # counters over the run, the kernel's UDP counters, what the simulated workers
        # were told and how late they sent, by 5 s from the start of the registrations
        counters = _delta(k0, await _counters(lead_url))
        res["master_register_s"] = _register_time(counters)  # the leader's own Register time
        res["master_counters"] = {
            k: v for k, v in counters.items() if not k.startswith(REQUEST_DURATION)
        }
        udp1 = udp_kernel(udp.ports if udp is not None else set())
        res["udp_kernel"] = {
            k: v - udp0.get(k, 0) if k != "socket_drops" else v for k, v in udp1.items()
        }
        res["datagrams_sent"] = udp.sent if udp is not None else 0
        res["datagrams_send_failed"] = udp.failed if udp is not None else 0
        res["registered_at_s"] = t_reg - t_start

        def per5(ts: list[float]) -> dict[int, int]:
            out: dict[int, int] = {}
            for t in ts:
                k = int((t - t_start) // 5) * 5
                out[k] = out.get(k, 0) + 1
            return out

        ttl_s = 4 * cfg.heartbeat_s
        res["sim"] = {
            "lost": len(blog.lost_at),
            "lost_by_5s": per5(blog.lost_at),
            "unknown": len(blog.unknown_at),
            "unknown_by_5s": per5(blog.unknown_at),
            "gaps_over_2_intervals": len(blog.gaps),
            "gaps_by_5s": per5([t for t, _ in blog.gaps]),
            "gap_max_s": max((g for _, g in blog.gaps), default=0.0),
            "send_late_max_s": blog.late_max,
            "send_late_over_1s": blog.late_over_1s,
            # per worker's first registration: Register out -> answer in, answer ->
            # its first beat out (the master's TTL runs from its reading the Register)
            "register_answer_s": _spread([w.answered_at - w.asked_at for w in sims], ttl_s),
            "answer_to_first_beat_s": _spread(
                [w.first_beat_at - w.answered_at for w in sims], ttl_s
            ),
            "register_to_first_beat_s": _spread(
                [w.first_beat_at - w.asked_at for w in sims], ttl_s
            ),
        }

    s_end = sampler.sample()
    res["total_s"] = s_end[0] - t_start
    res["total_cpu_s"] = [b - a for a, b in zip(c0[1], s_end[1], strict=True)]
    if etcd is not None:
        e_end = etcd.metric(ETCD_METRICS)
        res["etcd_total"] = {k: e_end[k] - etcd0[k] for k in ETCD_METRICS}
        res["etcd_writes_per_s_run"] = (
            e_end["etcd_server_proposals_committed_total"]
            - etcd0["etcd_server_proposals_committed_total"]
        ) / res["total_s"]
    res["watch_bytes"] = sum(w.bytes for w in watchers)
    res["samples"] = [{"t": t - t_start, "cpu_s": c, "rss": r} for t, c, r in sampler.samples]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in [*wchans, *vchans]:
        await ch.close(None)
    if udp is not None:
        udp.close()
    return res


def _log_tails(workdir: Path, lines: int = 20) -> dict[str, list[str]]:
    """The last ``lines`` lines of each log under ``workdir`` (a failed start)."""
    out = {}
    for p in sorted(workdir.glob("*.log")):
        with contextlib.suppress(OSError):
            out[p.name] = p.read_text(errors="replace").splitlines()[-lines:]
    return out


def _spread(xs: list[float], ttl: float) -> dict[str, float]:
    """p50, p99, max and how many passed ``ttl`` of the finite ``xs``."""
    v = np.array([x for x in xs if x == x], dtype=float)
    if not len(v):
        return {"n": 0}
    p50, p99 = np.percentile(v, [50, 99])
    return {"n": len(v), "p50": float(p50), "p99": float(p99), "max": float(v.max()),
            "over_ttl": int((v > ttl).sum())}  # fmt: skip


def _keep_logs(workdir: Path, dest: Path) -> str:
    """Copy the logs of a mode's run (the masters', etcd's) to ``dest``; its path."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(workdir.glob("*.log")):
        shutil.copyfile(p, dest / p.name)
    return str(dest)


def run_scale(cfg: ScaleConfig, *, modes: tuple[str, ...], say: Any) -> list[dict[str, Any]]:
    """Run the control-plane scenario once per mode ("single", "ha"), then with
    ``cfg.etcd_leases`` the lease design (:mod:`.leases`), with
    ``cfg.background_load`` busy processes beside it all the whole time."""
    out = []
    with BackgroundLoad(cfg.background_load):
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="kvscale-") as tmp:
                try:
                    with masters(cfg, Path(tmp), mode == "ha") as (ds, etcd, urls):
                        addrs, pids = [d.address for d in ds], [d.pid for d in ds]
                        res = asyncio.run(_run_mode(cfg, addrs, pids, etcd, say, tuple(urls)))
                except StartError as e:  # on a loaded host: say so, go on with the next mode
                    res = {"mode": mode, "error": str(e), "logs": _log_tails(Path(tmp))}
                res["load_average"] = os.getloadavg()
                if cfg.log_dir is not None:
                    res["logs_kept"] = _keep_logs(Path(tmp), Path(cfg.log_dir) / mode)
                out.append(res)
        if cfg.etcd_leases:
            res = run_leases(
                cfg.workers, cfg.per_connection, cfg.heartbeat_s, cfg.steady_s,
                cfg.fail_fraction, say,
            )  # fmt: skip
            res["load_average"] = os.getloadavg()
            out.append(res)
    return out
