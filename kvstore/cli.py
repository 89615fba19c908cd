"""The ``kvstore`` command: master, worker, up, status, check, demo, version, bench.

Errors a user can cause (a port in use, a bad size, a master that does not answer,
an unreadable certificate) end the command with one line on stderr and a non-zero
exit, never a traceback; ``--log-level debug`` adds the traceback for bug reports.
``kvstore bench`` is loaded only when it is run, so the daemons and the container
image (which leaves ``bench/`` out) never import the benchmark package.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import json
import logging
import os
import signal
import socket
import ssl
import sys
from typing import Any

import click

from kvstore_client import __version__
from kvstore_client.errors import KVStoreError

from . import procs
from .config import (
    DIST_NAME,
    Config,
    check_tls_files,
    check_worker_files,
    format_size,
    load_config,
)
from .console import make_console

log = logging.getLogger("kvstore.cli")

# Subcommands loaded on first use: name -> ("module:attribute", what to install if missing).
# Installed distributions add more through the entry-point group "kvstore.commands"
# (pyproject.toml declares `bench` there); this table also serves a source checkout run
# with PYTHONPATH, where no entry points are installed.
ENTRY_POINT_GROUP = "kvstore.commands"
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "kvstore_bench.cli:bench",
        f"the benchmarks ship with a source checkout: pip install -e '.[bench]' "
        f"(package {DIST_NAME})",
    ),
}


def _rpc_text(e: Any) -> str:
    """'UNAVAILABLE: failed to connect to all addresses; ...' from a grpc.RpcError."""
    code = e.code().name if hasattr(e, "code") and e.code() is not None else "ERROR"
    details = e.details() if hasattr(e, "details") else ""
    return " ".join(f"{code}: {details}".split())


def one_line(e: BaseException) -> str:
    """A user-facing, single-line description of an error."""
    import grpc

    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        text = _rpc_text(e)
    elif isinstance(e, ssl.SSLError):
        text = f"TLS: {e.reason or e}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def _lazy_commands() -> dict[str, tuple[str, str]]:
    """The built-in lazy commands plus those of installed entry points."""
    from importlib.metadata import entry_points

    out = dict(LAZY_COMMANDS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        hint = out.get(ep.name, ("", f"reinstall the package that provides {ep.value}"))[1]
        out[ep.name] = (ep.value, hint)
    return out


class KvstoreGroup(click.Group):
    """The top-level group: lazy subcommands and one-line errors."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_lazy_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        builtin = super().get_command(ctx, cmd_name)
        if builtin is not None:
            return builtin
        lazy = _lazy_commands()
        if cmd_name not in lazy:
            return None
        target, hint = lazy[cmd_name]
        module, attr = target.split(":")
        try:
            cmd = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            reason = f"kvstore {cmd_name} is not installed here ({e}); {hint}"

            def unavailable(**_: Any) -> None:
                raise click.ClickException(reason)

            return click.Command(
                cmd_name,
                callback=unavailable,
                help="(not installed)",
                context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
            )
        assert isinstance(cmd, click.Command)
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            raise click.Abort() from None
        except Exception as e:
            import grpc

            if not isinstance(e, KVStoreError | OSError | grpc.RpcError | RuntimeError):
                raise
            log.debug("%s failed", ctx.invoked_subcommand, exc_info=True)
            raise click.ClickException(one_line(e)) from None


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class ConfigError(click.ClickException):
    """A bad setting: one line, exit code 2 (like a usage error)."""

    exit_code = 2


def _config(ctx: click.Context, section: str, flags: dict[str, Any]) -> Config:
    return _config_sections(ctx, {section: flags})


def _config_sections(ctx: click.Context, flags: dict[str, dict[str, Any]]) -> Config:
    try:
        return load_config(ctx.obj.get("config"), flags)
    except KVStoreError as e:
        raise ConfigError(str(e)) from e


