"""The systems a ``kvstore bench transfer`` run measures, as the sweep sees them.

A :class:`Target` is one system on one transport: kvstore through
``Client(transport=...)`` for each of tcp://, shm:// and ucx:// (:class:`KvTarget`), and
Mooncake Store over TCP (:class:`MooncakeTarget`). :func:`systems` starts a local cluster
(master + one worker, serving ucx:// too when it is asked for and ucxx loads) and the
peers, or uses a running cluster, and stops everything it started.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.cluster import LocalCluster
from kvstore_client import Client
from kvstore_client.errors import KVStoreError, ResourceExhausted
from kvstore_client.transport import ucx as ucx_client

from ..peers import MooncakeServer, MooncakeStoreAdapter, PeerUnavailable
from .points import Buf, Plan, Target

NS = "bench/transfer/b0/tp0of1"
TRANSPORTS = ("tcp", "shm", "ucx")


def worker_args(transports: Sequence[str], notes: list[str] | None = None) -> list[str]:
    """Extra ``kvstore worker`` flags for a local cluster that serves ``transports``:
    ``--ucx-port 0`` when ucx:// is among them and ucxx loads here (else a note says
    why it is left out, and the ucx:// client is skipped with its own note)."""
    if "ucx" not in transports:
        return []
    if ucx_client.available():
        return ["--ucx-port", "0"]
    if notes is not None:
        notes.append("ucx:// not served: ucxx does not load (pip install 'kvstore-cache[ucx]')")
    return []


class KvTarget:
    """kvstore through ``Client(transport=...)``; the cluster's pids for CPU."""

    system = store = "kvstore"

    def __init__(self, client: Client, cluster: LocalCluster | None, transport: str) -> None:
        self.client, self.cluster, self.transport = client, cluster, transport

    def pids(self) -> list[int]:
        """The local cluster's processes (none for a running cluster: --master)."""
        if self.cluster is None:
            return []
        master = [self.cluster.master] if self.cluster.master else []
        return [d.pid for d in [*master, *self.cluster.worker_procs]]

    def workers(self) -> list[str]:
        """The ids of the workers in the client's map: a batch spreads over all of them
        (a running cluster's too, whatever its size)."""
        return sorted(w.id for w in self.client.workers())

    def native(self, raw: Sequence[bytes]) -> list[Any]:
        return list(raw)

    def prepare(self, buf: Buf) -> None:
        return None

    def release(self, buf: Buf) -> None:
        return None

    def put(self, keys: list[Any], buf: Buf, n: int) -> int:
        try:
            return sum(self.client.batch_put(NS, keys, buf.views[:n]))
        except ResourceExhausted:  # counted as errors of the point
            return 0

    def get(self, keys: list[Any], buf: Buf, n: int) -> int:
        return sum(self.client.batch_get_into(NS, keys, buf.views[:n]).result())

    def exists(self, keys: list[Any]) -> int:
        return sum(self.client.batch_exists(NS, keys))

    def remove(self, keys: list[Any]) -> None:
        for i in range(0, len(keys), 8192):
            self.client.remove(NS, keys[i : i + 8192])


class MooncakeTarget:
    """Mooncake Store over TCP; this process is a client without a segment of its own."""

    system = store = "mooncake"
    transport = "tcp"

    def __init__(self, adapter: MooncakeStoreAdapter, server: MooncakeServer) -> None:
        self.adapter, self.server, self.mc = adapter, server, adapter.store

    def pids(self) -> list[int]:
        return self.server.pids

    def workers(self) -> list[str]:
        """The segment hosts mounted (Mooncake spreads a batch over them)."""
        return [f"mooncake-segment{i}" for i in range(len(self.server.hosts))]

    def native(self, raw: Sequence[bytes]) -> list[Any]:
        return [k.hex() for k in raw]

    def prepare(self, buf: Buf) -> None:
        self.adapter.register(buf.arr)

    def release(self, buf: Buf) -> None:
        self.adapter.unregister(buf.arr)

    def put(self, keys: list[Any], buf: Buf, n: int) -> int:
        return sum(r == 0 for r in self.mc.batch_put_from(keys, buf.ptrs[:n], buf.sizes[:n]))

    def get(self, keys: list[Any], buf: Buf, n: int) -> int:
        res = self.mc.batch_get_into(keys, buf.ptrs[:n], buf.sizes[:n])
        return sum(r == s for r, s in zip(res, buf.sizes, strict=False))

    def exists(self, keys: list[Any]) -> int:
        return sum(r == 1 for r in self.mc.batch_is_exist(keys))

    def remove(self, keys: list[Any]) -> None:
        for i in range(0, len(keys), 8192):
            self.mc.batch_remove(keys[i : i + 8192], True)


# ---- points ------------------------------------------------------------------------


@contextlib.contextmanager
def systems(
    plan: Plan, transports: list[str], vs: list[str], dram: str, log_dir: str | None,
    notes: list[str], master: str | None = None,
) -> Iterator[tuple[list[Target], Callable[[], None]]]:  # fmt: skip
    """Start the cluster (and peers), or use the running one at ``master``; yield the
    targets and a function that grows every system to ``plan.aggregate_workers``
    servers (not for a running cluster). Everything started stops on exit."""
    with contextlib.ExitStack() as stack:
        quiet = subprocess.DEVNULL if log_dir is None else None
        cluster: LocalCluster | None = None
        if master is None:
            cluster = stack.enter_context(
                LocalCluster(
                    workers=1,
                    dram_size=dram,
                    log_dir=log_dir,
                    stderr=quiet,
                    extra_worker_args=worker_args(transports, notes),
                )
            )
        address = master or (cluster.address if cluster else "")
        targets: list[Target] = []
        for tr in transports:
            try:
                client = stack.enter_context(Client(address, timeout=120.0, transport=tr))
            except (KVStoreError, ValueError) as e:
                notes.append(f"kvstore transport {tr!r} skipped: {e}")
                continue
            targets.append(KvTarget(client, cluster, tr))
        server: MooncakeServer | None = None
        if "mooncake" in vs:
            try:
                server = MooncakeServer(segment_size=plan.capacity, log_dir=log_dir).start()
                stack.callback(server.stop)
                adapter = stack.enter_context(MooncakeStoreAdapter(server.master_address))
                targets.append(MooncakeTarget(adapter, server))
            except PeerUnavailable as e:
                notes.append(f"mooncake skipped: {e}")

        def grow() -> None:
            n = plan.aggregate_workers
            if cluster is None:
                return
            for _ in range(n - len(cluster.worker_procs)):
                cluster.add_worker()
            cluster.wait_for_workers(n)
            deadline = time.monotonic() + 20
            for t in targets:
                while isinstance(t, KvTarget) and len(t.client.workers()) < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a client never saw the added workers")
                    time.sleep(0.05)
            while server is not None and len(server.hosts) < n:
                server.add_segment_host()

        yield targets, grow
