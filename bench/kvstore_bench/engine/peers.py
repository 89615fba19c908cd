"""The engine bench's configurations: what backs the engines' KV cache in each.

Each :class:`Backing` starts what its configuration needs (a kvstore cluster, a
Mooncake master and segment holder, an LMCache server) as child processes on 127.0.0.1,
and says how to configure the engines: a ``kv_transfer_config`` and environment
variables. ``stop()`` ends every process it started, by pid. A configuration that cannot
run here raises :class:`NotRunnable` with the reason, which the report shows as
``ran: false`` / ``why_not``.

Names: ``prefix`` (each engine's own prefix cache), ``kvstore``, ``mooncake``,
``lmcache``, ``offload`` and the ablations ``kvstore-<variant>`` (see :data:`ABLATIONS`).
Every store gets the same memory (``memory_bytes``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.cluster import LocalCluster
from kvstore.config import MAX_VNODES_PER_GIB
from kvstore_client.sharding import DEFAULT_VNODES_PER_GIB, vnode_count

from ..peers import PeerUnavailable, free_port, stop_process, wait_for_port

__all__ = [
    "ABLATIONS",
    "CACHE_SIZE_ENV",
    "CONFIGS",
    "DEFAULT_CONFIGS",
    "KVSTORE_WORKERS",
    "Backing",
    "Context",
    "NotRunnable",
    "make_backing",
]

HOST = "127.0.0.1"
CONFIGS = ("prefix", "kvstore", "mooncake", "lmcache", "offload")
# what runs without --configs: every configuration that runs on this (CPU) platform;
# ``offload``'s engines do not start on it, and a run that fails fails the bench
DEFAULT_CONFIGS = ("prefix", "kvstore", "mooncake", "lmcache")
# One worker, as DESIGN deploys kvstore (one worker per host) and as the peers run one
# store process: the bench is one host. Split over two workers, each evicts by its own
# share of every chain and the store kept 0.4-2.3 points fewer tokens at a quarter of the
# working set (the ablation kvstore-two-workers; docs/BENCHMARKS.md).
KVSTORE_WORKERS = 1

# Ablations of the kvstore configuration: name -> (connector extra config, or None when
# the connector has no knob for it, with the reason). The config's "worker_args" are
# the workers' flags instead, its "workers" their number.
ABLATIONS: dict[str, tuple[dict[str, Any] | None, str]] = {
    "kvstore-load-or-recompute": (
        {"prefill_tokens_per_s": "auto"},
        "load-or-recompute on: prefill_tokens_per_s set to the prefix run's prefill speed "
        "(the default connector always loads)",
    ),
    "kvstore-write-all": (
        {"save_policy": "all"},
        "write every block: save_policy all (the connector also sends blocks the store "
        "had at lookup; the default sends only new ones)",
    ),
    "kvstore-exists-per-block": (
        {"lookup": "per_block"},
        "one exists call per block, in order until the first miss: lookup per_block "
        "(the default is one batched exists per rank namespace)",
    ),
    "kvstore-match-prefix": (
        {"lookup": "prefix"},
        "one match_prefix per rank namespace: lookup prefix",
    ),
    "kvstore-sync-load": (
        {"load_mode": "sync"},
        "synchronous load: load_mode sync (every hit loads before the forward of the step "
        "that schedules the request; the default decides per hit)",
    ),
    "kvstore-async-load": (
        {"load_mode": "async"},
        "asynchronous load: load_mode async (every hit loads between steps; the default "
        "loads a hit inside the step when its load is shorter than the engine's step)",
    ),
    "kvstore-lookup-in-pool": (
        {"lookup_inline": False},
        "every lookup on the connector's lookup threads: lookup_inline false (the default "
        "answers from same-host workers' shared indexes on the scheduler's thread)",
    ),
    "kvstore-lookup-once": (
        {"lookup_max_age_s": 1e9},
        "one lookup per request however long it waits: lookup_max_age_s 1e9 (the default "
        "looks up again when vLLM asks about a request whose lookup is over 0.5 s old)",
    ),
    "kvstore-save-ended": (
        {"save_ended": True},
        "a session's last turn saves its new blocks too: save_ended true (the default "
        "saves nothing for a request whose session hint says ended)",
    ),
    "kvstore-running-first": (
        {"worker_args": ["--session-order", "expected"]},
        "running sessions give way first, then the paused one expected back last (mean "
        "of the pauses the worker saw): worker --session-order expected (the default, "
        "per-session, ranks running and paused sessions alike by each one's own pauses)",
    ),
    "kvstore-paused-recent-first": (
        {"worker_args": ["--session-order", "recent"]},
        "running sessions give way first, then the most recently paused: worker "
        "--session-order recent",
    ),
    "kvstore-two-workers": (
        {"workers": 2},
        "two workers that split the store memory evenly, as `kvstore up` starts them "
        "(the default is --kvstore-workers 1: one worker per host, all the memory in it)",
    ),
    "kvstore-hit-from-head": (
        {"hit_past_local": False},
        "a hit is the store's run from the first block only: hit_past_local false (the "
        "default goes on past the engine's own hit with the store's blocks after it)",
    ),
}


class NotRunnable(RuntimeError):
    """This configuration cannot run here; the message says why. ``min_bytes``: the
    smallest store memory it accepts, when that is the reason (else 0)."""

    def __init__(self, why: str, min_bytes: int = 0) -> None:
        super().__init__(why)
        self.min_bytes = min_bytes


@dataclass(slots=True)
class Context:
    """What every backing needs: where the engine venv's programs are, a scratch and log
    directory, the store memory, the engine block size."""

    engine_python: Path
    work_dir: Path
    memory_bytes: int
    block_size: int
    extra: dict[str, Any] = field(default_factory=dict)
    block_bytes: int = 0  # bytes of one KV block in a store (0: unknown)
    session_hints: bool = True  # the kvstore connector sends the requests' session hints
    ssd: bool = False  # kvstore: half of memory_bytes as DRAM, half as an SSD tier
    kvstore_workers: int = KVSTORE_WORKERS  # the memory is split evenly among them
    saturate: int = 0  # sessions kept busy at once (--saturate); 0: the traces' clock

    @property
    def bin_dir(self) -> Path:
        return self.engine_python.parent

    def log(self, name: str) -> Any:
        return open(self.work_dir / f"{name}.log", "ab")


@dataclass(slots=True)
class Backing:
    """A started configuration: engine settings plus the processes to stop."""

    name: str
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cluster: LocalCluster | None = None
    note: str = ""

    def stop(self) -> None:
        """Stop everything this configuration started (engines are stopped by the caller)."""
        for p in reversed(self.procs):
            stop_process(p)
        self.procs.clear()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def _prefix(ctx: Context) -> Backing:
    return Backing("prefix")


MIN_SLAB = 256 << 10
MAX_SLAB = 16 << 20


def kvstore_slab(block_bytes: int) -> int:
    """The slab (= largest value) a worker gets: the smallest power of two that holds a
    block, at least 256 KiB (16 MiB, the default, when the block size is unknown)."""
    if block_bytes <= 0:
        return MAX_SLAB
    slab = MIN_SLAB
    while slab < block_bytes:
        slab *= 2
    return slab


def kvstore_min_bytes(block_bytes: int, workers: int = KVSTORE_WORKERS) -> int:
    """The least total DRAM the kvstore configuration runs with: one slab per worker."""
    return workers * kvstore_slab(block_bytes)


RING_POINTS = 1024  # a 64 GiB worker's points on the hash ring at the default density


def ring_density(capacity: int) -> int:
    """The master's ``--vnodes-per-gib`` that gives each worker of this capacity the
    ring points of a production (64 GiB) worker: the bench's workers are small, and
    at the floor of 160 points two equal workers' shares can be 55/45 (one evicts
    while the other has room), where 64 GiB workers would be within a point or two."""
    want = -(-RING_POINTS * (1 << 30) // max(1, capacity))
    return max(DEFAULT_VNODES_PER_GIB, min(MAX_VNODES_PER_GIB, want))


def _kvstore(
    ctx: Context,
    extra: dict[str, Any] | None = None,
    name: str = "kvstore",
    worker_args: list[str] | None = None,
    workers: int | None = None,
) -> Backing:
    workers = workers or ctx.kvstore_workers
    slab = kvstore_slab(ctx.block_bytes)
    dram = ctx.memory_bytes // 2 if ctx.ssd else ctx.memory_bytes
    per_worker = dram // workers
    if per_worker < slab:
        least = kvstore_min_bytes(ctx.block_bytes, workers) * (2 if ctx.ssd else 1)
        raise NotRunnable(
            f"{workers} workers need at least one {slab >> 10} KiB slab each "
            f"({least:,} bytes in all{' with half as SSD' if ctx.ssd else ''})",
            least,
        )
    each = per_worker + ((ctx.memory_bytes - dram) // workers if ctx.ssd else 0)
    cluster = LocalCluster(
        workers=0,
        dram_size=str(per_worker),
        max_value_size=str(slab),
        log_dir=str(ctx.work_dir),
        extra_master_args=["--vnodes-per-gib", str(ring_density(each))],
    ).start()
    ssd_note = ""
    try:
        for i in range(workers):
            # An agents-only store: every block belongs to a hinted session, so
            # sessions may hold all of DRAM (the default keeps 3/4 for plain LRU).
            args: list[str] = ["--session-budget", "1.0"] if ctx.session_hints else []
            args += worker_args or []
            if ctx.ssd:  # LMDB pages: the tier's size is what its values may occupy
                ssd_each = (ctx.memory_bytes - dram) // workers
                path = ctx.work_dir / f"ssd{i}"
                args += ["--ssd-path", str(path), "--ssd-size", str(ssd_each)]
                ssd_note = f" + {ssd_each:,} B SSD"
            cluster.add_worker(*args)
        cluster.wait_for_workers(workers)
    except BaseException:
        cluster.stop()
        raise
    cfg: dict[str, Any] = {"master": cluster.address, "lookup_timeout_s": 1.0}
    if not ctx.session_hints:
        cfg["session_hints"] = False
    cfg.update(extra or {})
    return Backing(
        name,
        kv_transfer_config={
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore_client.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": cfg,
        },
        cluster=cluster,
        note=f"{workers} workers x {per_worker:,} B DRAM{ssd_note} (slab {slab >> 10} KiB,"
        f" {vnode_count(each, ring_density(each)):,} ring points each)",
    )


def _need(ctx: Context, module: str, install: str) -> None:
    r = subprocess.run(
        [str(ctx.engine_python), "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise NotRunnable(f"{module} does not import in the engine venv ({last}); {install}")


def _program(ctx: Context, name: str, install: str) -> str:
    path = ctx.bin_dir / name
    if not path.exists():
        raise NotRunnable(f"{path} is missing; {install}")
    return str(path)


def _wait(
    ctx: Context, name: str, port: int, proc: subprocess.Popen[bytes], timeout: float
) -> None:
    """Wait for ``proc`` to listen on ``port``; NotRunnable with its log's last line."""
    try:
        wait_for_port(HOST, port, proc, timeout)
    except PeerUnavailable as e:
        try:
            lines = (ctx.work_dir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        last = next((ln.strip() for ln in reversed(lines) if ln.strip()), str(e))
        raise NotRunnable(f"{name} did not start: {last[:300]}") from e


MOONCAKE_INSTALL = (
    "install it with `.venv-e2e/bin/pip install --no-deps mooncake-transfer-engine-non-cuda`"
)


# mooncake_client 0.3.13 cannot allocate a segment under 16 MiB ("Failed to allocate
# segment memory", then a failed check): 15.99 MiB fails, 16 MiB runs (probed here).
MOONCAKE_MIN_SEGMENT = 16 << 20


def _mooncake(ctx: Context) -> Backing:
    """Mooncake Store over TCP: ``mooncake_master`` with its HTTP metadata server, one
    ``mooncake_client`` process holding the whole segment, engines in standalone-store
    mode (they mount no memory of their own)."""
    if ctx.memory_bytes < MOONCAKE_MIN_SEGMENT:
        raise NotRunnable(
            f"mooncake_client cannot allocate a segment of {ctx.memory_bytes:,} bytes "
            f"(its least is {MOONCAKE_MIN_SEGMENT >> 20} MiB)",
            MOONCAKE_MIN_SEGMENT,
        )
    _need(ctx, "mooncake.store", MOONCAKE_INSTALL)
    master_bin = _program(ctx, "mooncake_master", MOONCAKE_INSTALL)
    client_bin = _program(ctx, "mooncake_client", MOONCAKE_INSTALL)
    b = Backing("mooncake")
    try:
        rpc, http, meta_port = free_port(), free_port(), free_port()
        with ctx.log("mooncake-master") as log:
            b.procs.append(
                subprocess.Popen(
                    [
                        master_bin,
                        f"--rpc_address={HOST}",
                        f"--rpc_port={rpc}",
                        f"--metrics_host={HOST}",
                        f"--metrics_port={free_port()}",
                        "--enable_metric_reporting=false",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_host={HOST}",
                        f"--http_metadata_server_port={meta_port}",
                        "--logtostderr",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            )
        _wait(ctx, "mooncake-master", rpc, b.procs[-1], 60)
        _wait(ctx, "mooncake-master", meta_port, b.procs[-1], 60)
        metadata = f"http://{HOST}:{meta_port}/metadata"
        with ctx.log("mooncake-client") as log:
            b.procs.append(
                subprocess.Popen(
                    [
                        client_bin,
                        f"--master_server_address={HOST}:{rpc}",
                        f"--metadata_server={metadata}",
                        "--protocol=tcp",
                        f"--host={HOST}",
                        f"--port={http}",
                        f"--http_port={free_port()}",
                        f"--global_segment_size={ctx.memory_bytes}",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            )
        _wait(ctx, "mooncake-client", http, b.procs[-1], 60)
        conf = ctx.work_dir / "mooncake.json"
        conf.write_text(
            json.dumps(
                {
                    "local_hostname": HOST,
                    "metadata_server": metadata,
                    "master_server_address": f"{HOST}:{rpc}",
                    "protocol": "tcp",
                    "device_name": "",
                    "global_segment_size": 0,
                    "local_buffer_size": 64 << 20,
                    "mode": "standalone-store",
                }
            )
        )
        b.env["MOONCAKE_CONFIG_PATH"] = str(conf)
        b.kv_transfer_config = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
        }
        b.note = f"mooncake_client holds {ctx.memory_bytes:,} B"
        return b
    except BaseException:
        b.stop()
        raise


LMCACHE_INSTALL = (
    "install it with `.venv-e2e/bin/pip install --no-deps lmcache==0.5.6 sortedcontainers "
    "aiofile caio`"
)


def _lmcache(ctx: Context) -> Backing:
    """An ``lmcache server`` holding ``memory_bytes`` of CPU memory; engines use vLLM's
    ``LMCacheMPConnector`` (chunk size = the engine block size)."""
    _need(ctx, "lmcache", LMCACHE_INSTALL)
    exe = _program(ctx, "lmcache", LMCACHE_INSTALL)
    port = free_port()
    gib = ctx.memory_bytes / (1 << 30)
    b = Backing("lmcache")
    try:
        with ctx.log("lmcache-server") as log:
            b.procs.append(
                subprocess.Popen(
                    [
                        exe,
                        "server",
                        "--host",
                        HOST,
                        "--port",
                        str(port),
                        "--chunk-size",
                        str(ctx.block_size),
                        "--l1-size-gb",
                        f"{gib:.6f}",
                        "--eviction-policy",
                        "LRU",
                        "--supported-transfer-mode",
                        "auto",
                        "--disable-observability",
                        "--http-host",
                        HOST,
                        "--http-port",
                        str(free_port()),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            )
        _wait(ctx, "lmcache-server", port, b.procs[-1], 120)
        b.kv_transfer_config = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": HOST, "lmcache.mp.port": port},
        }
        b.note = f"lmcache server, {ctx.memory_bytes:,} B L1, chunk {ctx.block_size}"
        return b
    except BaseException:
        b.stop()
        raise


def _offload(ctx: Context) -> Backing:
    """vLLM's native CPU offloading; its engines fail at start on the CPU platform, which
    the caller reports as the reason."""
    return Backing(
        "offload",
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": ctx.memory_bytes},
        },
    )


def make_backing(name: str, ctx: Context) -> Backing:
    """Start configuration ``name``; NotRunnable when it cannot run here."""
    makers: dict[str, Callable[[Context], Backing]] = {
        "prefix": _prefix,
        "kvstore": _kvstore,
        "mooncake": _mooncake,
        "lmcache": _lmcache,
        "offload": _offload,
    }
    if name in makers:
        return makers[name](ctx)
    if name in ABLATIONS:
        extra, why = ABLATIONS[name]
        if extra is None:
            raise NotRunnable(why)
        extra = dict(extra)
        worker_args = [str(a) for a in extra.pop("worker_args", [])]
        workers = int(extra.pop("workers", 0)) or None
        if extra.get("prefill_tokens_per_s") == "auto":
            speed = ctx.extra.get("prefill_tokens_per_s")
            if not speed:
                raise NotRunnable("needs the prefix run's prefill speed (run `prefix` first)")
            extra["prefill_tokens_per_s"] = float(speed)
        return _kvstore(ctx, extra, name, worker_args, workers)
    raise ValueError(f"unknown configuration {name!r}")


# Environment variables that would set an engine's KV cache size behind the bench's back:
# vLLM's CPU platform replaces ``kv_cache_memory_bytes`` with VLLM_CPU_KVCACHE_SPACE GiB
# when it is set (vllm/platforms/cpu.py, "Legacy setting"). The bench says the size.
CACHE_SIZE_ENV = ("VLLM_CPU_KVCACHE_SPACE",)


def engine_env(
    backing: Backing, pythonpath: list[str], scratch: Path | None = None
) -> dict[str, str]:
    """Environment of an engine process of this configuration.

    ``scratch``: the engine's own temp directory (TMPDIR, and vLLM's
    VLLM_RPC_BASE_PATH where its IPC sockets go, e.g. the Mooncake store connector's
    ``lookup_rpc_port_0_host_..._dp_rank0``, a name two engines on one host would
    share) and its own VLLM_PORT. Variables of :data:`CACHE_SIZE_ENV` are dropped: the
    engine's KV cache is the bench's ``kv_cache_bytes``."""
    env = dict(os.environ)
    for k in CACHE_SIZE_ENV:
        env.pop(k, None)
    env.update(backing.env)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_HOST_IP", HOST)  # what Mooncake's engines announce: loopback only
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")])
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
        for k in ("TMPDIR", "TMP", "TEMP", "VLLM_RPC_BASE_PATH"):
            env[k] = str(scratch)
        env["VLLM_PORT"] = str(free_port())
    return env