def check_ports(host: str, ports: list[tuple[int, str]]) -> None:
    """Fail with one line when a fixed port is taken, naming the port and its flag.

    Binds and closes each port > 0 the way the daemons bind it (SO_REUSEADDR, no
    SO_REUSEPORT), so what fails here would fail there; ports of 0 are picked later.
    """
    bind_host = host or "0.0.0.0"
    for port, flag in ports:
        if port <= 0:
            continue
        try:
            with socket.create_server((bind_host, port), reuse_port=False):
                pass
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                zero = "0 turns it off" if flag == "--metrics-port" else "0 picks a free port"
                raise click.ClickException(
                    f"port {port} on {bind_host} is already in use: stop what holds it or "
                    f"choose another with {flag} ({zero})"
                ) from None
            if e.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
                raise click.ClickException(
                    f"cannot listen on {bind_host}:{port} ({flag}, --host): {e.strerror}"
                ) from None
            if isinstance(e, socket.gaierror):
                raise click.ClickException(
                    f"cannot resolve --host {bind_host!r}: {e.strerror}"
                ) from None
            raise


def _security_options(f: Any) -> Any:
    for opt in reversed(
        [
            click.option("--tls-cert", default=None, help="PEM certificate (enables TLS)."),
            click.option("--tls-key", default=None, help="PEM private key."),
            click.option("--tls-ca", default=None, help="CA bundle that signed the peers."),
            click.option(
                "--tls-client-auth/--no-tls-client-auth",
                default=None,
                help="Mutual TLS: require client certificates.",
            ),
            click.option(
                "--tenants-file",
                default=None,
                help="YAML tenants: tokens, namespaces, quotas (enables auth).",
            ),
        ]
    ):
        f = opt(f)
    return f


@click.group(cls=KvstoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="KVSTORE_CONFIG",
    help="YAML config file (sections master:, worker:).",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="info",
    show_default=True,
    envvar="KVSTORE_LOG_LEVEL",
)
@click.version_option(__version__, "--version", prog_name="kvstore", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, log_level: str) -> None:
    """kvstore: a distributed KV-cache store for LLM inference."""
    ctx.ensure_object(dict)
    ctx.obj["config"] = config_file
    log_level = log_level.lower()
    os.environ["KVSTORE_LOG_LEVEL"] = log_level  # daemons this command starts log alike
    if config_file:
        os.environ["KVSTORE_CONFIG"] = config_file  # ... and read the same file
    _setup_logging(log_level)


def _set_config(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
    if value:
        ctx.ensure_object(dict)
        ctx.obj["config"] = value
        os.environ["KVSTORE_CONFIG"] = value


# `--config` is accepted after the subcommand too (`kvstore worker --config kv.yaml`).
config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False),
    default=None,
    expose_value=False,
    is_eager=True,
    callback=_set_config,
    help="YAML config file (sections master:, worker:); same as kvstore --config.",
)


@main.command()
def version() -> None:
    """Print the version."""
    click.echo(f"kvstore {__version__}")


