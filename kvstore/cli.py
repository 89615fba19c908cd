"""The ``kvstore`` command: master, worker, up, status, check, demo, version."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import click

from kvstore_client import __version__
from kvstore_client.errors import KVStoreError

from .config import Config, format_size, load_config


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _config(ctx: click.Context, section: str, flags: dict[str, Any]) -> Config:
    try:
        return load_config(ctx.obj.get("config"), {section: flags})
    except KVStoreError as e:
        raise click.UsageError(str(e)) from e


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="KVSTORE_CONFIG",
    help="YAML config file (sections master:, worker:).",
)
@click.option("--log-level", default="info", show_default=True, envvar="KVSTORE_LOG_LEVEL")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, log_level: str) -> None:
    """kvstore: a distributed KV-cache store for LLM inference."""
    ctx.ensure_object(dict)
    ctx.obj["config"] = config_file
    os.environ["KVSTORE_LOG_LEVEL"] = log_level  # daemons this command starts log alike
    _setup_logging(log_level)


@main.command()
def version() -> None:
    """Print the version."""
    click.echo(f"kvstore {__version__}")


@main.command()
@click.option("--host", default=None, help="Bind address [127.0.0.1].")
@click.option("--port", type=int, default=None, help="gRPC port; 0 picks a free one [7700].")
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
    "--namespace-replicas",
    multiple=True,
    help="PREFIX=R: copies for namespaces starting with PREFIX (longest wins); repeatable.",
)
@_security_options
@click.pass_context
def master(ctx: click.Context, /, **flags: Any) -> None:
    """Run the master (control plane: membership and the shard map)."""
    from .master.server import serve

    cfg = _config(ctx, "master", flags)
    try:
        sys.exit(asyncio.run(serve(cfg.master)))
    except KVStoreError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--master", default=None, help="Master host:port (comma-separated for HA).")
@click.option("--host", default=None, help="Bind address [127.0.0.1].")
@click.option("--advertise-host", default=None, help="Address clients should use.")
@click.option("--id", "id", default=None, help="Stable worker id (ring identity).")
@click.option("--grpc-port", type=int, default=None, help="Store service port; 0 = free port.")
@click.option("--tcp-port", type=int, default=None, help="Transfer port; 0 = free port.")
@click.option(
    "--ucx-port",
    type=int,
    default=None,
    help="UCX transfer port (kvstore[ucx]); 0 = free; -1 = off.",
)
@click.option("--metrics-port", type=int, default=None, help="Prometheus port; 0 = off.")
@click.option("--dram-size", default=None, help="DRAM arena size, e.g. 4GiB [1GiB].")
@click.option("--max-value-size", default=None, help="Largest block, also the slab [16MiB].")
@click.option("--shm-dir", default=None, help="tmpfs for the arena [/dev/shm].")
@click.option("--ssd-path", default=None, help="LMDB directory of the SSD tier (off if unset).")
@click.option("--ssd-size", default=None, help="SSD tier size (LMDB map size) [16GiB].")
@click.option("--ssd-sync/--no-ssd-sync", default=None, help="fsync every SSD commit [no].")
@click.option(
    "--promote",
    type=click.Choice(["always", "second-hit", "never"]),
    default=None,
    help="When an SSD hit moves back to DRAM [second-hit].",
)
@click.option("--promote-window", default=None, help="Second-hit window [60s].")
@click.option("--pin", multiple=True, help="Pinned namespace, NS or NS=QUOTA (repeatable).")
@click.option("--drain-timeout", default=None, help="SIGTERM: bound on drain + demotion [30s].")
@_security_options
@click.option("--token", default=None, help="Bearer token for the master (admin tenant).")
@click.pass_context
def worker(ctx: click.Context, /, **flags: Any) -> None:
    """Run a worker (a shard server with a DRAM tier)."""
    from .worker.server import run

    cfg = _config(ctx, "worker", flags)
    try:
        sys.exit(run(cfg.worker))
    except KVStoreError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--dram-size", default="1GiB", show_default=True, help="Per worker.")
@click.option("--max-value-size", default="16MiB", show_default=True)
@click.option("--master-port", type=int, default=7700, show_default=True, help="0 = free port.")
@click.option("--host", default="127.0.0.1", show_default=True)
def up(workers: int, dram_size: str, max_value_size: str, master_port: int, host: str) -> None:
    """Run a master and N workers on this host until Ctrl-C."""
    from .cluster import LocalCluster, StartError

    cluster = LocalCluster(
        workers=workers,
        dram_size=dram_size,
        max_value_size=max_value_size,
        master_port=master_port,
        host=host,
        worker_ttl="5s",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start()
    except StartError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"kvstore cluster up: master {cluster.address}, {workers} workers of {dram_size}")
    click.echo(
        f"  export KVSTORE_MASTER={cluster.address}; kvstore status --master {cluster.address}"
    )
    click.echo("Ctrl-C stops it.")
    try:
        while not stop.wait(0.5):
            if not cluster.master or not cluster.master.alive():
                click.echo("master exited", err=True)
                break
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        click.echo("cluster stopped")


@main.command()
@click.option("--master", envvar="KVSTORE_MASTER", default="127.0.0.1:7700", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option("--timeout", type=float, default=5.0, show_default=True)
def status(master: str, as_json: bool, timeout: float) -> None:
    """Show the cluster's workers, capacity, usage, keys and hit counts."""
    import grpc

    from kvstore_client.client import parse_masters
    from kvstore_client.proto import master_pb2, master_pb2_grpc
    from kvstore_client.security import Tls, metadata, open_channel

    addr = parse_masters(master)[0]
    try:
        with open_channel(addr, Tls.from_env()) as ch:
            st = master_pb2_grpc.MasterStub(ch).ClusterStatus(
                master_pb2.ClusterStatusRequest(),
                timeout=timeout,
                metadata=metadata(os.environ.get("KVSTORE_TOKEN")),
            )
    except grpc.RpcError as e:
        raise click.ClickException(f"master {addr}: {e.code().name}: {e.details()}") from e
    workers: list[dict[str, Any]] = [
        {
            "id": w.info.id,
            "grpc": w.info.grpc,
            "endpoints": list(w.info.endpoints),
            "capacity_bytes": w.info.capacity_bytes,
            "used_bytes": w.stats.used_bytes,
            "keys": w.stats.keys,
            "hits": w.stats.hits,
            "misses": w.stats.misses,
            "evictions": w.stats.evictions,
            "last_heartbeat_age_s": round(w.last_heartbeat_age_s, 3),
        }
        for w in st.workers
    ]
    if as_json:
        click.echo(
            json.dumps(
                {"master": addr, "map_version": st.map_version, "workers": workers}, indent=2
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kvstore {addr} · map v{st.map_version} · {len(workers)} workers")
    for col in ("worker", "grpc", "endpoints", "capacity", "used", "keys", "hits", "misses"):
        t.add_column(col, justify="right" if col not in ("worker", "grpc", "endpoints") else "left")
    for w in workers:
        t.add_row(
            str(w["id"]),
            str(w["grpc"]),
            " ".join(w["endpoints"]),
            format_size(float(w["capacity_bytes"])),
            format_size(float(w["used_bytes"])),
            str(w["keys"]),
            str(w["hits"]),
            str(w["misses"]),
        )
    Console().print(t)


@main.command()
@click.option("--master", envvar="KVSTORE_MASTER", default="127.0.0.1:7700", show_default=True)
@click.option("--size", default="64KiB", show_default=True)
def check(master: str, size: str) -> None:
    """Put one random block and read it back; exit 1 unless it round-trips."""
    from .config import parse_size
    from .demo import check_roundtrip

    ok, msg = check_roundtrip(master, parse_size(size))
    click.echo(msg)
    sys.exit(0 if ok else 1)


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


def _add_bench() -> None:
    from kvstore_bench.cli import bench

    main.add_command(bench)


_add_bench()


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