@main.command()
@click.option("--host", default=None, help="Bind address [127.0.0.1].")
@click.option("--port", type=int, default=None, help="gRPC port; 0 picks a free one [7700].")
@click.option(
    "--beat-port",
    default=None,
    help="UDP port for datagram beats; 0 picks a free one, off turns them off "
    "[the number of the gRPC port].",
)
@click.option("--worker-ttl", default=None, help="Drop a worker silent this long [10s].")
@click.option("--metrics-port", type=int, default=None, help="Prometheus port; 0 = off.")
@click.option("--etcd", default=None, help="etcd endpoints for HA masters.")
@click.option("--etcd-ca", default=None, help="PEM CA for https:// etcd endpoints.")
@click.option("--etcd-cert", default=None, help="PEM client certificate for etcd.")
@click.option("--etcd-key", default=None, help="PEM key of --etcd-cert.")
@click.option("--lease-ttl", default=None, help="etcd leader lease; bounds failover [5s].")
@click.option("--advertise-host", default=None, help="Address other masters forward to.")
@click.option("--cluster-id", default=None, help="Cluster name (etcd key prefix) [kvstore].")
@click.option(
    "--replicas", type=int, default=None, help="Copies of each block on distinct workers, 1-8 [1]."
)
@click.option(
    "--vnodes-per-gib",
    type=int,
    default=None,
    help="Hash-ring points per GiB of a worker's capacity (at least 160 a worker) [16].",
)
@click.option(
    "--namespace-replicas",
    multiple=True,
    help="PREFIX=R: copies for namespaces starting with PREFIX (longest wins); repeatable.",
)
@_security_options
@config_option
@click.pass_context
def master(ctx: click.Context, /, **flags: Any) -> None:
    """Run the master (control plane: membership and the shard map)."""
    from .master.server import serve

    cfg = _config(ctx, "master", flags)
    m = cfg.master
    try:
        check_tls_files("master", m.tls_cert, m.tls_key, m.tls_ca)
    except KVStoreError as e:
        raise ConfigError(str(e)) from e
    check_ports(m.host, [(m.port, "--port"), (m.metrics_port, "--metrics-port")])
    sys.exit(asyncio.run(serve(m)))


@main.command()
@click.option(
    "--master",
    default=None,
    help="Master host:port (comma-separated for HA); else $KVSTORE_MASTER [127.0.0.1:7700].",
)
@click.option(
    "--datagram-beats/--no-datagram-beats",
    default=None,
    help="Beat by UDP datagram when the master offers it (opt-in: see docs/SCALE.md); "
    "off: on the gRPC stream [off].",
)
@click.option("--host", default=None, help="Bind address [127.0.0.1].")
@click.option("--advertise-host", default=None, help="Address clients should use.")
@click.option("--id", "id", default=None, help="Stable worker id (ring identity).")
@click.option("--grpc-port", type=int, default=None, help="Store service port; 0 = free port.")
@click.option("--tcp-port", type=int, default=None, help="Transfer port; 0 = free port.")
@click.option(
    "--ucx-port",
    type=int,
    default=None,
    help="UCX transfer port (extra kvstore-cache[ucx]); 0 = free; -1 = off.",
)
@click.option("--metrics-port", type=int, default=None, help="Prometheus port; 0 = off.")
@click.option("--dram-size", default=None, help="DRAM arena size, e.g. 4GiB [1GiB].")
@click.option("--max-value-size", default=None, help="Largest block, also the slab [16MiB].")
@click.option(
    "--shm-dir",
    default=None,
    help="Directory of the arena's hand-over socket for same-host clients (the arena "
    "itself is an anonymous memfd, in no directory) [/dev/shm].",
)
@click.option(
    "--huge-pages",
    default=None,
    help="Back the arena with huge pages of this size (2MiB, 1GiB) reserved in the "
    "kernel (vm.nr_hugepages); 0 = regular pages [0].",
)
@click.option("--ssd-path", default=None, help="LMDB directory of the SSD tier (off if unset).")
@click.option(
    "--ssd-size",
    default=None,
    help="SSD tier size: bytes of LMDB pages its values may take (each value is rounded "
    "up to whole pages; the map file is sized 1.5x this + 1 MiB) [16GiB].",
)
@click.option("--ssd-sync/--no-ssd-sync", default=None, help="fsync every SSD commit [no].")
@click.option(
    "--share-arena/--no-share-arena",
    default=None,
    help="Hand the arena and its index to same-host clients (shm://); off: they use "
    "tcp:// like remote ones [on].",
)
@click.option(
    "--shm-inbox-size",
    default=None,
    help="Each same-host client's inbox, into which it writes the blocks it puts (the "
    "worker verifies and publishes them); 0 = none, puts go over tcp:// [64MiB].",
)
@click.option(
    "--dumpable/--no-dumpable",
    default=None,
    help="Let debuggers of the worker's user attach (py-spy, gdb); off, other processes "
    "of the user cannot read or write the worker's memory [off].",
)
@click.option(
    "--promote",
    type=click.Choice(["always", "second-hit", "never"]),
    default=None,
    help="When an SSD hit moves back to DRAM [second-hit].",
)
@click.option("--promote-window", default=None, help="Second-hit window [60s].")
@click.option("--pin", multiple=True, help="Pinned namespace, NS or NS=QUOTA (repeatable).")
@click.option("--drain-timeout", default=None, help="SIGTERM: bound on drain + demotion [30s].")
@click.option(
    "--session-budget", type=float, default=None, help="DRAM share for live sessions [0.25]."
)
@click.option(
    "--session-share",
    type=float,
    default=None,
    help="Most of DRAM + SSD one hinted session may fill; 0 = no cap [0.5].",
)
@click.option(
    "--session-order",
    type=click.Choice(["per-session", "expected", "recent"]),
    default=None,
    help="Which session gives way first when DRAM is full: the one likely back last, "
    "from its own and the seen pauses, running or paused (per-session); running "
    "ones, then paused ones expected back last (expected) or most recently paused "
    "(recent) [per-session].",
)
@click.option("--session-ttl", default=None, help="How long a paused session is kept [300s].")
@click.option("--max-sessions", type=int, default=None, help="Live sessions per tenant [4096].")
@click.option(
    "--kv-events", default=None, help="Publish KV events (vLLM format) on this ZMQ PUB endpoint."
)
@click.option("--kv-events-replay", default=None, help="ZMQ ROUTER endpoint for event replay.")
@click.option("--kv-events-topic", default=None, help="Topic prefix of KV events [kvstore/].")
@_security_options
@click.option("--token", default=None, help="Bearer token for the master (admin tenant).")
@config_option
@click.pass_context
def worker(ctx: click.Context, /, **flags: Any) -> None:
    """Run a worker (a shard server with a DRAM tier)."""
    from .worker.server import run

    cfg = _config(ctx, "worker", flags)
    w = cfg.worker
    try:
        check_worker_files(w)
        check_tls_files("worker", w.tls_cert, w.tls_key, w.tls_ca)
    except KVStoreError as e:
        raise ConfigError(str(e)) from e
    check_ports(
        w.host,
        [
            (w.grpc_port, "--grpc-port"),
            (w.tcp_port, "--tcp-port"),
            (w.ucx_port, "--ucx-port"),
            (w.metrics_port, "--metrics-port"),
        ],
    )
    sys.exit(run(w))


@main.command()
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--dram-size", default=None, help="Per worker [worker.dram_size: 1GiB].")
@click.option("--max-value-size", default=None, help="[worker.max_value_size: 16MiB].")
@click.option("--master-port", type=int, default=None, help="0 = free port [master.port: 7700].")
@click.option("--host", default=None, help="Bind address of all daemons [master.host: 127.0.0.1].")
@config_option
@click.pass_context
def up(
    ctx: click.Context,
    workers: int,
    dram_size: str | None,
    max_value_size: str | None,
    master_port: int | None,
    host: str | None,
) -> None:
    """Run a master and N workers on this host until Ctrl-C.

    A config file (--config) and KVSTORE_* variables apply to the daemons as they do
    to `kvstore master` and `kvstore worker`, flags first; worker ports and ids are
    picked per worker, since N workers share this host."""
    from .cluster import LocalCluster, StartError

    # Check what we can before starting anything.
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    cfg = _config_sections(
        ctx,
        {
            "master": {"port": master_port, "host": host},
            "worker": {"dram_size": dram_size, "max_value_size": max_value_size, "host": host},
        },
    )
    m, w = cfg.master, cfg.worker
    if w.dram_size < w.max_value_size:
        raise ConfigError(
            f"--dram-size ({format_size(w.dram_size)}) must be at least --max-value-size "
            f"({format_size(w.max_value_size)})"
        )
    if w.ssd_path and workers > 1:
        raise ConfigError(
            f"worker.ssd_path ({w.ssd_path}) would be shared by {workers} workers: run "
            "kvstore up --workers 1, or kvstore worker once per SSD directory"
        )
    host = m.host
    master_port = m.port
    check_ports(host, [(master_port, "--master-port")])
    dram_text = format_size(w.dram_size).replace(" ", "")
    cluster = LocalCluster(
        workers=workers,
        dram_size=str(w.dram_size),
        max_value_size=str(w.max_value_size),
        master_port=master_port,
        host=host,
        worker_ttl="5s",
        relay_stderr=True,
        # N workers on one host: each picks its own ports and id, whatever the file says.
        extra_worker_args=["--grpc-port", "0", "--tcp-port", "0", "--id", ""]
        + (["--ucx-port", "0"] if w.ucx_port > 0 else [])
        + (["--metrics-port", "0"] if w.metrics_port > 0 and workers > 1 else []),
    )
    # SIGINT too, as a flag: a child of a shell's background job inherits SIGINT
    # ignored, and then Python raises no KeyboardInterrupt for Ctrl-C.
    stop = procs.StopSignals((signal.SIGTERM, signal.SIGINT))
    try:
        cluster.start()
    except StartError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"kvstore cluster up: master {cluster.address}, {workers} workers of {dram_text}")
    click.echo(
        f"  export KVSTORE_MASTER={cluster.address}; kvstore status --master {cluster.address}"
    )
    click.echo("Ctrl-C stops it.")
    try:
        while not stop.wait(0.5):
            if not cluster.master or not cluster.master.alive():
                click.echo("master exited", err=True)
                break
    finally:
        cluster.stop()
        click.echo("cluster stopped")


@main.command()
@click.option("--master", envvar="KVSTORE_MASTER", default="127.0.0.1:7700", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--timeout", type=float, default=5.0, show_default=True)
@click.option("--sessions", "sessions", is_flag=True, help="Top agent sessions by blocks asked.")
@click.option("--top", type=int, default=10, show_default=True, help="Sessions to show.")
def status(master: str, as_json: bool, timeout: float, sessions: bool, top: int) -> None:
    """Show the cluster's workers, capacity, usage, keys and hit counts (with
    --sessions: the top agent sessions, merged over workers, and session counters)."""
    import grpc

    from . import admin

    addr = _master_address(master)
    try:
        map_version, workers = admin.status(addr, timeout)
    except grpc.RpcError as e:
        raise click.ClickException(f"master {addr}: {_rpc_text(e)}") from None
    if sessions:
        _print_sessions([str(w["grpc"]) for w in workers], as_json, timeout, top)
        return
    if as_json:
        click.echo(
            json.dumps({"master": addr, "map_version": map_version, "workers": workers}, indent=2)
        )
        return
    print_status(addr, map_version, workers)


def _master_address(master: str) -> str:
    """The first address of a --master list; a one-line error when malformed."""
    from kvstore_client.routing import parse_masters

    try:
        return parse_masters(master)[0]
    except KVStoreError as e:
        raise ConfigError(f"--master {master!r}: {e}") from e


@main.command()
@click.argument("worker_id")
@click.option("--master", envvar="KVSTORE_MASTER", default="127.0.0.1:7700", show_default=True)
@click.option(
    "--timeout",
    default="60s",
    show_default=True,
    help="Bound on the hand-off of the worker's blocks (at most 1h).",
)
def drain(worker_id: str, master: str, timeout: str) -> None:
    """Drain WORKER_ID for maintenance without stopping it: it leaves the map at once
    (clients route its keys to their next owners), then hands its DRAM blocks, most
    recently used first, to those owners. It keeps running, out of the map, until it is
    stopped or restarted."""
    import grpc

    from . import admin
    from .config import parse_duration

    addr = _master_address(master)
    try:
        seconds = parse_duration(timeout)
    except KVStoreError as e:
        raise ConfigError(f"--timeout {timeout!r}: {e}") from e
    if not 0 < seconds <= 3600:
        raise ConfigError(f"--timeout {timeout!r}: want more than 0s and at most 1h")
    try:
        r = admin.drain(addr, worker_id, seconds)
    except grpc.RpcError as e:
        raise click.ClickException(f"drain {worker_id}: {_rpc_text(e)}") from None
    click.echo(
        f"worker {r.worker_id} left the map (version {r.map_version}); "
        f"{r.moved_blocks} blocks ({format_size(float(r.moved_bytes))}) moved to their next "
        f"owners, {r.kept_blocks} kept, in {r.seconds:.2f}s. It keeps running out of the map "
        "until it is stopped."
    )


def _print_sessions(addrs: list[str], as_json: bool, timeout: float, top: int) -> None:
    """Ask every worker for its session table; merge a session's rows over workers."""
    import grpc

    from kvstore_client.proto import store_pb2, store_pb2_grpc
    from kvstore_client.security import Tls, metadata, open_channel

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    totals = dict.fromkeys(("live", "dropped", "expired", "retained_bytes", "prefetched"), 0)
    for a in addrs:
        try:
            with open_channel(a, Tls.from_env()) as ch:
                resp = store_pb2_grpc.StoreStub(ch).Sessions(
                    store_pb2.SessionsRequest(limit=max(1, min(top * 4, 1000))),
                    timeout=timeout,
                    metadata=metadata(os.environ.get("KVSTORE_TOKEN")),
                )
        except grpc.RpcError as e:
            raise click.ClickException(f"worker {a}: {_rpc_text(e)}") from None
        for k in totals:
            totals[k] += getattr(resp, k)
        for x in resp.sessions:
            row = rows.setdefault(
                (x.namespace, x.session_id),
                {"namespace": x.namespace, "session": x.session_id, "state": x.state,
                 "blocks": 0, "hit_blocks": 0, "lookup_blocks": 0},
            )  # fmt: skip
            for k in ("blocks", "hit_blocks", "lookup_blocks"):
                row[k] += getattr(x, k)
    best = sorted(rows.values(), key=lambda r: -r["lookup_blocks"])[: max(0, top)]
    for r in best:
        r["hit_rate"] = (
            round(r["hit_blocks"] / r["lookup_blocks"], 4) if r["lookup_blocks"] else None
        )
    if as_json:
        click.echo(json.dumps({"totals": totals, "sessions": best}, indent=2))
        return
    click.echo(
        "sessions (per-worker rows; a session spans workers): "
        + " ".join(f"{k}={v}" for k, v in totals.items())
    )
    click.echo(f"{'SESSION':<28} {'STATE':<7} {'BLOCKS':>7} {'ASKED':>8} {'HIT':>6}  NAMESPACE")
    for r in best:
        hit = f"{100 * r['hit_rate']:.1f}%" if r["hit_rate"] is not None else "-"
        click.echo(
            f"{r['session'][:28]:<28} {r['state']:<7} {r['blocks']:>7} "
            f"{r['lookup_blocks']:>8} {hit:>6}  {r['namespace']}"
        )


def _short_endpoints(grpc_addr: str, endpoints: list[str]) -> str:
    """ "tcp://h:7702 shm:///dev/shm/x ucx://h:7703" -> "tcp :7702 · shm · ucx :7703"
    when h is the gRPC host (the common case), else the full URL."""
    host = grpc_addr.rpartition(":")[0]
    out = []
    for ep in endpoints:
        scheme, _, rest = ep.partition("://")
        if scheme == "shm":
            out.append("shm")
        elif rest.rpartition(":")[0] == host:
            out.append(f"{scheme} :{rest.rpartition(':')[2]}")
        else:
            out.append(ep)
    return " · ".join(out)


def print_status(addr: str, map_version: int, workers: list[dict[str, Any]]) -> None:
    """The status table, made to fit 80 columns: long cells wrap, nothing is cut."""
    from rich import box
    from rich.table import Table

    if not workers:
        click.echo(
            f"kvstore {addr} · no workers: none has registered with this master. Start one "
            f"with `kvstore worker --master {addr}` (or `export KVSTORE_MASTER={addr}`); a "
            "worker that cannot reach the master logs `waiting for the master` and retries."
        )
        return
    used = sum(int(w["used_bytes"]) for w in workers)
    cap = sum(int(w["capacity_bytes"]) for w in workers)
    ssd_used = sum(int(w.get("ssd_used_bytes", 0)) for w in workers)
    ssd_cap = sum(int(w.get("ssd_capacity_bytes", 0)) for w in workers)
    ssd = (
        f" · SSD {format_size(float(ssd_used))} of {format_size(float(ssd_cap))}" if ssd_cap else ""
    )
    t = Table(
        title=(
            f"kvstore {addr} · {len(workers)} workers · DRAM "
            f"{format_size(float(used))} of {format_size(float(cap))} used{ssd} · "
            f"map rev {map_version % 10000:04d}"
        ),
        caption=(
            ("DRAM, SSD: used / capacity; keys: in DRAM + on SSD\n" if ssd_cap else "")
            + "map rev: changes whenever a worker joins or leaves (--json: full version)"
        ),
        box=box.SIMPLE_HEAD,
        title_justify="left",
        caption_justify="left",
    )
    t.add_column("worker", overflow="fold")
    t.add_column("address", overflow="fold")
    t.add_column(
        "DRAM used / capacity" if not ssd_cap else "DRAM", justify="right", overflow="fold"
    )
    if ssd_cap:
        t.add_column("SSD", justify="right", overflow="fold")
    t.add_column("keys", justify="right")
    t.add_column("hits / misses", justify="right", overflow="fold")
    for w in workers:
        cells = [
            str(w["id"]) + ("\n(draining)" if w.get("state") == "draining" else ""),
            f"{w['grpc']}\n{_short_endpoints(str(w['grpc']), list(w['endpoints']))}",
            f"{format_size(float(w['used_bytes']))} / {format_size(float(w['capacity_bytes']))}",
        ]
        keys = str(w["keys"])
        if ssd_cap:
            cells.append(
                f"{format_size(float(w['ssd_used_bytes']))} / "
                f"{format_size(float(w['ssd_capacity_bytes']))}"
                if w["ssd_capacity_bytes"]
                else "-"
            )
            keys = f"{w['keys']} + {w['ssd_keys']}" if w["ssd_capacity_bytes"] else keys
        t.add_row(*cells, keys, f"{w['hits']} / {w['misses']}")
    make_console().print(t)


@main.command()
@click.option("--master", envvar="KVSTORE_MASTER", default="127.0.0.1:7700", show_default=True)
@click.option("--size", default="64KiB", show_default=True)
def check(master: str, size: str) -> None:
    """Put one random block and read it back; exit 1 unless it round-trips."""
    from .config import parse_size
    from .demo import check_roundtrip

    try:
        nbytes = parse_size(size)
        if nbytes <= 0:
            raise ConfigError(f"--size must be positive, got {size}")
    except KVStoreError as e:
        raise ConfigError(f"--size: {e}") from e
    ok, msg = check_roundtrip(master, nbytes)
    if not ok:
        raise click.ClickException(msg)
    click.echo(msg)


@main.command()
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--dram-size", default="512MiB", show_default=True, help="Per worker.")
@click.option("--blocks", type=int, default=256, show_default=True)
@click.option("--block-size", default="1MiB", show_default=True)
@click.option("--master", default=None, help="Use a running cluster instead of starting one.")
def demo(workers: int, dram_size: str, blocks: int, block_size: str, master: str | None) -> None:
    """Start a local cluster, drive a short workload, print hit rate and GiB/s, stop."""
    from .config import parse_size
    from .demo import run_demo

    sys.exit(run_demo(workers, dram_size, blocks, parse_size(block_size), master))


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(prog_name="kvstore")
